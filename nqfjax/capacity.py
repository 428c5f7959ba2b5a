r"""What a model of given width, data and weight decay converges to (THEORY.md
section 6).

Training `W` (`p x m`) by gradient flow with weight decay $\lambda$ minimises

$$F(M) = L(M) + \frac{\lambda}{2}\,\mathrm{Tr}\,M, \qquad M = W W^\top \succeq 0,
\quad \mathrm{rank}\,M \le m,$$

because $|W|^2 = \mathrm{Tr}[W W^\top]$: the flow
$\dot M = -2\eta(GM + MG) - 2\eta\lambda M$ of THEORY.md section 2 is
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
- maps the test error of the quadratic network trained on `n` Gaussian samples
  with width `m` and weight decay $\lambda$ (`finite_data_map`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
from jaxtyping import Array, ArrayLike, Bool, Float, Int, PRNGKeyArray

from ._checks import check_shape, is_concrete, nonnegative, positive, static_int
from .mflow import solve_mflow
from .structures.quadratic import QuadraticNet
from .sweep import grid_product, sweep
from .tasks import Task, gaussian_quadratic_task, task_from_samples
from .train import train


# --------------------------------------------------------------------------------
# Small helpers


def _sym(X):
    return 0.5 * (X + X.T)


def _inner(X, Y):
    return jnp.sum(X * Y)


def _psd_project(X):
    """The nearest PSD matrix in Frobenius norm: clip the eigenvalues at zero."""
    w, V = jnp.linalg.eigh(_sym(X))
    return (V * jnp.maximum(w, 0.0)[None, :]) @ V.T


def _defaults(dtype) -> dict:
    if jnp.dtype(dtype) == jnp.float64:
        return dict(tol=1e-11, grad_tol=1e-8, rank_tol=1e-8)
    return dict(tol=1e-5, grad_tol=1e-4, rank_tol=1e-3)


def _scale(task, lam):
    """|C|_F + (lam/2) sqrt(p): the size of the gradient Z at M = 0, the unit of the
    relative KKT residuals."""
    s = jnp.sqrt(jnp.sum(task.C**2)) + 0.5 * lam * jnp.sqrt(task.p)
    return jnp.maximum(s, jnp.finfo(task.dtype).tiny)


def _stationarity(task, lam, M):
    """|Z M|_F / (s |M|_F): the relative residual of the fixed-point condition."""
    Z = _sym(task.K(M) - task.C) + 0.5 * lam * jnp.eye(task.p, dtype=M.dtype)
    normM = jnp.sqrt(jnp.sum(M**2))
    denom = _scale(task, lam) * jnp.where(normM > 0, normM, 1.0)
    return jnp.sqrt(jnp.sum((Z @ M) ** 2)) / denom


def _kkt(task, lam, M):
    """(stationarity, dual infeasibility, min eigenvalue of Z), the first two
    relative to `_scale`."""
    Z = _sym(task.K(M) - task.C) + 0.5 * lam * jnp.eye(task.p, dtype=M.dtype)
    zmin = jnp.linalg.eigvalsh(Z)[0]
    dual = jnp.maximum(-zmin, 0.0) / _scale(task, lam)
    return _stationarity(task, lam, M), dual, zmin


def _rank(M, rank_tol):
    w = jnp.linalg.eigvalsh(_sym(M))
    top = jnp.max(w)
    return jnp.sum(w > rank_tol * jnp.where(top > 0, top, jnp.inf)).astype(jnp.int32)


def _top_factor(M):
    """`W` (`p x p`) with `W W^T = M`, columns in decreasing order of eigenvalue
    (zero beyond the rank)."""
    w, V = jnp.linalg.eigh(_sym(M))
    w, V = w[::-1], V[:, ::-1]
    return V * jnp.sqrt(jnp.maximum(w, 0.0))[None, :]


# --------------------------------------------------------------------------------
# The convex problem: accelerated projected gradient on the PSD cone


def _operator_norm(task, iters: int = 60):
    """Largest eigenvalue of `K` on symmetric matrices (power iteration, a lower
    bound; the line search below corrects an underestimate)."""
    p = task.p
    X = jr.normal(jr.key(0), (p, p), task.dtype)
    X = _sym(X) + jnp.eye(p, dtype=task.dtype)
    X = X / jnp.sqrt(jnp.sum(X**2))

    def body(_, X):
        Y = _sym(task.K(X))
        return Y / jnp.maximum(jnp.sqrt(jnp.sum(Y**2)), jnp.finfo(task.dtype).tiny)

    X = jax.lax.fori_loop(0, iters, body, X)
    return _inner(X, task.K(X))


def _convex(task, lam, tol, max_steps):
    r"""FISTA with backtracking and adaptive restart for
    $\min_{M \succeq 0} L(M) + \tfrac\lambda2\mathrm{Tr}M$, from `M = 0`.

    One `K` application per step (`K` is linear, so `K[y]` at the extrapolated point
    is a combination of the last two). Stops when the gradient mapping
    $L_K |y - \Pi(y - Z(y)/L_K)|$ falls below `tol * _scale`."""
    p, dtype = task.p, task.dtype
    eye = jnp.eye(p, dtype=dtype)
    C = _sym(task.C)
    s = _scale(task, lam)
    tiny = jnp.finfo(dtype).tiny
    L0 = 1.1 * jnp.maximum(_operator_norm(task), tiny)

    def cond(state):
        *_, res, k = state
        return (k < max_steps) & (res > tol)

    def body(state):
        x, Kx, xp, Kxp, t, L, res, k = state
        t_new = 0.5 * (1.0 + jnp.sqrt(1.0 + 4.0 * t * t))
        beta = (t - 1.0) / t_new
        y = x + beta * (x - xp)
        Ky = Kx + beta * (Kx - Kxp)
        grad = Ky - C + 0.5 * lam * eye
        x_new = _psd_project(y - grad / L)
        Kx_new = _sym(task.K(x_new))
        d = x_new - y
        dd = jnp.sum(d * d)
        dKd = jnp.sum(d * (Kx_new - Ky))
        # sufficient decrease of a quadratic: <d, K d> <= L |d|^2
        ok = dKd <= L * dd * (1.0 + 1e-10) + tiny
        # gradient-based adaptive restart (O'Donoghue & Candes, 2015)
        restart = jnp.sum((y - x_new) * (x_new - x)) > 0
        res_new = L * jnp.sqrt(dd) / s
        return (
            jnp.where(ok, x_new, x),
            jnp.where(ok, Kx_new, Kx),
            jnp.where(ok, x, xp),
            jnp.where(ok, Kx, Kxp),
            jnp.where(ok & ~restart, t_new, jnp.ones_like(t)),
            jnp.where(ok, L, 2.0 * L),
            jnp.where(ok, res_new, res),
            k + 1,
        )

    zero = jnp.zeros((p, p), dtype)
    one = jnp.ones((), dtype)
    state = (zero, zero, zero, zero, one, L0, jnp.asarray(jnp.inf, dtype), 0)
    x, *_, res, k = jax.lax.while_loop(cond, body, state)
    return x, jnp.asarray(k, jnp.int32), res <= tol


# --------------------------------------------------------------------------------
# The rank-capped problem: factored (Burer-Monteiro) solve


def _lbfgs(f, x0, grad_tol, max_steps):
    r"""Minimise `f` from `x0` by L-BFGS (`optax.lbfgs` with a backtracking Armijo
    line search that allows for roundoff in `f`) until `|grad| <= grad_tol`, the
    step limit, or the resolution of `f`. Returns `(x, |grad|, steps)`; callers
    judge convergence by the KKT residual.

    The capped problem is non-convex, and an Armijo search (unlike a Wolfe one)
    can store a curvature pair with `s.y < 0` and then propose an ascent
    direction: a step that does not lower `f` is rejected and the memory cleared,
    so the next step is steepest descent; two rejections in a row mean `f` is at
    its resolution, and the loop stops. (optax's zoom line search, which enforces
    the Wolfe conditions, was measured 4-8x slower on the finite-data sweeps.)
    The loop is written here, not run by `optimistix.minimise`, because
    `max_steps` is traced: under `vmap` over widths, the widths that need no
    solve run zero steps instead of the batch's longest run."""
    dtype = x0.dtype
    opt = optax.lbfgs(
        memory_size=10,
        linesearch=optax.scale_by_backtracking_linesearch(
            max_backtracking_steps=20,
            decrease_factor=0.5,
            increase_factor=jnp.inf,  # start every search from the unit step
            rtol=8 * jnp.finfo(dtype).eps,  # Armijo up to roundoff in f
        ),
    )
    value_and_grad = jax.value_and_grad(f)

    def cond(c):
        x, state, fx, g, k, rejected = c
        gn = jnp.sqrt(jnp.sum(g**2))
        return (k < max_steps) & (gn > grad_tol) & (rejected < 2)

    def body(c):
        x, state, fx, g, k, rejected = c
        updates, new_state = opt.update(g, state, x, value=fx, grad=g, value_fn=f)
        x_new = optax.apply_updates(x, updates)
        f_new, g_new = value_and_grad(x_new)
        ok = f_new < fx
        keep = functools.partial(jnp.where, ok)
        state = jax.tree.map(keep, new_state, opt.init(x))
        return (
            keep(x_new, x),
            state,
            keep(f_new, fx),
            keep(g_new, g),
            k + 1,
            jnp.where(ok, 0, rejected + 1),
        )

    f0, g0 = value_and_grad(x0)
    init = (x0, opt.init(x0), f0, g0, 0, 0)
    x, _, _, g, k, _ = jax.lax.while_loop(cond, body, init)
    return x, jnp.sqrt(jnp.sum(g**2)), k


