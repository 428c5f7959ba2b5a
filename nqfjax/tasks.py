r"""Tasks: what the data contribute to the dynamics of `M = W W^T`.

A task is the triple $(K, C, \mathbb{E}|y|^2)$ of THEORY.md section 2,

$$C = \mathbb{E} \sum_j y_j A_j(x), \qquad
K[X] = \mathbb{E} \sum_j A_j(x)\, \mathrm{Tr}[A_j(x) X], \qquad
L(M) = \tfrac12 \langle M, K[M] \rangle - \langle C, M \rangle
+ \tfrac12 \mathbb{E}|y|^2,$$

with `K` applied matrix-free (the `p^4` tensor is never formed). Tasks come from
closed forms for Gaussian inputs (`gaussian_quadratic_task`,
`gaussian_perceptron_task`), from samples through any `Structure`
(`task_from_samples`), or from a power-law spectrum of independent modes
(`power_law_task`, THEORY.md section 5).
"""

import abc

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Float

from ._checks import (
    check_ndim,
    check_shape,
    finite,
    is_concrete,
    positive,
    symmetric_psd,
)
from .structures.base import Structure


def _inner(X, Y):
    """Frobenius inner product `<X, Y> = sum_ij X_ij Y_ij`."""
    return jnp.sum(X * Y)


def _sym(X):
    return 0.5 * (X + X.T)


def _check_symmetric(name: str, X, *, rtol: float = 1e-6):
    """Return `X`, raising unless it is a finite symmetric matrix."""
    X = finite(name, X)
    if X.ndim != 2 or X.shape[0] != X.shape[1]:
        raise ValueError(f"`{name}` must be a square matrix, got shape {X.shape}.")
    tol = rtol * jnp.max(jnp.abs(X)) + jnp.finfo(X.dtype).tiny
    err = jnp.max(jnp.abs(X - X.T))
    if is_concrete(X):
        if float(err) > float(tol):
            raise ValueError(f"`{name}` must be symmetric; max |X - X^T| = {err:.3g}.")
        return X
    return eqx.error_if(X, err > tol, f"`{name}` must be symmetric.")


class Task(eqx.Module):
    r"""What a data distribution contributes to the dynamics of `M` (THEORY.md
    section 2): the matrix-free PSD map `K`, the matrix `C` and `E|y|^2`.

    Concrete tasks provide `C`, `y2` and `_K`; `K`, `loss` and `gradient` are
    shared. `K` is linear and self-adjoint in the Frobenius inner product; it is
    meant for symmetric arguments (a non-symmetric `X` acts through its
    symmetric part for the tasks here).

    **Attributes:**

    - `p`: parameters per unit (the size of `M`).
    - `C`: $\mathbb{E}\sum_j y_j A_j(x)$, shape `(p, p)`, symmetric.
    - `y2`: $\mathbb{E}|y|^2$, a scalar.
    """

    C: eqx.AbstractVar[Float[Array, "p p"]]
    y2: eqx.AbstractVar[Float[Array, ""]]

    @abc.abstractmethod
    def _K(self, X: Float[Array, "p p"]) -> Float[Array, "p p"]: ...

    @property
    def p(self) -> int:
        """Parameters per unit: `M` is `p x p`."""
        return self.C.shape[0]

    @property
    def dtype(self):
        return self.C.dtype

    def K(self, X: Float[Array, "p p"]) -> Float[Array, "p p"]:
        r"""$K[X] = \mathbb{E}\sum_j A_j(x)\,\mathrm{Tr}[A_j(x) X]$, shape `(p, p)`.

        **Arguments:**

        - `X`: a symmetric matrix, shape `(p, p)`.

        **Raises:** `ValueError` if `X` is not `(p, p)`.
        """
        X = jnp.asarray(X)
        check_shape("X", X, (self.p, self.p))
        return self._K(X)

    def gradient(self, M: Float[Array, "p p"]) -> Float[Array, "p p"]:
        r"""$G(M) = \partial L / \partial M = K[M] - C$, shape `(p, p)`."""
        return self.K(M) - self.C

    def loss(self, M: Float[Array, "p p"]) -> Float[Array, ""]:
        r"""$L(M) = \tfrac12\langle M, K[M]\rangle - \langle C, M\rangle
        + \tfrac12 \mathbb{E}|y|^2$, the squared loss of the quadratic model
        $f_j(x) = \mathrm{Tr}[M A_j(x)]$ (a scalar).

        **Arguments:**

        - `M`: shape `(p, p)`, symmetric (usually PSD, `M = W W^T`).
        """
        M = jnp.asarray(M)
        check_shape("M", M, (self.p, self.p))
        return 0.5 * _inner(M, self._K(M)) - _inner(self.C, M) + 0.5 * self.y2


