r"""The closed M-space flow, integrated with diffrax:

$$\frac{dM}{dt} = -2\eta\,(G M + M G) - 2\eta\lambda M, \qquad G = K[M] - C .$$
"""

import warnings
from collections.abc import Callable

import diffrax
import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float

from .._checks import (
    check_shape,
    error_if,
    is_concrete,
    nonnegative,
    renamed_keywords,
    symmetric_psd,
)
from .._linalg import psd_sqrt
from ..tasks.base import Task
from ._integrate import (
    Solution,
    check_learning_rate,
    check_times,
    default_adjoint,
    deprecated_tolerances,
    field_rate_and_times,
    integrate,
    overflow_exponent,
    step_size_controller,
)


def _field(t, y, args):
    # Module level (not a closure) so that diffrax's jit cache is hit on every call.
    # State: W = exp(s) V with |V|_F = 1 held fixed by the Rayleigh-quotient term,
    # so tolerances act on an O(1) matrix however small or large M is.
    s, V = y
    task, eta, lam, s_max = args
    s = jnp.minimum(s, s_max)
    M = jnp.exp(2.0 * s) * (V @ V.T)
    G = task.gradient(M)
    LV = -eta * (2.0 * G @ V + lam * V)
    ds = jnp.sum(V * LV) / jnp.sum(V * V)
    return ds, LV - ds * V


_TERM = diffrax.ODETerm(_field)


def _default_tolerances(dtype) -> tuple[float, float]:
    if jnp.dtype(dtype) == jnp.float64:
        return 1e-9, 1e-9
    return 1e-5, 1e-6


def _initial_factor(M0):
    """`(log |W0|_F, W0 / |W0|_F)` for the symmetric square root `W0` of `M0`."""
    W0 = psd_sqrt(0.5 * (M0 + M0.T))
    norm0 = jnp.sqrt(jnp.sum(W0**2))
    if is_concrete(norm0) and not float(norm0) > 0:
        raise ValueError("`M0` must be nonzero (M = 0 is a fixed point of the flow).")
    norm0 = error_if(norm0, ~(norm0 > 0), "`M0` must be nonzero.")
    return jnp.log(norm0), W0 / norm0


