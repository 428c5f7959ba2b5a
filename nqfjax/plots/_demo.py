"""The demo's figures: the engines' loss curves with the staircase, the
init-scale sweep, the power law and the structure matrices."""

from collections.abc import Mapping, Sequence

import numpy as np
from matplotlib.figure import Figure

from ._common import (
    STYLES,
    cycle_colour,
    figure_grid,
    fit_y_labels,
    log_interp,
    log_ticks,
    positive_part,
    save_png,
    text_inches,
)


def _title_inches(*titles: str) -> float:
    """The top margin, in inches, above axes with these titles (default size).

    The titles are set at `y=1.0`, on the axes (their tick labels are below):
    left to place itself, a title measures every tick label of its axes at each
    draw, in case a y offset text is in its way."""
    lines = max(t.count("\n") + 1 for t in titles)
    return 0.06 + 0.24 * lines


def plot_loss_curves(
    curves: Mapping[str, tuple[np.ndarray, np.ndarray]],
    *,
    switch_times: Sequence[float] = (),
    rescaled: Mapping[str, tuple[np.ndarray, np.ndarray]] | None = None,
    staircase: tuple[np.ndarray, np.ndarray] | None = None,
    reference: str | None = None,
    rescaled_title: str = r"Approach to the staircase as $\varepsilon \to 0$",
    floor: float = 1e-5,
    path=None,
    title: str = "Loss curves",
):
    r"""Loss curves of several engines on one log-log plot, their ratio to a
    reference engine below it and, optionally, curves in rescaled time beside the
    singular-limit staircase.

    **Arguments:**

    - `curves`: label -> `(t, loss)` on one grid of times, e.g. W-space, M-space
      and Lotka-Volterra.
    - `switch_times`: predicted switch-on times, drawn as vertical lines.
    - `rescaled`: label -> `(tau, loss)` with `tau = t / ln(1/eps)`, e.g. LV
      curves at shrinking `eps`, drawn on a second panel; say in the labels how
      `eps` relates to the init scale.
    - `staircase`: `(tau, loss)` of the singular limit, drawn on that panel,
      whose axis ends shortly after the staircase's last step.
    - `reference`: the label of `curves` the others are divided by in the ratio
      panel (default: the last one).
    - `rescaled_title`: the second panel's title.
    - `floor`: the loss axes start at `floor` times the largest loss.
    """
    second = bool(rescaled) or staircase is not None
    fig = Figure(figsize=(12.4 if second else 6.4, 6.4))
    grid = figure_grid(
        fig,
        2,
        2 if second else 1,
        top=_title_inches(title, rescaled_title if second else ""),
        height_ratios=(3, 1.3),
    )
    ax = fig.add_subplot(grid[0, 0])
    ratio = fig.add_subplot(grid[1, 0], sharex=ax)
    top = max(float(np.nanmax(loss)) for _, loss in curves.values())
    reference = list(curves)[-1] if reference is None else reference
    t_ref, L_ref = (np.asarray(a, float) for a in curves[reference])
    for i, (label, (t, loss)) in enumerate(curves.items()):
        tt, ll = positive_part(t, loss)
        kw = dict(color=cycle_colour(i), ls=STYLES[i % 4], lw=max(2.4 - 0.5 * i, 1.0))
        ax.loglog(tt, ll, label=label, gid=f"data:{label}", **kw)
        if label != reference:
            # only where the reference is on the plot: below it, the real
            # network's round-off floor against a loss that keeps falling says
            # nothing about agreement
            keep = (np.asarray(t) > 0) & (L_ref >= floor * top)
            ratio.semilogx(
                np.asarray(t)[keep],
                np.asarray(loss)[keep] / L_ref[keep],
                label=f"{label} / {reference}",
                **kw,
            )
    ratio.axhline(1.0, color="k", lw=0.8)
    for j, ts in enumerate(t for t in switch_times if np.isfinite(t)):
        label = "predicted switch-on" if j == 0 else None
        ax.axvline(ts, color="grey", lw=0.8, ls=":", label=label)
        ratio.axvline(ts, color="grey", lw=0.8, ls=":")
    ax.set_ylim(floor * top, 2 * top)
    ax.set_ylabel("loss")
    ax.set_title(title, y=1.0)  # see _title_inches
    ax.legend(fontsize=8)
    ax.tick_params(labelbottom=False)
    ratio.set_xlabel("t (gradient steps)")
    ratio.set_ylabel("loss ratio")
    ratio.legend(fontsize=7)
    if second:
        _staircase_panel(fig.add_subplot(grid[:, 1]), rescaled, staircase, top, floor)
        fig.axes[-1].set_title(rescaled_title, y=1.0)
    log_ticks(fig)
    fit_y_labels(fig, grid, [[ax, ratio]] + [fig.axes[2:]] * second)
    save_png(fig, path)
    return fig


