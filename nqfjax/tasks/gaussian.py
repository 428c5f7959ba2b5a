"""Tasks in closed form for Gaussian inputs: the quadratic network
(`gaussian_quadratic_task`) and the perceptron (`gaussian_perceptron_task`)."""

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Float

from .._checks import (
    check_ndim,
    check_shape,
    check_symmetric,
    finite,
    symmetric_psd,
)
from .._linalg import frobenius, sym
from .base import Task


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
        self.y2 = frobenius(M_star, self.C)

    def _K(self, X):
        S = self.covariance
        return 2.0 * S @ sym(X) @ S + S * frobenius(S, X)


def gaussian_quadratic_task(
    covariance: Float[ArrayLike, "d d"], M_star: Float[ArrayLike, "d d"]
) -> GaussianQuadraticTask:
    r"""The quadratic network $f(x) = \sum_i (u_i\cdot x)^2$ on Gaussian inputs
    $x \sim N(0, S)$ with teacher $y = x^\top M_\star x$ (docs/theory/closed-flow.md).

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
    M_star = check_symmetric("M_star", M_star.astype(dtype))
    return GaussianQuadraticTask(sym(S), sym(M_star))


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
    $y = T x$ (docs/theory/quadratic-form.md).

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
        S = sym(symmetric_psd("covariance", S.astype(dtype)))
    T = finite("teacher", T.astype(dtype))
    slope = float(slope)
    if not np.isfinite(slope) or slope == 0.0:
        raise ValueError(f"`slope` must be finite and nonzero, got {slope}.")
    return GaussianPerceptronTask(T, S, slope)