# --------------------------------------------------------------------------------
# Quadratic network with Gaussian inputs


class GaussianQuadraticTask(Task):
    r"""Quadratic network `f(x) = x^T M x` (`A(x) = x x^T`), Gaussian inputs
    $x \sim N(0, S)$ and a quadratic teacher $y = x^\top M_\star x$.

    Wick's theorem gives

    $$K[X] = 2 S X S + S\,\mathrm{Tr}[S X], \qquad C = K[M_\star], \qquad
    \mathbb{E} y^2 = \langle M_\star, K[M_\star]\rangle
    = 2\,\mathrm{Tr}[(S M_\star)^2] + \mathrm{Tr}[S M_\star]^2 .$$

    Build with `gaussian_quadratic_task`.
    """

    covariance: Float[Array, "d d"]
    M_star: Float[Array, "d d"]
    C: Float[Array, "d d"]
    y2: Float[Array, ""]

    def __init__(self, covariance, M_star):
        self.covariance = covariance
        self.M_star = M_star
        self.C = self._K(M_star)
        self.y2 = _inner(M_star, self.C)

    def _K(self, X):
        S = self.covariance
        return 2.0 * S @ _sym(X) @ S + S * _inner(S, X)


def gaussian_quadratic_task(
    covariance: Float[ArrayLike, "d d"], M_star: Float[ArrayLike, "d d"]
) -> GaussianQuadraticTask:
    r"""The quadratic network $f(x) = \sum_i (u_i\cdot x)^2$ on Gaussian inputs
    $x \sim N(0, S)$ with teacher $y = x^\top M_\star x$ (THEORY.md section 2).

    $K[X] = 2 S X S + S\,\mathrm{Tr}[S X]$, $C = K[M_\star]$ and
    $\mathbb{E}y^2 = \langle M_\star, K[M_\star]\rangle$, so the loss vanishes
    at $M = M_\star$. When `S` commutes with $M_\star$ the task reduces to a
    Lotka-Volterra system in their common eigenbasis (`lv_reduce`), with
    $B = 4\eta\,(2\,\mathrm{diag}(s^2) + s s^\top)$.

    **Arguments:**

    - `covariance`: $S$, shape `(d, d)`, symmetric positive semi-definite.
    - `M_star`: the teacher, shape `(d, d)`, symmetric (need not be PSD; the
      student, being PSD, then cannot reach zero loss).

    **Returns:** a `Task` with `p = d`.

    **Raises:** `ValueError` for a non-square, non-symmetric, non-finite or
    non-PSD `covariance`, or an `M_star` of another shape or not symmetric.
    """
    S = jnp.asarray(covariance)
    M_star = jnp.asarray(M_star)
    dtype = jnp.result_type(S, M_star, float)
    check_ndim("covariance", S, 2, "a (d, d) covariance matrix")
    d = S.shape[0]
    check_shape("covariance", S, (d, d))
    check_shape("M_star", M_star, (d, d))
    S = symmetric_psd("covariance", S.astype(dtype))
    M_star = _check_symmetric("M_star", M_star.astype(dtype))
    return GaussianQuadraticTask(_sym(S), _sym(M_star))


# --------------------------------------------------------------------------------
# Two-layer perceptron with Gaussian inputs and a linear teacher


