r"""A batch of Lotka-Volterra systems in one fused loop: `solve_lv_batch`.

`jax.vmap(solve_lv)` runs diffrax's loop under `vmap`, which selects the whole
carried state (and the saved outputs) between accepted and rejected steps at
every step. Here one `lax.while_loop` steps every member at once with its own
step size: the Rodas4 step of `LVRosenbrock` as batched arithmetic, the
acceptance as masks on the small per-member state, and the outputs that fall
inside an accepted step written from the step's dense output. Its reverse-mode
derivative is the discrete adjoint of the loop (`jax.custom_vjp`), with
checkpoints every `ceil(sqrt(max_steps))` accepted steps.
"""

import functools
import math

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import ArrayLike, Float

from .._checks import error_if, is_concrete, static_int
from ..tasks.interactions import DiagonalInteractions, LowRankInteractions
from ..tasks.lotka_volterra import LotkaVolterra
from ._integrate import Solution, check_times, tolerance_checks as _tolerance_checks
from ._rosenbrock import (
    RODAS4,
    _combine,
    dense_output,
    exponent_clip,
    rosenbrock_stages,
)
from .lv import _check_m0, _default_tolerances, _log_floor, _rates


# the fields of a LotkaVolterra: the system of `_rates` (`r`, `interactions`,
# `decay`), then those of its loss. A batch's `system` is this tuple, and its
# `axes` the batch axis (0, or None for a field shared by the batch) of each
# leaf of it, in the order of `jax.tree.leaves`: static, so that the loop is
# compiled once per layout.
_FIELDS = ("r", "interactions", "decay")
_LOSS_FIELDS = ("loss_scale", "loss_offset")
# diffrax's PIDController defaults (an integral controller), with diffrax's
# error order for an ODE solver, its order (the embedded method's order + 1):
# the step sequence of `solve_lv`
_SAFETY, _FACTOR_MIN, _FACTOR_MAX = 0.9, 0.2, 10.0
_ERROR_ORDER = RODAS4.order
_MAX_STEPS_MSG = (
    "The solver took `max_steps` = {} steps without reaching the last time of "
    "`ts` for members {} of the batch. Increase `max_steps`, or loosen `atol` "
    "(with `throw=False` the Solution's `result` marks the members and "
    "`stats['moving']` the modes that were still moving)."
)


def _in_axes(system, axes):
    """The batch axes `axes` (one per leaf) as a tree of the structure of
    `system`: `jax.vmap`'s `in_axes` for it."""
    return jax.tree.unflatten(jax.tree.structure(system), axes)


def _leaf_axis(name: str, x, ndim: int, n: int, p: int):
    """The batch axis of the leaf `name` of `lv`, whose one-system form has
    `ndim` dimensions, the first of size `p`: None (shared by the batch) or 0
    (one per member, a leading `n`)."""
    shape = tuple(jnp.shape(x))
    one = () if ndim == 0 else (p, *shape[len(shape) - ndim + 1 :])
    if shape == one:
        return None
    if shape == (n, *one):
        return 0
    raise ValueError(
        f"`lv.{name}` must have shape {one} (one system for the whole batch) "
        f"or {(n, *one)} (one per member of the batch of {n} in `m0`), got "
        f"{shape}."
    )


def _batched(lv: LotkaVolterra, n: int, p: int) -> tuple[tuple, tuple]:
    """The system of `lv`, `(r, interactions, decay, loss_scale, loss_offset)`,
    and the batch axis of each of its leaves (0 for a leaf given per member,
    None for one shared by the batch), checking that each has the shape of one
    system of `p` modes, or that with a leading `n`."""
    inter = lv.interactions
    paths = jax.tree_util.tree_flatten_with_path(inter)[0]
    named = [("r", lv.r, 1)]
    named += [
        ("interactions" + jax.tree_util.keystr(path), leaf, k)
        for (path, leaf), k in zip(paths, inter._unbatched_ndims)
    ]
    named += [(k, getattr(lv, k), 0) for k in ("decay", *_LOSS_FIELDS)]
    axes = tuple(_leaf_axis(name, x, k, n, p) for name, x, k in named)
    system = tuple(getattr(lv, k) for k in _FIELDS + _LOSS_FIELDS)
    return system, axes


