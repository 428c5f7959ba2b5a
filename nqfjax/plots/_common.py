"""What every figure shares (a private module whose names the figures import):
the colour and line-style cycle, fixed margins, writing a figure, and the
positive part of a curve that a log-log axis can show."""

import re

import matplotlib as mpl
import numpy as np
from matplotlib import cbook
from matplotlib.font_manager import FontProperties
from matplotlib.textpath import text_to_path
from matplotlib.ticker import LogFormatterSciNotation, LogLocator

from ..io import write_figure


_COLOURS = mpl.rcParams["axes.prop_cycle"].by_key()["color"]
STYLES = ["-", "--", ":", "-."]


def save_png(fig, path) -> None:
    if path is not None:
        write_figure(path, fig)


def figure_grid(fig, nrows=1, ncols=1, *, top, right=0.15, bottom=0.5, hgap=0.15, **kw):
    """A `GridSpec` whose right, bottom and top margins and row gap are given in
    inches (the defaults are those of the demo's figures); its left margin and
    column gap are set by `fit_y_labels` once the axes' limits are known.

    The demo's figures are placed this way instead of by a layout engine: the
    constrained layout measures every tick label of every axes twice more before
    the figure is drawn, about half of a figure's time. The tests check that no
    text is outside the figure and no two axes' texts overlap.
    """
    width, height = fig.get_size_inches()
    cell_h = (height - top - bottom - (nrows - 1) * hgap) / nrows
    return fig.add_gridspec(
        nrows,
        ncols,
        right=1 - right / width,
        bottom=bottom / height,
        top=1 - top / height,
        hspace=hgap / cell_h,
        **kw,
    )


def text_inches(text: str, size: float) -> tuple[float, float]:
    """Width and height (with descent) of one line of `text` (mathtext if it
    has any) at `size` points, in inches."""
    w, h, d = text_to_path.get_text_width_height_descent(
        text, FontProperties(size=size), ismath=cbook.is_math_text(text)
    )
    return w / 72, (h + d) / 72


def _y_label_inches(ax) -> float:
    """How far left of `ax` its y tick labels and y label reach, in inches, at
    its current limits: the widest label its locators and formatters give, the
    tick and pads, and the (rotated) y label's height."""
    lo, hi = sorted(ax.get_ylim())
    rc = mpl.rcParams
    size = FontProperties(size=rc["ytick.labelsize"]).get_size_in_points()
    widest = 0.0
    for locator, formatter in [
        (ax.yaxis.get_major_locator(), ax.yaxis.get_major_formatter()),
        (ax.yaxis.get_minor_locator(), ax.yaxis.get_minor_formatter()),
    ]:
        for label in formatter.format_ticks([x for x in locator() if lo <= x <= hi]):
            widest = max(widest, text_inches(label, size)[0])
    ylabel = ax.yaxis.label
    height = (
        text_inches(ylabel.get_text(), ylabel.get_size())[1] if ylabel.get_text() else 0
    )
    pads = rc["ytick.major.size"] + rc["ytick.major.pad"] + rc["axes.labelpad"]
    return widest + pads / 72 + height


def fit_y_labels(fig, grid, columns, *, edge: float = 0.08, gap: float = 0.15):
    """Set `grid`'s left margin and column gap to what the y tick labels and y
    labels of `columns` (the axes of each grid column) need, plus `edge` inches
    at the figure's edge and `gap` between columns, and move the axes there."""
    width = fig.get_size_inches()[0]
    need = [max(_y_label_inches(ax) for ax in column) for column in columns]
    left, wgap = need[0] + edge, max(need[1:], default=0.0) + gap
    right = (1 - grid.right) * width
    cell_w = (width - left - right - (len(columns) - 1) * wgap) / len(columns)
    grid.update(left=left / width, wspace=wgap / cell_w)
    for ax in fig.axes:  # `update` moves only the axes of pyplot's figures
        spec = ax.get_subplotspec()
        if spec is not None and spec.get_gridspec() is grid:
            ax.set_position(spec.get_position(fig))


_DECADE = re.compile(r"\$\\mathdefault\{(-?10)\^\{(-?\d+)\}\}\$")
_SUPERSCRIPT = str.maketrans(
    "-0123456789", "\u207b\u2070\u00b9\u00b2\u00b3\u2074\u2075\u2076\u2077\u2078\u2079"
)


class _DecadeFormatter(LogFormatterSciNotation):
    """Matplotlib's log tick labels, with a power of ten written as `10` and a
    Unicode exponent (`10⁻⁵`) instead of mathtext: the same look, without a
    mathtext parse (about 8 ms) for each label of each figure."""

    def __call__(self, x, pos=None):
        label = super().__call__(x, pos)
        match = _DECADE.fullmatch(label)
        if match is None:
            return label
        return match[1].replace("-", "\u2212") + match[2].translate(_SUPERSCRIPT)


def log_ticks(fig, max_decades: float = 3.0) -> None:
    """The ticks of each log axis of `fig`, at its final limits: decades
    labelled by `_DecadeFormatter` and, where the axis spans more than
    `max_decades` decades, minor ticks at 2 and 5 times each power of ten only.

    Eight minor ticks a decade are too close to read there, and each is an
    object matplotlib builds, places and draws: on the demo's loss figures they
    were about a third of the figure's time."""
    for ax in fig.axes:
        for axis, limits in ((ax.xaxis, ax.get_xlim()), (ax.yaxis, ax.get_ylim())):
            if axis.get_scale() != "log":
                continue
            axis.set_major_formatter(_DecadeFormatter())
            lo, hi = sorted(limits)
            if np.log10(hi / lo) > max_decades:
                axis.set_minor_locator(LogLocator(subs=(2.0, 5.0)))


def cycle_colour(i: int) -> str:
    return _COLOURS[i % len(_COLOURS)]


def positive_part(t, y):
    """`(t, y)` where both are positive and finite (what a log-log plot shows)."""
    t, y = np.asarray(t, float), np.asarray(y, float)
    keep = np.isfinite(t) & np.isfinite(y) & (t > 0) & (y > 0)
    return t[keep], y[keep]


def log_interp(x, xp, yp):
    """`yp(x)` interpolated linearly in log-log (`xp` increasing, all positive)."""
    return np.exp(np.interp(np.log(x), np.log(xp), np.log(yp)))
