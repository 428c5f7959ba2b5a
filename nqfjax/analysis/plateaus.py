"""Plateaus and drops of a measured loss curve (`detect_plateaus`)."""

from __future__ import annotations

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Float

from .._curves import first_crossing, loglog_slope


# ---------------------------------------------------------------------------
# Plateau detection
# ---------------------------------------------------------------------------


class Plateaus(eqx.Module):
    """The plateaus of a measured loss curve (`detect_plateaus`), in time order.

    - `start`, `end`: where each plateau begins and ends (in `t`), shape `(P,)`.
    - `level`: the median loss on each plateau, shape `(P,)`.
    - `drop`: `level[i] - level[i + 1]`, the size of the drop after plateau `i`,
      shape `(P - 1,)` (negative would mean a rise).
    - `drop_times`: when the smoothed loss crosses the middle of each drop,
      `(level[i] + level[i + 1]) / 2`, shape `(P - 1,)`.
    """

    start: Float[Array, " P"]
    end: Float[Array, " P"]
    level: Float[Array, " P"]
    drop: Float[Array, " P-1"]
    drop_times: Float[Array, " P-1"]

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


def _interp_linear_ends(x, xp, fp):
    """`np.interp`, but extrapolating linearly beyond the ends of `xp`."""
    if xp.size == 1:
        return np.full_like(x, fp[0])
    out = np.interp(x, xp, fp)
    before, after = x < xp[0], x > xp[-1]
    out[before] = fp[0] + (x[before] - xp[0]) * (fp[1] - fp[0]) / (xp[1] - xp[0])
    out[after] = fp[-1] + (x[after] - xp[-1]) * (fp[-1] - fp[-2]) / (xp[-1] - xp[-2])
    return out


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
    min_samples: int = 9,
) -> Plateaus:
    r"""Find the plateaus and drops of a measured loss curve.

    Works in log-log coordinates, where the plateaus of a staircase are flat and
    equally resolved at every time scale:

    1. a robust local level $y = \ln\max(L, \text{floor})$: around each of
       `n_grid` points in $\log_{10} t$, the median of the samples within
       `smooth` decades, or of the `min_samples` nearest where the samples are
       sparser (any spacing works: log-spaced, or every SGD step, which is
       sparse in log-time at early times), placed at the median log-time of
       its samples; the median removes spikes, the spread of the samples gives
       each level a standard error. The analysis grid spans these centres;
    2. a Gaussian of standard deviation `smooth` decades averages the noise;
    3. the log-slope $s = d\ln L / d\ln t$ by finite differences. Drops are
       where $|s| >$ `drop_slope` (a switch-on is steep in log-log: the loss
       falls by O(1) within a fraction of its time), with calm gaps shorter
       than `min_length` inside a drop closed, and a steep run that changes
       the level by less than `min_drop` or than 4 standard errors dropped as
       a wiggle of the noise. The stretches between drops lasting at least
       `min_length` decades are the candidates;
    4. a candidate is a plateau if it has a flat core: where the slope
       averaged over `min_length` decades is below `2 slope_tol`, and where the
       spike-robust least-squares slope of the raw samples (from the first to
       the last core point) is below `slope_tol` to within one standard error
       and known to better than `slope_tol / 2`. Its level is the median of
       those samples. A curve without any drop is one plateau if its fitted
       log-log slope is below `slope_tol`, else it has none (a power law
       $t^{-\gamma}$ with `slope_tol` $< \gamma$);
    5. neighbouring plateaus whose levels differ by less than a fraction
       `min_drop` are merged.

    A plateau's `start` and `end` are the ends of its stretch between drops.
    Runs eagerly in numpy (the number of plateaus depends on the data).

    **Arguments:**

    - `ts`: times, shape `(T,)`, strictly increasing and `> 0`.
    - `loss`: the loss at `ts`, shape `(T,)`, finite.
    - `drop_slope`: `|d ln L / d ln t|` above which the curve is dropping
      (default 1).
    - `slope_tol`: `|d ln L / d ln t|` below which it is flat (default 0.15).
    - `min_length`: shortest stretch between drops, in decades (default 0.05).
    - `min_drop`: smallest relative change between plateau levels (default 0.1).
    - `smooth`: smoothing width in decades (default 0.02).
    - `floor`: losses below it are raised to it, so that a curve falling to 0
      ends on a plateau at `floor` (default `1e-6 max(loss)`); must be `> 0`.
    - `n_grid`: points of the log-time grid (default 1024).
    - `min_samples`: fewest samples behind each local median (default 9).

    **Returns:** a `Plateaus`.

    **Raises:** `ValueError` for malformed input (shapes, non-positive or
    non-increasing times, non-finite losses, a non-positive maximum or `floor`,
    bad options).
    """
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
    options = dict(
        drop_slope=drop_slope, slope_tol=slope_tol, min_length=min_length, smooth=smooth
    )
    for name, value in options.items():
        if not (np.isfinite(value) and value > 0):
            raise ValueError(f"`{name}` must be > 0, got {value}.")
    if not slope_tol < drop_slope:
        raise ValueError(
            f"`slope_tol` ({slope_tol}) must be below `drop_slope` ({drop_slope})."
        )
    if not (0 < min_drop < 1):
        raise ValueError(f"`min_drop` must be in (0, 1), got {min_drop}.")
    top = float(np.max(loss))
    if top <= 0:
        raise ValueError("`loss` must have a positive maximum (log-scale detection).")
    floor = 1e-6 * top if floor is None else float(floor)
    if not (np.isfinite(floor) and floor > 0):
        raise ValueError(f"`floor` must be > 0, got {floor}.")
    n_grid, min_samples = int(n_grid), int(min_samples)
    if n_grid < 16:
        raise ValueError(f"`n_grid` must be >= 16, got {n_grid}.")
    if min_samples < 1:
        raise ValueError(f"`min_samples` must be >= 1, got {min_samples}.")

    u = np.log10(ts)
    y_raw = np.log(np.maximum(loss, floor))
    # 1-2. a robust local level: around each point of a grid in log-time, the
    # median of the raw samples within `smooth` decades, widened to the
    # `min_samples` nearest where the samples are sparser (early times of an
    # every-step record), placed at the window's median log-time. The analysis
    # grid spans these centres (no extrapolation at the ends, where windows are
    # one-sided); then a Gaussian of `smooth` decades with odd-reflected ends
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
    # standard error of each local median, from the spread of its samples
    # (1.4826 MAD estimates a standard deviation, a median's error is 1.2533
    # sd / sqrt(n) for Gaussian noise)
    se_c = np.array(
        [
            1.2533 * 1.4826 * np.median(np.abs(y_raw[a:b] - m)) / np.sqrt(b - a)
            for (a, b), m in zip(pairs, y_c)
        ]
    )
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
    se = np.interp(grid, u_c, se_c)
    # 3. the log-slope; stretches between drops
    slope = np.gradient(y, grid) / np.log(10)
    calm = np.abs(slope) <= drop_slope
    # noise can split one drop into several steep runs: a calm gap shorter than
    # `min_length` between two steep runs is part of the drop
    edges = np.diff(np.concatenate([[0], calm.astype(np.int8), [0]]))
    for a, b in zip(np.flatnonzero(edges == 1), np.flatnonzero(edges == -1) - 1):
        if a > 0 and b < n_grid - 1 and grid[b] - grid[a] < min_length:
            calm[a : b + 1] = False
    # a steep run that changes the level by less than `min_drop`, or by less
    # than 4 standard errors of the local levels, is a wiggle of the noise
    edges = np.diff(np.concatenate([[0], (~calm).astype(np.int8), [0]]))
    for a, b in zip(np.flatnonzero(edges == 1), np.flatnonzero(edges == -1) - 1):
        before, after = max(a - 1, 0), min(b + 1, n_grid - 1)
        change = abs(y[after] - y[before])
        noise = 4 * np.hypot(se[before], se[after])
        if change < max(-np.log1p(-min_drop), noise):
            calm[a : b + 1] = True
    edges = np.diff(np.concatenate([[0], calm.astype(np.int8), [0]]))
    stretches = list(zip(np.flatnonzero(edges == 1), np.flatnonzero(edges == -1) - 1))
    # the slope averaged over `min_length` decades: what "flat" is tested on
    half = max(1, int(round(0.5 * min_length / du)))
    ahead = np.minimum(np.arange(n_grid) + half, n_grid - 1)
    behind = np.maximum(np.arange(n_grid) - half, 0)
    span = (grid[ahead] - grid[behind]) * np.log(10)
    mean_slope = (y[ahead] - y[behind]) / span
    # 4. plateaus: stretches with a flat core. Without any drop there is no
    # staircase: the whole curve is one plateau if its fitted log-log slope is
    # flat, else there is none (a power law)
    if calm.all():
        fitted = loglog_slope(u * np.log(10), y_raw, take_logs=False).slope
        stretches = [(0, n_grid - 1)] if abs(fitted) < slope_tol else []
    found: list[list] = []
    for a, b in stretches:
        if grid[b] - grid[a] < min_length:
            continue
        core = np.flatnonzero(np.abs(mean_slope[a : b + 1]) < 2 * slope_tol)
        if core.size == 0:
            continue
        # certify the core on the raw samples from its first to its last
        # point: their (spike-robust) least-squares log-log slope must be below
        # `slope_tol` to within one standard error, and measured well enough
        # to tell (two standard errors below `slope_tol`); a noise dip of a
        # power law fails this
        # (a stretch at an end of the grid reaches the end of the data)
        lo = grid[a + core[0]] - du / 2 if a > 0 else u[0]
        hi = grid[a + core[-1]] + du / 2 if b < n_grid - 1 else u[-1]
        inside = (u >= lo) & (u <= hi)
        fit, fit_err = _robust_slope(u[inside] * np.log(10), y_raw[inside])
        if not (abs(fit) < slope_tol + fit_err and 2 * fit_err < slope_tol):
            continue
        level = float(np.median(np.maximum(loss[inside], floor)))
        # 5. merge with the previous plateau at the same level
        if found and abs(np.log(level / found[-1][2])) < -np.log1p(-min_drop):
            found[-1][1] = b
        else:
            found.append([a, b, level])

    starts = np.array([10 ** grid[a] for a, _, _ in found])
    ends = np.array([10 ** grid[b] for _, b, _ in found])
    if found:  # a plateau at an end of the grid extends to the end of the data
        if found[0][0] == 0:
            starts[0] = ts[0]
        if found[-1][1] == n_grid - 1:
            ends[-1] = ts[-1]
    levels = np.array([lvl for _, _, lvl in found])
    drops = levels[:-1] - levels[1:]
    drop_times = []
    smooth_loss = np.exp(y)
    for (_, b0, l0), (a1, _, l1) in zip(found[:-1], found[1:]):
        seg = np.arange(b0, a1 + 1)
        t_mid = first_crossing(
            grid[seg],
            smooth_loss[seg],
            0.5 * (l0 + l1),
            rising=l1 > l0,
            interpolate="linear",
            at_start="nan",
        )
        if np.isnan(t_mid):  # no crossing: the middle of the gap
            t_mid = 0.5 * (grid[b0] + grid[a1])
        drop_times.append(10**t_mid)
    return Plateaus(
        start=jnp.asarray(starts),
        end=jnp.asarray(ends),
        level=jnp.asarray(levels),
        drop=jnp.asarray(drops),
        drop_times=jnp.asarray(np.asarray(drop_times)),
    )
