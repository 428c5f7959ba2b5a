r"""The inverse problem: the power-law Lotka-Volterra model
($\lambda_k = k^{-\alpha}$, $m^*_k = k^{-\beta}$, init scale, time scale) whose
loss curve matches a measured one, found by least squares through the solver
(`fit_spectrum`), and the exponent the theory then predicts.

**Modes beyond `p`.** The first `p` modes are computed one by one; the modes
`p < k <= n_modes` enter as a continuum with sharp switch-ons,
$\tfrac12 \int_{\max(p + 1/2,\,k_t)}^{N + 1/2} k^{-(\alpha + 2\beta)} dk$ with
$k_t$ the mode jumping at time $t$ (the sharp-switch sum, with the jump time
$(\ln(m^*_k/\epsilon) - 1)/r_k$, one $1/r_k$ before the switch-on time, that
makes the loss exact to first order in the logistic's width). Without it a
model shorter than the curve's spectrum cannot match the curve (it lacks the
other modes' unlearned loss from the start, and its loss drops to zero once
its `p` modes are learned), and the
exponents come out wrong: on a 2000-mode curve (`alpha = 1, beta = 0.5`,
`eps = 1e-16`, to `t = 1e6`-`2e6`) `p = 200` alone gave `alpha` = 1.9-2.6 and
`beta` = 0.04-0.23. With the tail, `p = 200` reproduced that curve to 1% in
`log L` at the true parameters, and the fit recovered both exponents to 0.03%
(`p = 50`: likewise). The modes are merged (the continuum is accurate) beyond
$k \approx (\alpha + \beta) \ln(1/\epsilon)$, a few tens, so `p` of 50-200
suffices for any `n_modes`. `n_modes=float("inf")` models an unbounded spectrum
(for `alpha + 2 beta > 1`; the loss is infinite otherwise). `n_modes` must be
known: the spectrum's cutoff shows in the curve (the loss falls faster once the
front nears it), and a wrong one biases the exponents.

**Derivatives.** `method="solve_lv"` integrates every mode with `solve_lv`
(vmapped over modes; they are independent) and differentiates with
`diffrax.ForwardMode`: five parameters and a curve of `T` points make forward
mode the right choice (the `T x 5` Jacobian that Gauss-Newton and the error
bars need costs five tangent solves, where reverse mode would need `T` backward
passes).

**Error bars.** The Laplace standard errors are meaningful for noisy data, and
a measure of misfit only for a deterministic curve."""

import warnings
from typing import Literal

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Float

from .._checks import eager_only
from .._curves import first_crossing
from ..engines.lv import lv_stepsize_controller, solve_lv
from ..tasks.interactions import DiagonalInteractions
from ..tasks.lotka_volterra import LotkaVolterra
from ..theory.power_law import power_law_exponent
from ._least_squares import (
    host_curve,
    laplace_cov,
    log_noise,
    nothing_to_fit,
    robust_least_squares,
)


# --------------------------------------------------------------------------------
# spectra: the inverse problem through solve_lv

#: How the model's modes are computed: `"logistic"`, the closed form of an
#: isolated mode (exact for these independent modes, fast), or `"solve_lv"`,
#: each mode integrated by `solve_lv` (the same model, slower).
SPECTRUM_METHODS = ("logistic", "solve_lv")

#: The one default of `fit_spectrum`, `analyse_curve`, `fit_curve_file` and
#: `nqfjax fit --spectrum-method`.
DEFAULT_SPECTRUM_METHOD = "logistic"


