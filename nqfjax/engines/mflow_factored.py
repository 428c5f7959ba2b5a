r"""The M-space flow integrated for a thin factor $W$ (`p x r`), never forming a
`p x p` matrix:

$$\frac{dW}{dt} = -\eta\,(2\, G(W W^\top)\, W + \lambda W), \qquad
M = W W^\top .$$
"""

from collections.abc import Callable

import diffrax
import jax
import jax.numpy as jnp
from jaxtyping import ArrayLike, Float

from .._checks import check_shape, error_if, finite, is_concrete, nonnegative
from ..tasks.base import Task
from ._integrate import (
    Solution,
    check_learning_rate,
    check_times,
    default_adjoint,
    field_rate_and_times,
    integrate,
    overflow_exponent,
    step_size_controller,
)


def _field(t, y, args):
    # Module level (not a closure) so that diffrax's jit cache is hit on every call.
    # State: W = exp(s) V with |V|_F = 1 held fixed by the Rayleigh-quotient term,
    # as in solve_mflow, so tolerances act on an O(1) matrix however small M is.
    s, V = y
    task, eta, lam, s_max = args
    s = jnp.minimum(s, s_max)
    scale = jnp.exp(s)
    GV = task.gradient_factor(scale * V) / scale  # G(e^{2s} V V^T) V
    LV = -eta * (2.0 * GV + lam * V)
    ds = jnp.sum(V * LV) / jnp.sum(V * V)
    return ds, LV - ds * V


_TERM = diffrax.ODETerm(_field)


def _default_tolerances(dtype) -> tuple[float, float]:
    if jnp.dtype(dtype) == jnp.float64:
        return 1e-9, 1e-9
    return 1e-5, 1e-6


def _check_factor(W0, p: int, dtype):
    """`(log |W0|_F, W0 / |W0|_F)` after checking that `W0` is `(p, r)`, finite
    and nonzero."""
    W0 = jnp.asarray(W0)
    if W0.ndim != 2 or W0.shape[0] != p or W0.shape[1] < 1:
        raise ValueError(
            f"`W0` must have shape (p, r) = ({p}, r) with r >= 1 to match "
            f"`task.p`, got {W0.shape}."
        )
    W0 = finite("W0", W0.astype(dtype))
    norm0 = jnp.sqrt(jnp.sum(W0**2))
    if is_concrete(norm0) and not float(norm0) > 0:
        raise ValueError("`W0` must be nonzero (W = 0 is a fixed point of the flow).")
    norm0 = error_if(norm0, ~(norm0 > 0), "`W0` must be nonzero.")
    return jnp.log(norm0), W0 / norm0


