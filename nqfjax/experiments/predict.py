r"""Predictions for a user's own architecture and data (`predict`) and their
agreement with a measured run (`agreement`); `experiments/predict_file.py` is
the file-to-report driver of `nqfjax predict`.

`predict` builds the empirical task of the samples and the initial
`M0 = W0 W0^T` that `train` would start from with the same key, and runs an
engine of `experiments/engines.py` on them (by default `AutoEngine`: the
Lotka-Volterra reduction where the data allow, else the M-space flow), saying
which engine it used and why.
"""

import warnings

import diffrax
import equinox as eqx
import jax.numpy as jnp
import jax.random as jr
import numpy as np
from jaxtyping import Array, ArrayLike, Float, PRNGKeyArray

from .._checks import eager_only, static_int
from ..engines.train import TrainResult, log_spaced_steps
from ..structures.base import AbstractStructure
from ..tasks.sampled import task_from_samples
from .engines import AbstractEngine, AutoEngine, accepts_factor, engine_from_word
from .switch_ons import SwitchOns, rank_switch_ons, switch_ons
from .validity import Validity, leading_order_validity


class Prediction(eqx.Module):
    r"""What `predict` returns: the predicted loss curve of training, when its
    modes switch on, the loss on the plateaus and the learned modes.

    Switch-ons are read off the eigenvalues of $M(t) = W W^\top$ *by rank*
    (`switch_ons`, `SwitchOns`): the `k`-th is the first time `k` eigenvalues
    are above half the smallest learned value. A trained network is timed the
    same way at the same threshold (what `agreement` does), so the two numbers
    measure the same event without following any eigenvector through time. A
    rank is *learned* when its last value exceeds
    $\sqrt{\lambda_{\max}(M_0)\,\lambda_{(1)}}$, the geometric middle between
    the initial scale and the largest learned mode; there are never more than
    the rank of $M$ (`width`). Choose the horizon so that the modes of interest
    have settled, and records dense enough to resolve them (the default 200
    log-spaced steps).

    **Attributes:**

    - `engine`: the engine used, `"lv"` (exact reduction), `"mflow"` (the
      M-space flow, dense or factored: `reason` says which) or
      `"approximate_lv"` (the Lotka-Volterra system in the eigenbasis of `C`):
      what an `AutoEngine` chose.
    - `reason`: one line saying why that engine (the measured violation).
    - `violation`: the relative violation of commutation measured by
      `lv_reduce` (0 for an exact reduction; NaN when it was not measured).
    - `ts`: the times (gradient steps), shape `(T,)`.
    - `loss`: the predicted loss at `ts`, shape `(T,)`.
    - `mode_curves`: the learned eigenvalues of `M` by rank along `ts`, shape
      `(T, q)`.
    - `switch_ons`: the `SwitchOns` of those curves (the threshold, the times,
      the groups of near-simultaneous switch-ons and their spreads).
    - `plateaus`: the loss before the first switch-on (at `ts[0]`), between
      consecutive switch-ons (at their geometric mean time) and at the last
      time, shape `(q + 1,)`, in time order.
    - `modes`: the learned modes, eigenvectors of the last `M`, shape `(p, q)`.
    - `mode_values`: their eigenvalues, shape `(q,)`.
    - `W0`: the initial weights `train` draws with the same key, shape
      `(p, width)` (`M0 = W0 W0^T` is a property).
    - `growth_rate`: the largest linear growth rate $r = 4\eta\lambda_{\max}(C)$
      per step. Full-batch GD grows a mode by $(1 + r/2)^2$ per step where the
      flow grows it by $e^r$: its switch-ons lag the flow's by a fraction of
      about $r/4$.
    - `validity`: where the leading order holds along the prediction (a
      `Validity`: the departure of the real layer from its quadratic form at
      about 40 records (log-spaced early, evenly spaced late), the expected
      shift of each switch-on by the real layer's higher orders and the lag of
      gradient descent, the step where it exceeds its tolerance, and a
      one-line `verdict`).

    **Properties:** `switch_times` (`switch_ons.times`), shape `(q,)`, in time
    order (NaN for ranks already on at `ts[0]`); `switch_levels`, the threshold
    they cross, shape `(q,)`; `M0`.
    """

    engine: str = eqx.field(static=True)
    reason: str = eqx.field(static=True)
    violation: Float[Array, ""]
    ts: Float[Array, " T"]
    loss: Float[Array, " T"]
    mode_curves: Float[Array, "T q"]
    switch_ons: SwitchOns
    plateaus: Float[Array, " q+1"]
    modes: Float[Array, "p q"]
    mode_values: Float[Array, " q"]
    W0: Float[Array, "p m"]
    growth_rate: Float[Array, ""]
    validity: Validity

    @property
    def switch_times(self) -> Float[Array, " q"]:
        """The switch-on times, `switch_ons.times`, shape `(q,)`."""
        return jnp.asarray(self.switch_ons.times, self.loss.dtype)

    @property
    def switch_levels(self) -> Float[Array, " q"]:
        """The level crossed at each of `switch_times` (the threshold), shape
        `(q,)`."""
        q = self.switch_ons.times.shape[0]
        return jnp.full(q, self.switch_ons.threshold, self.loss.dtype)

    @property
    def M0(self) -> Float[Array, "p p"]:
        """The initial `M = W0 W0^T`, shape `(p, p)`."""
        return self.W0 @ self.W0.T


