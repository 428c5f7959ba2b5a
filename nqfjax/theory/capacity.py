r"""What a model of given width, data and weight decay converges to.

Training `W` (`p x m`) by gradient flow with weight decay $\lambda$ minimises

$$F(M) = L(M) + \frac{\lambda}{2}\,\mathrm{Tr}\,M, \qquad M = W W^\top \succeq 0,
\quad \mathrm{rank}\,M \le m,$$

because $|W|^2 = \mathrm{Tr}[W W^\top]$: the flow
$\dot M = -2\eta(GM + MG) - 2\eta\lambda M$ is
$\dot M = -2\eta(Z M + M Z)$ with $Z = \nabla F = G + \tfrac\lambda2 I$, so its
fixed points satisfy $Z M = 0$. Without the rank cap the problem is convex ($K$
is PSD) and its minimisers are exactly the PSD `M` with

$$Z = K[M] - C + \tfrac\lambda2 I \succeq 0, \qquad Z M = 0$$

(the KKT conditions of the PSD cone). This module

- solves for that fixed point (`converged_solution`), with a certificate: the
  residuals of both KKT conditions;
- computes, from `(K, C)` alone, the rank of the optimum (`minimum_width`) and
  the excess loss of every narrower model (`excess_loss_by_width`), where the
  rank cap makes the problem non-convex;
"""

from __future__ import annotations

from collections.abc import Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
from jaxtyping import Array, ArrayLike, Bool, Float, Int, PRNGKeyArray

from .._checks import check_shape, error_if, is_concrete, nonnegative, static_int
from .._linalg import sym as _sym
from ..tasks.base import Task
from ._psd_solvers import (
    kkt_residuals,
    minimise,
    numerical_rank,
    solver_options,
    top_factor,
    width_path,
)


# --------------------------------------------------------------------------------
# Public: the converged solution


class ConvergedSolution(eqx.Module):
    r"""The fixed point of the M-space flow with weight decay: what `converged_solution`
    returns.

    With $Z = K[M] - C + \tfrac\lambda2 I$ and $s = |C|_F + \tfrac\lambda2\sqrt p$:

    **Fields:**

    - `M`: the solution, shape `(p, p)`, symmetric PSD.
    - `W`: a factor with `W W^T = M`, shape `(p, width)` (columns in decreasing
      order of eigenvalue; zero beyond the rank).
    - `weight_decay`: $\lambda$.
    - `objective`: $F(M) = L(M) + \tfrac\lambda2 \mathrm{Tr}\,M$;
      `loss`: $L(M)$.
    - `rank`: the numerical rank of `M` (eigenvalues above `rank_tol` times the
      largest).
    - `stationarity`: $|Z M|_F / (s\,|M|_F)$, the residual of the fixed-point
      condition $ZM = 0$ (and of complementary slackness); zero for `M = 0`.
    - `dual_infeasibility`: $\max(0, -\lambda_{\min}(Z)) / s$, the residual of
      $Z \succeq 0$.
    - `min_dual_eigenvalue`: $\lambda_{\min}(Z)$ (unnormalised). Adding one unit
      `w` changes the objective at rate $w^\top Z w$, so a negative value is the
      gain per unit of $|w|^2$ that a wider model would have: positive
      `dual_infeasibility` at a width-capped solution says the cap binds.
    - `num_steps`: steps of the convex solver.
    - `converged`: whether every solver stage reached its tolerance.

    `kkt_residual = max(stationarity, dual_infeasibility)` certifies a global
    minimiser over all PSD `M` (any width) when it is at roundoff level.
    """

    M: Float[Array, "p p"]
    W: Float[Array, "p m"]
    weight_decay: Float[Array, ""]
    objective: Float[Array, ""]
    loss: Float[Array, ""]
    rank: Int[Array, ""]
    stationarity: Float[Array, ""]
    dual_infeasibility: Float[Array, ""]
    min_dual_eigenvalue: Float[Array, ""]
    num_steps: Int[Array, ""]
    converged: Bool[Array, ""]

    @property
    def kkt_residual(self) -> Float[Array, ""]:
        """`max(stationarity, dual_infeasibility)`: the relative KKT residual of the
        convex problem without a width cap."""
        return jnp.maximum(self.stationarity, self.dual_infeasibility)


def _assemble(task, lam, M, steps, ok, rank_tol):
    stat, dual, zmin = kkt_residuals(task, lam, M)
    return ConvergedSolution(
        M=M,
        W=top_factor(M),
        weight_decay=lam,
        objective=task.loss(M) + 0.5 * lam * jnp.trace(M),
        loss=task.loss(M),
        rank=numerical_rank(M, rank_tol),
        stationarity=stat,
        dual_infeasibility=dual,
        min_dual_eigenvalue=zmin,
        num_steps=steps,
        converged=ok,
    )


