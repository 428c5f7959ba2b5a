"""What every figure shares: the colour and line-style cycle, fixed margins,
writing a figure, and the positive part of a curve that a log-log axis can show."""

import matplotlib as mpl
import numpy as np
from matplotlib.font_manager import FontProperties
from matplotlib.textpath import text_to_path

from ..io import write_figure


_COLOURS = mpl.rcParams["axes.prop_cycle"].by_key()["color"]
_STYLES = ["-", "--", ":", "-."]


def _save(fig, path) -> None:
    if path is not None:
        write_figure(path, fig)


def _grid(fig, nrows=1, ncols=1, *, left, right, bottom, top, hgap=0.0, wgap=0.0, **kw):
    """A `GridSpec` whose margins and gaps are given in inches.

    The demo's figures use fixed margins instead of a layout engine: the
    constrained layout measures every tick label of every axes twice more before
    the figure is drawn, about half of a figure's time. The margins hold the
    tick labels and axis labels those figures draw (checked in the tests: no text
    outside the figure, no two axes' texts overlapping).
    """
    width, height = fig.get_size_inches()
    cell_w = (width - left - right - (ncols - 1) * wgap) / ncols
    cell_h = (height - top - bottom - (nrows - 1) * hgap) / nrows
    return fig.add_gridspec(
        nrows,
        ncols,
        left=left / width,
        right=1 - right / width,
        bottom=bottom / height,
        top=1 - top / height,
        wspace=wgap / cell_w,
        hspace=hgap / cell_h,
        **kw,
    )


def _text_inches(text: str, size: float) -> tuple[float, float]:
    """Width and height (with descent) of one line of plain `text` at `size`
    points, in inches."""
    w, h, d = text_to_path.get_text_width_height_descent(
        text, FontProperties(size=size), ismath=False
    )
    return w / 72, (h + d) / 72


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
