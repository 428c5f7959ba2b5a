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

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import ArrayLike, Float

from .._checks import error_if, is_concrete, nonnegative, static_int
from ..tasks.lotka_volterra import LotkaVolterra
from ._integrate import (
    Solution,
    check_learning_rate,
    check_times,
    deprecated_tolerances,
    tolerance_checks,
)
from ._lv_batch_adjoint import integrate_chunk, segment_length
from ._lv_batch_loop import StepState, in_axes
from ._lv_common import (
    PIDConstants,
    check_m0,
    first_step,
    modes,
    moving,
    pid_constants,
    rates,
)
from ._rosenbrock import RODAS4, exponent_clip
from .lv import lv_stepsize_controller


_MAX_STEPS_MSG = (
    "The solver took `max_steps` = {} steps without reaching the last time of "
    "`ts` for members {} of the batch. Increase `max_steps`, or loosen `atol` "
    "(with `throw=False` the Solution's `result` marks the members and "
    "`stats['moving']` the modes that were still moving)."
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
def _solve_batch(lv, axes, pid, start: StepState, times, clock, max_steps, chunk):
    r"""`integrate_chunk` over the batch in chunks of `chunk` members (one after
    another, so that a chunk's state stays in cache), then `m`, the loss, the
    stats and which members reached the end. `lv`: the systems, their leaves
    batched along the static `axes` (see `_batch_axes`). `times`: the flow
    times, `clock = (eta, tau)` the learning rate and the steps since the start
    `(T,)`, `times - s_start = eta tau`, for the derivative in `eta` (see
    `_read_clock`)."""
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
    ax = in_axes(lv, axes)
    y_max = jnp.asarray(exponent_clip(y.dtype), y.dtype)

    def field(y, lv):  # d log m / ds of every member, y (n, ..., p)
        return rates(y, (lv.r, lv.interactions, lv.decay, y_max))

    field = jax.vmap(field, in_axes=(0, ax))
    y = _read_clock(y, ok, clock, field, lv)
    y = jnp.where(ok[:, None, None], y, jnp.nan)
    rate = field(stop.y, lv)
    m = modes(y)
    stats = {
        "num_steps": n_acc + n_rej,
        "num_accepted_steps": n_acc,
        "num_rejected_steps": n_rej,
        "moving": moving(stop.y, rate, (times[-1] - stop.t)[:, None]),
    }
    loss = jax.vmap(lambda lv, m: lv.loss(m), in_axes=(ax, 0))(lv, m)
    return m, loss, stats, ok


def _read_clock(y, ok, clock, field, lv):
    r"""The logs `y` `(n, T, p)` at the flow times $s_k = s_0 + \eta \tau_k$, with
    their derivative in the learning rate $\eta$: $\partial y_k / \partial \eta
    = \tau_k\, f(y_k)$, `f` the field (the system is autonomous). The loop holds
    its times fixed (`stop_gradient`); the term added here is zero and carries
    that derivative (first order only). Members that did not finish (`ok`
    false) get none."""
    eta, tau = clock
    y_safe = jnp.where(ok[:, None, None], y, 0.0)  # no NaN in the field's VJP
    f = jnp.where(
        ok[:, None, None],
        jax.vmap(field, in_axes=(1, None), out_axes=1)(y_safe, lv),
        0.0,
    )
    return y + (eta - jax.lax.stop_gradient(eta)) * tau[None, :, None] * f


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
    run time: `stepsize_controller`, or the default
    `lv_stepsize_controller(atol, rtol=rtol, dtype=dtype)` (`solve_lv`'s),
    which the deprecated `rtol`/`atol` set when given (warning at the caller
    of `solve_lv_batch`)."""
    if stepsize_controller is not None and (rtol is not None or atol is not None):
        raise ValueError(
            "Give the tolerances inside `stepsize_controller`, not also as "
            "`rtol`/`atol` (deprecated)."
        )
    instead = "nqfjax.lv_stepsize_controller(atol=..., rtol=...)"
    deprecated_tolerances(rtol, atol, instead, stacklevel=4)
    if stepsize_controller is None:
        stepsize_controller = lv_stepsize_controller(atol, rtol=rtol, dtype=dtype)
    pid = pid_constants(stepsize_controller, RODAS4.order, dtype)
    pending = tolerance_checks(stepsize_controller.rtol, stepsize_controller.atol)
    if pid.dtmax is not None:
        msg = "`stepsize_controller.dtmax` must be > 0."
        if not is_concrete(pid.dtmax):
            pending.append((~(pid.dtmax > 0), msg))
        elif not float(pid.dtmax) > 0:
            raise ValueError(msg + f" Got {float(pid.dtmax)}.")
    return pid, pending


def _clock(learning_rate, dtype):
    """The constant learning rate of the batch, a scalar of `dtype` (checked as
    `solve_lv` checks it); a schedule is refused."""
    if callable(learning_rate):
        raise ValueError(
            "`learning_rate` must be a constant (a scalar > 0) for `solve_lv_batch`, "
            "whose fused loop runs the members on one clock; for an optax schedule "
            "or momentum use `solve_lv` (under `jax.vmap` for a batch)."
        )
    if jnp.ndim(learning_rate) != 0:
        raise ValueError(
            "`learning_rate` must be a scalar, one for the whole batch (for one "
            "per member use `jax.vmap(solve_lv)`), got shape "
            f"{jnp.shape(learning_rate)}."
        )
    return check_learning_rate(learning_rate, dtype)


def _with_weight_decay(lv: LotkaVolterra, weight_decay, n: int) -> LotkaVolterra:
    r"""`lv` with `2 weight_decay` added to its decay: $\delta + 2\lambda$ per
    unit of flow time. `weight_decay`: `>= 0`, a scalar or one per member `(n,)`."""
    lam = nonnegative("weight_decay", jnp.asarray(weight_decay, lv.r.dtype))
    if lam.shape not in ((), (n,)):
        raise ValueError(
            "`weight_decay` must be a scalar or have shape (n,) = "
            f"{(n,)} (one per member), got shape {lam.shape}."
        )
    if is_concrete(lam) and lam.shape == () and float(lam) == 0.0:
        return lv  # no decay added: the leaf keeps its batch axis
    return eqx.tree_at(lambda lv: lv.decay, lv, lv.decay + 2.0 * lam)


def solve_lv_batch(
    lv: LotkaVolterra,
    m0: Float[ArrayLike, "n p"],
    ts: Float[ArrayLike, " T"],
    learning_rate: Float[ArrayLike, ""] = 1.0,
    weight_decay: Float[ArrayLike, ""] | Float[ArrayLike, " n"] = 0.0,
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

    $$\frac{d \log m_k}{ds} = r_k - (B m)_k - \delta - 2\lambda, \qquad
    s = \eta\, t:$$

    for each member `solve_lv(lv, m0[i], ts, learning_rate, weight_decay)` with
    its default solver and controller (Rodas4, `LVRosenbrock`;
    `lv_stepsize_controller`), as one fused loop: each member keeps its own
    time and step size, accepted and rejected steps are masks on the
    per-member state, outputs inside a step come from Rodas4's dense output,
    and every member takes the steps it would take alone. **Time**, as in
    `solve_lv`: `lv` is in flow time `s` (`lv_reduce(task)`), `ts` count steps
    at the constant `learning_rate` $\eta$, and the loop runs at unit rate
    from `eta t0` to the flow times `eta ts`; the weight decay $\lambda$ adds
    $2\lambda$ to `lv.decay`. Called eagerly, the checks run on the host and
    the compiled loop holds no host callback.

    **Gradients** (reverse mode) with respect to `lv`, `m0` and `weight_decay`:
    the discrete adjoint of the loop, the accepted steps held fixed, each run
    backwards through the VJP of its Rodas4 step and dense output (the
    derivative of the numerical solution; memory `O(sqrt(max_steps) p)` per
    member, checkpoints every `ceil(sqrt(max_steps))` accepted steps). With
    respect to `learning_rate`: $\partial y_k / \partial \eta = (t_k - t_0)
    f(y_k)$, `f` the field at the output (first derivatives). `ts`, `t0`, `dt0`
    and the tolerances are refused (`ValueError`), as is forward mode: use
    `solve_lv` (`diffrax.ForwardMode()`) for those.

    **Arguments:**

    - `lv`: a `LotkaVolterra` whose fields each describe one system shared by
      the batch or carry a leading batch axis of size `n` (e.g. built under
      `jax.vmap`). Any interactions.
    - `m0`: initial values, shape `(n, p)`, finite, at least the smallest normal
      number of the dtype.
    - `ts`: output steps, shape `(T,)`, strictly increasing, `ts[0] >= t0`.
    - `learning_rate`: $\eta > 0$, a scalar shared by the batch (default 1:
      `ts` are flow times); a schedule needs `solve_lv`.
    - `weight_decay`: $\lambda \ge 0$ on `W`, a scalar or one per member `(n,)`
      (default 0).
    - `t0`: the step at which `m = m0` (default 0; `None` means `ts[0]`).
    - `stepsize_controller`: a `diffrax.PIDController` on `log m` (default
      `lv_stepsize_controller(dtype=...)`: `atol` 1e-9 in float64, 1e-5 in
      float32, `rtol = atol / |log floor|`). The loop reads `rtol`, `atol`,
      `icoeff`, `safety`, `factormin`, `factormax`, `dtmax` (in flow time) and
      `error_order`, and measures the error in the max norm over modes: a
      `norm` left at diffrax's default is *read as the max norm* (as
      `optimistix.max_norm`, which `lv_stepsize_controller` sets); `pcoeff`,
      `dcoeff`, `dtmin`, another `norm` or `step_ts`/`jump_ts` are refused.
    - `dt0`: the first step, in flow time (default per member, as `solve_lv`).
    - `max_steps`: the most steps (accepted and rejected) any member may take.
    - `throw`: raise if a member did not reach the end within `max_steps`; with
      `throw=False` its `ys` and `loss` are NaN, its `result`
      `max_steps_reached`.
    - `chunk_size`: how many members step together (default: all), chunk after
      chunk; the results do not depend on it.
    - `rtol`, `atol`: deprecated (`DeprecationWarning`): pass
      `stepsize_controller=lv_stepsize_controller(atol, rtol=...)`.

    **Returns:** a `Solution` with a leading batch axis on every field, as
    `jax.vmap(solve_lv)`: `ts` `(n, T)` (the steps), `ys = m(ts)` `(n, T, p)`
    (0 below the floor of the dtype), `loss` `(n, T)`, `stats` (step counts
    `(n,)`, `moving` `(n, p)`) and `result` `(n,)`.

    **Raises:** `ValueError` for a bad shape of `m0`, of a field of `lv` or of
    `weight_decay`, `m0` not finite or below the smallest normal number, `ts`
    empty, not increasing or before `t0`, `learning_rate` not a scalar `> 0`,
    `weight_decay < 0`, a bad tolerance or controller option, `max_steps < 1`
    or `chunk_size < 1` (traced: at run time); `RuntimeError` naming
    `max_steps` when `throw` and a member ran out of steps.
    """
    lv, m0, axes = _check_batch(lv, m0, weight_decay)
    n, dtype = m0.shape[0], m0.dtype
    eta = _clock(learning_rate, dtype)
    ts, t_start = check_times(ts, dtype, t0)
    max_steps = static_int("max_steps", max_steps, minimum=1)
    chunk = n if chunk_size is None else static_int("chunk_size", chunk_size)
    pid, pending = _controller(stepsize_controller, rtol, atol, dtype)
    for bad, msg in pending:
        ts = error_if(ts, bad, msg)
    # the flow times s = eta t; their derivative in eta is taken outside the
    # loop (`_solve_batch`), which holds its times fixed
    eta_fixed = jax.lax.stop_gradient(eta)
    start = _start(lv, axes, m0, eta_fixed * t_start, dt0, pid)
    clock = (eta, ts - t_start)
    y, loss, stats, ok = _solve_batch(
        lv, axes, pid, start, eta_fixed * ts, clock, max_steps, min(chunk, n)
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


def _check_batch(
    lv: LotkaVolterra, m0, weight_decay
) -> tuple[LotkaVolterra, object, tuple]:
    """`(lv, m0, axes)`: both in the dtype of the solve (checked, see
    `check_m0`), `lv` with the weight decay added (`_with_weight_decay`), and
    the batch axis of each leaf of `lv` (see `_batch_axes`)."""
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
    _batch_axes(lv, n, p)  # the shapes, before the decay is added
    dtype = jnp.result_type(lv.r.dtype, m0.dtype, float)
    m0 = check_m0(m0, dtype)
    lv = jax.tree.map(lambda x: x.astype(dtype), lv)
    lv = _with_weight_decay(lv, weight_decay, n)
    return lv, m0, _batch_axes(lv, n, p)
