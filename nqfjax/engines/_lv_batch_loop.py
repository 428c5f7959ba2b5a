r"""The fused loop of `solve_lv_batch` (private module): one `lax.while_loop`
that steps every member of a batch of Lotka-Volterra systems at once, each with
its own time and step size (the Rodas4 step of `LVRosenbrock` as batched
arithmetic, the acceptance as masks on the small per-member state), and writes
the outputs that fall inside an accepted step from the step's dense output.

A batch's system is a `LotkaVolterra` whose leaves are each shared by the batch
or carry a leading batch axis; `axes` (static) holds the batch axis of each
leaf, `0` or `None`, in the order of `jax.tree.leaves`.
"""

import functools
from collections.abc import Callable
from typing import NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from ..tasks.interactions import DiagonalInteractions, LowRankInteractions
from ..tasks.lotka_volterra import LotkaVolterra
from ._lv_common import PIDConstants, rates
from ._rosenbrock import (
    RODAS4,
    _combine,
    dense_output,
    exponent_clip,
    rosenbrock_stages,
)


def in_axes(lv: LotkaVolterra, axes: tuple) -> LotkaVolterra:
    """The batch axes `axes` (one per leaf) as a tree of the structure of `lv`:
    `jax.vmap`'s `in_axes` for it."""
    return jax.tree.unflatten(jax.tree.structure(lv), axes)


class StepState(eqx.Module):
    """Where each member of a batch stands, every field with a leading `(n,)`
    (or `(n, k)` for `k` of them, e.g. the checkpoints): its time `t`, next step
    size `dt`, log-state `y` `(..., p)`, and `idx`, the index of its next
    output time."""

    t: Float[Array, " n"]
    dt: Float[Array, " n"]
    y: Float[Array, "n p"]
    idx: Int[Array, " n"]


class StepRecord(eqx.Module):
    """Accepted steps of each member, `(n, seg, ...)`: the log-state `y` at the
    start of the step, its time `t`, its length `h` and `idx`, the index of the
    first output time at or after `t`."""

    y: Float[Array, "n seg p"]
    t: Float[Array, "n seg"]
    h: Float[Array, "n seg"]
    idx: Int[Array, "n seg"]


class LoopSetup(NamedTuple):
    """What every loop over the batch shares: the batched Rodas4 `step(lv, y, h,
    y_max) -> (y1, err, H)`, the clip of the exponent, the last output time, and
    the time after which a step ends at it (within 100 ULPs, as diffrax)."""

    step: Callable
    y_max: Float[Array, ""]
    t_end: Float[Array, ""]
    t_floor: Float[Array, ""]


class Carry(eqx.Module):
    """The state of the fused loop: the members' `state`, the outputs `out`
    `(n, T + 1, p)` (the last row takes masked writes), the accepted and
    rejected step counts, the iteration, and (recording for the adjoint) the
    steps of the first segment and the checkpoints."""

    state: StepState
    out: Float[Array, "n T+1 p"]
    n_acc: Int[Array, " n"]
    n_rej: Int[Array, " n"]
    it: Int[Array, ""]
    first: StepRecord | None
    ckpt: StepState | None


def member_step(lv, y0, h, y_max):
    """One Rodas4 step of one member from `y0` over `h` (see `LVRosenbrock`):
    `(y1, err, H)`."""
    m = jnp.exp(jnp.minimum(y0, y_max))
    gh = RODAS4.gamma * h
    solve = lv.interactions.rosenbrock_solver(m, gh, gh)
    args = (lv.r, lv.interactions, lv.decay, y_max)
    return rosenbrock_stages(RODAS4, lambda t, y: rates(y, args), solve, 0.0, y0, h)


