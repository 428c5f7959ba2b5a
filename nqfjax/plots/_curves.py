"""Figures of runs and curves: a sweep's loss curves, a user's curve analysed
and forecast, and a prediction against training."""

from collections.abc import Mapping, Sequence

import numpy as np
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from ._common import STYLES, cycle_colour, log_interp, positive_part


def plot_sweep(
    steps: np.ndarray,
    loss: np.ndarray,
    grid: Mapping[str, Sequence],
    *,
    switch_on: np.ndarray | None = None,
):
    """The loss curves of a sweep (`nqfjax sweep`), one panel per
    `(optimizer, architecture)` group: colour by init scale, line style by
    learning rate, marker by seed; a cross marks where a run diverged (its last
    finite point). Where the theory applies, a short vertical tick at the top
    of the panel marks each mode's predicted switch-on time, in the colour and
    line style of its `(init scale, learning rate)` (`gid`
    `"switch_on:S:L:K"`, with `S`, `L` and `K` the indices of the init scale,
    learning rate and mode).

    The step axis is logarithmic above step 1 and linear below it (`symlog`), so
    step 0 sits at 0, where it is.

    **Arguments:**

    - `steps`: the recorded steps, shape `(R,)`.
    - `loss`: shape `(n_optimizer, n_architecture, n_init_scale,
      n_learning_rate, n_seed, R)`.
    - `grid`: the grid axes, with keys `optimizer`, `architecture`, `init_scale`,
      `learning_rate` and `seed` (lists as long as the axes of `loss`).
    - `switch_on`: predicted switch-on times in steps, shape `(n_optimizer,
      n_architecture, n_init_scale, n_learning_rate, K)`, NaN where there is no
      prediction (e.g. Adam); `None` for none.
    """
    steps = np.asarray(steps, float)
    loss = np.asarray(loss, float)
    n_o, n_a = loss.shape[:2]
    fig = Figure(figsize=(4.6 * n_a + 1.6, 3.6 * n_o), layout="constrained")
    axes = fig.subplots(n_o, n_a, squeeze=False)
    diverged = predicted = False
    for o, a in np.ndindex(n_o, n_a):
        ax = axes[o, a]
        diverged |= _sweep_curves(ax, steps, loss[o, a], np.nanmax(loss))
        ax.set_xscale("symlog", linthresh=1.0)
        ax.set_yscale("log")
        ax.set_xlim(0, steps.max() * 1.05)
        if switch_on is not None:
            predicted |= _switch_on_ticks(ax, np.asarray(switch_on, float)[o, a])
        ax.set_title(f"{grid['optimizer'][o]}, {grid['architecture'][a]}", fontsize=10)
        ax.set_xlabel("step (symlog: step 0 at 0)")
        ax.set_ylabel("loss")
    handles = _sweep_legend(grid, predicted, diverged)
    fig.legend(handles=handles, loc="outside right upper", fontsize=7)
    return fig


#: The markers of the seeds of a sweep.
_MARKERS = ["o", "s", "^", "v", "D", "P", "X", "*"]


