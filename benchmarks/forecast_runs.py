"""Forecasts of recorded training runs against naive baselines (issue 29).

Each run of `examples/runs/` (recorded by `benchmarks/record_runs.py`) is
forecast from its first 30% of steps to its end by `nqfjax.forecast` with a
nominal 90% band, and scored at every later recorded step, in `log L`:

- the median absolute error of the forecast;
- the interval score of the band (Gneiting and Raftery's proper score for a
  central interval: its width plus `2 / 0.1` times the distance by which the
  truth falls outside it), averaged over the later steps: lower is better;
- the coverage: the fraction of later steps inside the band.

Against two naive baselines, scored the same way:

- `last`: the last observed value kept, with a band of plus or minus the
  change of `log L` over the prefix's last stretch of the same length in
  `log t` as the forecast's horizon (what the curve did over the last such
  stretch, it may do again);
- `power law`: a power law with a floor fitted to the prefix's second half in
  `log t` and continued, with a band from its parameters' uncertainty and its
  misfit (`baseline_power_law`).

    python benchmarks/forecast_runs.py               # the development runs
    python benchmarks/forecast_runs.py --held-out    # the held-out runs
    python benchmarks/forecast_runs.py --held-out-2  # the third set
    python benchmarks/forecast_runs.py --held-out-3  # the fourth set
    python benchmarks/forecast_runs.py --held-out-4  # the fifth set
    python benchmarks/forecast_runs.py --held-out-5  # the sixth set
    python benchmarks/forecast_runs.py iris_gd ...   # just these
"""

import os
import sys
import time


os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402


jax.config.update("jax_enable_x64", True)

import numpy as np  # noqa: E402

import nqfjax  # noqa: E402
from nqfjax.experiments import read_curve_csv  # noqa: E402


RUNS = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "..", "examples", "runs"
)
FRACTION, LEVEL = 0.3, 0.9
METHODS = ("forecast", "last", "power law")


def load_run(name: str) -> tuple[np.ndarray, np.ndarray]:
    """`(steps, loss)` of a recorded run."""
    curve = read_curve_csv(os.path.join(RUNS, f"{name}.csv"))
    return curve.ts, curve.loss


def run_names(held_out: bool | int = False) -> list[str]:
    """The runs `record_runs.py` records: those the forecast was first
    developed on, or with `held_out` those kept from its first revision
    (`True` or 1: `HELD_OUT`), from its second (2: `HELD_OUT_2`) or from
    its third (3: `HELD_OUT_3`), from its fourth (4: `HELD_OUT_4`) or from
    its fifth (5: `HELD_OUT_5`) (the
    folder also holds the staircase runs of `examples/runs/record.py`, which
    sit on their last plateau from 30% of their steps on)."""
    from record_runs import (
        HELD_OUT,
        HELD_OUT_2,
        HELD_OUT_3,
        HELD_OUT_4,
        HELD_OUT_5,
        RUNS as RECORDED,
    )

    sets = {
        0: RECORDED,
        1: HELD_OUT,
        2: HELD_OUT_2,
        3: HELD_OUT_3,
        4: HELD_OUT_4,
        5: HELD_OUT_5,
    }
    return sorted(sets[int(held_out)])


def interval_score(lower, upper, truth, level: float = LEVEL) -> float:
    """The mean interval score of the central `level` band `[lower, upper]`
    (all in `log L`): width plus `2 / (1 - level)` times the miss."""
    a = 1 - level
    miss = np.maximum(lower - truth, 0) + np.maximum(truth - upper, 0)
    return float(np.mean(upper - lower + 2 / a * miss))


def _on(grid, values, at):
    """`values` (positive, on the log-spaced `grid`) at the times `at`, in log."""
    return np.interp(np.log(at), np.log(grid), np.log(np.asarray(values)))


def baseline_last(t, y, until, at):
    """`(centre, lower, upper)` in `log L` at `at`: the last value kept."""
    ly = np.log(y[y > 0])
    tp = t[y > 0]
    horizon = np.log(until / tp[-1])
    back = np.interp(np.log(tp[-1]) - horizon, np.log(np.maximum(tp, 1e-300)), ly)
    width = abs(ly[-1] - back)
    centre = np.full(at.shape, ly[-1])
    return centre, centre - width, centre + width


