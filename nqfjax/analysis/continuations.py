r"""The simple continuations `forecast` weighs against its mode spectrum, and
the backtest that chooses among them and sizes the band (numpy only).

- the tail: a power law with a floor, $\log L = \log(L_\infty + c\,t^{-\gamma})$,
  fitted to the prefix's last stretch of as many e-folds of `t` as the
  forecast's horizon (a settled tail continued as a tail);
- the power law: $L_\infty + c\,(t + t_0)^{-\gamma}$ fitted to the later half
  of the prefix in `log t` (a large `t0` bends it towards an exponential
  approach to the floor);
- the staircase: `fit_staircase`'s drops and floor fitted to the prefix and
  continued (a drop in progress completed, then the floor; a curve on a
  plateau or at its floor stays there: a staircase continued as one);
- the flat continuation: the last value kept.

The backtest forecasts the prefix from earlier origins $T_b = T e^{-f X}$ (`X`
the forecast's horizon in e-folds of `t`, `f` in `BACKTEST_FRACTIONS`; none
where `X` passes `REACH` of the prefix's span) to its end, each
candidate from the data before its origin only, and measures the error of
$\log L$ at relative horizons $s = \ln(t/T_b) / (f X)$ in `(0, 1]`."""

from collections.abc import Callable

import numpy as np

from .staircase import fit_staircase


#: The origins of the backtest: `f` of the forecast's horizon before the end.
BACKTEST_FRACTIONS = (0.5, 0.35, 0.25)
#: The relative horizons at which the backtest measures errors.
HORIZONS = np.linspace(0.05, 1.0, 20)
#: The longest horizon backtested, as a fraction of the prefix's span in
#: `log t` (a longer one gets no backtest).
REACH = 0.5
#: Points a candidate needs before an origin.
MIN_POINTS = 8


def tail_fit(
    t: np.ndarray, ly: np.ndarray, shifts: bool = False
) -> tuple[float, float, float, float]:
    r"""`(floor, t0, log c, gamma)` of $\log(L_\infty + c\,(t + t_0)^{-\gamma})$
    fitted to points `(t, log L)` by least squares in $\log L$: for each floor
    on a grid from 0 to 0.999 of the lowest loss (and, with `shifts`, each
    `t0` on a grid from 0 to 3 times the last time), a straight line of
    $\log(L - L_\infty)$ against $\log(t + t_0)$ (`gamma >= 0`: a rising
    stretch is flat); the pair with the smallest misfit wins."""
    low = float(np.exp(np.min(ly)))
    floors = np.concatenate([[0.0], low * (1 - np.geomspace(1.0, 1e-3, 24)[1:])])
    t0s = (
        np.concatenate([[0.0], t[-1] * np.geomspace(1e-3, 3.0, 16)])
        if shifts
        else np.zeros(1)
    )
    f, s = (g.ravel() for g in np.meshgrid(floors, t0s, indexing="ij"))
    z = np.log(np.maximum(np.exp(ly)[None, :] - f[:, None], 1e-300))
    lt = np.log(t[None, :] + s[:, None])
    x = lt - lt.mean(1, keepdims=True)
    slope = (z * x).sum(1) / np.maximum((x * x).sum(1), 1e-300)
    gamma = np.maximum(-slope, 0.0)
    log_c = (z + gamma[:, None] * lt).mean(1)
    fitted = np.logaddexp(
        np.log(np.maximum(f, 1e-300))[:, None], log_c[:, None] - gamma[:, None] * lt
    )
    best = int(np.argmin(((fitted - ly) ** 2).sum(1)))
    return float(f[best]), float(s[best]), float(log_c[best]), float(gamma[best])


def _tail_at(fit, at):
    floor, t0, log_c, gamma = fit
    return np.logaddexp(np.log(max(floor, 1e-300)), log_c - gamma * np.log(at + t0))


def tail_curve(t, ly, use, origin: float, horizon: float, at) -> np.ndarray:
    """`log L` at `at` of a power law with a floor fitted to the points before
    `origin` within `horizon` e-folds of it (at least the last `MIN_POINTS`)."""
    idx = np.flatnonzero(use & (t <= origin) & (t > 0))
    near = idx[np.log(t[idx]) >= np.log(origin) - horizon]
    if near.size < MIN_POINTS:
        near = idx[-MIN_POINTS:]
    return _tail_at(tail_fit(t[near], ly[near]), at)