@eqx.filter_jit
def _solve_jit(task, lam, mask, key, opts, capped):
    M, steps, ok = minimise(task, lam, mask, key, opts, capped)
    return _assemble(task, lam, M, steps, ok, opts.rank_tol)


def _check_task(task):
    if not isinstance(task, Task):
        raise ValueError(f"`task` must be an nqfjax Task, got {type(task)}.")


def _weight_decay(task, weight_decay):
    lam = jnp.asarray(weight_decay)
    check_shape("weight_decay", lam, ())
    return nonnegative("weight_decay", lam.astype(task.dtype))


def converged_solution(
    task: Task,
    weight_decay: Float[ArrayLike, ""] = 0.0,
    *,
    width: int | None = None,
    key: PRNGKeyArray | None = None,
    n_starts: int = 4,
    tol: float | None = None,
    max_steps: int = 100_000,
    grad_tol: float | None = None,
    factored_max_steps: int = 2_000,
    rank_tol: float | None = None,
    throw: bool = True,
) -> ConvergedSolution:
    r"""The fixed point of the M-space flow with weight decay: what training
    converges to, without training.

    Minimises $F(M) = L(M) + \tfrac\lambda2\,\mathrm{Tr}\,M$ over PSD `M` (of
    rank `<= width` when given), what gradient descent on `W` with the penalty
    $\tfrac\lambda2|W|^2$ minimises; without the cap its global minimisers are
    the KKT points $ZM = 0$, $Z = K[M] - C + \tfrac\lambda2 I \succeq 0$ (see
    the theory page on finite width and data).

    **Algorithm.** (1) The convex problem: FISTA (Beck & Teboulle, 2009) on the PSD
    cone, projecting by clipping eigenvalues at zero, with a backtracking step
    $1/L_K$ ($L_K$ the largest eigenvalue of `K`, by power iteration) and
    gradient-based adaptive restart (O'Donoghue & Candes, 2015), from `M = 0`,
    until the relative gradient mapping is below `tol`. It converges linearly
    under strict complementarity and reaches the roundoff level in tens to
    thousands of steps for the tasks here. (2) With a `width` below the rank of
    that optimum, the rank cap makes the problem non-convex (it has spurious
    local minima, in which training from a random start can also stall): a
    factored (Burer-Monteiro) solve in $W$ by L-BFGS, width by width from 1 to
    `width`, each from several starts: the previous width's solution plus one
    unit along each eigenvector of $Z$ with a negative eigenvalue (at its
    optimal scale), the top eigen-part of the convex optimum, and `n_starts`
    random factors; the lowest objective wins. That is the best local minimum
    found, with no certificate of global optimality (`dual_infeasibility > 0`
    then says how much a wider model would gain). When the convex optimum fits
    the width it is returned (it is then optimal for every width).

    With `weight_decay = 0` and a singular `K` (e.g. fewer samples than
    `p (p + 1) / 2`), the minimiser need not be unique: this returns the one
    FISTA reaches from `M = 0`, not necessarily the one gradient descent from a
    small random start selects (its implicit bias); a positive `weight_decay`
    picks one.

    Works under `jit` and `vmap` (over `weight_decay`, keys and the task's
    arrays) in float32 and float64; `width` and `n_starts` are static (the
    tolerances are not, so changing them does not recompile). Not
    differentiable: the solvers are `while` loops (differentiate the loss at
    the solution, where `Z M = 0`, by the envelope theorem instead).

    **Arguments:**

    - `task`: the `Task`.
    - `weight_decay`: $\lambda \ge 0$ (default 0).
    - `width`: the number of units `m` (rank cap), a Python int `>= 1`; `None`
      (default) means no cap.
    - `key`: PRNG key for the random starts of the factored solve (default
      `key(0)`).
    - `n_starts`: random starts of the factored solve, in addition to the `p + 1`
      systematic ones (default 4).
    - `tol`: relative tolerance of the convex solve (default 1e-11 in float64,
      1e-5 in float32).
    - `max_steps`: step limit of the convex solve.
    - `grad_tol`: tolerance of the factored solve (default 1e-8 in float64, 1e-4
      in float32): it runs until the gradient of its normalised objective is
      below `grad_tol / 10` or the objective stops decreasing at roundoff, and
      has converged when the relative `stationarity` is below `grad_tol`;
      `factored_max_steps` is its step limit.
    - `rank_tol`: relative eigenvalue threshold for the rank (default 1e-8 in
      float64, 1e-3 in float32).
    - `throw`: raise if a solver stage did not converge (default `True`); with
      `False` (sweeps) inspect `converged`.

    **Returns:** a `ConvergedSolution` (`M`, `W`, the objective, the rank and the
    KKT residuals).

    **Raises:** `ValueError` for a task that is not a `Task`, a negative or
    non-scalar `weight_decay`, a `width` that is not an int `>= 1`, or bad
    options; a runtime error (`eqx.error_if`) when `throw` and a stage did not
    converge.
    """
    _check_task(task)
    lam = _weight_decay(task, weight_decay)
    p = task.p
    width_ = p if width is None else static_int("width", width)
    opts = solver_options(
        task.dtype, tol, max_steps, grad_tol, factored_max_steps, n_starts, rank_tol
    )
    mask = jnp.arange(p) < width_
    key = jr.key(0) if key is None else key
    sol = _with_width(_solve_jit(task, lam, mask, key, opts, width_ < p), width_)
    return _check_converged(sol) if throw else sol


