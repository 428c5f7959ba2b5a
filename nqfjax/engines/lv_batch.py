r"""A batch of Lotka-Volterra systems in one fused loop: `solve_lv_batch`.

`jax.vmap(solve_lv)` runs diffrax's loop under `vmap`, which selects the whole
carried state (and the saved outputs) between accepted and rejected steps at
every step. Here one `lax.while_loop` steps every member at once with its own
step size (`_lv_batch_loop`); its reverse-mode derivative is the discrete
adjoint of the loop (`_lv_batch_adjoint`). This module holds the public
function: its checks, the batch axes of the system, the chunks and the
statistics.
"""

import functools
import warnings

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import ArrayLike, Float

from .._checks import error_if, is_concrete, static_int
from ..tasks.lotka_volterra import LotkaVolterra
from ._integrate import Solution, check_times, tolerance_checks
from ._lv_batch_adjoint import integrate_chunk, segment_length
from ._lv_batch_loop import StepState, in_axes
from ._lv_common import (
    PIDConstants,
    check_m0,
    default_tolerances,
    first_step,
    max_norm,
    modes,
    moving,
    pid_constants,
    rates,
)
from ._rosenbrock import RODAS4, exponent_clip


_MAX_STEPS_MSG = (
    "The solver took `max_steps` = {} steps without reaching the last time of "
    "`ts` for members {} of the batch. Increase `max_steps`, or loosen `atol` "
    "(with `throw=False` the Solution's `result` marks the members and "
    "`stats['moving']` the modes that were still moving)."
)
_DEPRECATED_TOLERANCES = (
    "`solve_lv_batch(rtol=, atol=)` is deprecated: pass "
    "stepsize_controller=diffrax.PIDController(rtol=..., atol=...) (with `atol` "
    "alone, the default `rtol` was atol / |log floor of the dtype|)."
)


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


def _batch_axes(lv: LotkaVolterra, n: int, p: int) -> tuple:
    """The batch axis of each leaf of `lv`, in the order of `jax.tree.leaves`
    (0 for a leaf given per member, None for one shared by the batch), checking
    that each has the shape of one system of `p` modes, or that with a leading
    `n`."""
    paths = jax.tree_util.tree_flatten_with_path(lv.interactions)[0]
    named = [("r", lv.r, 1)]
    named += [
        ("interactions" + jax.tree_util.keystr(path), leaf, k)
        for (path, leaf), k in zip(paths, lv.interactions._unbatched_ndims)
    ]
    named += [(k, getattr(lv, k), 0) for k in ("decay", "loss_scale", "loss_offset")]
    axes = tuple(_leaf_axis(name, x, k, n, p) for name, x, k in named)
    assert len(axes) == len(jax.tree.leaves(lv)), "a field of lv is not read"
    return axes


def _split(x, axis, chunk: int):
    """`x` `(n, ...)` as `(n_chunks, chunk, ...)`, padded with member 0; None
    for a leaf shared by the batch (`axis` None)."""
    if axis is None:
        return None
    pad = -x.shape[0] % chunk
    x = jnp.concatenate([x, jnp.repeat(x[:1], pad, axis=0)]) if pad else x
    return x.reshape(-1, chunk, *x.shape[1:])


@functools.partial(jax.jit, static_argnames=("axes", "max_steps", "chunk"))
def _solve_batch(lv, axes, pid, start: StepState, times, max_steps, chunk):
    """`integrate_chunk` over the batch in chunks of `chunk` members (one after
    another, so that a chunk's state stays in cache), then `m`, the loss, the
    stats and which members reached the end. `lv`: the systems, their leaves
    batched along the static `axes` (see `_batch_axes`)."""
    n, p = start.y.shape
    leaves, treedef = jax.tree.flatten(lv)
    per_chunk = (
        [_split(x, ax, chunk) for x, ax in zip(leaves, axes)],
        jax.tree.map(lambda x: _split(x, 0, chunk), start),
    )

    def run(args):
        chunk_leaves, start_c = args
        lv_c = jax.tree.unflatten(
            treedef,
            [x if ax is None else c for x, c, ax in zip(leaves, chunk_leaves, axes)],
        )
        seg = segment_length(max_steps)
        return integrate_chunk(lv_c, axes, pid, start_c, times, max_steps, seg)

    outs = jax.lax.map(run, per_chunk)
    y, stop, n_acc, n_rej = jax.tree.map(
        lambda x: x.reshape(-1, *x.shape[2:])[:n], outs
    )
    ok = stop.t >= times[-1]
    y = jnp.where(ok[:, None, None], y, jnp.nan)
    ax = in_axes(lv, axes)
    y_max = jnp.asarray(exponent_clip(y.dtype), y.dtype)
    rate = jax.vmap(
        lambda y, lv: rates(y, (lv.r, lv.interactions, lv.decay, y_max)),
        in_axes=(0, ax),
    )(stop.y, lv)
    m = modes(y)
    stats = {
        "num_steps": n_acc + n_rej,
        "num_accepted_steps": n_acc,
        "num_rejected_steps": n_rej,
        "moving": moving(stop.y, rate, (times[-1] - stop.t)[:, None]),
    }
    loss = jax.vmap(lambda lv, m: lv.loss(m), in_axes=(ax, 0))(lv, m)
    return m, loss, stats, ok