def power_law_curve(t, ly, use, origin: float, horizon: float, at) -> np.ndarray:
    r"""`log L` at `at` of $L_\infty + c\,(t + t_0)^{-\gamma}$ fitted to the
    later half (in `log t`) of the points before `origin`."""
    idx = np.flatnonzero(use & (t <= origin) & (t > 0))
    lt = np.log(t[idx])
    half = idx[lt >= 0.5 * (lt[0] + lt[-1])]
    if half.size < MIN_POINTS:
        half = idx[-MIN_POINTS:]
    return _tail_at(tail_fit(t[half], ly[half], shifts=True), at)


def staircase_curve(t, ly, use, origin: float, horizon: float, at) -> np.ndarray:
    """`log L` at `at` of the staircase (`fit_staircase`: drops and a floor)
    fitted to the points before `origin`, continued past them."""
    idx = np.flatnonzero(use & (t <= origin) & (t > 0))
    fit = fit_staircase(t[idx], np.exp(ly[idx]))
    curve = fit.log_curve(np.asarray(at, float))
    if not np.all(np.isfinite(curve)):  # nothing fitted: the last value kept
        return flat_curve(t, ly, use, origin, horizon, at)
    return curve


def flat_curve(t, ly, use, origin: float, horizon: float, at) -> np.ndarray:
    """`log L` at `at`: the last value before `origin`, kept."""
    return np.full(np.shape(at), ly[use & (t <= origin)][-1])


def anchored(candidate: Callable, t, ly, use, origin: float, horizon: float, at):
    """`candidate`'s `log L` at `at` moved to pass through the last observed
    value before `origin` (a continuation continues the curve from where it
    is; the candidate says how it moves on)."""
    both = candidate(t, ly, use, origin, horizon, np.append(at, origin))
    return both[:-1] - both[-1] + ly[use & (t <= origin)][-1]


def backtest(
    t: np.ndarray,
    ly: np.ndarray,
    use: np.ndarray,
    horizon: float,
    candidates: dict[str, Callable],
) -> tuple[dict[str, np.ndarray], np.ndarray]:
    r"""The errors of each candidate on forecasts of the prefix from earlier
    origins (see the module notes): `({name: errors}, fractions)`, errors of
    shape `(B, len(HORIZONS))` (predicted minus observed `log L`), one row per
    origin with at least `MIN_POINTS` usable points before it, and those
    origins' `f`. A candidate is called as `candidate(t, ly, use, origin,
    horizon, at)` and sees only the points before `origin`."""
    t_end = t[use][-1]
    log_t = np.log(np.maximum(t, 1e-300))
    errors: dict[str, list] = {name: [] for name in candidates}
    fractions = []
    # a horizon longer than half the prefix (in log t) cannot be backtested
    # inside it: the candidates would see too little of it to say anything,
    # and a shorter backtest says nothing of the drops a long horizon holds
    span = np.log(t_end / t[use & (t > 0)][0])
    fractions_used = BACKTEST_FRACTIONS if horizon <= REACH * span else ()
    for f in fractions_used:
        origin = t_end * np.exp(-f * horizon)
        before = use & (t <= origin) & (t > 0)
        if before.sum() < MIN_POINTS:
            continue
        at = origin * np.exp(HORIZONS * f * horizon)
        seen = use & (t > 0)
        truth = np.interp(np.log(at), log_t[seen], ly[seen])
        for name, candidate in candidates.items():
            predicted = anchored(candidate, t, ly, before, origin, horizon, at)
            errors[name].append(np.asarray(predicted) - truth)
        fractions.append(f)
    shape = (len(fractions), HORIZONS.size)
    return (
        {name: np.reshape(np.asarray(e, float), shape) for name, e in errors.items()},
        np.asarray(fractions),
    )


def backtest_band(errors: np.ndarray, fractions: np.ndarray, s: np.ndarray, z: float):
    r"""The band's half-width at relative horizons `s` (`ln(t/T) / X`) from a
    candidate's backtest `errors`: each origin's error at the same relative
    horizon, scaled to the full horizon (divided by its `f`: errors grow in
    proportion to the horizon), their root mean square over the origins, times
    `z`; shape `s.shape` (zero without origins). Symmetric: three origins say
    how far a continuation strays, not reliably to which side."""
    if errors.shape[0] == 0:
        return np.zeros(s.shape)
    scaled = np.abs(errors) / fractions[:, None]
    at = np.clip(s, HORIZONS[0], 1.0)
    each = np.array([np.interp(at, HORIZONS, e) for e in scaled])
    typical = np.sqrt(np.mean(each**2, 0))
    ramp = np.clip(s / HORIZONS[0], 0, 1)  # to zero at the origin itself
    return z * typical * ramp
