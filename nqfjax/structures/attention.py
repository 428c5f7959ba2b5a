"""Attention: the query-key circuit and the value-output circuit of softmax heads."""

from typing import final

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from .._checks import is_concrete, static_int
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
)
from .base import (
    AbstractStructure,
    check_batch,
    check_input,
    check_unit,
    check_weights,
    flag,
    size,
)


def _default_values(T: int, k: int) -> Float[Array, "T k"]:
    """Fixed, deterministic, non-degenerate default values `sin(1 + b(j+1))`."""
    b = np.arange(T)[:, None]
    j = np.arange(k)[None, :]
    return jnp.asarray(np.sin(1.0 + b * (j + 1.0)))


def _check_query(query: int, T: int) -> int:
    """`query` as a Python int in `[-T, T)`."""
    query = static_int("query", query, minimum=-T)
    if query >= T:
        raise ValueError(
            f"`query` must be an integer token index in [-T, T) = [{-T}, {T}), "
            f"got {query!r}."
        )
    return query


def _temperature(temperature) -> float:
    """`temperature` as a finite float `> 0`."""
    try:
        value = float(temperature)
    except (TypeError, ValueError):
        value = float("nan")
    if isinstance(temperature, bool) or not (np.isfinite(value) and value > 0):
        raise ValueError(
            f"`temperature` must be finite and strictly positive, got {temperature!r}."
        )
    return value