class SpectrumFit(eqx.Module):
    r"""The result of `fit_spectrum`: the power-law LV model of independent modes

    $$\lambda_k = k^{-\alpha},\quad m^*_k = k^{-\beta},\quad
    r_k = \rho\,\lambda_k m^*_k,\quad B_{kk} = \rho\,\lambda_k,\quad
    m_k(0) = \epsilon,\quad
    L(t) = A \sum_{k=1}^{N} \tfrac12 \lambda_k \big(m^*_k - m_k(t)\big)^2$$

    whose loss curve matches the data (see the documentation's theory pages):
    the first `p` modes explicitly, the rest (`p < k <= N = n_modes`) as a
    continuum (see the module notes).

    **Fields:**

    - `alpha`, `beta` and their standard errors `alpha_err`, `beta_err`.
    - `eps`: the initial value of every mode, in units of `m*_1`.
    - `rate`: $\rho = r_1$, the growth rate of the first mode (per step).
    - `amplitude`: $A$, the loss scale.
    - `gamma`: the exponent the theory predicts for these spectra,
      `power_law_exponent(alpha, beta, "rich")` (NaN where it is undefined,
      `alpha + 2 beta <= 1`).
    - `p`: number of explicit modes; `method`: `"solve_lv"` or `"logistic"`.
    - `rms`: root-mean-square residual of `log L` over the fitted points.
    - `n_modes`: total number of modes `N` (an int `>= p`, or `inf`); `None`
      (the default) means `p`, no tail.
    - `found`: whether the curve is described by a spectrum; if not, `reason`
      says why (nothing to fit: the parameters are NaN; a refused fit: `beta <
      0` or a misfit far above the noise, the fitted numbers kept).
    """

    alpha: Float[Array, ""]
    beta: Float[Array, ""]
    alpha_err: Float[Array, ""]
    beta_err: Float[Array, ""]
    eps: Float[Array, ""]
    rate: Float[Array, ""]
    amplitude: Float[Array, ""]
    gamma: float = eqx.field(static=True)
    rms: Float[Array, ""]
    p: int = eqx.field(static=True)
    method: str = eqx.field(static=True)
    n_modes: int | float | None = eqx.field(static=True, default=None)
    found: bool = eqx.field(static=True, default=True)
    reason: str = eqx.field(static=True, default="")

    @property
    def theta(self) -> Float[Array, " 5"]:
        """The fitted parameters `(alpha, beta, log eps, log rate, log amplitude)`."""
        return jnp.stack(
            [
                self.alpha,
                self.beta,
                jnp.log(self.eps),
                jnp.log(self.rate),
                jnp.log(self.amplitude),
            ]
        )

    def loss(self, ts: Float[ArrayLike, " T"]) -> Float[Array, " T"]:
        """The fitted model's loss curve at times `ts` (same `method`)."""
        ts = jnp.asarray(ts, self.alpha.dtype)
        n_modes = self.p if self.n_modes is None else self.n_modes
        log_loss = eqx.filter_jit(spectrum_log_loss)(
            self.theta, ts, self.p, self.method, None, n_modes
        )
        return jnp.exp(log_loss)


def _spectrum_modes(theta, p: int):
    k = jnp.arange(1, p + 1, dtype=theta.dtype)
    alpha, beta, log_eps, log_rate = theta[0], theta[1], theta[2], theta[3]
    lam, mstar = k**-alpha, k**-beta
    rate = jnp.exp(log_rate)
    return lam, mstar, rate * lam * mstar, rate * lam, jnp.exp(log_eps)


def _log_logistic_gap(log_mstar, log_eps, r, ts):
    r"""`log |m*_k - m_k(t)|`, shape `(p, T)`, of isolated logistic modes
    (see the documentation's theory pages) from `m_k(0) = eps`, in log space:
    $m^* - m = m^* c e^{-rt} / (1 + c e^{-rt})$ with $c = m^*/\epsilon - 1$, so
    that a learned mode's gap never underflows to zero (its log stays finite
    however small it is)."""
    tiny = jnp.finfo(r.dtype).tiny
    # log|c| from d = log(m*/eps) without forming e^d (no overflow at tiny eps)
    d = log_mstar - log_eps
    ad = jnp.maximum(jnp.abs(d), tiny)
    log_abs_c = jnp.maximum(d, 0.0) + jnp.log(-jnp.expm1(-ad))
    log_c = log_abs_c[:, None] - r[:, None] * ts[None, :]
    # log|1 + sign(c) e^{log_c}|: softplus for c > 0; for c < 0, |c| < 1 and
    # log_c < 0, so log1p(-e^{log_c}) is finite.
    grows = (d > 0)[:, None]
    log_den = jnp.where(
        grows,
        jnp.logaddexp(0.0, log_c),
        jnp.log(-jnp.expm1(jnp.minimum(log_c, -tiny))),
    )
    return log_mstar[:, None] + log_c - log_den