class Agreement(eqx.Module):
    r"""How closely a measured run follows a `Prediction` (see `agreement`).

    **Attributes:**

    - `predicted_times`: the predicted switch-on times compared (the first `c`
      in time order), shape `(c,)`.
    - `measured_times`: the measured ones (the measured eigenvalues of `M` by
      rank crossing the same threshold), shape `(c,)`; NaN where not measured.
    - `time_errors`: `measured / predicted - 1`, shape `(c,)`.
    - `subspace_overlaps`: after each compared switch-on `k`, the cosine of the
      largest principal angle between the top-`k` predicted modes (at the last
      time; `k` extended to the end of a near-degenerate group) and the top-`k`
      measured ones (at twice the last compared switch-on), shape `(c,)`: near
      1 when the run learned the predicted directions (NaN against another
      prediction).
    - `log_loss_departure`: $\max |\ln L_{\rm measured} - \ln L_{\rm predicted}|$
      over the measured times up to `horizon`.
    - `horizon`: the last time compared: the `c`-th switch-on (or the last
      common time when no mode switches on).
    """

    predicted_times: Float[Array, " c"]
    measured_times: Float[Array, " c"]
    time_errors: Float[Array, " c"]
    subspace_overlaps: Float[Array, " c"]
    log_loss_departure: Float[Array, ""]
    horizon: Float[Array, ""]

    @property
    def max_time_error(self) -> float:
        """The largest `|time_errors|` (NaN if any time is missing)."""
        errors = np.asarray(self.time_errors)
        return float(np.max(np.abs(errors))) if errors.size else 0.0


# --------------------------------------------------------------------------------
# the start and the engine


def _initial_weights(structure, key, init_scale, width, dtype):
    """`W0` exactly as `nqfjax.train` draws it from `key`: the first half of
    `jr.split(key)` gives standard normals of shape `(p, width)` in the data's
    dtype, times `init_scale`."""
    init_key, _ = jr.split(key)
    Z = jr.normal(init_key, (structure.p, width), dtype)
    return jnp.asarray(init_scale, dtype) * Z


