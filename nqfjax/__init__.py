"""nqfjax: the neural quadratic form theory of sudden learning, in JAX.

The public API is exactly what this module re-exports.
"""

import importlib.metadata

# structures and the quadratic form (THEORY.md section 1)
from .autodiff import structure_from_layer as structure_from_layer
from .model import nqf_apply as nqf_apply
from .structures import (
    Conv1D as Conv1D,
    MixtureOfExperts as MixtureOfExperts,
    OVAttention as OVAttention,
    Perceptron as Perceptron,
    QKAttention as QKAttention,
    QuadraticNet as QuadraticNet,
    Structure as Structure,
)

# tasks and the three engines (sections 2-3)
from .lv import (
    LotkaVolterra as LotkaVolterra,
    NotReducibleError as NotReducibleError,
    lv_reduce as lv_reduce,
    solve_lv as solve_lv,
)
from .mflow import solve_mflow as solve_mflow
from .tasks import (
    Task as Task,
    gaussian_perceptron_task as gaussian_perceptron_task,
    gaussian_quadratic_task as gaussian_quadratic_task,
    power_law_task as power_law_task,
    task_from_samples as task_from_samples,
)
from .train import TrainResult as TrainResult, train as train

# theory (sections 4-5)
from .theory import (
    Staircase as Staircase,
    detect_plateaus as detect_plateaus,
    power_law_exponent as power_law_exponent,
    sharp_switch_loss as sharp_switch_loss,
    singular_limit as singular_limit,
    switch_on_times as switch_on_times,
)

# fitting and sweeps
from .fit import fit_power_law as fit_power_law, fit_spectrum as fit_spectrum
from .sweep import sweep as sweep


try:
    __version__ = importlib.metadata.version("nqfjax")
except importlib.metadata.PackageNotFoundError:  # pragma: no cover
    __version__ = "0+unknown"