@functools.partial(jax.jit, static_argnames="axes")
def _first_step(lv, axes, m0):
    """`solve_lv`'s first step (`first_step`) per member; one compiled call
    (eagerly, its ops would be ten)."""
    ax = in_axes(lv, axes)
    return jax.vmap(
        lambda lv, m0: first_step(lv.r, lv.interactions, m0), in_axes=(ax, 0)
    )(lv, m0)


def _controller(stepsize_controller, rtol, atol, dtype) -> tuple[PIDConstants, list]:
    """The controller's constants in `dtype`, and the tolerance checks left for
    run time: `stepsize_controller`, or `solve_lv`'s default
    `diffrax.PIDController` in the max norm (dtype-aware tolerances, see
    `default_tolerances`), built from the deprecated `rtol`/`atol` when given."""
    if rtol is not None or atol is not None:
        if stepsize_controller is not None:
            raise ValueError(
                "Give the tolerances inside `stepsize_controller`, not also as "
                "`rtol`/`atol` (deprecated)."
            )
        warnings.warn(_DEPRECATED_TOLERANCES, DeprecationWarning, stacklevel=3)
    if stepsize_controller is None:
        default_rtol, default_atol = default_tolerances(dtype, atol)
        stepsize_controller = diffrax.PIDController(
            rtol=default_rtol if rtol is None else rtol,
            atol=default_atol if atol is None else atol,
            norm=max_norm,
        )
    pid = pid_constants(stepsize_controller, RODAS4.order, dtype)
    pending = tolerance_checks(stepsize_controller.rtol, stepsize_controller.atol)
    if pid.dtmax is not None:
        msg = "`stepsize_controller.dtmax` must be > 0."
        if not is_concrete(pid.dtmax):
            pending.append((~(pid.dtmax > 0), msg))
        elif not float(pid.dtmax) > 0:
            raise ValueError(msg + f" Got {float(pid.dtmax)}.")
    return pid, pending


