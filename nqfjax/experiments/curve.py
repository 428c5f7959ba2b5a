"""A user's own loss curve (`nqfjax fit`): read it from CSV (`read_curve_csv`),
find its plateaus, power law and spectrum and forecast its continuation
(`analyse_curve`), and write a summary and a figure (`fit_curve_file`)."""

import csv
import io
import math
import os
import warnings
from pathlib import Path
from typing import Any, NamedTuple

import equinox as eqx
import jax
import numpy as np

from .. import plots
from ..analysis.forecast import Forecast, forecast
from ..analysis.plateaus import Plateaus, detect_plateaus
from ..analysis.power_law import PowerLawFit, fit_power_law
from ..analysis.selection import ModelSelection, select_model
from ..analysis.spectrum import (
    DEFAULT_SPECTRUM_METHOD,
    SPECTRUM_METHODS,
    SpectrumFit,
    fit_spectrum,
)
from ..io import versions, write_figure, write_json
from ..progress import AbstractProgressMeter, as_progress_meter
from ._outcomes import DictView, Failed, Skipped, attempt, found_or_skipped
from ._summaries import curve_summary


# --------------------------------------------------------------------------------
# loss curves from CSV files


class Curve(NamedTuple):
    """A loss curve read by `read_curve_csv`: times `ts` and `loss` (float64
    arrays of one length), and the names of the columns they came from."""

    ts: np.ndarray
    loss: np.ndarray
    time_column: str
    loss_column: str


#: Header names recognised as the time column, in order of preference.
TIME_COLUMNS = ("t", "time", "step")

#: The fewest rows a curve may have.
MIN_POINTS = 10


#: At most this many header names, and characters of a value, are quoted in
#: an error message.
_MAX_SHOWN = 40


def _excerpt(text: str) -> str:
    """`repr(text)`, cut to its first `_MAX_SHOWN` characters."""
    if len(text) <= _MAX_SHOWN:
        return repr(text)
    return f"{text[:_MAX_SHOWN]!r}... ({len(text)} characters)"


