"""The built-in structures by name: the one table the CLI's sweep configuration,
the demo and the tests read.

```python
nqfjax.structure_names()                      # ('perceptron', 'quadratic', ...)
nqfjax.make_structure("conv1d", length=16)    # Conv1D(length=16, ...)
nqfjax.structure_arguments("conv1d")          # {'length': int, ...}
```
"""

import difflib
import types
from collections.abc import Mapping

from .attention import OVAttention, QKAttention
from .base import AbstractStructure
from .conv import Conv1D
from .moe import MixtureOfExperts
from .perceptron import Perceptron
from .quadratic import QuadraticNet


# name -> (class, {constructor argument that a text configuration can set: type}).
# Arguments that are not plain values (activations, attention values) are left
# out: they keep their defaults when a structure is made by name.
_REGISTRY: dict[str, tuple[type[AbstractStructure], dict[str, type]]] = {
    "perceptron": (Perceptron, {"d": int, "k": int}),
    "quadratic": (QuadraticNet, {"d": int}),
    "qk_attention": (
        QKAttention,
        {
            "T": int,
            "d": int,
            "k": int,
            "query": int,
            "softmax": bool,
            "temperature": float,
        },
    ),
    "ov_attention": (
        OVAttention,
        {
            "T": int,
            "d": int,
            "k": int,
            "query": int,
            "learn_qk": bool,
            "temperature": float,
        },
    ),
    "moe": (MixtureOfExperts, {"d": int, "k": int, "experts": int, "gate": str}),
    "conv1d": (
        Conv1D,
        {"length": int, "kernel_size": int, "stride": int, "pool": bool},
    ),
}


def _entry(name: str) -> tuple[type[AbstractStructure], dict[str, type]]:
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        close = difflib.get_close_matches(str(name), list(_REGISTRY), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(
            f"`name` must be one of {', '.join(_REGISTRY)}, got {name!r}{hint}."
        ) from None


def structure_names() -> tuple[str, ...]:
    """The names of the built-in structures, in a fixed order."""
    return tuple(_REGISTRY)


def structure_class(name: str) -> type[AbstractStructure]:
    """The class registered under `name`.

    **Raises:** `ValueError` for an unknown name (with the closest known one).
    """
    return _entry(name)[0]


def structure_arguments(name: str) -> Mapping[str, type]:
    """The constructor arguments of `name` that can be set by name, and their
    types (`int`, `float`, `bool` or `str`), read-only.

    **Raises:** `ValueError` for an unknown name.
    """
    return types.MappingProxyType(_entry(name)[1])


def make_structure(name: str, **kwargs) -> AbstractStructure:
    """The structure registered under `name`, built with `kwargs`.

    **Arguments:**

    - `name`: one of `structure_names()`.
    - `**kwargs`: constructor arguments, each one of `structure_arguments(name)`
      and of its type (an `int` is accepted where a `float` is expected; a `bool`
      is never an `int`).

    **Returns:** the structure, e.g. `make_structure("perceptron", d=8)` is
    `Perceptron(d=8)`.

    **Raises:** `ValueError` for an unknown name, an argument the structure does
    not take by name, a value of the wrong type, or one its constructor refuses.
    """
    cls, arguments = _entry(name)
    for key, value in kwargs.items():
        if key not in arguments:
            raise ValueError(
                f"`{key}` is not an argument of {name!r} ({cls.__name__}); it takes "
                f"{', '.join(arguments)}."
            )
        kind = arguments[key]
        ok = isinstance(value, kind) and not (kind is not bool and type(value) is bool)
        if kind is float:
            ok = isinstance(value, int | float) and not isinstance(value, bool)
        if not ok:
            raise ValueError(
                f"`{key}` of {name!r} must be of type {kind.__name__}, got {value!r}."
            )
    return cls(**kwargs)
