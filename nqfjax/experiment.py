r"""Config-driven experiments behind the `nqfjax sweep` and `nqfjax fit` commands.

Everything the command line does is a function here, so that a Python user (or a
notebook) can do the same:

- `load_sweep_config(path)` / `parse_sweep_config(mapping)`: read and validate a
  TOML sweep configuration into a `SweepConfig` (every problem is a `ValueError`
  naming the key, raised before anything is written);
- `run_sweep_config(config, out_dir)`: train the real network at every point of
  the grid with `nqfjax.train`, through the resumable, checkpointed
  `nqfjax.sweep`, and write `results.npz`, `summary.json` and `loss_curves.png`;
- `read_curve_csv(path)`: read a loss curve from a CSV file, with line- and
  column-precise errors;
- `analyse_curve(ts, loss)`: plateaus (`detect_plateaus`), a power law
  (`fit_power_law`) and a power-law spectrum (`fit_spectrum`) of one curve, as a
  JSON-able summary and a figure; `fit_curve_file(path, out_dir)` does it for a
  CSV file and writes `fit.json` and `fit.png`.

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
architecture = ["perceptron"]   # see ARCHITECTURES

[architectures.perceptron]      # optional constructor arguments
d = 4
k = 2

[sweep]
chunk = 4               # grid points per compiled call and checkpoint file
```
"""

import csv
import dataclasses
import difflib
import hashlib
import importlib.metadata
import io
import json
import math
import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax

from .fit import fit_power_law, fit_spectrum
from .structures import (
    Conv1D,
    MixtureOfExperts,
    OVAttention,
    Perceptron,
    QKAttention,
    QuadraticNet,
)
from .structures.base import Structure
from .sweep import _atomic_write, grid_product, sweep
from .theory import detect_plateaus, power_law_exponent
from .train import log_spaced_steps, train


# --------------------------------------------------------------------------------
# the sweep configuration


#: Architectures a sweep may use: name -> (class, {constructor argument: type}).
ARCHITECTURES: dict[str, tuple[type[Structure], dict[str, type]]] = {
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

#: Optimizers a sweep may use: name -> factory `learning_rate -> optax transform`
#: (`None`: plain gradient descent, `optax.sgd`; minibatch SGD with `batch_size`).
OPTIMIZERS = {
    "gd": None,
    "momentum": lambda learning_rate: optax.sgd(learning_rate, momentum=0.9),
    "adam": optax.adam,
}

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
        "model": (("layer", "quadratic"), "layer"),
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

    def structure(self, architecture: str) -> Structure:
        """The `Structure` instance of one architecture of the grid."""
        cls, _ = ARCHITECTURES[architecture]
        return cls(**self.architectures.get(architecture, {}))


def _unknown(where: str, key: str, allowed) -> ValueError:
    allowed = sorted(allowed)
    close = difflib.get_close_matches(key, allowed, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return ValueError(
        f"unknown key {where + key!r}{hint}; allowed: {', '.join(allowed)}."
    )


def _check_value(name: str, kind, value):
    """Check one value against a schema kind; return it (ints as float where a
    float is expected)."""
    if isinstance(kind, tuple):  # a choice of strings
        if not isinstance(value, str) or value not in kind:
            raise ValueError(
                f"{name} must be one of {', '.join(map(repr, kind))}, got {value!r}."
            )
        return value
    if kind.startswith("list["):
        inner = kind[5:-1]
        if not isinstance(value, list) or len(value) == 0:
            raise ValueError(f"{name} must be a non-empty list, got {value!r}.")
        out = [_check_value(f"{name}[{i}]", inner, v) for i, v in enumerate(value)]
        if len(set(out)) != len(out):
            raise ValueError(f"{name} has repeated values: {value!r}.")
        return out
    if kind in ("optimizer", "architecture"):
        names = OPTIMIZERS if kind == "optimizer" else ARCHITECTURES
        if not isinstance(value, str) or value not in names:
            raise ValueError(
                f"{name}: unknown {kind} {value!r}; choose from {', '.join(names)}."
            )
        return value
    base, _, bound = kind.partition(">")
    if base == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name} must be an integer, got {value!r}.")
    else:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{name} must be a number, got {value!r}.")
        value = float(value)
        if not math.isfinite(value):
            raise ValueError(f"{name} must be finite, got {value!r}.")
    if bound == "0" and not value > 0:
        raise ValueError(f"{name} must be > 0, got {value!r}.")
    if bound.startswith("=") and not value >= int(bound[1:]):
        raise ValueError(f"{name} must be >= {bound[1:]}, got {value!r}.")
    return value


def _check_type(name: str, kind: type, value):
    if kind is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{name} must be a number, got {value!r}.")
        return float(value)
    if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise ValueError(f"{name} must be an integer, got {value!r}.")
    if not isinstance(value, kind):
        raise ValueError(f"{name} must be a {kind.__name__}, got {value!r}.")
    return value


def parse_sweep_config(
    mapping: Mapping[str, Any], *, source: str = "<dict>"
) -> SweepConfig:
    """Validate a sweep configuration given as a dict (the parsed TOML).

    Checks every key and value (unknown keys, types, signs, choices), builds
    every architecture of the grid once (so a bad constructor argument is caught
    here), and checks the sizes against each other (`batch_size <= n_samples`,
    `width` and `teacher_units` within a mixture of experts' `experts`).

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
        if arch not in ARCHITECTURES:
            raise _unknown("architectures.", arch, ARCHITECTURES)
        if not isinstance(options, Mapping):
            raise ValueError(f"[architectures.{arch}] must be a table.")
        types = ARCHITECTURES[arch][1]
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
    if max(config.grid["seed"]) >= 2**31:
        raise ValueError(f"grid.seed must be < 2**31, got {max(config.grid['seed'])}.")
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
        cap = structure.max_units
        if cap is not None:
            if train_["model"] == "layer" and train_["width"] > cap:
                raise ValueError(
                    f"train.width ({train_['width']}) exceeds the {cap} unit(s) the "
                    f"{arch} layer holds (`max_units`)."
                )
            if data["teacher_units"] > cap:
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

    **Raises:** `ValueError` for a missing or unreadable file, invalid TOML, or
    any problem `parse_sweep_config` finds, the message starting with the path.
    """
    path = Path(path)
    try:
        with open(path, "rb") as f:
            mapping = tomllib.load(f)
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror or e}.") from None
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{path}: invalid TOML: {e}.") from None
    try:
        return parse_sweep_config(mapping, source=str(path))
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


