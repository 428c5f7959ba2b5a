r"""The test error of the quadratic network over samples `n`, width `m` and weight
decay $\lambda$ (`finite_data_map`), through `nqfjax.sweep`."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
from jaxtyping import Array, ArrayLike, Float, Int

from .._checks import positive, static_int
from ..engines.mflow import solve_mflow
from ..engines.train import train
from ..progress import AbstractProgressMeter
from ..structures.models import QuadraticForm
from ..structures.quadratic import QuadraticNet
from ..sweep import grid_product, sweep
from ..tasks.gaussian import gaussian_quadratic_task
from ..tasks.sampled import task_from_samples
from ..theory._psd_solvers import kkt_residuals, minimise, solver_options


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
        M = minimise(task, lam, mask, key, opts, capped)[0]
    elif method == "mflow":
        W0 = run["init_scale"] * jr.normal(key, (p, p), dtype) * mask[None, :]
        ts = jnp.asarray([run["num_steps"]], dtype)
        M = solve_mflow(
            task, W0 @ W0.T, ts, run["learning_rate"] / frac, lam, throw=False
        ).ys[-1]
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
            model=QuadraticForm(),
            record_at=(run["num_steps"],),
        )
        M = res.M[-1]
    stat, _, _ = kkt_residuals(task, lam, M)
    return pop.loss(M), task.loss(M) / frac, stat


@eqx.filter_jit
def _floor_jit(pop, lams, masks, key, opts, capped):
    def one(mask, lam):
        return pop.loss(minimise(pop, lam, mask, key, opts, capped)[0])

    return jax.vmap(lambda mask: jax.vmap(lambda lam: one(mask, lam))(lams))(masks)


def _floor(pop, lams, widths, opts) -> Float[Array, "W L"]:
    """The limit `n -> infinity`: the population loss of the converged solution
    of the population task at each width and weight decay."""
    p = pop.p
    masks = jnp.arange(p)[None, :] < jnp.asarray(widths)[:, None]
    return _floor_jit(pop, jnp.asarray(lams), masks, jr.key(0), opts, min(widths) < p)


def _solution_options(dtype, tol, max_steps, n_starts):
    """The options of the converged solutions (`tol` default: 1e-8 in float64,
    1e-5 in float32; test errors to ~1e-8, tighter costs iterations at small n)."""
    if tol is None:
        tol = 1e-8 if jnp.dtype(dtype) == jnp.float64 else 1e-5
    return solver_options(dtype, tol, max_steps, None, 2_000, n_starts, None)


def _sqrt_psd(S) -> Float[Array, "d d"]:
    """The symmetric square root of the PSD matrix `S`."""
    w, V = jnp.linalg.eigh(S)
    return (V * jnp.sqrt(jnp.maximum(w, 0.0))[None, :]) @ V.T


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
    progress: bool | AbstractProgressMeter = False,
) -> FiniteDataMap:
    r"""Test error of the quadratic network $f(x) = \sum_i (u_i\cdot x)^2$ trained on
    `n` samples with width `m` and weight decay $\lambda$, over a grid (see the
    documentation's theory pages).

    Inputs $x \sim N(0, S)$, labels $y = x^\top M_\star x + \sigma\xi$. For each
    seed, `max(ns)` samples are drawn once and the first `n` are used (nested
    training sets, so curves in `n` are smooth). On each training set the model
    is taken to convergence by `method`:

    - `"solution"` (default): the fixed point of the flow, `converged_solution`
      of the sampled task with the width cap (`n_starts` random starts for the
      capped widths, besides the systematic ones);
    - `"train"`: W-space gradient descent of the quadratic form (`train`,
      `model=QuadraticForm()`) for `num_steps` steps of `learning_rate` from an
      isotropic start of scale `init_scale`;
    - `"mflow"`: the M-space flow (`solve_mflow`) to `t = num_steps` from
      $M_0 = W_0 W_0^\top$ with $W_0$ of `m` random columns of that scale (the flow
      keeps the rank of $M_0$).

    The test error is the population loss of the Gaussian task at the learned
    `M` (`gaussian_quadratic_task(covariance, M_star).loss(M)`, the exact error
    on fresh inputs); `floor`, its limit $n \to \infty$ (the converged solution
    of the population task), is met at the regime boundaries in `(n, m, lam)`.

    **Sweeping.** `n` enters as a mask of the `max(ns)` samples (compensated
    exactly in the weight decay and the learning rate) and the width as a mask
    of columns: `"solution"` and `"mflow"` are one compiled `sweep` over
    `(n, m, lam, seed)`; `"train"` (whose width is a shape) is one per width.

    **Arguments:**

    - `covariance`: $S$, shape `(d, d)`, symmetric PSD.
    - `M_star`: the teacher, shape `(d, d)`, symmetric.
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
    p, dtype = pop.p, pop.dtype
    ns, widths, lams, seeds, noise = _check_grid(
        ns, widths, weight_decays, seeds, noise, dtype
    )
    run = _check_method(method, widths, p, learning_rate, num_steps, init_scale)
    opts = _solution_options(dtype, tol, max_steps, n_starts)
    point = functools.partial(
        _finite_data_point,
        setup=(_sqrt_psd(pop.covariance), pop.M_star, pop, noise, max(ns)),
        method=method,
        opts=opts,
        run=run,
    )
    sweep_kw = dict(chunk=chunk, mesh=mesh, progress=progress)
    test, trn, stat = _sweep_grid(point, method, ns, widths, lams, seeds, p, sweep_kw)
    return FiniteDataMap(
        ns=ns,
        widths=widths,
        weight_decays=jnp.asarray(lams),
        seeds=jnp.asarray(seeds),
        test_error=jnp.asarray(test),
        train_error=jnp.asarray(trn),
        stationarity=jnp.asarray(stat),
        floor=_floor(pop, lams, widths, opts),
        method=method,
        noise=noise,
    )


def _check_grid(ns, widths, weight_decays, seeds, noise, dtype):
    """The grid axes of `finite_data_map`, checked: `(ns, widths, lams, seeds,
    noise)`."""
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
    return ns, widths, lams, seeds, noise


def _check_method(method, widths, p, learning_rate, num_steps, init_scale):
    """The training options of `method` (`None` for `"solution"`)."""
    if method not in ("solution", "train", "mflow"):
        raise ValueError(
            f"`method` must be 'solution', 'train' or 'mflow', got {method!r}."
        )
    if method == "mflow" and min(widths) < p:
        raise ValueError(
            "method='mflow' needs every width >= d: a width-capped fixed point is a "
            "saddle of the M-space flow (which closes on M, not on its rank), "
            "which roundoff in the dense flow escapes; use 'train' (W has m "
            "columns exactly) or 'solution' for capped widths."
        )
    if method == "solution":
        return None
    if learning_rate is None or num_steps is None:
        raise ValueError(
            f"method={method!r} needs `learning_rate` and `num_steps` (enough "
            "steps to converge; check `stationarity` in the result)."
        )
    positive("learning_rate", jnp.asarray(learning_rate))
    positive("init_scale", jnp.asarray(init_scale))
    return dict(
        learning_rate=float(learning_rate),
        num_steps=static_int("num_steps", num_steps),
        init_scale=float(init_scale),
    )


def _sweep_grid(point, method, ns, widths, lams, seeds, p, sweep_kw):
    """`(test, train, stationarity)`, each of shape `(N, W, L, S)`, through
    `sweep`: one sweep over `(n, m, lam, seed)`, or for `"train"`, whose width
    fixes a shape, one sweep per width. `sweep_kw["chunk"]=None`: one chunk per
    `n` (the grid's slowest axis), so that the iterations of the ill-conditioned
    small-n points are not paid by the whole grid (a vmapped loop runs as long
    as its slowest member)."""
    if sweep_kw["chunk"] is None:
        per_n = lams.size * seeds.size * (1 if method == "train" else len(widths))
        sweep_kw = dict(sweep_kw, chunk=per_n)
    if method != "train":
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
        shape = (len(ns), len(widths), lams.size, seeds.size)
        return tuple(np.asarray(o).reshape(shape) for o in res.outputs)
    outs = []
    grid = grid_product({"n": np.asarray(ns), "weight_decay": lams, "seed": seeds})
    for m in widths:
        fn = functools.partial(point, width=m, width_static=m, capped=False)
        res = sweep(fn, grid, **sweep_kw)
        shape = (len(ns), 1, lams.size, seeds.size)
        outs.append([np.asarray(o).reshape(shape) for o in res.outputs])
    return tuple(np.concatenate([o[i] for o in outs], axis=1) for i in range(3))