def _log_expm1_ratio(z):
    r"""$\log\big((1 - e^{-z})/z\big)$ for any real `z`, stably (`-z/2` near 0)."""
    small = jnp.abs(z) < 1e-6
    az = jnp.where(small, 1.0, jnp.abs(z))
    big = jnp.log(-jnp.expm1(-az)) - jnp.log(az) + jnp.maximum(-z, 0.0)
    return jnp.where(small, -0.5 * z, big)


def _log_tail(theta, ts, p: int, n_modes):
    r"""`log` of the unlearned loss of the modes `p < k <= n_modes`, shape `(T,)`,
    as a continuum with sharp switch-ons (the sharp-switch sum):

    $$L_{tail}(t) = \tfrac12 \int_{\max(p + 1/2,\ k_t)}^{N + 1/2} k^{-s}\,dk,
    \qquad s = \alpha + 2\beta,$$

    the midpoint (Euler-Maclaurin) approximation of $\sum_{k=p+1}^{N}$, exact
    to $O(s^2 / p^2)$ relative. Mode `k` jumps at
    $t_k = (\ln(m^*_k/\epsilon) - 1)/r_k$ (one $1/r_k$ before its switch-on
    time, the half-way point): the logistic's squared gap
    $\sigma(z)^2$, $z = \ln(m^*/\epsilon) - r t$, carries one unit of $z$ less
    than a sharp step at $z = 0$ ($\int (\sigma^2 - H)\,dz = -1$), so the
    shift by 1 makes the sharp sum exact to first order in the switch-on width.
    The front $k_t$ (where $t_k = t$) solves
    $(\ln(1/\epsilon) - 1 - \beta \ln k)\,k^{\alpha+\beta} = \rho t$, found by
    fixed-point iteration on $\ln k$ (a contraction by
    $\beta / ((\alpha + \beta)\ln(m^*_k / \epsilon))$, ~0.01 in practice).
    Measured against a 2000-mode `solve_lv` curve (`alpha = 1, beta = 0.5`,
    `eps = 1e-16`, to `t = 2e6`) with `p = 200`: the log loss is within 1% at all
    times (largest where the front crosses `p`; RMS 0.06%); without the shift,
    9%. (`jax.scipy.special.zeta` does differentiate in `s`, but gives only the
    `t = 0` value of an unbounded tail.)"""
    alpha, beta, log_eps, log_rate = theta[0], theta[1], theta[2], theta[3]
    dtype = theta.dtype
    s = alpha + 2 * beta
    ab = jnp.maximum(alpha + beta, 1e-3)  # growth exponent of t_k; > 0 in practice
    big = 0.5 * float(np.log(np.finfo(np.dtype(dtype)).max))
    log_rt = log_rate + jnp.log(jnp.maximum(ts, jnp.finfo(dtype).tiny))
    L0 = -log_eps - 1.0
    floor = 1e-3  # modes with ln(m*/eps) - 1 below this switch on at once

    def front(x, _):
        return (log_rt - jnp.log(jnp.maximum(L0 - beta * x, floor))) / ab, None

    x0 = (log_rt - jnp.log(jnp.maximum(L0, floor))) / ab
    x, _ = jax.lax.scan(front, x0, None, length=8)
    x = jnp.clip(x, -big, big)
    lo = jnp.maximum(float(np.log(p + 0.5)), x)
    if np.isinf(n_modes):
        # int_lo^inf k^-s dk = e^{(1-s) lo} / (s - 1), finite only for s > 1
        sm1 = s - 1
        finite_sum = sm1 > 0
        log_int = (1 - s) * lo - jnp.log(jnp.where(finite_sum, sm1, 1.0))
        log_int = jnp.where(finite_sum, log_int, jnp.inf)
    else:
        hi = float(np.log(n_modes + 0.5))
        width = jnp.maximum(hi - lo, 0.0)
        # e^{(1-s) lo} (1 - e^{-(s-1) w}) / (s - 1) = e^{(1-s) lo} w h((s-1) w);
        # exactly zero (log = -inf) once the front has passed the last mode, so
        # that it does not mask the explicit modes' loss.
        log_int = (
            (1 - s) * lo
            + jnp.log(jnp.maximum(width, jnp.finfo(dtype).tiny))
            + _log_expm1_ratio((s - 1) * width)
        )
        log_int = jnp.where(width > 0, log_int, -jnp.inf)
    return float(np.log(0.5)) + log_int