# --------------------------------------------------------------------------------
# running a sweep


def _versions() -> dict[str, str]:
    out = {}
    for name in ("nqfjax", "jax", "equinox", "optax", "diffrax", "numpy"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:  # pragma: no cover
            out[name] = "unknown"
    return out


def _jsonable(x):
    """Python floats for JSON, with NaN and inf as `null`."""
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_jsonable(v) for v in x]
    if isinstance(x, np.ndarray | jax.Array):
        return _jsonable(np.asarray(x).tolist())
    if isinstance(x, np.generic):
        x = x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def _write_json(path: Path, obj) -> None:
    text = json.dumps(_jsonable(obj), indent=1, allow_nan=False).encode()
    _atomic_write(os.fspath(path), lambda f: f.write(text))


def _write_figure(path: Path, fig) -> None:
    _atomic_write(os.fspath(path), lambda f: fig.savefig(f, format="png", dpi=100))


def _make_data(config: SweepConfig, structure: Structure, dtype):
    """Gaussian inputs and the targets of a teacher of the same architecture:
    `ys = layer(W*, x) - layer(0, x) + noise`, `W* = teacher_scale * N(0, 1)`."""
    data = config.data
    rng = np.random.default_rng(data["seed"])
    xs = rng.standard_normal((data["n_samples"], *structure.input_shape))
    W_star = data["teacher_scale"] * rng.standard_normal(
        (structure.p, data["teacher_units"])
    )
    xs, W_star = jnp.asarray(xs, dtype), jnp.asarray(W_star, dtype)

    def target(x):
        return structure.layer(W_star, x) - structure.layer(jnp.zeros_like(W_star), x)

    ys = np.asarray(jax.jit(jax.vmap(target))(xs))
    ys = ys + data["noise"] * rng.standard_normal(ys.shape)
    return xs, jnp.asarray(ys, dtype)


def _group_tag(config: SweepConfig, optimizer: str, architecture: str) -> str:
    """A fingerprint of everything a group's sweep closes over (its checkpoint
    refuses a directory written with different settings)."""
    meta = {
        "data": config.data,
        "train": config.train,
        "optimizer": optimizer,
        "architecture": architecture,
        "options": config.architectures[architecture],
    }
    digest = hashlib.sha256(json.dumps(meta, sort_keys=True).encode()).hexdigest()
    return f"nqfjax.experiment/{digest[:16]}"


