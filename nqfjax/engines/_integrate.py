r"""The one integrator behind `solve_mflow` and `solve_lv` (private module): the
checks of the times, tolerances and step limit, the change of clock of a
learning-rate schedule, one `diffrax.diffeqsolve`, and the `Solution` both return.

A solve is configured by the diffrax objects themselves: `solver`,
`stepsize_controller`, `adjoint`, `dt0`, `max_steps`, `throw`, each `None` (or
its documented value) meaning the engine's one default. The `rtol`/`atol`
keywords of earlier releases are deprecated (`deprecated_tolerances`) and mapped
to the controller they built then (`step_size_controller`).
"""

import warnings
from collections.abc import Callable

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Bool, Float, Int, PyTree

from .._checks import error_if, is_concrete, static_int
from .clock import check_momentum, clock


class Solution(eqx.Module):
    r"""A flow solved at the requested times, as returned by `solve_mflow` and
    `solve_lv`.

    **Fields:**

    - `ts`: the output times, in steps, shape `(T,)`.
    - `ys`: the state at `ts`: `M`, shape `(T, p, p)` (`solve_mflow`), or the
      modes `m`, shape `(T, p)` (`solve_lv`). NaN everywhere when the solve failed
      (`throw=False`): a failed solve never passes for a truncated result.
    - `loss`: the loss at `ts`, shape `(T,)` (`task.loss(M)`, or `lv.loss(m)`).
    - `stats`: a dict of step counts, `num_steps`, `num_accepted_steps` and
      `num_rejected_steps` (as in `diffrax.Solution`). `solve_lv` adds `moving`,
      shape `(p,)`: the modes whose log still moved by more than 1 (a factor `e`)
      over what remained of the horizon at the rate they had when the solver
      stopped; all `False` after a successful solve, and after `max_steps` was
      reached it names the modes that needed the steps.
    - `result`: the `diffrax.RESULTS` code of the solve.
    """

    ts: Float[Array, " T"]
    ys: Float[Array, "T ..."]
    loss: Float[Array, " T"]
    stats: dict[str, Array]
    result: diffrax.RESULTS

    @property
    def succeeded(self) -> Bool[Array, ""]:
        """Whether the solve reached the last time of `ts` (`result` successful)."""
        return self.result == diffrax.RESULTS.successful


# --------------------------------------------------------------------------------
# checks


def check_times(ts: ArrayLike, dtype, t0: float | None):
    """`(ts, t_start)` in `dtype`, refusing empty, non-increasing or non-finite
    `ts`, a cast to `dtype` that merges times, and `ts[0] < t0`."""
    ts_in = jnp.asarray(ts)
    if ts_in.ndim != 1:
        raise ValueError(f"`ts` must be a 1-D array of times, got shape {ts_in.shape}.")
    if ts_in.shape[0] == 0:
        raise ValueError("`ts` must hold at least one time, got an empty array.")
    if not jnp.issubdtype(ts_in.dtype, jnp.floating):
        ts_in = ts_in.astype(jnp.result_type(float))
    ts = ts_in.astype(dtype)
    cast = ts.dtype != ts_in.dtype
    msg = "`ts` must be finite and strictly increasing."
    cast_msg = (
        f"`ts` is strictly increasing in {ts_in.dtype} but not once cast to the "
        f"system's {ts.dtype}: some times are closer than {ts.dtype} resolves. "
        f"Space them further apart or give the system in {ts_in.dtype}."
    )
    if is_concrete(ts_in):
        tn = np.asarray(ts_in)
        if not (np.all(np.isfinite(tn)) and np.all(np.diff(tn) > 0)):
            raise ValueError(msg + f" Got {tn if tn.size < 8 else 'bad entries'}.")
        d = np.diff(np.asarray(ts))
        if cast and not np.all(d > 0):
            i = int(np.argmin(d > 0))
            raise ValueError(
                cast_msg + f" (ts[{i}] = {tn[i]!r}, ts[{i + 1}] = {tn[i + 1]!r})."
            )
    else:
        ok = jnp.all(jnp.isfinite(ts_in)) & jnp.all(jnp.diff(ts_in) > 0)
        ts = error_if(ts, ~ok, msg)
        if cast:
            ts = error_if(ts, ~jnp.all(jnp.diff(ts) > 0), cast_msg)
    if t0 is None:
        return ts, ts[0]
    t_start = jnp.asarray(t0, dtype)
    start_msg = f"`ts` must start at or after t0 (`ts[0] >= t0`, with t0 = {t0})."
    if is_concrete(ts, t_start):
        if not np.isfinite(float(t_start)):
            raise ValueError(f"`t0` must be finite or None, got {t0}.")
        if float(ts[0]) < float(t_start):
            raise ValueError(start_msg + f" Got ts[0] = {float(ts[0])}.")
        return ts, t_start
    bad = ~jnp.isfinite(t_start) | (ts[0] < t_start)
    return error_if(ts, bad, start_msg), t_start


