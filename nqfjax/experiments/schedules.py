r"""Learning-rate and batch-size schedules designed by gradient descent through
a model of minibatch SGD (`optimize_schedule`), beside the standard ones tuned
on the same model (`standard_schedules`), and trained for real
(`train_schedule`).

At a fixed budget of `num_steps` steps and `budget` samples
($\sum_t b_t = $ `budget`), `optimize_schedule` parametrises

$$\eta_t = \eta_{\max}\,\sigma\big(\mathrm{pl}_\theta(t)\big),\qquad
b_t = 1 + (\text{budget} - T)\,\mathrm{softmax}_t\big(\mathrm{pl}_\phi(t)\big),$$

$\mathrm{pl}$ a piecewise-linear curve through `num_knots` equally spaced knots
($2 \times$ `num_knots` parameters), and minimises a criterion with optax
through `jax.grad`: by default the typical run's $\mathbb E \ln L_T$ over
simulated paths of the stochastic map (`TypicalLoss`, `sgd_paths`), which
respects the learning rate at which real runs diverge; or the mean loss
$\ln \mathbb E L_T$ of the moment equation (`MeanLoss`, `sgd_moments`), whose
heavy tails put the edge far too low at small batches. `standard_schedules`
tunes each standard shape's peak on the same criterion, so that a design's gain
is measured against fairly tuned baselines.

The tools model the quadratic network on a `gaussian_quadratic_task` whose
covariance commutes with its teacher (or on sign-symmetric `samples` of one);
any other task is refused with a `ValueError` naming `task`.
"""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
from jax.scipy.stats import binom
from jaxtyping import Array, ArrayLike, Float, PRNGKeyArray

from .._checks import static_int
from ..engines.train import Segment, train_segments
from ..structures.quadratic import QuadraticNet
from ..tasks.gaussian import GaussianQuadraticTask
from ._schedule_criteria import (
    Criterion,
    MeanLoss,
    TypicalLoss,
    check_criterion,
    stability_edge,
)


__all__ = [
    "MeanLoss",
    "Schedule",
    "TypicalLoss",
    "evaluate_schedule",
    "optimize_schedule",
    "piecewise_constant",
    "stability_edge",
    "standard_schedules",
    "train_schedule",
]


class Schedule(eqx.Module):
    r"""A learning-rate and batch-size schedule with the loss a criterion
    (`TypicalLoss` or `MeanLoss`) predicts for it.

    **Attributes:**

    - `name`: a label.
    - `learning_rates`: $\eta_t$, shape `(T,)`.
    - `batch_sizes`: $b_t$ (real numbers for a relaxed schedule, integers for
      one that is trained), shape `(T,)`; their sum is the sample budget.
    - `predicted_loss`: the predicted loss after `0..T` steps, shape
      `(T + 1,)`: the typical run's ($\exp \mathbb E \ln L_t$ over the paths)
      or the mean one, as the criterion says.
    - `final_loss`: its last value (scalar; `inf` for a mean that diverged).
    - `name`: a label.
    - `diverged_fraction`: the predicted fraction of runs that diverge (for
      `MeanLoss`, 1 if the mean diverges, else 0); `None` if not computed.
    """

    learning_rates: Float[Array, " T"]
    batch_sizes: Float[Array, " T"]
    predicted_loss: Float[Array, " T1"]
    final_loss: Float[Array, ""]
    name: str = eqx.field(static=True, default="")
    diverged_fraction: Float[Array, ""] | None = None


def evaluate_schedule(
    task: GaussianQuadraticTask,
    learning_rates: Float[ArrayLike, " T"],
    batch_sizes: Float[ArrayLike, " T"],
    m0: Float[ArrayLike, " d"],
    *,
    name: str = "",
    criterion: Criterion | None = None,
    **model,
) -> Schedule:
    """The `Schedule` of given per-step sequences, with the loss `criterion`
    (default `TypicalLoss()`) predicts for them (`model`: the keyword
    arguments of `sgd_moments`, e.g. `noise_variance`, `samples`,
    `num_samples`). With `MeanLoss()` a predicted divergence of the mean gives
    `final_loss = inf`."""
    criterion = check_criterion(criterion)
    curve, final, frac = criterion.curve(task, learning_rates, batch_sizes, m0, model)
    return Schedule(
        jnp.asarray(learning_rates),
        jnp.asarray(batch_sizes),
        curve,
        final,
        name,
        frac,
    )


