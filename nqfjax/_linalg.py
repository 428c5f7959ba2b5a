"""Small linear-algebra helpers shared across the package (a private module whose
names other modules import): the symmetric part `sym`, the Frobenius inner
product `frobenius`, the PSD projection `psd_project` and the PSD square root
`psd_sqrt` with a derivative that stays finite at degenerate eigenvalues."""

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
