r"""The predicted weights in the frame of units that gradient descent
carries (`carried_factors`).

An engine that integrates $M = W W^\top$ gives the weights at the records as
$W(t) = M(t)^{1/2} O$ (`validity.factors_of`), the polar factor $O$ of the
initial weights held fixed. Gradient descent on the quadratic form moves the
weights by $\dot W = -2\eta\,G W$ ($G$ symmetric): from the left only, so a
direction $\psi(t) = \Phi(T, t)^\top \psi$ carried back by that flow keeps its
pattern over the units, $W(t)^\top \psi(t)$, fixed. $M^{1/2} O$ has the same
$M$ but turns the units' frame: for `Conv1D` on MNIST-1D (targets x1, init
`1e-3`) the third mode's pattern turns by 40 degrees between the first record
read and its switch-on, where gradient descent on the quadratic form keeps it
within 7 degrees. A layer whose units are not interchangeable (each unit's
own nonlinearity) feeds its waiting modes through the units that carry them,
and a feed read in a turning frame adds up across records in directions that
gradient descent never takes.

So the weights at each record are the factor of the engine's $M$ nearest
(Frobenius) to the previous record's weights carried by the quadratic form's
flow between the two, $\Phi_i W_i$, $\Phi_i = e^{-2\eta (t_{i+1} - t_i) \bar
G_i}$ (`_shifts.carry_back`): $W_{i+1} = F_{i+1} Q$ with $F_{i+1}$ the engine's
factor and $Q$ the orthogonal Procrustes rotation of $F_{i+1}^\top \Phi_i
W_i$. $W W^\top = M$ at every record, as before; the first record is kept.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ._shifts import carry_back


@eqx.filter_jit
def _generators(structure, xs, ys, Ws):
    r"""$G = \frac{1}{n}\sum_x (f_{\rm quad}(x) - y) A(x)$ at each of `Ws`
    (shape `(R, p, m)`): the quadratic form's gradient is $2 G W$. Shape
    `(R, p, p)`."""
    zero = jnp.zeros((structure.p, 1), Ws.dtype)
    f0 = jax.vmap(lambda x: structure.layer(zero, x))(xs)
    n = xs.shape[0]

    def one(W):
        residual = (f0 + structure.contract_factor(xs, W) - ys) / n
        return structure.weighted_sum(xs, residual)

    return jax.lax.map(one, Ws)


def carried_factors(structure, xs, ys, factors, ts, learning_rate) -> np.ndarray:
    r"""The weights `factors` (shape `(R, p, m)`, at the increasing times `ts`)
    turned, record by record, into the frame of units that the quadratic
    form's flow carries from the first record (see the module). Float64 numpy,
    shape `(R, p, m)`; `W W^T` unchanged."""
    W = np.asarray(factors, np.float64)
    ts = np.asarray(ts, np.float64)
    if W.shape[0] < 2:
        return W
    xs = jnp.asarray(xs)
    G = _generators(structure, xs, jnp.asarray(ys, xs.dtype), jnp.asarray(W, xs.dtype))
    flows = carry_back(ts, float(learning_rate), np.asarray(G, np.float64))
    out = np.empty_like(W)
    out[0] = W[0]
    for i in range(W.shape[0] - 1):
        U, _, Vt = np.linalg.svd(W[i + 1].T @ (flows[i] @ out[i]))
        out[i + 1] = W[i + 1] @ (U @ Vt)
    return out