def _staircase_panel(ax, rescaled, staircase, top, floor):
    """LV curves in rescaled time and the staircase; the axis ends 15% after the
    staircase's last step (or at the curves' end without one)."""
    rescaled = rescaled or {}
    for i, (label, (tau, loss)) in enumerate(rescaled.items()):
        shade = 0.35 + 0.65 * i / max(len(rescaled) - 1, 1)
        ax.semilogy(tau, loss, lw=1.6, color=cycle_colour(0), alpha=shade, label=label)
    end = None
    if staircase is not None:
        tau, level = (np.asarray(a, float) for a in staircase)
        ax.step(tau, level, where="post", color="k", lw=1.4, label="singular limit")
        steps = tau[1:][np.abs(np.diff(level)) > 1e-9 * np.max(np.abs(level))]
        if steps.size:
            end = 1.15 * steps[-1]
    if end is not None:
        ax.set_xlim(0, end)
    ax.set_ylim(floor * top, 2 * top)
    ax.set_xlabel(r"rescaled time $\tau = t / \ln(1/\varepsilon)$")
    ax.set_ylabel("loss")
    ax.legend(fontsize=8)


def plot_init_scale(
    log_inv_sigma: np.ndarray,
    times: np.ndarray,
    predicted_slopes: np.ndarray,
    *,
    predicted_times: np.ndarray | None = None,
    fitted_slopes: np.ndarray | None = None,
    path=None,
):
    r"""Measured switch-on times against `ln(1/sigma)`, one colour per mode, with
    the theory's times and the ratio of the two below.

    With `predicted_times` the lines are the theory's switch-on times at each
    init scale (nothing fitted); without them, lines of the predicted slopes
    `2/r_k` through the measured means (said in the legend), and no ratio panel.

    **Arguments:**

    - `log_inv_sigma`: shape `(S,)`.
    - `times`: measured switch-on times, shape `(S, K)`.
    - `predicted_slopes`: `2/r_k`, shape `(K,)`.
    - `predicted_times`: the theory's switch-on times, shape `(S, K)`.
    - `fitted_slopes`: the measured slopes, shape `(K,)`, shown in the legend.
    """
    x = np.asarray(log_inv_sigma, float)
    times = np.asarray(times, float)
    fig = Figure(figsize=(6.4, 6.0 if predicted_times is not None else 4.4))
    top = _title_inches("")
    if predicted_times is None:
        grid = figure_grid(fig, top=top)
        ax, ratio = fig.add_subplot(grid[0]), None
    else:
        grid = figure_grid(fig, 2, 1, top=top, height_ratios=(3, 1.3))
        ax = fig.add_subplot(grid[0])
        ratio = fig.add_subplot(grid[1], sharex=ax)
    order = np.argsort(x)
    for k in range(times.shape[1]):
        c = cycle_colour(k)
        label = f"mode {k}: measured"
        if fitted_slopes is not None:
            label += f" (slope {fitted_slopes[k]:.3g})"
        ax.plot(x, times[:, k], "o", color=c, label=label, gid=f"data:mode {k}")
        if predicted_times is not None:
            ax.plot(
                x[order],
                np.asarray(predicted_times)[order, k],
                "-",
                color=c,
                lw=1,
                label=f"mode {k}: theory (slope 2/r = {predicted_slopes[k]:.3g})",
            )
            ratio.plot(
                x, times[:, k] / np.asarray(predicted_times)[:, k], "o-", color=c
            )
            continue
        ok = np.isfinite(times[:, k])
        if ok.any():
            x0, y0 = x[ok].mean(), times[ok, k].mean()
            ax.plot(
                x[order],
                y0 + predicted_slopes[k] * (x[order] - x0),
                "-",
                color=c,
                lw=1,
                label=f"mode {k}: slope 2/r = {predicted_slopes[k]:.3g} "
                "through the measured mean",
            )
    ax.set_ylabel("switch-on time (steps)")
    ax.set_title(r"Switch-on times grow like $(2/r_k)\,\ln(1/\sigma)$", y=1.0)
    ax.legend(fontsize=7)
    bottom = ax
    if ratio is not None:
        ratio.axhline(1.0, color="k", lw=0.8)
        ratio.set_ylabel("measured / theory")
        ax.tick_params(labelbottom=False)
        bottom = ratio
    bottom.set_xlabel(r"$\ln(1/\sigma)$ ($\sigma$: init scale)")
    fit_y_labels(fig, grid, [fig.axes])
    save_png(fig, path)
    return fig


