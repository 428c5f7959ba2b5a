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
from ._settle import (
    WARM_ATOL,
    WARM_RTOL,
    WARM_STEPS,
    real_output_and_gradient,
    settle,
)


def read_records(start, stop, stride) -> np.ndarray:
    """The records `gradient_gap` reads: every `stride`-th from `start`, and
    the last, `stop - 1`."""
    if stop <= start:
        return np.zeros(0, np.int64)
    return np.union1d(np.arange(start, stop, stride), [stop - 1])


@eqx.filter_jit
def gradient_gap(
    structure,
    xs,
    ys,
    Ws,
    start,
    stop,
    learned=None,
    num_modes=0,
    ts=None,
    learning_rate=None,
    carry=False,
    first=None,
    stride=1,
):
    r"""At the records read of `Ws` (shape `(R, p, m)`; `read_records`: every
    `stride`-th of `start <= i < stop` and the last; all three traced, so one
    compilation serves every range): the norms of the real layer's departure
    and of its quadratic part (as `validity._departures`); the real layer's
    loss gradient less its quadratic form's, $\delta g$, and the quadratic
    form's, shapes `(R, p, m)`, for the loss $\frac{1}{2n}\sum_x |f(x) -
    y|^2$, the quadratic form's in closed form $2 G W$, $G = \frac{1}{n}\sum_x
    (f_{\rm quad}(x) - y) A(x)$ (`weighted_sum`); $G$; the eigenvalues
    (ascending) and eigenvectors of $W W^\top$; with the records' times `ts`
    (shape `(R,)`) and `learning_rate`, the quadratic form's flow of a small
    mode from the record read before, $\Phi = \prod_i e^{-2\eta (t_{i+1} -
    t_i) \bar G_i}$ over every record between, $\bar G_i = (G_i +
    G_{i+1})/2$ (as `_shifts.flow`); and the weights. Zero at the records
    not read.

    With `learned` (shape `(R,)`, traced: how many of the `num_modes` largest
    modes are learned at each record), $\delta g$ is read with the learned
    modes' levels settled where the real layer holds them (`_settle.settle`,
    from the levels settled at the record read before). With `carry`, the
    weights are first turned, from record 0, into the frame that the
    quadratic form's flow carries (`_frame`; `carried_factors`): visiting
    every record from `first` (traced; default `start`) and turned at those
    read and at those before `start` (for `carried_factors`: `start = R`),
    by the flow since the record turned before; from record 0 to `first` in
    one step of the flow, $\bar G$ the mean of $G$ at both ends (before the
    records read the weights are small or the time short: `validity`'s
    `estimated_records`, so $G$ is all but constant). One forward and
    backward pass of the real layer per record read, and about one more
    forward and two more passes where a mode is learned; $G$ and the flow at
    every record visited."""
    zero = jnp.zeros((structure.p, 1), Ws.dtype)
    f0 = jax.vmap(lambda x: structure.layer(zero, x))(xs)
    n, (R, p, m) = xs.shape[0], Ws.shape
    c = min(num_modes, p, m)
    timed = ts is not None

    def measure(i, W, quad, G, s_prev):
        g_quad = 2.0 * G @ W
        lam, U = jnp.linalg.eigh(W @ W.T)
        if c > 0:  # the largest modes, by rank, settled from the last record's
            top = (lam[::-1][:c], U[:, ::-1][:, :c])

            def settled():
                f = jax.vmap(lambda x: structure.layer(W, x))(xs)
                args = (g_quad, *top, learned[i], s_prev, WARM_STEPS)
                tol = dict(rtol=WARM_RTOL, atol=WARM_ATOL)
                return f, *settle(structure, xs, ys, W, *args, **tol)

            def plain():
                return *real_output_and_gradient(structure, xs, ys, W), 0.0 * s_prev

            f, g_real, s = jax.lax.cond(learned[i] > 0, settled, plain)
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

    eye = jnp.eye(p, dtype=Ws.dtype)

    def body(i, state):
        out, G_prev, W_prev, t_prev, Phi, s_prev = state
        W = Ws[i]
        quad, G = quad_and_G(W)
        read = (i >= start) & (((i - start) % stride == 0) | (i == stop - 1))
        if timed:  # the flow since the record turned or read before
            mu, V = jnp.linalg.eigh(0.5 * (G + G_prev))
            step = -2.0 * learning_rate * (ts[i] - t_prev) * mu
            Phi = ((V * jnp.exp(jnp.minimum(step, 600.0))[None, :]) @ V.T) @ Phi
            t_prev = ts[i]
        if carry:  # that flow carries the weights turned before here
            turn = (i > 0) & (read | (i < start))
            W = jax.lax.cond(turn, lambda: nearest_factor(W, Phi @ W_prev), lambda: W)
            W_prev = jnp.where(turn, W, W_prev)
        (delta, quad, gap, g_quad, lam, U), s = jax.lax.cond(
            read, lambda: measure(i, W, quad, G, s_prev), lambda: skip(W, s_prev)
        )
        kept = read | (carry & (i < start))
        # at a record not read, nothing but the weights turned is kept
        now = (delta, quad, gap, g_quad, G, lam, U, Phi, W)
        now = tuple(jnp.where(kept if a is W else read, a, 0.0) for a in now)
        Phi = jnp.where(kept, eye, Phi)
        out = tuple(o.at[i].set(a) for o, a in zip(out, now))
        return out, G, W_prev, t_prev, Phi, s

    shapes = ((), (), (p, m), (p, m), (p, p), (p,), (p, p), (p, p), (p, m))
    out = tuple(jnp.zeros((R, *s), Ws.dtype) for s in shapes)
    first = start if first is None else first
    # the record before the first visited, for the flow: record 0
    t0 = ts[0] if timed else jnp.zeros((), Ws.dtype)
    G0 = quad_and_G(Ws[0])[1]
    state = (out, G0, Ws[0], t0, eye, jnp.zeros(c, Ws.dtype))
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
        none,
        none,
        ts=as_x(np.asarray(ts, np.float64)),
        learning_rate=as_x(learning_rate),
        carry=True,
        first=np.int64(0),
    )
    return np.asarray(out[-1], np.float64)
