"""One-dimensional convolution with channels as units."""

from collections.abc import Callable
from typing import final

import equinox as eqx
import jax.numpy as jnp
import numpy as np

from ._blocks import pair_apply, pair_factors, pair_matrix, pair_part, slope_at_zero
from .base import (
    AbstractStructure,
    check_batch,
    check_input,
    check_unit,
    check_weights,
    flag,
    size,
)


@final
class Conv1D(AbstractStructure):
    r"""A 1-D convolution of a single-channel signal, one output channel per unit.

    Input `x` of shape `(length,)`. With kernel size `s` and stride `t` there are
    `P = (length - s) // t + 1` patches $x_\pi = (x_{\pi t}, \ldots, x_{\pi t+s-1})$,
    stacked as the rows of the `P x s` patch matrix `X`. Channel `c` has kernel
    $k_c \in R^s$ and a readout, and the (single) output is

    $$f(x) = \sum_c \sum_\pi a_{c,\pi}\, \sigma(k_c \cdot x_\pi)$$

    (readout per position, unit $w_c = (a_c, k_c)$, `p = P + s`), or with global
    average pooling ($f(x) = \sum_c a_c \frac1P\sum_\pi \sigma(k_c\cdot x_\pi)$,
    unit $(a_c, k_c)$, `p = 1 + s`). With `c = sigma'(0)`,

    $$A(x) = \frac{c}{2}\begin{pmatrix} 0 & X \\ X^\top & 0\end{pmatrix},$$

    where with pooling `X` collapses to the mean patch (a `1 x s` row). Exactly
    additive; quadratic up to $O(|W|^3)$ ($O(|W|^4)$ for odd `sigma`).

    **Arguments:**

    - `length`: signal length (default 8).
    - `kernel_size`: `s` (default 3).
    - `stride`: `t` (default 1).
    - `pool`: global average pooling over positions (default `False`).
    - `activation`: `sigma` with `sigma(0) = 0` and `sigma'(0) != 0` (default
      `jnp.tanh`).
    """

    length: int = eqx.field(static=True, default=8, converter=size("length"))
    kernel_size: int = eqx.field(static=True, default=3, converter=size("kernel_size"))
    stride: int = eqx.field(static=True, default=1, converter=size("stride"))
    pool: bool = eqx.field(static=True, default=False, converter=flag("pool"))
    activation: Callable = eqx.field(static=True, default=jnp.tanh)

    def __check_init__(self):
        if self.length < self.kernel_size:
            raise ValueError(
                f"`length` must be >= `kernel_size` = {self.kernel_size}, got "
                f"{self.length}."
            )
        slope_at_zero(self.activation)

    @property
    def k(self) -> int:
        return 1

    @property
    def slope(self) -> float:
        """`c = sigma'(0)`."""
        return slope_at_zero(self.activation)

    @property
    def positions(self) -> int:
        """The number of patches `P`."""
        return (self.length - self.kernel_size) // self.stride + 1

    @property
    def p(self) -> int:
        return (1 if self.pool else self.positions) + self.kernel_size

    @property
    def input_shape(self) -> tuple[int, ...]:
        return (self.length,)

    @property
    def additive(self) -> bool:
        return True

    def patches(self, x):
        """The `P x s` patch matrix `X` of one input `x` (shape `(length,)`), or
        the `(b, P, s)` patch matrices of a batch (shape `(b, length)`)."""
        idx = (
            self.stride * np.arange(self.positions)[:, None]
            + np.arange(self.kernel_size)[None, :]
        )
        return x[..., idx]

    def _blocks(self, xs):
        """The patch matrices of a batch, shape `(b, n, s)` (`n = 1`, the mean
        patch, with pooling): `A(x) = (c/2) [[0, X], [X^T, 0]]` in their terms."""
        X = self.patches(xs)
        return jnp.mean(X, axis=1, keepdims=True) if self.pool else X

    def A(self, x):
        x = check_input(self, x)
        X = self._blocks(x[None])[0]
        return pair_matrix(0.5 * self.slope * X, self.p, 0, X.shape[0])[None]

    # A(x) is the patch matrix and its transpose: the hooks contract the patches
    # directly, O(P s) per sample instead of O((P + s)^2).

    def contract(self, xs, X):
        Xs = self._blocks(check_batch(self, xs)).astype(X.dtype)
        n, s = Xs.shape[1:]
        B = pair_part(X, 0, n, n, s)
        return self.slope * jnp.einsum("bns,ns->b", Xs, B)[:, None]

    def weighted_sum(self, xs, c):
        Xs = self._blocks(check_batch(self, xs)).astype(c.dtype)
        G = 0.5 * self.slope * jnp.einsum("b,bns->ns", c[:, 0], Xs)
        return pair_matrix(G, self.p, 0, Xs.shape[1])

    def contract_factor(self, xs, W):
        # B = W_r W_c^T is (n, s), the size of one patch matrix, not (p, p)
        Xs = self._blocks(check_batch(self, xs)).astype(W.dtype)
        n, s = Xs.shape[1:]
        Wr, Wc = pair_factors(W, 0, n, n, s)
        return self.slope * jnp.einsum("bns,ns->b", Xs, Wr @ Wc.T)[:, None]

    def weighted_apply(self, xs, c, W):
        Xs = self._blocks(check_batch(self, xs)).astype(W.dtype)
        G = 0.5 * self.slope * jnp.einsum("b,bns->ns", c[:, 0].astype(W.dtype), Xs)
        Wr, Wc = pair_factors(W, 0, G.shape[0], G.shape[0], G.shape[1])
        return pair_apply(G @ Wc, G.T @ Wr, W, 0, G.shape[0])

    def sample_size(self):
        return self.length + self.positions * self.kernel_size

    def layer(self, W, x):
        W, x = check_weights(self, W), check_input(self, x)
        s = self.kernel_size
        readout, kernels = W[:-s], W[-s:]
        hidden = self.activation(self.patches(x) @ kernels)  # (P, m)
        if self.pool:
            return jnp.sum(readout[0] * jnp.mean(hidden, axis=0))[None]
        return jnp.sum(readout * hidden)[None]

    def unit(self, w, x):
        w, x = check_unit(self, w), check_input(self, x)
        return self.layer(w[:, None], x)