def _first_below(steps: np.ndarray, loss: np.ndarray, fraction: float):
    """The first recorded step at which `loss <= fraction * loss[..., 0]`, per
    curve (NaN where it never gets there)."""
    hit = loss <= fraction * loss[..., :1]
    first = np.argmax(hit, axis=-1)
    return np.where(hit.any(axis=-1), steps[first], np.nan)


def run_sweep_config(
    config: SweepConfig, out_dir: str | os.PathLike, *, progress: bool = True
) -> dict[str, Any]:
    """Train the real network at every point of a configuration's grid and write
    the results.

    The grid is the product of `optimizer x architecture x init_scale x
    learning_rate x seed`. Optimizer and architecture change the program, so
    each `(optimizer, architecture)` group is one `nqfjax.sweep` (one
    compilation) over the product of the traced hyperparameters `init_scale`,
    `learning_rate` and `seed`, each point a `nqfjax.train` run on the same
    teacher data; each group checkpoints to its own subdirectory
    `checkpoint/<optimizer>-<architecture>/`, so an interrupted run resumes by
    calling this again with the same configuration and `out_dir` (finished
    chunks are loaded, not recomputed; a checkpoint written with different
    settings is refused with a `ValueError`). The work runs in the precision
    `train.precision` whatever the global `jax_enable_x64` setting.

    Written to `out_dir` (each file atomically, after the whole grid is done):

    - `results.npz`: `loss` of shape `(n_optimizer, n_architecture,
      n_init_scale, n_learning_rate, n_seed, R)` (NaN once a run diverged),
      `steps` (R,) and the grid axes `optimizer`, `architecture`, `init_scale`,
      `learning_rate`, `seed`;
    - `summary.json`: the configuration, library versions, the chunk counts
      (computed and loaded from the checkpoint) and per run the initial and
      final loss and the first step at which the loss halved;
    - `loss_curves.png`: the loss curves, one panel per group.

    **Arguments:**

    - `config`: a `SweepConfig`.
    - `out_dir`: the output directory (created if needed).
    - `progress`: show a progress bar over each group's chunks.

    **Returns:** the summary (the content of `summary.json`), with `files`
    mapping `results`, `summary`, `figure` and `checkpoint` to their paths.

    **Raises:** `ValueError` for a checkpoint from a different configuration.
    """
    out = Path(out_dir)
    grid, train_ = config.grid, config.train
    dtype = np.float64 if train_["precision"] == "float64" else np.float32
    axes = {
        "init_scale": np.asarray(grid["init_scale"], dtype),
        "learning_rate": np.asarray(grid["learning_rate"], dtype),
        "seed": np.asarray(grid["seed"], np.int32),
    }
    points = grid_product(axes)
    shape = tuple(len(a) for a in axes.values())
    steps = np.asarray(log_spaced_steps(train_["num_steps"], train_["num_records"]))
    groups = [(o, a) for o in grid["optimizer"] for a in grid["architecture"]]
    loss = np.empty(
        (len(grid["optimizer"]), len(grid["architecture"]), *shape, steps.size), dtype
    )
    counts = {"total": 0, "computed": 0, "loaded": 0}

    with jax.enable_x64(train_["precision"] == "float64"):
        for g, (opt_name, arch) in enumerate(groups):
            structure = config.structure(arch)
            xs, ys = _make_data(config, structure, dtype)
            optimizer = OPTIMIZERS[opt_name]

            def point(init_scale, learning_rate, seed):
                return train(
                    structure,
                    xs,
                    ys,
                    num_steps=train_["num_steps"],
                    learning_rate=learning_rate,
                    optimizer=optimizer,
                    key=jr.key(seed),
                    init_scale=init_scale,
                    width=train_["width"],
                    weight_decay=train_["weight_decay"],
                    batch_size=train_["batch_size"],
                    model=train_["model"],
                    record_at=tuple(int(s) for s in steps),
                    snapshots=False,
                ).loss

            if progress:
                print(
                    f"group {g + 1}/{len(groups)}: optimizer={opt_name}, "
                    f"architecture={arch}",
                    flush=True,
                )
            result = sweep(
                point,
                points,
                checkpoint=out / "checkpoint" / f"{opt_name}-{arch}",
                chunk=config.sweep["chunk"],
                progress=progress,
                tag=_group_tag(config, opt_name, arch),
            )
            i, j = divmod(g, len(grid["architecture"]))
            loss[i, j] = np.asarray(result.outputs).reshape(*shape, steps.size)
            counts["total"] += result.n_chunks
            counts["computed"] += result.n_computed
            counts["loaded"] += result.n_loaded

    runs = []
    halved = _first_below(steps, loss, 0.5)
    for idx in np.ndindex(loss.shape[:-1]):
        o, a, s, e, r = idx
        runs.append(
            {
                "optimizer": grid["optimizer"][o],
                "architecture": grid["architecture"][a],
                "init_scale": grid["init_scale"][s],
                "learning_rate": grid["learning_rate"][e],
                "seed": grid["seed"][r],
                "initial_loss": float(loss[idx][0]),
                "final_loss": float(loss[idx][-1]),
                "step_loss_halved": float(halved[idx]),
            }
        )
    files = {
        "results": "results.npz",
        "summary": "summary.json",
        "figure": "loss_curves.png",
        "checkpoint": "checkpoint",
    }
    summary = {
        "config": config.to_dict(),
        "config_file": config.source,
        "versions": _versions(),
        "loss_shape": [
            "optimizer",
            "architecture",
            "init_scale",
            "learning_rate",
            "seed",
            "step",
        ],
        "steps": steps,
        "chunks": counts,
        "runs": runs,
        "files": files,
    }

    out.mkdir(parents=True, exist_ok=True)
    arrays = {
        "loss": loss,
        "steps": steps,
        "optimizer": np.asarray(grid["optimizer"]),
        "architecture": np.asarray(grid["architecture"]),
        **{name: a for name, a in axes.items()},
    }
    _atomic_write(os.fspath(out / files["results"]), lambda f: np.savez(f, **arrays))
    _write_figure(out / files["figure"], _sweep_figure(steps, loss, grid))
    _write_json(out / files["summary"], summary)
    summary["files"] = {k: out / v for k, v in files.items()}
    return summary


