from .attention import OVAttention as OVAttention, QKAttention as QKAttention
from .base import AbstractStructure as AbstractStructure, Structure as Structure
from .conv import Conv1D as Conv1D
from .moe import MixtureOfExperts as MixtureOfExperts
from .perceptron import Perceptron as Perceptron
from .quadratic import QuadraticNet as QuadraticNet
