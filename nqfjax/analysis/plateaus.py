"""Plateaus and drops of a measured loss curve (`detect_plateaus`)."""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Float

from .._checks import eager_only
from .._curves import first_crossing, loglog_slope
from ._least_squares import log_noise
from .stair_reading import StaircasePlateaus, read_plateaus
from .staircase import Staircase, fit_staircase
from .window import window_after_staircase


# ---------------------------------------------------------------------------
# Plateau detection
# ---------------------------------------------------------------------------


class Plateaus(eqx.Module):
    """The plateaus of a measured loss curve (`detect_plateaus`), in time order.

    - `start`, `end`: where each plateau begins and ends (in `t`), shape `(P,)`.
    - `level`: the median loss on each plateau, shape `(P,)`, and its standard
      error `level_err`.
    - `drop`: `level[i] - level[i + 1]`, the size of the drop after plateau `i`,
      shape `(P - 1,)` (negative would mean a rise), and its standard error
      `drop_err`.
    - `drop_times`: when the smoothed loss crosses the middle of each drop,
      `(level[i] + level[i + 1]) / 2`, shape `(P - 1,)`, and its standard error
      `drop_times_err` (the noise of the smoothed level over the steepness of
      the drop, and the grid's resolution).
    - `reason`: why there is no plateau (`""` when there is one).
    - `ambiguous`: where the data cannot tell (`""` when they can): two drops
      closer than their widths (counted as one), a drop no larger than the
      noise (not counted), another number of drops within 10 of BIC, a drop
      wider than a decade (several?), a drop half done outside the data
      that overlaps them, or a fit with one drop more that has a plateau
      across the middle of a drop; the count is then a lower bound.
    """

    start: Float[Array, " P"]
    end: Float[Array, " P"]
    level: Float[Array, " P"]
    drop: Float[Array, " P-1"]
    drop_times: Float[Array, " P-1"]
    level_err: Float[Array, " P"]
    drop_err: Float[Array, " P-1"]
    drop_times_err: Float[Array, " P-1"]
    reason: str = eqx.field(static=True, default="")
    ambiguous: str = eqx.field(static=True, default="")

    def __len__(self) -> int:
        return int(self.level.shape[0])


def _gaussian_smooth(y: np.ndarray, sigma_pts: float) -> np.ndarray:
    """Gaussian smoothing with odd reflection at the ends (keeps end slopes)."""
    if sigma_pts < 0.5:
        return y
    half = min(int(np.ceil(4 * sigma_pts)), y.size - 1)
    x = np.arange(-half, half + 1)
    kernel = np.exp(-0.5 * (x / sigma_pts) ** 2)
    kernel /= kernel.sum()
    left = 2 * y[0] - y[half:0:-1]
    right = 2 * y[-1] - y[-2 : -half - 2 : -1]
    return np.convolve(np.concatenate([left, y, right]), kernel, mode="valid")


