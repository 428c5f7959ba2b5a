"""How far each training method departs from gradient flow on its clock
(`compare_methods` -> `MethodReport`), from the switch-on times of its mode
amplitudes (`switch_times_from_curves`)."""

import functools
import warnings
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
from jaxtyping import Array, ArrayLike, Float, PRNGKeyArray

from .._checks import check_key, static_int
from .._curves import first_crossing
from ..engines.clock import invert_clock
from ..engines.lv import lv_reduce
from ..structures.base import AbstractStructure
from ..structures.models import AbstractModel, Layer, as_model
from ..tasks.base import Task
from ..tasks.lotka_volterra import LotkaVolterra
from ..tasks.sampled import task_from_samples
from ..theory.switch_on import switch_on_times
from .engines import LVEngine, MFlowEngine
from .methods import Method, train_method


class MethodReport(eqx.Module):
    r"""How far a method's switch-on times depart from gradient flow
    (`compare_methods`). Modes are the columns of the basis; `q` of them.

    **Fields:**

    - `name`: the method's label.
    - `ts`: recorded steps, shape `(R,)`.
    - `clock`: the method's flow time `s(ts)` (`Method.clock`), shape `(R,)`.
    - `m`: the mode amplitudes $u_k^\top M u_k$ of the trained network, averaged
      over seeds, shape `(R, q)`; `loss`: its training loss, averaged, `(R,)`.
    - `flow_m`, `flow_loss`: the gradient flow from the same `M0` on the same
      clock (`solve_mflow`), shapes `(R, q)` and `(R,)`.
    - `switch_times`: each mode's switch-on time in the trained network, the
      first time $m_k$ reaches `level` times the peak of the flow's $m_k$
      (log-linear interpolation between records), averaged over seeds, shape
      `(q,)`; NaN for modes that do not switch on (and settle) in the flow.
    - `switch_times_se`: their standard error over seeds (0 for one seed).
    - `flow_switch_times`: the same measurement on the flow, shape `(q,)`.
    - `theory_switch_times`: `switch_on_times` of the Lotka-Volterra reduction
      from the diagonal of `M0`, mapped to steps through the clock
      (`invert_clock`), shape `(q,)`.
    - `departure`: `switch_times / flow_switch_times - 1`, shape `(q,)`: the
      method's delay (> 0) or advance (< 0) relative to gradient flow on its
      clock, averaged over seeds.
    - `departure_rms`: the root-mean-square over seeds of each run's
      `t / t_flow - 1`, shape `(q,)`: how far one run departs (for SGD mostly
      the seed-to-seed spread; equal to `|departure|` for one seed).
    - `ratio_departure`: the same for the ratios to the first mode's time,
      $(t_k / t_{k_0}) / (t^{\rm flow}_k / t^{\rm flow}_{k_0}) - 1$, shape `(q,)`:
      independent of the clock (a method that only rescales time has 0 here).
    - `seeds`: the number of seeds averaged.
    """

    name: str = eqx.field(static=True)
    ts: Float[Array, " R"]
    clock: Float[Array, " R"]
    m: Float[Array, "R q"]
    loss: Float[Array, " R"]
    flow_m: Float[Array, "R q"]
    flow_loss: Float[Array, " R"]
    switch_times: Float[Array, " q"]
    switch_times_se: Float[Array, " q"]
    flow_switch_times: Float[Array, " q"]
    theory_switch_times: Float[Array, " q"]
    departure: Float[Array, " q"]
    departure_rms: Float[Array, " q"]
    ratio_departure: Float[Array, " q"]
    seeds: int = eqx.field(static=True)

    @property
    def max_departure(self) -> float:
        """The largest `|departure|` over the modes that switch on."""
        return float(np.nanmax(np.abs(np.asarray(self.departure))))


def switch_times_from_curves(
    ts: Float[ArrayLike, " R"],
    m: Float[ArrayLike, "R q"],
    level: float = 0.5,
    peak: Float[ArrayLike, " q"] | None = None,
) -> Float[Array, " q"]:
    """For each column of `m`, the first time it reaches `level` times its peak
    value (its own largest value, or `peak` when given), interpolated
    log-linearly between records: the half-way time of a logistic rise for
    `level = 0.5`. NaN where it never gets there, or is there from `ts[0]`.
    Runs eagerly.

    **Arguments:**

    - `ts`: times, shape `(R,)`, increasing.
    - `m`: positive curves, shape `(R, q)`.
    - `level`: in `(0, 1)`.
    - `peak`: optional reference values, shape `(q,)`.

    **Returns:** shape `(q,)`.
    """
    ts = np.asarray(ts, np.float64)
    m = np.asarray(m, np.float64)
    if m.ndim != 2 or m.shape[0] != ts.shape[0]:
        raise ValueError(f"`m` must have shape (R, q) with R = {ts.shape[0]}.")
    if not 0 < level < 1:
        raise ValueError(f"`level` must be in (0, 1), got {level}.")
    peak = (
        m.max(0)
        if peak is None
        else np.broadcast_to(np.asarray(peak, float), m.shape[1:])
    )
    target = level * peak
    out = first_crossing(ts, m, target, rising=True, at_start="nan")
    finite = np.all(np.isfinite(m), axis=0) & np.isfinite(target)
    return jnp.asarray(np.where(finite, out, np.nan))


