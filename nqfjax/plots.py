"""Figures: loss curves with switch-on times, the staircase, init-scale sweeps,
power laws and structure matrices.

Each function takes plain arrays, draws one figure, writes it to `path` (PNG,
atomically) when given, and returns the `matplotlib.figure.Figure`. They never call
a solver themselves.

Figures are built with matplotlib's object API (`matplotlib.figure.Figure`), never
through pyplot: nothing here opens, registers or closes a pyplot figure, so the
figures of a notebook or script that calls into nqfjax are left alone.
"""

from collections.abc import Mapping, Sequence

import matplotlib as mpl
import numpy as np
from matplotlib.figure import Figure

from .io import write_figure


_COLOURS = mpl.rcParams["axes.prop_cycle"].by_key()["color"]


def _save(fig, path) -> None:
    if path is not None:
        write_figure(path, fig)


def plot_loss_curves(
    curves: Mapping[str, tuple[np.ndarray, np.ndarray]],
    *,
    switch_times: Sequence[float] = (),
    rescaled: Mapping[str, tuple[np.ndarray, np.ndarray]] | None = None,
    staircase: tuple[np.ndarray, np.ndarray] | None = None,
    floor: float = 1e-5,
    path=None,
    title: str = "Loss curves",
):
    """Loss curves of several engines on one log-log plot and, optionally, curves
    in rescaled time beside the singular-limit staircase.

    **Arguments:**

    - `curves`: label -> `(t, loss)`, e.g. W-space, M-space and LV.
    - `switch_times`: predicted switch-on times, drawn as vertical lines.
    - `rescaled`: label -> `(tau, loss)` with `tau = t / ln(1/eps)`, e.g. LV
      curves at shrinking `eps`, drawn on a second panel.
    - `staircase`: `(tau, loss)` of the singular limit, drawn on that panel.
    - `floor`: the loss axes start at `floor` times the largest loss.
    """
    ncols = 2 if (rescaled or staircase is not None) else 1
    fig = Figure(figsize=(6.2 * ncols, 4.4), layout="constrained")
    axes = fig.subplots(1, ncols, squeeze=False)
    ax = axes[0, 0]
    styles = ["-", "--", ":", "-."]
    top = max(float(np.nanmax(loss)) for _, loss in curves.values())
    for i, (label, (t, loss)) in enumerate(curves.items()):
        t, loss = np.asarray(t), np.asarray(loss)
        keep = (t > 0) & (loss > 0)
        ax.loglog(t[keep], loss[keep], styles[i % 4], lw=2.4 - 0.5 * i, label=label)
    for j, ts in enumerate(switch_times):
        if np.isfinite(ts):
            label = "predicted switch-on" if j == 0 else None
            ax.axvline(ts, color="grey", lw=0.8, ls=":", label=label)
    ax.set_ylim(floor * top, 2 * top)
    ax.set_xlabel("t (gradient steps)")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.legend(fontsize=8)
    if ncols == 2:
        ax2 = axes[0, 1]
        for i, (label, (tau, loss)) in enumerate((rescaled or {}).items()):
            ax2.semilogy(
                tau,
                loss,
                lw=1.6,
                alpha=0.5 + 0.5 * i / max(len(rescaled) - 1, 1),
                label=label,
            )
        if staircase is not None:
            tau, level = staircase
            ax2.step(
                tau, level, where="post", color="k", lw=1.4, label="singular limit"
            )
        ax2.set_ylim(floor * top, 2 * top)
        ax2.set_xlabel(r"rescaled time $\tau = t / \ln(1/\varepsilon)$")
        ax2.set_ylabel("loss")
        ax2.set_title("Approach to the staircase as the init scale shrinks")
        ax2.legend(fontsize=8)
    _save(fig, path)
    return fig


def plot_init_scale(
    log_inv_sigma: np.ndarray,
    times: np.ndarray,
    predicted_slopes: np.ndarray,
    *,
    fitted_slopes: np.ndarray | None = None,
    path=None,
):
    """Measured switch-on times against `ln(1/sigma)`, one colour per mode, with
    lines of the predicted slopes `2/r_k` through the measured means.

    **Arguments:**

    - `log_inv_sigma`: shape `(S,)`.
    - `times`: measured switch-on times, shape `(S, K)`.
    - `predicted_slopes`: shape `(K,)`.
    - `fitted_slopes`: optional, shape `(K,)`, shown in the legend.
    """
    x = np.asarray(log_inv_sigma)
    times = np.asarray(times)
    fig = Figure(figsize=(6.2, 4.4), layout="constrained")
    ax = fig.subplots()
    for k in range(times.shape[1]):
        c = _COLOURS[k % len(_COLOURS)]
        label = f"mode {k}: predicted slope {predicted_slopes[k]:.3g}"
        if fitted_slopes is not None:
            label += f", measured {fitted_slopes[k]:.3g}"
        ax.plot(x, times[:, k], "o", color=c, label=label)
        ok = np.isfinite(times[:, k])
        if ok.any():
            x0, y0 = x[ok].mean(), times[ok, k].mean()
            ax.plot(x, y0 + predicted_slopes[k] * (x - x0), "-", color=c, lw=1)
    ax.set_xlabel(r"$\ln(1/\sigma)$")
    ax.set_ylabel("switch-on time (steps)")
    ax.set_title(r"Switch-on times grow like $(2/r_k)\,\ln(1/\sigma)$")
    ax.legend(fontsize=8)
    _save(fig, path)
    return fig


