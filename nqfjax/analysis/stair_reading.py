r"""The plateaus read off a fitted staircase (`read_plateaus`, internal), from
its fitted curve rather than from its modes' parameters: a drop is a peak of
the curve's log-log steepness $s = -d\ln L/d\ln t$, the levels it separates
are the curve's values where $s$ is least between neighbouring peaks (the
flattest point of the plateau between them, where the curve really is), and
its edges are where the curve has done 20% and 80% of that fall in $\ln L$.
Reading the modes' asymptotes instead (the floor plus the heights of the
later modes) misplaces the levels wherever a mode's tail reaches far: an
asymmetric drop fitted as a sharp mode plus a broad one, or a broad mode
half done before the data."""

from functools import partial
from typing import NamedTuple

import numpy as np

from .._curves import loglog_slope
from .staircase import EDGE, Staircase


#: Points of the log-time grid the fitted curve is read on (a decade beyond
#: each end of the data).
_GRID = 4000
#: A fall in `ln L` below which a peak of the fitted curve's steepness is a
#: wiggle of the fit, not a drop (a tenth of the smallest `min_drop`'s 0.1).
_WIGGLE = 0.01
#: A log-log slope above which a stretch is no plateau, however steep its
#: drops: its loss still falls faster than `1/t`.
_STILL_FALLING = 1.0
#: A log-log steepness below which the fitted curve is flat (it falls by less
#: than 0.01 in `ln L` per decade): no peak of a drop.
_FLAT = 1e-3


class StaircasePlateaus(NamedTuple):
    """The plateaus read off a fitted staircase (`read_plateaus`), numpy
    arrays of shape `(P,)` (`start`, `end`, `level`, `level_err`) and `(P -
    1,)` (`drop_times`, `drop_times_err`); `n_drops` counted, `reason` (no
    plateau), `ambiguous` (what the data cannot tell), `ends_falling` (no
    plateau after the last drop: a tail)."""

    start: np.ndarray
    end: np.ndarray
    level: np.ndarray
    level_err: np.ndarray
    drop_times: np.ndarray
    drop_times_err: np.ndarray
    n_drops: int
    reason: str = ""
    ambiguous: str = ""
    ends_falling: bool = False


def _none(reason, ambiguous, n_drops=0, ends_falling=False) -> StaircasePlateaus:
    empty = [np.zeros(0)] * 6
    return StaircasePlateaus(*empty, n_drops, reason, ambiguous, ends_falling)


def _count(lt, lo, hi):
    return int(np.count_nonzero((lt >= lo) & (lt <= hi)))


def _segments(grid, c, valleys):
    """Per segment between neighbouring `valleys` (indices into `grid`, the
    curve `c = ln L` on it): `(ln t at EDGE, ln t at 1 - EDGE of its fall,
    ln t where L crosses the middle of its levels)`, shape `(len - 1, 3)`."""
    levels = c[valleys]
    drops = np.empty((len(valleys) - 1, 3))
    for k, (v0, v1) in enumerate(zip(valleys[:-1], valleys[1:])):
        seg, hi, lo = c[v0 : v1 + 1], levels[k], levels[k + 1]
        middle = np.log(0.5 * (np.exp(hi) + np.exp(lo)))
        for j, level in enumerate((hi - EDGE * (hi - lo), hi - (1 - EDGE) * (hi - lo))):
            drops[k, j] = grid[v0 + int(np.argmax(seg <= level))]
        drops[k, 2] = grid[v0 + int(np.argmax(seg <= middle))]
    return drops