def spectrum_log_loss(theta, ts, p: int, method: str, solve_options, n_modes):
    r"""`log L(ts)` of the power-law LV model at `theta = (alpha, beta, log eps,
    log rate, log A)`: `p` explicit modes plus, if `n_modes > p`, the continuum
    tail of `_log_tail`.

    `"solve_lv"`: one single-mode `solve_lv` per mode, vmapped (the modes are
    independent, so this is the same solution as one `p`-dimensional solve, but
    every mode resolves its own time scale). Derivatives go through
    `diffrax.ForwardMode` (for `jax.jacfwd`/`jax.jvp`): five parameters against
    a curve of `T` points. The loss is floored at the smallest normal float
    (a curve of learned modes can round to zero). `"logistic"`: the closed form
    of each isolated mode, summed in log space
    (log-sum-exp), so it never underflows to `log 0 = -inf`."""
    lam, mstar, r, b, eps = _spectrum_modes(theta, p)
    if method == "logistic":
        log_gap = _log_logistic_gap(jnp.log(mstar), theta[2], r, ts)
        log_terms = jnp.log(0.5 * lam)[:, None] + 2 * log_gap
        log_loss = jax.scipy.special.logsumexp(log_terms, axis=0)
    else:
        options = dict(solve_options or {})

        def one(r_k, b_k):
            lv = LotkaVolterra(r_k[None], DiagonalInteractions(b_k[None]))
            return solve_lv(lv, eps[None], ts, **options).ys[:, 0]

        m = jax.vmap(one)(r, b)  # (p, T)
        gap = mstar[:, None] - m
        loss = 0.5 * jnp.sum(lam[:, None] * gap**2, axis=0)
        log_loss = jnp.log(jnp.maximum(loss, jnp.finfo(loss.dtype).tiny))
    if n_modes > p:
        log_loss = jnp.logaddexp(log_loss, _log_tail(theta, ts, p, n_modes))
    return theta[4] + log_loss


@eqx.filter_jit
def _fit_spectrum_core(ts, y, weights, theta0, delta, lr, steps, polish, method, opts):
    """Fit from every start (`robust_least_squares`, vmapped) and keep the best; its
    Laplace covariance and RMS log-residual."""
    p = opts["p"]
    n_modes = opts["n_modes"]
    solve_options = opts["solve"]

    def residual(theta):
        return spectrum_log_loss(theta, ts, p, method, solve_options, n_modes) - y

    fits = jax.vmap(
        lambda th: robust_least_squares(residual, weights, delta, th, steps, polish, lr)
    )(theta0)
    best = jax.tree.map(lambda x: x[jnp.argmin(fits.value)], fits)
    rms = jnp.sqrt(jnp.sum(weights * best.res**2) / jnp.sum(weights))
    return best.theta, laplace_cov(best, weights), rms, fits.value


