"""The headline experiment (`nqfjax demo`) and its report.

`run_demo` trains a real network from small initialisation, runs the M-space flow
and the Lotka-Volterra reduction beside it, checks the theory's predictions
against the measurements, and writes figures plus `report.json` and `report.md`.
Everything it does goes through the public API; the command line only calls it.
"""

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .. import plots
from .._curves import first_crossing
from ..analysis.power_law import fit_power_law
from ..engines.lv import lv_reduce, solve_lv
from ..engines.lv_batch import solve_lv_batch
from ..engines.mflow import solve_mflow
from ..engines.train import train
from ..io import atomic_write_text
from ..progress import AbstractProgressMeter, as_progress_meter
from ..structures import (
    Conv1D,
    MixtureOfExperts,
    OVAttention,
    Perceptron,
    QKAttention,
    QuadraticNet,
)
from ..sweep import sweep
from ..tasks.power_law import power_law_task
from ..tasks.sampled import task_from_samples
from ..theory.power_law import power_law_exponent, sharp_switch_loss
from ..theory.staircase import singular_limit
from ..theory.switch_on import switch_on_times
from ._outcomes import DictView
from ._report import DemoCheck, checks, markdown, report_dict
from .demo_config import DemoConfig


# --------------------------------------------------------------------------------
# the stages


def _crossing_times(ts: np.ndarray, values: np.ndarray, levels: np.ndarray):
    """First time each column of `values` (shape `(T, K)`) rises through
    `levels[k]`, linearly interpolated in `t`; NaN if it never does."""
    return first_crossing(
        ts, values, levels, rising=True, interpolate="linear", at_start="nan"
    )


@eqx.filter_jit
def _loss_jit(system, states):
    return jax.vmap(system.loss)(states)


def _loss_curve(system, states) -> np.ndarray:
    """`system.loss` (a task's or a Lotka-Volterra system's) along a solution,
    in one compiled call rather than one small compilation per operation."""
    return np.asarray(_loss_jit(system, jnp.asarray(states)))


def _whitened_teacher(cfg: DemoConfig):
    rng = np.random.default_rng(cfg.seed)
    xs = np.sqrt(cfg.n) * np.linalg.qr(rng.normal(size=(cfg.n, cfg.n)))[0][:, : cfg.d]
    U = np.linalg.qr(rng.normal(size=(cfg.k, cfg.k)))[0]
    V = np.linalg.qr(rng.normal(size=(cfg.d, cfg.d)))[0][:, : cfg.k]
    teacher = U @ np.diag(cfg.singular_values) @ V.T
    return xs, xs @ teacher.T


class _Problem(NamedTuple):
    """The network, its data and its Lotka-Volterra reduction."""

    structure: Perceptron
    xs: np.ndarray
    ys: np.ndarray
    task: Any
    lv: Any
    basis: np.ndarray
    learn: np.ndarray  # the modes that grow


def _problem(cfg: DemoConfig) -> _Problem:
    structure = Perceptron(d=cfg.d, k=cfg.k)
    xs, ys = _whitened_teacher(cfg)
    task = task_from_samples(structure, xs, ys)
    lv, basis = lv_reduce(task)  # in flow time: s = learning_rate * steps
    # the modes that grow: r above roundoff (the teacher's null directions have
    # r = 0 up to ~1e-35, of either sign)
    r = np.asarray(lv.r)
    learn = np.flatnonzero(r > 1e-8 * np.abs(r).max())
    return _Problem(structure, xs, ys, task, lv, np.asarray(basis), learn)


def _lv_loss(cfg: DemoConfig, lv, m0, ts, learning_rate) -> np.ndarray:
    """The loss at the steps `ts` of `learning_rate`: `solve_lv_batch` (a batch
    of one) for the default solver, else `solve_lv` with `cfg.lv_solver`."""
    if cfg.lv_solver is not None:
        sol = solve_lv(lv, m0, ts, learning_rate, solver=cfg.lv_solver)
        return np.asarray(sol.loss)
    sol = solve_lv_batch(lv, jnp.asarray(m0)[None], ts, learning_rate)
    return np.asarray(sol.loss[0])


