r"""The Lotka-Volterra engine: `solve_lv` integrates the reduced system in log
space, `lv_reduce` finds the reduction of a task (or raises `NotReducibleError`).

$$\frac{d \log m_k}{ds} = r_k - (B m)_k - \delta - 2\lambda, \qquad
s = \int_0^t \eta .$$

The system is the task's data in flow time `s`; the learning rate $\eta$ and the
weight decay $\lambda$ are the solver's arguments, as for `solve_mflow`.
"""

import warnings
from collections.abc import Callable

import diffrax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float

from .._checks import (
    check_shape,
    nonnegative,
)
from ..tasks.lotka_volterra import LotkaVolterra
from ._integrate import (
    Solution,
    check_learning_rate,
    check_times,
    default_adjoint,
    deprecated_tolerances,
    flow_times,
    integrate,
    step_size_controller,
    tolerance_checks,
)
from ._lv_common import (
    check_m0 as _check_m0,
    default_tolerances as _default_tolerances,
    first_step,
    max_norm as _max_norm,
    modes,
    moving,
    rates as _rates,
)
from ._rosenbrock import LVRosenbrock, exponent_clip
from .reduction import NotReducibleError as NotReducibleError, lv_reduce as lv_reduce


def _log_field(t, y, args):
    # Module level (not a closure) so that diffrax's jit cache is hit on every call.
    return _rates(y, args)


_LOG_TERM = diffrax.ODETerm(_log_field)


def lv_stepsize_controller(
    atol: float | None = None, *, rtol: float | None = None, dtype=None
) -> diffrax.PIDController:
    r"""`solve_lv`'s default step-size controller, at a chosen tolerance.

    `diffrax.PIDController(rtol, atol, norm=max over modes)` on $y = \log m$, so
    `atol` bounds the *relative* error of every mode, tiny or not, and
    `rtol = atol / |log floor|` (the floor: the log of the smallest normal number
    of `dtype`, -87.3 in float32, -708.4 in float64) holds every mode above the
    floor to between `atol` and `2 atol` while a dying mode's steps grow with its
    depth (with `rtol = 0` it would cost steps to the end of `ts`).

    **Arguments:**

    - `atol`: finite, `>= 0` (default: 1e-9 in float64, 1e-5 in float32).
    - `rtol`: finite, `>= 0` (default `atol / |log floor|`).
    - `dtype`: the system's dtype, which sets both defaults (default: JAX's
      default float, float64 under `jax_enable_x64`).

    **Returns:** the `diffrax.PIDController` to pass as
    `solve_lv(..., stepsize_controller=...)`; with no arguments it is the one
    `solve_lv` uses by default for a system of `dtype`.

    **Raises:** `ValueError` for a negative or non-finite `atol`/`rtol`, or both
    0 (traced values are checked when `solve_lv` runs).
    """
    dtype = jnp.result_type(float) if dtype is None else jnp.dtype(dtype)
    default_rtol, atol = _default_tolerances(dtype, atol)
    rtol = default_rtol if rtol is None else rtol
    tolerance_checks(rtol, atol)
    return diffrax.PIDController(rtol=rtol, atol=atol, norm=_max_norm)