def _local_exponent(t, loss, factor: float = 2.0):
    """`-d ln L / d ln t` of a positive curve, as the log-log slope between
    `t / sqrt(factor)` and `t * sqrt(factor)`: a staircase of many small steps
    reads as the power law it follows, not as a spike at each step."""
    tp, lp = positive_part(t, loss)
    half = np.sqrt(factor)
    t = tp[(tp / half >= tp[0]) & (tp * half <= tp[-1])]
    rise = np.log(log_interp(t * half, tp, lp) / log_interp(t / half, tp, lp))
    return t, -rise / np.log(factor)


def plot_power_law(
    t: np.ndarray,
    loss: np.ndarray,
    *,
    window: tuple[float, float],
    gamma_fit: float,
    gamma_rich: float,
    gamma_lazy: float,
    fit: tuple[np.ndarray, np.ndarray] | None = None,
    sharp: tuple[np.ndarray, np.ndarray] | None = None,
    offset: float = 3.0,
    path=None,
):
    r"""A loss curve with many modes, the fitting window and the exponents, with
    the local exponent $-d\ln L / d\ln t$ below.

    The fitted curve (`fit`) is drawn through the data; the theory's slopes
    `-gamma_rich` and `-gamma_lazy` are guides drawn `offset` times above the data
    at the window's middle (said in their labels), so that they do not hide the
    data. The lower panel shows the local exponent of the data (and of the
    sharp-switch sum) against the three exponents as horizontal lines: where the
    curves are flat inside the window, the fit is a power law.

    **Arguments:**

    - `t`, `loss`: the curve, shape `(R,)`.
    - `window`: `(t_lo, t_hi)` of the fit.
    - `gamma_fit`, `gamma_rich`, `gamma_lazy`: the fitted and predicted exponents.
    - `fit`: `(t, fitted loss)` of the fitted curve, drawn through the data.
    - `sharp`: `(t, loss)` of the sharp-switch sum.
    - `offset`: how far above the data the theory slopes are drawn (> 1).
    """
    tt, ll = positive_part(t, loss)
    fig = Figure(figsize=(6.6, 6.4))
    grid = figure_grid(fig, 2, 1, top=_title_inches(""), height_ratios=(3, 1.6))
    ax = fig.add_subplot(grid[0])
    slope = fig.add_subplot(grid[1], sharex=ax)
    ax.loglog(tt, ll, lw=2.4, color=cycle_colour(0), label="Lotka-Volterra simulation")
    ax.lines[-1].set_gid("data:simulation")
    if sharp is not None:
        ax.loglog(*positive_part(*sharp), "--", color=cycle_colour(1), lw=1.2)
        ax.lines[-1].set_label("refined sharp-switch sum")
    lo, hi = window
    for a in (ax, slope):
        a.axvspan(lo, hi, color="grey", alpha=0.12)
    ax.patches[-1].set_label("fitting window")
    if fit is not None:
        ft, fl = positive_part(*fit)
        ax.loglog(
            ft,
            fl,
            "k-",
            lw=1.2,
            label=rf"fit: $\gamma$ = {gamma_fit:.3f}",
            gid="guide:simulation",
        )
    _theory_slopes(ax, tt, ll, window, gamma_rich, gamma_lazy, offset)
    ax.set_ylabel("loss")
    ax.set_title(r"Power law $L \sim t^{-\gamma}$ from many modes", y=1.0)
    ax.legend(fontsize=7)
    ax.tick_params(labelbottom=False)
    _local_exponents(slope, tt, ll, window, sharp, (gamma_fit, gamma_rich, gamma_lazy))
    log_ticks(fig)
    fit_y_labels(fig, grid, [[ax, slope]])
    save_png(fig, path)
    return fig


