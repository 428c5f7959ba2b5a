r"""The TOML sweep behind `nqfjax sweep`: its validated configuration.

- `load_sweep_config(path)` / `parse_sweep_config(mapping)`: read and validate a
  TOML sweep configuration into a `SweepConfig` (every problem is a `ValueError`
  naming the key, raised before anything is written);
- `run_sweep_config(config, out_dir)` (in `sweep_run.py`): train the real
  network at every point of the grid with `nqfjax.train`, through the resumable,
  checkpointed `nqfjax.sweep`, and write `results.npz`, `summary.json` and
  `loss_curves.png`.

The sweep configuration (see `examples/sweep_small.toml` for a commented one):

```toml
[data]          # Gaussian inputs, targets of a teacher of the same architecture
n_samples = 64          # number of training inputs
teacher_units = 2       # the teacher's units ...
teacher_scale = 1.0     # ... drawn as teacher_scale * N(0, 1)
noise = 0.0             # standard deviation of Gaussian label noise
seed = 0                # seed of the inputs, the teacher and the noise

[train]
num_steps = 400         # optimizer steps (required)
width = 4               # units of the trained network
num_records = 40        # about how many log-spaced steps to record
batch_size = 16         # minibatch size; omit for full batch
weight_decay = 0.0      # L2 penalty lambda >= 0
model = "layer"         # "layer" (the real network) or "quadratic" (its form)
precision = "float32"   # or "float64"

[grid]                  # the sweep runs the full product of these lists
init_scale = [1e-4, 1e-2]       # sigma > 0 (required)
learning_rate = [0.05]          # eta > 0 (required)
seed = [0, 1]                   # initialisation and minibatch seeds, >= 0
optimizer = ["gd", "adam"]      # "gd", "momentum" or "adam"
architecture = ["perceptron"]   # see nqfjax.structure_names()

[architectures.perceptron]      # optional constructor arguments
d = 4
k = 2

[sweep]
chunk = 4               # grid points per compiled call and checkpoint file
```
"""

import dataclasses
import difflib
import math
import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..structures.base import AbstractStructure
from ..structures.models import MODELS
from ..structures.registry import (
    make_structure,
    structure_arguments,
    structure_names,
)
from ._optimizers import (
    OPTIMIZERS as OPTIMIZERS,  # the one table: word -> optax factory (None: GD)
)


# --------------------------------------------------------------------------------
# the sweep configuration


_REQUIRED = object()
# section -> key -> (kind, default); kinds: int, float, str, list[float], ...
_SCHEMA: dict[str, dict[str, tuple[str, Any]]] = {
    "data": {
        "n_samples": ("int>=1", 64),
        "teacher_units": ("int>=1", 2),
        "teacher_scale": ("float>0", 1.0),
        "noise": ("float>=0", 0.0),
        "seed": ("int>=0", 0),
    },
    "train": {
        "num_steps": ("int>=1", _REQUIRED),
        "width": ("int>=1", 4),
        "num_records": ("int>=2", 40),
        "batch_size": ("int>=1", None),
        "weight_decay": ("float>=0", 0.0),
        "model": (tuple(MODELS), "layer"),
        "precision": (("float32", "float64"), "float32"),
    },
    "grid": {
        "init_scale": ("list[float>0]", _REQUIRED),
        "learning_rate": ("list[float>0]", _REQUIRED),
        "seed": ("list[int>=0]", [0]),
        "optimizer": ("list[optimizer]", ["gd"]),
        "architecture": ("list[architecture]", ["perceptron"]),
    },
    "sweep": {"chunk": ("int>=1", None)},
}
_SECTIONS = (*_SCHEMA, "architectures")


@dataclasses.dataclass(frozen=True)
class SweepConfig:
    """A validated sweep configuration (build with `load_sweep_config` or
    `parse_sweep_config`).

    **Fields:**

    - `data`, `train`, `grid`, `sweep`: dicts of the sections with every default
      filled in (see the module docstring for the keys).
    - `architectures`: dict `name -> constructor arguments` for every
      architecture of the grid (empty dict: the class defaults).
    - `source`: where the configuration came from (a path, or `"<dict>"`).
    """

    data: dict[str, Any]
    train: dict[str, Any]
    grid: dict[str, list]
    sweep: dict[str, Any]
    architectures: dict[str, dict[str, Any]]
    source: str = "<dict>"

    def to_dict(self) -> dict[str, Any]:
        """The configuration as a plain (TOML- and JSON-able) dict."""
        out = {
            "data": dict(self.data),
            "train": {k: v for k, v in self.train.items() if v is not None},
            "grid": {k: list(v) for k, v in self.grid.items()},
            "architectures": {k: dict(v) for k, v in self.architectures.items()},
        }
        if self.sweep["chunk"] is not None:
            out["sweep"] = dict(self.sweep)
        return out

    def structure(self, architecture: str) -> AbstractStructure:
        """The `AbstractStructure` instance of one architecture of the grid."""
        return make_structure(architecture, **self.architectures.get(architecture, {}))


