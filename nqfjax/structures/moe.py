"""Mixture of experts: a softmax router, or a gate that is itself a weight factor."""

from collections.abc import Callable
from typing import Literal, final

import equinox as eqx
import jax
import jax.numpy as jnp

from ._blocks import (
    outer_weighted_apply,
    pair_factors,
    pair_matrix,
    pair_part,
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
class MixtureOfExperts(AbstractStructure):
    r"""A mixture of `experts` experts, one expert (with its router row) per unit.

    Input `x \in R^d`; each expert is a perceptron neuron $\sigma(u_e \cdot x)$
    with `sigma(0) = 0`, `c = sigma'(0)` (`activation=lambda z: z` gives the
    linear expert $u_e \cdot x$).

    `gate="softmax"` (default): $f(x) = \sum_e g_e(x)\, a_e\, \sigma(u_e\cdot x)$
    with $g = \mathrm{softmax}(R x)$ over the `experts` router rows $r_e$ and
    readouts $a_e \in R^k$. Unit $w_e = (r_e, a_e, u_e)$, `p = d + k + d`. Since
    $g_e = 1/E + O(r)$, the router enters at third order and

    $$A_j(x) = \frac{c}{2E}\begin{pmatrix} 0 & 0 & 0 \\ 0 & 0 & e_j x^\top \\
    0 & x e_j^\top & 0\end{pmatrix}$$

    ($1/E$ times the perceptron's `A` on the expert block, zero on the router
    block). Not additive: the softmax couples the experts at third order (the
    Hessian at zero is still block-diagonal over units).

    `gate="factor"`: the gate is a weight factor, $g_e = r_e \cdot x$, and
    $f(x) = \sum_e (r_e \cdot x)\, \sigma(u_e \cdot x)$ with one output (the
    gate plays the readout's role). Unit $w_e = (r_e, u_e)$, `p = 2d`,

    $$A(x) = \frac{c}{2}\begin{pmatrix} 0 & x x^\top \\ x x^\top & 0\end{pmatrix},$$

    exactly additive.

    The layer holds at most `experts` units (`max_units`); a `W` with fewer
    columns leaves the remaining experts switched off (zero weights: router logit
    0, output 0), which is how `unit` is defined.

    **Arguments:**

    - `d`: input dimension (default 3).
    - `k`: number of outputs (default 1; must be 1 for `gate="factor"`).
    - `experts`: the number of experts `E` (default 4).
    - `gate`: `"softmax"` or `"factor"`.
    - `activation`: the experts' `sigma`, with `sigma(0) = 0` and
      `sigma'(0) != 0` (default `jnp.tanh`).
    """

    d: int = eqx.field(static=True, default=3, converter=size("d"))
    k: int = eqx.field(static=True, default=1, converter=size("k"))
    experts: int = eqx.field(static=True, default=4, converter=size("experts"))
    gate: Literal["softmax", "factor"] = eqx.field(static=True, default="softmax")
    activation: Callable = eqx.field(static=True, default=jnp.tanh)

    def __check_init__(self):
        if self.gate not in ("softmax", "factor"):
            raise ValueError(
                f'`gate` must be "softmax" or "factor", got {self.gate!r}.'
            )
        if self.gate == "factor" and self.k != 1:
            raise ValueError(
                f'`k` must be 1 with gate="factor" (the gate is the readout), got '
                f"k={self.k}."
            )
        slope_at_zero(self.activation)

    @property
    def slope(self) -> float:
        """`c = sigma'(0)`."""
        return slope_at_zero(self.activation)

    @property
    def p(self) -> int:
        return 2 * self.d + (self.k if self.gate == "softmax" else 0)

    @property
    def input_shape(self) -> tuple[int, ...]:
        return (self.d,)

    @property
    def additive(self) -> bool:
        return self.gate == "factor"

    @property
    def max_units(self) -> int:
        return self.experts

    def A(self, x):
        x = check_input(self, x)
        d, k, p = self.d, self.k, self.p
        if self.gate == "factor":
            xx = 0.5 * self.slope * jnp.outer(x, x)
            zero = jnp.zeros((d, d), x.dtype)
            return jnp.block([[zero, xx], [xx, zero]])[None]
        half = 0.5 * self.slope / self.experts * x

        def one(j):
            out = jnp.zeros((p, p), x.dtype)
            out = out.at[d + j, d + k :].set(half)
            return out.at[d + k :, d + j].set(half)

        return jax.vmap(one)(jnp.arange(k))

    # The router block of A is zero and the expert block is a perceptron's
    # (softmax gate: readout row j times x, over E), or the pair (x x^T, x x^T)
    # (factor gate): the hooks contract the samples directly, O(k d) or O(d^2)
    # per sample.

    def contract(self, xs, X):
        xs = check_batch(self, xs)
        d = self.d
        if self.gate == "factor":
            # Tr[A X] = c x^T B x with B the symmetrised router-expert block
            B = pair_part(X, 0, d, d, d)
            xs = xs.astype(X.dtype)
            return self.slope * jnp.sum((xs @ B) * xs, axis=1, keepdims=True)
        scale = 0.5 * self.slope / self.experts
        return readout_contract(xs, X, scale=scale, k=self.k, r0=d, c0=d + self.k)

    def weighted_sum(self, xs, c):
        xs = check_batch(self, xs)
        d = self.d
        if self.gate == "factor":
            xs = xs.astype(c.dtype)
            G = 0.5 * self.slope * (xs * c).T @ xs  # sum_s c_s (c/2) x_s x_s^T
            return pair_matrix(G, self.p, 0, d)
        scale = 0.5 * self.slope / self.experts
        return readout_weighted_sum(xs, c, scale=scale, p=self.p, r0=d, c0=d + self.k)

    def contract_factor(self, xs, W):
        xs = check_batch(self, xs)
        d = self.d
        if self.gate == "factor":
            # c x^T W_r W_c^T x = c (W_r^T x) . (W_c^T x)
            Wr, Wc = pair_factors(W, 0, d, d, d)
            xs = xs.astype(W.dtype)
            return self.slope * jnp.sum((xs @ Wr) * (xs @ Wc), axis=1, keepdims=True)
        scale = 0.5 * self.slope / self.experts
        return readout_contract_factor(
            xs, W, scale=scale, k=self.k, r0=d, c0=d + self.k
        )

    def weighted_apply(self, xs, c, W):
        xs = check_batch(self, xs)
        d = self.d
        if self.gate == "factor":  # G = (c/2) sum_s c_s x_s x_s^T
            xs = xs.astype(W.dtype)
            L = xs * c.astype(W.dtype)
            return outer_weighted_apply(L, xs, W, scale=0.5 * self.slope, r0=0, c0=d)
        scale = 0.5 * self.slope / self.experts
        return readout_weighted_apply(xs, c, W, scale=scale, r0=d, c0=d + self.k)

    def mode_gram(self, xs, U):
        if self.gate == "factor":
            return AbstractStructure.mode_gram(self, xs, U)
        xs = check_batch(self, xs)
        scale = 0.5 * self.slope / self.experts
        d = self.d
        return readout_mode_gram(xs, U, scale=scale, k=self.k, r0=d, c0=d + self.k)

    def sample_size(self):
        return self.d + self.k

    def layer(self, W, x):
        W, x = check_weights(self, W), check_input(self, x)
        d, k, m = self.d, self.k, W.shape[1]
        gate_logits = W[:d].T @ x
        hidden = self.activation(W[-d:].T @ x)
        if self.gate == "factor":
            return jnp.sum(gate_logits * hidden)[None]
        padded = jnp.concatenate([gate_logits, jnp.zeros(self.experts - m, x.dtype)])
        g = jax.nn.softmax(padded)[:m]
        return W[d : d + k] @ (g * hidden)

    def unit(self, w, x):
        w, x = check_unit(self, w), check_input(self, x)
        return self.layer(w[:, None], x)