def check_n_modes(n_modes, p: int) -> int | float:
    """`n_modes` as an int `>= p` or `inf` (`None` means `p`)."""
    if n_modes is None:
        return p
    if isinstance(n_modes, bool) or not isinstance(
        n_modes, (int, np.integer, float, np.floating)
    ):
        raise ValueError(f"`n_modes` must be an int >= p or inf, got {n_modes!r}.")
    if np.isinf(n_modes) and n_modes > 0:
        return float("inf")
    if np.isnan(n_modes) or n_modes != int(n_modes) or n_modes < p:
        raise ValueError(
            f"`n_modes` must be an int >= p = {p} or inf, got {n_modes!r}."
        )
    return int(n_modes)


def spectrum_starts(t, y, use, p: int, n_modes) -> np.ndarray:
    """A grid of 8 starts over `(alpha, beta, eps)`, shape `(8, 5)`: the amplitude
    `A` from the initial loss, the rate from the first drop (where the loss
    falls below 3/4 of its start): `rho t_1 ~ ln(1/eps)`."""
    y0 = y[use][0]
    t_drop = first_crossing(t, np.where(use, y, np.inf), 0.75 * y0, interpolate="step")
    t_drop = t[-1] if np.isnan(t_drop) else t_drop
    t_drop = max(t_drop, t[t > 0][0] if np.any(t > 0) else 1.0)
    k = np.arange(1, p + 1)
    rows = []
    for a0 in (0.8, 1.6):
        for b0 in (0.4, 1.0):
            s0 = a0 + 2 * b0
            total = 0.5 * np.sum(k**-s0)
            if n_modes > p:  # the tail, as in `_log_tail` at t = 0
                total += (
                    0.5
                    * ((p + 0.5) ** (1 - s0) - (n_modes + 0.5) ** (1 - s0))
                    / (s0 - 1)
                )
            for log_eps in (np.log(1e-4), np.log(1e-10)):
                rate = np.log(-log_eps / t_drop)
                rows.append([a0, b0, log_eps, rate, np.log(y0 / total)])
    return np.array(rows)


def _solve_options(solver, stepsize_controller, max_steps, rtol, atol) -> dict:
    """`solve_lv`'s options for every mode: the controller (default
    `lv_stepsize_controller(1e-6, rtol=1e-6)`; the deprecated `rtol`/`atol` are
    mapped to it, a missing one 1e-6 as before), forward-mode derivatives and
    `throw=False` (a failed trial solve is a rejected step, never a result)."""
    if rtol is not None or atol is not None:
        warnings.warn(
            "The `rtol`/`atol` keywords of fit_spectrum are deprecated: pass "
            "`stepsize_controller=nqfjax.lv_stepsize_controller(atol=..., "
            "rtol=...)`.",
            DeprecationWarning,
            stacklevel=3,
        )
        if stepsize_controller is not None:
            raise ValueError(
                "Give the tolerances either as `rtol`/`atol` or inside "
                "`stepsize_controller`, not both."
            )
    if stepsize_controller is None:
        stepsize_controller = lv_stepsize_controller(
            1e-6 if atol is None else atol, rtol=1e-6 if rtol is None else rtol
        )
    return dict(
        solver=solver,
        stepsize_controller=stepsize_controller,
        max_steps=max_steps,
        throw=False,
        adjoint=diffrax.ForwardMode(),
    )


def _refusal(beta: float, rms: float, noise: float) -> str:
    """Why a converged fit is not a spectrum ("" if it is one): `beta < 0`
    (targets growing with `k`), or a misfit far above the noise, an rms of
    `log L` above `max(3 noise, 0.1)` (the model does not describe the curve)."""
    if beta < 0:
        return (
            f"beta = {beta:.3g} < 0: the fitted targets grow with k, not a "
            "power-law spectrum"
        )
    if rms > max(3 * noise, 0.1):
        return (
            f"the model misses the curve: rms of log L {rms:.3g} against a noise "
            f"of {noise:.3g}"
        )
    return ""


def _not_found(p, method, n_modes, reason, dtype) -> "SpectrumFit":
    nan = jnp.asarray(jnp.nan, dtype)
    return SpectrumFit(
        alpha=nan,
        beta=nan,
        alpha_err=nan,
        beta_err=nan,
        eps=nan,
        rate=nan,
        amplitude=nan,
        gamma=float("nan"),
        rms=nan,
        p=p,
        method=method,
        n_modes=n_modes,
        found=False,
        reason=reason,
    )