@final
class QKAttention(AbstractStructure):
    r"""The query-key circuit of one attention head, with fixed values.

    Input: tokens `x` of shape `(T, d)`. The output at the query token `a` is

    $$f_j(x; W) = \sum_b \alpha_b(x; W)\, v_{bj},\qquad
    s_b = x_a^\top W_Q W_K^\top x_b / \tau,$$

    with $\alpha_b = \mathrm{softmax}_b(s)$ (`softmax=True`) or $\alpha_b = s_b$
    (linear attention, `softmax=False`), `v` the fixed values (shape `(T, k)`) and
    `tau` the temperature. A unit is one inner dimension of $W_Q W_K^\top$,
    $w_i = (q_i, k_i)$ (query block first), so `p = 2d` and

    $$A_j(x) = \frac{1}{2\tau}\begin{pmatrix} 0 & x_a z_j^\top \\
    z_j x_a^\top & 0\end{pmatrix},\qquad
    z_j = \begin{cases}\sum_b v_{bj} x_b & \text{linear,}\\
    \frac1T \sum_b (v_{bj} - \bar v_j) x_b & \text{softmax,}\end{cases}$$

    because the softmax linearises to $1/T + (s_b - \bar s)/T$. Linear attention
    is exact and additive. Softmax attention is not additive (the units add
    inside the softmax) and its value at zero is the mean value $\bar v$, an
    offset of the target; the quadratic form holds to $O(|W|^4)$ since the logits
    are themselves quadratic in `W`.

    **Arguments:**

    - `T`: number of tokens (default: `values.shape[0]`, or 4).
    - `d`: token dimension (default 3).
    - `k`: number of outputs (default: `values.shape[1]`, or 1).
    - `values`: the fixed values `v`, shape `(T, k)`; a 1-D array of shape `(T,)`
      means `k = 1`. Default: the deterministic $v_{bj} = \sin(1 + b(j+1))$.
    - `query`: index `a` of the query token (default -1, the last token).
    - `softmax`: softmax attention (default) or linear attention.
    - `temperature`: `tau > 0` (default 1).

    **Raises:** `ValueError` for inconsistent sizes, a query index out of range,
    non-finite values or a non-positive temperature.
    """

    values: Float[Array, "T k"]
    d: int = eqx.field(static=True)
    query: int = eqx.field(static=True)
    softmax: bool = eqx.field(static=True)
    temperature: float = eqx.field(static=True)

    def __init__(
        self,
        *,
        T: int | None = None,
        d: int = 3,
        k: int | None = None,
        values=None,
        query: int = -1,
        softmax: bool = True,
        temperature: float = 1.0,
    ):
        T = None if T is None else static_int("T", T)
        k = None if k is None else static_int("k", k)
        if values is None:
            values = _default_values(4 if T is None else T, 1 if k is None else k)
        values = jnp.asarray(values)
        if values.ndim == 1:
            values = values[:, None]
        if values.ndim != 2 or values.shape[0] < 1 or values.shape[1] < 1:
            raise ValueError(
                "`values` must have shape (T, k) or (T,) with T, k >= 1, got "
                f"{values.shape}."
            )
        if T is not None and values.shape[0] != T:
            raise ValueError(
                f"`values` must have shape (T, k) = ({T}, k), got {values.shape}."
            )
        if k is not None and values.shape[1] != k:
            raise ValueError(
                f"`values` must have shape (T, k) = (T, {k}), got {values.shape}."
            )
        if not jnp.issubdtype(values.dtype, jnp.floating):
            values = values.astype(float)
        self.values = values
        self.d = static_int("d", d)
        self.query = _check_query(query, values.shape[0])
        self.softmax = flag("softmax")(softmax)
        self.temperature = _temperature(temperature)

    def __check_init__(self):
        if is_concrete(self.values) and not np.all(np.isfinite(self.values)):
            raise ValueError("`values` contains NaN or inf.")

    @property
    def T(self) -> int:
        """Number of tokens."""
        return self.values.shape[0]

    @property
    def k(self) -> int:
        return self.values.shape[1]

    @property
    def p(self) -> int:
        return 2 * self.d

    @property
    def input_shape(self) -> tuple[int, ...]:
        return (self.T, self.d)

    @property
    def additive(self) -> bool:
        return not self.softmax

    def _mixing(self, dtype) -> Float[Array, "T k"]:
        """`z_j = mixing[:, j] . x` (over tokens): the values, centred and over `T`
        for the softmax, over the temperature."""
        v = self.values.astype(dtype)
        if self.softmax:
            v = (v - jnp.mean(v, axis=0, keepdims=True)) / self.T
        return v / self.temperature

    def A(self, x):
        x = check_input(self, x)
        xa, z = x[self.query], self._mixing(x.dtype).T @ x  # (d,), (k, d)
        return jax.vmap(
            lambda zj: pair_matrix(0.5 * jnp.outer(xa, zj), self.p, 0, self.d)
        )(z)

    # A_j(x) is the rank-two pair (x_a, z_j): the hooks contract the samples
    # directly, O(T k d + d^2) per sample, and never form a (p, p) matrix per
    # sample.

    def _batch(self, xs, dtype):
        xs = check_batch(self, xs).astype(dtype)
        Z = jnp.einsum("tj,btl->bjl", self._mixing(dtype), xs)  # (b, k, d)
        return xs[:, self.query], Z

    def contract(self, xs, X):
        # Tr[A_j X] = x_a^T B z_j with B the symmetrised query-key block of X
        xa, Z = self._batch(xs, X.dtype)
        B = pair_part(X, 0, self.d, self.d, self.d)
        return jnp.einsum("bl,bjl->bj", xa @ B, Z)

    def weighted_sum(self, xs, c):
        xa, Z = self._batch(xs, c.dtype)
        G = 0.5 * xa.T @ jnp.einsum("bj,bjl->bl", c, Z)  # sum_sj c_sj x_a z_sj^T / 2
        return pair_matrix(G, self.p, 0, self.d)

    def contract_factor(self, xs, W):
        # x_a^T W_q W_k^T z_j = (W_q^T x_a) . (W_k^T z_j)
        xa, Z = self._batch(xs, W.dtype)
        Wq, Wk = pair_factors(W, 0, self.d, self.d, self.d)
        return jnp.einsum("br,bjr->bj", xa @ Wq, Z @ Wk)

    def weighted_apply(self, xs, c, W):
        # G = (1/2) x_a^T (sum_j c_sj z_sj): a sum of rank-one blocks
        xa, Z = self._batch(xs, W.dtype)
        zc = jnp.einsum("bj,bjl->bl", c.astype(W.dtype), Z)
        return outer_weighted_apply(xa, zc, W, scale=0.5, r0=0, c0=self.d)

    def sample_size(self):
        return (self.T + self.k + 1) * self.d

    def _logits(self, W, x):
        d = self.d
        Q, K = W[:d], W[d:]
        return (x @ K) @ (Q.T @ x[self.query]) / self.temperature

    def _mix(self, s, x):
        v = self.values.astype(x.dtype)
        if self.softmax:
            return jax.nn.softmax(s) @ v
        return s @ v

    def layer(self, W, x):
        W, x = check_weights(self, W), check_input(self, x)
        return self._mix(self._logits(W, x), x)

    def unit(self, w, x):
        w, x = check_unit(self, w), check_input(self, x)
        out = self.layer(w[:, None], x)
        if self.softmax:
            out = out - jnp.mean(self.values.astype(x.dtype), axis=0)
        return out