def compare_methods(
    methods: Sequence[Method] | Mapping[str, Method],
    structure: AbstractStructure,
    xs: Float[ArrayLike, "n ..."],
    ys: Float[ArrayLike, "n k"],
    *,
    num_steps: int,
    W0: Float[ArrayLike, "p m"],
    weight_decay: float = 0.0,
    key: PRNGKeyArray | None = None,
    seeds: int = 1,
    model: AbstractModel = Layer(),
    record_at: Sequence[int] | None = None,
    basis: Float[ArrayLike, "p q"] | None = None,
    level: float = 0.5,
    min_growth: float = 100.0,
    reference: MFlowEngine | LVEngine = MFlowEngine(),
    solve_options: Mapping | None = None,
) -> dict[str, MethodReport]:
    r"""Train each method and measure how far its switch-on times depart from the
    gradient-flow prediction on its clock.

    For each method: the network is trained from `W0` (`train_method`, `seeds`
    minibatch keys for stochastic methods, vmapped), recording the mode
    amplitudes $m_k = u_k^\top M u_k$ in `basis` (default: the Lotka-Volterra
    basis of `lv_reduce(task_from_samples(structure, xs, ys))`); the
    M-space flow from $M_0 = W_0 W_0^\top$ is run on the method's clock
    (`solve_mflow` with the schedule: exact gradient flow for any `W0`, aligned
    or not).
    The switch-on time of a mode is the first time it reaches `level` times the
    peak of its flow curve, measured the same way on both
    (`switch_times_from_curves`); modes that grow less than `min_growth` times
    in the flow, or are still growing at the end of the run (more than 5% over
    its last tenth), are not counted as switched on and get NaN. What to expect
    (derived in the documentation's page "Training methods as a change of
    clock"): full-batch GD lags the flow by a relative $\approx r/4$; SGD's
    switch-on times scatter around GD's by $\propto \sqrt{(n-b)/(b(n-1))}$
    (`departure_rms`), their mean at GD's; heavy-ball momentum `mu` lags by
    $r/4 + \tfrac r2 \tfrac{\mu}{1-\mu}$ on its clock; Adam departs by O(1), in
    the ratios too (it is not rotation-equivariant); a learning-rate schedule is
    the flow on its clock, a batch-size schedule SGD segment by segment.

    **The reference** is an engine holding its solver options: `MFlowEngine()`
    (default) integrates `solve_mflow` on the clock from $M_0$ (exact for any
    `W0`; its implicit default solver compiles slowly, pass e.g.
    `MFlowEngine(solver=diffrax.Tsit5())` for small problems); `LVEngine()`
    integrates `solve_lv` from the diagonal of $M_0$ in the basis of `lv_reduce`
    (at its `tol`; then omit `basis`): exact for `W0` aligned with the modes,
    and much cheaper.

    **Arguments:**

    - `methods`: a sequence of `Method`s (keyed by their `label`) or a dict.
    - `structure`, `xs`, `ys`: the architecture and data.
    - `num_steps`: steps per run.
    - `W0`: the initial weights, shape `(p, m)`.
    - `weight_decay`: `lambda >= 0`.
    - `key`: PRNG key for the minibatches (default `key(0)`).
    - `seeds`: minibatch seeds averaged for methods with a batch size (default 1).
    - `model`: the model trained, `Layer()` (default, as in `nqfjax.train`) or
      `QuadraticForm()` (the quadratic form, whose gradient flow the reference
      is: pass it to measure the methods alone).
    - `record_at`: the recorded steps (default 401 evenly spaced).
    - `basis`: the modes, shape `(p, q)`, orthonormal columns.
    - `level`: the fraction of a mode's peak that defines its switch-on.
    - `min_growth`: growth factor in the flow below which a mode is off.
    - `reference`: an `MFlowEngine` or an `LVEngine` (see above). The words
      `"mflow"` and `"lv"` and `solve_options` (keywords of `solve_mflow` or
      `solve_lv`) are deprecated: `solver`, `stepsize_controller`, `adjoint`
      and `max_steps` belong in the engine.

    **Returns:** a dict `label -> MethodReport`.

    **Raises:** `ValueError` for a task that does not reduce when no `basis` is
    given (`NotReducibleError`), or bad arguments.
    """
    # Long only for its docstring (the contract); the code is a few named steps.
    items = _method_items(methods)
    model = as_model(model)
    if seeds < 1:
        raise ValueError(f"`seeds` must be >= 1, got {seeds}.")
    reference, extra = _reference_engine(reference, solve_options, basis)
    num_steps = static_int("num_steps", num_steps)
    record = (
        np.unique(np.linspace(0, num_steps, 401).astype(int))
        if record_at is None
        else np.asarray(record_at, int)
    )
    key = jr.key(0) if key is None else check_key(key)
    ref = _reference(structure, xs, ys, W0, basis, weight_decay, reference)

    def run(mth, k):
        return train_method(
            mth,
            structure,
            xs,
            ys,
            num_steps=num_steps,
            W0=ref.W0,
            key=k,
            weight_decay=weight_decay,
            model=model,
            record_at=record,
            basis=ref.basis,
        )

    reports = {}
    for label, mth in items:
        n_seeds = seeds if mth.batch_size is not None else 1
        m_runs, loss_runs = _seeded_runs(functools.partial(run, mth), key, n_seeds)
        flow_m, flow_loss = _reference_flow(
            mth, ref, record, weight_decay, reference, extra
        )
        on = _switched_on(flow_m, ref.m0, record, min_growth)
        reports[label] = _report(
            label, mth, ref, record, m_runs, loss_runs, flow_m, flow_loss, on, level
        )
    return reports