def fit_spectrum(
    ts: Float[ArrayLike, " T"],
    loss: Float[ArrayLike, " T"],
    *,
    p: int,
    n_modes: int | float | None = None,
    method: Literal["logistic", "solve_lv"] = DEFAULT_SPECTRUM_METHOD,
    starts: Float[ArrayLike, "S 5"] | None = None,
    steps: int = 50,
    polish: int = 30,
    learning_rate: float = 0.03,
    huber_delta: float = 0.1,
    rel_floor: float = 1e-6,
    solver: diffrax.AbstractSolver | None = None,
    stepsize_controller: diffrax.AbstractStepSizeController | None = None,
    max_steps: int = 4096,
    rtol: float | None = None,
    atol: float | None = None,
) -> SpectrumFit:
    r"""Recover the power-law spectra `(alpha, beta)`, the init scale and the time
    scale of a loss curve, by gradient descent through `solve_lv`.

    The model is `SpectrumFit`'s: $\theta = (\alpha, \beta, \ln\epsilon,
    \ln\rho, \ln A)$, the first `p` modes one by one and the modes
    `p < k <= n_modes` as a continuum with sharp switch-ons (see the module
    notes on why the tail matters and how accurate it is). Each drop of the
    staircase fixes a height ratio ($\propto k^{-(\alpha + 2\beta)}$) and a time
    ratio ($\propto k^{\alpha+\beta}$), so both exponents are identifiable from
    a curve that resolves a few switch-ons and reaches the merged regime.

    The objective is the mean Huber loss (threshold `huber_delta`) of the
    residuals of $\log L$ over the points with `loss > rel_floor * max(loss)`.
    From each start (default: a grid of 8 over `(alpha, beta, eps)` with `rho`
    set by the time of the first drop and `A` by the initial loss) it runs
    `steps` of Adam (optax) and at most `polish` steps of
    `optimistix.LevenbergMarquardt`, vmapped over starts; the best wins. The
    standard errors are Laplace (Gauss-Newton) ones, $s^2 (J^\top J)^{-1}$.
    `method="logistic"` (the default) uses the closed form of an isolated mode;
    `"solve_lv"` integrates the same model and differentiates the solves in
    forward mode (`diffrax.ForwardMode`: five parameters against `T` residuals).
    `ts` counts steps and the model is the gradient flow: GD grows a mode by
    `1 + r` per step instead of `e^r`, which shifts `rho` slightly.

    **Nothing to fit, or no spectrum.** A curve that does not fall (all zero,
    flat within its noise, or rising) gives `found=False` and NaN parameters; a
    fit with `beta < 0`, or whose rms in `log L` is above `max(3 noise, 0.1)`
    (`noise`: the scatter of `log L` about a smooth curve), gives `found=False`
    and says why in `reason` (the fitted numbers are kept for inspection).

    Eager only: the starts, the usable points and the verdict are chosen on the
    host, in numpy; under `jax.jit`, `vmap`, `grad` or `shard_map` it raises a
    `ValueError` saying so (the fits themselves are one jit-compiled call).

    **Arguments:**

    - `ts`: times, shape `(T,)`, increasing, `>= 0`.
    - `loss`: the observed loss, shape `(T,)` (points `<= rel_floor * max` dropped).
    - `p`: number of explicit modes of the model (a few hundred at most).
    - `n_modes`: the total number of modes `N`, e.g. the number of learnable
      modes of the task: an int `>= p`, or `float("inf")`; default `p` (no tail).
    - `method`: `"logistic"` (the default, `DEFAULT_SPECTRUM_METHOD`) or
      `"solve_lv"` (`SPECTRUM_METHODS`).
    - `starts`: optional starting points, shape `(S, 5)` in `theta` coordinates.
    - `steps`, `polish`, `learning_rate`: Adam steps, Levenberg-Marquardt steps,
      Adam's peak learning rate.
    - `huber_delta`, `rel_floor`: see above.
    - `solver`, `stepsize_controller`, `max_steps`: each mode's `solve_lv`
      (defaults: `solve_lv`'s solver, `lv_stepsize_controller(1e-6, rtol=1e-6)`,
      4096 steps; always `adjoint=diffrax.ForwardMode()` and `throw=False`, so
      a failed trial solve is a rejected step, never a silent result).
    - `rtol`, `atol`: deprecated (`DeprecationWarning`): pass
      `stepsize_controller=lv_stepsize_controller(atol, rtol=rtol)`, the same
      controller (a missing one is 1e-6, as before).

    **Returns:** a `SpectrumFit`.

    **Raises:** `ValueError` for bad shapes or values, `p < 1`, `n_modes < p`,
    fewer than 8 usable points, an unknown `method` or traced arguments;
    `RuntimeError` if the model cannot be evaluated from any start (every solve
    failed).
    """
    eager_only("fit_spectrum", "the fit is set up on the host", ts=ts, loss=loss)
    t, y = host_curve(ts, loss)
    if isinstance(p, bool) or not isinstance(p, (int, np.integer)) or p < 1:
        raise ValueError(f"`p` must be a positive int, got {p!r}.")
    p = int(p)
    n_modes = check_n_modes(n_modes, p)
    if method not in SPECTRUM_METHODS:
        raise ValueError(f"`method` must be 'logistic' or 'solve_lv', got {method!r}.")
    dtype = jnp.result_type(float)
    use = y > rel_floor * np.max(y)
    if np.max(y) > 0 and use.sum() < 8:
        raise ValueError(
            f"need at least 8 points with loss > rel_floor * max(loss), got "
            f"{int(use.sum())}."
        )
    nothing = nothing_to_fit(t, y)
    if nothing:
        return _not_found(p, method, n_modes, nothing, dtype)
    starts = spectrum_starts(t, y, use, p, n_modes) if starts is None else starts
    starts = np.asarray(starts, dtype=np.float64)
    if starts.ndim != 2 or starts.shape[1] != 5 or not np.all(np.isfinite(starts)):
        raise ValueError(
            f"`starts` must be a finite array of shape (S, 5), got {starts.shape}."
        )
    opts = {
        "p": p,
        "n_modes": n_modes,
        "solve": _solve_options(solver, stepsize_controller, max_steps, rtol, atol),
    }
    ly = np.where(use, np.log(np.where(use, y, 1.0)), 0.0)
    theta, cov, rms, values = _fit_spectrum_core(
        jnp.asarray(t, dtype),
        jnp.asarray(ly, dtype),
        jnp.asarray(use, dtype),
        jnp.asarray(starts, dtype),
        huber_delta,
        learning_rate,
        int(steps),
        int(polish),
        method,
        opts,
    )
    if not np.isfinite(np.min(np.asarray(values))):
        raise RuntimeError(
            "fit_spectrum: the model could not be evaluated from any start (every "
            "solve failed; raise `max_steps` or loosen the `stepsize_controller`'s "
            "tolerances, or pass "
            "`starts`)."
        )
    alpha, beta = float(theta[0]), float(theta[1])
    try:
        gamma = power_law_exponent(alpha, beta, "rich")
    except ValueError:
        gamma = float("nan")
    reason = _refusal(beta, float(rms), log_noise(ly[use]))
    return SpectrumFit(
        alpha=theta[0],
        beta=theta[1],
        alpha_err=jnp.sqrt(cov[0, 0]),
        beta_err=jnp.sqrt(cov[1, 1]),
        eps=jnp.exp(theta[2]),
        rate=jnp.exp(theta[3]),
        amplitude=jnp.exp(theta[4]),
        gamma=gamma,
        rms=rms,
        p=p,
        method=method,
        n_modes=n_modes,
        found=not reason,
        reason=reason,
    )
