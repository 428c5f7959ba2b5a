r"""Solvers for the converged solution on the PSD cone (private).

Hand-written because no library offers them: FISTA projected onto the PSD cone
for the convex problem, and L-BFGS (optax's, with a reset on rejected steps) on
a factor $M = V V^\top$ for the width-capped one, with traced step counts so that
`jit` and `vmap` see one program.
"""

from __future__ import annotations

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
from jaxtyping import Array, Float, Int

from .._checks import static_int
from .._linalg import frobenius as _inner, psd_project as _psd_project, sym as _sym


def default_tolerances(dtype) -> dict:
    """The default `tol`, `grad_tol` and `rank_tol` for `dtype`."""
    if jnp.dtype(dtype) == jnp.float64:
        return dict(tol=1e-11, grad_tol=1e-8, rank_tol=1e-8)
    return dict(tol=1e-5, grad_tol=1e-4, rank_tol=1e-3)


class SolverOptions(eqx.Module):
    """The solvers' tolerances and step limits (`solver_options`)."""

    # Tolerances and step limits are arrays (traced), so changing them does not
    # recompile; only the number of starts fixes a shape.
    tol: Float[Array, ""]
    max_steps: Int[Array, ""]
    grad_tol: Float[Array, ""]
    factored_max_steps: Int[Array, ""]
    rank_tol: Float[Array, ""]
    n_starts: int = eqx.field(static=True)


def solver_options(
    dtype, tol, max_steps, grad_tol, factored_max_steps, n_starts, rank_tol
) -> SolverOptions:
    """The checked options (`None` tolerances: `default_tolerances(dtype)`), or a
    `ValueError` naming the bad one."""
    d = default_tolerances(dtype)
    n_starts = static_int("n_starts", n_starts, 0)
    max_steps = static_int("max_steps", max_steps)
    factored_max_steps = static_int("factored_max_steps", factored_max_steps)
    for name, value in (("tol", tol), ("grad_tol", grad_tol), ("rank_tol", rank_tol)):
        if value is not None and not (np.isfinite(value) and value > 0):
            raise ValueError(f"`{name}` must be a positive float, got {value!r}.")
    return SolverOptions(
        tol=jnp.asarray(d["tol"] if tol is None else tol, dtype),
        max_steps=jnp.asarray(int(max_steps), jnp.int32),
        grad_tol=jnp.asarray(d["grad_tol"] if grad_tol is None else grad_tol, dtype),
        factored_max_steps=jnp.asarray(int(factored_max_steps), jnp.int32),
        rank_tol=jnp.asarray(d["rank_tol"] if rank_tol is None else rank_tol, dtype),
        n_starts=int(n_starts),
    )


def minimise(task, lam, mask, key, opts: SolverOptions, capped: bool):
    """Traceable core: the convex solve, then (when `capped`) the factored solve
    under the rank cap `mask`, keeping the convex optimum whenever it fits the cap.
    Returns `(M, steps, converged)`, `M` symmetric."""
    M, steps, ok = solve_convex(task, lam, opts.tol, opts.max_steps)
    if capped:
        M, ok_cap = solve_width_limited(task, lam, mask, key, M, opts)
        ok = ok & ok_cap
    return _sym(M), steps, ok


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


def kkt_residuals(task, lam, M):
    """(stationarity, dual infeasibility, min eigenvalue of Z), the first two
    relative to `_scale`."""
    Z = _sym(task.K(M) - task.C) + 0.5 * lam * jnp.eye(task.p, dtype=M.dtype)
    zmin = jnp.linalg.eigvalsh(Z)[0]
    dual = jnp.maximum(-zmin, 0.0) / _scale(task, lam)
    return _stationarity(task, lam, M), dual, zmin


def numerical_rank(M, rank_tol):
    w = jnp.linalg.eigvalsh(_sym(M))
    top = jnp.max(w)
    return jnp.sum(w > rank_tol * jnp.where(top > 0, top, jnp.inf)).astype(jnp.int32)


def top_factor(M):
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


def solve_convex(task, lam, tol, max_steps):
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


def width_path(task, lam, M_cvx, key, opts, m):
    r"""The best PSD `M` of rank `<= k` for `k = 1, ..., m` (computed) and
    `k = m + 1, ..., p` (copies of the width-`m` one), with convergence flags:
    shapes `(p, p, p)` and `(p,)`.

    Each width is a factored solve from the best of several starts:

    - greedy (`p` starts): the width-`(k-1)` solution plus one new unit along an
      eigenvector `v` of $Z = K[M] - C + \tfrac\lambda2 I$ with a negative
      eigenvalue, at the scale
      $t = -v^\top Z v / \langle vv^\top, K[vv^\top]\rangle$ that minimises the
      objective along $M + t\,vv^\top$ (one more mode switching on, as in
      training from small initialisation; the most negative one is not always
      the best: the capped problem has several local minima);
    - the top-`k` eigen-part of the convex optimum `M_cvx`;
    - `n_starts` isotropic random factors.

    A width at or above the rank of `M_cvx` takes `M_cvx` (optimal for it) and no
    factored step (which matters under `vmap`, where a batched loop runs as long
    as any member does)."""
    p, dtype = task.p, task.dtype
    tiny = jnp.finfo(dtype).tiny
    eye = jnp.eye(p, dtype=dtype)
    rank_cvx = numerical_rank(M_cvx, opts.rank_tol)
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


def solve_width_limited(task, lam, mask, key, M_cvx, opts):
    """The best PSD `M` of rank `<= sum(mask)` found (`width_path`), and whether
    it converged."""
    m = jnp.sum(mask)
    Ms, oks = width_path(task, lam, M_cvx, key, opts, m)
    return Ms[m - 1], oks[m - 1]
