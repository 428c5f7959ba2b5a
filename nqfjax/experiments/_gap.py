r"""The gradient gap along a trajectory of weights (`validity`): at each
record read, the real layer's departure from its quadratic form and the
difference of their loss gradients, in one compiled loop over the records.

With `carry` the weights are first turned, record by record from the first,
into the frame of units that the quadratic form's flow carries (`_frame`):
the quadratic form's $G$ and the flow between records that the frame needs
are those the gap reads, computed once.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ._frame import nearest_factor
from ._settle import level_weights, real_output_and_gradient, settle


@eqx.filter_jit
def gradient_gap(
    structure,
    xs,
    ys,
    Ws,
    ts,
    learning_rate,
    start,
    stop,
    learned=None,
    num_modes=0,
    carry=False,
    first=None,
):
    r"""At the records `start <= i < stop` of `Ws` (shape `(R, p, m)`; both
    traced, so one compilation serves every range): the norms of the real
    layer's departure and of its quadratic part (as `validity._departures`);
    the real layer's loss gradient less its quadratic form's, $\delta g$, and
    the quadratic form's, shapes `(R, p, m)`, for the loss
    $\frac{1}{2n}\sum_x |f(x) - y|^2$, the quadratic form's in closed form
    $2 G W$, $G = \frac{1}{n}\sum_x (f_{\rm quad}(x) - y) A(x)$
    (`weighted_sum`); $G$; the eigenvalues (ascending) and eigenvectors of
    $W W^\top$; with the records' times `ts` (shape `(R,)`) and
    `learning_rate` $\eta$, the quadratic form's flow of a small mode from the
    record before, $e^{-2\eta (t_i - t_{i-1}) \bar G_i}$, $\bar G_i =
    (G_{i-1} + G_i)/2$ (as `_shifts.flow`); and the weights. Zero outside
    the range.

    With `learned` (shape `(R,)`, traced: how many of the `num_modes` largest
    modes are learned at each record), $\delta g$ is read with the learned
    modes' levels settled where the real layer holds them (`_settle`: at
    the levels of the Newton step taken at the record before). With
    `carry`, the weights are first turned, from record 0, into the frame that
    the quadratic form's flow carries (`_frame`; `carried_factors`; $W
    W^\top$'s modes then from the same SVD), record by record from
    `first` (traced; default `start`; `carried_factors`: 0, with `start =
    R`), and from record 0 to `first` in one step of the flow, $\bar G$ the
    mean of $G$ at both ends (before the records read the weights are small
    or the time short: `validity`'s `estimated_records`, so $G$ is all but
    constant; measured on iris: the shifts move by 4e-8). One forward and
    backward pass of the real layer per record read, and one more forward
    pass where a mode is learned."""

    def forward(W):
        return jax.vmap(lambda x: structure.layer(W, x))(xs)

    f0 = forward(jnp.zeros((structure.p, 1), Ws.dtype))
    n, (R, p, m) = xs.shape[0], Ws.shape
    c = min(num_modes, p, m)

    def measure(i, W, quad, G, s_prev, modes):
        g_quad = 2.0 * G @ W
        lam, U = jnp.linalg.eigh(W @ W.T) if modes is None else modes
        if c > 0:  # the largest modes, by rank, at the levels of the step
            # taken at the record before; this record's step for the next
            top = (lam[::-1][:c], U[:, ::-1][:, :c])
            s0 = jnp.where(jnp.arange(c) < learned[i], s_prev, 0.0)
            moved = level_weights(W, *top, s0)  # W itself while none is learned
            f, g0 = real_output_and_gradient(structure, xs, ys, moved)
            f = jax.lax.cond(learned[i] > 0, lambda: forward(W), lambda: f)
            args = (g_quad, *top, learned[i], s0, g0)
            g_real, s = settle(structure, xs, ys, W, *args)
        else:
            f, g_real = real_output_and_gradient(structure, xs, ys, W)
            s = s_prev
        delta = f - f0 - quad
        norms = (jnp.sqrt(jnp.sum(delta**2)), jnp.sqrt(jnp.sum(quad**2)))
        return (*norms, g_real - g_quad, g_quad, lam, U), s

    def skip(W, s_prev):
        scalar = jnp.zeros((), W.dtype)
        zeros = (scalar, scalar, jnp.zeros_like(W), jnp.zeros_like(W))
        return (*zeros, jnp.zeros(p, W.dtype), jnp.zeros((p, p), W.dtype)), s_prev

    def quad_and_G(W):
        # the quadratic part and G depend on W only through W W^T: the same in
        # any frame; d Tr[W W^T A] / dW = 2 A W (A symmetric): no second VJP
        quad = structure.contract_factor(xs, W)
        return quad, structure.weighted_sum(xs, (f0 + quad - ys) / n)

    def body(i, state):
        out, G_prev, W_prev, t_prev, s_prev = state
        W = Ws[i]
        quad, G = quad_and_G(W)
        # the flow from the record visited before
        mu, V = jnp.linalg.eigh(0.5 * (G + G_prev))
        step = -2.0 * learning_rate * (ts[i] - t_prev) * mu
        flow = (V * jnp.exp(jnp.minimum(step, 600.0))[None, :]) @ V.T
        modes = None
        if carry:  # which carries the weights turned there here
            near, U, S = nearest_factor(W, flow @ W_prev)
            W = jnp.where(i > 0, near, W)
            if m >= p:  # W W^T's modes from the same SVD, ascending as eigh's
                modes = (S[::-1] ** 2, U[:, ::-1])
        read = i >= start
        (delta, quad, gap, g_quad, lam, U), s = jax.lax.cond(
            read,
            lambda: measure(i, W, quad, G, s_prev, modes),
            lambda: skip(W, s_prev),
        )
        # outside the range read, nothing but the weights is kept (`skip`
        # gives zeros for the rest of what is measured)
        G_, flow_ = (jnp.where(read, a, 0.0) for a in (G, flow))
        now = (delta, quad, gap, g_quad, G_, lam, U, flow_, W)
        out = tuple(o.at[i].set(a) for o, a in zip(out, now))
        return out, G, W, ts[i], s

    shapes = ((), (), (p, m), (p, m), (p, p), (p,), (p, p), (p, p), (p, m))
    out = tuple(jnp.zeros((R, *s), Ws.dtype) for s in shapes)
    first = start if first is None else first
    # the record before the first visited, for the flow: record 0
    state = (out, quad_and_G(Ws[0])[1], Ws[0], ts[0], jnp.zeros(c, Ws.dtype))
    return jax.lax.fori_loop(first, stop, body, state)[0]


def carried_factors(structure, xs, ys, factors, ts, learning_rate) -> np.ndarray:
    r"""The weights `factors` (shape `(R, p, m)`, at the increasing times `ts`)
    turned, record by record, into the frame of units that the quadratic
    form's flow carries from the first record (`_frame`): `gradient_gap`'s
    carried weights, no record read. Float64 numpy, shape `(R, p, m)`;
    `W W^T` unchanged."""
    W = np.asarray(factors, np.float64)
    R = W.shape[0]
    if R < 2:
        return W
    xs = jnp.asarray(xs)
    as_x = lambda a: jnp.asarray(a, xs.dtype)  # noqa: E731
    none = np.int64(R)  # no record read: start = stop; every record carried
    out = gradient_gap(
        structure,
        xs,
        as_x(ys),
        as_x(W),
        as_x(np.asarray(ts, np.float64)),
        as_x(learning_rate),
        none,
        none,
        carry=True,
        first=np.int64(0),
    )
    return np.asarray(out[-1], np.float64)