class GaussianPerceptronTask(Task):
    r"""Two-layer perceptron (`Perceptron` layout, readout block first, `p = k + d`,
    $A_j(x) = \tfrac c2 (e_j x^\top + x e_j^\top)$), Gaussian inputs
    $x \sim N(0, S)$, linear teacher $y = T x$.

    Writing $X_{au}$ for the `(k, d)` readout-input block of a symmetric `X`,

    $$K[X]_{au} = \tfrac{c^2}{2} X_{au} S, \qquad
    C_{au} = \tfrac c2\, T S, \qquad \mathbb{E}|y|^2 = \mathrm{Tr}[T S T^\top],$$

    the other blocks of `K[X]` and `C` being zero (the lower-left block is the
    transpose). The quadratic model is $f(x) = c\, M_{au} x$ and the loss is
    $\tfrac12 \mathrm{Tr}[(c M_{au} - T) S (c M_{au} - T)^\top]$.

    Build with `gaussian_perceptron_task`.
    """

    teacher: Float[Array, "k d"]
    covariance: Float[Array, "d d"]
    slope: float = eqx.field(static=True)
    C: Float[Array, "p p"]
    y2: Float[Array, ""]

    def __init__(self, teacher, covariance, slope):
        self.teacher = teacher
        self.covariance = covariance
        self.slope = slope
        k, d = teacher.shape
        C_au = 0.5 * slope * teacher @ covariance
        dt = C_au.dtype
        self.C = jnp.block(
            [[jnp.zeros((k, k), dt), C_au], [C_au.T, jnp.zeros((d, d), dt)]]
        )
        self.y2 = jnp.sum((teacher @ covariance) * teacher)

    @property
    def k(self) -> int:
        return self.teacher.shape[0]

    @property
    def d(self) -> int:
        return self.teacher.shape[1]

    def _K(self, X):
        k = self.k
        Z = 0.5 * (X[:k, k:] + X[k:, :k].T)
        out = 0.5 * self.slope**2 * Z @ self.covariance
        return jnp.zeros_like(X).at[:k, k:].set(out).at[k:, :k].set(out.T)


def gaussian_perceptron_task(
    teacher: Float[ArrayLike, "k d"],
    covariance: Float[ArrayLike, "d d"] | None = None,
    *,
    slope: float = 1.0,
) -> GaussianPerceptronTask:
    r"""The two-layer perceptron $f(x) = \sum_i a_i \sigma(u_i \cdot x)$ with
    `k` outputs on Gaussian inputs $x \sim N(0, S)$ and the linear teacher
    $y = T x$ (THEORY.md sections 1-3).

    The layout is that of `Perceptron(d, k)`: `p = k + d`, readout block first.
    With whitened inputs (`S = I`) the task reduces to a Lotka-Volterra system
    in the basis $(a_s, \pm b_s)/\sqrt2$ from the SVD $T = \sum_s \sigma_s
    a_s b_s^\top$ (`lv_reduce` finds it): the `+` mode of each singular value
    is logistic with $r_s = 2\eta c\,\sigma_s$ and $m^\star_s = 2\sigma_s / c$.

    **Arguments:**

    - `teacher`: $T$, shape `(k, d)`.
    - `covariance`: $S$, shape `(d, d)`, symmetric PSD; `None` (default) means
      whitened inputs, `S = I`.
    - `slope`: $c = \sigma'(0)$ of the student's activation (default 1, as for
      `tanh` and the linear network).

    **Returns:** a `Task` with `p = k + d`.

    **Raises:** `ValueError` for a teacher that is not 2-D, a covariance of
    the wrong shape or not symmetric PSD, NaN, or a zero or non-finite `slope`.
    """
    T = jnp.asarray(teacher)
    check_ndim("teacher", T, 2, "a (k, d) matrix (y = teacher @ x)")
    k, d = T.shape
    if k < 1 or d < 1:
        raise ValueError(f"`teacher` must have k >= 1 and d >= 1, got {T.shape}.")
    dtype = jnp.result_type(T, float)
    if covariance is None:
        S = jnp.eye(d, dtype=dtype)
    else:
        S = jnp.asarray(covariance)
        check_shape("covariance", S, (d, d))
        dtype = jnp.result_type(dtype, S)
        S = _sym(symmetric_psd("covariance", S.astype(dtype)))
    T = finite("teacher", T.astype(dtype))
    slope = float(slope)
    if not np.isfinite(slope) or slope == 0.0:
        raise ValueError(f"`slope` must be finite and nonzero, got {slope}.")
    return GaussianPerceptronTask(T, S, slope)


