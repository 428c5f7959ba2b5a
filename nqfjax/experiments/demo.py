"""The headline experiment (`nqfjax demo`) and its report.

`run_demo` trains a real network from small initialisation, runs the M-space flow
and the Lotka-Volterra reduction beside it, checks the theory's predictions
against the measurements, and writes figures plus `report.json` and `report.md`.
Everything it does goes through the public API; the command line only calls it.
"""

import dataclasses
import datetime
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from .. import plots
from .._curves import first_crossing, loglog_slope
from ..analysis.power_law import fit_power_law
from ..engines.lv import lv_reduce, solve_lv
from ..engines.mflow import solve_mflow
from ..engines.train import train
from ..io import atomic_write_text, versions
from ..structures.perceptron import Perceptron
from ..structures.registry import make_structure, structure_class, structure_names
from ..sweep import sweep
from ..tasks.power_law import power_law_task
from ..tasks.sampled import task_from_samples
from ..theory.power_law import power_law_exponent, sharp_switch_loss
from ..theory.staircase import singular_limit
from ..theory.switch_on import switch_on_times


@dataclasses.dataclass(frozen=True)
class DemoConfig:
    """The demo's built-in defaults (all of them end up in `report.json`).

    The network is a two-layer tanh perceptron on exactly whitened inputs (an
    orthogonal design, `(1/n) X^T X = I`), with a linear teacher of singular values
    `singular_values`: each singular value is one logistic mode
    (docs/theory/lotka-volterra.md). The learning rate keeps
    `r_k = 2 eta s_k <= 0.01` per step, so
    gradient descent follows the flow to ~0.3% in time. Small singular values keep
    the learned weights small, so that tanh's cubic term stays negligible: it
    couples the modes, and once the first modes are learned it seeds the later
    ones at an amplitude independent of the init scale. With these values that
    seeding overtakes the init below `sigma ~ 1e-9`, so the init-scale sweep
    stays above it (measured: the slowest mode's slope 19% low over 1e-4..1e-10,
    and with 8x larger singular values 7% low over 1e-3..1e-7).
    """

    d: int = 6
    k: int = 3
    n: int = 32
    singular_values: tuple[float, ...] = (0.005, 0.0025, 0.00125)
    learning_rate: float = 1.0
    width: int = 128
    init_scale: float = 1e-4
    steps: int = 8000
    num_records: int = 400
    sweep_scales: tuple[float, ...] = (1e-4, 1e-5, 1e-6, 1e-7, 1e-8)
    sweep_steps: int = 14000
    power_law_modes: int = 2000
    alpha: float = 1.0
    beta: float = 0.5
    power_law_eps: float = 1e-16
    seed: int = 0
    # tolerances of the agreement checks (those of the library's tests)
    tol_switch_on: float = 0.02
    tol_plateau: float = 0.01
    tol_slope: float = 0.03
    tol_gamma_sharp: float = 0.01
    tol_gamma_rich: float = 0.05

    @classmethod
    def quick(cls) -> "DemoConfig":
        """Smaller sweeps for tests; the same checks."""
        return cls(
            num_records=240,
            sweep_scales=(1e-4, 1e-6, 1e-8),
            power_law_modes=2000,
        )


def _check(name: str, measured, predicted, tol: float, what: str) -> dict:
    measured = np.atleast_1d(np.asarray(measured, float))
    predicted = np.atleast_1d(np.asarray(predicted, float))
    rel = np.abs(measured / predicted - 1)
    worst = float(np.max(rel)) if rel.size else float("nan")
    return {
        "name": name,
        "what": what,
        "measured": measured.tolist(),
        "predicted": predicted.tolist(),
        "max_rel_error": worst,
        "tolerance": tol,
        "passed": bool(np.isfinite(worst) and worst <= tol),
    }


#: half-way crossings of the modes: a rise through the level, linear in t and m
_RISING_LINEAR = dict(rising=True, interpolate="linear", at_start="nan")


def _whitened_teacher(cfg: DemoConfig):
    rng = np.random.default_rng(cfg.seed)
    xs = np.sqrt(cfg.n) * np.linalg.qr(rng.normal(size=(cfg.n, cfg.n)))[0][:, : cfg.d]
    U = np.linalg.qr(rng.normal(size=(cfg.k, cfg.k)))[0]
    V = np.linalg.qr(rng.normal(size=(cfg.d, cfg.d)))[0][:, : cfg.k]
    teacher = U @ np.diag(cfg.singular_values) @ V.T
    return xs, xs @ teacher.T