def _member_step(system, y0, h, y_max):
    """One Rodas4 step of one member from `y0` over `h` (see `LVRosenbrock`):
    `(y1, err, H)`."""
    r, interactions, decay = system
    m = jnp.exp(jnp.minimum(y0, y_max))
    gh = RODAS4.gamma * h
    solve = interactions.rosenbrock_solver(m, gh, gh)
    args = (r, interactions, decay, y_max)
    return rosenbrock_stages(RODAS4, lambda t, y: _rates(y, args), solve, 0.0, y0, h)


def _structured_step(system, y0, h, y_max, *, axes):
    r"""One Rodas4 step of every member, `B = diag(d) + U U^T`
    (`LowRankInteractions`, or `DiagonalInteractions`: no `U`), as batched
    arithmetic: `(y1, err, H)` with `H` of shape `(n, r, p)`; `axes` those of
    the leaves of `system`.

    The same step as `_member_step` (`rosenbrock_stages` with the Woodbury
    solve of `LowRankInteractions.rosenbrock_solver`), with the products by `U`
    of the field and of the Woodbury solve merged, one product per stage
    instead of two: with $w = \gamma h\, m / a$, $a = 1 + \gamma h\, d\, m$ and $P = U^T
    \mathrm{diag}(w)\, U$, a stage with $v = r - \delta - d\, m_s + \sum_j C_{ij}
    k_j / h$ is $k = (\gamma h / a)\,(v - U (s_1 + c))$ with $s_1 = U^T m_s$,
    $s_2 = U^T (w v)$ and $c = (I + P)^{-1} (s_2 - P s_1)$. On 64 members of 64
    modes this cut the step's time by 15-30% (fewer, larger kernels)."""
    tab = RODAS4
    r, inter, decay = system
    ax_r, ax_inter, ax_decay = _in_axes(system, axes)
    row = lambda x, ax: x if ax == 0 else x[None]  # (n or 1, ...)
    r, d = row(r, ax_r), row(inter.d, ax_inter.d)
    decay = decay[:, None] if ax_decay == 0 else decay
    n = y0.shape[0]
    # a DiagonalInteractions has no columns
    low_rank = isinstance(inter, LowRankInteractions)
    q = inter.U.shape[-1] if low_rank else 0
    if q:
        U, shared = row(inter.U, ax_inter.U), ax_inter.U is None

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


def _controller(y0, y1, err, h, active, rtol, atol):
    """`(accept, dt_next)`: diffrax's `PIDController` defaults in the max norm over
    modes, per member; a non-finite error is a rejection by the largest factor."""
    y1 = jnp.where(jnp.isnan(y1), y0, y1)
    scale = atol + rtol * jnp.maximum(jnp.abs(y0), jnp.abs(y1))
    e = _max_last(jnp.abs(err) / scale)
    e = jnp.where(jnp.isnan(e), jnp.inf, e)
    accept = (e < 1) & active
    factor = jnp.clip(
        _SAFETY * e ** (-1.0 / _ERROR_ORDER),
        jnp.where(accept, 1.0, _FACTOR_MIN),
        jnp.where(accept, _FACTOR_MAX, _SAFETY),
    )
    return accept, h * factor.astype(h.dtype)


def _write_outputs(times, t0, h, y0, y1, H, accept, idx, out):
    """Every output time in `(t0, t0 + h]` of the members' accepted steps, from
    the dense output, one per member at a time; masked writes go to the extra
    last row of `out` (`(n, T + 1, p)`), so nothing selects over `out`."""
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


def _loop_setup(system, axes, dtype, times):
    """What every loop over the batch shares: `(step, y_max, t_end, t_floor)`."""
    y_max = jnp.asarray(exponent_clip(dtype), dtype)
    t_end = times[-1]
    # as diffrax, end a step at t_end when it would stop within 100 ULPs of it
    t_floor = t_end
    for _ in range(100):
        t_floor = jnp.nextafter(t_floor, jnp.asarray(-jnp.inf, dtype))
    if isinstance(system[1], (DiagonalInteractions, LowRankInteractions)):
        # diagonal plus low rank: the products of the stages merged, batched
        step = functools.partial(_structured_step, axes=axes)
    else:  # any other form (dense: an LU per member): member by member
        step = jax.vmap(_member_step, in_axes=(_in_axes(system, axes), 0, 0, None))
    return step, y_max, t_end, t_floor


