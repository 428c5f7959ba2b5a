r"""Independent modes with power-law spectra (`power_law_task`): the task whose
Lotka-Volterra reduction gives a power law in time."""

import warnings

import jax.numpy as jnp
from jaxtyping import Array, Float

from .._checks import (
    check_shape,
    error_if,
    finite,
    is_concrete,
    positive,
    renamed_keywords,
    static_int,
)
from .base import Task
from .interactions import DiagonalInteractions
from .lotka_volterra import LotkaVolterra


# --------------------------------------------------------------------------------
# Power-law task of independent modes


class PowerLawTask(Task):
    r"""Independent modes with power-law spectra (docs/theory/power-laws.md):

    $$K[X] = \mathrm{diag}(\lambda \odot \mathrm{diag}\,X), \qquad
    C = \mathrm{diag}(\lambda \odot m^\star), \qquad
    y2 = \textstyle\sum_k \lambda_k {m^\star_k}^2,$$

    $\lambda_k = k^{-\alpha}$, $m^\star_k = k^{-\beta}$, so the loss vanishes at
    $M = \mathrm{diag}(m^\star)$ and an unlearned mode costs
    $\lambda_k {m^\star_k}^2 / 2$. Only the vectors are stored; `C` is formed on
    access. For many modes use `lotka_volterra()` directly instead of
    `lv_reduce` (which returns a dense `p x p` basis).

    Build with `power_law_task`.
    """

    lam: Float[Array, " p"]
    mstar: Float[Array, " p"]

    @property
    def C(self) -> Float[Array, "p p"]:
        return jnp.diag(self.lam * self.mstar)

    @property
    def y2(self) -> Float[Array, ""]:
        return jnp.sum(self.lam * self.mstar**2)

    @property
    def p(self) -> int:
        return self.lam.shape[0]

    @property
    def dtype(self):
        return self.lam.dtype

    def _K(self, X):
        return jnp.diag(self.lam * jnp.diag(X))

    @renamed_keywords(eta="learning_rate")
    def lotka_volterra(self, learning_rate=None, weight_decay=None):
        r"""The exact Lotka-Volterra reduction in the standard basis, in flow time
        (as `lv_reduce(task)`): $r_k = 4\lambda_k m^\star_k$,
        $B = 4\,\mathrm{diag}(\lambda)$, no decay, with `loss` equal to the
        task's loss; the learning rate and the weight decay are `solve_lv`'s.
        Works under `jit`/`grad` (unlike `lv_reduce`, which runs eagerly).

        `learning_rate`, `weight_decay` (and `eta=`) are deprecated
        (`DeprecationWarning`): the system built at them, rates times $\eta$
        and `decay = 2 eta weight_decay`, as in earlier releases."""
        if learning_rate is not None or weight_decay is not None:
            warnings.warn(
                "PowerLawTask.lotka_volterra(learning_rate, weight_decay) is "
                "deprecated: lotka_volterra() returns the system in flow time; pass "
                "the learning rate and the weight decay to solve_lv(lv, m0, ts, "
                "learning_rate, weight_decay).",
                DeprecationWarning,
                stacklevel=4,  # past renamed_keywords' and equinox's method wrappers
            )
        return self._system(
            1.0 if learning_rate is None else learning_rate,
            0.0 if weight_decay is None else weight_decay,
        )

    def _system(self, learning_rate, weight_decay):
        eta = positive("learning_rate", jnp.asarray(learning_rate, self.dtype))
        return LotkaVolterra(
            4.0 * eta * self.lam * self.mstar,
            DiagonalInteractions(4.0 * eta * self.lam),
            decay=2.0 * eta * jnp.asarray(weight_decay, self.dtype),
            loss_scale=1.0 / (4.0 * eta),
            loss_offset=0.5 * self.y2,
        )

    def known_reduction(self, eta=1.0, weight_decay=0.0):
        """`(system, identity)`: the system of `lotka_volterra()` (at `eta` and
        `weight_decay` for `lv_reduce`'s deprecated arguments); the modes are the
        standard basis, so `lv_reduce` needs no search."""
        return self._system(eta, weight_decay), jnp.eye(self.p, dtype=self.dtype)