def _engines(cfg: DemoConfig, structure, xs, ys, lv, basis, record):
    """W-space training from `sigma Z`, and M-space and LV from the same `M0`."""
    W0 = cfg.init_scale * np.random.default_rng(cfg.seed + 1).normal(
        size=(structure.p, cfg.width)
    )
    M0 = W0 @ W0.T
    res = train(
        structure,
        xs,
        ys,
        num_steps=cfg.steps,
        learning_rate=cfg.learning_rate,
        W0=W0,
        record_at=record,
        basis=basis,
    )
    ts = jnp.asarray(record, jnp.float64)
    task = task_from_samples(structure, xs, ys)
    L_m = solve_mflow(task, M0, ts, cfg.learning_rate).loss
    m0 = np.diag(basis.T @ M0 @ basis)
    m_lv = solve_lv(lv, m0, ts).ys
    return res, np.asarray(L_m), np.asarray(m_lv), m0


def _init_scale_sweep(cfg: DemoConfig, structure, xs, ys, lv, basis, learn):
    """Switch-on times of the real network at each init scale (one vmapped,
    jit-compiled `sweep`), measured as the half-way crossing of each learned mode."""
    record = np.unique(np.geomspace(1, cfg.sweep_steps, cfg.num_records).astype(int))
    Z = np.random.default_rng(cfg.seed + 2).normal(size=(structure.p, cfg.width))

    def run(init_scale):
        res = train(
            structure,
            xs,
            ys,
            num_steps=cfg.sweep_steps,
            learning_rate=cfg.learning_rate,
            W0=jnp.asarray(Z),
            init_scale=init_scale,
            record_at=record,
            basis=basis[:, learn],
        )
        return res.m

    out = sweep(run, {"init_scale": np.asarray(cfg.sweep_scales)}, progress=False)
    mstar = np.asarray(lv.fixed_point_isolated())[learn]
    times = np.stack(
        [
            first_crossing(record, np.asarray(m), mstar / 2, **_RISING_LINEAR)
            for m in out.outputs
        ]
    )
    x = np.log(1 / np.asarray(cfg.sweep_scales))
    slopes = np.array(
        [loglog_slope(x, t, np.isfinite(t), take_logs=False).slope for t in times.T]
    )
    return x, times, slopes


def _power_law(cfg: DemoConfig):
    """A power-law task of many independent modes: simulated, fitted, predicted."""
    eta = 0.25  # 4 eta = 1: r_k = k^-(alpha + beta)
    a, b, p, eps = cfg.alpha, cfg.beta, cfg.power_law_modes, cfg.power_law_eps
    lv = power_law_task(p, a, b).lotka_volterra(eta)  # B diagonal: O(p) steps
    # the modes beyond p stay unlearned until after the window: keep their loss,
    # sum_{k > p} lam_k m*_k^2 / 2 (a Hurwitz zeta), so that the curve inside the
    # window is that of the infinite spectrum
    tail = 0.5 * jax.scipy.special.zeta(a + 2 * b, p + 1.0)
    lv = eqx.tree_at(lambda s: s.loss_offset, lv, lv.loss_offset + tail)
    log_eps = np.log(1 / eps)

    def t_on(k):  # sharp switch-on of mode k
        return (log_eps - b * np.log(k)) * k ** (a + b) / (4 * eta)

    # the steps merge into a power law once k > (alpha + beta) ln(1/eps); the last
    # modes carry finite-p effects: fit between twice the first and p/2
    window = (float(t_on(2 * (a + b) * log_eps)), float(t_on(p / 2)))
    ts = np.geomspace(1.0, 4 * t_on(p), 400)
    loss = np.asarray(solve_lv(lv, jnp.full(p, eps), jnp.asarray(ts)).loss)
    sharp = np.asarray(sharp_switch_loss(lv, eps, jnp.asarray(ts)))
    fit = fit_power_law(ts, loss, window=window)
    fit_sharp = fit_power_law(ts, sharp, window=window)
    return {
        "ts": ts,
        "loss": loss,
        "sharp": sharp,
        "window": window,
        "gamma_fit": float(fit.gamma),
        "gamma_fit_err": float(fit.gamma_err),
        "gamma_sharp": float(fit_sharp.gamma),
        "gamma_rich": float(power_law_exponent(a, b, "rich")),
        "gamma_lazy": float(power_law_exponent(a, b, "lazy")),
    }


