"""Two-layer perceptron: `f(x) = sum_i a_i sigma(u_i . x)` with k outputs."""

from collections.abc import Callable
from typing import final

import equinox as eqx
import jax.numpy as jnp

from ._blocks import (
    readout_contract,
    readout_contract_factor,
    readout_mode_gram,
    readout_weighted_apply,
    readout_weighted_sum,
    slope_at_zero,
)
from .base import (
    AbstractStructure,
    check_batch,
    check_input,
    check_unit,
    check_weights,
    size,
)


@final
class Perceptron(AbstractStructure):
    r"""Two-layer perceptron with `k` outputs and `d` inputs.

    Unit `i` is `w_i = (a_i, u_i)` with readout `a_i \in R^k` first, so `p = k + d`,
    and the layer is `f(x) = \sum_i a_i \sigma(u_i \cdot x)`. With `c = \sigma'(0)`,

    $$A_j(x) = \tfrac{c}{2}(e_j x^\top + x e_j^\top)$$

    in the `(k + d)` block layout.

    **Arguments:**

    - `d`: input dimension (default 4).
    - `k`: number of outputs (default 2).
    - `activation`: elementwise `sigma` with `sigma(0) = 0` and `sigma'(0) != 0`
      (default `jnp.tanh`); anything else raises `ValueError`.
    """

    d: int = eqx.field(static=True, default=4, converter=size("d"))
    k: int = eqx.field(static=True, default=2, converter=size("k"))
    activation: Callable = eqx.field(static=True, default=jnp.tanh)

    def __check_init__(self):
        slope_at_zero(self.activation)

    @property
    def slope(self) -> float:
        """`c = sigma'(0)`."""
        return slope_at_zero(self.activation)

    @property
    def p(self) -> int:
        return self.k + self.d

    @property
    def input_shape(self) -> tuple[int, ...]:
        return (self.d,)

    @property
    def additive(self) -> bool:
        return True

    def A(self, x):
        x = check_input(self, x)
        k, d = self.k, self.d
        off = (
            jnp.zeros((k, k, d), x.dtype)
            .at[jnp.arange(k), jnp.arange(k)]
            .set(0.5 * self.slope * x)
        )
        top = jnp.concatenate([jnp.zeros((k, k, k), x.dtype), off], axis=2)
        bottom = jnp.concatenate(
            [jnp.swapaxes(off, 1, 2), jnp.zeros((k, d, d), x.dtype)], axis=2
        )
        return jnp.concatenate([top, bottom], axis=1)

    # A_j(x) is nonzero only in row/column j of the readout block: the hooks
    # contract the samples directly, O(k d) per sample instead of O(k p^2).

    def contract(self, xs, X):
        xs = check_batch(self, xs)
        return readout_contract(
            xs, X, scale=0.5 * self.slope, k=self.k, r0=0, c0=self.k
        )

    def weighted_sum(self, xs, c):
        xs = check_batch(self, xs)
        return readout_weighted_sum(
            xs, c, scale=0.5 * self.slope, p=self.p, r0=0, c0=self.k
        )

    def contract_factor(self, xs, W):
        xs = check_batch(self, xs)
        return readout_contract_factor(
            xs, W, scale=0.5 * self.slope, k=self.k, r0=0, c0=self.k
        )

    def weighted_apply(self, xs, c, W):
        xs = check_batch(self, xs)
        return readout_weighted_apply(xs, c, W, scale=0.5 * self.slope, r0=0, c0=self.k)

    def mode_gram(self, xs, U):
        xs = check_batch(self, xs)
        return readout_mode_gram(
            xs, U, scale=0.5 * self.slope, k=self.k, r0=0, c0=self.k
        )

    def sample_size(self):
        return self.k + self.d

    def unit(self, w, x):
        w, x = check_unit(self, w), check_input(self, x)
        return w[: self.k] * self.activation(jnp.dot(w[self.k :], x))

    def layer(self, W, x):
        W, x = check_weights(self, W), check_input(self, x)
        return W[: self.k] @ self.activation(W[self.k :].T @ x)