def _best_peak(task, shape, batch_sizes, m0, peaks, name, model, crit) -> Schedule:
    """The schedule `peak * shape` with the lowest predicted final loss over
    `peaks` (each standard schedule is tuned on the criterion, to be fair to
    it)."""
    best = None
    for peak in peaks:
        sched = evaluate_schedule(
            task, peak * shape, batch_sizes, m0, name=name, criterion=crit, **model
        )
        if best is None or float(sched.final_loss) < float(best.final_loss):
            best = sched
    return best


def standard_shapes(T: int) -> dict[str, Float[Array, " T"]]:
    """The standard learning-rate shapes over `T` steps, peak 1, by name:
    constant, cosine, warmup-cosine (10% warmup) and step decay (x0.1 at half
    and three quarters of the run); the decaying ones end at `1e-6`, not 0
    (`sgd_moments` needs every rate > 0)."""
    t = jnp.arange(T)
    tiny = 1e-6
    return {
        "constant": jnp.ones(T),
        "cosine": optax.cosine_decay_schedule(1.0, T)(t) + tiny,
        "warmup-cosine": optax.warmup_cosine_decay_schedule(0.0, 1.0, T // 10, T)(t)
        + tiny,
        "step decay": optax.piecewise_constant_schedule(
            1.0, {T // 2: 0.1, (3 * T) // 4: 0.1}
        )(t),
    }


def standard_schedules(
    task: GaussianQuadraticTask,
    budget: int,
    m0: Float[ArrayLike, " d"],
    *,
    num_steps: int,
    max_learning_rate: float,
    num_peaks: int = 12,
    criterion: Criterion | None = None,
    **model,
) -> tuple[Schedule, ...]:
    r"""The standard schedules at a budget of `budget` samples over `num_steps`
    steps, each with its peak learning rate tuned on `criterion` (default
    `TypicalLoss()`, the typical run) over `num_peaks` log-spaced values from
    `max_learning_rate / 20` to `max_learning_rate`, with constant batches
    `budget / num_steps`: constant, cosine (`optax.cosine_decay_schedule`),
    warmup-cosine (`optax.warmup_cosine_decay_schedule`, 10% warmup) and step
    decay (`optax.piecewise_constant_schedule`, x0.1 at 50% and 75%); then the
    tuned cosine paired with the batch-size rule of the convex theory,
    `"cosine + convex batch"`.

    The convex rule: on a convex quadratic the minibatch noise adds
    $\propto \eta_t^2 c_b$ per step to an excess loss that the step removes at a
    rate $\propto \eta_t$, so the noise stays below the loss it acts on when
    $\eta_t / b_t \propto L_t$. We take $b_t \propto \eta_t / \hat L_t$, with
    $\hat L_t$ the loss predicted for the tuned cosine at constant batches,
    scaled to the budget (and at least 1): a heuristic for this non-convex
    problem, not its optimum.

    Pass a `max_learning_rate` above the stability edge (`stability_edge`):
    the tuning finds the best peak below it; a cap below the edge tunes
    timidly.

    **Returns:** a tuple of five `Schedule`s, in that order.
    """
    T = static_int("num_steps", num_steps, 1)
    crit = check_criterion(criterion)
    if budget < T:
        raise ValueError(f"`budget` ({budget}) must be >= num_steps ({T}).")
    if not max_learning_rate > 0:
        raise ValueError(f"`max_learning_rate` must be > 0, got {max_learning_rate}.")
    b = jnp.full(T, budget / T)
    peaks = np.geomspace(max_learning_rate / 20, max_learning_rate, num_peaks)
    out = [
        _best_peak(task, shape, b, m0, peaks, name, model, crit)
        for name, shape in standard_shapes(T).items()
    ]
    cosine = out[1]
    weight = cosine.learning_rates / cosine.predicted_loss[:-1]
    convex_b = 1 + (budget - T) * weight / jnp.sum(weight)
    out.append(
        evaluate_schedule(
            task,
            cosine.learning_rates,
            convex_b,
            m0,
            name="cosine + convex batch",
            criterion=crit,
            **model,
        )
    )
    return tuple(out)


def optimize_schedule(
    task: GaussianQuadraticTask,
    budget: int,
    m0: Float[ArrayLike, " d"],
    *,
    num_steps: int,
    max_learning_rate: float,
    num_knots: int = 16,
    init: Schedule | None = None,
    optimizer: optax.GradientTransformation | None = None,
    num_iterations: int = 150,
    batch_sizes: Float[ArrayLike, " T"] | None = None,
    criterion: Criterion | None = None,
    check_paths: int | None = None,
    check_confidence: float = 0.95,
    **model,
) -> Schedule:
    r"""The learning-rate and batch-size schedules that minimise the predicted
    final loss at a budget of `budget` samples over `num_steps` steps, under
    $\eta_t \le$ `max_learning_rate`, by gradient descent through `criterion`
    (default `TypicalLoss()`: the typical run's $\mathbb E \ln L_T$ over
    simulated paths, the same noise at every iteration; `MeanLoss()`: the
    moment equation's $\ln \mathbb E L_T$).

    The parametrisation (module docstring) has `2 num_knots` parameters; the
    batch sizes are real (relaxed) and sum to `budget` exactly. The optimiser
    starts from `init` (default: constant batches and a cosine at half the
    maximum), minimises the criterion's log final loss with `optimizer` (default
    `optax.adam(0.1)`) for `num_iterations` steps, skipping non-finite updates,
    and returns the best schedule seen (with `TypicalLoss`: checked on fresh
    paths, below, and replaced by its start, checked alike, where those paths
    find the start better).

    With `TypicalLoss`, the design is then checked on fresh paths: the
    optimiser sits at the divergence edge of the paths it saw (their noise,
    not the model's), so its divergence probability $p$ is tested again on
    $n = $ `check_paths` paths of another key (`fold_in(key, 1)`). A count
    of $k$ diverged paths passes when it shows $p \le$ `max_diverged`
    $= p_0$ at `check_confidence` $= 1 - \alpha$: the exact one-sided
    binomial test, $P[\mathrm{Bin}(n, p_0) \le k] \le \alpha$ (the
    Clopper-Pearson upper bound on $p$ at $1 - \alpha$ is then $\le p_0$);
    e.g. $k \le 17$ of 512 (3.3%) for $p_0 = 5\%$, $\alpha = 5\%$. If it
    fails, the learning rates are backed off, $\eta_t \to s\,\eta_t$ with
    the largest $s \le 1$ (bisection in $\log s$, resolution 1%) at which it
    passes. A check of the plain fraction ($k/n \le p_0$) stops where the
    fresh paths sit at $p_0$ by chance, above it as often as not: a design
    checked so on 512 paths lost 5.4% of 4096 other paths and 5.8% of 4096
    seeds of real SGD (`benchmarks/schedules_vs_sgd.py`, task A). The check
    runs on the batch sizes optimised (real numbers) or given: check a
    rounded schedule as rounded, with `batch_sizes=` its batches,
    `num_knots=num_steps` and `num_iterations=0` (its rates kept, then backed
    off); relaxed batches between two integers diverge less than the rounded
    ones that are run (5.9% against 7.5% of 4096 paths, task C).

    **Arguments:**

    - `task`, `m0`, `**model`: as for `sgd_moments`.
    - `criterion`: `TypicalLoss(...)` (default) or `MeanLoss()`.
    - `budget`: the total number of samples, `>= num_steps`.
    - `num_steps`: `T` (static int).
    - `max_learning_rate`: the bound on $\eta_t$.
    - `num_knots`: knots of each piecewise-linear curve (static int >= 2).
    - `init`: a `Schedule` to start from (its curves are read at the knots).
    - `optimizer`: an optax `GradientTransformation`.
    - `num_iterations`: optimiser steps.
    - `batch_sizes`: shape `(T,)`: keep these batch sizes and optimise the
      learning rates only (e.g. to polish the learning rates of a schedule whose
      batch sizes were rounded by `piecewise_constant`).
    - `check_paths`: paths of the fresh-key check (`TypicalLoss` only;
      default `4 * criterion.paths`; 0: no check, no back-off).
    - `check_confidence`: the confidence $1 - \alpha$ of the check, in
      `[0.5, 1)` (default 0.95; `max_diverged = 0` asks for no diverged path).

    **Returns:** the optimised `Schedule` (named `"optimised"`).

    **Raises:** `ValueError` for a budget below `num_steps`, a non-positive
    maximum learning rate, or fewer than 2 knots.
    """
    T = static_int("num_steps", num_steps, 1)
    K = static_int("num_knots", num_knots, 2)
    crit = check_criterion(criterion)
    if check_paths is not None:
        static_int("check_paths", check_paths, 0)
    if not 0.5 <= check_confidence < 1:
        raise ValueError(
            f"`check_confidence` must be in [0.5, 1), got {check_confidence}."
        )
    if isinstance(crit, TypicalLoss):
        n_check = 4 * crit.paths if check_paths is None else int(check_paths)
        allowed = _allowed_count(n_check, crit.max_diverged, check_confidence)
        if n_check and allowed < 0:
            raise ValueError(
                f"`check_paths` ({n_check}) too few to show a divergence "
                f"probability <= max_diverged ({crit.max_diverged}) at "
                f"`check_confidence` {check_confidence}, even with no path diverged."
            )
    if budget < T:
        raise ValueError(f"`budget` ({budget}) must be >= num_steps ({T}).")
    if not max_learning_rate > 0:
        raise ValueError(f"`max_learning_rate` must be > 0, got {max_learning_rate}.")
    t = jnp.arange(T, dtype=float)
    knots = jnp.linspace(0.0, T - 1, K)
    cap = model.get("num_samples")
    if cap is None and model.get("samples") is not None:
        cap = np.shape(model["samples"][0])[0]

    fixed_b = None if batch_sizes is None else jnp.asarray(batch_sizes, float)

    def unpack(theta):
        eta = max_learning_rate * jax.nn.sigmoid(jnp.interp(t, knots, theta[:K]))
        if fixed_b is not None:
            return eta, fixed_b
        b = 1 + (budget - T) * jax.nn.softmax(jnp.interp(t, knots, theta[K:]))
        return eta, b if cap is None else jnp.minimum(b, cap)

    if init is None:
        eta0 = 0.5 * max_learning_rate * optax.cosine_decay_schedule(1.0, T)(t)
        b0 = jnp.full(T, budget / T)
    else:
        eta0, b0 = init.learning_rates, init.batch_sizes
    frac = jnp.clip(jnp.interp(knots, t, eta0) / max_learning_rate, 1e-3, 1 - 1e-3)
    logb = jnp.log(jnp.clip(jnp.interp(knots, t, b0) - 1, 1e-3, None))
    theta = jnp.concatenate([jnp.log(frac / (1 - frac)), logb - jnp.mean(logb)])

    def objective(theta):
        eta, b = unpack(theta)
        return crit.objective(task, eta, b, m0, model)

    opt = optax.apply_if_finite(optax.adam(0.1) if optimizer is None else optimizer, 10)
    value_and_grad = eqx.filter_jit(jax.value_and_grad(objective))
    state = opt.init(theta)
    best_value, best_theta, theta_0 = np.inf, theta, theta
    for _ in range(int(num_iterations)):
        value, grad = value_and_grad(theta)
        if np.isfinite(float(value)) and float(value) < best_value:
            best_value, best_theta = float(value), theta
        updates, state = opt.update(grad, state, theta)
        theta = optax.apply_updates(theta, updates)
    eta, b = unpack(best_theta)
    if isinstance(crit, TypicalLoss) and n_check:
        eta, final = _back_off(crit, n_check, allowed, task, eta, b, m0, model)
        if best_theta is not theta_0:
            eta, b = _better_of(
                crit,
                n_check,
                allowed,
                task,
                (eta, b, final),
                unpack(theta_0),
                m0,
                model,
            )
    return evaluate_schedule(
        task, eta, b, m0, name="optimised", criterion=crit, **model
    )


def _allowed_count(n: int, cap: float, confidence: float) -> int:
    """The most diverged paths of `n` that show a divergence probability
    `<= cap` at `confidence`: the largest `k` with
    `P[Bin(n, cap) <= k] <= 1 - confidence` (`jax.scipy.stats.binom`, in
    float64 on the host); -1 if not even `k = 0` does; 0 for `cap = 0`."""
    if cap == 0 or n == 0:
        return 0
    with jax.enable_x64(True):
        log_pmf = binom.logpmf(jnp.arange(n + 1.0), float(n), float(cap))
        cdf = np.cumsum(np.exp(np.asarray(log_pmf, np.float64)))
    return int(np.searchsorted(cdf, 1 - confidence, side="right")) - 1


def _fresh(crit, n):
    """The user's criterion, every other field kept, on `n` other paths (key
    `fold_in(key, 1)`)."""
    key = jr.key(0) if crit.key is None else crit.key
    return dataclasses.replace(crit, paths=n, key=jr.fold_in(key, 1))


def _better_of(crit, n, allowed, task, design, start, m0, model):
    """`(eta, b)` of the design (`(eta, b, final)`, checked: `_back_off`) or
    of the start (`(eta, b)`), checked alike, whichever has the lower typical
    final loss on the fresh paths: a design pushed to the edge of the paths
    it saw, then backed off, can end above its start (without label noise:
    the slow test's design on 32 paths)."""
    eta, b = start
    try:
        eta, final = _back_off(crit, n, allowed, task, eta, b, m0, model)
    except ValueError:  # no scale of the start passes the check
        return design[:2]
    return (eta, b) if final < design[2] else design[:2]


def _back_off(crit, n, allowed, task, eta, b, m0, model):
    """`eta` scaled down by the largest `s <= 1` at which at most `allowed`
    of `n >= 1` fresh paths (key `fold_in(key, 1)`) diverge: bracket by
    factors 0.8, then 5 bisection steps in `log s`; with the typical final
    loss on those paths at that scale (`inf` if not finite)."""
    fresh = _fresh(crit, n)
    passed = {}  # scale -> final loss, of the scales that pass

    def ok(scale):
        _, final, frac = fresh.curve(task, scale * eta, b, m0, model)
        if int(round(float(frac) * n)) > allowed:
            return False
        final = float(final)
        passed[scale] = final if np.isfinite(final) else np.inf
        return True

    if ok(1.0):
        return eta, passed[1.0]
    hi, lo = 1.0, 0.8
    while not ok(lo):
        hi, lo = lo, 0.8 * lo
        if lo < 1e-3:
            raise ValueError(
                "`optimize_schedule`: no scale of the design's learning rates "
                "passes the fresh-path check (`max_diverged`, `check_confidence`)."
            )
    for _ in range(5):
        mid = float(np.sqrt(lo * hi))
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo * eta, passed[lo]


def piecewise_constant(
    schedule: Schedule,
    num_segments: int,
    task: GaussianQuadraticTask,
    m0: Float[ArrayLike, " d"],
    *,
    criterion: Criterion | None = None,
    **model,
) -> Schedule:
    """The schedule as `train_schedule` runs it: on `num_segments` equal
    segments, the mean learning rate and a power of two for the batch size (a
    few static batch sizes, so a few compilations of `train`): each segment's
    mean rounded down, then the segments furthest below their mean doubled, as
    long as the sample budget (the schedule's total) holds and no segment gets
    more than twice its mean. The loss is the one `criterion` (default
    `TypicalLoss()`) predicts for exactly that."""
    T = schedule.learning_rates.shape[0]
    S = static_int("num_segments", num_segments, 1)
    if T % S:
        raise ValueError(f"`num_segments` ({S}) must divide the {T} steps.")
    eta = schedule.learning_rates.reshape(S, -1).mean(axis=1)
    want = np.asarray(schedule.batch_sizes).reshape(S, -1).mean(axis=1)
    budget = float(np.sum(want)) * (T // S)
    # powers of two at or below what was asked (the budget holds), then double
    # the most shortchanged segments while the budget allows
    b = 2.0 ** np.floor(np.log2(np.maximum(want, 1.0)))
    while True:
        order = np.argsort(b / want)
        grown = [i for i in order if (np.sum(b) + b[i]) * (T // S) <= budget]
        if not grown or b[grown[0]] * 2 > 2 * want[grown[0]]:
            break
        b[grown[0]] *= 2
    return evaluate_schedule(
        task,
        jnp.repeat(eta, T // S),
        jnp.repeat(jnp.asarray(b), T // S),
        m0,
        name=schedule.name,
        criterion=criterion,
        **model,
    )


def train_schedule(
    schedule: Schedule,
    xs: Float[ArrayLike, "n d"],
    ys: Float[ArrayLike, "n 1"],
    W0: Float[ArrayLike, "d m"],
    keys: PRNGKeyArray,
    *,
    num_segments: int,
) -> Float[Array, "seeds S1"]:
    """Train the quadratic network with a piecewise-constant `schedule` (from
    `piecewise_constant`, constant on `num_segments` equal segments with integer
    batch sizes): one run of `num_segments` segments (`train_segments`, the real
    layer `Layer()` as everywhere), continuing from the last weights, vmapped
    over `keys` (one run per key; segment `i` draws its minibatches from
    `split(fold_in(key, i))[1]`). Returns the full-data loss at the start and
    after each segment, shape `(len(keys), num_segments + 1)`."""
    T = schedule.learning_rates.shape[0]
    S = static_int("num_segments", num_segments, 1)
    L = T // S
    eta = np.asarray(schedule.learning_rates).reshape(S, L)
    b = np.asarray(schedule.batch_sizes).reshape(S, L)
    if not (np.all(eta == eta[:, :1]) and np.all(b == b[:, :1])):
        raise ValueError("`schedule` must be constant on each segment.")
    net = QuadraticNet(xs.shape[1])
    n = xs.shape[0]
    sizes = [None if int(size) >= n else int(size) for size in b[:, 0]]

    def run(key):
        segments = [
            Segment(L, eta[i, 0], 0.0, sizes[i], jr.split(jr.fold_in(key, i))[1])
            for i in range(S)
        ]
        res = train_segments(
            net,
            xs,
            ys,
            segments,
            W0=W0,
            record_at=range(0, S * L + 1, L),
            snapshots=False,
        )
        return res.loss

    return jax.vmap(run)(keys)