def plot_power_law(
    t: np.ndarray,
    loss: np.ndarray,
    *,
    window: tuple[float, float],
    gamma_fit: float,
    gamma_rich: float,
    gamma_lazy: float,
    sharp: tuple[np.ndarray, np.ndarray] | None = None,
    path=None,
):
    """A loss curve with many modes, the fitting window, and guide lines of slope
    `-gamma_fit`, `-gamma_rich` and `-gamma_lazy` through the window's middle."""
    t, loss = np.asarray(t), np.asarray(loss)
    fig = Figure(figsize=(6.2, 4.4), layout="constrained")
    ax = fig.subplots()
    keep = (t > 0) & (loss > 0)
    ax.loglog(t[keep], loss[keep], lw=2.4, label="Lotka-Volterra simulation")
    if sharp is not None:
        ax.loglog(*sharp, "--", lw=1.2, label="sharp-switch sum")
    lo, hi = window
    ax.axvspan(lo, hi, color="grey", alpha=0.12, label="fitting window")
    tm = np.sqrt(lo * hi)
    lm = np.interp(np.log(tm), np.log(t[keep]), loss[keep])
    tt = np.geomspace(lo, hi, 20)
    for g, style, name in [
        (gamma_fit, "k-", "fitted"),
        (gamma_rich, "r:", "rich theory"),
        (gamma_lazy, "g-.", "lazy theory"),
    ]:
        ax.loglog(
            tt,
            lm * 1.6 * (tt / tm) ** (-g),
            style,
            lw=1.2,
            label=rf"{name}: $\gamma$ = {g:.3f}",
        )
    ax.set_xlabel("t (gradient steps)")
    ax.set_ylabel("loss")
    ax.set_title(r"Power law $L \sim t^{-\gamma}$ from many modes")
    ax.legend(fontsize=8)
    _save(fig, path)
    return fig


def plot_structures(matrices: Mapping[str, np.ndarray], *, path=None):
    """Heatmaps of one structure matrix `A_0(x)` (shape `(p, p)`) per architecture,
    on a symmetric colour scale."""
    names = list(matrices)
    ncols = min(3, len(names))
    nrows = -(-len(names) // ncols)
    fig = Figure(figsize=(3.6 * ncols, 3.4 * nrows), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False)
    for ax in axes.flat[len(names) :]:
        ax.axis("off")
    for ax, name in zip(axes.flat, names):
        A = np.asarray(matrices[name])
        v = np.max(np.abs(A)) or 1.0
        im = ax.imshow(A, cmap="RdBu_r", vmin=-v, vmax=v)
        ax.set_title(f"{name} (p = {A.shape[0]})", fontsize=9)
        ax.set_xticks([])
        ax.set_yticks([])
        fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04)
    fig.suptitle(r"Structure matrices $A(x)$ for one input")
    _save(fig, path)
    return fig


def plot_sweep(steps: np.ndarray, loss: np.ndarray, grid: Mapping[str, Sequence]):
    """The loss curves of a sweep (`nqfjax sweep`), one log-log panel per
    `(optimizer, architecture)` group: colour by init scale, line style by learning
    rate.

    **Arguments:**

    - `steps`: the recorded steps, shape `(R,)`.
    - `loss`: shape `(n_optimizer, n_architecture, n_init_scale,
      n_learning_rate, n_seed, R)`.
    - `grid`: the grid axes, with keys `optimizer`, `architecture`, `init_scale`,
      `learning_rate` and `seed` (lists as long as the axes of `loss`).
    """
    n_o, n_a = loss.shape[:2]
    fig = Figure(figsize=(4.2 * n_a, 3.4 * n_o), layout="constrained")
    axes = fig.subplots(n_o, n_a, squeeze=False)
    colours = [f"C{i % 10}" for i in range(len(grid["init_scale"]))]
    styles = ["-", "--", ":", "-."]
    t = np.maximum(steps, 0.5)  # step 0 drawn at 0.5 on the log axis
    for o, a in np.ndindex(n_o, n_a):
        ax = axes[o, a]
        for s, lr, seed in np.ndindex(loss.shape[2:5]):
            curve = loss[o, a, s, lr, seed]
            label = None
            if seed == 0:
                label = (
                    f"σ={grid['init_scale'][s]:.3g}, η={grid['learning_rate'][lr]:.3g}"
                )
            ax.loglog(
                t,
                curve,
                styles[lr % 4],
                color=colours[s],
                lw=1.2,
                alpha=0.8,
                label=label,
            )
        ax.set_title(f"{grid['optimizer'][o]}, {grid['architecture'][a]}", fontsize=10)
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.legend(fontsize=7)
    return fig


