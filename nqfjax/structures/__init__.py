import warnings as _warnings

from .attention import OVAttention as OVAttention, QKAttention as QKAttention
from .base import AbstractStructure as AbstractStructure
from .conv import Conv1D as Conv1D
from .moe import MixtureOfExperts as MixtureOfExperts
from .perceptron import Perceptron as Perceptron
from .quadratic import QuadraticNet as QuadraticNet


def __getattr__(name: str):
    # `Structure`: the name nqfjax used before `AbstractStructure`, for one release.
    if name == "Structure":
        _warnings.warn(
            "`Structure` is deprecated and will be removed in the next release; "
            "use `AbstractStructure`.",
            DeprecationWarning,
            stacklevel=2,
        )
        return AbstractStructure
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