def _attempt(setup, system, rtol, atol, t, dt, y, active):
    """One attempted step of every member from `(t, dt, y)`: `(h, y1, H, accept,
    (t, dt, y) after it)`, the state moved on where the step is accepted and `dt`
    the controller's next where `active`. Inactive members idle on a unit step."""
    step, y_max, t_end, t_floor = setup
    t1 = jnp.where(t + dt > t_floor, t_end, t + dt)
    h = jnp.where(active, t1 - t, 1.0)
    y1, err, H = step(system, y, h, y_max)
    accept, dt_next = _controller(y, y1, err, h, active, rtol, atol)
    after = (
        jnp.where(accept, t1, t),
        jnp.where(active, dt_next, dt),
        jnp.where(accept[:, None], y1, y),
    )
    return h, y1, H, accept, after


def _pack(y, *scalars):
    """One row per member: `y` `(n, p)` followed by the scalars, each `(n,)` (an
    output index is exact as a float), so that a record is one write."""
    cols = jnp.stack([x.astype(y.dtype) for x in scalars], axis=-1)
    return jnp.concatenate([y, cols], axis=-1)


def _unpack(rows):
    """`(y, a, b, idx)` of rows packed by `_pack(y, a, b, idx)`."""
    p = rows.shape[-1] - 3
    idx = rows[..., p + 2].astype(jnp.int32)
    return rows[..., :p], rows[..., p], rows[..., p + 1], idx


def _empty_records(n, seg, p, dtype):
    """`(n, seg, p + 3)` records `(y, t, h, idx)`, with `h = 1` in the slots that
    stay empty (they are masked, but must not divide by zero)."""
    return jnp.zeros((n, seg, p + 3), dtype).at[..., p + 1].set(1)