def _with_width(sol: ConvergedSolution, width: int) -> ConvergedSolution:
    """`sol` with its factor `W` cut or zero-padded to `width` columns (outside
    the compiled core, so that widths share a compilation)."""
    p = sol.M.shape[0]
    if width == p:
        return sol
    W = sol.W[:, :width]
    if width > p:
        W = jnp.concatenate([W, jnp.zeros((p, width - p), W.dtype)], axis=1)
    return eqx.tree_at(lambda s: s.W, sol, W)


def _check_converged(sol: ConvergedSolution) -> ConvergedSolution:
    """`sol`, or a `RuntimeError` (an `eqx.error_if` when traced) if a solver
    stage did not converge."""
    msg = (
        "converged_solution did not converge (raise `max_steps` or "
        "`factored_max_steps`, or loosen `tol`/`grad_tol`)."
    )
    if is_concrete(sol.converged):
        if not bool(sol.converged):
            raise RuntimeError(msg)
        return sol
    return error_if(sol, ~sol.converged, msg, RuntimeError)


# --------------------------------------------------------------------------------
# Public: minimum width and the excess loss of narrower models


def minimum_width(
    task: Task,
    weight_decay: Float[ArrayLike, ""] = 0.0,
    *,
    rank_tol: float | None = None,
    tol: float | None = None,
    max_steps: int = 100_000,
) -> int:
    r"""The rank of the optimal `M`: the smallest width that reaches the minimum of
    $L(M) + \tfrac\lambda2\mathrm{Tr}\,M$ over PSD `M`, from `(K, C)` alone,
    before training.

    Computed from the certified convex optimum of `converged_solution` (without
    a width cap): the number of its eigenvalues above `rank_tol` times the
    largest. Weight decay soft-thresholds the optimum and can only lower this
    rank for the whitened Gaussian task. When the minimiser is not unique
    (`weight_decay = 0` and a singular `K`), this is the rank of the one
    `converged_solution` returns, an upper bound on the smallest.

    **Arguments:** `task`, `weight_decay` (default 0), `rank_tol`, `tol`,
    `max_steps` as in `converged_solution`.

    **Returns:** the rank, a Python int.

    **Raises:** `ValueError` as `converged_solution`; `RuntimeError` if the convex
    solve does not converge. Not jit-able (it returns an int).
    """
    sol = converged_solution(
        task, weight_decay, rank_tol=rank_tol, tol=tol, max_steps=max_steps
    )
    return int(sol.rank)


class WidthProfile(eqx.Module):
    r"""What `excess_loss_by_width` returns.

    **Fields:**

    - `widths`: the widths `m`, a tuple of ints.
    - `objective`: $F(M_m)$ at each width, shape `(len(widths),)`;
      `loss`: $L(M_m)$.
    - `excess`: $F(M_m) - F(M_\mathrm{opt})$, the excess objective (the excess loss
      when `weight_decay = 0`), `>= 0`, zero from `minimum_width` on.
    - `M`: the best PSD $M_m$ of rank `<= m` found, shape `(len(widths), p, p)`.
    - `stationarity`: the relative residual $|Z M_m|/(s|M_m|)$ at each width (a
      local optimality check; see `ConvergedSolution`).
    - `min_dual_eigenvalue`: $\lambda_{\min}(Z)$ at each width (negative where the
      width binds: the rate at which one more unit would lower the objective).
    - `converged`: whether each factored solve reached its tolerance.
    - `optimum`: the `ConvergedSolution` without a width cap.
    - `min_width`: its rank (`minimum_width`).
    """

    widths: tuple[int, ...] = eqx.field(static=True)
    objective: Float[Array, " W"]
    loss: Float[Array, " W"]
    excess: Float[Array, " W"]
    M: Float[Array, "W p p"]
    stationarity: Float[Array, " W"]
    min_dual_eigenvalue: Float[Array, " W"]
    converged: Bool[Array, " W"]
    optimum: ConvergedSolution
    min_width: int = eqx.field(static=True)


