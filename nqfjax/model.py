"""The neural quadratic form `Tr[W W^T A(x)]`."""

import jax.numpy as jnp
from jaxtyping import Array, Float

from .structures.base import Structure


def nqf_apply(structure: Structure, W: Float[Array, "p m"], x) -> Float[Array, " k"]:
    r"""The quadratic model $f_j(x) = \mathrm{Tr}[W W^\top A_j(x)]$ for one input.

    Computed as $\sum_i w_i^\top A_j(x) w_i$ without forming `W W^T`. Batch over
    inputs with `jax.vmap(nqf_apply, in_axes=(None, None, 0))`.

    **Arguments:**

    - `structure`: the architecture.
    - `W`: weights, shape `(p, m)`, units as columns.
    - `x`: one input, shape `structure.input_shape`.

    **Returns:** shape `(k,)`.
    """
    W = jnp.asarray(W)
    if W.ndim != 2 or W.shape[0] != structure.p:
        raise ValueError(
            f"`W` must have shape (p, m) = ({structure.p}, m), got {W.shape}."
        )
    A = structure.A(x)
    return jnp.einsum("im,kij,jm->k", W, A, W)
