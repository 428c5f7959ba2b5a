r"""The TOML sweep behind `nqfjax sweep`: a validated configuration and its run.

- `load_sweep_config(path)` / `parse_sweep_config(mapping)`: read and validate a
  TOML sweep configuration into a `SweepConfig` (every problem is a `ValueError`
  naming the key, raised before anything is written);
- `run_sweep_config(config, out_dir)`: train the real network at every point of
  the grid with `nqfjax.train`, through the resumable, checkpointed
  `nqfjax.sweep`, and write `results.npz`, `summary.json` and `loss_curves.png`;

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
import hashlib
import json
import math
import os
import tomllib
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np

from .. import plots
from .._curves import first_crossing
from ..engines.train import log_spaced_steps, train
from ..io import atomic_write, check_output_dir, versions, write_figure, write_json
from ..structures.base import Structure
from ..structures.registry import (
    make_structure,
    structure_arguments,
    structure_names,
)
from ..sweep import defer_interrupts, grid_product, sweep
from ._optimizers import (
    OPTIMIZERS as OPTIMIZERS,  # the one table: word -> optax factory (None: GD)
)
from .predict import predict


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
        return make_structure(architecture, **self.architectures.get(architecture, {}))


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
        names = OPTIMIZERS if kind == "optimizer" else structure_names()
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


#: A run counts as diverged from the first recorded step at which its loss is not
#: finite or exceeds `DIVERGENCE_FACTOR` times its (positive) loss at step 0.
DIVERGENCE_FACTOR = 1e3


def _diverged_at(steps: np.ndarray, loss: np.ndarray):
    """The first recorded step at which a curve diverged (see `DIVERGENCE_FACTOR`),
    per curve (NaN where it did not)."""
    initial = loss[..., :1]
    with np.errstate(invalid="ignore", over="ignore"):
        bad = ~np.isfinite(loss) | (
            (initial > 0) & (loss > DIVERGENCE_FACTOR * initial)
        )
    first = np.argmax(bad, axis=-1)
    return np.where(bad.any(axis=-1), steps[first], np.nan)


def _predicted_switch_on(config, structure, xs, ys, steps) -> tuple[np.ndarray, str]:
    """The theory's switch-on times of a full-batch GD group at each `(init_scale,
    learning_rate)`, shape `(n_init_scale, n_learning_rate, K)` (NaN-padded), from
    the first seed's initial weights (`predict`: the Lotka-Volterra reduction where
    the data allow, else the M-space flow); and which engine, or why none."""
    grid, train_ = config.grid, config.train
    if train_["batch_size"] is not None:
        return np.full((0, 0, 0), np.nan), "none: minibatch training (SGD)"
    scales, rates = grid["init_scale"], grid["learning_rate"]
    times, why = {}, ""
    for s, r in np.ndindex(len(scales), len(rates)):
        try:
            pred = predict(
                structure,
                xs,
                ys,
                init_scale=float(scales[s]),
                learning_rate=float(rates[r]),
                width=train_["width"],
                key=jr.key(grid["seed"][0]),
                ts=steps,
                weight_decay=train_["weight_decay"],
            )
        except ValueError as e:  # the runs stand; the summary says why no ticks
            return np.full((0, 0, 0), np.nan), f"none: predict failed ({e})"
        times[s, r], why = np.asarray(pred.switch_times, float), pred.reason
    K = max((t.size for t in times.values()), default=0)
    out = np.full((len(scales), len(rates), K), np.nan)
    for (s, r), t in times.items():
        out[s, r, : t.size] = t
    return out, why


def _run_groups(config, out, points, shape, steps, progress, interrupted):
    """One `nqfjax.sweep` per `(optimizer, architecture)` group; returns the loss
    array, the chunk counts and the checkpoint's warnings (damaged chunks)."""
    grid, train_ = config.grid, config.train
    dtype = np.float64 if train_["precision"] == "float64" else np.float32
    groups = [(o, a) for o in grid["optimizer"] for a in grid["architecture"]]
    loss = np.empty(
        (len(grid["optimizer"]), len(grid["architecture"]), *shape, steps.size), dtype
    )
    counts = {"total": 0, "computed": 0, "loaded": 0, "damaged": []}
    notes, theory = [], {}
    with jax.enable_x64(train_["precision"] == "float64"):
        for g, (opt_name, arch) in enumerate(groups):
            if interrupted():
                raise KeyboardInterrupt
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

            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                result = sweep(
                    point,
                    points,
                    checkpoint=out / "checkpoint" / f"{opt_name}-{arch}",
                    chunk=config.sweep["chunk"],
                    progress=f"{opt_name}-{arch} ({g + 1}/{len(groups)})"
                    if progress
                    else False,
                    tag=_group_tag(config, opt_name, arch),
                )
            for w in caught:  # the checkpoint's go to the summary, others on
                if str(w.message).startswith("checkpoint chunk "):
                    notes.append(str(w.message))
                else:
                    warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
            i, j = divmod(g, len(grid["architecture"]))
            loss[i, j] = np.asarray(result.outputs).reshape(*shape, steps.size)
            counts["total"] += result.n_chunks
            counts["computed"] += result.n_computed
            counts["loaded"] += result.n_loaded
            counts["damaged"] += list(result.damaged)
            if opt_name == "gd":  # the theory is gradient flow's (GD, not Adam)
                theory[i, j] = _predicted_switch_on(config, structure, xs, ys, steps)
    return loss, counts, notes, theory


def _runs(config, steps, loss) -> tuple[list[dict], list[int]]:
    """Per run its grid point, initial and final loss, the step where the loss
    halved and where it diverged; and the indices of the diverged runs."""
    grid = config.grid
    halved = first_crossing(
        steps, np.moveaxis(loss, -1, 0), 0.5 * loss[..., 0], interpolate="step"
    )
    diverged = _diverged_at(steps, loss)
    runs = []
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
                "diverged": bool(np.isfinite(diverged[idx])),
                "step_diverged": float(diverged[idx]),
            }
        )
    return runs, [k for k, run in enumerate(runs) if run["diverged"]]


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
    teacher data; each group checkpoints to its own subfolder
    `checkpoint/<optimizer>-<architecture>/`, so an interrupted run resumes by
    calling this again with the same configuration and `out_dir` (finished
    chunks are loaded, not recomputed; damaged ones are recomputed; a checkpoint
    written with different settings is refused with a `ValueError`). A SIGINT
    stops it at the next chunk boundary with `KeyboardInterrupt`, the
    checkpoint whole. The work runs in the precision `train.precision` whatever
    the global `jax_enable_x64` setting.

    A run *diverged* from the first recorded step at which its loss is not finite
    or above `DIVERGENCE_FACTOR` (1000) times its loss at step 0; divergence is a
    result, not an error: such runs are counted and listed in the summary.

    Written to `out_dir` (each file atomically, after the whole grid is done;
    `results.npz` last, so that it exists only once all is written):

    - `results.npz`: `loss` of shape `(n_optimizer, n_architecture,
      n_init_scale, n_learning_rate, n_seed, R)` (NaN once a run diverged),
      `steps` (R,) and the grid axes `optimizer`, `architecture`, `init_scale`,
      `learning_rate`, `seed`;
    - `summary.json`: the configuration, library versions, the chunk counts
      (computed, loaded from the checkpoint, and the damaged chunk files
      recomputed, with `checkpoint_warnings` saying why), per run the initial
      and final loss, the first step at which the loss halved and the step at
      which it diverged (`null` if it did not), and `diverged` (the criterion,
      the count and the indices of the diverged runs in `runs`), and
      `predicted_switch_on`: for each full-batch GD group, the theory's
      switch-on times of each mode at each `(init_scale, learning_rate)` from
      the first seed's initial weights (`predict`: the Lotka-Volterra reduction
      where the data allow, else the M-space flow; which one, and why, in
      `engine`);
    - `loss_curves.png`: the loss curves, one panel per group, with those
      predicted switch-on times as ticks.

    **Arguments:**

    - `config`: a `SweepConfig`.
    - `out_dir`: the output folder (created if needed; checked before any work).
    - `progress`: show a progress bar per group (tracing, compiling, chunks).

    **Returns:** the summary (the content of `summary.json`), with `files`
    mapping `results`, `summary`, `figure` and `checkpoint` to their paths.

    **Raises:** `ValueError` for an output folder that cannot be created or
    written, or a checkpoint from a different configuration or that cannot be
    read (the file named); `KeyboardInterrupt` after a SIGINT.
    """
    out = check_output_dir(out_dir, "out_dir")
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

    # the outputs are written inside the block too (a SIGINT while they are
    # written waits for the safe point before results.npz)
    with defer_interrupts() as interrupted:
        loss, counts, notes, theory = _run_groups(
            config, out, points, shape, steps, progress, interrupted
        )
        switch_on = np.full((*loss.shape[:4], 0), np.nan)
        if theory:
            K = max(t.shape[-1] for t, _ in theory.values())
            switch_on = np.full((*loss.shape[:4], K), np.nan)
            for (i, j), (t, _) in theory.items():
                switch_on[i, j, : t.shape[0], : t.shape[1], : t.shape[2]] = t
        runs, diverged = _runs(config, steps, loss)
        files = {
            "results": "results.npz",
            "summary": "summary.json",
            "figure": "loss_curves.png",
            "checkpoint": "checkpoint",
        }
        summary = {
            "config": config.to_dict(),
            "config_file": config.source,
            "versions": versions(),
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
            "checkpoint_warnings": notes,
            "diverged": {
                "criterion": "a recorded loss not finite or above "
                f"{DIVERGENCE_FACTOR:g} x the loss at step 0",
                "count": len(diverged),
                "runs": diverged,
            },
            "runs": runs,
            "predicted_switch_on": {
                f"{grid['optimizer'][i]}-{grid['architecture'][j]}": {
                    "engine": why,
                    "seed": grid["seed"][0],
                    "times": t,  # [init_scale][learning_rate][mode], in steps
                }
                for (i, j), (t, why) in theory.items()
            },
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
        write_figure(
            out / files["figure"],
            plots.plot_sweep(steps, loss, grid, switch_on=switch_on),
        )
        write_json(out / files["summary"], summary)
        # a safe point: the block may be nested in a caller's (the CLI's), whose
        # exit, not this one's, raises; an interrupt that came stops here, before
        # results.npz, which is written last: it exists only when all is done
        if interrupted():
            raise KeyboardInterrupt
        atomic_write(os.fspath(out / files["results"]), lambda f: np.savez(f, **arrays))
    summary["files"] = {k: out / v for k, v in files.items()}
    return summary