def structured_step(lv, y0, h, y_max, *, axes):
    r"""One Rodas4 step of every member, `B = diag(d) + U U^T`
    (`LowRankInteractions`, or `DiagonalInteractions`: no `U`), as batched
    arithmetic: `(y1, err, H)` with `H` of shape `(n, r, p)`.

    The same step as `member_step` (`rosenbrock_stages` with the Woodbury solve
    of `LowRankInteractions.rosenbrock_solver`), with the products by `U` of the
    field and of the Woodbury solve merged, one product per stage instead of
    two: with $w = \gamma h\, m / a$, $a = 1 + \gamma h\, d\, m$ and $P = U^T
    \mathrm{diag}(w)\, U$, a stage with $v = r - \delta - d\, m_s + \sum_j C_{ij}
    k_j / h$ is $k = (\gamma h / a)\,(v - U (s_1 + c))$ with $s_1 = U^T m_s$,
    $s_2 = U^T (w v)$ and $c = (I + P)^{-1} (s_2 - P s_1)$. On 64 members of 64
    modes this cut the step's time by 15-30% (fewer, larger kernels)."""
    tab = RODAS4
    inter, ax = lv.interactions, in_axes(lv, axes)
    row = lambda x, a: x if a == 0 else x[None]  # (n or 1, ...)
    r, d = row(lv.r, ax.r), row(inter.d, ax.interactions.d)
    decay = lv.decay[:, None] if ax.decay == 0 else lv.decay
    n = y0.shape[0]
    # a DiagonalInteractions has no columns
    low_rank = isinstance(inter, LowRankInteractions)
    q = inter.U.shape[-1] if low_rank else 0
    if q:
        U, shared = row(inter.U, ax.interactions.U), ax.interactions.U is None

    def u_t(x):  # (k, p) -> U^T x, (k, q)
        return x @ U[0] if shared else jnp.einsum("np,npq->nq", x, U)

    def u(s):  # (n, q) -> U s, (n, p)
        return s @ U[0].T if shared else jnp.einsum("nq,npq->np", s, U)

    gh = tab.gamma * h[:, None]
    m = jnp.exp(jnp.minimum(y0, y_max))
    inv_a = 1 / (1 + gh * d * m)
    w = gh * m * inv_a
    if q:
        spec = "np,pq,pr->nqr" if shared else "np,npq,npr->nqr"
        P = jnp.einsum(spec, w, *((U[0], U[0]) if shared else (U, U)))
        S = jnp.eye(q, dtype=y0.dtype)[None] + P
    ks = []
    for i in range(tab.num_stages):
        y_s = y0 if i == 0 else y0 + _combine(tab.a[i], ks)
        m_s = m if i == 0 else jnp.exp(jnp.minimum(y_s, y_max))
        v = r - decay - d * m_s
        if i > 0:
            v = v + _combine(tab.C[i], ks) / h[:, None]
        if q == 0:  # B diagonal
            ks.append(gh * inv_a * v)
            continue
        if shared:  # one product for both: stack the two along the batch
            s12 = u_t(jnp.concatenate([m_s, w * v]))
            s1, s2 = s12[:n], s12[n:]
        else:
            s1, s2 = u_t(m_s), u_t(w * v)
        rhs = s2 - jnp.einsum("nqr,nr->nq", P, s1)
        c = rhs / S[:, 0] if q == 1 else jnp.linalg.solve(S, rhs[..., None])[..., 0]
        ks.append(gh * inv_a * (v - u(s1 + c)))
    y1 = y0 + _combine(tab.m, ks)
    return y1, ks[-1], jnp.stack([_combine(row, ks) for row in tab.H], axis=1)


def _max_last(x):
    """`max(x, axis=-1)` as a tree of elementwise maxima, which XLA fuses into one
    loop (its CPU reduction of the fused error norm was the loop's slowest
    kernel, see benchmarks/README.md)."""
    while x.shape[-1] > 1:
        if x.shape[-1] % 2:
            x = jnp.concatenate([x, x[..., -1:]], axis=-1)
        half = x.shape[-1] // 2
        x = jnp.maximum(x[..., :half], x[..., half:])
    return x[..., 0]