def _theory_slopes(ax, tt, ll, window, gamma_rich, gamma_lazy, offset) -> None:
    """The theory's slopes as guides over the `window`, `offset` times above the
    data `(tt, ll)` at its middle."""
    lo, hi = window
    tm = np.sqrt(lo * hi)
    lm = log_interp(tm, tt, ll)
    guide_t = np.geomspace(lo, hi, 20)
    for g, style, colour, name in [
        (gamma_rich, "-.", "C3", "rich theory"),
        (gamma_lazy, ":", "C2", "lazy theory"),
    ]:
        ax.loglog(
            guide_t,
            offset * lm * (guide_t / tm) ** (-g),
            style,
            color=colour,
            lw=1.6,
            label=rf"{name}: $\gamma$ = {g:.3f} (slope; offset $\times${offset:g})",
            gid=f"offset:simulation:{offset:g}",
        )


def _local_exponents(slope, tt, ll, window, sharp, gammas) -> None:
    """The lower panel: the local exponent of the data `(tt, ll)` (and of the
    sharp-switch sum) against the fitted, rich and lazy exponents `gammas`,
    scaled to them and to the data's exponents in the `window`."""
    slope.semilogx(
        *_local_exponent(tt, ll), color=cycle_colour(0), lw=2, label="simulation"
    )
    if sharp is not None:
        slope.semilogx(
            *_local_exponent(*sharp),
            "--",
            color=cycle_colour(1),
            lw=1.2,
            label="sharp-switch sum",
        )
    for g, style, colour, name in zip(
        gammas, ["-", "-.", ":"], ["k", "C3", "C2"], ["fit", "rich", "lazy"]
    ):
        if np.isfinite(g):  # a refused fit (no power law) has no line
            slope.axhline(g, ls=style, color=colour, lw=1, label=rf"$\gamma$ {name}")
    lo, hi = window
    te, ge = _local_exponent(tt, ll)
    gs = list(gammas) + list(ge[(te >= lo) & (te <= hi)])
    gs = [g for g in gs if np.isfinite(g)]
    pad = 0.15 * (max(gs) - min(gs) + 0.1)
    slope.set_ylim(min(gs) - pad, max(gs) + pad)
    slope.set_xlabel("t (gradient steps)")
    slope.set_ylabel(r"local exponent $-d\ln L/d\ln t$")
    slope.legend(fontsize=7, ncols=3, loc="upper right")


