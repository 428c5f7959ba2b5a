"""The neural quadratic form `Tr[W W^T A(x)]`."""

import jax.numpy as jnp
from jaxtyping import Array, Float

from .._checks import finite
from .base import AbstractStructure, check_input


def nqf_apply(
    structure: AbstractStructure, W: Float[Array, "p m"], x
) -> Float[Array, " k"]:
    r"""The quadratic model $f_j(x) = \mathrm{Tr}[W W^\top A_j(x)]$ for one input.

    Computed as $\sum_i w_i^\top A_j(x) w_i$ without forming `W W^T`. Batch over
    inputs with `jax.vmap(nqf_apply, in_axes=(None, None, 0))`.

    **Arguments:**

    - `structure`: the architecture.
    - `W`: weights, shape `(p, m)`, units as columns.
    - `x`: one input, shape `structure.input_shape`.

    **Returns:** shape `(k,)`.

    **Raises:** `ValueError` if `structure` is not an `AbstractStructure`, if `W`
    is not `(p, m)` or `x` not `structure.input_shape`, or (also under `jit`, via
    `eqx.error_if`) if `W` or `x` contains NaN or inf.
    """
    if not isinstance(structure, AbstractStructure):
        raise ValueError(
            "`structure` must be an nqfjax.AbstractStructure, got "
            f"{type(structure).__name__}."
        )
    W = jnp.asarray(W)
    if W.ndim != 2 or W.shape[0] != structure.p:
        raise ValueError(
            f"`W` must have shape (p, m) = ({structure.p}, m), got {W.shape}."
        )
    W = finite("W", W)
    x = finite("x", check_input(structure, x))
    A = structure.A(x)
    return jnp.einsum("im,kij,jm->k", W, A, W)