def _factored(task, lam, mask, V0, scale_M, grad_tol, max_steps):
    r"""L-BFGS on $V \mapsto F(s V V^\top)/s_F$ with the columns outside `mask`
    held at zero, so that `rank M <= sum(mask)`. Normalised so that `V` and the
    gradient are O(1) whatever the scale of the task. Returns
    `(M, objective, |grad|, steps)`."""
    scale_F = scale_M * _scale(task, lam)
    maskf = mask.astype(V0.dtype)[None, :]

    def f(V):
        V = V * maskf
        F = task.loss(scale_M * (V @ V.T)) + 0.5 * lam * scale_M * jnp.sum(V * V)
        return F / scale_F

    V, g, k = _lbfgs(f, V0 * maskf, 0.1 * grad_tol, max_steps)
    V = V * maskf
    M = scale_M * (V @ V.T)
    return M, f(V) * scale_F, g, k


def _best_of(task, lam, mask, starts, scale_M, max_steps, opts):
    """Factored solves from `starts` (vmapped); the lowest objective wins, and among
    starts that tie with it to roundoff (the same minimum reached from several
    starts) the most stationary one. Returns `(M, stationarity)`."""
    M, obj, _, _ = jax.vmap(
        lambda V0: _factored(task, lam, mask, V0, scale_M, opts.grad_tol, max_steps)
    )(starts)
    obj = jnp.where(jnp.isfinite(obj), obj, jnp.inf)
    stat = jax.vmap(lambda M: _stationarity(task, lam, M))(M)
    best = jnp.min(obj)
    tie = obj <= best + 1e3 * jnp.finfo(task.dtype).eps * jnp.abs(best)
    i = jnp.argmin(jnp.where(tie, stat, jnp.inf))
    return M[i], stat[i]


