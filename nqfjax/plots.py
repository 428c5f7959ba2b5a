"""Figures: loss curves with switch-on times, the staircase, init-scale sweeps,
power laws and structure matrices.

Each function takes plain arrays, draws one figure, writes it to `path` (PNG) and
returns the `matplotlib.figure.Figure`. They never call a solver themselves.
"""

from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
import numpy as np


_COLOURS = plt.rcParams["axes.prop_cycle"].by_key()["color"]


def _save(fig, path) -> None:
    if path is not None:
        fig.savefig(path, dpi=110, bbox_inches="tight")


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
    fig, axes = plt.subplots(1, ncols, figsize=(6.2 * ncols, 4.4), squeeze=False)
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
    fig.tight_layout()
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
    fig, ax = plt.subplots(figsize=(6.2, 4.4))
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
    fig.tight_layout()
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
    fig, ax = plt.subplots(figsize=(6.2, 4.4))
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
    fig.tight_layout()
    _save(fig, path)
    return fig


def plot_structures(matrices: Mapping[str, np.ndarray], *, path=None):
    """Heatmaps of one structure matrix `A_0(x)` (shape `(p, p)`) per architecture,
    on a symmetric colour scale."""
    names = list(matrices)
    ncols = min(3, len(names))
    nrows = -(-len(names) // ncols)
    fig, axes = plt.subplots(
        nrows, ncols, figsize=(3.6 * ncols, 3.4 * nrows), squeeze=False
    )
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
    fig.tight_layout()
    _save(fig, path)
    return fig