def control(pid: PIDConstants, y0, y1, err, h, active):
    """`(accept, dt_next)` per member: diffrax's `PIDController` (an integral
    controller, `pid`) in the max norm over modes; a non-finite error is a
    rejection by the largest factor."""
    y1 = jnp.where(jnp.isnan(y1), y0, y1)
    scale = pid.atol + pid.rtol * jnp.maximum(jnp.abs(y0), jnp.abs(y1))
    e = _max_last(jnp.abs(err) / scale)
    e = jnp.where(jnp.isnan(e), jnp.inf, e)
    accept = (e < 1) & active
    factor = jnp.clip(
        pid.safety * e ** (-pid.exponent),
        jnp.where(accept, 1.0, pid.factormin),
        jnp.where(accept, pid.factormax, pid.safety),
    )
    dt = h * factor.astype(h.dtype)
    return accept, dt if pid.dtmax is None else jnp.minimum(dt, pid.dtmax)


def write_outputs(times, t0, h, y0, y1, H, accept, idx, out):
    """Every output time in `(t0, t0 + h]` of the members' accepted steps, from
    the dense output, one per member at a time; masked writes go to the extra
    last row of `out` (`(n, T + 1, p)`), so nothing selects over `out`. Returns
    `(idx, out)` after them."""
    T = times.shape[0]
    rows = jnp.arange(y0.shape[0])
    t1 = t0 + h
    H = jnp.moveaxis(H, 1, 0)  # (r, n, p)

    def due(idx):
        return accept & (idx < T) & (times[jnp.minimum(idx, T - 1)] <= t1)

    def body(carry):
        idx, out = carry
        mask = due(idx)
        theta = (times[jnp.minimum(idx, T - 1)] - t0) / h
        y = dense_output(y0, y1, H, theta[:, None])
        out = out.at[rows, jnp.where(mask, idx, T)].set(y)
        return idx + mask, out

    return jax.lax.while_loop(lambda c: jnp.any(due(c[0])), body, (idx, out))


def loop_setup(lv, axes, dtype, times) -> LoopSetup:
    """The `LoopSetup` of a batch `lv` with batch axes `axes` in `dtype`."""
    y_max = jnp.asarray(exponent_clip(dtype), dtype)
    t_end = times[-1]
    # as diffrax, end a step at t_end when it would stop within 100 ULPs of it
    t_floor = t_end
    for _ in range(100):
        t_floor = jnp.nextafter(t_floor, jnp.asarray(-jnp.inf, dtype))
    if isinstance(lv.interactions, (DiagonalInteractions, LowRankInteractions)):
        # diagonal plus low rank: the products of the stages merged, batched
        step = functools.partial(structured_step, axes=axes)
    else:  # any other form (dense: an LU per member): member by member
        step = jax.vmap(member_step, in_axes=(in_axes(lv, axes), 0, 0, None))
    return LoopSetup(step, y_max, t_end, t_floor)


def attempt(setup: LoopSetup, lv, pid, state: StepState, active):
    """One attempted step of every member from `state`: `(h, y1, H, accept,
    after)`, `after` the `(t, dt, y)` of `state` moved on where the step is
    accepted and `dt` the controller's next where `active` (`idx` unchanged).
    Inactive members idle on a unit step."""
    t, dt, y = state.t, state.dt, state.y
    t1 = jnp.where(t + dt > setup.t_floor, setup.t_end, t + dt)
    h = jnp.where(active, t1 - t, 1.0)
    y1, err, H = setup.step(lv, y, h, setup.y_max)
    accept, dt_next = control(pid, y, y1, err, h, active)
    after = StepState(
        jnp.where(accept, t1, t),
        jnp.where(active, dt_next, dt),
        jnp.where(accept[:, None], y1, y),
        state.idx,
    )
    return h, y1, H, accept, after


def empty_records(n, seg, p, dtype) -> StepRecord:
    """`(n, seg)` records, with `h = 1` in the slots that stay empty (they are
    masked, but must not divide by zero)."""
    zeros = jnp.zeros((n, seg), dtype)
    return StepRecord(
        jnp.zeros((n, seg, p), dtype), zeros, zeros + 1, jnp.zeros((n, seg), jnp.int32)
    )


def write_slot(buffers, rows, slot, values):
    """`buffers` (a module of `(n, k, ...)` arrays) with `values` (the same
    module of `(n, ...)`) written at `[rows, slot]`; an out-of-range slot is
    dropped."""
    return jax.tree.map(
        lambda b, v: b.at[rows, slot].set(v, mode="drop"), buffers, values
    )