def _curve_drops(stairs: Staircase, lt):
    """The drops of the fitted curve on a grid of `ln t` spanning the data
    `lt` and a decade beyond each end: `levels` (`(P,)`, the curve at the
    flattest point between neighbouring peaks of its steepness, and at the
    grid's ends), per drop `(ln t at EDGE, ln t at 1 - EDGE of its fall in
    ln L, ln t where L crosses the middle of its levels)` (`(P - 1, 3)`)
    and the valleys' `ln t` (the drops' bounds, `(P,)`). Peaks whose fall is
    below `_WIGGLE` are merged into a neighbour (across the less flat of
    their two valleys)."""
    grid = np.linspace(lt[0] - np.log(10), lt[-1] + np.log(10), _GRID)
    c = stairs.log_curve(np.exp(grid))
    s = -np.gradient(c, grid)
    inner = np.flatnonzero((s[1:-1] >= s[:-2]) & (s[1:-1] > s[2:]) & (s[1:-1] > _FLAT))
    peaks = list(inner + 1)
    valleys = [0]
    for p, q in zip(peaks[:-1], peaks[1:]):
        valleys.append(p + int(np.argmin(s[p : q + 1])))
    valleys.append(_GRID - 1)
    while len(valleys) > 2:
        falls = c[valleys[:-1]] - c[valleys[1:]]
        k = int(np.argmin(falls))
        if falls[k] >= _WIGGLE:
            break
        # drop the inner valley of the two bounding this segment, the less flat
        sides = [j for j in (k, k + 1) if 0 < j < len(valleys) - 1]
        del valleys[max(sides, key=lambda j: s[valleys[j]])]
    drops = _segments(grid, c, valleys)
    return np.exp(c[valleys]), drops, grid[valleys]


def _kept_drops(stairs: Staircase, lt, min_drop, slack=0.0):
    """The drops of a fitted staircase that the data at log-times `lt` see,
    as `(first level, last level + 1, ln t at 20%, ln t at 80%)`, the levels
    (`_curve_drops`) and the notes on what the data cannot tell (see
    `read_plateaus`); a drop under `min_drop` by less than `slack` standard
    errors is kept."""
    levels, read, bounds = _curve_drops(stairs, lt)
    K = read.shape[0]
    edges, mids = read[:, :2], read[:, 2]
    notes = []
    count = partial(_count, lt)
    # the drops half done within the data
    seen = [k for k in range(K) if lt[0] < mids[k] < lt[-1]]
    for k in set(range(K)) - set(seen):  # half done outside, overlapping them
        fall, over = np.log(levels[k] / levels[k + 1]), edges[k, 0] < lt[-1]
        if fall >= -np.log1p(-min_drop) and over and edges[k, 1] > lt[0]:
            notes.append(
                f"a drop of {fall:.2g} in log L half done outside the data (t = "
                f"{np.exp(mids[k]):.3g}) overlaps them: the count may be short"
            )
    # several fitted modes, each a drop of its own size, within one drop of
    # the curve (no valley between them): one drop or several?
    times, heights = stairs.modes()
    lmode = np.log(times)
    for k in seen:
        inside = (lmode > bounds[k]) & (lmode < bounds[k + 1])
        big = np.log1p(heights / levels[k + 1]) >= -np.log1p(-min_drop)
        if np.sum(inside & big) > 1:
            at = ", ".join(f"{t:.3g}" for t in np.sort(times[inside & big]))
            notes.append(
                f"the drop at t = {np.exp(mids[k]):.3g} is fitted by modes at t = "
                f"{at} with no plateau between them: one drop or several?"
            )
    # (first level index, last level index + 1, lo edge, hi edge)
    drops = [[k, k + 1, edges[k, 0], edges[k, 1]] for k in seen]
    # small or insignificant drops are not drops
    kept = []
    for i, (a, b, lo, hi) in enumerate(drops):
        fall = np.log(levels[a] / levels[b])
        before = count(drops[i - 1][3] if i else -np.inf, lo)
        after = count(hi, drops[i + 1][2] if i + 1 < len(drops) else np.inf)
        se = np.hypot(stairs.se(before), stairs.se(after))
        if fall + slack * se < -np.log1p(-min_drop):
            continue
        if not kept and before < 3:  # a first level on fewer samples than a plateau
            notes.append(
                f"a drop of {fall:.2g} in log L at t = {np.exp(lo):.3g} has "
                f"{before} samples before it (not counted)"
            )
            continue
        if fall < 4 * se:
            notes.append(
                f"a drop of {fall:.2g} in log L at t = {np.exp(lo):.3g} is within "
                f"4 standard errors ({4 * se:.2g}) of the noise (not counted)"
            )
            continue
        kept.append((a, b, lo, hi))
    for a, b, lo, hi in kept:  # wider than any one drop of the families
        if hi - lo > np.log(10):
            w, mid = (hi - lo) / np.log(10), np.exp(0.5 * (lo + hi))
            notes.append(f"the drop at t = {mid:.3g} spans {w:.2g} decades: several?")
    bic, K = np.asarray(stairs.bic), stairs.n_modes
    close = [k + 1 for k in np.flatnonzero(bic - bic[K - 1] < 10) if k + 1 != K]
    if close:
        notes.append(
            f"the data cannot tell {K} fitted modes from "
            f"{' or '.join(map(str, close))} (BIC within 10)"
        )
    return kept, levels, notes


