"""The command line's drivers: what `nqfjax demo`, `nqfjax sweep`, `nqfjax fit` and
`nqfjax predict` run, so that a notebook or script can do the same.

A driver combines the library's building blocks (engines, theory, analysis, the
functions of `nqfjax` itself) for one command, writes its files (a report,
figures, a summary) and returns an equinox Module with named fields holding the
library's results (`DemoOutput`, `SweepOutput`, `CurveAnalysis` in a `FitOutput`,
`PredictOutput`); the command line alone turns them into text. The building
blocks that also live in this package (`predict`, `train_method`,
`compare_methods`, the schedules, delayed generalisation, the finite-data map)
are reached as `nqfjax.NAME`; only the drivers are reached here, as
`nqfjax.experiments.NAME`.
"""

from ._outcomes import Failed as Failed, Skipped as Skipped
from ._report import DemoCheck as DemoCheck
from .curve import (
    Curve as Curve,
    CurveAnalysis as CurveAnalysis,
    FitOutput as FitOutput,
    analyse_curve as analyse_curve,
    fit_curve_file as fit_curve_file,
    read_curve_csv as read_curve_csv,
)
from .demo import (
    DemoConfig as DemoConfig,
    DemoOutput as DemoOutput,
    run_demo as run_demo,
)
from .predict_file import PredictOutput as PredictOutput, predict_file as predict_file
from .sweep_config import (
    SweepConfig as SweepConfig,
    load_sweep_config as load_sweep_config,
    parse_sweep_config as parse_sweep_config,
)
from .sweep_run import SweepOutput as SweepOutput, run_sweep_config as run_sweep_config


__all__ = [
    "Curve",
    "CurveAnalysis",
    "Failed",
    "FitOutput",
    "PredictOutput",
    "Skipped",
    "DemoCheck",
    "DemoConfig",
    "DemoOutput",
    "SweepConfig",
    "SweepOutput",
    "analyse_curve",
    "fit_curve_file",
    "load_sweep_config",
    "parse_sweep_config",
    "predict_file",
    "read_curve_csv",
    "run_demo",
    "run_sweep_config",
]
