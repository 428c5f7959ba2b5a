r"""The reverse-mode derivative of `solve_lv_batch`'s fused loop (private
module): `integrate_chunk`, the loop as a `jax.custom_vjp` whose backward pass
is the discrete adjoint of the loop, with checkpoints every
`ceil(sqrt(max_steps))` accepted steps.
"""

import functools
import math

import jax
import jax.numpy as jnp

from ._lv_batch_loop import (
    StepRecord,
    StepState,
    integrate_loop,
    loop_setup,
    recompute_segment,
)
from ._rosenbrock import RODAS4


def segment_length(max_steps: int) -> int:
    """The accepted steps per segment of the discrete adjoint, `ceil(sqrt(
    max_steps))`: as many as the checkpoints, which balances the two buffers."""
    return math.isqrt(max_steps - 1) + 1


def _output_cotangents(times, out_bar, record: StepRecord, count, r):
    r"""The cotangents that the outputs inside the accepted steps of one segment
    send to each step's `(y0, y1, H)`, each `(n, seg, ...)`, by one scatter over
    the outputs: output `k` lies in the last step `i` whose first output index is
    at most `k`, at $\theta_k = (t_k - t_{0,i}) / h_i$, and the dense output
    $(1-\theta) y_0 + \theta\,(y_1 + (1-\theta) \sum_j \theta^j H_j)$ is linear
    in them."""
    t0, h = record.t, record.h
    n, seg, p = record.y.shape
    T = times.shape[0]
    valid = jnp.arange(seg)[None] < count[:, None]
    starts = jnp.where(valid, record.idx, T + 1)  # sorted along each member's steps
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


def _adjoint_step(setup, lv, record: StepRecord, dense_bar, ybar, lv_bar, i, active):
    r"""The cotangents through accepted step `i` of `record` (masked by
    `active`): `dense_bar` those of the outputs inside the steps (see
    `_output_cotangents`), then through the Rodas4 step. Returns `(ybar,
    lv_bar)` before the step."""
    y0, h = record.y[:, i], record.h[:, i]
    y0_direct, y1_bar, H_bar = (
        dense_bar[0][:, i],
        dense_bar[1][:, i],
        dense_bar[2][:, :, i],
    )

    def run_step(lv, y0):
        y1, _, H = setup.step(lv, y0, h, setup.y_max)
        return y1, H  # (n, p), (n, r, p)

    _, vjp = jax.vjp(run_step, lv, y0)
    mask = active[:, None]
    cot = (jnp.where(mask, ybar + y1_bar, 0.0), jnp.where(mask[..., None], H_bar, 0.0))
    s_bar, y0_bar = vjp(cot)
    lv_bar = jax.tree.map(jnp.add, lv_bar, s_bar)
    return jnp.where(mask, y0_bar + y0_direct, ybar), lv_bar


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 5, 6))
def integrate_chunk(lv, axes, pid, start: StepState, times, max_steps, seg):
    """`integrate_loop` without records: the logs at `times` `(c, T, p)` (NaN
    where not reached), the `StepState` where each member stopped, and the
    accepted and rejected step counts. Reverse-mode differentiable in `lv` and
    `start.y` by the discrete adjoint of the loop (`_chunk_bwd`)."""
    carry = integrate_loop(lv, axes, pid, start, times, max_steps, None)
    return carry.out[:, :-1], carry.state, carry.n_acc, carry.n_rej


_NOT_DIFFERENTIABLE = (
    "`solve_lv_batch` differentiates its solution with respect to the system "
    "`lv` and `m0`, with the steps it took held fixed; it is not differentiable "
    "with respect to `{}` (pass it as a constant, e.g. through "
    "`jax.lax.stop_gradient`, or use `solve_lv`)."
)


def _chunk_fwd(lv, axes, pid, start, times, max_steps, seg):
    for name, x in (
        ("ts", times),
        ("t0", start.t),
        ("dt0", start.dt),
        ("atol", pid.atol),
        ("rtol", pid.rtol),
        ("stepsize_controller.dtmax", pid.dtmax),
    ):
        if x is not None and x.perturbed:
            raise ValueError(_NOT_DIFFERENTIABLE.format(name))
    lv, pid, start, times = jax.tree.map(
        lambda x: x.value,
        (lv, pid, start, times),
        is_leaf=lambda x: isinstance(x, jax.custom_derivatives.CustomVJPPrimal),
    )
    carry = integrate_loop(lv, axes, pid, start, times, max_steps, seg)
    outs = carry.out[:, :-1], carry.state, carry.n_acc, carry.n_rej
    return outs, (lv, pid, times, carry.n_acc, carry.first, carry.ckpt)


def _chunk_bwd(axes, max_steps, seg, residuals, cotangents):
    r"""The discrete adjoint of the loop: the accepted steps, last first, each
    through the VJP of its Rodas4 step and of the dense output of the outputs
    inside it. Segments of `seg` accepted steps are re-run from their
    checkpoints (the first one is recorded by the forward pass), so memory is
    `O(seg + max_steps / seg)` states per member and a solve within one segment
    is not re-run."""
    lv, pid, times, n_acc, first, ckpt = residuals
    out_bar = cotangents[0]
    n, T, p = first.y.shape[0], times.shape[0], first.y.shape[-1]
    dtype = first.y.dtype
    if isinstance(out_bar, jax.custom_derivatives.SymbolicZero):
        out_bar = jnp.zeros((n, T, p), dtype)
    setup = loop_setup(lv, axes, dtype, times)
    n_seg = -(-n_acc // seg)  # (n,)

    def segment(carry):
        j, ybar, lv_bar = carry
        j = j - 1
        count = jnp.clip(n_acc - j * seg, 0, seg)
        record = jax.lax.cond(
            j == 0,
            lambda: first,
            lambda: recompute_segment(
                setup, lv, pid, times, seg, jax.tree.map(lambda x: x[:, j], ckpt), count
            ),
        )
        dense_bar = _output_cotangents(times, out_bar, record, count, len(RODAS4.H))

        def step_back(carry):
            i, ybar, lv_bar = carry
            i = i - 1
            ybar, lv_bar = _adjoint_step(
                setup, lv, record, dense_bar, ybar, lv_bar, i, i < count
            )
            return i, ybar, lv_bar

        _, ybar, lv_bar = jax.lax.while_loop(
            lambda c: c[0] > 0, step_back, (jnp.max(count), ybar, lv_bar)
        )
        return j, ybar, lv_bar

    init = (jnp.max(n_seg), jnp.zeros((n, p), dtype), jax.tree.map(jnp.zeros_like, lv))
    _, ybar, lv_bar = jax.lax.while_loop(lambda c: c[0] > 0, segment, init)
    # an output at the start time is the initial value itself
    at_start = times[0] <= ckpt.t[:, 0]
    ybar = ybar + jnp.where(at_start[:, None], out_bar[:, 0], 0.0)
    start_bar = StepState(None, None, ybar, None)
    return lv_bar, None, start_bar, None


integrate_chunk.defvjp(_chunk_fwd, _chunk_bwd, symbolic_zeros=True)