class _Engines(NamedTuple):
    """Stage 1: the three engines' loss curves on one grid of steps, the
    switch-on times, and the staircase with LV curves at shrinking eps."""

    record: np.ndarray
    L_w: np.ndarray
    L_m: np.ndarray | None  # None without `cfg.mflow_solver`
    L_lv: np.ndarray
    m0: np.ndarray
    t_pred: np.ndarray
    t_meas: np.ndarray
    log_eps: float
    stair: Any
    tau_grid: np.ndarray
    stair_loss: np.ndarray
    rescaled: dict
    plateau_idx: list


def _engines(cfg: DemoConfig, pb: _Problem) -> _Engines:
    """W-space training from `sigma Z`, and M-space and LV from the same `M0`."""
    record = np.unique(np.linspace(0, cfg.steps, cfg.num_records).astype(int))
    W0 = cfg.init_scale * np.random.default_rng(cfg.seed + 1).normal(
        size=(pb.structure.p, cfg.width)
    )
    M0 = W0 @ W0.T
    res = train(
        pb.structure,
        pb.xs,
        pb.ys,
        num_steps=cfg.steps,
        learning_rate=cfg.learning_rate,
        W0=W0,
        record_at=record,
        basis=pb.basis,
    )
    ts = jnp.asarray(record, jnp.float64)
    L_m = None
    if cfg.mflow_solver is not None:
        solver = cfg.mflow_solver
        M = solve_mflow(pb.task, M0, ts, cfg.learning_rate, solver=solver).ys
        L_m = _loss_curve(pb.task, M)
    m0 = np.diag(pb.basis.T @ M0 @ pb.basis)
    L_lv = _lv_loss(cfg, pb.lv, m0, ts, cfg.learning_rate)
    L_w = np.asarray(res.loss)
    mstar = np.asarray(pb.lv.fixed_point_isolated())[pb.learn]
    t_pred = np.asarray(switch_on_times(pb.lv, m0))[pb.learn] / cfg.learning_rate
    t_meas = _crossing_times(record, np.asarray(res.m)[:, pb.learn], mstar / 2)
    # eps: the typical initial amplitude of a learned mode, m_k(0) ~ sigma^2 width
    log_eps = float(-np.log(np.median(m0[pb.learn])))
    stair, tau_grid, stair_loss, rescaled = _staircase(cfg, pb.lv, m0, log_eps)
    return _Engines(
        record=record,
        L_w=L_w,
        L_m=L_m,
        L_lv=L_lv,
        m0=m0,
        t_pred=t_pred,
        t_meas=t_meas,
        log_eps=log_eps,
        stair=stair,
        tau_grid=tau_grid,
        stair_loss=stair_loss,
        rescaled=rescaled,
        plateau_idx=_plateau_indices(record, L_lv, t_pred),
    )


def _staircase(cfg: DemoConfig, lv, m0, log_eps):
    """The singular limit, and LV at shrinking eps with the same exponents
    `q_k(0) = ln m0_k / ln(1/eps)`: in rescaled time (flow time over
    `ln(1/eps)`; steps over it at unit learning rate) they approach the staircase
    (errors ~ 1 / ln(1/eps)). Labelled with eps and the init scale it stands for:
    a typical amplitude `eps^c` is that of an init scale of about
    `sigma eps^((c-1)/2)` (as `eps ~ sigma^2 width`)."""
    stair = singular_limit(lv, log_eps, m0=m0)
    finite_tau = np.asarray(stair.switch_on_tau)[np.isfinite(stair.switch_on_tau)]
    tau_grid = np.linspace(0, 1.3 * finite_tau.max(), cfg.num_records)
    stair_loss = np.asarray(stair.loss_tau(tau_grid))
    rescaled = {}
    for c in (1, 2, 4, 8):
        loss_c = _lv_loss(
            cfg, lv, np.exp(c * np.log(m0)), jnp.asarray(tau_grid * c * log_eps), 1.0
        )
        # typical amplitude eps^c: an init scale of about sigma eps^((c-1)/2)
        eps, sigma = (
            np.exp(-c * log_eps),
            cfg.init_scale * np.exp(-(c - 1) * log_eps / 2),
        )
        label = (
            rf"Lotka-Volterra, $\varepsilon$ = {eps:.0e} "
            rf"($\sigma \approx$ {sigma:.0e})"
        )
        rescaled[label] = (tau_grid, loss_c)
    return stair, tau_grid, stair_loss, rescaled