def _width_path(task, lam, M_cvx, key, opts, m):
    r"""The best PSD `M` of rank `<= k` for `k = 1, ..., m` (computed) and
    `k = m + 1, ..., p` (copies of the width-`m` one), with convergence flags:
    shapes `(p, p, p)` and `(p,)`.

    Each width is a factored solve from the best of several starts:

    - greedy (`p` starts): the width-`(k-1)` solution plus one new unit along an
      eigenvector `v` of $Z = K[M] - C + \tfrac\lambda2 I$ with a negative
      eigenvalue, at the scale
      $t = -v^\top Z v / \langle vv^\top, K[vv^\top]\rangle$ that minimises the
      objective along $M + t\,vv^\top$ (one more mode switching on, as in
      training from small initialisation, THEORY.md section 4; the most negative
      one is not always the best: the capped problem has several local minima);
    - the top-`k` eigen-part of the convex optimum `M_cvx`;
    - `n_starts` isotropic random factors.

    A width at or above the rank of `M_cvx` takes `M_cvx` (optimal for it) and no
    factored step (which matters under `vmap`, where a batched loop runs as long
    as any member does)."""
    p, dtype = task.p, task.dtype
    tiny = jnp.finfo(dtype).tiny
    eye = jnp.eye(p, dtype=dtype)
    rank_cvx = _rank(M_cvx, opts.rank_tol)
    w, V = jnp.linalg.eigh(_sym(M_cvx))
    w, V = w[::-1], V[:, ::-1]
    top = jnp.maximum(w[0], 0.0)
    scale_M = jnp.where(top > 0, top, 1.0)
    V_trunc = V * jnp.sqrt(jnp.maximum(w, 0.0) / scale_M)[None, :]

    def step(M_prev, k):
        mask = jnp.arange(p) < k
        fits = rank_cvx <= k
        active = (k <= m) & ~fits
        # greedy start
        wp, Vp = jnp.linalg.eigh(_sym(M_prev))
        wp, Vp = wp[::-1], Vp[:, ::-1]
        V_prev = Vp * jnp.sqrt(jnp.maximum(wp, 0.0) / scale_M)[None, :]
        Z = _sym(task.K(M_prev) - task.C) + 0.5 * lam * eye
        zw, zV = jnp.linalg.eigh(Z)

        def greedy(z, v):
            vv = jnp.outer(v, v)
            t = jnp.maximum(-z, 0.0) / jnp.maximum(jnp.sum(vv * task.K(vv)), tiny)
            return V_prev.at[:, k - 1].set(v * jnp.sqrt(t / scale_M))

        starts = [jax.vmap(greedy)(zw, zV.T), V_trunc[None]]
        if opts.n_starts:
            R = jr.normal(jr.fold_in(key, k), (opts.n_starts, p, p), dtype)
            starts.append(R / jnp.sqrt(p))
        starts = jnp.concatenate(starts)
        max_steps = jnp.where(active, opts.factored_max_steps, 0)
        M_k, stat = _best_of(task, lam, mask, starts, scale_M, max_steps, opts)
        M_k = jnp.where(fits, M_cvx, jnp.where(k <= m, M_k, M_prev))
        ok = fits | (k > m) | (stat <= opts.grad_tol)
        return M_k, (M_k, ok)

    ks = jnp.arange(1, p + 1)
    _, (Ms, oks) = jax.lax.scan(step, jnp.zeros((p, p), dtype), ks)
    return Ms, oks