def _engine(engine, tol, solver, max_steps) -> AbstractEngine:
    """The engine object of `predict`'s arguments: `None` is `AutoEngine()`; a
    word and the keywords `tol`, `solver`, `max_steps` are deprecated (the same
    engine, through `engine_from_word`)."""
    old = {"tol": tol, "solver": solver, "max_steps": max_steps}
    given = [name for name, value in old.items() if value is not None]
    if isinstance(engine, AbstractEngine):
        if given:
            raise ValueError(
                f"Give {', '.join(f'`{n}`' for n in given)} inside the engine "
                f"object, not beside it (got engine={engine!r})."
            )
        return engine
    if engine is None and not given:
        return AutoEngine()
    word = "auto" if engine is None else engine
    if not isinstance(word, str):
        raise ValueError(
            "`engine` must be an nqfjax.AbstractEngine (AutoEngine, LVEngine, "
            f"MFlowEngine, FactoredMFlowEngine, ApproximateLVEngine) or None, got "
            f"{engine!r}."
        )
    result = engine_from_word(word, **old)  # raises for an unknown word
    what = [f"engine={word!r}"] * (engine is not None) + [f"`{n}`" for n in given]
    warnings.warn(
        f"predict's {', '.join(what)} is deprecated and will be removed in the next "
        f"release; pass the engine as an object: engine={result!r}.",
        DeprecationWarning,
        stacklevel=3,
    )
    return result


# --------------------------------------------------------------------------------
# reading the curves


def _plateaus(ts, loss, times):
    """The loss at `ts[0]`, half-way in `log t` between consecutive switch-on
    times, and at `ts[-1]`."""
    on = np.sort(times[np.isfinite(times) & (times > 0)])
    mids = np.sqrt(on[:-1] * on[1:])
    log_loss = np.log(np.maximum(loss, np.finfo(np.float64).tiny))
    inner = np.exp(np.interp(mids, ts, log_loss))
    levels = np.concatenate([[loss[0]], inner, [loss[-1]]])
    if len(on) == 0:  # no switch-on within the horizon: one plateau
        levels = levels[:1]
    # modes already on at ts[0] (NaN times) have no plateau before them
    missing = len(times) + 1 - len(levels)
    return np.concatenate([levels, np.full(missing, np.nan)])


def _time_grid(num_steps, num_records, ts):
    if (num_steps is None) == (ts is None):
        raise ValueError("Give exactly one of `num_steps` and `ts`.")
    if ts is not None:
        ts = np.asarray(ts, np.float64).reshape(-1)
        if ts.size < 2 or not np.all(np.isfinite(ts)) or np.any(np.diff(ts) <= 0):
            raise ValueError("`ts` must hold at least 2 increasing finite times.")
        if ts[0] < 0:
            raise ValueError(f"`ts` must start at or after 0, got {ts[0]}.")
        return ts
    num_steps = static_int("num_steps", num_steps, 1)
    num_records = static_int("num_records", num_records, 3)
    return np.asarray(log_spaced_steps(num_steps, num_records), np.float64)


def _check_arguments(structure, init_scale, learning_rate, width, weight_decay):
    """The scalar arguments of `predict`, checked on the host; the width as an
    int."""
    if not isinstance(structure, AbstractStructure):
        raise ValueError(
            f"`structure` must be an nqfjax.AbstractStructure, got {structure!r}."
        )
    width = static_int("width", width, 1)
    for name, value in (("init_scale", init_scale), ("learning_rate", learning_rate)):
        if not (np.ndim(value) == 0 and np.isfinite(value) and float(value) > 0):
            raise ValueError(f"`{name}` must be a finite number > 0, got {value!r}.")
    if not (np.ndim(weight_decay) == 0 and float(weight_decay) >= 0):
        raise ValueError(f"`weight_decay` must be >= 0, got {weight_decay!r}.")
    return width