def read_plateaus(
    stairs: Staircase, ts, loss, slope_tol=0.15, min_length=0.05, min_drop=0.1
) -> StaircasePlateaus:
    """The plateaus of a fitted staircase, checked against the data (`ts`,
    `loss > 0`):

    - the drops are the fitted curve's (`_curve_drops`: peaks of its
      steepness, levels where it is flattest between them), spanning 20% to
      80% of their falls in `ln L`; those half done outside the data are not
      seen; a drop that several fitted modes make is said in `ambiguous`;
    - a drop smaller than a fraction `min_drop`, or than 4 standard errors of
      the two levels it separates, is not counted (the latter said in
      `ambiguous`), nor a first drop with fewer than 3 records before it;
    - where another number of drops has a BIC within 10 of the chosen one
      (not "very strong" evidence), `ambiguous` says so;
    - where the best fit with one drop more (`Staircase.with_modes`), read
      alike but counting a drop under `min_drop` by less than 2 standard
      errors, sees more plateaus, one of them across the middle of a drop
      of this reading, `ambiguous` says so whatever its BIC (one drop or
      two? Drops barely above the noise, where the extra mode improves the
      fit by about what 4 parameters fitted to noise do);
    - the plateaus are the stretches before the first drop is 10% done,
      between drops and after the last is 90% done: each needs at least 3
      samples over `min_length` decades, and a log-log slope of the data there
      (to within two standard errors) and somewhere on the fitted curve
      below `min(max(slope_tol, steepness / 2), 1)` (a loss falling faster
      than `1/t` is still dropping; a stretch between drops that fails is
      said in `ambiguous`),
      `steepness` the smaller of its neighbouring drops' (the fall from 10%
      to 90% in `ln L` over its log-time): a power law, which the model fits
      as drops with heavy tails, falls between them as steeply as during
      them. Without a drop, the curve is one plateau if its log-log slope is
      below `slope_tol`, else none.

    `ends_falling` where the stretch after the last drop is no plateau (a
    tail, such as a power law's, not a step of a staircase).

    Levels are the medians of the samples where the fitted curve is within
    2% of a level of the stretch (the one held longest, several across
    uncounted drops), or the fitted level where it never is (fewer than 3
    such samples), with the standard error of a median of those samples
    (`Staircase.se`); drop times where the
    fitted curve crosses the middle of the levels, with the standard error of
    a local level over the drop's steepness."""
    read = _read(stairs, ts, loss, slope_tol, min_length, min_drop)
    K = stairs.n_modes
    if stairs.fits is None or K >= len(stairs.fits) or read.level.size < 2:
        return read
    # the best fit with one drop more, which BIC does not call for, read
    # alike (a drop under `min_drop` by less than 2 standard errors counted):
    # a plateau where this reading has a drop half done?
    alt = _read(
        stairs.with_modes(K + 1), ts, loss, slope_tol, min_length, min_drop, 2.0
    )
    if alt.level.size <= read.level.size:
        return read
    notes = [read.ambiguous] if read.ambiguous else []
    bic = np.asarray(stairs.bic)
    for t_mid in read.drop_times:
        on = np.flatnonzero((alt.start < t_mid) & (t_mid < alt.end))
        if on.size:
            a, b = alt.start[on[0]], alt.end[on[0]]
            notes.append(
                f"a fit of {K + 1} modes (BIC {bic[K] - bic[K - 1]:.2g} higher) has a "
                f"plateau from t = {a:.3g} to {b:.3g}, across the drop at t = "
                f"{t_mid:.3g}: one drop or two?"
            )
    return read._replace(ambiguous="; ".join(notes))