def _sweep_figure(steps, loss, grid):
    """One log-log panel of loss curves per `(optimizer, architecture)` group:
    colour by init scale, line style by learning rate (seeds share both)."""
    from matplotlib.figure import Figure

    n_o, n_a = loss.shape[:2]
    fig = Figure(figsize=(4.2 * n_a, 3.4 * n_o), layout="constrained")
    axes = fig.subplots(n_o, n_a, squeeze=False)
    colours = [f"C{i % 10}" for i in range(len(grid["init_scale"]))]
    styles = ["-", "--", ":", "-."]
    t = np.maximum(steps, 0.5)  # step 0 drawn at 0.5 on the log axis
    for o, a in np.ndindex(n_o, n_a):
        ax = axes[o, a]
        for s, lr, seed in np.ndindex(loss.shape[2:5]):
            curve = loss[o, a, s, lr, seed]
            label = None
            if seed == 0:
                label = (
                    f"σ={grid['init_scale'][s]:.3g}, η={grid['learning_rate'][lr]:.3g}"
                )
            ax.loglog(
                t,
                curve,
                styles[lr % 4],
                color=colours[s],
                lw=1.2,
                alpha=0.8,
                label=label,
            )
        ax.set_title(f"{grid['optimizer'][o]}, {grid['architecture'][a]}", fontsize=10)
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.legend(fontsize=7)
    return fig


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
MIN_POINTS = 10


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
    rows = csv.reader(io.StringIO("\n".join(line for _, line in lines)))
    header = [h.strip().lower() for h in next(rows)]

    def find(name: str, what: str, hint: str) -> int:
        if name.strip().lower() not in header:
            raise ValueError(
                f"{path}: missing {what} column {name!r} in the header (line "
                f"{lines[0][0]}: {', '.join(map(repr, header))}){hint}."
            )
        return header.index(name.strip().lower())

    if time_column is None:
        present = [c for c in TIME_COLUMNS if c in header]
        if not present:
            raise ValueError(
                f"{path}: missing time column: none of "
                f"{', '.join(map(repr, TIME_COLUMNS))} in the header (line "
                f"{lines[0][0]}: {', '.join(map(repr, header))}); name it with "
                "--time-column."
            )
        time_column = present[0]
    i_t = find(time_column, "time", "; name it with --time-column")
    i_l = find(loss_column, "loss", "; name it with --loss-column")

    ts, loss = [], []
    for (n, _), row in zip(lines[1:], rows):
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
                    f"{path}, line {n}, column {col!r}: {cell!r} is not a number."
                ) from None
            if not math.isfinite(value):
                raise ValueError(
                    f"{path}, line {n}, column {col!r}: {cell!r} is not finite."
                )
            if value < 0:
                what = "time (steps)" if col == time_column else "loss"
                raise ValueError(
                    f"{path}, line {n}, column {col!r}: negative {what} {cell}."
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


def analyse_curve(
    ts,
    loss,
    *,
    modes: int | None = 200,
    total_modes: float = float("inf"),
    spectrum_method: str = "logistic",
    progress: bool = False,
):
    r"""Plateaus, power law and spectrum of one loss curve.

    Three analyses, each of which may fail on its own (its entry of the summary
    is then `{"error": message}`):

    - `plateaus`: `detect_plateaus` on the points with `t > 0`: start, end and
      level of each plateau and the times of the drops between them;
    - `power_law`: `fit_power_law`, $L = L_\infty + c\,(t + t_0)^{-\gamma}$ on
      an automatically chosen window;
    - `spectrum`: `fit_spectrum` with `modes` independent modes: the spectral
      exponents `alpha`, `beta` of the power-law Lotka-Volterra model that
      reproduces the curve, and the exponents the theory predicts from them
      (`gamma_rich`, `gamma_lazy`, THEORY.md section 5) to compare with the
      fitted `gamma`. Skipped with `modes=None`.

    The fits run in float64 whatever the global `jax_enable_x64` setting.

    **Arguments:**

    - `ts`, `loss`: the curve, 1-D, times strictly increasing and `>= 0`.
    - `modes`: number of modes of the spectrum model (`None`: skip it).
    - `total_modes`: the number of modes of the spectrum behind the curve; those
      beyond `modes` enter the model as a continuum tail (`fit_spectrum`'s
      `n_modes`; default `inf`, an unbounded power-law spectrum).
    - `spectrum_method`: `"logistic"` (closed form, fast) or `"solve_lv"`
      (through the ODE solver, slow).
    - `progress`: show a progress bar over the three analyses.

    **Returns:** `(summary, figure)`: a JSON-able dict and a
    `matplotlib.figure.Figure` (the curve on log-log axes with the plateaus, the
    fitted power law and its window, and the fitted spectrum model).
    """
    from tqdm import tqdm

    ts = np.asarray(ts, np.float64)
    loss = np.asarray(loss, np.float64)
    summary: dict[str, Any] = {
        "n_points": int(ts.size),
        "t_range": [float(ts[0]), float(ts[-1])],
        "loss_range": [float(loss.min()), float(loss.max())],
    }
    curves: dict[str, Any] = {}
    tasks = ["plateaus", "power_law"] + ([] if modes is None else ["spectrum"])
    bar = tqdm(tasks, desc="fit", unit="step", disable=not progress)
    with jax.enable_x64(True):
        for name in bar:
            bar.set_postfix_str(name)
            try:
                if name == "plateaus":
                    pos = ts > 0
                    pl = detect_plateaus(ts[pos], loss[pos])
                    curves["plateaus"] = pl
                    summary[name] = {
                        "count": len(pl),
                        "start": pl.start,
                        "end": pl.end,
                        "level": pl.level,
                        "drop_times": pl.drop_times,
                    }
                elif name == "power_law":
                    fit = fit_power_law(ts, loss)
                    curves["power_law"] = fit
                    summary[name] = {
                        "gamma": float(fit.gamma),
                        "gamma_err": float(fit.gamma_err),
                        "L_inf": float(fit.L_inf),
                        "c": float(fit.c),
                        "t0": float(fit.t0),
                        "window": list(fit.window),
                        "n_points": fit.n_points,
                        "rms_log": float(fit.rms),
                    }
                else:
                    spec = fit_spectrum(
                        ts,
                        loss,
                        p=modes,
                        n_modes=max(total_modes, modes),
                        method=spectrum_method,
                    )
                    curves["spectrum"] = spec
                    a, b = float(spec.alpha), float(spec.beta)
                    try:
                        lazy = power_law_exponent(a, b, "lazy")
                    except ValueError:
                        lazy = float("nan")
                    summary[name] = {
                        "alpha": a,
                        "beta": b,
                        "alpha_err": float(spec.alpha_err),
                        "beta_err": float(spec.beta_err),
                        "eps": float(spec.eps),
                        "rate": float(spec.rate),
                        "amplitude": float(spec.amplitude),
                        "gamma_rich": float(spec.gamma),
                        "gamma_lazy": lazy,
                        "modes": spec.p,
                        "method": spec.method,
                        "rms_log": float(spec.rms),
                    }
            except (ValueError, RuntimeError) as e:  # a failed fit, reported
                summary[name] = {"error": " ".join(str(e).split())}
        # the fitted curves, evaluated in float64 too
        if "power_law" in curves:
            lo, hi = curves["power_law"].window
            tt = np.geomspace(max(lo, ts[ts > 0][0]), hi, 100)
            curves["power_law_curve"] = (tt, np.asarray(curves["power_law"](tt)))
        if "spectrum" in curves:
            curves["spectrum_curve"] = np.asarray(curves["spectrum"].loss(ts))
    bar.close()
    return _jsonable(summary), _curve_figure(ts, loss, curves, summary)


def _curve_figure(ts, loss, curves, summary):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 4.6), layout="constrained")
    ax = fig.subplots()
    pos = (ts > 0) & (loss > 0)
    ax.loglog(ts[pos], loss[pos], "k-", lw=2.2, alpha=0.7, label="data")
    if "plateaus" in curves:
        pl = curves["plateaus"]
        for i, (s, e, lvl) in enumerate(
            zip(np.asarray(pl.start), np.asarray(pl.end), np.asarray(pl.level))
        ):
            ax.hlines(
                lvl,
                s,
                e,
                colors="C1",
                lw=3,
                alpha=0.8,
                label="plateaus" if i == 0 else None,
            )
        for i, td in enumerate(np.asarray(pl.drop_times)):
            ax.axvline(
                td, color="C1", lw=0.8, ls=":", label="drops" if i == 0 else None
            )
    if "power_law_curve" in curves:
        lo, hi = summary["power_law"]["window"]
        ax.axvspan(lo, hi, color="C0", alpha=0.1, label="power-law window")
        tt, fitted = curves["power_law_curve"]
        g = summary["power_law"]["gamma"]
        ax.loglog(
            tt,
            fitted,
            "C0--",
            lw=1.5,
            label=rf"power law, $\gamma$ = {g:.3f}",
        )
    if "spectrum_curve" in curves:
        s = summary["spectrum"]
        model = curves["spectrum_curve"]
        keep = pos & (model > 0)
        ax.loglog(
            ts[keep],
            model[keep],
            "C2:",
            lw=1.5,
            label=rf"spectrum: $\alpha$ = {s['alpha']:.2f}, $\beta$ = {s['beta']:.2f}",
        )
    ax.set_xlabel("t (steps)")
    ax.set_ylabel("loss")
    ax.set_title("Loss curve analysis")
    ax.legend(fontsize=8)
    return fig