def solve_lv(
    lv: LotkaVolterra,
    m0: Float[ArrayLike, " p"],
    ts: Float[ArrayLike, " T"],
    learning_rate: Float[ArrayLike, ""] | Callable = 1.0,
    weight_decay: Float[ArrayLike, ""] = 0.0,
    *,
    momentum: float = 0.0,
    discrete: bool = True,
    t0: float | None = 0.0,
    solver: diffrax.AbstractSolver | None = None,
    stepsize_controller: diffrax.AbstractStepSizeController | None = None,
    adjoint: diffrax.AbstractAdjoint | None = None,
    dt0: float | None = None,
    max_steps: int = 100_000,
    throw: bool = True,
    rtol: float | None = None,
    atol: float | None = None,
) -> Solution:
    r"""Integrate the Lotka-Volterra system in log space and return it at `ts`.

    Solves $d \log m_k / ds = r_k - (B m)_k - \delta - 2\lambda$ with
    $m = e^{\log m}$, which keeps `m > 0` and stays accurate from initial values
    like `1e-30`, in float32 too. The exponent is clipped before `exp` so that a
    rejected trial step cannot overflow; the clip is far above any reachable
    state (`m <= max(m*)`).

    **Time.** `s` is the system's own time, the flow time: `lv`'s rates are per
    unit of it (`lv_reduce(task)` gives the system of gradient flow at unit
    learning rate). `learning_rate` maps the steps `ts` to it,
    $s(t) = \int_0^t \eta$ (the change of clock, see `clock`, whose `momentum`
    and `discrete` options these are): `ts` count the steps of gradient descent
    at that rate, or of that optax schedule, and the system is integrated once at
    unit rate and read off at $s(t)$. A schedule needs concrete `ts`. The weight
    decay $\lambda$ on `W` adds $2\lambda$ to the decay per unit of `s` (as in
    `solve_mflow`, which takes the same two arguments).

    **Modes that die.** A mode with `r < 0`, or suppressed by the others, falls
    linearly in log space for ever. Below the log of the smallest normal number
    of the dtype (`-87.3` in float32, `-708.4` in float64) it is reported as off
    (`m = 0` in `ys`; it no longer acts on the others, `e^{log m}` being below
    every live mode's resolution), and the default `rtol` lets its steps grow
    with its depth there, so that it costs a few steps however long `ts` runs
    (`r = [-1, 1]` to `t = 1e7` in float32: ~90 steps). Its log is still exact:
    if its rate turns positive it grows back from where the exact solution is.
    (Pinning it at the floor was tried: the analytic Jacobian of the default
    solver does not know of the pin, and the step-size control then stalls at
    the pin, at float32 resolution there.)

    **Default:** `LVRosenbrock(lv.interactions)` with
    `lv_stepsize_controller(dtype=...)`, i.e. `diffrax.PIDController` in the max
    norm on `log m` with `atol` 1e-9 in float64 and 1e-5 in float32 and
    `rtol = atol / |log floor|` (`dt0 = 0.01` over the fastest initial rate,
    `max_steps=100_000`, `RecursiveCheckpointAdjoint`).

    **Solver.** The system is stiff once modes switch on. The default solver is a
    Rosenbrock method (`LVRosenbrock`, RODAS4: L-stable, one linear solve per
    stage with the analytic Jacobian $-B\,\mathrm{diag}(m)$, no Newton iterations;
    `O(p q)` per step when `B` is diagonal plus rank `q`, see `LotkaVolterra`),
    with a PID step-size controller in the max norm on the log-state, so `atol`
    bounds the *relative* error of every mode, tiny or not;
    `lv_stepsize_controller(atol)` is that controller at another tolerance, and
    any diffrax solver and controller can be passed instead (measured speeds:
    `benchmarks/README.md`). Gradients go through
    `diffrax.RecursiveCheckpointAdjoint` (reverse-mode checkpointing);
    `BacksolveAdjoint` was measured here to give gradients about 100% off on this
    problem. For a few hyperparameters forward mode (`jax.jacfwd`) also works
    with `adjoint=diffrax.ForwardMode()`.

    **Arguments:**

    - `lv`: the system.
    - `m0`: initial values, shape `(p,)`, finite and at least the smallest normal
      number of the dtype (`1.2e-38` in float32, `2.2e-308` in float64): below
      it a mode would start off.
    - `ts`: output times (in steps), shape `(T,)`, `T >= 1`, strictly increasing
      (also once cast to the system's dtype), `ts[0] >= t0`.
    - `learning_rate`: `eta > 0` or an optax schedule; see **Time** (default 1:
      `ts` are flow times).
    - `weight_decay`: $\lambda \ge 0$, weight decay on `W` (default 0); the
      system's own `lv.decay` $\delta$ applies as well.
    - `momentum`, `discrete`: the clock (see `clock`).
    - `t0`: the step at which `m = m0` (default 0; `None` means `ts[0]`).
    - `solver`, `stepsize_controller`, `adjoint`: diffrax objects; `None` is the
      default above (`lv_stepsize_controller` builds it at another `atol`). A
      controller's `rtol`/`atol` must be finite and `>= 0`.
    - `dt0`: the first step (`None`: the default above); `max_steps >= 1`.
    - `throw`: raise if the solve fails (for example `max_steps` reached). With
      `throw=False` (for vmapped sweeps) a failed solve returns NaN everywhere, so
      it can never pass for a result, and `stats["moving"]` says which modes were
      still moving when the solver stopped.
    - `rtol`, `atol`: deprecated (`DeprecationWarning`): pass
      `stepsize_controller=lv_stepsize_controller(atol, rtol=...)`, the same
      controller (a missing `rtol` is `atol / |log floor|`, as before). Not with
      `stepsize_controller`.

    **Returns:** a `Solution` with `ys = m(ts)`, shape `(T, p)`, and `loss =
    lv.loss(m(ts))`, shape `(T,)`.

    **Raises:** `ValueError` for bad shapes, `m0` not finite or below the
    smallest normal number, `ts` empty, not increasing (or not once cast to the
    system's dtype) or before `t0`, a negative or non-finite tolerance,
    `learning_rate <= 0`, `weight_decay < 0` or `max_steps < 1` (traced values:
    at run time, through `eqx.error_if`).
    """
    p = lv.p
    m0 = jnp.asarray(m0)
    check_shape("m0", m0, (p,))
    dtype = jnp.result_type(lv.r.dtype, m0.dtype, float)
    m0 = _check_m0(m0, dtype)
    learning_rate = check_learning_rate(learning_rate, dtype)
    lam = nonnegative("weight_decay", jnp.asarray(weight_decay, dtype))
    check_shape("weight_decay", lam, ())
    ts, t_start = check_times(ts, dtype, t0)
    s_start, times, inverse = flow_times(
        learning_rate, ts, t_start, momentum=momentum, discrete=discrete
    )
    deprecated_tolerances(
        rtol, atol, "nqfjax.lv_stepsize_controller(atol=..., rtol=...)"
    )
    controller, pending = step_size_controller(
        stepsize_controller, rtol, atol, _default_tolerances(dtype, atol), _max_norm
    )
    if solver is None:
        solver = LVRosenbrock(lv.interactions)
    if dt0 is None:
        dt0 = first_step(lv.r, lv.interactions, m0)
    y_max = jnp.asarray(exponent_clip(dtype), dtype)
    args = (lv.r, lv.interactions, lv.decay + 2.0 * lam, y_max)
    y, (s_stop, y_stop), stats, result = integrate(
        _LOG_TERM,
        solver,
        jnp.log(m0),
        args,
        s_start,
        times,
        controller=controller,
        pending=pending,
        dt0=dt0,
        max_steps=max_steps,
        adjoint=default_adjoint(adjoint),
        throw=throw,
        inverse=inverse,
        on_max_steps="Some modes were still moving when it stopped: with "
        "`throw=False` the Solution's `stats['moving']` marks them. Increase "
        "`max_steps`, or loosen the tolerance (`lv_stepsize_controller(atol)`).",
    )
    stats["moving"] = moving(y_stop, _rates(y_stop, args), times[-1] - s_stop)
    m = modes(y)
    return Solution(ts, m, lv.loss(m), stats, result)


def solve_lv_schedule(
    lv_unit: LotkaVolterra,
    m0: Float[ArrayLike, " p"],
    ts: Float[ArrayLike, " T"],
    learning_rate: Float[ArrayLike, ""] | Callable,
    *,
    momentum: float = 0.0,
    discrete: bool = True,
    **solve_options,
) -> Float[Array, "T p"]:
    """Deprecated: use `solve_lv(lv_unit, m0, ts, learning_rate, momentum=...,
    discrete=...).ys`, which it returns (`m(ts)`, shape `(T, p)`)."""
    warnings.warn(
        "solve_lv_schedule is deprecated: solve_lv takes the schedule as its "
        "`learning_rate` (use `solve_lv(...).ys`).",
        DeprecationWarning,
        stacklevel=2,
    )
    return solve_lv(
        lv_unit,
        m0,
        ts,
        learning_rate,
        momentum=momentum,
        discrete=discrete,
        **solve_options,
    ).ys