def _read(
    stairs, ts, loss, slope_tol, min_length, min_drop, slack=0.0
) -> StaircasePlateaus:
    """`read_plateaus` of one fit (without the fit of one drop more); a drop
    under `min_drop` by less than `slack` standard errors is counted."""
    lt, ly = np.log(ts), np.log(loss)
    kept, levels, notes = _kept_drops(stairs, lt, min_drop, slack)
    count = partial(_count, lt)
    if not kept:
        # no drop: one plateau if the curve is flat, none if it falls (a
        # power law)
        line = loglog_slope(lt, ly, take_logs=False)
        if abs(line.slope) < slope_tol:
            level = float(np.exp(np.median(ly)))
            err = level * stairs.se(ly.size)
            return StaircasePlateaus(
                np.array([ts[0]]),
                np.array([ts[-1]]),
                np.array([level]),
                np.array([err]),
                np.zeros(0),
                np.zeros(0),
                0,
                ambiguous="; ".join(notes),
            )
        reason = "no plateau: no drop stands out of the noise, and the curve falls"
        return _none(reason, "; ".join(notes), ends_falling=True)
    # stretches: before the first drop, between drops, after the last
    bounds = [lt[0]] + [x for a, b, lo, hi in kept for x in (lo, hi)] + [lt[-1]]
    stretches = list(zip(bounds[0::2], bounds[1::2]))
    keep = _flat(stairs, stretches, kept, levels, lt, ly, slope_tol, min_length)
    for j in np.flatnonzero(~np.array(keep[1:-1], bool)) + 1:  # between two drops
        lo, hi = np.exp(stretches[j])
        notes.append(
            f"the curve does not level off between t = {lo:.3g} and {hi:.3g} "
            "(no plateau seen between two drops): one drop or two?"
        )
    ambiguous = "; ".join(notes)
    found = []
    level_idx = [kept[0][0]] + [b for a, b, lo, hi in kept]
    # the fitted levels of each stretch (several across uncounted drops)
    first = [0] + [b for a, b, lo, hi in kept]
    last = [a for a, b, lo, hi in kept] + [len(levels) - 1]
    for j, ((lo, hi), ok) in enumerate(zip(stretches, keep)):
        if ok:
            level = levels[level_idx[j]]
            # where the fitted curve is within 2% of a level of the stretch
            # (the one it stays at longest): the median of the samples there
            # (exact on a flat plateau); else the fitted asymptote (a plateau
            # tilted by its drops' tails)
            inside = (lt >= lo) & (lt <= hi)
            fitted = stairs.log_curve(ts[inside])  # float64 whatever JAX's default
            near = np.abs(fitted[None] - np.log(levels[first[j] : last[j] + 1, None]))
            core = inside.copy()
            core[inside] = max(near < 0.02, key=np.sum)
            if core.sum() >= 3:
                level = float(np.exp(np.median(ly[core])))
            n = max(int(core.sum()) if core.sum() >= 3 else count(lo, hi), 1)
            found.append((lo, hi, level, stairs.se(n), j))
    if not found:
        reason = "no plateau: no flat stretch between the fitted drops"
        return _none(reason, ambiguous, len(kept), ends_falling=not keep[-1])
    starts = np.exp([f[0] for f in found])
    ends = np.exp([f[1] for f in found])
    # a plateau at an end of the data extends to it (exactly)
    starts[0] = ts[0] if found[0][4] == 0 else starts[0]
    ends[-1] = ts[-1] if found[-1][4] == len(stretches) - 1 else ends[-1]
    lev = np.array([f[2] for f in found])
    lev_err = lev * np.array([f[3] for f in found])
    times, t_err = [], []
    for (_, _, _, _, j0), (_, _, _, _, j1) in zip(found[:-1], found[1:]):
        # the drops between plateaus j0 and j1 (one where both exist)
        a, b, lo, hi = kept[j0]
        b = kept[j1 - 1][1]
        hi = kept[j1 - 1][3]
        mid = _crossing(stairs, 0.5 * (levels[a] + levels[b]), lo, hi)
        steep = np.log(levels[a] / levels[b]) / max(hi - lo, 1e-12) * (1 - 2 * EDGE)
        n = max(count(lo, hi), 1)
        times.append(np.exp(mid))
        t_err.append(np.exp(mid) * stairs.se(n) / max(steep, 1e-12))
    return StaircasePlateaus(
        starts,
        ends,
        lev,
        lev_err,
        np.array(times),
        np.array(t_err),
        len(kept),
        ambiguous=ambiguous,
        ends_falling=not keep[-1],
    )


