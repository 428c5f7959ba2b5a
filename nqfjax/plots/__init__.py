r"""Figures: loss curves with switch-on times and the staircase, init-scale sweeps,
power laws, structure matrices, sweeps and a user's loss curve.

Each function takes plain arrays, draws one figure, writes it to `path` (PNG,
atomically) when given, and returns the `matplotlib.figure.Figure`. They never call
a solver themselves.

Figures are built with matplotlib's object API (`matplotlib.figure.Figure`), never
through pyplot: nothing here opens, registers or closes a pyplot figure, so the
figures of a notebook or script that calls into nqfjax are left alone.

What a reader relies on is kept checkable: every axis is labelled, every legend
entry is distinct, and a line drawn as a guide to the data carries the `gid`
`"guide:NAME"` when it passes through the data line of `gid` `"data:NAME"`, or
`"offset:NAME:FACTOR"` when it is drawn `FACTOR` times above it at the middle of
its range (its label then says so). Where agreement is the point, a panel below
shows the ratio or the residual.
"""

from ._curves import (
    plot_curve_analysis,
    plot_forecast,
    plot_prediction,
    plot_sweep,
)
from ._demo import (
    plot_init_scale,
    plot_loss_curves,
    plot_power_law,
    plot_structures,
)


__all__ = [
    "plot_curve_analysis",
    "plot_forecast",
    "plot_init_scale",
    "plot_loss_curves",
    "plot_power_law",
    "plot_prediction",
    "plot_structures",
    "plot_sweep",
]