def integrate_loop(lv, axes, pid, start: StepState, times, max_steps, seg):
    """The fused loop over one chunk of members from `start`, to `times[-1]` or
    `max_steps` iterations: the final `Carry`. With `seg` (an int), it also
    records what the discrete adjoint needs: the state after every `seg`-th
    accepted step of each member (the checkpoints, slot 0 the start), and the
    accepted steps of the first segment."""
    n, p = start.y.shape
    T = times.shape[0]
    dtype = start.y.dtype
    setup = loop_setup(lv, axes, dtype, times)
    rows = jnp.arange(n)
    record = seg is not None
    k = -(-max_steps // seg) + 1 if record else 0  # the checkpoints

    def cond(c: Carry):
        return jnp.any(c.state.t < setup.t_end) & (c.it < max_steps)

    def body(c: Carry):
        s = c.state
        active = s.t < setup.t_end
        h, y1, H, accept, after = attempt(setup, lv, pid, s, active)
        idx, out = write_outputs(times, s.t, h, s.y, y1, H, accept, s.idx, c.out)
        first, ckpt = c.first, c.ckpt
        if record:
            # the first segment's accepted steps; masked writes are dropped
            slot = jnp.where(accept & (c.n_acc < seg), c.n_acc, seg)
            first = write_slot(first, rows, slot, StepRecord(s.y, s.t, h, s.idx))
        state = eqx.tree_at(lambda a: a.idx, after, idx)
        n_acc = c.n_acc + accept
        if record:
            slot = jnp.where(accept & (n_acc % seg == 0), n_acc // seg, k)
            ckpt = write_slot(ckpt, rows, slot, state)
        n_rej = c.n_rej + (active & ~accept)
        return Carry(state, out, n_acc, n_rej, c.it + 1, first, ckpt)

    zeros = jnp.zeros(n, jnp.int32)
    out = jnp.full((n, T + 1, p), jnp.nan, dtype)
    # an output at the start time itself is the initial value
    at_start = times[0] <= start.t
    out = out.at[:, 0].set(jnp.where(at_start[:, None], start.y, jnp.nan))
    start = eqx.tree_at(lambda s: s.idx, start, at_start.astype(jnp.int32))
    first = ckpt = None
    if record:
        first = empty_records(n, seg, p, dtype)
        ckpt = jax.tree.map(lambda x: jnp.zeros((n, k, *x.shape[1:]), x.dtype), start)
        ckpt = write_slot(ckpt, rows, 0, start)
    init = Carry(start, out, zeros, zeros, jnp.asarray(0), first, ckpt)
    return jax.lax.while_loop(cond, body, init)


def recompute_segment(setup, lv, pid, times, seg, start: StepState, count):
    """The `StepRecord` `(n, seg)` of the accepted steps of one segment of every
    member, re-run from its checkpoint `start` for `count` `(n,)` accepted
    steps (0: the member idles)."""
    n, p = start.y.shape
    rows = jnp.arange(n)

    def cond(carry):
        return jnp.any(carry[1] < count)

    def body(carry):
        s, c, bufs = carry
        active = (c < count) & (s.t < setup.t_end)
        h, _, _, accept, after = attempt(setup, lv, pid, s, active)
        slot = jnp.where(accept, c, seg)
        bufs = write_slot(bufs, rows, slot, StepRecord(s.y, s.t, h, s.idx))
        # the index of the next output: the first output time after the step
        idx = jnp.where(
            accept, jnp.searchsorted(times, s.t + h, side="right"), s.idx
        ).astype(s.idx.dtype)
        s = eqx.tree_at(lambda a: a.idx, after, idx)
        c = c + accept
        # a member that reached the end stops counting (the forward pass's steps
        # are reproduced, so this guards against a loop that would not end)
        c = jnp.where(s.t >= setup.t_end, jnp.maximum(c, count), c)
        return s, c, bufs

    bufs = empty_records(n, seg, p, start.y.dtype)
    init = (start, jnp.zeros(n, count.dtype), bufs)
    return jax.lax.while_loop(cond, body, init)[-1]