def _plateau_indices(record, L_lv, t_pred) -> list[int]:
    """Where the LV loss is flattest between consecutive predicted switch-ons."""
    t_sorted = np.sort(t_pred)
    slope = np.abs(np.gradient(L_lv, record))
    idx = []
    for lo, hi in zip(t_sorted[:-1], t_sorted[1:]):
        window = np.flatnonzero((record > lo) & (record < hi))
        if window.size:
            idx.append(int(window[np.argmin(slope[window])]))
    return idx


class _Sweep(NamedTuple):
    """Stage 2: switch-on times of the real network at each init scale."""

    log_inv_sigma: np.ndarray
    times: np.ndarray  # measured, (S, K)
    predicted: np.ndarray  # switch_on_times at each scale, (S, K)
    slopes: np.ndarray  # measured d t_k / d ln(1/sigma), (K,)
    predicted_slopes: np.ndarray  # 2 / r_k


def _init_scale_sweep(cfg: DemoConfig, pb: _Problem) -> _Sweep:
    """One vmapped, jit-compiled `sweep` over `train`; each learned mode's
    switch-on time is its half-way crossing, beside the theory's at that scale."""
    record = np.unique(np.geomspace(1, cfg.sweep_steps, cfg.num_records).astype(int))
    Z = np.random.default_rng(cfg.seed + 2).normal(size=(pb.structure.p, cfg.width))
    basis = pb.basis[:, pb.learn]

    def run(init_scale):
        res = train(
            pb.structure,
            pb.xs,
            pb.ys,
            num_steps=cfg.sweep_steps,
            learning_rate=cfg.learning_rate,
            W0=jnp.asarray(Z),
            init_scale=init_scale,
            record_at=record,
            basis=basis,
        )
        return res.m

    scales = np.asarray(cfg.sweep_scales)
    out = sweep(run, {"init_scale": scales}, progress=False)
    mstar = np.asarray(pb.lv.fixed_point_isolated())[pb.learn]
    times = np.stack(
        [_crossing_times(record, np.asarray(m), mstar / 2) for m in out.outputs]
    )
    m0_unit = np.diag(pb.basis.T @ Z @ Z.T @ pb.basis)
    # the system's flow times, in steps
    flow = [np.asarray(switch_on_times(pb.lv, s**2 * m0_unit)) for s in scales]
    predicted = np.stack(flow)[:, pb.learn] / cfg.learning_rate
    x = np.log(1 / scales)
    slopes = np.array(
        [np.polyfit(x[np.isfinite(t)], t[np.isfinite(t)], 1)[0] for t in times.T]
    )
    rates = cfg.learning_rate * np.asarray(pb.lv.r)[pb.learn]  # per step
    return _Sweep(x, times, predicted, slopes, 2 / rates)