def _robust_slope(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """Least-squares slope of `y` on `x` and its standard error, refitted once
    without the points more than 3 robust standard deviations off (spikes)."""
    keep = np.ones(x.size, bool)
    for refit in (False, True):
        if np.count_nonzero(keep) < 3:
            return np.inf, np.inf
        line = loglog_slope(x, y, keep, take_logs=False)
        if not np.isfinite(line.slope):  # all x equal
            return np.inf, np.inf
        if not refit:
            resid = y - line.intercept - line.slope * x
            scale = 1.4826 * np.median(np.abs(resid))
            keep = np.abs(resid) <= 3 * scale + 1e-300
    return float(line.slope), float(line.slope_err)


def detect_plateaus(
    ts: Float[ArrayLike, " T"],
    loss: Float[ArrayLike, " T"],
    *,
    drop_slope: float = 1.0,
    slope_tol: float = 0.15,
    min_length: float = 0.05,
    min_drop: float = 0.1,
    smooth: float = 0.02,
    floor: float | None = None,
    n_grid: int = 1024,
    min_samples: int | None = None,
    method: str = "model",
) -> Plateaus:
    r"""Find the plateaus and drops of a measured loss curve.

    **`method="model"`** (default): a staircase of `K = 1..6` drops, each with
    its own height, position, steepness and asymmetry (from a sigmoid in
    $\log t$ to an isolated mode's logistic in $t$), plus a floor, fitted to
    the log-binned medians of $\ln L$ with `K` chosen by BIC under the
    noise measured from the data (`analysis/staircase.py`); the plateaus are
    read off its fitted curve (`analysis/stair_reading.py`) and checked
    against the data: a drop is a peak of the curve's log-log steepness,
    spanning 20%-80% of its fall in $\ln L$ between the levels where the
    curve is flattest, a drop under `min_drop` or within 4 standard errors
    of the noise is not counted, and a plateau is a stretch before, between
    or after drops with at least 3 samples over `min_length` decades and a
    log-log slope, in the data and on the fitted curve, below
    `min(max(slope_tol, half its neighbouring drops' steepness), 1)` (a
    power law has none). Levels are the medians of the data where the
    fitted curve holds a level, drop times where it crosses each drop's
    middle. Where the data cannot tell (a drop made of several fitted
    modes, two drops without a flat stretch between them, a drop within the
    noise, another `K` within 10 of BIC, a fit with one drop more that has
    a plateau across a drop's middle) `ambiguous` says so. Holds across
    the sharpness of the drops (see the how-to's table of measured rates);
    about a second per curve (two where the noise is correlated).

    **`method="slope"`**: the earlier detector, fast but for sharp drops only
    (a fixed log-log slope threshold `drop_slope`; gentle drops are missed).
    It works in log-log coordinates, where the plateaus of a staircase are
    flat and equally resolved at every time scale:

    1. a robust local level $y = \ln\max(L, \text{floor})$ (in effect a
       log-binning): around each of `n_grid` points in $\log_{10} t$, the median
       of the samples within `smooth` decades, or of the `min_samples` nearest
       where they are sparser (any spacing works, even every SGD step), placed
       at their median log-time; the median removes spikes, the samples'
       spread gives each level a standard error;
    2. a Gaussian of standard deviation `smooth` decades averages the noise;
    3. the log-slope $s = d\ln L / d\ln t$ by finite differences. Drops are
       where $|s| >$ `drop_slope` (a switch-on is steep in log-log), with calm
       gaps shorter than `min_length` inside a drop closed, and a steep run
       changing the level by less than `min_drop` or 4 standard errors dropped
       as noise. The stretches between drops of at least `min_length` decades
       are the candidates;
    4. a candidate is a plateau if it has a flat core: where the slope averaged
       over `min_length` decades is below `2 slope_tol`, and the spike-robust
       least-squares slope of the raw samples there is below `slope_tol` to
       within one standard error and known to better than `slope_tol / 2`;
       between two drops, also where that slope plus its error is below a
       quarter of both drops' mean steepness (a tilted or short plateau; a
       power law's wiggles are as steep as the curve between them). Its level
       is the median of those samples, with its standard error. A curve
       without a drop is one plateau if its log-log slope is below `slope_tol`,
       else none (a power law $t^{-\gamma}$ with `slope_tol` $< \gamma$);
    5. neighbouring plateaus whose levels differ by less than a fraction
       `min_drop` are merged.

    A plateau's `start` and `end` are the ends of its stretch between drops.
    Eager only (numpy): under a JAX transformation it raises a `ValueError`.

    **Arguments:**

    - `ts`: times, shape `(T,)`, strictly increasing and `> 0`.
    - `loss`: the loss at `ts`, shape `(T,)`, finite.
    - `drop_slope`: `|d ln L / d ln t|` above which the curve is dropping
      (default 1; `"slope"` only).
    - `slope_tol`: `|d ln L / d ln t|` below which it is flat (default 0.15).
    - `min_length`: shortest stretch between drops, in decades (default 0.05).
    - `min_drop`: smallest relative change between plateau levels (default 0.1).
    - `smooth`: smoothing width in decades (default 0.02).
    - `floor`: losses below it are raised to it, so that a curve falling to 0
      ends on a plateau at `floor` (default `1e-6 max(loss)`); must be `> 0`.
    - `n_grid`: points of the log-time grid (default 1024).
    - `method`: `"model"` (default) or `"slope"` (see above; `smooth`,
      `n_grid`, `min_samples` and `drop_slope` are the slope detector's).
    - `min_samples`: fewest samples behind each local median (default: from
      the noise, `(sigma / 0.04)^2` clipped to `[3, 9]`, `sigma` the scatter of
      `ln L` between neighbouring samples: a clean curve sampled sparsely at
      early times keeps its first plateaus resolved).

    **Returns:** a `Plateaus` (empty, with its `reason`, where there is none;
    an all-zero loss without a `floor` has none).

    **Raises:** `ValueError` for malformed input (shapes, non-positive or
    non-increasing times, non-finite losses, a negative maximum, a `floor`
    `<= 0`, bad options, an unknown `method`, traced arguments).
    """
    eager_only("detect_plateaus", "the plateaus are found in numpy", ts=ts, loss=loss)
    if method not in ("model", "slope"):
        raise ValueError(f"`method` must be 'model' or 'slope', got {method!r}.")
    ts, loss, floor = _check_plateau_args(
        ts,
        loss,
        drop_slope=drop_slope,
        slope_tol=slope_tol,
        min_length=min_length,
        min_drop=min_drop,
        smooth=smooth,
        floor=floor,
        n_grid=n_grid,
        min_samples=min_samples,
    )
    if floor is None:
        return _no_plateaus(
            "no plateau: the loss is 0 everywhere (nothing to place on a log scale)"
        )
    if method == "model":
        floored = np.maximum(loss, floor)
        _, read = model_plateaus(ts, floored, slope_tol, min_length, min_drop)
        return as_plateaus(read)
    u, floored = np.log10(ts), np.maximum(loss, floor)
    y_raw = np.log(floored)
    sigma = log_noise(y_raw)
    if min_samples is None:
        min_samples = int(np.clip(np.ceil((sigma / 0.04) ** 2), 3, 9))
    grid, y, se = _local_levels(u, y_raw, smooth, int(min_samples), int(n_grid), sigma)
    calm = _calm(grid, y, se, drop_slope, min_length, min_drop)
    found = _flat_stretches(
        u, y_raw, floored, grid, y, calm, slope_tol, min_length, min_drop
    )
    return _plateaus(found, grid, y, se, ts)


def _plateaus(found, grid, y, se, ts) -> Plateaus:
    """The `Plateaus` of the flat stretches `found` on the log-time `grid` (`y`:
    the smoothed log loss, `se` its standard error; `ts`: the data's times)."""
    starts = np.array([10 ** grid[f.first] for f in found])
    ends = np.array([10 ** grid[f.last] for f in found])
    if found:  # a plateau at an end of the grid extends to the end of the data
        if found[0].first == 0:
            starts[0] = ts[0]
        if found[-1].last == grid.size - 1:
            ends[-1] = ts[-1]
    levels = np.array([f.level for f in found])
    level_err = np.array([f.level_err for f in found])
    drop_times, drop_times_err = _drop_times(found, grid, y, se)
    return Plateaus(
        start=jnp.asarray(starts),
        end=jnp.asarray(ends),
        level=jnp.asarray(levels),
        drop=jnp.asarray(levels[:-1] - levels[1:]),
        drop_times=jnp.asarray(drop_times),
        level_err=jnp.asarray(level_err),
        drop_err=jnp.asarray(np.hypot(level_err[:-1], level_err[1:])),
        drop_times_err=jnp.asarray(drop_times_err),
        reason="" if found else "no plateau: no flat stretch of the curve",
    )


def _no_plateaus(reason: str) -> Plateaus:
    empty = jnp.zeros((0,))
    return Plateaus(*([empty] * 8), reason=reason)


def _check_plateau_args(ts, loss, *, floor, n_grid, min_samples, min_drop, **positive):
    """The curve as float64 arrays and the floor (`None` for an all-zero loss),
    or a `ValueError` naming the bad argument."""
    ts = np.asarray(ts, np.float64)
    loss = np.asarray(loss, np.float64)
    if ts.ndim != 1 or ts.shape[0] < 8:
        raise ValueError(f"`ts` must be 1-D with at least 8 samples, got {ts.shape}.")
    if loss.shape != ts.shape:
        raise ValueError(f"`loss` must have shape {ts.shape}, got {loss.shape}.")
    if not (np.all(np.isfinite(ts)) and np.all(ts > 0) and np.all(np.diff(ts) > 0)):
        raise ValueError("`ts` must be finite, > 0 and strictly increasing.")
    if not np.all(np.isfinite(loss)):
        raise ValueError("`loss` contains NaN or inf.")
    for name, value in positive.items():
        if not (np.isfinite(value) and value > 0):
            raise ValueError(f"`{name}` must be > 0, got {value}.")
    if not positive["slope_tol"] < positive["drop_slope"]:
        raise ValueError(
            f"`slope_tol` ({positive['slope_tol']}) must be below `drop_slope` "
            f"({positive['drop_slope']})."
        )
    if not (0 < min_drop < 1):
        raise ValueError(f"`min_drop` must be in (0, 1), got {min_drop}.")
    if int(n_grid) < 16:
        raise ValueError(f"`n_grid` must be >= 16, got {n_grid}.")
    if min_samples is not None and int(min_samples) < 1:
        raise ValueError(f"`min_samples` must be >= 1, got {min_samples}.")
    top = float(np.max(loss))
    if top < 0:
        raise ValueError("`loss` must have a positive maximum (log-scale detection).")
    if floor is not None:
        floor = float(floor)
        if not (np.isfinite(floor) and floor > 0):
            raise ValueError(f"`floor` must be > 0, got {floor}.")
    elif top > 0:
        floor = 1e-6 * top
    return ts, loss, floor


def _local_levels(u, y_raw, smooth, min_samples, n_grid, sigma):
    """Steps 1-2: a robust local level on a grid in log-time, its smoothed
    version and the standard error of each local median.

    Around each point of a grid in log-time, the median of the raw samples
    within `smooth` decades, widened to the `min_samples` nearest where the
    samples are sparser (early times of an every-step record), placed at the
    window's median log-time. The analysis grid spans these centres (no
    extrapolation at the ends, where windows are one-sided); then a Gaussian
    of `smooth` decades with odd-reflected ends (in effect a log-binning: a
    record of every step is reduced to its medians over `smooth` decades).

    **Returns:** `(grid, y, se)`, each of shape `(n_grid,)`."""
    probe = np.linspace(u[0], u[-1], n_grid)
    lo = np.searchsorted(u, probe - smooth, "left")
    hi = np.searchsorted(u, probe + smooth, "right")
    few = hi - lo < min_samples
    centre = np.searchsorted(u, probe[few])
    lo_few = np.clip(centre - min_samples // 2, 0, max(u.size - min_samples, 0))
    lo[few], hi[few] = lo_few, np.minimum(lo_few + min_samples, u.size)
    pairs = sorted({(int(a), int(b)) for a, b in zip(lo, hi)})
    u_c = np.array([np.median(u[a:b]) for a, b in pairs])
    y_c = np.array([np.median(y_raw[a:b]) for a, b in pairs])
    # standard error of each local median, 1.2533 sd / sqrt(n) for Gaussian
    # noise, with the sd from the spread of its samples (1.4826 MAD) where
    # there are at least 9, else from the noise `sigma` of the whole curve
    n_c = np.array([b - a for a, b in pairs])
    spread = np.array(
        [1.4826 * np.median(np.abs(y_raw[a:b] - m)) for (a, b), m in zip(pairs, y_c)]
    )
    se_c = 1.2533 * np.where(n_c >= 9, spread, sigma) / np.sqrt(n_c)
    u_c, keep = np.unique(u_c, return_index=True)
    y_c, se_c = y_c[keep], se_c[keep]
    if u_c.size < 2:
        raise ValueError(
            "Too few samples for the smoothing: give more samples than "
            f"`min_samples` ({min_samples}) spread over time."
        )
    grid = np.linspace(u_c[0], u_c[-1], n_grid)
    du = grid[1] - grid[0]
    y = _gaussian_smooth(np.interp(grid, u_c, y_c), smooth / du)
    return grid, y, np.interp(grid, u_c, se_c)


def _runs(mask):
    """`(first, last)` index of each run of `True` in `mask`."""
    edges = np.diff(np.concatenate([[0], mask.astype(np.int8), [0]]))
    return list(zip(np.flatnonzero(edges == 1), np.flatnonzero(edges == -1) - 1))


def _calm(grid, y, se, drop_slope, min_length, min_drop):
    """Step 3: where the smoothed log-log curve is not dropping, shape
    `(n_grid,)`: its slope `|d ln L / d ln t| <= drop_slope`, with calm gaps
    shorter than `min_length` inside a drop closed (noise can split one drop
    into several steep runs), and a steep run that changes the level by less
    than `min_drop` or than 4 standard errors of the local levels counted as
    calm (a wiggle of the noise)."""
    n_grid = grid.size
    slope = np.gradient(y, grid) / np.log(10)
    calm = np.abs(slope) <= drop_slope
    for a, b in _runs(calm):
        if a > 0 and b < n_grid - 1 and grid[b] - grid[a] < min_length:
            calm[a : b + 1] = False
    for a, b in _runs(~calm):
        before, after = max(a - 1, 0), min(b + 1, n_grid - 1)
        change = abs(y[after] - y[before])
        noise = 4 * np.hypot(se[before], se[after])
        if change < max(-np.log1p(-min_drop), noise):
            calm[a : b + 1] = True
    return calm


class _Found(NamedTuple):
    first: int  # grid indices of the stretch
    last: int
    level: float
    level_err: float


def _flat_stretches(u, y_raw, floored, grid, y, calm, slope_tol, min_length, min_drop):
    """Steps 4-5: the calm stretches with a flat core (`_Found`: grid indices,
    the median loss and its standard error), neighbours at the same level
    merged.

    A stretch of at least `min_length` decades qualifies if it has a core where
    the slope averaged over `min_length` decades is below `2 tol`, and the
    spike-robust least-squares log-log slope of the raw samples of that core is
    below `tol` to within one standard error and known to better than
    `tol / 2` (a noise dip of a power law fails this), `tol` being
    `slope_tol`. Between two drops, a stretch is also a plateau where its slope
    plus its error is below a quarter of both drops' mean steepness (the level
    change over the log-time of the drop): a logistic switch-on in linear time
    leaves a shoulder in log-log (the next mode's loss starts to fall before
    the plateau is flat), and a short plateau has few samples, yet a reader
    marks both; the wiggles of a power law are as steep as the curve between
    them and fail this. Without any drop there is no staircase: the whole
    curve is one plateau if its fitted log-log slope is flat, else there is
    none (a power law)."""
    n_grid = grid.size
    du = grid[1] - grid[0]
    half = max(1, int(round(0.5 * min_length / du)))
    ahead = np.minimum(np.arange(n_grid) + half, n_grid - 1)
    behind = np.maximum(np.arange(n_grid) - half, 0)
    mean_slope = (y[ahead] - y[behind]) / ((grid[ahead] - grid[behind]) * np.log(10))
    drops = _runs(~calm)
    stretches = _runs(calm)
    if calm.all():
        fitted = loglog_slope(u * np.log(10), y_raw, take_logs=False).slope
        stretches = [(0, n_grid - 1)] if abs(fitted) < slope_tol else []
    found: list[_Found] = []
    for a, b in stretches:
        if grid[b] - grid[a] < min_length:
            continue
        # between two drops, a stretch much flatter than both is a plateau even
        # if tilted (a logistic switch-on in linear time leaves a shoulder in
        # log-log) or short: a quarter of the drops' mean steepness
        shoulder = 0.0
        if 0 < a and b < n_grid - 1:
            shoulder = 0.25 * min(
                _mean_steepness(grid, y, *max(r for r in drops if r[1] < a)),
                _mean_steepness(grid, y, *min(r for r in drops if r[0] > b)),
            )
        tol = max(slope_tol, shoulder)
        core = np.flatnonzero(np.abs(mean_slope[a : b + 1]) < 2 * tol)
        if core.size == 0:
            continue
        # the raw samples from the core's first to its last point (a stretch at
        # an end of the grid reaches the end of the data)
        lo = grid[a + core[0]] - du / 2 if a > 0 else u[0]
        hi = grid[a + core[-1]] + du / 2 if b < n_grid - 1 else u[-1]
        inside = (u >= lo) & (u <= hi)
        fit, fit_err = _robust_slope(u[inside] * np.log(10), y_raw[inside])
        flat = abs(fit) < slope_tol + fit_err and 2 * fit_err < slope_tol
        if not (flat or abs(fit) + fit_err < shoulder):
            continue
        samples = np.log(floored[inside])
        level = float(np.exp(np.median(samples)))
        # the median's standard error, 1.2533 sd / sqrt(n), sd from the MAD
        spread = 1.4826 * np.median(np.abs(samples - np.log(level)))
        level_err = level * 1.2533 * spread / np.sqrt(samples.size)
        if found and abs(np.log(level / found[-1].level)) < -np.log1p(-min_drop):
            found[-1] = found[-1]._replace(last=b)
        else:
            found.append(_Found(a, b, level, level_err))
    return found


def _mean_steepness(grid, y, a, b):
    """`|d ln L / d ln t|` averaged over the run `a..b` of the grid (with its
    neighbours): the level change over the log-time the run takes."""
    before, after = max(a - 1, 0), min(b + 1, grid.size - 1)
    return abs(y[after] - y[before]) / ((grid[after] - grid[before]) * np.log(10))


def _drop_times(found, grid, y, se) -> tuple[np.ndarray, np.ndarray]:
    r"""When the smoothed loss crosses the middle of each drop between plateaus
    (the middle of the gap where it does not), shape `(P - 1,)`, and its
    standard error: the local level's error over the slope there,
    $\sigma_{\log t} = \mathrm{se} / |d \ln L / d \log_{10} t|$, with half a
    grid step added in quadrature."""
    du = grid[1] - grid[0]
    slope = np.gradient(y, grid)
    times, errs = [], []
    smooth_loss = np.exp(y)
    for before, after in zip(found[:-1], found[1:]):
        seg = np.arange(before.last, after.first + 1)
        u_mid = first_crossing(
            grid[seg],
            smooth_loss[seg],
            0.5 * (before.level + after.level),
            rising=after.level > before.level,
            interpolate="linear",
            at_start="nan",
        )
        if np.isnan(u_mid):
            u_mid = 0.5 * (grid[before.last] + grid[after.first])
        at = int(np.clip(np.searchsorted(grid, u_mid), 0, grid.size - 1))
        err_u = np.hypot(se[at] / max(abs(slope[at]), 1e-12), du / 2)
        times.append(10**u_mid)
        errs.append(10**u_mid * np.log(10) * err_u)
    return np.asarray(times), np.asarray(errs)


def as_plateaus(read: StaircasePlateaus) -> Plateaus:
    """The `Plateaus` of a staircase's plateaus read off its fit."""
    lev, lev_err = read.level, read.level_err
    return Plateaus(
        start=jnp.asarray(read.start),
        end=jnp.asarray(read.end),
        level=jnp.asarray(lev),
        drop=jnp.asarray(lev[:-1] - lev[1:]),
        drop_times=jnp.asarray(read.drop_times),
        level_err=jnp.asarray(lev_err),
        drop_err=jnp.asarray(np.hypot(lev_err[:-1], lev_err[1:])),
        drop_times_err=jnp.asarray(read.drop_times_err),
        reason=read.reason,
        ambiguous=read.ambiguous,
    )


def model_plateaus(
    ts, loss, slope_tol=0.15, min_length=0.05, min_drop=0.1
) -> tuple[Staircase, StaircasePlateaus]:
    """The staircase model's plateaus of a curve (`ts > 0` increasing, `loss >
    0`, numpy, shape `(T,)`): the staircase fitted to the whole curve, or,
    where it ends falling (`read_plateaus`: a tail after its last drop) and
    has plateaus before a power-law window (`window_after_staircase`),
    refitted to the points before that window only (at least 8), so that the
    tail's power law is not fitted as broad drops that swallow the last
    steps; the refit is kept where it finds as many plateaus or more, with
    `ends_falling`. **Returns:** `(stairs, read)`."""
    stairs = fit_staircase(ts, loss)
    read = read_plateaus(stairs, ts, loss, slope_tol, min_length, min_drop)
    if not (read.ends_falling and read.level.size):
        return stairs, read
    window, _ = window_after_staircase(
        ts, loss, partial(detect_plateaus, method="slope")
    )
    before = ts < window[0] if window is not None else np.zeros(ts.size, bool)
    if before.sum() < 8:
        return stairs, read
    tb, lb = ts[before], loss[before]
    refit = fit_staircase(tb, lb)
    again = read_plateaus(refit, tb, lb, slope_tol, min_length, min_drop)
    if again.level.size < read.level.size:
        return stairs, read
    return refit, again._replace(ends_falling=True)