def _flat(stairs, stretches, kept, levels, lt, ly, slope_tol, min_length):
    """Which `stretches` (`(lo, hi)` in `ln t`) between the `kept` drops are
    plateaus (see `read_plateaus`): flat in the data and somewhere in the
    fitted curve (a stretch of few samples can look flat between steps)."""
    keep = []
    for j, (lo, hi) in enumerate(stretches):
        # flat against its neighbouring drops: a power law, which the model
        # fits as drops with heavy tails, falls between them as steeply
        steep = min(
            (1 - 2 * EDGE) * np.log(levels[a] / levels[b]) / max(dhi - dlo, 1e-12)
            for a, b, dlo, dhi in kept[max(j - 1, 0) : j + 1]
        )
        inside = (lt >= lo) & (lt <= hi)
        enough = inside.sum() >= 3 and hi - lo >= min_length * np.log(10)
        slope = np.inf
        if enough:  # the slope, less twice its standard error
            line = loglog_slope(lt, ly, inside, take_logs=False)
            slope = abs(line.slope) - 2 * line.slope_err
            # and the fitted curve's least steepness in the stretch
            grid = np.linspace(lo, hi, 200)
            least = np.min(np.abs(np.gradient(stairs.log_curve(np.exp(grid)), grid)))
            slope = max(slope, least)
        bar = min(max(slope_tol, 0.5 * steep), _STILL_FALLING)
        keep.append(bool(enough and slope < bar))
    return keep


def _crossing(stairs: Staircase, level, lo, hi):
    """`ln t` where the fitted curve crosses `level` between `ln t = lo` and
    `hi` (widened by half their span; linear in `ln L` between grid points).
    Compared in `ln L`, float64 (`log_curve`; `curve` is float32 under JAX's
    default and loses a loss below float32's normal range, 1e-38)."""
    pad = 0.5 * (hi - lo) + 1e-6
    grid = np.linspace(lo - pad, hi + pad, 2001)
    c, target = stairs.log_curve(np.exp(grid)), np.log(level)
    below = np.flatnonzero(c <= target)
    if below.size == 0:
        return 0.5 * (lo + hi)
    i = below[0]
    if i == 0:
        return grid[0]
    c0, c1 = c[i - 1], c[i]
    return grid[i - 1] + (grid[i] - grid[i - 1]) * (c0 - target) / (c0 - c1)