@eqx.filter_jit
def _profile_jit(task, lam, key, M_cvx, opts):
    Ms, oks = width_path(task, lam, M_cvx, key, opts, task.p)
    Ms = jax.vmap(_sym)(Ms)

    def stats(M):
        stat, _, zmin = kkt_residuals(task, lam, M)
        loss = task.loss(M)
        return loss + 0.5 * lam * jnp.trace(M), loss, stat, zmin

    obj, loss, stat, zmin = jax.vmap(stats)(Ms)
    return Ms, obj, loss, stat, zmin, oks


def excess_loss_by_width(
    task: Task,
    widths: Sequence[int] | None = None,
    weight_decay: Float[ArrayLike, ""] = 0.0,
    *,
    key: PRNGKeyArray | None = None,
    n_starts: int = 4,
    tol: float | None = None,
    max_steps: int = 100_000,
    grad_tol: float | None = None,
    factored_max_steps: int = 2_000,
    rank_tol: float | None = None,
) -> WidthProfile:
    r"""The excess loss of a model of each width below the rank of the optimum,
    from `(K, C)` alone.

    For each width `m`: the best PSD $M_m$ of rank `<= m` under the task's metric,

    $$M_m = \operatorname*{argmin}_{M \succeq 0,\ \mathrm{rank} M \le m}
    L(M) + \tfrac\lambda2 \mathrm{Tr}\,M,$$

    and its excess over the unconstrained optimum. When `K` is a multiple of the
    identity on symmetric matrices this is the Eckart-Young truncation of the
    optimum to its top `m` eigenvalues; for the whitened Gaussian quadratic task
    ($K[X] = 2X + I\,\mathrm{Tr}X$) the top `m` eigenvalues of the target,
    shifted by a common threshold. In general the problem is **non-convex**: it
    is solved in factored form (`W` of `m` columns, L-BFGS), width after width,
    from the previous width plus one unit along each descent eigenvector of $Z$,
    the truncation of the optimum and `n_starts` random starts, keeping the best
    (see `converged_solution`), so the result is the best local minimum found
    (an upper bound on the true excess), without a certificate. A width at or
    above the rank returns the certified optimum (excess zero).

    **Arguments:**

    - `task`: the `Task`.
    - `widths`: increasing ints `>= 1` (default `1, ..., minimum_width`).
    - `weight_decay`: $\lambda \ge 0$ (default 0).
    - `key`, `n_starts`, `tol`, `max_steps`, `grad_tol`, `factored_max_steps`,
      `rank_tol`: as in `converged_solution`.

    **Returns:** a `WidthProfile`.

    **Raises:** `ValueError` for a bad task, `weight_decay`, `widths` (not
    strictly increasing ints `>= 1`) or options; `RuntimeError` if the convex
    solve does not converge. Not jit-able as a whole (the default widths depend
    on the rank); the solves are one compiled call vmapped over widths and starts.
    """
    _check_task(task)
    lam = _weight_decay(task, weight_decay)
    p = task.p
    opts = solver_options(
        task.dtype, tol, max_steps, grad_tol, factored_max_steps, n_starts, rank_tol
    )
    key = jr.key(0) if key is None else key
    optimum = _solve_jit(task, lam, jnp.ones(p, bool), key, opts, False)
    if not bool(optimum.converged):
        raise RuntimeError(
            "excess_loss_by_width: the convex solve did not converge (raise "
            "`max_steps` or loosen `tol`)."
        )
    rank = int(optimum.rank)
    if widths is None:
        widths = tuple(range(1, max(rank, 1) + 1))
    else:
        if isinstance(widths, int | np.integer):
            raise ValueError("`widths` must be a sequence of ints, e.g. [1, 2, 3].")
        widths = tuple(static_int("widths[i]", w) for w in widths)
        if len(widths) == 0 or any(b <= a for a, b in zip(widths, widths[1:])):
            raise ValueError(
                f"`widths` must be a non-empty, strictly increasing sequence, got "
                f"{widths}."
            )
    # One greedy path through every width 1..p (one compilation per task shape),
    # then the requested ones (widths above p are width p).
    out = _profile_jit(task, lam, key, optimum.M, opts)
    index = jnp.asarray([min(w, p) - 1 for w in widths])
    M, obj, loss, stat, zmin, ok = (x[index] for x in out)
    return WidthProfile(
        widths=widths,
        objective=obj,
        loss=loss,
        excess=jnp.maximum(obj - optimum.objective, 0.0),
        M=M,
        stationarity=stat,
        min_dual_eigenvalue=zmin,
        converged=ok,
        optimum=optimum,
        min_width=rank,
    )