def _power_law(cfg: DemoConfig) -> dict:
    """A power-law task of many independent modes: simulated, fitted, predicted."""
    learning_rate = 0.25  # 4 learning_rate = 1: r_k = k^-(alpha + beta)
    a, b, p, eps = cfg.alpha, cfg.beta, cfg.power_law_modes, cfg.power_law_eps
    lv = power_law_task(p, a, b).lotka_volterra()  # in flow time; B diagonal
    # the modes beyond p stay unlearned until after the window: keep their loss,
    # sum_{k > p} lam_k m*_k^2 / 2 (a Hurwitz zeta), so that the curve inside the
    # window is that of the infinite spectrum
    tail = 0.5 * jax.scipy.special.zeta(a + 2 * b, p + 1.0)
    lv = eqx.tree_at(lambda s: s.loss_offset, lv, lv.loss_offset + tail)
    log_eps = np.log(1 / eps)

    def t_on(k):  # sharp switch-on of mode k
        return (log_eps - b * np.log(k)) * k ** (a + b) / (4 * learning_rate)

    # the steps merge into a power law once k > (alpha + beta) ln(1/eps); the last
    # modes carry finite-p effects: fit between twice the first and p/2
    window = (float(t_on(2 * (a + b) * log_eps)), float(t_on(p / 2)))
    ts = np.geomspace(1.0, 4 * t_on(p), 400)
    if cfg.closed_form_power_law:
        # independent modes without decay are exactly logistic:
        # m_k(t) = m*_k / (1 + (m*_k / eps - 1) e^{-r_k t})
        r = learning_rate * np.asarray(lv.r)  # per step
        mstar = np.asarray(lv.fixed_point_isolated())
        m = mstar / (1 + (mstar / eps - 1) * np.exp(-np.outer(ts, r)))
    else:
        m = solve_lv(lv, jnp.full(p, eps), jnp.asarray(ts), learning_rate).ys
    loss = _loss_curve(lv, jnp.asarray(m))
    sharp = np.asarray(sharp_switch_loss(lv, eps, learning_rate * jnp.asarray(ts)))
    fit = fit_power_law(ts, loss, window=window)
    # only its exponent is used: the Laplace error skips the refits
    fit_sharp = fit_power_law(ts, sharp, window=window, uncertainty="laplace")
    fit_t = np.geomspace(*window, 60)
    return {
        "ts": ts,
        "loss": loss,
        "sharp": sharp,
        "window": window,
        "fit_curve": (fit_t, np.asarray(fit(fit_t))),
        "gamma_fit": float(fit.gamma),
        "gamma_fit_err": float(fit.gamma_err),
        "gamma_sharp": float(fit_sharp.gamma),
        "gamma_rich": float(power_law_exponent(a, b, "rich")),
        "gamma_lazy": float(power_law_exponent(a, b, "lazy")),
    }


def _architectures():
    """The architectures of the structure figure, with the parameter blocks of
    one unit in order (see each class's docstring)."""
    P = Perceptron()
    qk, ov, moe, moe_f, conv = (
        QKAttention(),
        OVAttention(),
        MixtureOfExperts(),
        MixtureOfExperts(gate="factor"),
        Conv1D(),
    )
    return [
        ("Perceptron", P, [("a readout", P.k), ("u input", P.d)]),
        ("QuadraticNet", QuadraticNet(), [("u input", QuadraticNet().d)]),
        ("QKAttention (softmax)", qk, [("q query", qk.d), ("k key", qk.d)]),
        (
            "QKAttention (linear)",
            QKAttention(softmax=False),
            [("q query", qk.d), ("k key", qk.d)],
        ),
        ("OVAttention", ov, [("o output", ov.k), ("v value", ov.d)]),
        (
            "MixtureOfExperts (softmax)",
            moe,
            [("r router", moe.d), ("a readout", moe.k), ("u expert", moe.d)],
        ),
        (
            "MixtureOfExperts (factor gate)",
            moe_f,
            [("r gate", moe_f.d), ("u expert", moe_f.d)],
        ),
        (
            "Conv1D",
            conv,
            [("a readout per position", conv.positions), ("kernel", conv.kernel_size)],
        ),
    ]


