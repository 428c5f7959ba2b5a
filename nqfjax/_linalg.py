"""Small linear-algebra helpers shared across the package (a private module whose
names other modules import): the symmetric part `sym`, the Frobenius inner
product `frobenius`, the PSD projection `psd_project`, the PSD square root
`psd_sqrt` with a derivative that stays finite at degenerate eigenvalues, and
an LU solver differentiated implicitly."""

from __future__ import annotations

import jax
import jax.numpy as jnp


@jax.custom_jvp
def psd_sqrt(M):
    """The symmetric square root of a symmetric PSD matrix (negative eigenvalues
    from roundoff are clipped to zero)."""
    w, V = jnp.linalg.eigh(M)
    return (V * jnp.sqrt(jnp.maximum(w, 0.0))[None, :]) @ V.T


@psd_sqrt.defjvp
def _psd_sqrt_jvp(primals, tangents):
    # The Frechet derivative solves the Sylvester equation S dS + dS S = dM:
    # dS = V [ (V^T dM V)_ij / (s_i + s_j) ] V^T. Unlike differentiating `eigh`
    # it is finite for degenerate eigenvalues (only s_i = s_j = 0 is singular,
    # where the square root is not differentiable; that part is set to zero).
    (M,), (dM,) = primals, tangents
    w, V = jnp.linalg.eigh(M)
    s = jnp.sqrt(jnp.maximum(w, 0.0))
    S = (V * s[None, :]) @ V.T
    denom = s[:, None] + s[None, :]
    ok = denom > 0
    dMt = V.T @ (0.5 * (dM + dM.T)) @ V
    dS = V @ jnp.where(ok, dMt / jnp.where(ok, denom, 1.0), 0.0) @ V.T
    return S, dS


# --------------------------------------------------------------------------------
# Small helpers


def sym(X):
    return 0.5 * (X + X.T)


def frobenius(X, Y):
    return jnp.sum(X * Y)


def psd_project(X):
    """The nearest PSD matrix in Frobenius norm: clip the eigenvalues at zero."""
    w, V = jnp.linalg.eigh(sym(X))
    return (V * jnp.maximum(w, 0.0)[None, :]) @ V.T


def lu_solver(A):
    """`b -> A^{-1} b` with one LU factorisation of `A` (shape `(n, n)`), shared
    by every stage of a step. `jax.lax.custom_linear_solve` differentiates the
    solve implicitly (`dx = A^{-1}(db - dA x)`, transposed with the same factors)
    instead of differentiating `lu_factor`, whose JVP cost ~35x the solve
    (benchmarks/README.md, `gradients.py`). Not `lineax.linear_solve`, which does
    the same but refuses every vector inside `shard_map` (it compares the
    vector's sharding with the operator's structure, which has none), where a
    sweep over devices runs this solver. A singular `A` gives NaN, which the
    step-size controller rejects, as it does any failed step."""
    factors = jax.scipy.linalg.lu_factor(jax.lax.stop_gradient(A))

    def solve(b):
        return jax.lax.custom_linear_solve(
            lambda x: A @ x,
            b,
            lambda _, r: jax.scipy.linalg.lu_solve(factors, r),
            lambda _, r: jax.scipy.linalg.lu_solve(factors, r, trans=1),
        )

    return solve
