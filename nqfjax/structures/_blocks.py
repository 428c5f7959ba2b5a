r"""Off-diagonal block matrices: the closed-form batch hooks of the built-in
structures, and the slope `sigma'(0)` of their activations (a private module
whose names the structures import).

Every built-in structure except the quadratic network has structure matrices of
one shape: a block $U_j(x)$ (rows `r`, columns `c`, disjoint) and its transpose,

$$A_j(x) = \begin{pmatrix} 0 & U_j(x) \\ U_j(x)^\top & 0 \end{pmatrix}
\quad\text{on } (r, c), \text{ zero elsewhere,}$$

so that $\mathrm{Tr}[A_j(x) X] = 2\langle U_j(x), B\rangle$ with
$B = \tfrac12(X_{rc} + X_{cr}^\top)$ (`pair_part`), and
$\sum_{s,j} c_{sj} A_j(x_s)$ is the same pattern around
$\sum_{s,j} c_{sj} U_j(x_s)$ (`pair_matrix`). With $U_j(x)$ of rank one or a
patch matrix, neither ever forms a `(p, p)` matrix per sample.
"""

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float


def pair_part(X: Float[Array, "p p"], r0: int, nr: int, c0: int, nc: int):
    r"""$B = \tfrac12(X_{rc} + X_{cr}^\top)$, shape `(nr, nc)`, for the rows
    `r = r0 .. r0 + nr` and columns `c = c0 .. c0 + nc`."""
    return 0.5 * (X[r0 : r0 + nr, c0 : c0 + nc] + X[c0 : c0 + nc, r0 : r0 + nr].T)


def pair_matrix(G, p: int, r0: int, c0: int) -> Float[Array, "p p"]:
    """The `(p, p)` matrix with `G` (shape `(nr, nc)`) at rows `r0 ..` and columns
    `c0 ..`, `G^T` at the mirrored place, zero elsewhere."""
    nr, nc = G.shape
    out = jnp.zeros((p, p), G.dtype)
    out = out.at[r0 : r0 + nr, c0 : c0 + nc].set(G)
    return out.at[c0 : c0 + nc, r0 : r0 + nr].set(G.T)


def readout_contract(V, X, *, scale: float, k: int, r0: int, c0: int):
    r"""`contract` for $U_j(x) = s\, e_j v(x)^\top$ (a readout row times a feature
    vector, as in a perceptron): $\mathrm{Tr}[A_j(x_s) X] = 2 s\,(B v_s)_j$.

    **Arguments:** `V`, the features $v(x_s)$ of the batch, shape `(b, n)`; `X`,
    shape `(p, p)`; `scale` $s$; `k` readout rows from `r0`; features from `c0`.

    **Returns:** shape `(b, k)`, in the dtype of `X`.
    """
    B = pair_part(X, r0, k, c0, V.shape[1])
    return 2.0 * scale * V.astype(X.dtype) @ B.T


def readout_weighted_sum(V, c, *, scale: float, p: int, r0: int, c0: int):
    r"""`weighted_sum` for $U_j(x) = s\, e_j v(x)^\top$:
    $\sum_{s,j} c_{sj} U_j(x_s) = s\, c^\top V$ in the pair pattern.

    **Arguments:** `V`, shape `(b, n)`; `c`, shape `(b, k)`; `scale` $s$; `p`;
    readout rows from `r0`, features from `c0`.

    **Returns:** shape `(p, p)`, in the dtype of `c`.
    """
    return pair_matrix(scale * c.T @ V.astype(c.dtype), p, r0, c0)


# ------------------------------------------------------------------------------
# the factored hooks: Tr[A_j W W^T] and sum c A W without any (p, p) matrix
#
# For X = W W^T the pair part is B = W_r W_c^T (rows r and c of W), so
# Tr[A_j X] = 2 <U_j, W_r W_c^T>, and (sum c A) W has rows r = G W_c and rows
# c = G^T W_r with G = sum c U_j.


def pair_factors(W, r0: int, nr: int, c0: int, nc: int):
    """`(W_r, W_c)`: the rows `r0 .. r0 + nr` and `c0 .. c0 + nc` of `W`."""
    return W[r0 : r0 + nr], W[c0 : c0 + nc]


def pair_apply(GWc, GtWr, W, r0: int, c0: int) -> Float[Array, "p r"]:
    r"""$(\sum c A) W$ in the pair pattern: the `(p, r)` matrix with `GWc`
    ($G W_c$, shape `(nr, r)`) at rows `r0 ..`, `GtWr` ($G^\top W_r$, shape
    `(nc, r)`) at rows `c0 ..`, zero elsewhere (in the dtype of `W`)."""
    out = jnp.zeros(W.shape, W.dtype)
    out = out.at[r0 : r0 + GWc.shape[0]].add(GWc.astype(W.dtype))
    return out.at[c0 : c0 + GtWr.shape[0]].add(GtWr.astype(W.dtype))