def power_law_task(p: int, alpha, beta, *, dtype=None) -> PowerLawTask:
    r"""Independent modes with $\lambda_k = k^{-\alpha}$ and
    $m^\star_k = k^{-\beta}$, `k = 1..p` (see the documentation's theory pages).

    $K[X] = \mathrm{diag}(\lambda\odot\mathrm{diag}X)$,
    $C = \mathrm{diag}(\lambda \odot m^\star)$,
    $y2 = \sum_k \lambda_k {m^\star_k}^2$: the reduction is exact in the
    standard basis with $r_k = 4\eta k^{-(\alpha+\beta)}$,
    $B_{kk} = 4\eta k^{-\alpha}$, and the loss falls as
    $t^{-(\alpha + 2\beta - 1)/(\alpha+\beta)}$ once the steps merge.
    `alpha` and `beta` may be traced (`jit`, `grad`, `vmap`).

    The exponents must make that power law exist, the range where
    `power_law_exponent` is defined:

    - `alpha > 0`: the spectrum of `K` decays. Otherwise the largest curvature
      $B_{kk}$ sits at the last mode and nothing has a limit as `p` grows.
    - `alpha + 2 beta > 1`: the cost of the unlearned modes,
      $\tfrac12\sum_k k^{-(\alpha+2\beta)}$, converges as `p` grows, so the
      exponent is positive and the loss decays as a power law. Otherwise the
      loss is carried by the last modes, set by the cutoff `p`, not by `t`.

    Together these give `alpha + beta > 0` as well: the rates
    $r_k \propto k^{-(\alpha+\beta)}$ decrease, so the modes switch on one
    after another.

    **Arguments:**

    - `p`: number of modes (a Python int `>= 1`).
    - `alpha`: spectral exponent of `K`, finite, `> 0`.
    - `beta`: exponent of the target amplitudes, finite, `alpha + 2 beta > 1`.
    - `dtype`: floating dtype (default: JAX's default float).

    **Returns:** a `PowerLawTask`.

    **Raises:** `ValueError` for `p` not an int `>= 1`, non-finite exponents,
    `alpha <= 0` or `alpha + 2 beta <= 1` (under `jit`/`vmap`, the same message
    from `eqx.error_if` at run time).
    """
    p = static_int("p", p, 1)
    dtype = jnp.result_type(float) if dtype is None else jnp.dtype(dtype)
    alpha = finite("alpha", jnp.asarray(alpha, dtype))
    beta = finite("beta", jnp.asarray(beta, dtype))
    check_shape("alpha", alpha, ())
    check_shape("beta", beta, ())
    alpha, beta = _check_exponents(alpha, beta)
    k = jnp.arange(1, p + 1, dtype=dtype)
    return PowerLawTask(k ** (-alpha), k ** (-beta))


_ALPHA_MSG = "`alpha` must be > 0 (the spectrum lam_k = k^-alpha of K must decay)"
_SUM_MSG = (
    "`alpha + 2 beta` must be > 1 (the cost of the unlearned modes, "
    "sum_k k^-(alpha + 2 beta) / 2, must converge for the loss to decay as a power "
    "law)"
)


def _check_exponents(alpha, beta):
    """`(alpha, beta)` after checking `alpha > 0` and `alpha + 2 beta > 1`,
    eagerly or (traced) with `eqx.error_if`."""
    if is_concrete(alpha, beta):
        a, b = float(alpha), float(beta)
        if not a > 0:
            raise ValueError(f"{_ALPHA_MSG}; got alpha = {a}.")
        if not a + 2 * b > 1:
            raise ValueError(f"{_SUM_MSG}; got alpha + 2 beta = {a + 2 * b}.")
        return alpha, beta
    alpha = error_if(alpha, ~(alpha > 0), _ALPHA_MSG + ".")
    beta = error_if(beta, ~(alpha + 2 * beta > 1), _SUM_MSG + ".")
    return alpha, beta
