"""nqfjax: the neural quadratic form theory of sudden learning, in JAX.

The public API is exactly what this module re-exports.
"""

import importlib.metadata

from .autodiff import (
    AutodiffStructureMatrix as AutodiffStructureMatrix,
    structure_from_layer as structure_from_layer,
)
from .capacity import (
    ConvergedSolution as ConvergedSolution,
    FiniteDataMap as FiniteDataMap,
    WidthProfile as WidthProfile,
    converged_solution as converged_solution,
    excess_loss_by_width as excess_loss_by_width,
    finite_data_map as finite_data_map,
    minimum_width as minimum_width,
)
from .fit import (
    PowerLawFit as PowerLawFit,
    SpectrumFit as SpectrumFit,
    fit_power_law as fit_power_law,
    fit_spectrum as fit_spectrum,
)
from .lv import (
    LotkaVolterra as LotkaVolterra,
    NotReducibleError as NotReducibleError,
    lv_reduce as lv_reduce,
    solve_lv as solve_lv,
)
from .methods import (
    DelayResult as DelayResult,
    DelayScaling as DelayScaling,
    Method as Method,
    MethodReport as MethodReport,
    clock as clock,
    compare_methods as compare_methods,
    delay_scaling as delay_scaling,
    delayed_generalisation as delayed_generalisation,
    generalisation_delay as generalisation_delay,
    invert_clock as invert_clock,
    solve_lv_schedule as solve_lv_schedule,
    solve_mflow_schedule as solve_mflow_schedule,
    switch_times_from_curves as switch_times_from_curves,
    train_method as train_method,
)
from .mflow import solve_mflow as solve_mflow
from .model import nqf_apply as nqf_apply
from .spectra import (
    WeightSpectrum as WeightSpectrum,
    marchenko_pastur_density as marchenko_pastur_density,
    marchenko_pastur_edges as marchenko_pastur_edges,
    weight_spectrum as weight_spectrum,
)
from .structures import (
    Conv1D as Conv1D,
    MixtureOfExperts as MixtureOfExperts,
    OVAttention as OVAttention,
    Perceptron as Perceptron,
    QKAttention as QKAttention,
    QuadraticNet as QuadraticNet,
    Structure as Structure,
)
from .sweep import (
    SweepResult as SweepResult,
    grid_product as grid_product,
    sweep as sweep,
)
from .tasks import (
    Task as Task,
    gaussian_perceptron_task as gaussian_perceptron_task,
    gaussian_quadratic_task as gaussian_quadratic_task,
    power_law_task as power_law_task,
    task_from_samples as task_from_samples,
)
from .theory import (
    NNQPSolution as NNQPSolution,
    Plateaus as Plateaus,
    Staircase as Staircase,
    detect_plateaus as detect_plateaus,
    nnqp as nnqp,
    power_law_exponent as power_law_exponent,
    sharp_switch_loss as sharp_switch_loss,
    singular_limit as singular_limit,
    switch_on_times as switch_on_times,
)
from .train import TrainResult as TrainResult, train as train


try:
    __version__ = importlib.metadata.version("nqfjax")
except importlib.metadata.PackageNotFoundError:  # pragma: no cover
    __version__ = "0+unknown"