def fit_curve_file(
    path: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    time_column: str | None = None,
    loss_column: str = "loss",
    modes: int | None = 200,
    total_modes: float = float("inf"),
    spectrum_method: str = "logistic",
    progress: bool = True,
) -> dict[str, Any]:
    """Read a loss curve from CSV (`read_curve_csv`), analyse it
    (`analyse_curve`) and write `fit.json` and `fit.png` to `out_dir`
    (atomically; nothing is written if the CSV is malformed).

    **Arguments:**

    - `path`: the CSV file; `time_column`, `loss_column`: as `read_curve_csv`.
    - `out_dir`: the output directory (created if needed).
    - `modes`, `total_modes`, `spectrum_method`, `progress`: as `analyse_curve`.

    **Returns:** the summary (the content of `fit.json`), with `files` mapping
    `summary` and `figure` to their paths.

    **Raises:** `ValueError` from `read_curve_csv`, or for a bad `modes` or
    `spectrum_method`.
    """
    if modes is not None and (
        isinstance(modes, bool) or not isinstance(modes, int) or modes < 1
    ):
        raise ValueError(f"`modes` must be a positive integer, got {modes!r}.")
    if spectrum_method not in ("logistic", "solve_lv"):
        raise ValueError(
            "`spectrum_method` must be 'logistic' or 'solve_lv', got "
            f"{spectrum_method!r}."
        )
    curve = read_curve_csv(path, time_column=time_column, loss_column=loss_column)
    summary, fig = analyse_curve(
        curve.ts,
        curve.loss,
        modes=modes,
        total_modes=total_modes,
        spectrum_method=spectrum_method,
        progress=progress,
    )
    files = {"summary": "fit.json", "figure": "fit.png"}
    summary = {
        "source": str(path),
        "columns": {"time": curve.time_column, "loss": curve.loss_column},
        **summary,
        "versions": _versions(),
        "files": files,
    }
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _write_figure(out / files["figure"], fig)
    _write_json(out / files["summary"], summary)
    summary["files"] = {k: out / v for k, v in files.items()}
    return summary