def solve_mflow_factored(
    task: Task,
    W0: Float[ArrayLike, "p r"],
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
) -> Solution:
    r"""Integrate the M-space flow for a `(p, r)` factor and return the factor
    at `ts`.

    $$\frac{dW}{dt} = -\eta(t)\,(2\, G(W W^\top)\, W + \lambda W), \qquad
    G(M) = K[M] - C .$$

    $M = W W^\top$ then solves the M-space flow of `solve_mflow` exactly,
    $\dot M = -2\eta(GM + MG) - 2\eta\lambda M$, whatever factor of $M_0$ is
    given: the flow of $M$ is invariant to $W_0 \to W_0 Q$ with $Q$ orthogonal,
    so any `W0` with $W_0 W_0^\top = M_0$ gives the same $M(t)$ (the columns of
    `W0` are, for instance, the initial units of `train`). The rank of $M$
    stays at most `r` by construction: no mode beyond the rank of `M0` is
    seeded by roundoff, as it can be in the dense products of `solve_mflow`.
    The state is `r` columns instead of `p`, and a step costs one pass over the
    task's samples through `Task.gradient_factor`: `O(n k p r)` or less for a
    `SampledTask` of a built-in structure (`O(n k p + k p r)` for perceptrons
    and readouts), `O(p^2 r)` plus one `K` for a task with a dense `C` (the
    Gaussian tasks), against `O(p^3)` for `solve_mflow`. Nothing of size
    `p x p` is formed or stored.

    As in `solve_mflow`, time counts gradient steps, schedules and `momentum`
    act through the clock (`clock`), and the factor is stored as $W = e^s V$
    with $|V|_F = 1$ held fixed, so the tolerances act on an O(1) matrix
    whether `M0` is `1e-30` or `1`.

    **Default:** `diffrax.Tsit5()` with `diffrax.PIDController(rtol=1e-9,
    atol=1e-9)` in float64, `(rtol=1e-5, atol=1e-6)` in float32 (`dt0` chosen
    by diffrax, `max_steps=100_000`, `RecursiveCheckpointAdjoint`). Explicit:
    an implicit solver's dense Jacobian would have `(p r)^2` entries.

    Gradients with respect to the task, a constant `learning_rate`,
    `weight_decay` and `W0` go through `adjoint`.

    **Arguments:**

    - `task`: the `Task`; its `gradient_factor` and `loss_factor` are used.
    - `W0`: initial factor, shape `(p, r)`, finite, nonzero ($M_0 = W_0 W_0^\top$).
    - `ts`: output times (in steps), shape `(T,)`, `T >= 1`, strictly increasing
      (also once cast to the task's dtype), `ts[0] >= t0`.
    - `learning_rate`: $\eta > 0$, or an optax schedule (a callable of the step).
    - `weight_decay`: $\lambda \ge 0$, weight decay on `W` (default 0).
    - `momentum`, `discrete`: the clock of a schedule or of momentum (see
      `clock`; default: no momentum, the clock of the optimizer's steps).
    - `t0`: the time at which `W = W0` (default 0; `None` means `ts[0]`).
    - `solver`, `stepsize_controller`, `adjoint`: diffrax objects; `None` is the
      default above. A controller's `rtol`/`atol` must be finite and `>= 0`.
    - `dt0`: the first step (`None`: diffrax chooses); `max_steps >= 1`.
    - `throw`: raise if the solve fails (e.g. `max_steps` reached). With
      `throw=False` a failed solve returns NaN everywhere.

    **Returns:** a `Solution` with `ys = W(ts)`, shape `(T, p, r)` (the factors,
    not `M`: `M(t) = ys[t] @ ys[t].T`), and `loss = task.loss_factor(W(ts))`,
    shape `(T,)`.

    **Raises:** `ValueError` if `W0` is not `(task.p, r)`, zero or not finite;
    if `ts` is empty, not increasing (or stops being so once cast to the task's
    dtype) or starts before `t0`; if `learning_rate <= 0`, `weight_decay < 0`,
    a tolerance is negative or not finite, or `max_steps < 1` (traced values:
    at run time, through `eqx.error_if`).
    """
    if not isinstance(task, Task):
        raise ValueError(f"`task` must be a Task, got {type(task)}.")
    W0 = jnp.asarray(W0)
    dtype = jnp.result_type(task.dtype, W0.dtype, float)
    y0 = _check_factor(W0, task.p, dtype)
    learning_rate = check_learning_rate(learning_rate, dtype)
    lam = nonnegative("weight_decay", jnp.asarray(weight_decay, dtype))
    check_shape("weight_decay", lam, ())
    ts, t_start = check_times(ts, dtype, t0)
    controller, pending = step_size_controller(
        stepsize_controller, None, None, _default_tolerances(dtype)
    )
    eta, s_start, times, inverse = field_rate_and_times(
        learning_rate, ts, t_start, momentum=momentum, discrete=discrete
    )
    s_max = overflow_exponent(dtype)
    (s, V), _, stats, result = integrate(
        _TERM,
        diffrax.Tsit5() if solver is None else solver,
        y0,
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
    W = jnp.exp(s)[:, None, None] * V
    return Solution(ts, W, jax.lax.map(task.loss_factor, W), stats, result)