def plot_structures(
    matrices: Mapping[str, np.ndarray],
    *,
    blocks: Mapping[str, Sequence[tuple[str, int]]] | None = None,
    path=None,
):
    r"""Heatmaps of one structure matrix `A_0(x)` (shape `(p, p)`) per
    architecture, each divided by its largest absolute entry (stated in its
    title) so that one colour scale, from -1 to 1, serves them all.

    **Arguments:**

    - `matrices`: name -> `A_0(x)`, shape `(p, p)`.
    - `blocks`: name -> the blocks of a unit's parameters in order, as
      `(label, size)` pairs summing to `p` (e.g. `[("a", k), ("u", d)]` for a
      perceptron): drawn as lines between blocks and named on the axes. Without
      them, every parameter index is a tick.
    """
    names = list(matrices)
    ncols = min(3, len(names))
    nrows = -(-len(names) // ncols)
    parts = {}
    for name in names:
        p = np.shape(matrices[name])[0]
        parts[name] = (blocks or {}).get(name) or [(str(i), 1) for i in range(p)]
        if (total := sum(size for _, size in parts[name])) != p:
            raise ValueError(f"`blocks[{name!r}]` sizes sum to {total}, not p = {p}.")
    fig = Figure(figsize=(3.9 * ncols + 0.8, 3.6 * nrows))
    axes, bar = _structure_axes(fig, [parts[name] for name in names], ncols, blocks)
    for ax, name in zip(axes, names):
        A = np.asarray(matrices[name], float)
        scale = float(np.max(np.abs(A))) or 1.0
        image = ax.imshow(A / scale, cmap="RdBu_r", vmin=-1, vmax=1)
        ax.set_title(
            f"{name}\np = {A.shape[0]}, max |A| = {scale:.3g}", fontsize=8, y=1.0
        )
        edges = np.cumsum([0] + [size for _, size in parts[name]])
        centres = 0.5 * (edges[:-1] + edges[1:]) - 0.5
        labels = [label for label, _ in parts[name]]
        ax.set_xticks(centres, labels, fontsize=7, rotation=30 if blocks else 0)
        ax.set_yticks(centres, labels, fontsize=7)
        for e in edges[1:-1]:
            ax.axhline(e - 0.5, color="k", lw=0.6)
            ax.axvline(e - 0.5, color="k", lw=0.6)
        ax.set_xlabel("parameter block of a unit", fontsize=7)
        ax.set_ylabel("parameter block of a unit", fontsize=7)
    fig.colorbar(image, cax=bar, label=r"$A_0(x)\,/\,\max|A_0(x)|$")
    height = fig.get_size_inches()[1]
    fig.suptitle(
        r"Structure matrices $A(x)$ for one input (first output)",
        y=1 - 0.08 / height,
    )
    save_png(fig, path)
    return fig


def _structure_axes(fig, parts, ncols, rotated):
    """One axes per matrix on a grid of `ncols` columns, and a colour bar's axes
    at the right, placed in inches: each column leaves room on its left for its
    widest block label (7 pt), each row below it for its tallest one (rotated by
    30 degrees when `rotated`), each map for a two-line title above it."""
    width, height = fig.get_size_inches()
    nrows = -(-len(parts) // ncols)
    # the widest and tallest tick label of each map, in inches
    sizes = [np.max([text_inches(label, 7) for label, _ in p], axis=0) for p in parts]
    sizes += [np.zeros(2)] * (nrows * ncols - len(parts))
    sizes = np.reshape(sizes, (nrows, ncols, 2))
    w, h = sizes[..., 0], sizes[..., 1]
    below = w * np.sin(np.pi / 6) + h * np.cos(np.pi / 6) if rotated else h
    # tick (3.5 pt) and pad (3.5 pt), then the 7 pt axis label and its pad
    left = w.max(axis=0) + 0.1 + 0.2 + 0.05
    bottom = below.max(axis=1) + 0.1 + 0.2 + 0.05
    top, right, title = 0.38, 1.4, 0.45
    cell_w = (width - left.sum() - right) / ncols
    cell_h = (height - title - nrows * top - bottom.sum()) / nrows
    axes = []
    for k in range(len(parts)):
        i, j = divmod(k, ncols)
        x = left[: j + 1].sum() + j * cell_w
        y = height - title - (i + 1) * (top + cell_h) - bottom[:i].sum()
        axes.append(
            fig.add_axes((x / width, y / height, cell_w / width, cell_h / height))
        )
    grid_h = height - title - bottom[-1]
    bar = fig.add_axes(
        (
            (width - right + 0.3) / width,
            (bottom[-1] + 0.2 * grid_h) / height,
            0.28 / width,
            0.6 * grid_h / height,
        ),
        label="<colorbar>",
    )
    return axes, bar
