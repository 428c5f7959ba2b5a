r"""Running a TOML sweep (`nqfjax sweep`): `run_sweep_config(config, out_dir)`
trains the real network at every point of the grid of a `SweepConfig` with
`nqfjax.train`, through the resumable, checkpointed `nqfjax.sweep`, and writes
`results.npz`, `summary.json` and `loss_curves.png`. The configuration itself
(reading and validating the TOML) is `sweep_config.py`.
"""

import hashlib
import json
import os
import warnings
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np

from .. import plots
from .._curves import first_crossing
from ..engines.train import log_spaced_steps, train
from ..io import atomic_write, check_output_dir, versions, write_figure, write_json
from ..progress import AbstractProgressMeter
from ..structures.base import AbstractStructure
from ..structures.models import MODELS
from ..sweep import CheckpointWarning, defer_interrupts, grid_product, sweep
from ._outcomes import DictView
from .predict import predict
from .sweep_config import OPTIMIZERS, SweepConfig


def _make_data(config: SweepConfig, structure: AbstractStructure, dtype):
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

#: The criterion in words (`summary.json`, `nqfjax sweep`).
DIVERGENCE_CRITERION = (
    f"a recorded loss not finite or above {DIVERGENCE_FACTOR:g} x the loss at step 0"
)


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
                    model=MODELS[train_["model"]],
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
                    if progress is True
                    else progress,
                    tag=_group_tag(config, opt_name, arch),
                )
            for w in caught:  # the checkpoint's go to the summary, others on
                if issubclass(w.category, CheckpointWarning):
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


_FILES = {
    "results": "results.npz",
    "summary": "summary.json",
    "figure": "loss_curves.png",
    "checkpoint": "checkpoint",
}


def _switch_on_array(shape, theory) -> np.ndarray:
    """The GD groups' predicted switch-on times in one NaN-padded array of
    shape `(*shape, K)` (`shape`: optimizer, architecture, init scale,
    learning rate)."""
    K = max((t.shape[-1] for t, _ in theory.values()), default=0)
    switch_on = np.full((*shape, K), np.nan)
    for (i, j), (t, _) in theory.items():
        switch_on[i, j, : t.shape[0], : t.shape[1], : t.shape[2]] = t
    return switch_on


def _summary(config, steps, loss, counts, notes, theory) -> dict[str, Any]:
    """The content of `summary.json`."""
    grid = config.grid
    runs, diverged = _runs(config, steps, loss)
    return {
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
            "criterion": DIVERGENCE_CRITERION,
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
        "files": dict(_FILES),
    }


def _write(out, grid, axes, steps, loss, switch_on, summary, interrupted) -> None:
    """The figure, `summary.json` and, last, `results.npz` (inside the caller's
    `defer_interrupts` block: an interrupt stops before `results.npz`)."""
    files = summary["files"]
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


class SweepOutput(DictView):
    """What `run_sweep_config` computed and wrote.

    **Fields:**

    - `config`: the `SweepConfig`.
    - `steps`: the recorded steps, shape `(R,)`.
    - `loss`: shape `(n_optimizer, n_architecture, n_init_scale,
      n_learning_rate, n_seed, R)` (as `results.npz`).
    - `step_diverged`: the first recorded step at which each run diverged
      (`DIVERGENCE_CRITERION`), NaN where it did not; `loss.shape[:-1]`.
    - `predicted_switch_on`: the theory's switch-on times of each mode for the
      full-batch GD groups, shape `(n_optimizer, n_architecture, n_init_scale,
      n_learning_rate, K)`, NaN-padded (NaN for the other groups).
    - `n_chunks`, `n_computed`, `n_loaded`: the checkpoint chunks over every
      group, computed by this call and loaded.
    - `damaged`: the chunk files found damaged and recomputed (each group's
      `SweepResult.damaged`); `checkpoint_warnings`: the checkpoint's
      `CheckpointWarning`s, each saying which file and why.
    - `files`: the paths of `results`, `summary`, `figure` and `checkpoint`.

    Reading it as the dict `run_sweep_config` used to return (the content of
    `summary.json`) is deprecated (one release).
    """

    config: SweepConfig = eqx.field(static=True)
    steps: np.ndarray
    loss: np.ndarray
    step_diverged: np.ndarray
    predicted_switch_on: np.ndarray
    n_chunks: int = eqx.field(static=True)
    n_computed: int = eqx.field(static=True)
    n_loaded: int = eqx.field(static=True)
    damaged: tuple[str, ...] = eqx.field(static=True)
    checkpoint_warnings: tuple[str, ...] = eqx.field(static=True)
    files: dict[str, Path] = eqx.field(static=True)

    @property
    def criterion(self) -> str:
        """When a run counts as diverged, in words."""
        return DIVERGENCE_CRITERION

    def as_dict(self) -> dict[str, Any]:
        """The content of `summary.json`, with `files` mapped to their paths."""
        summary = json.loads(Path(self.files["summary"]).read_text())
        return {**summary, "files": self.files}


def run_sweep_config(
    config: SweepConfig,
    out_dir: str | os.PathLike,
    *,
    progress: bool | AbstractProgressMeter = True,
) -> SweepOutput:
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
    - `progress`: a progress bar per group (tracing, compiling, chunks): `True`
      for a `tqdm` bar labelled with the group, `False` for none, or a meter
      (`nqfjax.AbstractProgressMeter`).

    **Returns:** a `SweepOutput`: the loss curves, the steps where runs
    diverged, the predicted switch-on times, the chunk counts and damaged chunk
    files, and the paths of `results`, `summary`, `figure` and `checkpoint`.

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
        switch_on = _switch_on_array(loss.shape[:4], theory)
        summary = _summary(config, steps, loss, counts, notes, theory)
        _write(out, grid, axes, steps, loss, switch_on, summary, interrupted)
        files = summary["files"]
    return SweepOutput(
        config=config,
        steps=steps,
        loss=loss,
        step_diverged=_diverged_at(steps, loss),
        predicted_switch_on=switch_on,
        n_chunks=counts["total"],
        n_computed=counts["computed"],
        n_loaded=counts["loaded"],
        damaged=tuple(counts["damaged"]),
        checkpoint_warnings=tuple(notes),
        files={k: out / v for k, v in files.items()},
    )