@final
class OVAttention(AbstractStructure):
    r"""The value-output circuit of `m` softmax attention heads (one head per unit).

    Input: tokens `x` of shape `(T, d)`. Head `h` has value vector $v_h \in R^d$
    and output vector $o_h \in R^k$; the layer at the query token `a` is

    $$f(x; W) = \sum_h o_h\, v_h^\top \sum_b \alpha^h_b\, x_b .$$

    How the query-key part is held (the choice this class makes):

    - `learn_qk=False` (default, the convention of the theory pages): the
      query-key weights are zero, the attention is exactly uniform,
      $\alpha^h_b = 1/T$, and the unit is $w_h = (o_h, v_h)$, `p = k + d`.
    - `learn_qk=True`: each head also carries a rank-one query-key circuit
      $(q_h, k_h)$ trained with it, $\alpha^h = \mathrm{softmax}_b((x_a\cdot
      q_h)(k_h \cdot x_b)/\tau)$, and the unit is $w_h = (o_h, v_h, q_h, k_h)$,
      `p = k + 3d`. At small weights the logits are $O(|w|^2)$, so the softmax is
      uniform at leading order and the query-key block of `A` is zero: the
      query-key circuit enters only at fourth order (the OV circuit is learned
      first).

    In both cases, with $\bar x = \frac1T\sum_b x_b$ the mean token,

    $$A_j(x) = \tfrac12\begin{pmatrix} 0 & e_j \bar x^\top \\
    \bar x e_j^\top & 0\end{pmatrix}$$

    on the `(o, v)` block (zero elsewhere). The layer is exactly additive: each
    head normalises its own softmax, which sees only that head's weights, so heads
    never couple. It is exactly quadratic for `learn_qk=False` and quadratic up to
    $O(|W|^4)$ for `learn_qk=True`.

    **Arguments:**

    - `T`: number of tokens (default 4).
    - `d`: token dimension (default 3).
    - `k`: number of outputs (default 1).
    - `query`: index `a` of the query token (default -1, the last token); used
      only when `learn_qk=True`.
    - `learn_qk`: whether each head carries its own trainable query-key circuit.
    - `temperature`: `tau > 0` of the softmax (default 1).
    """

    T: int = eqx.field(static=True, default=4, converter=size("T"))
    d: int = eqx.field(static=True, default=3, converter=size("d"))
    k: int = eqx.field(static=True, default=1, converter=size("k"))
    query: int = eqx.field(static=True, default=-1)
    learn_qk: bool = eqx.field(static=True, default=False, converter=flag("learn_qk"))
    temperature: float = eqx.field(static=True, default=1.0, converter=_temperature)

    def __check_init__(self):
        _check_query(self.query, self.T)

    @property
    def p(self) -> int:
        return self.k + (3 if self.learn_qk else 1) * self.d

    @property
    def input_shape(self) -> tuple[int, ...]:
        return (self.T, self.d)

    @property
    def additive(self) -> bool:
        return True

    def A(self, x):
        x = check_input(self, x)
        xbar = jnp.mean(x, axis=0)
        eye = jnp.eye(self.k, dtype=x.dtype)
        return jax.vmap(
            lambda e: pair_matrix(0.5 * jnp.outer(e, xbar), self.p, 0, self.k)
        )(eye)

    # A_j(x) = (e_j xbar^T + xbar e_j^T) / 2 on the (o, v) block: a readout row
    # times the mean token, O(T d + k d) per sample.

    def contract(self, xs, X):
        xbar = jnp.mean(check_batch(self, xs), axis=1)
        return readout_contract(xbar, X, scale=0.5, k=self.k, r0=0, c0=self.k)

    def weighted_sum(self, xs, c):
        xbar = jnp.mean(check_batch(self, xs), axis=1)
        return readout_weighted_sum(xbar, c, scale=0.5, p=self.p, r0=0, c0=self.k)

    def contract_factor(self, xs, W):
        xbar = jnp.mean(check_batch(self, xs), axis=1)
        return readout_contract_factor(xbar, W, scale=0.5, k=self.k, r0=0, c0=self.k)

    def weighted_apply(self, xs, c, W):
        xbar = jnp.mean(check_batch(self, xs), axis=1)
        return readout_weighted_apply(xbar, c, W, scale=0.5, r0=0, c0=self.k)

    def mode_gram(self, xs, U):
        xbar = jnp.mean(check_batch(self, xs), axis=1)
        return readout_mode_gram(xbar, U, scale=0.5, k=self.k, r0=0, c0=self.k)

    def sample_size(self):
        return (self.T + self.k) * self.d

    def layer(self, W, x):
        W, x = check_weights(self, W), check_input(self, x)
        k, d = self.k, self.d
        Out, V = W[:k], W[k : k + d]
        if self.learn_qk:
            Q, K = W[k + d : k + 2 * d], W[k + 2 * d :]
            logits = (x @ K) * (x[self.query] @ Q)[None, :] / self.temperature
            mixed = jax.nn.softmax(logits, axis=0).T @ x  # (m, d), one row per head
        else:
            mixed = jnp.broadcast_to(jnp.mean(x, axis=0), (W.shape[1], d))
        return Out @ jnp.sum(V.T * mixed, axis=1)

    def unit(self, w, x):
        w, x = check_unit(self, w), check_input(self, x)
        return self.layer(w[:, None], x)