def tolerance_checks(rtol, atol) -> list[tuple[Array, str]]:
    """Eager `ValueError` for a negative or non-finite `rtol`/`atol` (or both 0);
    for traced ones the `(bad, message)` pairs to check at run time."""
    pending = []
    for name, x in (("atol", atol), ("rtol", rtol)):
        msg = f"`{name}` must be a finite number >= 0"
        if is_concrete(x):
            xn = np.asarray(x)
            if xn.shape != () or not (np.isfinite(xn) and xn >= 0):
                raise ValueError(msg + f", got {x!r}.")
        else:
            pending.append((~(jnp.isfinite(x) & (x >= 0)), msg + "."))
    both = "`rtol` and `atol` cannot both be 0 (no step would be accepted)."
    if is_concrete(rtol, atol):
        if float(np.asarray(rtol)) == 0 and float(np.asarray(atol)) == 0:
            raise ValueError(both)
    else:
        pending.append(((rtol == 0) & (atol == 0), both))
    return pending


def deprecated_tolerances(rtol, atol, instead: str, *, stacklevel: int = 3) -> None:
    """Warn (`DeprecationWarning`, at the caller of the public function) when the
    deprecated `rtol`/`atol` keywords are given; `instead` names the controller
    to pass."""
    if rtol is None and atol is None:
        return
    warnings.warn(
        f"The `rtol`/`atol` keywords are deprecated: pass "
        f"`stepsize_controller={instead}`.",
        DeprecationWarning,
        stacklevel=stacklevel,
    )


def default_adjoint(adjoint) -> diffrax.AbstractAdjoint:
    """`adjoint`, or the flows' default `diffrax.RecursiveCheckpointAdjoint()` for
    `None`; anything else than a diffrax adjoint is refused."""
    if adjoint is None:
        return diffrax.RecursiveCheckpointAdjoint()
    if not isinstance(adjoint, diffrax.AbstractAdjoint):
        raise ValueError(
            f"`adjoint` must be a diffrax.AbstractAdjoint or None, got {type(adjoint)}."
        )
    return adjoint


def step_size_controller(
    controller: diffrax.AbstractStepSizeController | None,
    rtol,
    atol,
    defaults: tuple[float, float],
    norm: Callable | None = None,
) -> tuple[diffrax.AbstractStepSizeController, list[tuple[Array, str]]]:
    """The controller to use and the tolerance checks left for run time.

    `controller=None` builds `diffrax.PIDController(rtol, atol, norm)` with
    `defaults` for the tolerances not given; a given controller must not come with
    `rtol`/`atol`, and its own tolerances (if it has any) are checked the same."""
    if controller is None:
        rtol = defaults[0] if rtol is None else rtol
        atol = defaults[1] if atol is None else atol
        pending = tolerance_checks(rtol, atol)
        kwargs = {} if norm is None else {"norm": norm}
        return diffrax.PIDController(rtol=rtol, atol=atol, **kwargs), pending
    if rtol is not None or atol is not None:
        raise ValueError(
            "Give the tolerances either as `rtol`/`atol` or inside "
            "`stepsize_controller`, not both."
        )
    if not isinstance(controller, diffrax.AbstractStepSizeController):
        raise ValueError(
            "`stepsize_controller` must be a diffrax.AbstractStepSizeController, got "
            f"{type(controller)}."
        )
    if hasattr(controller, "rtol") and hasattr(controller, "atol"):
        return controller, tolerance_checks(controller.rtol, controller.atol)
    return controller, []


# --------------------------------------------------------------------------------
# the change of clock


def check_learning_rate(learning_rate, dtype):
    """A constant rate as a scalar of `dtype` (> 0 and finite; checked at run time
    when traced), or the schedule (a callable) unchanged."""
    if callable(learning_rate):
        return learning_rate
    eta = jnp.asarray(learning_rate, dtype)
    if eta.shape != ():
        raise ValueError(
            "`learning_rate` must be a scalar or an optax schedule (a callable of "
            f"the step), got shape {eta.shape}."
        )
    msg = "`learning_rate` must be > 0 and finite"
    if is_concrete(eta):
        if not (np.isfinite(float(eta)) and float(eta) > 0):
            raise ValueError(msg + f", got {float(eta)}.")
        return eta
    return error_if(eta, ~(jnp.isfinite(eta) & (eta > 0)), msg + ".")