def _integrate_loop(system, axes, y0, times, t_start, dt0, rtol, atol, max_steps, seg):
    """The fused loop over one chunk of members. With `seg` (an int), it also
    records what the discrete adjoint needs: the state `(t, dt, y, idx)` after
    every `seg`-th accepted step of each member (the checkpoints, slot 0 the
    start), and the accepted steps of the first segment `(y, t, h, idx)`."""
    n, p = y0.shape
    T = times.shape[0]
    dtype = y0.dtype
    setup = _loop_setup(system, axes, dtype, times)
    t_end = setup[2]
    rows = jnp.arange(n)
    record = seg is not None

    def cond(carry):
        t, it = carry[0], carry[7]
        return jnp.any(t < t_end) & (it < max_steps)

    def body(carry):
        t, dt, y, idx, out, n_acc, n_rej, it, rec = carry
        active = t < t_end
        h, y1, H, accept, after = _attempt(setup, system, rtol, atol, t, dt, y, active)
        idx_new, out = _write_outputs(times, t, h, y, y1, H, accept, idx, out)
        if record:
            first, ckpt = rec
            # the first segment's accepted steps; masked writes are dropped
            slot = jnp.where(accept & (n_acc < seg), n_acc, seg)
            first = first.at[rows, slot].set(_pack(y, t, h, idx), mode="drop")
        t, dt, y = after
        n_acc = n_acc + accept
        n_rej = n_rej + (active & ~accept)
        if record:
            slot = jnp.where(accept & (n_acc % seg == 0), n_acc // seg, ckpt.shape[1])
            ckpt = ckpt.at[rows, slot].set(_pack(y, t, dt, idx_new), mode="drop")
            rec = (first, ckpt)
        return t, dt, y, idx_new, out, n_acc, n_rej, it + 1, rec

    zeros = jnp.zeros(n, jnp.int32)
    out = jnp.full((n, T + 1, p), jnp.nan, dtype)
    # an output at the start time itself is the initial value
    at_start = times[0] <= t_start
    out = out.at[:, 0].set(jnp.where(at_start[:, None], y0, jnp.nan))
    idx0 = at_start.astype(jnp.int32)
    rec = None
    if record:
        k = -(-max_steps // seg) + 1
        first = _empty_records(n, seg, p, dtype)
        ckpt = jnp.zeros((n, k, p + 3), dtype)
        ckpt = ckpt.at[:, 0].set(_pack(y0, t_start, dt0, idx0))
        rec = (first, ckpt)
    init = (t_start, dt0, y0, idx0, out, zeros, zeros, 0, rec)
    t, _, y, _, out, n_acc, n_rej, _, rec = jax.lax.while_loop(cond, body, init)
    return (out[:, :T], t, y, n_acc, n_rej), rec


def _recompute_segment(setup, system, times, rtol, atol, seg, state, count):
    """The accepted steps `(y, t, h, idx)`, each `(n, seg, ...)`, of one segment
    of every member, re-run from its checkpoint `state = (t, dt, y, idx)` for
    `count` `(n,)` accepted steps (0: the member idles)."""
    t, dt, y, idx = state
    n, p = y.shape
    t_end = setup[2]
    rows = jnp.arange(n)

    def cond(carry):
        return jnp.any(carry[4] < count)

    def body(carry):
        t, dt, y, idx, c, bufs = carry
        active = (c < count) & (t < t_end)
        h, _, _, accept, after = _attempt(setup, system, rtol, atol, t, dt, y, active)
        slot = jnp.where(accept, c, seg)
        bufs = bufs.at[rows, slot].set(_pack(y, t, h, idx), mode="drop")
        idx = jnp.where(
            accept, jnp.searchsorted(times, t + h, side="right").astype(idx.dtype), idx
        )
        t, dt, y = after
        c = c + accept
        # a member that reached the end stops counting (the forward pass's steps
        # are reproduced, so this guards against a loop that would not end)
        c = jnp.where(t >= t_end, jnp.maximum(c, count), c)
        return t, dt, y, idx, c, bufs

    bufs = _empty_records(n, seg, p, y.dtype)
    init = (t, dt, y, idx, jnp.zeros(n, count.dtype), bufs)
    return jax.lax.while_loop(cond, body, init)[-1]


def _output_cotangents(times, out_bar, record, count, r):
    r"""The cotangents that the outputs inside the accepted steps of one segment
    send to each step's `(y0, y1, H)`, each `(n, seg, ...)`, by one scatter over
    the outputs: output `k` lies in the last step `i` whose first output index is
    at most `k`, at $\theta_k = (t_k - t_{0,i}) / h_i$, and the dense output
    $(1-\theta) y_0 + \theta\,(y_1 + (1-\theta) \sum_j \theta^j H_j)$ is linear
    in them."""
    y0, t0, h, idx = record
    n, seg, p = y0.shape
    T = times.shape[0]
    valid = jnp.arange(seg)[None] < count[:, None]
    starts = jnp.where(valid, idx, T + 1)  # sorted along each member's steps
    last = jnp.maximum(count - 1, 0)
    pick = lambda x: jnp.take_along_axis(x, last[:, None], axis=1)[:, 0]
    end = jnp.where(
        count > 0,
        jnp.searchsorted(times, pick(t0) + pick(h), side="right"),
        0,
    )
    k = jnp.arange(T)
    step = jax.vmap(lambda s: jnp.searchsorted(s, k, side="right"))(starts) - 1
    inside = (k[None] >= starts[:, :1]) & (k[None] < end[:, None]) & (step >= 0)
    step = jnp.clip(step, 0, seg - 1)
    t0_k = jnp.take_along_axis(t0, step, axis=1)
    h_k = jnp.take_along_axis(h, step, axis=1)
    theta = ((times[None] - t0_k) / h_k)[..., None]  # (n, T, 1)
    o = jnp.where(inside[..., None], out_bar, 0.0)
    rows = jnp.arange(n)[:, None]
    slot = jnp.where(inside, step, seg)  # outside: dropped
    zeros = jnp.zeros((n, seg, p), o.dtype)
    add = lambda w: zeros.at[rows, slot].add(w, mode="drop")
    y0_bar = add((1 - theta) * o)
    y1_bar = add(theta * o)
    H_bar = jnp.stack(
        [add(theta * (1 - theta) * theta**j * o) for j in range(r)], axis=1
    )  # (n, r, seg, p)
    return y0_bar, y1_bar, H_bar


def _adjoint_step(setup, system, record, dense_bar, ybar, sys_bar, i, active):
    r"""The cotangents through accepted step `i` of the records `(y, t, h, idx)`
    (masked by `active`): `dense_bar` those of the outputs inside the steps (see
    `_output_cotangents`), then through the Rodas4 step. Returns `(ybar,
    sys_bar)` before the step."""
    step, y_max = setup[0], setup[1]
    y0, h = record[0][:, i], record[2][:, i]
    y0_direct, y1_bar, H_bar = (
        dense_bar[0][:, i],
        dense_bar[1][:, i],
        dense_bar[2][:, :, i],
    )

    def run_step(system, y0):
        y1, _, H = step(system, y0, h, y_max)
        return y1, H  # (n, p), (n, r, p)

    _, vjp = jax.vjp(run_step, system, y0)
    mask = active[:, None]
    cot = (jnp.where(mask, ybar + y1_bar, 0.0), jnp.where(mask[..., None], H_bar, 0.0))
    s_bar, y0_bar = vjp(cot)
    sys_bar = jax.tree.map(jnp.add, sys_bar, s_bar)
    return jnp.where(mask, y0_bar + y0_direct, ybar), sys_bar


def _segment(max_steps: int) -> int:
    """The accepted steps per segment of the discrete adjoint, `ceil(sqrt(
    max_steps))`: as many as the checkpoints, which balances the two buffers."""
    return math.isqrt(max_steps - 1) + 1


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 8, 9))
def _integrate_chunk(system, axes, y0, times, t_start, dt0, rtol, atol, max_steps, seg):
    """`_integrate_loop` without records: the logs at `times` `(c, T, p)` (NaN
    where not reached), the time and state where each member stopped, and the
    accepted and rejected step counts. Reverse-mode differentiable in `system`
    and `y0` by the discrete adjoint of the loop (`_chunk_bwd`)."""
    return _integrate_loop(
        system, axes, y0, times, t_start, dt0, rtol, atol, max_steps, None
    )[0]