def read_curve_csv(
    path: str | os.PathLike,
    *,
    time_column: str | None = None,
    loss_column: str = "loss",
) -> Curve:
    """Read a loss curve from a CSV file.

    The format: a header line naming the columns, then one row per recorded
    step; blank lines and lines starting with `#` are ignored; other columns are
    ignored. The time column (`t`, `time` or `step` by default) counts training
    steps: numbers `>= 0`, strictly increasing. The loss column (`loss` by
    default) holds finite numbers `>= 0`. At least 10 rows are needed.

    ```
    step,loss
    0,0.52
    1,0.519
    ...
    ```

    **Arguments:**

    - `path`: the CSV file.
    - `time_column`: the header of the time column (default: the first of
      `t`, `time`, `step` present; matched case-insensitively, like `loss_column`).
    - `loss_column`: the header of the loss column (default `loss`).

    **Returns:** a `Curve`.

    **Raises:** `ValueError` naming the problem and where it is: an unreadable
    file, no header, a missing column, a row with too few fields, a value that
    is not a finite number, a negative time or loss, a time not greater than
    the one before, or fewer than 10 rows.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8-sig")
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror or e}.") from None
    except UnicodeDecodeError:
        raise ValueError(f"{path} is not a UTF-8 text (CSV) file.") from None
    lines = [
        (n, line)
        for n, line in enumerate(text.splitlines(), start=1)
        if line.strip() and not line.lstrip().startswith("#")
    ]
    if not lines:
        raise ValueError(f"{path}: no header line (the file is empty).")
    try:
        rows = list(csv.reader(io.StringIO("\n".join(line for _, line in lines))))
    except csv.Error as e:  # e.g. a field longer than csv.field_size_limit()
        raise ValueError(f"{path}: not a readable CSV file ({e}).") from None
    header = [h.strip().lower() for h in rows[0]]
    shown = ", ".join(map(_excerpt, header[:_MAX_SHOWN]))
    shown += ", ..." if len(header) > _MAX_SHOWN else ""

    def find(name: str, what: str, hint: str) -> int:
        if name.strip().lower() not in header:
            raise ValueError(
                f"{path}: missing {what} column {name!r} in the header (line "
                f"{lines[0][0]}: {shown}){hint}."
            )
        return header.index(name.strip().lower())

    if time_column is None:
        present = [c for c in TIME_COLUMNS if c in header]
        if not present:
            raise ValueError(
                f"{path}: missing time column: none of "
                f"{', '.join(map(repr, TIME_COLUMNS))} in the header (line "
                f"{lines[0][0]}: {shown}); name it with "
                "--time-column."
            )
        time_column = present[0]
    i_t = find(time_column, "time", "; name it with --time-column")
    i_l = find(loss_column, "loss", "; name it with --loss-column")

    ts, loss = [], []
    for (n, _), row in zip(lines[1:], rows[1:]):
        values = []
        for col, i in ((time_column, i_t), (loss_column, i_l)):
            if i >= len(row):
                raise ValueError(
                    f"{path}, line {n}: {len(row)} fields, no value for column "
                    f"{col!r} (column {i + 1})."
                )
            cell = row[i].strip()
            try:
                value = float(cell)
            except ValueError:
                raise ValueError(
                    f"{path}, line {n}, column {col!r}: {_excerpt(cell)} is not a "
                    "number."
                ) from None
            if not math.isfinite(value):
                raise ValueError(
                    f"{path}, line {n}, column {col!r}: {_excerpt(cell)} is not finite."
                )
            if value < 0:
                what = "time (steps)" if col == time_column else "loss"
                raise ValueError(
                    f"{path}, line {n}, column {col!r}: negative {what} {value:g}."
                )
            values.append(value)
        if ts and values[0] <= ts[-1]:
            raise ValueError(
                f"{path}, line {n}, column {time_column!r}: time {values[0]:g} is "
                f"not greater than the previous {ts[-1]:g}; times must be strictly "
                "increasing."
            )
        ts.append(values[0])
        loss.append(values[1])
    if len(ts) < MIN_POINTS:
        raise ValueError(
            f"{path}: {len(ts)} data rows; at least {MIN_POINTS} are needed."
        )
    return Curve(np.asarray(ts), np.asarray(loss), time_column, loss_column)


# --------------------------------------------------------------------------------
# analysing one curve


class CurveAnalysis(DictView):
    """What `analyse_curve` found in one loss curve: each step's result is the
    library's result module, `Skipped(reason)` when it found nothing to report
    (a loss that is zero, flat or rising; a refused spectrum fit), `Failed(error)`
    when it raised, or `None` when it was not asked for.

    **Fields:**

    - `ts`, `loss`: the curve, float64, shape `(T,)`.
    - `model`: a `ModelSelection` (`select_model`), `Skipped` or `Failed`.
    - `plateaus`: a `Plateaus` (`detect_plateaus` on `t > 0`; none found: length
      0 and its `reason`) or `Failed`.
    - `power_law`: a `PowerLawFit`, `Skipped` or `Failed`.
    - `spectrum`: a `SpectrumFit`, `Skipped`, `Failed`, or `None` (`modes=None`).
    - `forecast`: a `Forecast`, `Skipped`, `Failed`, or `None` (no `forecast_to`).
    - `forecast_to`: the time forecast to, or `None`.

    `figure()` draws it. Reading it as the dict `analyse_curve` used to return
    (`analysis["power_law"]`), or unpacking it as `(summary, figure)`, is
    deprecated (one release).
    """

    ts: np.ndarray
    loss: np.ndarray
    model: ModelSelection | Skipped | Failed
    plateaus: Plateaus | Failed
    power_law: PowerLawFit | Skipped | Failed
    spectrum: SpectrumFit | Skipped | Failed | None = None
    forecast: Forecast | Skipped | Failed | None = None
    forecast_to: float | None = eqx.field(static=True, default=None)

    def as_dict(self) -> dict[str, Any]:
        """The JSON-able summary (the analysis part of `fit.json`)."""
        return curve_summary(self)

    def figure(self):
        """The curve on log-log axes with the plateaus, the fitted power law and
        its window, the spectrum model and the forecast with its band, and the
        residuals below (a `matplotlib.figure.Figure`)."""
        curves: dict[str, Any] = {}
        if isinstance(self.plateaus, Plateaus):
            curves["plateaus"] = self.plateaus
        with jax.enable_x64(True):
            if isinstance(self.power_law, PowerLawFit):
                lo, hi = self.power_law.window
                tt = np.geomspace(max(lo, self.ts[self.ts > 0][0]), hi, 100)
                curves["power_law_curve"] = (tt, np.asarray(self.power_law(tt)))
            if isinstance(self.spectrum, SpectrumFit):
                curves["spectrum_curve"] = np.asarray(self.spectrum.loss(self.ts))
        if isinstance(self.forecast, Forecast):
            curves["forecast"] = self.forecast
        return plots.plot_curve_analysis(self.ts, self.loss, curves, self.as_dict())

    def __iter__(self):
        warnings.warn(
            "unpacking analyse_curve's result as (summary, figure) is deprecated: "
            "it returns a CurveAnalysis; read its fields and call `.figure()`.",
            DeprecationWarning,
            stacklevel=2,
        )
        return iter((self.as_dict(), self.figure()))


def _check_options(modes, total_modes, spectrum_method) -> int | float:
    """Reject bad options before any work (a `ValueError` naming the option and
    its command-line flag); return `total_modes` as an int or `inf`."""
    if modes is not None and (
        isinstance(modes, bool) or not isinstance(modes, (int, np.integer)) or modes < 1
    ):
        raise ValueError(
            f"`modes` (--modes) must be a positive integer, got {modes!r}."
        )
    if spectrum_method not in SPECTRUM_METHODS:
        raise ValueError(
            "`spectrum_method` must be 'logistic' or 'solve_lv', got "
            f"{spectrum_method!r}."
        )
    lowest = 1 if modes is None else modes
    number = not isinstance(total_modes, bool) and isinstance(
        total_modes, (int, float, np.integer, np.floating)
    )
    if number and total_modes == float("inf"):
        return float("inf")
    whole = number and np.isfinite(total_modes) and total_modes == int(total_modes)
    if not whole or total_modes < lowest:
        raise ValueError(
            "`total_modes` (--total-modes) must be an integer >= the number of "
            f"modes of the model ({lowest}) or inf, got {total_modes!r}."
        )
    return int(total_modes)


def _model(ts, loss, **_):
    chosen = select_model(ts, loss)
    return chosen if chosen.best else Skipped(chosen.reason)


def _plateaus(ts, loss, **_):
    pos = ts > 0
    return detect_plateaus(ts[pos], loss[pos])


def _power_law(ts, loss, **_):
    return found_or_skipped(fit_power_law(ts, loss))


def _spectrum(ts, loss, *, modes, total_modes, spectrum_method, **_):
    spec = fit_spectrum(ts, loss, p=modes, n_modes=total_modes, method=spectrum_method)
    return found_or_skipped(spec)


def _forecast(ts, loss, *, forecast_to, modes, total_modes, **_):
    p = modes if modes is not None else int(min(100, total_modes))
    return found_or_skipped(forecast(ts, loss, forecast_to, p=p, n_modes=total_modes))


_STEPS = {
    "model": _model,
    "plateaus": _plateaus,
    "power_law": _power_law,
    "spectrum": _spectrum,
    "forecast": _forecast,
}


def analyse_curve(
    ts,
    loss,
    *,
    modes: int | None = 200,
    total_modes: float = float("inf"),
    spectrum_method: str = DEFAULT_SPECTRUM_METHOD,
    forecast_to: float | None = None,
    progress: bool | AbstractProgressMeter = False,
) -> CurveAnalysis:
    r"""Plateaus, power law, spectrum and forecast of one loss curve.

    Up to five analyses, each of which may fail on its own (its field of the
    result is then `Failed(error)`) or find nothing (a loss that is zero, flat
    or rising has no power law, spectrum or forecast, and a refused spectrum
    fit has none: `Skipped(reason)`; no plateau: a `Plateaus` of length 0 and
    its `reason`):

    - `model`: `select_model`, the curve's shape (a staircase, a power law, or a
      staircase turning into one) by BIC, with the runner-up and why it lost;
    - `plateaus`: `detect_plateaus` on the points with `t > 0`: start, end and
      level of each plateau, the size and time of the drops between them, and
      their standard errors;
    - `power_law`: `fit_power_law`, $L = L_\infty + c\,(t + t_0)^{-\gamma}$ on
      an automatically chosen window, with its systematic uncertainty;
    - `spectrum`: `fit_spectrum` with `modes` independent modes: the spectral
      exponents `alpha`, `beta` of the power-law Lotka-Volterra model that
      reproduces the curve, and the exponent the theory predicts from them
      (`gamma`, rich) to compare with the fitted one. Skipped (`None`) with
      `modes=None`;
    - `forecast` (with `forecast_to`): `forecast` to that time, its band, the
      next switch-on times and the final level.

    The fits run in float64 whatever the global `jax_enable_x64` setting.

    **Arguments:**

    - `ts`, `loss`: the curve, 1-D, times strictly increasing and `>= 0`.
    - `modes`: number of modes of the spectrum model (`None`: skip it).
    - `total_modes`: the number of modes of the spectrum behind the curve; those
      beyond `modes` enter the model as a continuum tail (`fit_spectrum`'s
      `n_modes`; default `inf`, an unbounded power-law spectrum).
    - `spectrum_method`: `fit_spectrum`'s `method`, `"logistic"` (closed form,
      fast; the default, `DEFAULT_SPECTRUM_METHOD`) or `"solve_lv"` (through
      the ODE solver, slow).
    - `forecast_to`: forecast the curve to this time (after its last one).
    - `progress`: a progress meter over the analyses
      (`nqfjax.AbstractProgressMeter`; `True` for a `tqdm` bar, `False` for none).

    **Returns:** a `CurveAnalysis` (`.figure()` draws it).

    **Raises:** `ValueError` for a bad option (before any work).
    """
    total_modes = _check_options(modes, total_modes, spectrum_method)
    ts = np.asarray(ts, np.float64)
    loss = np.asarray(loss, np.float64)
    _check_forecast_to(forecast_to, ts)
    names = ["model", "plateaus", "power_law"]
    names += [] if modes is None else ["spectrum"]
    names += [] if forecast_to is None else ["forecast"]
    options = dict(
        modes=modes,
        total_modes=total_modes,
        spectrum_method=spectrum_method,
        forecast_to=forecast_to,
    )
    found: dict[str, Any] = {}
    bar = as_progress_meter(progress).bar(len(names), "fit")
    with jax.enable_x64(True), bar:
        for name in names:
            bar.status(name)
            found[name] = attempt(_STEPS[name], ts, loss, **options)
            bar.update()
    return CurveAnalysis(ts=ts, loss=loss, forecast_to=forecast_to, **found)


def _check_forecast_to(forecast_to, ts=None) -> None:
    if forecast_to is None:
        return
    ok = not isinstance(forecast_to, bool) and isinstance(
        forecast_to, (int, float, np.integer, np.floating)
    )
    if not (ok and np.isfinite(forecast_to) and forecast_to > 0):
        raise ValueError(
            "`forecast_to` (--forecast-to) must be a finite time > 0, got "
            f"{forecast_to!r}."
        )
    if ts is not None and not forecast_to > ts[-1]:
        raise ValueError(
            f"`forecast_to` (--forecast-to) must be after the curve's last time "
            f"{ts[-1]:g}, got {forecast_to:g}."
        )


class FitOutput(DictView):
    """What `fit_curve_file` read, found and wrote.

    **Fields:**

    - `source`: the CSV file; `curve`: the `Curve` read from it.
    - `analysis`: the `CurveAnalysis`.
    - `files`: `{"summary": fit.json, "figure": fit.png}`, their paths.

    Reading it as the dict `fit_curve_file` used to return (`out["power_law"]`)
    is deprecated (one release).
    """

    source: str = eqx.field(static=True)
    curve: Curve
    analysis: CurveAnalysis
    files: dict[str, Path] = eqx.field(static=True)

    def as_dict(self) -> dict[str, Any]:
        """The content of `fit.json`, with `files` mapped to their paths."""
        return {
            **_fit_json(self.source, self.curve, self.analysis),
            "files": self.files,
        }


def _fit_json(source: str, curve: Curve, analysis: CurveAnalysis) -> dict[str, Any]:
    """`fit.json` less its `files`."""
    return {
        "source": source,
        "columns": {"time": curve.time_column, "loss": curve.loss_column},
        **analysis.as_dict(),
        "versions": versions(),
    }


def fit_curve_file(
    path: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    time_column: str | None = None,
    loss_column: str = "loss",
    modes: int | None = 200,
    total_modes: float = float("inf"),
    spectrum_method: str = DEFAULT_SPECTRUM_METHOD,
    forecast_to: float | None = None,
    progress: bool | AbstractProgressMeter = True,
) -> FitOutput:
    """Read a loss curve from CSV (`read_curve_csv`), analyse it
    (`analyse_curve`) and write `fit.json` and `fit.png` to `out_dir`
    (atomically; nothing is written if the CSV is malformed).

    **Arguments:**

    - `path`: the CSV file; `time_column`, `loss_column`: as `read_curve_csv`.
    - `out_dir`: the output directory (created if needed).
    - `modes`, `total_modes`, `spectrum_method`, `forecast_to`, `progress`: as
      `analyse_curve`.

    **Returns:** a `FitOutput`: the curve, its `CurveAnalysis` and the paths of
    `fit.json` (every fitted number: the analysis' JSON form, with the source,
    its columns and the library versions) and `fit.png` (`CurveAnalysis.figure`).

    **Raises:** `ValueError` from `read_curve_csv`, or for a bad `modes`,
    `total_modes`, `spectrum_method` or `forecast_to` (before the file is read,
    or, for a `forecast_to` before the curve's end, before any analysis).
    """
    total_modes = _check_options(modes, total_modes, spectrum_method)
    _check_forecast_to(forecast_to)
    curve = read_curve_csv(path, time_column=time_column, loss_column=loss_column)
    analysis = analyse_curve(
        curve.ts,
        curve.loss,
        modes=modes,
        total_modes=total_modes,
        spectrum_method=spectrum_method,
        forecast_to=forecast_to,
        progress=progress,
    )
    files = {"summary": "fit.json", "figure": "fit.png"}
    summary = {**_fit_json(str(path), curve, analysis), "files": files}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_figure(out / files["figure"], analysis.figure())
    write_json(out / files["summary"], summary)
    return FitOutput(
        source=str(path),
        curve=curve,
        analysis=analysis,
        files={k: out / v for k, v in files.items()},
    )