def _unknown(where: str, key: str, allowed) -> ValueError:
    allowed = sorted(allowed)
    close = difflib.get_close_matches(key, allowed, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return ValueError(
        f"unknown key {where + key!r}{hint}; allowed: {', '.join(allowed)}."
    )


#: Integers of a configuration (steps, sizes, seeds) must be below this in
#: magnitude: JAX's default integers are 32-bit.
INT_LIMIT = 2**31


def _show(value) -> str:
    """`repr(value)` for an error message, cut short: an integer of many digits
    by its number of digits, any other long value by its first characters."""
    text = repr(value)
    if len(text) <= 40:
        return text
    if isinstance(value, int):
        return f"an integer of {len(text.lstrip('-'))} digits"
    return f"{text[:40]}... ({len(text)} characters)"


def _check_value(name: str, kind, value):
    """Check one value against a schema kind; return it (ints as float where a
    float is expected)."""
    if isinstance(kind, tuple):  # a choice of strings
        if not isinstance(value, str) or value not in kind:
            raise ValueError(
                f"{name} must be one of {', '.join(map(repr, kind))}, got "
                f"{_show(value)}."
            )
        return value
    if kind.startswith("list["):
        inner = kind[5:-1]
        if not isinstance(value, list) or len(value) == 0:
            raise ValueError(f"{name} must be a non-empty list, got {_show(value)}.")
        out = [_check_value(f"{name}[{i}]", inner, v) for i, v in enumerate(value)]
        if len(set(out)) != len(out):
            raise ValueError(f"{name} has repeated values: {_show(value)}.")
        return out
    if kind in ("optimizer", "architecture"):
        names = OPTIMIZERS if kind == "optimizer" else structure_names()
        if not isinstance(value, str) or value not in names:
            raise ValueError(
                f"{name}: unknown {kind} {_show(value)}; choose from "
                f"{', '.join(names)}."
            )
        return value
    base, _, bound = kind.partition(">")
    value = _check_type(name, int if base == "int" else float, value)
    if bound == "0" and not value > 0:
        raise ValueError(f"{name} must be > 0, got {_show(value)}.")
    if bound.startswith("=") and not value >= int(bound[1:]):
        raise ValueError(f"{name} must be >= {bound[1:]}, got {_show(value)}.")
    return value


def _check_type(name: str, kind: type, value):
    """Check a value's type: numbers are finite (returned as `float`), integers
    of magnitude below `INT_LIMIT`."""
    if kind is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{name} must be a number, got {_show(value)}.")
        try:
            number = float(value)
        except OverflowError:  # an integer beyond float's range
            number = math.inf
        if not math.isfinite(number):
            raise ValueError(f"{name} must be finite, got {_show(value)}.")
        return number
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name} must be an integer, got {_show(value)}.")
        if abs(value) >= INT_LIMIT:
            raise ValueError(
                f"{name} must be an integer below 2**31, got {_show(value)}."
            )
        return value
    if not isinstance(value, kind):
        raise ValueError(f"{name} must be a {kind.__name__}, got {_show(value)}.")
    return value