def flow_times(
    learning_rate, ts, t_start, *, momentum: float, discrete: bool
) -> tuple[Array, Array, Int[np.ndarray, " T"] | None]:
    r"""The flow times $s = \int_0^t \eta$ of the start and of `ts`: `(s_start,
    s_unique, inverse)`, with `s_unique[inverse]` the clock at `ts` and `inverse`
    `None` when the times are used as they are. Clock values that repeat (a rate of
    zero, or a float32 cast) are solved once."""
    mu = check_momentum(momentum)
    dtype = ts.dtype
    if not callable(learning_rate) and mu == 0:
        return learning_rate * t_start, learning_rate * ts, None
    both = jnp.concatenate([jnp.reshape(t_start, (1,)), ts])
    s = clock(learning_rate, both, momentum=mu, discrete=discrete).astype(dtype)
    s_start, s = s[0], s[1:]
    if not is_concrete(s):
        return s_start, s, None
    unique, inverse = np.unique(np.asarray(s), return_inverse=True)
    if unique.shape == s.shape:
        return s_start, s, None
    return s_start, jnp.asarray(unique, dtype), inverse.reshape(-1)


def field_rate_and_times(
    learning_rate, ts, t_start, *, momentum: float, discrete: bool
):
    """The rate that scales a flow's field and the times it is integrated at:
    `(eta, s_start, times, inverse)`. A constant rate scales the field, so that
    gradients in it need no clock; a schedule or momentum runs the unit-rate flow
    on the clock $s(t)$ (`flow_times`)."""
    if callable(learning_rate) or momentum != 0:
        s_start, times, inverse = flow_times(
            learning_rate, ts, t_start, momentum=momentum, discrete=discrete
        )
        return jnp.ones((), ts.dtype), s_start, times, inverse
    return learning_rate, t_start, ts, None


def overflow_exponent(dtype) -> Array:
    """`s_max`: the largest log-norm of a factor `W = e^s V` whose `M = W W^T`
    products stay far from overflow in `dtype` (an eighth of the log of the
    largest float)."""
    return jnp.asarray(0.125 * float(np.log(np.finfo(np.dtype(dtype)).max)), dtype)


# --------------------------------------------------------------------------------
# the integration


def integrate(
    term: diffrax.AbstractTerm,
    solver: diffrax.AbstractSolver,
    y0: PyTree[Array],
    args: PyTree,
    t_start: Float[Array, ""],
    times: Float[Array, " T"],
    *,
    controller: diffrax.AbstractStepSizeController,
    pending: list[tuple[Array, str]],
    dt0,
    max_steps: int,
    adjoint: diffrax.AbstractAdjoint,
    throw: bool,
    inverse: np.ndarray | None = None,
    on_max_steps: str = "",
):
    """One `diffrax.diffeqsolve` from `(t_start, y0)`, saved at `times` and at the
    point where the solver stopped.

    **Returns:** `(ys, (t_stop, y_stop), stats, result)`: the state at `times`
    (rows `inverse` of it when given; NaN everywhere unless the solve
    succeeded), the last time reached and the state there, the step counts and
    the `diffrax.RESULTS` code. With `throw`, a failed solve raises: reaching
    `max_steps` with a message naming it and `on_max_steps`, other failures with
    diffrax's message.
    """
    max_steps = static_int("max_steps", max_steps, minimum=1)
    if not isinstance(solver, diffrax.AbstractSolver):
        raise ValueError(
            f"`solver` must be a diffrax.AbstractSolver or None, got {type(solver)}."
        )
    for bad, msg in pending:
        times = error_if(times, bad, msg)
    sol = diffrax.diffeqsolve(
        term,
        solver,
        t0=t_start,
        t1=times[-1],
        dt0=dt0,
        y0=y0,
        args=args,
        saveat=diffrax.SaveAt(ts=times, t1=True),
        stepsize_controller=controller,
        max_steps=max_steps,
        adjoint=adjoint,
        throw=False,
    )
    ok = sol.result == diffrax.RESULTS.successful
    ys = jax.tree.map(lambda y: jnp.where(ok, y[:-1], jnp.nan), sol.ys)
    if inverse is not None:
        ys = jax.tree.map(lambda y: y[jnp.asarray(inverse)], ys)
    # the stop is saved after the times reached (later rows stay at inf)
    last = jnp.sum(jnp.isfinite(sol.ts)) - 1
    stop = (sol.ts[last], jax.tree.map(lambda y: y[last], sol.ys))
    if throw:
        ys = error_if(
            ys,
            sol.result == diffrax.RESULTS.max_steps_reached,
            f"The solver took `max_steps` = {max_steps} steps without reaching the "
            f"last time of `ts`. {on_max_steps}",
            RuntimeError,
        )
        ys = error_if(
            ys,
            ~ok,
            "The solve failed before the last time of `ts` (pass `throw=False` "
            "for diffrax's result code in `Solution.result`).",
            RuntimeError,
        )
    stats = {
        k: jnp.asarray(sol.stats[k])
        for k in ("num_steps", "num_accepted_steps", "num_rejected_steps")
    }
    return ys, stop, stats, sol.result
