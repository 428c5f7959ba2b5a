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

from ._frame import nearest_factor
from ._settle import (
    WARM_ATOL,
    WARM_RTOL,
    WARM_STEPS,
    real_output_and_gradient,
    settle,
)


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
):
    r"""At the records `start <= i < stop` of `Ws` (shape `(R, p, m)`; both
    traced, so one compilation serves every range): the norms of the real
    layer's departure and of its quadratic part (as `validity._departures`);
    the real layer's loss gradient less its quadratic form's, $\delta g$, and
    the quadratic form's, shapes `(R, p, m)`, for the loss
    $\frac{1}{2n}\sum_x |f(x) - y|^2$, the quadratic form's in closed form
    $2 G W$, $G = \frac{1}{n}\sum_x (f_{\rm quad}(x) - y) A(x)$
    (`weighted_sum`); $G$; the eigenvalues (ascending) and eigenvectors of
    $W W^\top$ and of $\bar G_i = (G_{i-1} + G_i)/2$ (`_shifts.flow`); and the
    weights read. Zero outside the range.

    With `learned` (shape `(R,)`, traced: how many of the `num_modes` largest
    modes are learned at each record), $\delta g$ is read with the learned
    modes' levels settled where the real layer holds them (`_settle.settle`,
    from the levels settled at the record before). With `carry` (and the
    records' times `ts`, shape `(R,)`, and `learning_rate`), the weights are
    those of `_frame.carried_factors`, from record 0. One forward and backward
    pass of the real layer per record read, and about one more forward and
    two more passes where a mode is learned."""
    zero = jnp.zeros((structure.p, 1), Ws.dtype)
    f0 = jax.vmap(lambda x: structure.layer(zero, x))(xs)
    n, (R, p, m) = xs.shape[0], Ws.shape
    c = min(num_modes, p, m)

    def measure(i, W, G, lam, U, s_prev):
        quad = structure.contract_factor(xs, W)
        g_quad = 2.0 * G @ W
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
        return norms, g_real - g_quad, g_quad, s

    def body(i, state):
        out, G_prev, W_prev, s_prev = state
        W = Ws[i]
        # d Tr[W W^T A] / dW = 2 A W (A symmetric): no second VJP to compile;
        # G depends on W only through W W^T: the same in any frame
        residual = f0 + structure.contract_factor(xs, W) - ys
        G = structure.weighted_sum(xs, residual / n)
        mu, V = jnp.linalg.eigh(0.5 * (G + G_prev))
        if carry:  # the flow from the record before carries its weights here
            step = -2.0 * learning_rate * (ts[i] - ts[i - 1]) * mu
            flow = (V * jnp.exp(jnp.minimum(step, 600.0))[None, :]) @ V.T
            W = jnp.where(i > 0, nearest_factor(W, flow @ W_prev), W)
        lam, U = jnp.linalg.eigh(W @ W.T)

        def skip():
            zeros = jnp.zeros((), W.dtype), jnp.zeros((), W.dtype)
            return zeros, jnp.zeros_like(W), jnp.zeros_like(W), s_prev

        norms, gap, g_quad, s = jax.lax.cond(
            i >= start, lambda: measure(i, W, G, lam, U, s_prev), skip
        )
        now = (*norms, gap, g_quad, G, lam, U, mu, V, W)
        # outside the range read, nothing is kept
        now = tuple(jnp.where(i >= start, a, jnp.zeros_like(a)) for a in now)
        return tuple(o.at[i].set(a) for o, a in zip(out, now)), G, W, s

    shapes = ((), (), (p, m), (p, m), (p, p), (p,), (p, p), (p,), (p, p), (p, m))
    out = tuple(jnp.zeros((R, *s), Ws.dtype) for s in shapes)
    G0 = jnp.zeros((p, p), Ws.dtype)
    state = (out, G0, Ws[0], jnp.zeros(c, Ws.dtype))
    first = 0 if carry else start
    return jax.lax.fori_loop(first, stop, body, state)[0]