def readout_contract_factor(V, W, *, scale: float, k: int, r0: int, c0: int):
    r"""`contract_factor` for $U_j(x) = s\, e_j v(x)^\top$:
    $\mathrm{Tr}[A_j(x_s) W W^\top] = 2 s\, (V W_c W_r^\top)_{sj}$, computed as
    `V @ (W_c @ W_r.T)`: `O(n k r + b n k)` for `V` of shape `(b, n)`.

    **Returns:** shape `(b, k)`, in the dtype of `W`.
    """
    Wr, Wc = pair_factors(W, r0, k, c0, V.shape[1])
    return 2.0 * scale * V.astype(W.dtype) @ (Wc @ Wr.T)


def readout_mode_gram(V, U, *, scale: float, k: int, r0: int, c0: int):
    r"""`mode_gram` for $U_j(x) = s\, e_j v(x)^\top$: the outputs of mode `l`
    are $F_{sj,l} = 2 s\, (V U_c)_{sl} (U_r)_{jl}$, so their Gram is
    $4 s^2\, (U_r^\top U_r) \circ ((V U_c)^\top V U_c)$: `O(b n r + b r^2)`
    for `V` of shape `(b, n)`, against `O(b k r^2)` for $F^\top F$.

    **Returns:** shape `(r, r)`, in the dtype of `U`.
    """
    Ur, Uc = pair_factors(U, r0, k, c0, V.shape[1])
    Z = V.astype(U.dtype) @ Uc
    return (4.0 * scale**2) * (Ur.T @ Ur) * (Z.T @ Z)


def readout_weighted_apply(V, c, W, *, scale: float, r0: int, c0: int):
    r"""`weighted_apply` for $U_j(x) = s\, e_j v(x)^\top$: with
    $G = s\, c^\top V$ (shape `(k, n)`), rows `r0 ..` get $G W_c$ and rows
    `c0 ..` get $G^\top W_r$; `O(b k n + k n r)`.

    **Returns:** shape `(p, r)`, in the dtype of `W`.
    """
    G = scale * c.astype(W.dtype).T @ V.astype(W.dtype)
    Wr, Wc = pair_factors(W, r0, G.shape[0], c0, G.shape[1])
    return pair_apply(G @ Wc, G.T @ Wr, W, r0, c0)


def outer_weighted_apply(L, R, W, *, scale: float, r0: int, c0: int):
    r"""`weighted_apply` when $G = s\, L^\top R$ (`L`: `(b, nr)`, `R`:
    `(b, nc)`; a sum of rank-one blocks): rows `r0 ..` get
    $s L^\top (R W_c)$ and rows `c0 ..` get $s R^\top (L W_r)$, without forming
    `G`; `O(b (nr + nc) r)`.

    **Returns:** shape `(p, r)`, in the dtype of `W`.
    """
    L, R = L.astype(W.dtype), R.astype(W.dtype)
    Wr, Wc = pair_factors(W, r0, L.shape[1], c0, R.shape[1])
    return pair_apply(scale * L.T @ (R @ Wc), scale * R.T @ (L @ Wr), W, r0, c0)


# ------------------------------------------------------------------------------
# activations


def slope_at_zero(activation: Callable) -> float:
    """`sigma'(0)`, after checking `sigma(0) = 0`.

    Evaluated eagerly even while tracing, so that it may be called from inside
    `jit`, `vmap` and `shard_map`: `jax.core.eval_context` (inside `shard_map`,
    `jax.ensure_compile_time_eval` still stages the calls, and `float` then
    fails on a tracer).
    """
    with jax.core.eval_context():
        return _slope_at_zero_eager(activation)


@functools.partial(jax.jit, static_argnums=0)
def _value_and_slope(activation, z):
    return jax.value_and_grad(activation)(z)


def _slope_at_zero_eager(activation: Callable) -> float:
    zero = jnp.zeros((), jnp.float32)
    try:
        hash(activation)
    except TypeError:  # e.g. a module holding arrays: not a static argument
        value, slope = activation(zero), jax.grad(activation)(zero)
    else:  # one compiled call per activation (eagerly, its ops would be six)
        value, slope = _value_and_slope(activation, zero)
    value, slope = float(value), float(slope)
    if not np.isfinite(value) or abs(value) > 1e-7:
        raise ValueError(
            "`activation` must satisfy sigma(0) = 0 (the unit's output a*sigma(u.x) "
            f"then has no first-order term at zero); got sigma(0) = {value:.3g}. "
            "Use a centred activation such as tanh, or sigma(z) - sigma(0)."
        )
    if not np.isfinite(slope) or slope == 0.0:
        raise ValueError(
            "`activation` must have a finite nonzero slope sigma'(0); got "
            f"{slope:.3g}. With sigma'(0) = 0 the quadratic form vanishes and the "
            "leading order is cubic, outside this theory."
        )
    return slope
