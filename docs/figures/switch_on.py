"""Draw `docs/images/switch_on.png`, the theory pages' figure of one mode
switching on: `solve_lv` of a single mode from three initial sizes against the
logistic closed form, with `switch_on_times`, in steps and in rescaled time.

Run from the repository root: `python docs/figures/switch_on.py`."""

from pathlib import Path

import jax
import matplotlib


matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

import nqfjax  # noqa: E402


jax.config.update("jax_enable_x64", True)
OUT = Path(__file__).resolve().parents[1] / "images" / "switch_on.png"
R, M_STAR = 0.5, 1.0  # one mode: growth rate r and learned value m* = r / B


def main() -> None:
    lv = nqfjax.LotkaVolterra(np.array([R]), np.array([[R / M_STAR]]))
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4.2))
    colors = plt.cm.Blues(np.linspace(0.45, 1.0, 3))
    for eps, color in zip((1e-3, 1e-6, 1e-12), colors):
        log_inv = np.log(1 / eps)
        ts = np.linspace(0.0, 1.4 * log_inv / R, 400)
        m = np.asarray(nqfjax.solve_lv(lv, np.array([eps]), ts).ys)[:, 0]
        closed = M_STAR / (1 + (M_STAR / eps - 1) * np.exp(-R * ts))
        t_k = float(nqfjax.switch_on_times(lv, np.array([eps]))[0])
        label = rf"$\epsilon$ = {eps:g}"
        ax.plot(ts, m / M_STAR, color=color, lw=2.5, label=label + " (solve_lv)")
        ax.plot(ts, closed / M_STAR, "k:", lw=1)
        ax.axvline(t_k, color=color, ls="--", lw=1)
        bx.plot(ts / log_inv, m / M_STAR, color=color, lw=2.5, label=label)
    ax.plot([], [], "k:", label="logistic closed form")
    ax.plot([], [], "k--", lw=1, label="switch-on time $t_k$ (switch_on_times)")
    ax.axhline(0.5, color="0.6", lw=0.8)
    ax.set(
        xlabel="t (flow time)",
        ylabel="$m_k(t) / m^*_k$",
        title=rf"One mode switching on ($r_k$ = {R}): logistic, half-way at $t_k$",
    )
    ax.legend(fontsize=8, loc="center right")
    tau = np.linspace(0, 1.4 / R, 200)
    bx.plot(tau, (tau >= 1 / R).astype(float), "k", lw=1.2, label="singular limit")
    bx.set(
        xlabel=r"rescaled time $\tau = t / \ln(1/\epsilon)$",
        ylabel="$m_k / m^*_k$",
        title=r"In rescaled time: a step at $\tau_k = 1/r_k$ as $\epsilon \to 0$",
    )
    bx.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(OUT, dpi=100)
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