@eqx.filter_jit
def _first_As(structures, xs):
    # one compiled call for every architecture, cheaper than one each or than
    # dispatching their ops eagerly; `A` checks only static shapes, so the call
    # stays free of runtime checks
    return [s.A(x)[0] for s, x in zip(structures, xs)]


def _structure_matrices(seed: int):
    """`A_0(x)` of every architecture at one random input, and their blocks."""
    rng = np.random.default_rng(seed)
    archs = _architectures()
    xs = [jnp.asarray(rng.normal(size=s.input_shape)) for _, s, _ in archs]
    As = _first_As([s for _, s, _ in archs], xs)
    matrices = {name: np.asarray(A) for (name, _, _), A in zip(archs, As)}
    blocks = {name: parts for name, _, parts in archs}
    return matrices, blocks


# --------------------------------------------------------------------------------
# checks, figures and the report


def _figures(out: Path | None, cfg: DemoConfig, eng, sw, pl, structures) -> dict:
    """The four figures, `file name -> Figure`, written to `out` unless `None`."""

    def path(name):
        return None if out is None else out / name

    curves = {
        "W-space (real tanh network, GD)": (eng.record, eng.L_w),
        "M-space flow": (eng.record, eng.L_m),
        "Lotka-Volterra": (eng.record, eng.L_lv),
    }
    if eng.L_m is None:
        del curves["M-space flow"]
    eps = np.exp(-eng.log_eps)
    figs = {}
    figs["staircase.png"] = plots.plot_loss_curves(
        curves,
        switch_times=eng.t_pred,
        rescaled=eng.rescaled,
        staircase=(eng.tau_grid, eng.stair_loss),
        rescaled_title=(
            r"Approach to the staircase as $\varepsilon \to 0$"
            "\n"
            rf"($\varepsilon = m_k(0) \approx \sigma^2 m$; here {eps:.0e} "
            rf"at $\sigma$ = {cfg.init_scale:g}, m = {cfg.width})"
        ),
        title=f"Sudden learning from init scale σ = {cfg.init_scale:g}",
        path=path("staircase.png"),
    )
    figs["init_scale.png"] = plots.plot_init_scale(
        sw.log_inv_sigma,
        sw.times,
        sw.predicted_slopes,
        predicted_times=sw.predicted,
        fitted_slopes=sw.slopes,
        path=path("init_scale.png"),
    )
    figs["power_law.png"] = plots.plot_power_law(
        pl["ts"],
        pl["loss"],
        window=pl["window"],
        gamma_fit=pl["gamma_fit"],
        gamma_rich=pl["gamma_rich"],
        gamma_lazy=pl["gamma_lazy"],
        fit=pl["fit_curve"],
        sharp=(pl["ts"], pl["sharp"]),
        path=path("power_law.png"),
    )
    matrices, blocks = structures
    figs["structures.png"] = plots.plot_structures(
        matrices, blocks=blocks, path=path("structures.png")
    )
    return figs


class _Stages:
    """A progress bar over the demo's stages and the time each one took."""

    def __init__(self, total: int, meter: AbstractProgressMeter):
        self.bar = meter.bar(total, "nqfjax demo")
        self.timings: dict[str, float] = {}

    def run(self, name: str, fn, *args):
        self.bar.status(name)
        start = time.perf_counter()
        out = fn(*args)
        self.timings[name.replace(" ", "_").replace("-", "_")] = (
            time.perf_counter() - start
        )
        self.bar.update(1)
        return out

    def close(self):
        self.bar.close()