def _width_limited(task, lam, mask, key, M_cvx, opts):
    """The best PSD `M` of rank `<= sum(mask)` found (`_width_path`), and whether
    it converged."""
    m = jnp.sum(mask)
    Ms, oks = _width_path(task, lam, M_cvx, key, opts, m)
    return Ms[m - 1], oks[m - 1]


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


class _Options(eqx.Module):
    # Tolerances and step limits are arrays (traced), so changing them does not
    # recompile; only the number of starts fixes a shape.
    tol: Float[Array, ""]
    max_steps: Int[Array, ""]
    grad_tol: Float[Array, ""]
    factored_max_steps: Int[Array, ""]
    rank_tol: Float[Array, ""]
    n_starts: int = eqx.field(static=True)


def _assemble(task, lam, M, steps, ok, rank_tol):
    stat, dual, zmin = _kkt(task, lam, M)
    return ConvergedSolution(
        M=M,
        W=_top_factor(M),
        weight_decay=lam,
        objective=task.loss(M) + 0.5 * lam * jnp.trace(M),
        loss=task.loss(M),
        rank=_rank(M, rank_tol),
        stationarity=stat,
        dual_infeasibility=dual,
        min_dual_eigenvalue=zmin,
        num_steps=steps,
        converged=ok,
    )


def _solve(task, lam, mask, key, opts: _Options, capped: bool):
    """Traceable core: convex solve, then (when `capped`) the factored solve under
    the rank cap `mask`, keeping the convex optimum whenever it fits the cap."""
    M, steps, ok = _convex(task, lam, opts.tol, opts.max_steps)
    if capped:
        M, ok_cap = _width_limited(task, lam, mask, key, M, opts)
        ok = ok & ok_cap
    return _assemble(task, lam, _sym(M), steps, ok, opts.rank_tol)


@eqx.filter_jit
def _solve_jit(task, lam, mask, key, opts, capped):
    return _solve(task, lam, mask, key, opts, capped)


def _check_task(task):
    if not isinstance(task, Task):
        raise ValueError(f"`task` must be an nqfjax Task, got {type(task)}.")


def _weight_decay(task, weight_decay):
    lam = jnp.asarray(weight_decay)
    check_shape("weight_decay", lam, ())
    return nonnegative("weight_decay", lam.astype(task.dtype))


