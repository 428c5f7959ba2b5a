"""The JSON form of the curve analysis (`fit.json`, written by `fit_curve_file`):
the one place where a `CurveAnalysis`'s modules become a JSON-able dict. A
`Skipped` step is `{"found": false, "reason": ...}`, a `Failed` one
`{"error": ...}`; a step not asked for is absent."""

from typing import Any

import numpy as np

from ..analysis.forecast import Forecast
from ..analysis.plateaus import Plateaus
from ..analysis.power_law import PowerLawFit
from ..analysis.selection import ModelSelection
from ..analysis.spectrum import SpectrumFit
from ..io import jsonable
from ..theory.power_law import power_law_exponent
from ._outcomes import Failed, Skipped


def lazy_exponent(alpha: float, beta: float) -> float:
    """`power_law_exponent(alpha, beta, "lazy")`, NaN where it is undefined."""
    try:
        return power_law_exponent(alpha, beta, "lazy")
    except ValueError:
        return float("nan")


def _plateaus(pl: Plateaus) -> dict:
    entry = {
        "count": len(pl),
        "start": pl.start,
        "end": pl.end,
        "level": pl.level,
        "level_err": pl.level_err,
        "drop": pl.drop,
        "drop_err": pl.drop_err,
        "drop_times": pl.drop_times,
        "drop_times_err": pl.drop_times_err,
    }
    if not len(pl):
        entry["reason"] = pl.reason
    return entry


def _power_law(fit: PowerLawFit) -> dict:
    return {
        "gamma": float(fit.gamma),
        "gamma_err": float(fit.gamma_err),
        "uncertainty": fit.uncertainty,
        "L_inf": float(fit.L_inf),
        "c": float(fit.c),
        "t0": float(fit.t0),
        "window": list(fit.window),
        "n_points": fit.n_points,
        "rms_log": float(fit.rms),
    }


def _spectrum(spec: SpectrumFit) -> dict:
    a, b = float(spec.alpha), float(spec.beta)
    return {
        "alpha": a,
        "beta": b,
        "alpha_err": float(spec.alpha_err),
        "beta_err": float(spec.beta_err),
        "eps": float(spec.eps),
        "rate": float(spec.rate),
        "amplitude": float(spec.amplitude),
        "gamma_rich": float(spec.gamma),
        "gamma_lazy": lazy_exponent(a, b),
        "modes": spec.p,
        "method": spec.method,
        "rms_log": float(spec.rms),
    }


def _forecast(fc: Forecast, until: float) -> dict:
    return {
        "until": until,
        "observed_until": fc.observed_until,
        "ts": fc.ts,
        "loss": fc.loss,
        "lower": fc.lower,
        "upper": fc.upper,
        "next_switch_on_times": fc.switch_on_times,
        "next_switch_on_modes": fc.switch_on_modes,
        "final_level": float(fc.final_level),
        "final_band": [float(fc.final_lower), float(fc.final_upper)],
        "floor": float(fc.floor),
        "alpha": float(fc.alpha),
        "beta": float(fc.beta),
        "rms_log": float(fc.rms),
    }


def _model(chosen: ModelSelection) -> dict:
    return {
        "best": chosen.best,
        "runner_up": chosen.runner_up,
        "why": chosen.why,
        "criterion": chosen.criterion,
        "scores": chosen.scores,
        "rms_log": chosen.rms,
    }


def step_entry(result: Any, until: float | None = None) -> dict:
    """The JSON entry of one step's result (a library module, `Skipped` or
    `Failed`)."""
    if isinstance(result, Failed):
        return {"error": result.error}
    if isinstance(result, Skipped):
        return {"found": False, "reason": result.reason}
    if isinstance(result, Forecast):
        return _forecast(result, until)
    convert = {
        Plateaus: _plateaus,
        PowerLawFit: _power_law,
        SpectrumFit: _spectrum,
        ModelSelection: _model,
    }[type(result)]
    return convert(result)


def curve_summary(analysis) -> dict[str, Any]:
    """The JSON-able summary of a `CurveAnalysis` (`fit.json` less its source,
    columns, versions and files): the curve's size and ranges, then one entry
    per step asked for, in the order `model`, `plateaus`, `power_law`,
    `spectrum`, `forecast`."""
    ts, loss = np.asarray(analysis.ts), np.asarray(analysis.loss)
    summary: dict[str, Any] = {
        "n_points": int(ts.size),
        "t_range": [float(ts[0]), float(ts[-1])],
        "loss_range": [float(loss.min()), float(loss.max())],
    }
    for name in ("model", "plateaus", "power_law", "spectrum", "forecast"):
        result = getattr(analysis, name)
        if result is not None:
            summary[name] = step_entry(result, analysis.forecast_to)
    return jsonable(summary)