def _method_items(methods) -> list[tuple[str, Method]]:
    """`(label, Method)` pairs of a dict or a sequence (keyed by `label`)."""
    if isinstance(methods, Mapping):
        items = list(methods.items())
    else:
        items = [(getattr(mth, "label", repr(mth)), mth) for mth in methods]
    for label, mth in items:
        if not isinstance(mth, Method):
            raise ValueError(f"`methods[{label!r}]` must be a Method, got {type(mth)}.")
    return items


class _Reference(NamedTuple):
    """What every method of `compare_methods` is compared against: the task, the
    modes, the start and the theory's switch-on times on the unit clock."""

    task: Task
    lv_unit: LotkaVolterra | None
    basis: Array
    W0: Array
    M0: Array
    m0: np.ndarray
    s_theory: np.ndarray | None


def _reference_engine(
    reference, solve_options, basis
) -> tuple[MFlowEngine | LVEngine, dict]:
    """The reference engine, and what is left of the deprecated `solve_options`
    for the engine function (tolerances: passed on as before). The words
    `"mflow"` and `"lv"` and `solve_options` warn."""
    words = {"mflow": MFlowEngine, "lv": LVEngine}
    if isinstance(reference, str) and reference not in words:
        raise ValueError(
            "`reference` must be an nqfjax.MFlowEngine or nqfjax.LVEngine (the "
            f'words "mflow" and "lv" are deprecated), got {reference!r}.'
        )
    options = dict(solve_options or {})
    if isinstance(reference, str) or solve_options is not None:
        what = [f"reference={reference!r}"] * isinstance(reference, str)
        what += ["`solve_options`"] * (solve_options is not None)
        warnings.warn(
            f"compare_methods's {' and '.join(what)} is deprecated and will be "
            "removed in the next release; pass an engine holding its solver "
            "options, e.g. reference=nqfjax.MFlowEngine(solver=diffrax.Tsit5()).",
            DeprecationWarning,
            stacklevel=3,
        )
    if isinstance(reference, str):
        fields = ("solver", "stepsize_controller", "adjoint", "max_steps")
        held = {k: options.pop(k) for k in fields if k in options}
        reference = words[reference](**held)
    if not isinstance(reference, MFlowEngine | LVEngine):
        raise ValueError(
            "`reference` must be an nqfjax.MFlowEngine or nqfjax.LVEngine, got "
            f"{reference!r}."
        )
    if isinstance(reference, LVEngine) and basis is not None:
        raise ValueError(
            "`reference=LVEngine(...)` uses the basis of `lv_reduce`: omit `basis`."
        )
    return reference, options


def _reference(structure, xs, ys, W0, basis, weight_decay, engine) -> _Reference:
    W0 = jnp.asarray(W0)
    task = task_from_samples(structure, xs, ys)
    lv_unit = None
    if basis is None:  # the reduction at the LV engine's tolerance
        tol = engine.tol if isinstance(engine, LVEngine) else None
        lv_unit, basis = lv_reduce(task, tol=tol)
    basis = jnp.asarray(basis, W0.dtype)
    M0 = W0 @ W0.T
    m0 = np.asarray(jnp.diag(basis.T @ M0 @ basis))
    s_theory = None
    if lv_unit is not None:
        # the switch-on theory reads the system's decay: 2 lambda per unit of s
        decayed = LotkaVolterra(
            lv_unit.r,
            lv_unit.interactions,
            2.0 * weight_decay,
            loss_scale=lv_unit.loss_scale,
            loss_offset=lv_unit.loss_offset,
        )
        s_theory = np.asarray(switch_on_times(decayed, np.maximum(m0, 1e-300)))
    return _Reference(task, lv_unit, basis, W0, M0, m0, s_theory)


