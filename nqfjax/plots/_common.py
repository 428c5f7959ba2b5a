"""What every figure shares: the colour and line-style cycle, writing a figure,
and the positive part of a curve that a log-log axis can show."""

import matplotlib as mpl
import numpy as np

from ..io import write_figure


_COLOURS = mpl.rcParams["axes.prop_cycle"].by_key()["color"]
_STYLES = ["-", "--", ":", "-."]


def _save(fig, path) -> None:
    if path is not None:
        write_figure(path, fig)


def _colour(i: int) -> str:
    return _COLOURS[i % len(_COLOURS)]


def _positive(t, y):
    """`(t, y)` where both are positive and finite (what a log-log plot shows)."""
    t, y = np.asarray(t, float), np.asarray(y, float)
    keep = np.isfinite(t) & np.isfinite(y) & (t > 0) & (y > 0)
    return t[keep], y[keep]


def _log_interp(x, xp, yp):
    """`yp(x)` interpolated linearly in log-log (`xp` increasing, all positive)."""
    return np.exp(np.interp(np.log(x), np.log(xp), np.log(yp)))