def predict(
    structure: AbstractStructure,
    xs: Float[ArrayLike, "n ..."],
    ys: Float[ArrayLike, "n k"],
    *,
    init_scale: float,
    learning_rate: float,
    width: int,
    key: PRNGKeyArray,
    num_steps: int | None = None,
    ts: Float[ArrayLike, " T"] | None = None,
    num_records: int = 200,
    weight_decay: float = 0.0,
    engine: AbstractEngine | None = None,
    tol: float | None = None,
    solver: diffrax.AbstractSolver | None = None,
    max_steps: int | None = None,
) -> Prediction:
    r"""Predict the loss curve of training `structure` on `(xs, ys)` from small
    initialisation, when each mode switches on, and what it learns.

    Builds the empirical task (`task_from_samples`) and the initial
    $M_0 = W_0 W_0^\top$ with $W_0$ drawn exactly as
    `train(structure, xs, ys, key=key, init_scale=init_scale, width=width)`
    draws it, then runs `engine` (`AbstractEngine.run`): by default
    `AutoEngine()`, the exact Lotka-Volterra reduction where the data allow
    (`LVEngine`), else the M-space flow $\dot M = -2\eta(GM + MG)$ from $M_0$
    (real data: the input covariance and the input-output correlation do not
    share an eigenbasis), integrated for the `(p, width)` factor $W$ itself
    when `width < p` (`FactoredMFlowEngine`), else for `M` (`MFlowEngine`),
    saying which in `engine` and
    `reason`, with the measured violation; or `ApproximateLVEngine()`, cheaper
    but exact only when the violation is 0. Each engine holds its solver,
    step-size controller, adjoint and `max_steps`. Time counts steps of
    full-batch gradient descent of rate `learning_rate` (the flow is its
    small-rate limit: see `Prediction.growth_rate`).

    Eager only: it chooses the engine on the host (`lv_reduce` runs in numpy),
    so under `jax.jit`, `vmap`, `grad` or `shard_map` it raises a `ValueError`
    saying so; trace `solve_lv` or `solve_mflow` themselves instead.

    **Arguments:**

    - `structure`: the architecture.
    - `xs`, `ys`: the data, shapes `(n, *structure.input_shape)` and `(n, k)`.
    - `init_scale`: $\sigma > 0$ of the initial weights $W_0 = \sigma Z$.
    - `learning_rate`: $\eta > 0$.
    - `width`: the number of units `m` (the rank of $M_0$).
    - `key`: the PRNG key `train` would get.
    - `num_steps`: predict at about `num_records` log-spaced integer steps from 0
      to `num_steps` (those of `train(..., num_records=num_records)`); or
    - `ts`: the times instead, increasing, from 0 or later.
    - `weight_decay`: $\lambda \ge 0$ on `W`.
    - `engine`: an `AbstractEngine` (default `None`: `AutoEngine()`). The words
      `"auto"`, `"lv"`, `"mflow"`, `"approximate_lv"` and the keywords `tol`,
      `solver`, `max_steps` are deprecated (`engine_from_word` says what they
      mean).

    **Returns:** a `Prediction`.

    **Raises:** `ValueError` naming the argument for bad shapes or values (from
    `task_from_samples`, the engine and the checks here); `NotReducibleError`
    from `LVEngine` on data that do not reduce; `ValueError` for traced
    arguments.
    """
    eager_only(
        "predict",
        "it chooses the engine on the host",
        xs=xs,
        ys=ys,
        init_scale=init_scale,
        learning_rate=learning_rate,
        weight_decay=weight_decay,
        key=key,
        ts=ts,
        structure=structure,
    )
    engine = _engine(engine, tol, solver, max_steps)
    width = _check_arguments(structure, init_scale, learning_rate, width, weight_decay)
    grid = _time_grid(num_steps, num_records, ts)

    task = task_from_samples(structure, xs, ys)
    dtype = task.dtype
    W0 = _initial_weights(structure, key, init_scale, width, dtype)
    M0 = W0 @ W0.T  # for the engines that take M0 (the dense flow, LV)
    ts = jnp.asarray(grid, dtype)
    eta = float(learning_rate)
    # the engines that integrate a factor start from the weights themselves
    extra = {"W0": W0} if accepts_factor(engine) else {}
    run = engine.run(task, M0, ts, eta, weight_decay, **extra)

    # never more modes than the rank of M = W W^T allows
    q = min(run.mode_curves.shape[1], width)
    ons = rank_switch_ons(grid, run.mode_curves[:, :q])
    times = ons.times
    c_max = float(np.max(np.linalg.eigvalsh(np.asarray(task.C, np.float64))))
    rate = 4.0 * eta * max(c_max, 0.0)
    if run.factors is None:  # an engine that gives no weights: nothing measured
        factors, records = np.zeros((0, task.p, 1)), np.zeros(0)
    else:
        factors, records = run.factors, grid[run.factor_index]
    validity = leading_order_validity(
        structure,
        xs,
        jnp.asarray(factors, dtype),
        records,
        growth_rate=rate,
        ys=ys,
        learning_rate=eta,
        switch_times=times,
        # in the frame of units that gradient descent carries (`_frame`)
        carry_frame=True,
    )
    as_array = lambda x: jnp.asarray(x, dtype)  # noqa: E731
    return Prediction(
        engine=run.engine,
        reason=run.reason,
        violation=as_array(run.violation),
        ts=ts,
        loss=as_array(run.loss),
        mode_curves=as_array(run.mode_curves[:, :q]),
        switch_ons=ons,
        plateaus=as_array(_plateaus(grid, run.loss, times)),
        modes=as_array(run.modes[:, :q]),
        mode_values=as_array(run.mode_values[:q]),
        W0=W0,
        growth_rate=as_array(rate),
        validity=validity,
    )