def baseline_power_law(t, y, until, at):
    """`(centre, lower, upper)` in `log L` at `at`: a power law with a floor,
    `L_inf + c (t + t0)^-gamma`, fitted by least squares in `log L` to the
    prefix's second half in `log t`, continued; the band: the central 90% of
    the curves of parameters drawn from the fit's Laplace covariance, widened
    by 1.645 times the rms misfit."""
    from scipy.optimize import least_squares

    pos = (t > 0) & (y > 0)
    tp, ly = t[pos], np.log(y[pos])
    keep = np.log(tp) >= 0.5 * (np.log(tp[0]) + np.log(tp[-1]))
    tp, ly = tp[keep], ly[keep]

    def curve(th, s):  # th: log c, log t0, gamma, log L_inf
        return np.logaddexp(th[3], th[0] - th[2] * np.log(s + np.exp(th[1])))

    slope = -np.polyfit(np.log(tp), ly, 1)[0]
    starts = [
        [ly[0] + max(slope, 0.1) * np.log(tp[0]), np.log(tp[0]), max(slope, 0.1), lf]
        for lf in (ly.min() - 5, ly.min() - 1)
    ]
    fits = [least_squares(lambda th: curve(th, tp) - ly, s0) for s0 in starts]
    fit = min(fits, key=lambda f: f.cost)
    rms = np.sqrt(2 * fit.cost / len(ly))
    dof = max(len(ly) - 4, 1)
    cov = np.linalg.pinv(fit.jac.T @ fit.jac) * 2 * fit.cost / dof
    draws = np.random.default_rng(0).multivariate_normal(
        fit.x, cov, 200, check_valid="ignore"
    )
    curves = np.array([curve(th, at) for th in draws])
    lo, hi = np.quantile(curves, [0.05, 0.95], axis=0)
    centre = curve(fit.x, at)
    return (
        centre,
        np.minimum(lo, centre) - 1.645 * rms,
        np.maximum(hi, centre) + 1.645 * rms,
    )


def score(t, y, fraction: float = FRACTION) -> dict:
    """The forecast and both baselines of one run from its first `fraction` of
    steps to its end: per method the median |error| of `log L`, the mean
    interval score and the coverage at the later recorded steps; and the
    forecast's `model` and time."""
    seen = t <= fraction * t[-1]
    later = ~seen & (y > 0)
    at, truth = t[later], np.log(y[later])
    start = time.perf_counter()
    fc = nqfjax.forecast(t[seen], y[seen], t[-1], level=LEVEL)
    seconds = time.perf_counter() - start
    grid = np.asarray(fc.ts)
    bands = {
        "forecast": tuple(_on(grid, v, at) for v in (fc.loss, fc.lower, fc.upper)),
        "last": baseline_last(t[seen], y[seen], t[-1], at),
        "power law": baseline_power_law(t[seen], y[seen], t[-1], at),
    }
    out = {"model": getattr(fc, "model", "spectrum"), "seconds": seconds}
    for name, (centre, lower, upper) in bands.items():
        out[name] = {
            "error": float(np.median(np.abs(centre - truth))),
            "score": interval_score(lower, upper, truth),
            "coverage": float(np.mean((lower <= truth) & (truth <= upper))),
            "n": int(truth.size),
        }
    return out


def wins(result: dict) -> tuple[bool, bool]:
    """Whether the forecast beats both baselines on its median error, and on
    its interval score."""
    f = result["forecast"]
    others = [result[m] for m in METHODS[1:]]
    return (
        all(f["error"] < o["error"] for o in others),
        all(f["score"] < o["score"] for o in others),
    )


def main(names):
    flags = {"--held-out": 1, **{f"--held-out-{k}": k for k in range(2, 6)}}
    held_out = max([flags.get(n, 0) for n in names], default=0)
    names = [n for n in names if not n.startswith("--")] or run_names(held_out)
    print(
        f"{'run':18s} {'model':9s} {'s':>5s}  "
        + "  ".join(f"{m + ' err/IS/cov':>22s}" for m in METHODS)
        + "  wins"
    )
    inside = total = both = 0
    for name in names:
        r = score(*load_run(name))
        err_win, score_win = wins(r)
        both += err_win and score_win
        f = r["forecast"]
        inside += round(f["coverage"] * f["n"])
        total += f["n"]
        cells = "  ".join(
            f"{r[m]['error']:6.3f} {r[m]['score']:7.3f} {r[m]['coverage']:5.0%}"
            for m in METHODS
        )
        print(
            f"{name:18s} {r['model']:9s} {r['seconds']:5.1f}  {cells}  "
            f"{'E' if err_win else '-'}{'S' if score_win else '-'}"
        )
    print(
        f"both won on {both}/{len(names)} runs; pooled coverage of the 90% band "
        f"{inside / total:.0%} ({inside}/{total})"
    )


if __name__ == "__main__":
    main(sys.argv[1:])