def _seeded_runs(run, key, n_seeds):
    """The mode amplitudes `(S, R, q)` and losses `(S, R)` of `run(key)` over
    `n_seeds` keys split from `key` (vmapped when more than one)."""
    keys = jr.split(key, n_seeds)
    if n_seeds > 1:
        res = jax.vmap(run)(keys)
        return np.asarray(res.m), np.asarray(res.loss)
    res = run(keys[0])
    return np.asarray(res.m)[None], np.asarray(res.loss)[None]


def _reference_flow(mth, ref, record, weight_decay, reference, extra):
    """The gradient flow from `M0` on the method's clock: mode amplitudes
    `(R, q)` and loss `(R,)`, from the M-space flow or the LV reduction
    (`reference.solve`; `extra`: the deprecated `solve_options` left)."""
    ts = jnp.asarray(record, ref.W0.dtype)
    if isinstance(reference, MFlowEngine):
        flow = reference.solve(
            ref.task,
            ref.M0,
            ts,
            mth.learning_rate,
            weight_decay,
            momentum=mth.clock_momentum,
            **extra,
        )
        flow_m = jnp.einsum("pk,tpq,qk->tk", ref.basis, flow.ys, ref.basis)
        return np.asarray(flow_m), np.asarray(flow.loss)
    flow = reference.solve(
        ref.lv_unit,
        np.maximum(ref.m0, np.finfo(ref.m0.dtype).tiny),
        ts,
        mth.learning_rate,
        weight_decay,
        momentum=mth.clock_momentum,
        **extra,
    )
    return np.asarray(flow.ys), np.asarray(flow.loss)


def _switched_on(flow_m, m0, record, min_growth):
    """Which modes switch on in the flow: grown `min_growth`-fold and settled by
    the end (over the last tenth of the run it grew by less than 5%), so that
    the peak is the plateau value and not where the run happened to stop."""
    peak = flow_m.max(0)
    i90 = int(np.searchsorted(record, 0.9 * record[-1]))
    settled = flow_m[-1] <= 1.05 * flow_m[min(i90, len(record) - 1)]
    return (peak >= min_growth * np.maximum(m0, np.finfo(float).tiny)) & settled


def _report(label, mth, ref, record, m_runs, loss_runs, flow_m, flow_loss, on, level):
    """The `MethodReport` of one method: switch-on times of each run and of the
    flow, the theory's on the method's clock, and the departures."""
    peak = flow_m.max(0)

    def switch_times(m):
        return np.where(
            on, np.asarray(switch_times_from_curves(record, m, level, peak)), np.nan
        )

    t_flow = switch_times(flow_m)
    t_runs = np.stack([switch_times(mr) for mr in m_runs])
    n_seeds = t_runs.shape[0]
    t_mean = t_runs.mean(0)
    t_se = (
        t_runs.std(0, ddof=1) / np.sqrt(n_seeds)
        if n_seeds > 1
        else np.zeros_like(t_mean)
    )
    t_theory = np.full(t_mean.shape, np.nan)
    if ref.s_theory is not None:
        t_theory = np.asarray(
            invert_clock(mth.learning_rate, ref.s_theory, momentum=mth.clock_momentum)
        )
    k0 = int(np.nanargmin(t_flow)) if np.any(on) else 0
    ts = jnp.asarray(record, ref.W0.dtype)
    return MethodReport(
        name=label,
        ts=ts,
        clock=mth.clock(ts),
        m=jnp.asarray(m_runs.mean(0)),
        loss=jnp.asarray(loss_runs.mean(0)),
        flow_m=jnp.asarray(flow_m),
        flow_loss=jnp.asarray(flow_loss),
        switch_times=jnp.asarray(t_mean),
        switch_times_se=jnp.asarray(t_se),
        flow_switch_times=jnp.asarray(t_flow),
        theory_switch_times=jnp.asarray(t_theory),
        departure=jnp.asarray(t_mean / t_flow - 1),
        departure_rms=jnp.asarray(np.sqrt(np.mean((t_runs / t_flow - 1) ** 2, 0))),
        ratio_departure=jnp.asarray((t_mean / t_mean[k0]) / (t_flow / t_flow[k0]) - 1),
        seeds=n_seeds,
    )
