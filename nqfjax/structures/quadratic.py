"""Quadratic network: `f(x) = sum_i (u_i . x)^2`."""

from typing import final

import equinox as eqx
import jax.numpy as jnp

from .base import (
    AbstractStructure,
    check_batch,
    check_input,
    check_unit,
    check_weights,
    size,
)


@final
class QuadraticNet(AbstractStructure):
    r"""Quadratic network `f(x) = \sum_i (u_i \cdot x)^2`, one output.

    Unit `u_i \in R^d`, `p = d`, and the form is exact: `A(x) = x x^\top`.

    **Arguments:**

    - `d`: input dimension (default 4).
    """

    d: int = eqx.field(static=True, default=4, converter=size("d"))

    @property
    def k(self) -> int:
        return 1

    @property
    def p(self) -> int:
        return self.d

    @property
    def input_shape(self) -> tuple[int, ...]:
        return (self.d,)

    @property
    def additive(self) -> bool:
        return True

    def A(self, x):
        x = check_input(self, x)
        return jnp.outer(x, x)[None]

    # A(x) = x x^T is rank one: the hooks never form it per sample (O(d) memory
    # per sample instead of O(d^2)).

    def contract(self, xs, X):
        xs = check_batch(self, xs).astype(X.dtype)
        return jnp.sum((xs @ X) * xs, axis=1, keepdims=True)

    def weighted_sum(self, xs, c):
        xs = check_batch(self, xs).astype(c.dtype)
        return (xs * c).T @ xs

    def contract_factor(self, xs, W):
        # Tr[x x^T W W^T] = |W^T x|^2
        xs = check_batch(self, xs).astype(W.dtype)
        return jnp.sum((xs @ W) ** 2, axis=1, keepdims=True)

    def weighted_apply(self, xs, c, W):
        # sum_s c_s x_s x_s^T W
        xs = check_batch(self, xs).astype(W.dtype)
        return (xs * c.astype(W.dtype)).T @ (xs @ W)

    def sample_size(self):
        return self.d

    def unit(self, w, x):
        w, x = check_unit(self, w), check_input(self, x)
        return jnp.dot(w, x)[None] ** 2

    def layer(self, W, x):
        W, x = check_weights(self, W), check_input(self, x)
        return jnp.sum((W.T @ x) ** 2)[None]