def parse_sweep_config(
    mapping: Mapping[str, Any], *, source: str = "<dict>"
) -> SweepConfig:
    """Validate a sweep configuration given as a dict (the parsed TOML).

    Checks every key and value (unknown keys, types, signs, choices; numbers
    finite, integers below 2**31 in magnitude), builds every architecture of
    the grid once (so a bad constructor argument is caught here), and checks
    the sizes against each other (`batch_size <= n_samples`, `width` and
    `teacher_units` within a mixture of experts' `experts`).

    **Arguments:**

    - `mapping`: the configuration (sections `data`, `train`, `grid`,
      `architectures`, `sweep`; see the module docstring).
    - `source`: a name for error messages and the summary (e.g. the file path).

    **Returns:** a `SweepConfig` with every default filled in.

    **Raises:** `ValueError` naming the offending key (`section.key`) and what
    was expected.
    """
    if not isinstance(mapping, Mapping):
        raise ValueError(f"the configuration must be a table, got {mapping!r}.")
    for section in mapping:
        if section not in _SECTIONS:
            raise _unknown("", section, _SECTIONS)
    sections = {}
    for section, schema in _SCHEMA.items():
        given = mapping.get(section, {})
        if not isinstance(given, Mapping):
            raise ValueError(f"[{section}] must be a table, got {given!r}.")
        for key in given:
            if key not in schema:
                raise _unknown(f"{section}.", key, schema)
        values = {}
        for key, (kind, default) in schema.items():
            name = f"{section}.{key}"
            if key in given:
                values[key] = _check_value(name, kind, given[key])
            elif default is _REQUIRED:
                raise ValueError(f"missing required key {name}.")
            else:
                values[key] = default
        sections[section] = values

    given = mapping.get("architectures", {})
    if not isinstance(given, Mapping):
        raise ValueError(f"[architectures] must be a table, got {given!r}.")
    architectures = {}
    for arch, options in given.items():
        if arch not in structure_names():
            raise _unknown("architectures.", arch, structure_names())
        if not isinstance(options, Mapping):
            raise ValueError(f"[architectures.{arch}] must be a table.")
        types = structure_arguments(arch)
        checked = {}
        for key, value in options.items():
            if key not in types:
                raise _unknown(f"architectures.{arch}.", key, types)
            checked[key] = _check_type(f"architectures.{arch}.{key}", types[key], value)
        architectures[arch] = checked

    config = SweepConfig(
        data=sections["data"],
        train=sections["train"],
        grid=sections["grid"],
        sweep=sections["sweep"],
        architectures={
            a: architectures.get(a, {}) for a in sections["grid"]["architecture"]
        },
        source=str(source),
    )
    train_, data = config.train, config.data
    if train_["batch_size"] is not None and train_["batch_size"] > data["n_samples"]:
        raise ValueError(
            f"train.batch_size ({train_['batch_size']}) exceeds data.n_samples "
            f"({data['n_samples']})."
        )
    for arch in config.grid["architecture"]:
        try:
            structure = config.structure(arch)
        except (ValueError, TypeError) as e:
            raise ValueError(f"architectures.{arch}: {e}") from None
        cap = MODELS[train_["model"]].max_units(structure)
        if cap is not None and train_["width"] > cap:
            raise ValueError(
                f"train.width ({train_['width']}) exceeds the {cap} unit(s) the "
                f"{arch} layer holds (`max_units`)."
            )
        cap = structure.max_units
        if cap is not None and data["teacher_units"] > cap:
            raise ValueError(
                f"data.teacher_units ({data['teacher_units']}) exceeds the {cap} "
                f"unit(s) the {arch} layer holds (`max_units`)."
            )
    return config


def load_sweep_config(path: str | os.PathLike) -> SweepConfig:
    """Read and validate a TOML sweep configuration (`tomllib`).

    **Arguments:**

    - `path`: the `.toml` file (see `examples/sweep_small.toml`).

    **Returns:** a `SweepConfig`.

    **Raises:** `ValueError` for a missing or unreadable file, a file that is
    not UTF-8 or not TOML (also nested too deeply, or an integer of more than
    4300 digits), or any problem `parse_sweep_config` finds, the message
    naming the path.
    """
    path = Path(path)
    try:
        with open(path, "rb") as f:
            mapping = tomllib.load(f)
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror or e}.") from None
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{path}: invalid TOML: {e}.") from None
    except UnicodeDecodeError as e:  # TOML is UTF-8
        raise ValueError(
            f"{path}: invalid TOML: not UTF-8 text (byte {e.start}: "
            f"{e.object[e.start : e.start + 1]!r})."
        ) from None
    except ValueError as e:  # int(): "Exceeds the limit (4300 digits) ..."
        reason = str(e).partition(":")[0]
        raise ValueError(f"{path}: invalid TOML: {reason}.") from None
    except RecursionError:  # tomllib reads nested arrays and tables recursively
        raise ValueError(f"{path}: invalid TOML: nested too deeply.") from None
    try:
        return parse_sweep_config(mapping, source=str(path))
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