def solve_lv_batch(
    lv: LotkaVolterra,
    m0: Float[ArrayLike, "n p"],
    ts: Float[ArrayLike, " T"],
    *,
    t0: float | None = 0.0,
    stepsize_controller: diffrax.PIDController | None = None,
    dt0: float | None = None,
    max_steps: int = 100_000,
    throw: bool = True,
    chunk_size: int | None = None,
    rtol: float | None = None,
    atol: float | None = None,
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
    holds no host callback (it can be kept in JAX's persistent cache).

    **Gradients.** `jax.grad` (reverse mode) differentiates the solution with
    respect to the fields of `lv` and `m0` by the discrete adjoint of the loop:
    the accepted steps are taken as fixed (as the step-size controller's choices
    are not part of the model), and each is run backwards through the VJP of its
    Rodas4 step and of the dense output of the outputs inside it. This is the
    derivative of the numerical solution, which converges to the true one with
    the tolerance. Checkpoints every `ceil(sqrt(max_steps))` accepted steps keep
    memory at `O(sqrt(max_steps) p)` per member; on a 64-mode system a gradient
    costs about three forward solves, against five for `jax.grad` through
    `solve_lv` (`benchmarks/gradients.py`). Differentiating with respect to `ts`, `t0`,
    `dt0` or the controller's tolerances raises a `ValueError`; forward mode
    (`jax.jvp`) is not supported: use `solve_lv` (with `diffrax.ForwardMode()`)
    for it.

    **Arguments:**

    - `lv`: the systems: a `LotkaVolterra` whose fields each either describe one
      system shared by the batch, or carry a leading batch axis of size `n`
      (e.g. built under `jax.vmap`). Any interactions.
    - `m0`: initial values, shape `(n, p)`, finite and at least the smallest
      normal number of the dtype.
    - `ts`: output times, shape `(T,)`, strictly increasing, `ts[0] >= t0`.
    - `t0`: the time at which `m = m0` (default 0; `None` means `ts[0]`).
    - `stepsize_controller`: a `diffrax.PIDController` on `log m`, e.g.
      `diffrax.PIDController(rtol=0.0, atol=1e-8)`. The fused loop reads its
      `rtol`, `atol`, `icoeff`, `safety`, `factormin`, `factormax`, `dtmax` and
      `error_order` (default: Rodas4's), and measures the error in the max norm
      over modes (its `norm` must be diffrax's default or `optimistix.max_norm`);
      a proportional or derivative part (`pcoeff`, `dcoeff`), `dtmin` or
      `step_ts`/`jump_ts` raise a `ValueError`. Default (`None`): `solve_lv`'s,
      `atol` 1e-9 in float64 and 1e-5 in float32 and `rtol = atol / |log
      floor|`.
    - `dt0`: the first step (default per member, as `solve_lv`).
    - `max_steps`: the most steps (accepted and rejected) any member may take.
    - `throw`: raise if a member did not reach `ts[-1]` within `max_steps`.
      With `throw=False` such a member's `ys` and `loss` are NaN and its
      `result` is `diffrax.RESULTS.max_steps_reached`.
    - `chunk_size`: how many members step together (default: all), chunk after
      chunk (for 256 members of 64 modes, chunks of 64 ran 1.6x faster on a
      loaded machine, 1.2x slower on a quiet one). The results do not depend
      on it.
    - `rtol`, `atol`: deprecated, the default controller's tolerances.

    **Returns:** a `Solution` with a leading batch axis on every field, as
    `jax.vmap(solve_lv)` returns it: `ts` `(n, T)`, `ys = m(ts)` `(n, T, p)`
    (`0` for a mode below the floor of the dtype), `loss` `(n, T)`, `stats`
    (`num_steps`, `num_accepted_steps`, `num_rejected_steps` `(n,)`, `moving`
    `(n, p)`) and `result` `(n,)`.

    **Raises:** `ValueError` for `m0` not of shape `(n, p)`, a field of `lv`
    that is neither one system's shape nor that with a leading `n`, `m0` not
    finite or below the smallest normal number, `ts` empty, not increasing or
    before `t0`, a negative or non-finite tolerance, a controller option the
    loop cannot honour, `max_steps < 1` or `chunk_size < 1` (traced values: at
    run time, through `eqx.error_if`); a `RuntimeError` naming `max_steps`
    (and, called eagerly, the members: an `eqx.EquinoxRuntimeError`) when
    `throw` and a member ran out of steps.
    """
    lv, m0, axes = _check_batch(lv, m0)
    n, dtype = m0.shape[0], m0.dtype
    ts, t_start = check_times(ts, dtype, t0)
    max_steps = static_int("max_steps", max_steps, minimum=1)
    chunk = n if chunk_size is None else static_int("chunk_size", chunk_size)
    pid, pending = _controller(stepsize_controller, rtol, atol, dtype)
    for bad, msg in pending:
        ts = error_if(ts, bad, msg)
    start = _start(lv, axes, m0, t_start, dt0, pid)
    y, loss, stats, ok = _solve_batch(
        lv, axes, pid, start, ts, max_steps, min(chunk, n)
    )
    y, result = _result(y, ok, throw, max_steps)
    return Solution(jnp.broadcast_to(ts, (n, ts.shape[0])), y, loss, stats, result)


def _start(lv, axes, m0, t_start, dt0, pid: PIDConstants) -> StepState:
    """Where every member starts: `t_start`, the first step `dt0` (default:
    `first_step`'s per member, at most `pid.dtmax` as diffrax's), `log m0`."""
    n, dtype = m0.shape[0], m0.dtype
    if dt0 is None:
        # the first step is a choice of the solver, held fixed under
        # differentiation as every other step
        dt0 = jax.lax.stop_gradient(_first_step(lv, axes, m0))
    dt0 = jnp.broadcast_to(jnp.asarray(dt0, dtype), (n,))
    if pid.dtmax is not None:
        dt0 = jnp.minimum(dt0, pid.dtmax)
    t_start = jnp.broadcast_to(t_start, (n,))
    return StepState(t_start, dt0, jnp.log(m0), jnp.zeros(n, jnp.int32))


def _result(y, ok, throw: bool, max_steps: int):
    """`(y, result)`: with `throw`, raise (or, traced, fail at run time) naming
    `max_steps` unless every member reached the end (`ok`); the
    `diffrax.RESULTS` of each member."""
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
    return y, result


def _check_batch(lv: LotkaVolterra, m0) -> tuple[LotkaVolterra, object, tuple]:
    """`(lv, m0, axes)`: both in the dtype of the solve (checked, see
    `check_m0`), and the batch axis of each leaf of `lv` (see `_batch_axes`)."""
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
    axes = _batch_axes(lv, n, p)
    dtype = jnp.result_type(lv.r.dtype, m0.dtype, float)
    m0 = check_m0(m0, dtype)
    return jax.tree.map(lambda x: x.astype(dtype), lv), m0, axes
