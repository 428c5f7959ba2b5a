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