# --------------------------------------------------------------------------------
# Tasks from samples


def _default_batch_size(n: int, structure: Structure) -> int:
    # Keep what one chunk of samples holds (for most structures the matrices
    # A(x_s), (b, k, p, p)) near 2^21 numbers.
    return int(max(1, min(n, 2**21 // max(1, structure._sample_size()))))


def _chunked_sum(structure, xs, aux, coef, batch_size):
    r"""$\frac1n\sum_s\sum_j c_{sj} A_j(x_s)$ with `c = coef(x_b, aux_b)` (shape
    `(b, k)`) for each chunk of `batch_size` samples (a `lax.scan` over full
    chunks, then the remainder), through the structure's `_weighted_sum`."""
    p, n, b = structure.p, xs.shape[0], batch_size
    dtype = aux.dtype

    def block(xb, ab):
        return structure._weighted_sum(xb, coef(xb, ab).astype(dtype))

    total = jnp.zeros((p, p), dtype)
    nb = n // b
    if nb > 0:
        xr = xs[: nb * b].reshape((nb, b) + xs.shape[1:])
        ar = aux[: nb * b].reshape((nb, b) + aux.shape[1:])

        def body(acc, xa):
            return acc + block(*xa), None

        total, _ = jax.lax.scan(body, total, (xr, ar))
    if n % b:
        total = total + block(xs[nb * b :], aux[nb * b :])
    return total / n


# Module-level jitted kernels: the cache is hit across calls and tasks (a closure
# rebuilt per call would recompile the scan every time when used eagerly).


@eqx.filter_jit
def _sampled_C(structure, xs, targets, batch_size):
    return _chunked_sum(structure, xs, targets, lambda xb, t: t, batch_size)


@eqx.filter_jit
def _sampled_K(structure, xs, X, batch_size):
    Xs = _sym(X).astype(xs.dtype)
    dummy = jnp.zeros((xs.shape[0], 0), xs.dtype)
    return _chunked_sum(
        structure, xs, dummy, lambda xb, _: structure._contract(xb, Xs), batch_size
    )


@eqx.filter_jit
def _offsets(structure, xs):
    W0 = jnp.zeros((structure.p, 1), xs.dtype)
    return jax.vmap(lambda x: structure.layer(W0, x))(xs).astype(xs.dtype)


class SampledTask(Task):
    r"""The empirical task of `n` samples through a `Structure`:

    $$K[X] = \frac1n \sum_s \sum_j A_j(x_s)\,\mathrm{Tr}[A_j(x_s) X], \qquad
    C = \frac1n \sum_s \sum_j \tilde y_{sj} A_j(x_s), \qquad
    y2 = \frac1n \sum_s |\tilde y_s|^2,$$

    with targets $\tilde y_s = y_s - f(x_s; 0)$ (`offsets`, the layer at zero
    weights; zero for perceptrons and quadratic networks). `K` recomputes
    `A(x_s)` in chunks of `batch_size` samples, so memory is
    `O(batch_size k p^2)` and nothing of size `p^4` or `n k p^2` is stored; for the
    perceptron, whose `A_j(x)` are sparse, the structure contracts the samples
    directly (`O(n k (k + d))` per application of `K`) without building any
    `A(x_s)`.

    `loss(M)` is the empirical squared loss of the quadratic model including its
    offset, $\frac1{2n}\sum_s |f(x_s; 0) + \mathrm{Tr}[M A(x_s)] - y_s|^2$.

    Build with `task_from_samples`.
    """

    structure: Structure
    xs: Array
    ys: Float[Array, "n k"]
    offsets: Float[Array, "n k"]
    C: Float[Array, "p p"]
    y2: Float[Array, ""]
    batch_size: int = eqx.field(static=True)

    def __init__(self, structure, xs, ys, offsets, batch_size):
        self.structure = structure
        self.xs = xs
        self.ys = ys
        self.offsets = offsets
        self.batch_size = batch_size
        targets = ys - offsets
        self.C = _sampled_C(structure, xs, targets, batch_size)
        self.y2 = jnp.mean(jnp.sum(targets**2, axis=1))

    @property
    def n(self) -> int:
        return self.xs.shape[0]

    @property
    def targets(self) -> Float[Array, "n k"]:
        """`ys - offsets`: what the quadratic form has to fit."""
        return self.ys - self.offsets

    def _K(self, X):
        return _sampled_K(self.structure, self.xs, X, self.batch_size)


def task_from_samples(
    structure: Structure,
    xs: ArrayLike,
    ys: Float[ArrayLike, "n k"],
    *,
    subtract_offset: bool = True,
    batch_size: int | None = None,
) -> SampledTask:
    r"""The empirical task of samples `(xs, ys)` through `structure`.

    $K[X] = \frac1n\sum_s\sum_j A_j(x_s)\,\mathrm{Tr}[A_j(x_s) X]$ is applied
    matrix-free (the `A(x_s)` are recomputed in chunks, never a `p^4` tensor),
    $C = \frac1n\sum_s\sum_j \tilde y_{sj} A_j(x_s)$ and
    $y2 = \frac1n \sum_s |\tilde y_s|^2$.

    The targets are $\tilde y_s = y_s - f(x_s; 0)$ when `subtract_offset` (the
    default): the layer at zero weights, `structure.layer(zeros((p, 1)), x)`,
    is a constant of the dynamics, not something the units learn (THEORY.md
    section 1; it vanishes for perceptrons and quadratic networks, not for
    softmax attention). Then `task.loss(W W^T)` equals the empirical squared
    loss $\frac1{2n}\sum_s |f(x_s;0) + \mathrm{Tr}[W W^\top A(x_s)] - y_s|^2$
    of the quadratic model, which is what `train(structure, xs, ys)` minimises.
    With `subtract_offset=False` the offset is ignored.

    As `n` grows the task converges to the population task (for Gaussian inputs,
    `gaussian_quadratic_task` / `gaussian_perceptron_task`) with errors
    `O(n^{-1/2})`.

    **Arguments:**

    - `structure`: the architecture.
    - `xs`: inputs, shape `(n, *structure.input_shape)`.
    - `ys`: targets, shape `(n, k)` (`(n,)` is accepted when `k = 1`).
    - `subtract_offset`: subtract `f(x; 0)` from `ys` (default `True`).
    - `batch_size`: samples per chunk when applying `K` (default: chunks of about
      `2^21` numbers).

    **Returns:** a `Task` with `p = structure.p`.

    **Raises:** `ValueError` for shapes that do not match the structure, `n = 0`
    or NaN in `xs` or `ys`.
    """
    if not isinstance(structure, Structure):
        raise ValueError(f"`structure` must be a Structure, got {type(structure)}.")
    xs, ys = jnp.asarray(xs), jnp.asarray(ys)
    shape = tuple(structure.input_shape)
    if xs.ndim != 1 + len(shape) or tuple(xs.shape[1:]) != shape:
        raise ValueError(
            f"`xs` must have shape (n, *input_shape) = (n, *{shape}), got {xs.shape}."
        )
    n, k = xs.shape[0], structure.k
    if n < 1:
        raise ValueError("`xs` must hold at least one sample.")
    if ys.ndim == 1 and k == 1:
        ys = ys[:, None]
    check_shape("ys", ys, (n, k))
    dtype = jnp.result_type(xs, ys, float)
    xs = finite("xs", xs.astype(dtype))
    ys = finite("ys", ys.astype(dtype))
    if subtract_offset:
        offsets = _offsets(structure, xs)
    else:
        offsets = jnp.zeros_like(ys)
    if batch_size is None:
        batch_size = _default_batch_size(n, structure)
    elif int(batch_size) < 1:
        raise ValueError(f"`batch_size` must be >= 1, got {batch_size}.")
    return SampledTask(structure, xs, ys, offsets, int(min(batch_size, n)))


# --------------------------------------------------------------------------------
# Power-law task of independent modes


class PowerLawTask(Task):
    r"""Independent modes with power-law spectra (THEORY.md section 5):

    $$K[X] = \mathrm{diag}(\lambda \odot \mathrm{diag}\,X), \qquad
    C = \mathrm{diag}(\lambda \odot m^\star), \qquad
    y2 = \textstyle\sum_k \lambda_k {m^\star_k}^2,$$

    $\lambda_k = k^{-\alpha}$, $m^\star_k = k^{-\beta}$, so the loss vanishes at
    $M = \mathrm{diag}(m^\star)$ and an unlearned mode costs
    $\lambda_k {m^\star_k}^2 / 2$. Only the vectors are stored; `C` is formed on
    access. For many modes use `lotka_volterra(eta)` directly instead of
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

    def lotka_volterra(self, eta, weight_decay=0.0):
        r"""The exact Lotka-Volterra reduction in the standard basis:
        $r_k = 4\eta\lambda_k m^\star_k$, $B = 4\eta\,\mathrm{diag}(\lambda)$,
        `decay = 2 eta weight_decay`, with `loss` equal to the task's loss.
        Works under `jit`/`grad` (unlike `lv_reduce`, which runs eagerly)."""
        from .lv import LotkaVolterra

        eta = positive("eta", jnp.asarray(eta, self.dtype))
        return LotkaVolterra(
            4.0 * eta * self.lam * self.mstar,
            decay=2.0 * eta * jnp.asarray(weight_decay, self.dtype),
            B_diag=4.0 * eta * self.lam,
            loss_scale=1.0 / (4.0 * eta),
            loss_offset=0.5 * self.y2,
        )


def power_law_task(p: int, alpha, beta, *, dtype=None) -> PowerLawTask:
    r"""Independent modes with $\lambda_k = k^{-\alpha}$ and
    $m^\star_k = k^{-\beta}$, `k = 1..p` (THEORY.md section 5).

    $K[X] = \mathrm{diag}(\lambda\odot\mathrm{diag}X)$,
    $C = \mathrm{diag}(\lambda \odot m^\star)$,
    $y2 = \sum_k \lambda_k {m^\star_k}^2$: the reduction is exact in the
    standard basis with $r_k = 4\eta k^{-(\alpha+\beta)}$,
    $B_{kk} = 4\eta k^{-\alpha}$, and the loss falls as
    $t^{-(\alpha + 2\beta - 1)/(\alpha+\beta)}$ once the steps merge.
    `alpha` and `beta` may be traced (`jit`, `grad`).

    **Arguments:**

    - `p`: number of modes (a Python int).
    - `alpha`: spectral exponent of `K`.
    - `beta`: exponent of the target amplitudes.
    - `dtype`: floating dtype (default: JAX's default float).

    **Returns:** a `PowerLawTask`.

    **Raises:** `ValueError` for `p < 1` or non-finite exponents.
    """
    if isinstance(p, bool) or not isinstance(p, int | np.integer) or p < 1:
        raise ValueError(f"`p` must be a positive int, got {p!r}.")
    dtype = jnp.result_type(float) if dtype is None else jnp.dtype(dtype)
    alpha = finite("alpha", jnp.asarray(alpha, dtype))
    beta = finite("beta", jnp.asarray(beta, dtype))
    check_shape("alpha", alpha, ())
    check_shape("beta", beta, ())
    k = jnp.arange(1, int(p) + 1, dtype=dtype)
    return PowerLawTask(k ** (-alpha), k ** (-beta))
