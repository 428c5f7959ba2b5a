r"""The non-negative quadratic program that fixes each plateau,
$\min_{m \ge 0} \tfrac12 m^\top B m - r^\top m$, solved by an active-set method
(hand-written: it runs under `jit`, and no library solver handles the exact
active set that the staircase needs)."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, Float, Int

from .._checks import check_ndim, check_shape, symmetric_psd


# ---------------------------------------------------------------------------
# The non-negative quadratic program
# ---------------------------------------------------------------------------


class NNQPSolution(eqx.Module):
    """The result of `nnqp`.

    - `m`: the minimiser, shape `(p,)` (zero outside the mask).
    - `iterations`: outer (variable-adding) iterations used.
    - `converged`: whether the KKT conditions hold to tolerance within
      `max_iter` iterations and the result is finite (false for an unbounded
      program, where some `d >= 0` has `B d = 0` and `r . d > 0`).
    """

    m: Float[Array, " p"]
    iterations: Int[Array, ""]
    converged: Bool[Array, ""]


def _passive_step(B, r, P, tol):
    """On the passive set `P`: the minimiser `z` of the program restricted to `P`
    (min-norm, through an eigendecomposition of `B_PP`), and `d`, the part of
    `r_P` in the null space of `B_PP`. When `|d| > tol` the restricted program
    is unbounded along `d` (zero curvature, slope `-|d|^2`), so `z` is not used."""
    p = r.shape[0]
    dtype = B.dtype
    PP = P[:, None] & P[None, :]
    Bp = jnp.where(PP, B, 0)
    rp = jnp.where(P, r, 0)
    evals, evecs = jnp.linalg.eigh(Bp)
    eps = jnp.finfo(dtype).eps
    null = evals <= 1e3 * p * eps * jnp.max(jnp.abs(evals)) + jnp.finfo(dtype).tiny
    coef = evecs.T @ rp
    z = evecs @ jnp.where(null, 0, coef / jnp.where(null, 1, evals))
    d = evecs @ jnp.where(null, coef, 0)
    z = jnp.where(P, z, 0)
    d = jnp.where(P, d, 0)
    return z, d, jnp.linalg.norm(d) > tol


def _kkt_tol(B, r, x):
    eps = jnp.finfo(B.dtype).eps
    p = r.shape[0]
    scale = jnp.max(jnp.abs(r)) + jnp.max(jnp.abs(B)) * jnp.max(jnp.abs(x))
    return 10 * p * eps * scale + jnp.finfo(B.dtype).tiny


@jax.jit
def nnqp_core(B, r, mask, max_iter):
    """Lawson-Hanson active-set method for `min 1/2 m^T B m - r^T m, m >= 0`,
    with zero-curvature steps for a singular (PSD) `B`: `nnqp` without its
    checks (`B` symmetric PSD `(p, p)`, `mask` bool `(p,)`, `max_iter` an int
    array), for callers that vmap it over masks (the staircase's event loop)."""
    p = r.shape[0]
    dtype = B.dtype
    index = jnp.arange(p)

    def outer_cond(state):
        x, P, it = state
        w = r - B @ x
        more = jnp.any(mask & ~P & (w > _kkt_tol(B, r, x)))
        return more & (it < max_iter) & jnp.all(jnp.isfinite(x))

    def inner_cond(s):
        x, P, done, k = s
        return ~done & (k <= 2 * p + 2)

    def inner_body(s):
        x, P, _, k = s
        tol = 100 * _kkt_tol(B, r, x)
        z, d, singular = _passive_step(B, r, P, tol)
        # the direction to move in: towards z, or along d (zero curvature)
        step = jnp.where(singular, d, z - x)
        blocking = P & jnp.where(singular, d < 0, z <= 0)
        gap = jnp.where(blocking & (-step > 0), -step, 1)
        ratio = jnp.where(blocking, jnp.where(-step > 0, x / gap, 0), jnp.inf)
        i = jnp.argmin(ratio)
        alpha = jnp.where(singular, ratio[i], jnp.minimum(ratio[i], 1))
        unbounded = singular & ~jnp.any(blocking)
        done = unbounded | (~singular & ~jnp.any(blocking))
        x_new = jnp.where(done & ~unbounded, z, x + alpha * step)
        hit = jnp.any(blocking) & ~done
        P_new = P & ((x_new > 0) | done) & ~(hit & (index == i))
        x_new = jnp.where(P_new, x_new, 0)
        x_new = jnp.where(unbounded, jnp.nan, x_new)
        return x_new, P_new, done, k + 1

    def outer_body(state):
        x, P, it = state
        w = r - B @ x
        j = jnp.argmax(jnp.where(mask & ~P, w, -jnp.inf))
        P = P.at[j].set(True)
        x, P, _, _ = jax.lax.while_loop(
            inner_cond, inner_body, (x, P, jnp.asarray(False), jnp.asarray(0))
        )
        return x, P, it + 1

    x0 = jnp.zeros(p, dtype)
    P0 = jnp.zeros(p, bool)
    x, P, it = jax.lax.while_loop(outer_cond, outer_body, (x0, P0, jnp.asarray(0)))
    w = r - B @ x
    kkt = ~jnp.any(mask & ~P & (w > _kkt_tol(B, r, x)))
    ok = kkt & jnp.all(jnp.isfinite(x)) & jnp.all(x >= 0)
    return NNQPSolution(m=x, iterations=it, converged=ok)


def nnqp(
    B: Float[ArrayLike, "p p"],
    r: Float[ArrayLike, " p"],
    mask: Bool[ArrayLike, " p"] | None = None,
    *,
    max_iter: int | None = None,
) -> NNQPSolution:
    r"""Solve the non-negative quadratic program of a plateau (see the
    documentation's theory pages):

    $$\min_{m \ge 0,\ m_i = 0\ (i \notin \text{mask})}
      \tfrac12 m^\top B m - r^\top m .$$

    For symmetric PSD `B` this is the stable (saturated) equilibrium of the
    Lotka-Volterra system restricted to `mask`: the KKT conditions
    `(r - B m)_k = 0` where `m_k > 0` and `(r - B m)_k <= 0` where `m_k = 0` say
    that the modes held are at rest and no other mode can invade.

    **Algorithm.** The Lawson-Hanson active-set method (Lawson & Hanson, *Solving
    Least Squares Problems*, 1974, ch. 23), written for the quadratic program: it
    touches only `B = A^T A` and `r = A^T b`, never `A`. Start from `m = 0` with an
    empty passive (free) set; repeatedly free the variable with the largest
    negative gradient `(r - B m)_j > 0`, solve the equality-constrained problem
    `B_PP z_P = r_P` on the passive set, and if some `z_i <= 0` step from `m`
    towards `z` until the first variable hits zero, drop it from the passive set
    and re-solve. It stops when the KKT conditions hold to a tolerance of
    `10 p eps (|r| + |B| |m|)`. In exact arithmetic the passive block `B_PP` stays
    nonsingular for PSD `B` (a dependent direction has zero gradient and is never
    freed), and the number of steps is finite; it is typically `~ p`. Fixed
    shapes (`jax.lax.while_loop` with masked solves), so it works under `jit` and
    `vmap`; one compilation per `(p, dtype)`.

    **Arguments:**

    - `B`: symmetric PSD matrix, shape `(p, p)`.
    - `r`: linear term, shape `(p,)`.
    - `mask`: which variables may be nonzero, shape `(p,)` (default all).
    - `max_iter`: cap on outer iterations (default `3 p + 10`); reaching it sets
      `converged = False`.

    **Returns:** an `NNQPSolution` (`m`, `iterations`, `converged`).

    **Raises:** `ValueError` for shapes, or for a non-symmetric or non-PSD `B`
    (through `eqx.error_if` under `jit`).
    """
    B = jnp.asarray(B)
    r = jnp.asarray(r)
    check_ndim("r", r, 1, "a vector")
    p = r.shape[0]
    check_shape("B", B, (p, p))
    dtype = jnp.result_type(B, r, float)
    B = symmetric_psd("B", B.astype(dtype))
    r = r.astype(dtype)
    if mask is None:
        mask = jnp.ones(p, bool)
    mask = jnp.asarray(mask)
    check_shape("mask", mask, (p,))
    if mask.dtype != jnp.bool_:
        raise ValueError(f"`mask` must be boolean, got dtype {mask.dtype}.")
    max_iter = 3 * p + 10 if max_iter is None else int(max_iter)
    return nnqp_core(0.5 * (B + B.T), r, mask, jnp.asarray(max_iter))