def _structure_matrices(seed: int) -> dict[str, np.ndarray]:
    key = jax.random.key(seed)
    out = {}
    # every registered structure at its defaults, and the other branch of the
    # two whose `A` changes form with a flag
    named = [
        (structure_class(n).__name__, make_structure(n)) for n in structure_names()
    ]
    named += [
        ("QKAttention (linear)", make_structure("qk_attention", softmax=False)),
        ("MixtureOfExperts (factor gate)", make_structure("moe", gate="factor")),
    ]
    for name, s in named:
        key, sub = jax.random.split(key)
        out[name] = np.asarray(s.A(jax.random.normal(sub, s.input_shape))[0])
    return out


def _markdown(report: dict) -> str:
    h = report["headline"]
    lines = [
        "# nqfjax demo report",
        "",
        f"Generated {report['created']} with nqfjax {report['versions']['nqfjax']} "
        f"(jax {report['versions']['jax']}, backend {report['versions']['backend']}).",
        "",
        "A two-layer tanh perceptron with "
        f"{report['config']['k']} outputs learns a linear teacher from init scale "
        f"{report['config']['init_scale']:g}: each singular value of the teacher is "
        "one mode that switches on suddenly after a plateau.",
        "",
        "## Headline numbers (prediction vs measurement)",
        "",
        "| quantity | predicted | measured | max rel. error | tolerance | ok |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for c in report["checks"]:
        fmt = lambda v: ", ".join(f"{x:.4g}" for x in v)  # noqa: E731
        lines.append(
            f"| {c['what']} | {fmt(c['predicted'])} | {fmt(c['measured'])} | "
            f"{c['max_rel_error']:.2%} | {c['tolerance']:.0%} | "
            f"{'yes' if c['passed'] else '**NO**'} |"
        )
    lines += [
        "",
        f"Power-law exponent: fitted {h['gamma_fit']:.4f}, rich theory "
        f"{h['gamma_rich']:.4f} (lazy {h['gamma_lazy']:.4f}); the fit sits a few "
        "percent above the asymptotic value because of the logarithmic corrections "
        "that the refined sharp-switch sum keeps.",
        "",
        "## Figures",
        "",
    ]
    captions = {
        "staircase.png": "W-space, M-space and Lotka-Volterra loss curves, predicted "
        "switch-on times, and the singular-limit staircase in rescaled time.",
        "init_scale.png": "Switch-on times against ln(1/sigma) with the predicted "
        "slopes 2/r_k.",
        "power_law.png": "Many modes: the loss follows a power law whose exponent "
        "the theory predicts.",
        "structures.png": "The structure matrix A(x) of each architecture.",
    }
    for name in report["figures"]:
        lines += [f"### {name}", "", captions[name], "", f"![{name}]({name})", ""]
    return "\n".join(lines)


def run_demo(
    out_dir: str | os.PathLike = "nqfjax-out",
    *,
    quick: bool = False,
    config: DemoConfig | None = None,
    progress: bool = True,
    log: Callable[[str], None] | None = None,
) -> dict:
    r"""Run the headline experiment and write its figures and report to `out_dir`.

    1. A tanh perceptron on whitened data, trained by gradient descent from
       `W0 = sigma Z`; beside it `solve_mflow` from `M0 = W0 W0^T` and `solve_lv`
       from `diag(basis^T M0 basis)` (`lv_reduce` of the task built from the same
       samples). Checks: the measured switch-on times of the real network against
       `switch_on_times` (2%), and the W-space loss on the plateaus against LV (1%).
    2. An init-scale sweep (`sweep` over `train`): switch-on times against
       `ln(1/sigma)`; check: slopes against `2 / r_k` (3%).
    3. A power-law task of `power_law_modes` independent modes integrated with
       `solve_lv`: the exponent fitted by `fit_power_law` against the refined
       sharp-switch prediction (1%) and `power_law_exponent(..., "rich")` (5%).
    4. The structure matrix of every architecture, as heatmaps.

    **Arguments:**

    - `out_dir`: where `staircase.png`, `init_scale.png`, `power_law.png`,
      `structures.png`, `report.json` and `report.md` go (created if needed).
    - `quick`: a smaller init-scale sweep (`DemoConfig.quick()`), for tests.
    - `config`: override the defaults entirely.
    - `progress`: show a progress bar over the steps.
    - `log`: where to send one-line status messages (default: nowhere).

    **Returns:** the report (the content of `report.json`), with `passed` true when
    every check is within its tolerance.
    """
    cfg = config or (DemoConfig.quick() if quick else DemoConfig())
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    log = log or (lambda _: None)
    stages = tqdm(total=5, desc="nqfjax demo", disable=not progress, unit="stage")
    timings = {}
    clock = time.perf_counter()

    def done(name):
        nonlocal clock
        now = time.perf_counter()
        timings[name] = now - clock
        clock = now
        stages.update(1)

    with jax.enable_x64(True):
        # 1. three engines on one network
        stages.set_postfix_str("three engines")
        structure = Perceptron(d=cfg.d, k=cfg.k)
        xs, ys = _whitened_teacher(cfg)
        task = task_from_samples(structure, xs, ys)
        lv, basis = lv_reduce(task, cfg.learning_rate)
        basis = np.asarray(basis)
        # the modes that grow: r above roundoff (the teacher's null directions
        # have r = 0 up to ~1e-35, of either sign)
        r = np.asarray(lv.r)
        learn = np.flatnonzero(r > 1e-8 * np.abs(r).max())
        record = np.unique(np.linspace(0, cfg.steps, cfg.num_records).astype(int))
        res, L_m, m_lv, m0 = _engines(cfg, structure, xs, ys, lv, basis, record)
        L_w, L_lv = np.asarray(res.loss), np.asarray(lv.loss(jnp.asarray(m_lv)))
        mstar = np.asarray(lv.fixed_point_isolated())[learn]
        t_pred = np.asarray(switch_on_times(lv, m0))[learn]
        t_meas = first_crossing(
            record, np.asarray(res.m)[:, learn], mstar / 2, **_RISING_LINEAR
        )
        log_eps = float(-np.log(np.median(m0[learn])))
        stair = singular_limit(lv, log_eps, m0=m0)
        # LV at shrinking eps with the same exponents q_k(0) = ln m0_k / ln(1/eps):
        # in rescaled time they approach the staircase (errors ~ 1 / ln(1/eps))
        finite_tau = np.asarray(stair.switch_on_tau)[np.isfinite(stair.switch_on_tau)]
        tau_grid = np.linspace(0, 1.4 * finite_tau.max(), cfg.num_records)
        stair_loss = np.asarray(stair.loss_tau(tau_grid))
        rescaled = {}
        for c in (1, 2, 4, 8):
            sol_c = solve_lv(
                lv, np.exp(c * np.log(m0)), jnp.asarray(tau_grid * c * log_eps)
            )
            rescaled[rf"Lotka-Volterra, $\varepsilon$ = {np.exp(-c * log_eps):.0e}"] = (
                tau_grid,
                np.asarray(sol_c.loss),
            )
        done("engines")

        # plateau losses: W-space vs LV where LV is flattest between switch-ons
        t_sorted = np.sort(t_pred)
        slope = np.abs(np.gradient(L_lv, record))
        idx = []
        for lo, hi in zip(t_sorted[:-1], t_sorted[1:]):
            window = np.flatnonzero((record > lo) & (record < hi))
            if window.size:
                idx.append(int(window[np.argmin(slope[window])]))

        # 2. init-scale sweep
        stages.set_postfix_str("init-scale sweep")
        x_sweep, t_sweep, slopes = _init_scale_sweep(
            cfg, structure, xs, ys, lv, basis, learn
        )
        pred_slopes = 2 / np.asarray(lv.r)[learn]
        done("init_scale_sweep")

        # 3. power law
        stages.set_postfix_str("power law")
        pl = _power_law(cfg)
        done("power_law")

        # 4. structures
        stages.set_postfix_str("structures")
        matrices = _structure_matrices(cfg.seed)
        done("structures")

    # figures
    stages.set_postfix_str("figures")
    figures = ["staircase.png", "init_scale.png", "power_law.png", "structures.png"]
    plots.plot_loss_curves(
        {
            "W-space (real tanh network, GD)": (record, L_w),
            "M-space flow": (record, L_m),
            "Lotka-Volterra": (record, L_lv),
        },
        switch_times=t_pred,
        rescaled=rescaled,
        staircase=(tau_grid, stair_loss),
        path=out / "staircase.png",
        title=f"Sudden learning from init scale {cfg.init_scale:g}",
    )
    plots.plot_init_scale(
        x_sweep, t_sweep, pred_slopes, fitted_slopes=slopes, path=out / "init_scale.png"
    )
    plots.plot_power_law(
        pl["ts"],
        pl["loss"],
        window=pl["window"],
        gamma_fit=pl["gamma_fit"],
        gamma_rich=pl["gamma_rich"],
        gamma_lazy=pl["gamma_lazy"],
        sharp=(pl["ts"], pl["sharp"]),
        path=out / "power_law.png",
    )
    plots.plot_structures(matrices, path=out / "structures.png")
    done("figures")
    stages.close()

    checks = [
        _check(
            "switch_on_times",
            t_meas,
            t_pred,
            cfg.tol_switch_on,
            "switch-on times of the real network (steps)",
        ),
        _check(
            "plateau_losses",
            L_w[idx],
            L_lv[idx],
            cfg.tol_plateau,
            "plateau losses, W-space vs Lotka-Volterra",
        ),
        _check(
            "init_scale_slopes",
            slopes,
            pred_slopes,
            cfg.tol_slope,
            "d t_k / d ln(1/sigma) vs 2/r_k",
        ),
        _check(
            "gamma_vs_sharp_switch",
            pl["gamma_fit"],
            pl["gamma_sharp"],
            cfg.tol_gamma_sharp,
            "power-law exponent vs refined sharp-switch sum",
        ),
        _check(
            "gamma_vs_rich",
            pl["gamma_fit"],
            pl["gamma_rich"],
            cfg.tol_gamma_rich,
            "power-law exponent vs (alpha+2beta-1)/(alpha+beta)",
        ),
    ]
    report = {
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "config": dataclasses.asdict(cfg),
        "versions": versions(),
        "timings_s": timings,
        "passed": all(c["passed"] for c in checks),
        "checks": checks,
        "headline": {
            "switch_on_measured": t_meas.tolist(),
            "switch_on_predicted": t_pred.tolist(),
            "slopes_measured": slopes.tolist(),
            "slopes_predicted": pred_slopes.tolist(),
            "gamma_fit": pl["gamma_fit"],
            "gamma_fit_err": pl["gamma_fit_err"],
            "gamma_sharp": pl["gamma_sharp"],
            "gamma_rich": pl["gamma_rich"],
            "gamma_lazy": pl["gamma_lazy"],
        },
        "lotka_volterra": {
            "r": np.asarray(lv.r).tolist(),
            "B": np.asarray(lv.B).tolist(),
            "learned_modes": learn.tolist(),
            "m0": m0.tolist(),
            "log_inv_eps": log_eps,
        },
        "curves": {
            "t": record.tolist(),
            "loss_w_space": L_w.tolist(),
            "loss_m_space": L_m.tolist(),
            "loss_lv": L_lv.tolist(),
            "plateau_indices": idx,
        },
        "staircase": {
            "jump_times": np.asarray(stair.jump_times).tolist(),
            "plateau_losses": np.asarray(stair.plateau_losses).tolist(),
            "tau": tau_grid.tolist(),
            "rescaled_lv": {k: v[1].tolist() for k, v in rescaled.items()},
            "events": [e._asdict() for e in stair.events],
        },
        "init_scale_sweep": {
            "init_scales": list(cfg.sweep_scales),
            "log_inv_sigma": x_sweep.tolist(),
            "switch_on_times": t_sweep.tolist(),
        },
        "power_law": {
            "t": pl["ts"].tolist(),
            "loss": pl["loss"].tolist(),
            "sharp_switch": pl["sharp"].tolist(),
            "window": list(pl["window"]),
        },
        "structures": {name: A.tolist() for name, A in matrices.items()},
        "figures": figures,
    }
    atomic_write_text(out / "report.json", json.dumps(report, indent=1))
    atomic_write_text(out / "report.md", _markdown(report))
    log(f"report: {out / 'report.md'}")
    return report