_NOT_DIFFERENTIABLE = (
    "`solve_lv_batch` differentiates its solution with respect to the system "
    "`lv` and `m0`, with the steps it took held fixed; it is not differentiable "
    "with respect to `{}` (pass it as a constant, e.g. through "
    "`jax.lax.stop_gradient`, or use `solve_lv`)."
)


def _chunk_fwd(system, axes, y0, times, t_start, dt0, rtol, atol, max_steps, seg):
    for name, x in (
        ("ts", times),
        ("t0", t_start),
        ("dt0", dt0),
        ("atol", atol),
        ("rtol", rtol),
    ):
        if x.perturbed:
            raise ValueError(_NOT_DIFFERENTIABLE.format(name))
    system, y0, times, t_start, dt0, rtol, atol = jax.tree.map(
        lambda x: x.value,
        (system, y0, times, t_start, dt0, rtol, atol),
        is_leaf=lambda x: isinstance(x, jax.custom_derivatives.CustomVJPPrimal),
    )
    outs, rec = _integrate_loop(
        system, axes, y0, times, t_start, dt0, rtol, atol, max_steps, seg
    )
    return outs, (system, times, rtol, atol, outs[3], rec)


def _chunk_bwd(axes, max_steps, seg, residuals, cotangents):
    r"""The discrete adjoint of the loop: the accepted steps, last first, each
    through the VJP of its Rodas4 step and of the dense output of the outputs
    inside it. Segments of `seg` accepted steps are re-run from their
    checkpoints (the first one is recorded by the forward pass), so memory is
    `O(seg + max_steps / seg)` states per member and a solve within one segment
    is not re-run."""
    system, times, rtol, atol, n_acc, (first, ckpt) = residuals
    out_bar = cotangents[0]
    n, T, p = out_bar.shape
    dtype = first.dtype
    if isinstance(out_bar, jax.custom_derivatives.SymbolicZero):
        out_bar = jnp.zeros((n, T, p), dtype)
    setup = _loop_setup(system, axes, dtype, times)
    n_seg = -(-n_acc // seg)  # (n,)
    sys_bar0 = jax.tree.map(jnp.zeros_like, system)

    def segment(carry):
        j, ybar, sys_bar = carry
        j = j - 1
        count = jnp.clip(n_acc - j * seg, 0, seg)
        y_c, t_c, dt_c, idx_c = _unpack(ckpt[:, j])
        state = (t_c, dt_c, y_c, idx_c)
        record = jax.lax.cond(
            j == 0,
            lambda: first,
            lambda: _recompute_segment(
                setup, system, times, rtol, atol, seg, state, count
            ),
        )
        record = _unpack(record)

        dense_bar = _output_cotangents(times, out_bar, record, count, len(RODAS4.H))

        def step_back(carry):
            i, ybar, sys_bar = carry
            i = i - 1
            ybar, sys_bar = _adjoint_step(
                setup, system, record, dense_bar, ybar, sys_bar, i, i < count
            )
            return i, ybar, sys_bar

        _, ybar, sys_bar = jax.lax.while_loop(
            lambda c: c[0] > 0, step_back, (jnp.max(count), ybar, sys_bar)
        )
        return j, ybar, sys_bar

    init = (jnp.max(n_seg), jnp.zeros((n, p), dtype), sys_bar0)
    _, ybar, sys_bar = jax.lax.while_loop(lambda c: c[0] > 0, segment, init)
    # an output at the start time is the initial value itself
    at_start = times[0] <= ckpt[:, 0, -3]
    ybar = ybar + jnp.where(at_start[:, None], out_bar[:, 0], 0.0)
    return sys_bar, ybar, None, None, None, None, None


_integrate_chunk.defvjp(_chunk_fwd, _chunk_bwd, symbolic_zeros=True)


def _loss(system, axes, m):
    """`lv.loss(m)` per member, `m` of shape `(n, T, p)`; `system` and `axes` as
    `_solve_batch`'s."""

    def one(r, interactions, scale, offset, m):
        quad = interactions.quadratic(m)
        return scale * (0.5 * quad - m @ r) + offset

    ax_r, ax_inter, _, ax_scale, ax_offset = _in_axes(system, axes)
    in_axes = (ax_r, ax_inter, ax_scale, ax_offset, 0)
    r, inter, _, scale, offset = system
    return jax.vmap(one, in_axes=in_axes)(r, inter, scale, offset, m)


@functools.partial(jax.jit, static_argnames=("axes", "max_steps", "chunk"))
def _solve_batch(system, axes, y0, times, t_start, dt0, rtol, atol, max_steps, chunk):
    """`_integrate_chunk` over the batch in chunks of `chunk` members (one after
    another, so that a chunk's state stays in cache), then `m`, the loss, the
    stats and which members reached the end. `system`: the fields `_FIELDS +
    _LOSS_FIELDS` of the systems, their leaves batched along the static `axes`
    (see `_batched`)."""
    n, p = y0.shape
    dtype = y0.dtype
    n_chunks = -(-n // chunk)
    pad = n_chunks * chunk - n

    def split(x, axis):  # (n, ...) -> (n_chunks, chunk, ...), padded with member 0
        if axis is None:
            return None
        x = jnp.concatenate([x, jnp.repeat(x[:1], pad, axis=0)]) if pad else x
        return x.reshape(n_chunks, chunk, *x.shape[1:])

    fields = system[: len(_FIELDS)]
    leaves, treedef = jax.tree.flatten(fields)
    field_axes = axes[: len(leaves)]
    batched = [split(x, ax) for x, ax in zip(leaves, field_axes)]
    per_chunk = (batched, split(y0, 0), split(t_start, 0), split(dt0, 0))

    def run(args):
        chunk_leaves, y0_c, t_start_c, dt0_c = args
        sys_c = jax.tree.unflatten(
            treedef,
            [
                x if ax is None else f
                for x, f, ax in zip(leaves, chunk_leaves, field_axes)
            ],
        )
        return _integrate_chunk(
            sys_c,
            field_axes,
            y0_c,
            times,
            t_start_c,
            dt0_c,
            rtol,
            atol,
            max_steps,
            _segment(max_steps),
        )

    outs = jax.lax.map(run, per_chunk)
    y, t_stop, y_stop, n_acc, n_rej = (
        x.reshape(n_chunks * chunk, *x.shape[2:])[:n] for x in outs
    )
    ok = t_stop >= times[-1]
    y = jnp.where(ok[:, None, None], y, jnp.nan)
    # moving: not dying below the floor, and the log would still change by more
    # than 1 before the last time at its rate when the solver stopped
    y_min = _log_floor(dtype)
    y_max = jnp.asarray(exponent_clip(dtype), dtype)
    rate_axes = (0, (*_in_axes(fields, field_axes), None))
    rate = jax.vmap(_rates, in_axes=rate_axes)(y_stop, (*fields, y_max))
    dying = (y_stop <= y_min) & (rate < 0)
    moving = ~dying & (jnp.abs(rate) * (times[-1] - t_stop)[:, None] > 1)
    m = jnp.where(y <= y_min, jnp.zeros_like(y), jnp.exp(y))
    loss = _loss(system, axes, m)
    stats = {
        "num_steps": n_acc + n_rej,
        "num_accepted_steps": n_acc,
        "num_rejected_steps": n_rej,
        "moving": moving,
    }
    return m, loss, stats, ok


def solve_lv_batch(
    lv: LotkaVolterra,
    m0: Float[ArrayLike, "n p"],
    ts: Float[ArrayLike, " T"],
    *,
    t0: float | None = 0.0,
    rtol: float | None = None,
    atol: float | None = None,
    dt0: float | None = None,
    max_steps: int = 100_000,
    throw: bool = True,
    chunk_size: int | None = None,
) -> Solution:
    r"""Integrate a batch of Lotka-Volterra systems in log space, in one loop.

    The same solve as `jax.vmap(solve_lv)` with `solve_lv`'s default solver and
    controller (Rodas4 with the analytic Jacobian, `LVRosenbrock`; diffrax's
    `PIDController` in the max norm over modes, on $y = \log m$), written as one
    fused loop over the batch: each member keeps its own time and step size,
    accepted and rejected steps are masks on the per-member state, and the
    outputs inside an accepted step are filled from Rodas4's dense output. A
    member that has reached `ts[-1]` idles until the last one has; every member
    takes the steps it would take alone.

    The model is `solve_lv`'s at unit learning rate: `ts` are times of `lv`
    itself (no schedule, momentum or custom solver; use `solve_lv` for those).
    Called outside `jax.jit`, the checks run on the host and the compiled loop
    holds no host callback, so it can be kept in JAX's persistent compilation
    cache.

    **Gradients.** `jax.grad` (reverse mode) differentiates the solution with
    respect to the fields of `lv` and `m0` by the discrete adjoint of the loop:
    the accepted steps are taken as fixed (as the step-size controller's choices
    are not part of the model), and each is run backwards through the VJP of its
    Rodas4 step and of the dense output of the outputs inside it. This is the
    derivative of the numerical solution, which converges to the true one with
    the tolerance. The forward pass stores the state after every
    `ceil(sqrt(max_steps))`-th accepted step and the steps of the first such
    segment, and the backward pass re-runs each later segment from its
    checkpoint: memory `O(sqrt(max_steps) p)` per member, and a solve that fits
    in one segment is not re-run. On a 64-mode system a gradient costs about
    three forward solves, against five for `jax.grad` through `solve_lv`
    (`benchmarks/gradients.py`). Differentiating with respect to `ts`, `t0`,
    `dt0`, `atol` or `rtol` raises a `ValueError`; forward mode (`jax.jvp`) is
    not supported: use `solve_lv` (with `diffrax.ForwardMode()`) for it.

    **Arguments:**

    - `lv`: the systems: a `LotkaVolterra` whose fields each either describe one
      system shared by the batch, or carry a leading batch axis of size `n`
      (e.g. built under `jax.vmap`). Dense or structured `B`.
    - `m0`: initial values, shape `(n, p)`, finite and at least the smallest
      normal number of the dtype.
    - `ts`: output times, shape `(T,)`, strictly increasing, `ts[0] >= t0`.
    - `t0`: the time at which `m = m0` (default 0; `None` means `ts[0]`).
    - `rtol`, `atol`: tolerances on `log m`, with `solve_lv`'s defaults (`atol`
      1e-9 in float64 and 1e-5 in float32, `rtol = atol / |log floor|`).
    - `dt0`: the first step (default per member, as `solve_lv`).
    - `max_steps`: the most steps (accepted and rejected) any member may take.
    - `throw`: raise if a member did not reach `ts[-1]` within `max_steps`.
      With `throw=False` such a member's `ys` and `loss` are NaN and its
      `result` is `diffrax.RESULTS.max_steps_reached`.
    - `chunk_size`: how many members step together (default: all); the chunks
      run one after another, each until its own last member is done. Smaller
      chunks keep their state in the CPU's cache: for 256 members of 64 modes,
      chunks of 64 ran 1.6x faster than the whole batch on a loaded machine,
      but 1.2x slower on a quiet one. The results do not depend on it.

    **Returns:** a `Solution` with a leading batch axis on every field, as
    `jax.vmap(solve_lv)` returns it: `ts` `(n, T)`, `ys = m(ts)` `(n, T, p)`
    (`0` for a mode below the floor of the dtype), `loss` `(n, T)`, `stats`
    (`num_steps`, `num_accepted_steps`, `num_rejected_steps` `(n,)`, `moving`
    `(n, p)`) and `result` `(n,)`.

    **Raises:** `ValueError` for `m0` not of shape `(n, p)`, a field of `lv`
    that is neither one system's shape nor that with a leading `n`, `m0` not
    finite or below the smallest normal number, `ts` empty, not increasing or
    before `t0`, a negative or non-finite tolerance, `max_steps < 1` or
    `chunk_size < 1` (traced values: at run time, through `eqx.error_if`);
    a `RuntimeError` naming `max_steps` (and, called eagerly, the members: an
    `eqx.EquinoxRuntimeError`) when `throw` and a member ran out of steps.
    """
    m0 = jnp.asarray(m0)
    if m0.ndim != 2:
        raise ValueError(
            f"`m0` must have shape (n, p): one row of initial values per member, "
            f"got shape {m0.shape}."
        )
    n, p = m0.shape
    if lv.r.shape[-1] != p:
        raise ValueError(
            f"`m0` has {p} modes per member but `lv.r` has shape {lv.r.shape}."
        )
    system, axes = _batched(lv, n, p)
    dtype = jnp.result_type(lv.r.dtype, m0.dtype, float)
    m0 = _check_m0(m0, dtype)
    ts, t_start = check_times(ts, dtype, t0)
    max_steps = static_int("max_steps", max_steps, minimum=1)
    chunk = n if chunk_size is None else static_int("chunk_size", chunk_size)
    chunk = min(chunk, n)
    default_rtol, default_atol = _default_tolerances(dtype, atol)
    rtol = default_rtol if rtol is None else rtol
    atol = default_atol if atol is None else atol
    for bad, msg in _tolerance_checks(rtol, atol):
        ts = error_if(ts, bad, msg)
    system = jax.tree.map(lambda x: x.astype(dtype), system)
    if dt0 is None:
        # the first step is a choice of the solver, held fixed under
        # differentiation as every other step
        dt0 = jax.lax.stop_gradient(_first_step(system, axes, m0))
    y, loss, stats, ok = _solve_batch(
        system,
        axes,
        jnp.log(m0),
        ts,
        jnp.broadcast_to(t_start, (n,)),
        jnp.broadcast_to(jnp.asarray(dt0, dtype), (n,)),
        jnp.asarray(rtol, dtype),
        jnp.asarray(atol, dtype),
        max_steps,
        chunk,
    )
    if throw:
        if is_concrete(ok):
            if not np.all(np.asarray(ok)):
                bad = np.flatnonzero(~np.asarray(ok)).tolist()
                raise eqx.EquinoxRuntimeError(_MAX_STEPS_MSG.format(max_steps, bad))
        else:
            y = error_if(
                y, ~jnp.all(ok), _MAX_STEPS_MSG.format(max_steps, "some"), RuntimeError
            )
    result = jax.vmap(
        lambda ok: diffrax.RESULTS.where(
            ok, diffrax.RESULTS.successful, diffrax.RESULTS.max_steps_reached
        )
    )(ok)
    return Solution(jnp.broadcast_to(ts, (n, ts.shape[0])), y, loss, stats, result)


@functools.partial(jax.jit, static_argnames="axes")
def _first_step(system, axes, m0):
    """`solve_lv`'s first step per member: `1e-2 / (max|r| + max|B| max(m0))`
    (`max|B|` is the largest diagonal entry: `B` is PSD). `system` and `axes` as
    `_solve_batch`'s; one compiled call (eagerly, its ops would be ten)."""
    r, inter = system[0], system[1]
    ax_r, ax_inter = _in_axes(system, axes)[:2]
    r_max = jnp.max(jnp.abs(r if ax_r == 0 else r[None]), axis=-1)
    diagonal = jax.vmap(
        lambda inter: inter.diagonal(), in_axes=(ax_inter,), axis_size=m0.shape[0]
    )(inter)
    scale = r_max + jnp.max(diagonal, axis=-1) * jnp.max(m0, axis=-1)
    return 1e-2 / jnp.maximum(scale, jnp.finfo(m0.dtype).tiny)
