"""The window of a loss curve where it falls as a power law (`auto_window`),
moved past a staircase (`window_after_staircase`); used by `fit_power_law`
and `model_plateaus`."""

import numpy as np

from .._curves import loglog_slope


def auto_window(
    t: np.ndarray,
    y: np.ndarray,
    *,
    half_width: float = 0.25,
    tol: float = 0.05,
    n_grid: int = 48,
) -> tuple[float, float] | None:
    """The longest range of `log10 t` over which the local slope of the log-log
    curve stays constant: the power-law regime, excluding an initial plateau or
    staircase and a final floor or finite-size cutoff.

    At each of `n_grid` centres, a least-squares line of `log L` against `log t`
    over the points within `half_width` decades gives the local slope, its
    standard error `se` and the residual scatter `rough`. A range qualifies when

    - every centre is smooth: `rough <= 2 * q + 1e-4` (decades), with `q` the
      lower quartile of `rough` over the decreasing part of the curve; white noise
      has the same scatter everywhere and passes, a resolved staircase of
      switch-ons is far rougher than the merged part and does not;
    - every local slope is within `tol * median + 2 se` of the median slope
      (so noise alone does not end it), and the median is above 0.05 (a flat
      plateau is no power law).

    `None` where the local slope is nowhere above 0.05 (nothing falls)."""
    keep = (t > 0) & (y > 0)
    lt, ly = np.log10(t[keep]), np.log10(y[keep])
    full = (float(t[keep][0]), float(t[keep][-1]))
    if lt.size < 8 or lt[-1] - lt[0] < 4 * half_width:
        return full
    grid = np.linspace(lt[0] + half_width, lt[-1] - half_width, n_grid)
    near = np.abs(lt[None, :] - grid[:, None]) <= half_width  # (n_grid, T)
    local = loglog_slope(lt, ly, near, take_logs=False)
    enough = near.sum(1) >= 4
    slopes = np.where(enough, -local.slope, np.nan)
    errs = np.where(enough, local.slope_err, np.nan)
    rough = np.where(enough, local.rms, np.nan)
    falling = slopes > 0.05
    if not np.any(falling):
        return None
    smooth = rough <= 2 * np.quantile(rough[falling], 0.25) + 1e-4
    best, best_len = None, 2 * half_width  # at least one smoothing window wide
    for i in range(n_grid):
        for j in range(n_grid - 1, i, -1):
            if grid[j] - grid[i] <= best_len:
                break
            seg, err = slopes[i : j + 1], errs[i : j + 1]
            if not (np.all(np.isfinite(seg)) and np.all(smooth[i : j + 1])):
                continue
            med = np.median(seg)
            if med > 0.05 and np.all(np.abs(seg - med) <= tol * med + 2 * err):
                best, best_len = (i, j), grid[j] - grid[i]
                break
    if best is None:
        return full
    lo, hi = grid[best[0]] - half_width, grid[best[1]] + half_width
    inside = (lt >= lo - 1e-12) & (lt <= hi + 1e-12)
    tw = t[keep][inside]
    return float(tw[0]), float(tw[-1])


def window_after_staircase(t, y, plateaus_of):
    """`auto_window` of the curve `(t, y)` (shape `(T,)`), moved past a
    staircase: where a drop between two plateaus of `plateaus_of(t, y)` (a
    `Plateaus`; `fit_power_law` gives the slope detector) falls inside the
    window (a resolved switch-on, which a
    smoothed slope can mistake for part of a power law), the window is sought
    again from the start of the plateau after the last such drop; where the
    last plateau ends inside it (a drop into a power law), from that end.
    **Returns:** `((t_lo, t_hi), "")`, or `(None, reason)` where nothing
    falls as a power law."""
    window = auto_window(t, y)
    pos = t > 0
    if window is not None and pos.sum() >= 8 and np.max(y[pos]) > 0:
        found = plateaus_of(t[pos], y[pos])
        # where the staircase's structure ends: after each drop between two
        # plateaus, the next plateau's start; after the last plateau (unless
        # it is the end of the curve), its end
        edges = list(zip(np.asarray(found.drop_times), np.asarray(found.start)[1:]))
        if len(found) and float(found.end[-1]) < t[-1]:
            edges.append((float(found.end[-1]), float(found.end[-1])))
        inside = [e for e in edges if window[0] < e[0] < window[1]]
        while inside and window is not None:
            after = t >= max(e[1] for e in inside)
            window = auto_window(t[after], y[after]) if after.sum() >= 8 else None
            if window is not None:
                inside = [e for e in edges if window[0] < e[0] < window[1]]
        if window is None:
            return None, (
                f"no power law: a staircase of {len(found)} plateaus, nothing "
                "falling as a power law after its last drop"
            )
    if window is None:
        return None, "no power law: the local log-log slope is nowhere above 0.05"
    return window, ""