# --------------------------------------------------------------------------------
# agreement with a measured run


def _degenerate_groups(values, gap):
    """Runs of consecutive `values` (decreasing) less than `gap` (relative)
    apart: the near-degenerate groups whose eigenvectors are defined only as a
    subspace. A list of index arrays."""
    values = np.asarray(values, np.float64)
    cuts = [0]
    for i in range(1, len(values)):
        if abs(values[i - 1] - values[i]) > gap * abs(values[i - 1]):
            cuts.append(i)
    cuts.append(len(values))
    return [np.arange(a, b) for a, b in zip(cuts[:-1], cuts[1:])]


def _subspace_cosines(M, modes, groups, c):
    """For `k = 1 .. c`: the cosine of the largest principal angle between the
    span of the first `k` columns of `modes` (shape `(p, q)`, by decreasing
    value) and the top-`k` eigenvectors of `M`, with `k` extended to the end of
    its near-degenerate group (whose eigenvectors are defined only together).
    Shape `(c,)`."""
    _, U = np.linalg.eigh(0.5 * (M + M.T))
    U = U[:, ::-1]
    modes = np.asarray(modes, np.float64)
    ends = {int(i): int(g[-1]) + 1 for g in groups for i in g}
    out = np.full(c, np.nan)
    for k in range(min(c, modes.shape[1])):
        top = ends[k]
        sv = np.linalg.svd(modes[:, :top].T @ U[:, :top], compute_uv=False)
        out[k] = min(float(np.min(sv)), 1.0)
    return out