def _sweep_curves(ax, steps, loss, top) -> bool:
    """One panel's curves, `loss[s, lr, seed, :]`, and a cross where a run
    diverged (at its last finite point, or at `top` if none is); whether one
    did."""
    every = max(1, steps.size // 8)
    diverged = False
    for s, lr, seed in np.ndindex(loss.shape[:3]):
        curve = loss[s, lr, seed]
        ax.plot(
            steps,
            curve,
            STYLES[lr % 4],
            color=cycle_colour(s),
            marker=_MARKERS[seed % len(_MARKERS)],
            markevery=(seed % every, every),
            ms=3.5,
            lw=1.1,
            alpha=0.85,
        )
        finite = np.flatnonzero(np.isfinite(curve))
        if finite.size < curve.size:
            diverged = True
            last = finite[-1] if finite.size else 0
            ax.plot(
                steps[last],
                curve[last] if finite.size else top,
                "x",
                color="red",
                ms=9,
                mew=2,
            )
    return diverged


def _sweep_legend(grid, predicted: bool, diverged: bool) -> list:
    """The legend's entries: init scales by colour, learning rates by line
    style, seeds by marker, and the switch-on ticks and crosses if drawn."""
    handles = [
        Line2D([], [], color=cycle_colour(i), label=f"σ = {v:.3g}")
        for i, v in enumerate(grid["init_scale"])
    ]
    handles += [
        Line2D([], [], color="k", ls=STYLES[i % 4], label=f"η = {v:.3g}")
        for i, v in enumerate(grid["learning_rate"])
    ]
    handles += [
        Line2D(
            [],
            [],
            color="k",
            ls="",
            marker=_MARKERS[i % len(_MARKERS)],
            label=f"seed {v}",
        )
        for i, v in enumerate(grid["seed"])
    ]
    if predicted:
        handles.append(
            Line2D(
                [], [], color="k", ls="", marker="|", ms=9, mew=1.5,
                label="predicted switch-on\n(theory, first seed)",
            )
        )  # fmt: skip
    if diverged:
        handles.append(
            Line2D([], [], color="red", ls="", marker="x", mew=2, label="diverged")
        )
    return handles


def _switch_on_ticks(ax, times) -> bool:
    """Ticks at the predicted switch-on times `times[s, lr, k]` (steps) along the
    top of `ax`, from 88% to 100% of its height; whether any was drawn."""
    drawn = False
    for s, lr, k in np.ndindex(times.shape):
        t = times[s, lr, k]
        if np.isfinite(t) and t >= 0:
            ax.axvline(
                t, ymin=0.88, ymax=1.0, color=cycle_colour(s), ls=STYLES[lr % 4],
                lw=1.6, gid=f"switch_on:{s}:{lr}:{k}",
            )  # fmt: skip
            drawn = True
    return drawn


def plot_curve_analysis(
    ts: np.ndarray, loss: np.ndarray, curves: Mapping, summary: Mapping
):
    r"""A user's loss curve (`nqfjax fit`) on log-log axes with what
    `analyse_curve` found in it, and the residuals of the fitted models below,
    $\ln(\text{data}/\text{model})$.

    **Arguments:**

    - `ts`, `loss`: the curve, shape `(R,)`.
    - `curves`: what was found, as `analyse_curve` collects it: optional entries
      `plateaus` (with `start`, `end`, `level` and `drop_times`),
      `power_law_curve` (`(t, fitted loss)` over the fitting window) and
      `spectrum_curve` (the spectrum model's loss at `ts`) and `forecast` (a
      `Forecast`, drawn by `plot_forecast`).
    - `summary`: the summary of `analyse_curve`, for the window and the fitted
      numbers (`summary["power_law"]["window"]`, `["gamma"]`;
      `summary["spectrum"]["alpha"]`, `["beta"]`).
    """
    ts, loss = np.asarray(ts, float), np.asarray(loss, float)
    fig = Figure(figsize=(6.6, 6.2), layout="constrained")
    ax, resid = fig.subplots(2, 1, sharex=True, height_ratios=(3, 1.4))
    pos = (ts > 0) & (loss > 0)
    ax.loglog(
        ts[pos], loss[pos], "k-", lw=2.2, alpha=0.7, label="data", gid="data:data"
    )
    if "plateaus" in curves:
        _plateaus(ax, curves["plateaus"])
    if "power_law_curve" in curves:
        lo, hi = summary["power_law"]["window"]
        for a in (ax, resid):
            a.axvspan(lo, hi, color="C0", alpha=0.1)
        ax.patches[-1].set_label("power-law window")
        tt, fitted = positive_part(*curves["power_law_curve"])
        g = summary["power_law"]["gamma"]
        ax.loglog(
            tt,
            fitted,
            "C0--",
            lw=1.5,
            label=rf"power law, $\gamma$ = {g:.3f}",
            gid="guide:data",
        )
        inside = pos & (ts >= tt[0]) & (ts <= tt[-1])
        resid.semilogx(
            ts[inside],
            np.log(loss[inside] / log_interp(ts[inside], tt, fitted)),
            "C0-",
            label="data / power law",
        )
    if "spectrum_curve" in curves:
        s = summary["spectrum"]
        model = np.asarray(curves["spectrum_curve"], float)
        keep = pos & (model > 0)
        ax.loglog(
            ts[keep],
            model[keep],
            "C2:",
            lw=1.5,
            label=rf"spectrum: $\alpha$ = {s['alpha']:.2f}, $\beta$ = {s['beta']:.2f}",
            gid="guide:data",
        )
        resid.semilogx(
            ts[keep], np.log(loss[keep] / model[keep]), "C2:", label="data / spectrum"
        )
    if "forecast" in curves:
        plot_forecast(curves["forecast"], ax=ax)
    resid.axhline(0.0, color="k", lw=0.8)
    ax.set_ylabel("loss")
    ax.set_title("Loss curve analysis")
    ax.legend(fontsize=8)
    ax.tick_params(labelbottom=False)
    resid.set_xlabel("t (steps)")
    resid.set_ylabel("ln(data / model)")
    if resid.lines[:-1]:
        resid.legend(fontsize=7)
    return fig


def plot_forecast(fc, ts=None, loss=None, truth=None, *, ax=None):
    """A `Forecast` on log-log axes: the forecast loss, its band and the next
    switch-on times; optionally the observed prefix `(ts, loss)` and the true
    continuation `truth = (t, loss)` to compare with.

    **Arguments:**

    - `fc`: the `Forecast`.
    - `ts`, `loss`: the observed prefix, shape `(T,)` (optional).
    - `truth`: `(t, loss)`, the curve actually run (optional).
    - `ax`: an axes to draw into (default: a new figure).

    **Returns:** the figure drawn into.
    """
    if ax is None:
        fig = Figure(figsize=(6.4, 4.6), layout="constrained")
        ax = fig.subplots()
        ax.set_xlabel("t (steps)")
        ax.set_ylabel("loss")
        ax.set_title("Forecast")
    if ts is not None:
        ax.loglog(
            *positive_part(np.asarray(ts), np.asarray(loss)),
            "k-",
            lw=2.2,
            alpha=0.7,
            label="observed",
        )
    if truth is not None:
        ax.loglog(*positive_part(*map(np.asarray, truth)), "k:", lw=1.4, label="truth")
    if fc.found:
        ft = np.asarray(fc.ts)
        ax.fill_between(
            ft,
            np.asarray(fc.lower),
            np.asarray(fc.upper),
            color="C3",
            alpha=0.15,
            label="forecast band",
        )
        ax.loglog(ft, np.asarray(fc.loss), "C3-", lw=1.2, label="forecast")
        for i, t_on in enumerate(np.asarray(fc.switch_on_times)):
            label = "next switch-ons" if i == 0 else None
            ax.axvline(t_on, color="C3", lw=0.8, ls="--", label=label)
    ax.legend(fontsize=8)
    return ax.figure


def _plateaus(ax, pl):
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
        ax.axvline(td, color="C1", lw=0.8, ls=":", label="drops" if i == 0 else None)


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
