"""nqfjax: the neural quadratic form theory of sudden learning, in JAX.

The public API is exactly what this module re-exports, and the command line's
drivers in `nqfjax.experiments`.
"""

import importlib.metadata
import warnings

from . import experiments as _experiments
from .analysis.forecast import (
    Forecast as Forecast,
    forecast as forecast,
)
from .analysis.plateaus import (
    Plateaus as Plateaus,
    detect_plateaus as detect_plateaus,
)
from .analysis.power_law import (
    PowerLawFit as PowerLawFit,
    fit_power_law as fit_power_law,
)
from .analysis.selection import (
    ModelSelection as ModelSelection,
    select_model as select_model,
)
from .analysis.spectrum import (
    SpectrumFit as SpectrumFit,
    fit_spectrum as fit_spectrum,
)
from .data import (
    load_data_file as load_data_file,
    load_dataset as load_dataset,
)
from .engines._integrate import Solution as Solution
from .engines.clock import (
    clock as clock,
    invert_clock as invert_clock,
)
from .engines.lv import (
    NotReducibleError as NotReducibleError,
    lv_reduce as lv_reduce,
    lv_stepsize_controller as lv_stepsize_controller,
    solve_lv as solve_lv,
    solve_lv_schedule as solve_lv_schedule,
)
from .engines.lv_batch import solve_lv_batch as solve_lv_batch
from .engines.mflow import (
    solve_mflow as solve_mflow,
    solve_mflow_schedule as solve_mflow_schedule,
)
from .engines.mflow_factored import solve_mflow_factored as solve_mflow_factored
from .engines.sgd_divergence import (
    SGDPaths as SGDPaths,
    sgd_divergence_boundary as sgd_divergence_boundary,
    sgd_paths as sgd_paths,
)
from .engines.sgd_moments import (
    SGDMoments as SGDMoments,
    sgd_moments as sgd_moments,
)
from .engines.train import (
    Segment as Segment,
    TrainResult as TrainResult,
    log_spaced_steps as log_spaced_steps,
    train as train,
    train_segments as train_segments,
)
from .experiments.compare import (
    MethodReport as MethodReport,
    compare_methods as compare_methods,
    switch_times_from_curves as switch_times_from_curves,
)
from .experiments.delay import (
    DelayResult as DelayResult,
    DelayScaling as DelayScaling,
    delay_scaling as delay_scaling,
    delayed_generalisation as delayed_generalisation,
    generalisation_delay as generalisation_delay,
)
from .experiments.engines import (
    AbstractEngine as AbstractEngine,
    ApproximateLVEngine as ApproximateLVEngine,
    AutoEngine as AutoEngine,
    FactoredMFlowEngine as FactoredMFlowEngine,
    LVEngine as LVEngine,
    MFlowEngine as MFlowEngine,
)
from .experiments.finite_data import (
    FiniteDataMap as FiniteDataMap,
    finite_data_map as finite_data_map,
)
from .experiments.methods import (
    Method as Method,
    train_method as train_method,
)
from .experiments.predict import (
    Agreement as Agreement,
    Prediction as Prediction,
    agreement as agreement,
    predict as predict,
)
from .experiments.schedules import (
    MeanLoss as MeanLoss,
    Schedule as Schedule,
    TypicalLoss as TypicalLoss,
    evaluate_schedule as evaluate_schedule,
    optimize_schedule as optimize_schedule,
    piecewise_constant as piecewise_constant,
    stability_edge as stability_edge,
    standard_schedules as standard_schedules,
    train_schedule as train_schedule,
)
from .experiments.switch_ons import (
    SwitchOns as SwitchOns,
    switch_ons as switch_ons,
)
from .experiments.validity import (
    Validity as Validity,
    leading_order_validity as leading_order_validity,
    validity_of_run as validity_of_run,
)
from .progress import (
    AbstractProgressMeter as AbstractProgressMeter,
    NoProgressMeter as NoProgressMeter,
    TqdmProgressMeter as TqdmProgressMeter,
)
from .structures import (
    AbstractStructure as AbstractStructure,
    Conv1D as Conv1D,
    MixtureOfExperts as MixtureOfExperts,
    OVAttention as OVAttention,
    Perceptron as Perceptron,
    QKAttention as QKAttention,
    QuadraticNet as QuadraticNet,
)
from .structures.apply import nqf_apply as nqf_apply
from .structures.autodiff import (
    AutodiffStructureMatrix as AutodiffStructureMatrix,
    structure_from_layer as structure_from_layer,
)
from .structures.models import (
    AbstractModel as AbstractModel,
    Layer as Layer,
    QuadraticForm as QuadraticForm,
)
from .structures.registry import (
    make_structure as make_structure,
    structure_arguments as structure_arguments,
    structure_class as structure_class,
    structure_names as structure_names,
)
from .sweep import (
    SweepPointError as SweepPointError,
    SweepResult as SweepResult,
    grid_product as grid_product,
    sweep as sweep,
)
from .tasks.base import (
    Task as Task,
)
from .tasks.gaussian import (
    gaussian_perceptron_task as gaussian_perceptron_task,
    gaussian_quadratic_task as gaussian_quadratic_task,
)
from .tasks.interactions import (
    AbstractInteractions as AbstractInteractions,
    DenseInteractions as DenseInteractions,
    DiagonalInteractions as DiagonalInteractions,
    LowRankInteractions as LowRankInteractions,
)
from .tasks.lotka_volterra import (
    LotkaVolterra as LotkaVolterra,
)
from .tasks.power_law import (
    power_law_task as power_law_task,
)
from .tasks.sampled import (
    task_from_samples as task_from_samples,
)
from .theory.capacity import (
    ConvergedSolution as ConvergedSolution,
    WidthProfile as WidthProfile,
    converged_solution as converged_solution,
    excess_loss_by_width as excess_loss_by_width,
    minimum_width as minimum_width,
)
from .theory.nnqp import (
    NNQPSolution as NNQPSolution,
    nnqp as nnqp,
)
from .theory.power_law import (
    power_law_exponent as power_law_exponent,
    sharp_switch_loss as sharp_switch_loss,
)
from .theory.spectra import (
    WeightSpectrum as WeightSpectrum,
    marchenko_pastur_density as marchenko_pastur_density,
    marchenko_pastur_edges as marchenko_pastur_edges,
    weight_spectrum as weight_spectrum,
)
from .theory.staircase import (
    Staircase as Staircase,
    singular_limit as singular_limit,
)
from .theory.switch_on import (
    switch_on_times as switch_on_times,
)


# The command line's drivers live in `nqfjax.experiments`; their old names here
# still work, with a DeprecationWarning, for one release.
def __getattr__(name: str):
    if name == "Structure":  # `AbstractStructure`'s earlier name, for one release
        warnings.warn(
            "`nqfjax.Structure` is deprecated and will be removed in the next "
            "release; use `nqfjax.AbstractStructure`.",
            DeprecationWarning,
            stacklevel=2,
        )
        return AbstractStructure
    if name in _experiments.__all__:
        warnings.warn(
            f"`nqfjax.{name}` is deprecated and will be removed in the next release; "
            f"use `nqfjax.experiments.{name}`.",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(_experiments, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


try:
    __version__ = importlib.metadata.version("nqfjax")
except importlib.metadata.PackageNotFoundError:  # pragma: no cover
    __version__ = "0+unknown"
