"""Quadratic network: `f(x) = sum_i (u_i . x)^2`."""

import equinox as eqx
import jax.numpy as jnp

from .base import Structure


class QuadraticNet(Structure):
    r"""Quadratic network `f(x) = \sum_i (u_i \cdot x)^2`, one output.

    Unit `u_i \in R^d`, `p = d`, and the form is exact: `A(x) = x x^\top`.

    **Arguments:**

    - `d`: input dimension (default 4).
    """

    d: int = eqx.field(static=True, default=4)

    def __check_init__(self):
        if self.d < 1:
            raise ValueError(f"`d` must be >= 1, got {self.d}.")

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

    def _A(self, x):
        return jnp.outer(x, x)[None]

    def _unit(self, w, x):
        return jnp.dot(w, x)[None] ** 2

    def _layer(self, W, x):
        return jnp.sum((W.T @ x) ** 2)[None]