def agreement(
    prediction: Prediction,
    measured: TrainResult | Prediction,
    *,
    num_switches: int = 3,
    degeneracy: float = 0.2,
) -> Agreement:
    r"""Compare a measured run with a `Prediction`: the first `num_switches`
    switch-ons and the loss curve up to the last of them.

    Switch-ons are compared one by one (`switch_ons`): the measured eigenvalues
    of `M` by rank cross the prediction's threshold
    (`prediction.switch_ons.threshold`: the same level, so that the two times
    measure the same event even where a real layer's own values keep moving as
    it departs from its quadratic form). For another `Prediction`, its curves
    cross the same threshold.
    The loss is compared in log space at the measured times, the predicted
    $\ln L$ interpolated linearly in `t`.

    For a trained network, `subspace_overlaps` says whether it learned the
    predicted directions: after the `k`-th switch-on, the span of the top `k`
    predicted modes against the top `k` eigenvectors of the measured `M` at
    twice the horizon (by then the compared modes are on, and a real layer has
    not had the time to drift far from its quadratic form), `k` extended to the
    end of its near-degenerate group (values within a relative `degeneracy` of
    their neighbours, whose eigenvectors are defined only together).

    **Arguments:**

    - `prediction`: the `Prediction`.
    - `measured`: a `TrainResult` (with `M` snapshots: `train(..., snapshots=True)`,
      the default) or another `Prediction` (e.g. the approximate reduction
      against the M-space flow).
    - `num_switches`: how many switch-ons to compare (fewer if fewer switch on).
    - `degeneracy`: the relative gap between consecutive predicted modes' values
      below which they are compared as one subspace (0: mode by mode; default
      0.2).

    **Returns:** an `Agreement`.

    **Raises:** `ValueError` when `measured` has no snapshots of `M`, or its
    times do not overlap the prediction's.
    """
    num_switches = static_int("num_switches", num_switches, 1)
    if not (np.ndim(degeneracy) == 0 and 0 <= float(degeneracy) < 1):
        raise ValueError(f"`degeneracy` must be in [0, 1), got {degeneracy!r}.")
    if not isinstance(measured, TrainResult | Prediction):
        raise ValueError(
            f"`measured` must be a TrainResult or a Prediction, got {type(measured)}."
        )
    ons = prediction.switch_ons
    q = ons.times.shape[0]
    if isinstance(measured, TrainResult):
        source, cap = measured, measured.W.shape[1]
    else:
        source, cap = measured.switch_ons, measured.switch_ons.curves.shape[1]
    c = min(num_switches, q)
    predicted = np.asarray(ons.times, np.float64)[:c]
    measured_times = np.full(c, np.nan)
    if q:  # the same threshold, as many ranks as both have
        theta = float(ons.threshold)
        timed = switch_ons(source, threshold=theta, num_modes=min(cap, c))
        found = np.asarray(timed.times, np.float64)
        measured_times[: len(found)] = found
    elif isinstance(measured, TrainResult) and measured.M is None:
        switch_ons(measured)  # raises: no snapshots
    t_m = np.asarray(measured.ts, np.float64)
    loss_m = np.asarray(measured.loss, np.float64)
    t_p = np.asarray(prediction.ts, np.float64)
    on = predicted[np.isfinite(predicted)]
    horizon = float(np.max(on)) if len(on) else min(t_p[-1], t_m[-1])
    overlaps = np.full(c, np.nan)
    if isinstance(measured, TrainResult) and c:
        end = max(int(np.searchsorted(t_m, 2.0 * horizon, side="right")), 2)
        groups = _degenerate_groups(prediction.mode_values, float(degeneracy))
        M_end = np.asarray(measured.M[end - 1], np.float64)
        overlaps = _subspace_cosines(M_end, prediction.modes, groups, c)
    window = (t_m >= t_p[0]) & (t_m <= min(horizon, t_p[-1]))
    if not np.any(window):
        raise ValueError("The measured times do not overlap the prediction's.")
    tiny = np.finfo(np.float64).tiny
    log_pred = np.interp(
        t_m[window], t_p, np.log(np.maximum(np.asarray(prediction.loss), tiny))
    )
    log_meas = np.log(np.maximum(loss_m[window], tiny))
    dtype = prediction.loss.dtype
    return Agreement(
        predicted_times=jnp.asarray(predicted, dtype),
        measured_times=jnp.asarray(measured_times, dtype),
        time_errors=jnp.asarray(measured_times / predicted - 1.0, dtype),
        subspace_overlaps=jnp.asarray(overlaps, dtype),
        log_loss_departure=jnp.asarray(np.max(np.abs(log_meas - log_pred)), dtype),
        horizon=jnp.asarray(horizon, dtype),
    )