def _options(dtype, tol, max_steps, grad_tol, factored_max_steps, n_starts, rank_tol):
    d = _defaults(dtype)
    n_starts = static_int("n_starts", n_starts, 0)
    max_steps = static_int("max_steps", max_steps)
    factored_max_steps = static_int("factored_max_steps", factored_max_steps)
    for name, value in (("tol", tol), ("grad_tol", grad_tol), ("rank_tol", rank_tol)):
        if value is not None and not (np.isfinite(value) and value > 0):
            raise ValueError(f"`{name}` must be a positive float, got {value!r}.")
    return _Options(
        tol=jnp.asarray(d["tol"] if tol is None else tol, dtype),
        max_steps=jnp.asarray(int(max_steps), jnp.int32),
        grad_tol=jnp.asarray(d["grad_tol"] if grad_tol is None else grad_tol, dtype),
        factored_max_steps=jnp.asarray(int(factored_max_steps), jnp.int32),
        rank_tol=jnp.asarray(d["rank_tol"] if rank_tol is None else rank_tol, dtype),
        n_starts=int(n_starts),
    )


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

    Minimises (THEORY.md sections 2 and 6)

    $$F(M) = L(M) + \frac\lambda2\,\mathrm{Tr}\,M \quad\text{over PSD } M
    \text{ (of rank} \le \texttt{width}\text{ when given)},$$

    the objective that gradient descent on `W` with the penalty
    $\tfrac\lambda2|W|^2$ minimises ($|W|^2 = \mathrm{Tr}\,W W^\top$). The flow
    $\dot M = -2\eta(ZM + MZ)$, $Z = K[M] - C + \tfrac\lambda2 I$, is at rest where
    $ZM = 0$; the global minimisers over all PSD `M` are the points where in
    addition $Z \succeq 0$ (the KKT conditions; the problem is convex because
    `K` is PSD), which is what a network of width `>= p` reaches from a generic
    start.

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
    opts = _options(
        task.dtype, tol, max_steps, grad_tol, factored_max_steps, n_starts, rank_tol
    )
    mask = jnp.arange(p) < width_
    key = jr.key(0) if key is None else key
    sol = _solve_jit(task, lam, mask, key, opts, width_ < p)
    if width_ != p:  # outside the compiled core, so that widths share a compilation
        W = sol.W[:, :width_]
        if width_ > p:
            W = jnp.concatenate([W, jnp.zeros((p, width_ - p), W.dtype)], axis=1)
        sol = eqx.tree_at(lambda s: s.W, sol, W)
    if throw:
        msg = (
            "converged_solution did not converge (raise `max_steps` or "
            "`factored_max_steps`, or loosen `tol`/`grad_tol`)."
        )
        if is_concrete(sol.converged):
            if not bool(sol.converged):
                raise RuntimeError(msg)
        else:
            sol = eqx.error_if(sol, ~sol.converged, msg)
    return sol


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
    before training (THEORY.md section 6).

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
    Ms, oks = _width_path(task, lam, M_cvx, key, opts, task.p)
    Ms = jax.vmap(_sym)(Ms)

    def stats(M):
        stat, _, zmin = _kkt(task, lam, M)
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
    from `(K, C)` alone (THEORY.md section 6).

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
    opts = _options(
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


# --------------------------------------------------------------------------------
# Public: finite data, width and weight decay


class FiniteDataMap(eqx.Module):
    r"""What `finite_data_map` returns: test and training errors of the quadratic
    network over a grid of samples `n`, widths `m`, weight decays $\lambda$ and
    seeds.

    **Fields:**

    - `ns`, `widths`: the grid axes (tuples of ints); `weight_decays` shape `(L,)`;
      `seeds` shape `(S,)`.
    - `test_error`: the population loss
      $\tfrac12\mathbb E_x (x^\top M x - x^\top M_\star x)^2$ of the learned `M`
      (the exact test error on fresh inputs against the noiseless teacher; with
      label noise of standard deviation $\sigma$ the expected error on noisy
      fresh labels is this plus $\sigma^2/2$), shape `(N, W, L, S)`.
    - `train_error`: the empirical loss on the `n` training samples,
      shape `(N, W, L, S)`.
    - `stationarity`: the relative fixed-point residual
      $|Z M|/(s|M|)$ of the learned `M` on its training task (how converged it
      is), shape `(N, W, L, S)`.
    - `floor`: the limit $n \to \infty$: the test error of the converged solution
      of the population task at each width and weight decay, shape `(W, L)`.
    - `method`: `"solution"`, `"train"` or `"mflow"`; `noise`: $\sigma$.
    """

    ns: tuple[int, ...] = eqx.field(static=True)
    widths: tuple[int, ...] = eqx.field(static=True)
    weight_decays: Float[Array, " L"]
    seeds: Int[Array, " S"]
    test_error: Float[Array, "N W L S"]
    train_error: Float[Array, "N W L S"]
    stationarity: Float[Array, "N W L S"]
    floor: Float[Array, "W L"]
    method: str = eqx.field(static=True)
    noise: float = eqx.field(static=True)

    @property
    def mean_test_error(self) -> Float[Array, "N W L"]:
        """`test_error` averaged over seeds."""
        return jnp.mean(self.test_error, axis=-1)

    @property
    def mean_train_error(self) -> Float[Array, "N W L"]:
        """`train_error` averaged over seeds."""
        return jnp.mean(self.train_error, axis=-1)


def _draw(seed, S_half, M_star, noise, n_max):
    """`n_max` Gaussian inputs `x ~ N(0, S)` and labels `x^T M* x + noise * xi`
    (`S_half` the symmetric square root of `S`)."""
    p, dtype = M_star.shape[0], M_star.dtype
    key = jr.key(seed)

    # sample i from its own key, so that the first n samples do not depend on
    # n_max: training sets are nested across calls too
    def one(i):
        z = jr.normal(jr.fold_in(key, i), (p + 1,), dtype)
        x = S_half @ z[:p]
        return x, x @ M_star @ x + noise * z[p]

    return jax.vmap(one)(jnp.arange(n_max))


def _finite_data_point(
    n, width, weight_decay, seed, *, setup, method, width_static, capped, opts, run
):
    S_half, M_star, pop, noise, n_max = setup
    p = M_star.shape[0]
    dtype = M_star.dtype
    xs, ys = _draw(seed, S_half, M_star, noise, n_max)
    keep = jnp.arange(n_max) < n
    # The first n samples; the rest are zeroed, which contributes nothing to K, C
    # or y2 but the normalisation 1/n_max: the padded task is (n/n_max) times the
    # n-sample task, so weight decay lam * n/n_max (and a learning rate
    # eta * n_max/n) give exactly the same minimiser (and trajectory).
    xs = jnp.where(keep[:, None], xs, 0.0)
    ys = jnp.where(keep, ys, 0.0)
    task = task_from_samples(QuadraticNet(p), xs, ys[:, None])
    frac = jnp.asarray(n, dtype) / n_max
    lam = jnp.asarray(weight_decay, dtype) * frac
    mask = jnp.arange(p) < width
    key = jr.fold_in(jr.key(seed), 1)
    if method == "solution":
        M = _solve(task, lam, mask, key, opts, capped).M
    elif method == "mflow":
        W0 = run["init_scale"] * jr.normal(key, (p, p), dtype) * mask[None, :]
        ts = jnp.asarray([run["num_steps"]], dtype)
        M = solve_mflow(
            task, W0 @ W0.T, ts, run["learning_rate"] / frac, lam, throw=False
        )[-1]
    else:
        res = train(
            QuadraticNet(p),
            xs,
            ys[:, None],
            num_steps=run["num_steps"],
            learning_rate=run["learning_rate"] / frac,
            key=key,
            init_scale=run["init_scale"],
            width=width_static,
            weight_decay=lam,
            model="quadratic",
            record_at=(run["num_steps"],),
        )
        M = res.M[-1]
    stat, _, _ = _kkt(task, lam, M)
    return pop.loss(M), task.loss(M) / frac, stat


@eqx.filter_jit
def _floor_jit(pop, lams, masks, key, opts, capped):
    def one(mask, lam):
        return _solve(pop, lam, mask, key, opts, capped).loss

    return jax.vmap(lambda mask: jax.vmap(lambda lam: one(mask, lam))(lams))(masks)


def _int_tuple(name, values) -> tuple[int, ...]:
    if isinstance(values, int | np.integer):
        values = (values,)
    out = tuple(static_int(f"{name}[i]", v) for v in values)
    if len(out) == 0:
        raise ValueError(f"`{name}` must be a non-empty sequence of ints >= 1.")
    return out


def finite_data_map(
    covariance: Float[ArrayLike, "d d"],
    M_star: Float[ArrayLike, "d d"],
    ns: Sequence[int],
    widths: Sequence[int],
    weight_decays: Float[ArrayLike, " L"],
    *,
    seeds: int | Sequence[int] = 4,
    noise: float = 0.0,
    method: Literal["solution", "train", "mflow"] = "solution",
    learning_rate: float | None = None,
    num_steps: int | None = None,
    init_scale: float = 1e-3,
    n_starts: int = 0,
    tol: float | None = None,
    max_steps: int = 100_000,
    chunk: int | None = None,
    mesh=None,
    progress: bool = False,
) -> FiniteDataMap:
    r"""Test error of the quadratic network $f(x) = \sum_i (u_i\cdot x)^2$ trained on
    `n` samples with width `m` and weight decay $\lambda$, over a grid (THEORY.md
    section 6).

    Inputs $x \sim N(0, S)$, labels $y = x^\top M_\star x + \sigma\xi$. For each
    seed, `max(ns)` samples are drawn once and the first `n` are used (nested
    training sets, so curves in `n` are smooth). On each training set the model
    is taken to convergence by `method`:

    - `"solution"` (default): the fixed point of the flow, `converged_solution`
      of the sampled task with the width cap (`n_starts` random starts for the
      capped widths, besides the systematic ones);
    - `"train"`: W-space gradient descent of the quadratic form (`train`,
      `model="quadratic"`) for `num_steps` steps of `learning_rate` from an
      isotropic start of scale `init_scale`;
    - `"mflow"`: the M-space flow (`solve_mflow`) to `t = num_steps` from
      $M_0 = W_0 W_0^\top$ with $W_0$ of `m` random columns of that scale (the flow
      keeps the rank of $M_0$).

    The test error is the population loss of the Gaussian task at the learned
    `M` (`gaussian_quadratic_task(covariance, M_star).loss(M)`), the exact
    expected error on fresh inputs. `floor` is its limit $n \to \infty$, the
    converged solution of the population task: the regime boundaries in
    `(n, m, lam)` are where the test error meets it.

    **Sweeping.** Everything runs through `sweep`: the number of samples enters
    through a mask of the `max(ns)` drawn samples (the masked task is `n/max(ns)`
    times the `n`-sample task, compensated exactly in the weight decay and the
    learning rate), and the width through a mask of columns, so `"solution"` and
    `"mflow"` are a single compiled sweep over `(n, m, lam, seed)`. `train`'s
    width fixes a shape, so `"train"` loops over widths, one sweep each.

    **Arguments:**

    - `covariance`: $S$, shape `(d, d)`, symmetric PSD.
    - `M_star`: the teacher, shape `(d, d)`, symmetric (e.g. a power-law
      spectrum).
    - `ns`: numbers of samples (ints `>= 1`).
    - `widths`: widths (ints `>= 1`; widths `>= d` are uncapped).
    - `weight_decays`: values of $\lambda \ge 0$, shape `(L,)`.
    - `seeds`: an int (that many seeds, `0..seeds-1`) or a sequence of ints.
    - `noise`: label noise $\sigma \ge 0$ (default 0).
    - `method`: `"solution"`, `"train"` or `"mflow"`.
    - `learning_rate`, `num_steps`, `init_scale`: for `"train"` and `"mflow"`
      (required there; `learning_rate` is $\eta$ of the `n`-sample problem).
    - `n_starts`, `tol`, `max_steps`: options of `converged_solution` (here `tol`
      defaults to 1e-8 in float64, 1e-5 in float32).
    - `chunk`, `mesh`, `progress`: passed to `sweep` (default `chunk`: the points
      of one `n`).

    **Returns:** a `FiniteDataMap`.

    **Raises:** `ValueError` for bad shapes or values (through
    `gaussian_quadratic_task`, `sweep` and the checks here), an unknown `method`,
    or a missing `learning_rate`/`num_steps`.
    """
    pop = gaussian_quadratic_task(covariance, M_star)
    S, M_star = pop.covariance, pop.M_star
    p, dtype = pop.p, pop.dtype
    ns = _int_tuple("ns", ns)
    widths = _int_tuple("widths", widths)
    lams = np.asarray(weight_decays, dtype=np.dtype(dtype))
    if lams.ndim != 1 or lams.size == 0 or not np.all(np.isfinite(lams) & (lams >= 0)):
        raise ValueError(
            "`weight_decays` must be a non-empty 1-D array of finite values >= 0."
        )
    if isinstance(seeds, int | np.integer):
        if int(seeds) < 1:
            raise ValueError(f"`seeds` must be >= 1, got {seeds}.")
        seeds = np.arange(int(seeds))
    seeds = np.asarray(seeds)
    if seeds.ndim != 1 or seeds.size == 0 or seeds.dtype.kind not in "iu":
        raise ValueError("`seeds` must be an int or a non-empty 1-D array of ints.")
    noise = float(noise)
    if not (np.isfinite(noise) and noise >= 0):
        raise ValueError(f"`noise` must be finite and >= 0, got {noise}.")
    if method not in ("solution", "train", "mflow"):
        raise ValueError(
            f"`method` must be 'solution', 'train' or 'mflow', got {method!r}."
        )
    if method == "mflow" and min(widths) < p:
        raise ValueError(
            "method='mflow' needs every width >= d: a width-capped fixed point is a "
            "saddle of the M-space flow (THEORY.md section 2 closes on M, not on its "
            "rank), which roundoff in the dense flow escapes; use 'train' (W has m "
            "columns exactly) or 'solution' for capped widths."
        )
    run = None
    if method != "solution":
        if learning_rate is None or num_steps is None:
            raise ValueError(
                f"method={method!r} needs `learning_rate` and `num_steps` (enough "
                "steps to converge; check `stationarity` in the result)."
            )
        positive("learning_rate", jnp.asarray(learning_rate))
        positive("init_scale", jnp.asarray(init_scale))
        num_steps = static_int("num_steps", num_steps)
        run = dict(
            learning_rate=float(learning_rate),
            num_steps=num_steps,
            init_scale=float(init_scale),
        )
    if tol is None:  # test errors to ~1e-8: tighter costs iterations at small n
        tol = 1e-8 if jnp.dtype(dtype) == jnp.float64 else 1e-5
    opts = _options(dtype, tol, max_steps, None, 2_000, n_starts, None)
    w, V = jnp.linalg.eigh(S)
    S_half = (V * jnp.sqrt(jnp.maximum(w, 0.0))[None, :]) @ V.T
    setup = (S_half, M_star, pop, noise, max(ns))
    shape = (len(ns), len(widths), lams.size, seeds.size)
    point = functools.partial(
        _finite_data_point, setup=setup, method=method, opts=opts, run=run
    )
    # Default: one chunk per n (the grid's slowest axis), so that the iterations of
    # the ill-conditioned small-n points are not paid by the whole grid (a
    # vmapped loop runs as long as its slowest member).
    per_n = len(lams) * seeds.size * (1 if method == "train" else len(widths))
    sweep_kw = dict(
        chunk=per_n if chunk is None else chunk, mesh=mesh, progress=progress
    )
    if method == "train":
        outs = []
        for m in widths:
            grid = grid_product(
                {"n": np.asarray(ns), "weight_decay": lams, "seed": seeds}
            )
            fn = functools.partial(point, width=m, width_static=m, capped=False)
            res = sweep(fn, grid, **sweep_kw)
            outs.append(
                [
                    np.asarray(o).reshape(len(ns), 1, lams.size, seeds.size)
                    for o in res.outputs
                ]
            )
        test, trn, stat = (
            np.concatenate([o[i] for o in outs], axis=1) for i in range(3)
        )
    else:
        grid = grid_product(
            {
                "n": np.asarray(ns),
                "width": np.asarray(widths),
                "weight_decay": lams,
                "seed": seeds,
            }
        )
        point = functools.partial(point, width_static=p, capped=min(widths) < p)
        res = sweep(point, grid, **sweep_kw)
        test, trn, stat = (np.asarray(o).reshape(shape) for o in res.outputs)
    masks = jnp.arange(p)[None, :] < jnp.asarray(widths)[:, None]
    floor = _floor_jit(pop, jnp.asarray(lams), masks, jr.key(0), opts, min(widths) < p)
    return FiniteDataMap(
        ns=ns,
        widths=widths,
        weight_decays=jnp.asarray(lams),
        seeds=jnp.asarray(seeds),
        test_error=jnp.asarray(test),
        train_error=jnp.asarray(trn),
        stationarity=jnp.asarray(stat),
        floor=floor,
        method=method,
        noise=noise,
    )