class DemoOutput(DictView):
    """What `run_demo` checked and wrote.

    **Fields:**

    - `config`: the `DemoConfig` run.
    - `checks`: the comparisons, `DemoCheck`s (measured against a prediction of
      the theory or another simulation, with the tolerance and the verdict).
    - `timings`: seconds per stage.
    - `files`: the paths of `report` (`report.json`), `markdown` (`report.md`)
      and each figure (by file name).

    `passed`: every check within its tolerance. Reading it as the dict
    `run_demo` used to return (the content of `report.json`) is deprecated
    (one release).
    """

    config: DemoConfig = eqx.field(static=True)
    checks: tuple[DemoCheck, ...]
    timings: dict[str, float] = eqx.field(static=True)
    files: dict[str, Path] = eqx.field(static=True)

    @property
    def passed(self) -> bool:
        """Whether every check is within its tolerance."""
        return all(check.passed for check in self.checks)

    def as_dict(self) -> dict[str, Any]:
        """The content of `report.json`."""
        return json.loads(Path(self.files["report"]).read_text())


def run_demo(
    out_dir: str | os.PathLike = "nqfjax-out",
    *,
    quick: bool = False,
    config: DemoConfig | None = None,
    progress: bool | AbstractProgressMeter = True,
    log: Callable[[str], None] | None = None,
) -> DemoOutput:
    r"""Run the headline experiment and write its figures and report to `out_dir`.

    1. A tanh perceptron on whitened data, trained by gradient descent from
       `W0 = sigma Z`; beside it `solve_mflow` from `M0 = W0 W0^T` and `solve_lv`
       from `diag(basis^T M0 basis)` (`lv_reduce` of the task built from the same
       samples). Checks: the measured switch-on times of the real network against
       `switch_on_times` (2%), and the W-space loss on the plateaus against the
       LV simulation (1%).
    2. An init-scale sweep (`sweep` over `train`): switch-on times against
       `ln(1/sigma)`; check: slopes against `2 / r_k` (3%).
    3. A power-law task of `power_law_modes` independent modes: the exponent
       fitted by `fit_power_law` against the one fitted to the refined
       sharp-switch sum (1%) and `power_law_exponent(..., "rich")` (5%).
    4. The structure matrix of every architecture, as heatmaps.

    **Arguments:**

    - `out_dir`: where `staircase.png`, `init_scale.png`, `power_law.png`,
      `structures.png`, `report.json` and `report.md` go (created if needed).
    - `quick`: `DemoConfig.quick()`, a smaller problem (two modes, fewer
      records, three init scales, 1000 power-law modes in closed form, no
      M-space flow) with the same checks.
    - `config`: override the defaults entirely.
    - `progress`: a progress meter over the stages (`nqfjax.AbstractProgressMeter`;
      `True` for a `tqdm` bar, `False` for none).
    - `log`: where to send one-line status messages (default: nowhere).

    **Returns:** a `DemoOutput`: the checks (`passed` when every one is within
    its tolerance), the stages' timings and the paths of what was written.
    """
    cfg = config or (DemoConfig.quick() if quick else DemoConfig())
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    log = log or (lambda _: None)
    stages = _Stages(total=6, meter=as_progress_meter(progress))
    with jax.enable_x64(True):
        pb = stages.run("setup", _problem, cfg)
        eng = stages.run("engines", _engines, cfg, pb)
        sw = stages.run("init-scale sweep", _init_scale_sweep, cfg, pb)
        pl = stages.run("power law", _power_law, cfg)
        structures = stages.run("structures", _structure_matrices, cfg.seed)
    figures = list(stages.run("figures", _figures, out, cfg, eng, sw, pl, structures))
    stages.close()
    results = checks(cfg, eng, sw, pl)
    report = report_dict(
        cfg, pb, stages.timings, results, eng, sw, pl, structures[0], figures
    )
    atomic_write_text(out / "report.json", json.dumps(report, indent=1))
    atomic_write_text(out / "report.md", markdown(report))
    log(f"report: {out / 'report.md'}")
    files = {"report": out / "report.json", "markdown": out / "report.md"}
    return DemoOutput(
        config=cfg,
        checks=tuple(results),
        timings=dict(stages.timings),
        files={**files, **{name: out / name for name in figures}},
    )
