r"""The closed M-space flow, integrated with diffrax:

$$\frac{dM}{dt} = -2\eta\,(G M + M G) - 2\eta\lambda M, \qquad G = K[M] - C .$$
"""

import diffrax
import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Float

from .._checks import (
    check_shape,
    increasing,
    is_concrete,
    nonnegative,
    positive,
    symmetric_psd,
)
from .._linalg import _psd_sqrt
from ..tasks.base import Task


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


def solve_mflow(
    task: Task,
    M0: Float[ArrayLike, "p p"],
    ts: Float[ArrayLike, " T"],
    eta: Float[ArrayLike, ""],
    weight_decay: Float[ArrayLike, ""] = 0.0,
    *,
    t0: float | None = 0.0,
    solver: diffrax.AbstractSolver | None = None,
    rtol: float | None = None,
    atol: float | None = None,
    dt0: float | None = None,
    max_steps: int = 100_000,
    adjoint: diffrax.AbstractAdjoint = diffrax.RecursiveCheckpointAdjoint(),
    throw: bool = True,
    full_output: bool = False,
) -> Float[Array, "T p p"]:
    r"""Integrate the closed flow of $M = W W^\top$ and return `M(ts)`.

    $$\frac{dM}{dt} = -2\eta\,(G M + M G) - 2\eta\lambda M, \qquad
    G = K[M] - C \quad\text{(THEORY.md section 2)}.$$

    Time counts gradient steps of learning rate `eta`: the flow is the limit of
    full-batch gradient descent $W \leftarrow W - \eta(\nabla_W L + \lambda W)$
    with one step per unit of `t`, so `t = step` compares with GD.

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

    The default solver is the implicit `diffrax.Kvaerno5` (the flow is stiff once
    modes switch on); its dense Jacobian has `p^4` entries, so for large `p` pass
    an explicit solver such as `diffrax.Tsit5()`.

    Gradients with respect to the task, `eta`, `weight_decay` and `M0` go
    through `adjoint` (default `RecursiveCheckpointAdjoint`); the square root of
    `M0` has a custom derivative that stays finite for degenerate eigenvalues.

    **Arguments:**

    - `task`: the `Task` (`K`, `C`, `y2`).
    - `M0`: initial `M`, shape `(p, p)`, symmetric PSD, nonzero.
    - `ts`: output times (in steps), shape `(T,)`, strictly increasing,
      `ts[0] >= t0`.
    - `eta`: the learning rate, > 0.
    - `weight_decay`: $\lambda \ge 0$, weight decay on `W` (default 0).
    - `t0`: the time at which `M = M0` (default 0; `None` means `ts[0]`).
    - `solver`, `rtol`, `atol`, `dt0`, `max_steps`, `adjoint`: diffrax options.
      Tolerances default to 1e-9 in float64 and (1e-5, 1e-6) in float32;
      `dt0=None` lets diffrax choose the first step.
    - `throw`: raise if the solve fails (e.g. `max_steps` reached). With
      `throw=False` (vmapped sweeps) a failed solve returns NaN everywhere; the
      step limit never truncates a solution silently.
    - `full_output`: also return the `diffrax.Solution`.

    **Returns:** `M(ts)`, shape `(T, p, p)`; with `full_output`, `(M, solution)`.

    **Raises:** `ValueError` if `M0` is not `(task.p, task.p)`, not symmetric PSD,
    zero or not finite, if `ts` is not increasing, or if `eta <= 0` or
    `weight_decay < 0`.
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
    eta = positive("eta", jnp.asarray(eta, dtype))
    check_shape("eta", eta, ())
    lam = nonnegative("weight_decay", jnp.asarray(weight_decay, dtype))
    check_shape("weight_decay", lam, ())
    ts = increasing("ts", jnp.asarray(ts, dtype))
    if t0 is not None and is_concrete(ts) and float(np.asarray(ts)[0]) < float(t0):
        raise ValueError(f"`ts` must start at or after t0={t0}, got ts[0]={ts[0]}.")
    t_start = ts[0] if t0 is None else jnp.asarray(t0, dtype)

    W0 = _psd_sqrt(0.5 * (M0 + M0.T))
    norm0 = jnp.sqrt(jnp.sum(W0**2))
    if is_concrete(norm0) and not float(norm0) > 0:
        raise ValueError("`M0` must be nonzero (M = 0 is a fixed point of the flow).")
    norm0 = eqx.error_if(norm0, ~(norm0 > 0), "`M0` must be nonzero.")
    y0 = (jnp.log(norm0), W0 / norm0)

    default_rtol, default_atol = _default_tolerances(dtype)
    rtol = default_rtol if rtol is None else rtol
    atol = default_atol if atol is None else atol
    solver = diffrax.Kvaerno5() if solver is None else solver
    s_max = jnp.asarray(0.125 * float(np.log(np.finfo(np.dtype(dtype)).max)), dtype)

    sol = diffrax.diffeqsolve(
        _TERM,
        solver,
        t0=t_start,
        t1=ts[-1],
        dt0=dt0,
        y0=y0,
        args=(task, eta, lam, s_max),
        saveat=diffrax.SaveAt(ts=ts),
        stepsize_controller=diffrax.PIDController(rtol=rtol, atol=atol),
        max_steps=max_steps,
        adjoint=adjoint,
        throw=throw,
    )
    s, V = sol.ys
    M = jnp.exp(2.0 * s)[:, None, None] * jnp.einsum("tij,tkj->tik", V, V)
    ok = sol.result == diffrax.RESULTS.successful
    M = jnp.where(ok, M, jnp.nan)
    if full_output:
        return M, sol
    return M
