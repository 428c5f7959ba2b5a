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

import importlib
from typing import TYPE_CHECKING


# matplotlib is imported when a figure is first asked for, not with `nqfjax`: the
# two submodules load on the first attribute access below.
if TYPE_CHECKING:
    from ._curves import (
        plot_curve_analysis as plot_curve_analysis,
        plot_forecast as plot_forecast,
        plot_prediction as plot_prediction,
        plot_sweep as plot_sweep,
    )
    from ._demo import (
        plot_init_scale as plot_init_scale,
        plot_loss_curves as plot_loss_curves,
        plot_power_law as plot_power_law,
        plot_structures as plot_structures,
    )

_WHERE = {
    "plot_curve_analysis": "._curves",
    "plot_forecast": "._curves",
    "plot_prediction": "._curves",
    "plot_sweep": "._curves",
    "plot_init_scale": "._demo",
    "plot_loss_curves": "._demo",
    "plot_power_law": "._demo",
    "plot_structures": "._demo",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    try:
        where = _WHERE[name]
    except KeyError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    value = getattr(importlib.import_module(where, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE))