@renamed_keywords(eta="learning_rate")
def solve_mflow(
    task: Task,
    M0: Float[ArrayLike, "p p"],
    ts: Float[ArrayLike, " T"],
    learning_rate: Float[ArrayLike, ""] | Callable,
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
    r"""Integrate the closed flow of $M = W W^\top$ and return it at `ts`.

    $$\frac{dM}{dt} = -2\eta(t)\,(G M + M G) - 2\eta(t)\lambda M, \qquad
    G = K[M] - C .$$

    Time counts gradient steps: with a constant `learning_rate` $\eta$ the flow
    is the limit of full-batch gradient descent
    $W \leftarrow W - \eta(\nabla_W L + \lambda W)$ with one step per unit of
    `t`, so `t = step` compares with GD. With an optax schedule $\eta(n)$ (or
    heavy-ball `momentum`) the flow is the flow at $\eta = 1$ read at the clock
    $s(t) = \int_0^t \eta$ (see `clock`, whose `momentum` and `discrete` options
    these are): the integrator runs once at unit rate, so the tolerances act on the
    same trajectory whatever the schedule, and clock values that repeat (a rate of
    zero) are solved once. A schedule needs concrete `ts`.

    The flow is integrated for a factor, $M = W W^\top$ with
    $dW/dt = -\eta (2 G W + \lambda W)$ and $W_0 = M_0^{1/2}$ (the symmetric
    square root), so `M` stays symmetric PSD by construction, and a rank-deficient
    `M0` keeps its rank. The factor is stored as $W = e^{s} V$ with
    $|V|_F = 1$ held fixed, so `rtol`/`atol` act on an O(1) matrix whether `M0` is
    `1e-30` or `1`: small initialisations are resolved relatively. Within `V`,
    entries much smaller than its largest are controlled absolutely (`atol`), so a
    mode far below the largest one in an arbitrary basis is resolved to about
    `atol * |V| / sqrt(m_k / m_max)`, and below the machine epsilon
    (`m_k / m_max` under ~1e-14 in float32, ~1e-32 in float64) roundoff in the
    dense products seeds it, as in W-space training at that precision;
    `solve_lv` is the engine for that regime when the task reduces.

    **Default:** `diffrax.Kvaerno5()` with `diffrax.PIDController(rtol=1e-9,
    atol=1e-9)` in float64, `(rtol=1e-5, atol=1e-6)` in float32 (`dt0` chosen by
    diffrax, `max_steps=100_000`, `RecursiveCheckpointAdjoint`). Kvaerno5 is
    implicit (the flow is stiff once modes switch on); its dense Jacobian has
    `p^4` entries, so for large `p` pass an explicit solver such as
    `diffrax.Tsit5()`.

    Gradients with respect to the task, a constant `learning_rate`,
    `weight_decay` and `M0` go through `adjoint`; the square root of `M0` has a
    custom derivative that stays finite for degenerate eigenvalues.

    **Arguments:**

    - `task`: the `Task` (`K`, `C`, `y2`).
    - `M0`: initial `M`, shape `(p, p)`, symmetric PSD, nonzero.
    - `ts`: output times (in steps), shape `(T,)`, `T >= 1`, strictly increasing
      (also once cast to the task's dtype), `ts[0] >= t0`.
    - `learning_rate`: $\eta > 0$, or an optax schedule (a callable of the step).
      (`eta=` is accepted for one release, with a `DeprecationWarning`.)
    - `weight_decay`: $\lambda \ge 0$, weight decay on `W` (default 0).
    - `momentum`, `discrete`: the clock of a schedule or of momentum (see
      `clock`; default: no momentum, the clock of the optimizer's steps).
    - `t0`: the time at which `M = M0` (default 0; `None` means `ts[0]`).
    - `solver`, `stepsize_controller`, `adjoint`: diffrax objects; `None` is the
      default above. A controller's `rtol`/`atol` must be finite and `>= 0`.
    - `dt0`: the first step (`None`: diffrax chooses); `max_steps >= 1`.
    - `throw`: raise if the solve fails (e.g. `max_steps` reached). With
      `throw=False` (vmapped sweeps) a failed solve returns NaN everywhere; the
      step limit never truncates a solution silently.
    - `rtol`, `atol`: deprecated (`DeprecationWarning`): pass
      `stepsize_controller=diffrax.PIDController(rtol=..., atol=...)`; a missing
      one takes its default above, as before. Not with `stepsize_controller`.

    **Returns:** a `Solution` with `ys = M(ts)`, shape `(T, p, p)`, and `loss =
    task.loss(M(ts))`, shape `(T,)`.

    **Raises:** `ValueError` if `M0` is not `(task.p, task.p)`, not symmetric PSD,
    zero or not finite; if `ts` is empty, not increasing (or stops being so once
    cast to the task's dtype) or starts before `t0`; if `learning_rate <= 0`,
    `weight_decay < 0`, a tolerance is negative or not finite, or `max_steps < 1`
    (traced values: at run time, through `eqx.error_if`).
    """
    if not isinstance(task, Task):
        raise ValueError(f"`task` must be a Task, got {type(task)}.")
    p = task.p
    M0 = jnp.asarray(M0)
    if M0.shape != (p, p):
        raise ValueError(
            f"`M0` must have shape (p, p) = ({p}, {p}) to match `task.p`, "
            f"got {M0.shape}."
        )
    dtype = jnp.result_type(task.dtype, M0.dtype, float)
    M0 = symmetric_psd("M0", M0.astype(dtype))
    learning_rate = check_learning_rate(learning_rate, dtype)
    lam = nonnegative("weight_decay", jnp.asarray(weight_decay, dtype))
    check_shape("weight_decay", lam, ())
    ts, t_start = check_times(ts, dtype, t0)
    deprecated_tolerances(
        rtol,
        atol,
        "diffrax.PIDController(rtol=..., atol=...)",
        stacklevel=4,  # past renamed_keywords' wrapper
    )
    controller, pending = step_size_controller(
        stepsize_controller, rtol, atol, _default_tolerances(dtype)
    )
    eta, s_start, times, inverse = field_rate_and_times(
        learning_rate, ts, t_start, momentum=momentum, discrete=discrete
    )
    s_max = overflow_exponent(dtype)
    (s, V), _, stats, result = integrate(
        _TERM,
        diffrax.Kvaerno5() if solver is None else solver,
        _initial_factor(M0),
        (task, eta, lam, s_max),
        s_start,
        times,
        controller=controller,
        pending=pending,
        dt0=dt0,
        max_steps=max_steps,
        adjoint=default_adjoint(adjoint),
        throw=throw,
        inverse=inverse,
        on_max_steps="Increase `max_steps` or loosen the step-size controller's "
        "tolerances; "
        "`throw=False` returns the step counts in `Solution.stats`.",
    )
    M = jnp.exp(2.0 * s)[:, None, None] * jnp.einsum("tij,tkj->tik", V, V)
    return Solution(ts, M, jax.vmap(task.loss)(M), stats, result)


def solve_mflow_schedule(
    task: Task,
    M0: Float[ArrayLike, "p p"],
    ts: Float[ArrayLike, " T"],
    learning_rate: Float[ArrayLike, ""] | Callable,
    weight_decay: Float[ArrayLike, ""] = 0.0,
    *,
    momentum: float = 0.0,
    discrete: bool = True,
    **solve_options,
) -> Float[Array, "T p p"]:
    """Deprecated: use `solve_mflow(task, M0, ts, learning_rate, weight_decay,
    momentum=..., discrete=...).ys`, which it returns (`M(ts)`, shape
    `(T, p, p)`)."""
    warnings.warn(
        "solve_mflow_schedule is deprecated: solve_mflow takes the schedule as its "
        "`learning_rate` (use `solve_mflow(...).ys`).",
        DeprecationWarning,
        stacklevel=2,
    )
    return solve_mflow(
        task,
        M0,
        ts,
        learning_rate,
        weight_decay,
        momentum=momentum,
        discrete=discrete,
        **solve_options,
    ).ys
