"""Two-layer perceptron: `f(x) = sum_i a_i sigma(u_i . x)` with k outputs."""

import functools
from collections.abc import Callable
from typing import final

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ._blocks import readout_contract, readout_weighted_sum
from .base import (
    AbstractStructure,
    check_batch,
    check_input,
    check_unit,
    check_weights,
    size,
)


def _slope_at_zero(activation: Callable) -> float:
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
        _slope_at_zero(self.activation)

    @property
    def slope(self) -> float:
        """`c = sigma'(0)`."""
        return _slope_at_zero(self.activation)

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

    def sample_size(self):
        return self.k + self.d

    def unit(self, w, x):
        w, x = check_unit(self, w), check_input(self, x)
        return w[: self.k] * self.activation(jnp.dot(w[self.k :], x))

    def layer(self, W, x):
        W, x = check_weights(self, W), check_input(self, x)
        return W[: self.k] @ self.activation(W[self.k :].T @ x)