def plot_curve_analysis(
    ts: np.ndarray, loss: np.ndarray, curves: Mapping, summary: Mapping
):
    """A user's loss curve (`nqfjax fit`) on log-log axes with what
    `analyse_curve` found in it.

    **Arguments:**

    - `ts`, `loss`: the curve, shape `(R,)`.
    - `curves`: what was found, as `analyse_curve` collects it: optional entries
      `plateaus` (with `start`, `end`, `level` and `drop_times`),
      `power_law_curve` (`(t, fitted loss)` over the fitting window) and
      `spectrum_curve` (the spectrum model's loss at `ts`).
    - `summary`: the summary of `analyse_curve`, for the window and the fitted
      numbers (`summary["power_law"]["window"]`, `["gamma"]`;
      `summary["spectrum"]["alpha"]`, `["beta"]`).
    """
    fig = Figure(figsize=(6.4, 4.6), layout="constrained")
    ax = fig.subplots()
    pos = (ts > 0) & (loss > 0)
    ax.loglog(ts[pos], loss[pos], "k-", lw=2.2, alpha=0.7, label="data")
    if "plateaus" in curves:
        pl = curves["plateaus"]
        for i, (s, e, lvl) in enumerate(
            zip(np.asarray(pl.start), np.asarray(pl.end), np.asarray(pl.level))
        ):
            ax.hlines(
                lvl,
                s,
                e,
                colors="C1",
                lw=3,
                alpha=0.8,
                label="plateaus" if i == 0 else None,
            )
        for i, td in enumerate(np.asarray(pl.drop_times)):
            ax.axvline(
                td, color="C1", lw=0.8, ls=":", label="drops" if i == 0 else None
            )
    if "power_law_curve" in curves:
        lo, hi = summary["power_law"]["window"]
        ax.axvspan(lo, hi, color="C0", alpha=0.1, label="power-law window")
        tt, fitted = curves["power_law_curve"]
        g = summary["power_law"]["gamma"]
        ax.loglog(
            tt,
            fitted,
            "C0--",
            lw=1.5,
            label=rf"power law, $\gamma$ = {g:.3f}",
        )
    if "spectrum_curve" in curves:
        s = summary["spectrum"]
        model = curves["spectrum_curve"]
        keep = pos & (model > 0)
        ax.loglog(
            ts[keep],
            model[keep],
            "C2:",
            lw=1.5,
            label=rf"spectrum: $\alpha$ = {s['alpha']:.2f}, $\beta$ = {s['beta']:.2f}",
        )
    ax.set_xlabel("t (steps)")
    ax.set_ylabel("loss")
    ax.set_title("Loss curve analysis")
    ax.legend(fontsize=8)
    return fig


def plot_prediction(prediction, trained=None, title: str = ""):
    """A prediction's loss curve with its switch-on times marked, and optionally
    the trained network's curve (`nqfjax predict`)."""
    fig = Figure(figsize=(6.4, 4.6), layout="constrained")
    ax = fig.subplots()
    ts, loss = np.asarray(prediction.ts), np.asarray(prediction.loss)
    keep = ts > 0
    ax.loglog(
        ts[keep], loss[keep], "C0-", lw=2.4, label=f"predicted ({prediction.engine})"
    )
    if trained is not None:
        tt, lt = np.asarray(trained.ts), np.asarray(trained.loss)
        keep = (tt > 0) & (lt > 0)
        ax.loglog(tt[keep], lt[keep], "k--", lw=1.4, label="trained network")
    for i, t in enumerate(np.asarray(prediction.switch_times)):
        if np.isfinite(t):
            label = "predicted switch-on" if i == 0 else None
            ax.axvline(t, color="C1", lw=0.9, ls=":", label=label)
    ax.set_xlabel("t (gradient steps)")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.legend(fontsize=8)
    return fig
