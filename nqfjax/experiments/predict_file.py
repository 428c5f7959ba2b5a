"""`nqfjax predict`: a prediction for a data file or a bundled data set, sized
from the data, written as JSON and a figure, optionally against real training."""

import json
import os
import warnings
from pathlib import Path
from typing import Any

import equinox as eqx
import jax.random as jr
import numpy as np

from .. import plots
from .._checks import static_int
from ..data import load_data_file, load_dataset
from ..engines.train import TrainResult, train
from ..io import jsonable, versions, write_figure, write_json
from ..progress import AbstractProgressMeter, as_progress_meter
from ..structures.base import AbstractStructure
from ..structures.registry import structure_arguments, structure_class
from ..tasks.sampled import task_from_samples
from ._outcomes import DictView
from .engines import AbstractEngine, engine_from_word
from .predict import Agreement, Prediction, agreement, predict


# --------------------------------------------------------------------------------
# `nqfjax predict`: a data file (or a bundled data set) to a figure and JSON

# The default number of units. The prediction is the layer's quadratic form; the
# real layer's cubic term is shared by the units, so the trained network follows
# the prediction better the wider it is, and `M = W W^T` has rank at most the
# width. Chosen by measuring `nqfjax predict --train` at widths 4, 16 and 64 (the
# table is in docs/how-to/data.md, "The width", and in the command's help).
DEFAULT_WIDTH = 64


def structure_for_data(
    arch: str, xs: np.ndarray, ys: np.ndarray, arch_args: dict | None = None
) -> AbstractStructure:
    """The architecture `arch` (a name of the sweep configuration's table,
    `"perceptron"`, `"quadratic"`, `"conv1d"`, `"qk_attention"`, `"ov_attention"`,
    `"moe"`) sized for inputs `xs` (shape `(n, d)`, or `(n, T, d)` for attention)
    and targets `ys` (shape `(n, k)`); `arch_args` sets its other constructor
    arguments (e.g. `{"kernel_size": 5}`; default kernel size: `min(5, d)`).

    **Raises:** `ValueError` for an unknown name, an unknown or size-fixing
    argument, or data of the wrong shape for the architecture.
    """
    try:
        cls, allowed = structure_class(arch), structure_arguments(arch)
    except ValueError as e:
        raise ValueError(str(e).replace("`name`", "`arch`", 1)) from None
    args = dict(arch_args or {})
    sizes = {"d", "k", "T", "length"}
    for name, value in args.items():
        if name not in allowed or name in sizes:
            free = sorted(set(allowed) - sizes)
            raise ValueError(
                f"`{name}` is not an argument of {arch!r} that can be set (sizes "
                f"come from the data; allowed: {free})."
            )
        kind = allowed[name]
        if kind is bool and not isinstance(value, bool):
            raise ValueError(f"`{name}` of {arch!r} must be true or false.")
        if kind is not bool and not isinstance(value, kind | int):
            raise ValueError(f"`{name}` of {arch!r} must be a {kind.__name__}.")
    n, k = xs.shape[0], ys.shape[1]
    sequence = arch in ("qk_attention", "ov_attention")
    want = 3 if sequence else 2
    if xs.ndim != want:
        shape = "(n, T, d)" if sequence else "(n, d)"
        raise ValueError(
            f"{arch!r} needs inputs of shape {shape}, got xs of shape {xs.shape}."
        )
    if arch in ("quadratic", "conv1d") and k != 1:
        raise ValueError(f"{arch!r} has one output; the targets have k = {k} columns.")
    if arch == "perceptron" or arch == "moe":
        return cls(d=xs.shape[1], k=k, **args)
    if arch == "quadratic":
        return cls(d=xs.shape[1], **args)
    if arch == "conv1d":
        args.setdefault("kernel_size", min(5, xs.shape[1]))
        return cls(length=xs.shape[1], **args)
    del n
    return cls(T=xs.shape[1], d=xs.shape[2], k=k, **args)


def default_hyperparameters(
    structure: AbstractStructure, xs, ys, init_scale: float, num_switches: int = 3
) -> tuple[float, int]:
    r"""`(learning_rate, num_steps)` for a prediction: the rate that makes the
    fastest linear growth rate $r_1 = 4\eta\lambda_1(C) = 0.01$ per step (small,
    so that gradient descent lags the flow by about $r/4 = 0.25\%$), and a
    horizon of $2.5 \ln(1/\sigma^2) / r_j$ steps, with $r_j$ the growth rate of
    the `num_switches`-th positive eigenvalue of `C` (the last mode of interest
    then switches on about 40% of the way)."""
    task = task_from_samples(structure, xs, ys)
    c = np.sort(np.linalg.eigvalsh(np.asarray(task.C, np.float64)))[::-1]
    if not c[0] > 0:
        raise ValueError(
            "The targets are uncorrelated with the inputs: C has no "
            "positive eigenvalue, so no mode grows."
        )
    learning_rate = 0.01 / (4.0 * c[0])
    positive = c[c > 1e-6 * c[0]]
    r_j = 0.01 * positive[min(num_switches, len(positive)) - 1] / c[0]
    return learning_rate, int(np.ceil(2.5 * np.log(1.0 / init_scale**2) / r_j))


def _summary(source, xs, arch, structure, hyper, P, trained, a) -> dict[str, Any]:
    """The content of `prediction.json` (less versions and files)."""
    ons = P.switch_ons
    labels = ons.groups
    summary: dict[str, Any] = {
        "source": source,
        "samples": int(xs.shape[0]),
        "architecture": {"name": arch, "p": structure.p, "k": structure.k},
        "hyperparameters": hyper,
        "engine": P.engine,
        "reason": P.reason,
        "violation": P.violation,
        "growth_rate": P.growth_rate,
        "switch_times": P.switch_times,
        "switch_threshold": P.switch_ons.threshold,
        "switch_groups": [
            {"mean": float(m), "spread": float(s), "size": int(np.sum(labels == j))}
            for j, (m, s) in enumerate(zip(ons.group_times, ons.group_spreads))
        ],
        "plateaus": P.plateaus,
        "mode_values": P.mode_values,
        "validity": {
            "verdict": P.validity.verdict,
            "tolerance": P.validity.tolerance,
            "breaks_at": P.validity.breaks_at,
            "discretisation_lag": P.validity.discretisation_lag,
            "t": P.validity.ts,
            "departure": P.validity.departure,
            "expected_shift": P.validity.expected_shift,
        },
        "curve": {"t": P.ts, "loss": P.loss},
    }
    if trained is None:
        return summary
    summary["trained"] = {"t": trained.ts, "loss": trained.loss}
    summary["agreement"] = {
        "switch_on": [
            {"predicted": p, "measured": m, "relative_error": e, "overlap": o}
            for p, m, e, o in zip(
                np.asarray(a.predicted_times).tolist(),
                np.asarray(a.measured_times).tolist(),
                np.asarray(a.time_errors).tolist(),
                np.asarray(a.subspace_overlaps).tolist(),
            )
        ],
        "log_loss_departure": a.log_loss_departure,
        "up_to": a.horizon,
    }
    return summary


def _load(data, dataset, n) -> tuple[np.ndarray, np.ndarray, str]:
    """`(xs, ys, source)` from a data file or a bundled data set."""
    if (data is None) == (dataset is None):
        raise ValueError("Give exactly one of a data file and `dataset`.")
    if data is not None:
        return *load_data_file(data), str(data)
    return *load_dataset(dataset, n=n), f"dataset:{dataset}"


class PredictOutput(DictView):
    """What `predict_file` predicted, trained and wrote.

    **Fields:**

    - `source`: the data file, or `dataset:NAME`.
    - `prediction`: the `Prediction` (engine, why, switch-on times, curve, ...).
    - `trained`: the `TrainResult` of the real network (`train_network`), or
      `None`; `agreement`: its `Agreement` with the prediction, or `None`.
    - `learning_rate`, `num_steps`: those used (given, or the defaults of
      `default_hyperparameters`).
    - `files`: the paths of `summary` (`prediction.json`) and `figure`
      (`prediction.png`).

    Reading it as the dict `predict_file` used to return (the content of
    `prediction.json`) is deprecated (one release).
    """

    source: str = eqx.field(static=True)
    prediction: Prediction
    trained: TrainResult | None
    agreement: Agreement | None
    learning_rate: float = eqx.field(static=True)
    num_steps: int = eqx.field(static=True)
    files: dict[str, Path] = eqx.field(static=True)

    def as_dict(self) -> dict[str, Any]:
        """The content of `prediction.json`, with `files` mapped to their paths."""
        summary = json.loads(Path(self.files["summary"]).read_text())
        return {**summary, "files": self.files}


def predict_file(
    out_dir: str | os.PathLike,
    *,
    data: str | os.PathLike | None = None,
    dataset: str | None = None,
    n: int | None = None,
    arch: str = "perceptron",
    arch_args: dict | None = None,
    init_scale: float = 1e-4,
    learning_rate: float | None = None,
    width: int = DEFAULT_WIDTH,
    num_steps: int | None = None,
    engine: AbstractEngine | None = None,
    train_network: bool = False,
    seed: int = 0,
    progress: bool | AbstractProgressMeter = True,
) -> PredictOutput:
    """Predict training on a data file (or a bundled data set) and write
    `prediction.json` and `prediction.png` to `out_dir`; with `train_network`
    also train the real network (`nqfjax.train`, full-batch GD, same key) and
    report the agreement per switch-on.

    **Arguments:**

    - `out_dir`: the output directory (created if needed).
    - `data`: a `.npz` or `.csv` file (`load_data_file`); or
    - `dataset`: a name of `nqfjax.data.DATASETS` (`load_dataset`, standardised,
      one-hot targets), at most `n` samples.
    - `arch`, `arch_args`: the architecture (`structure_for_data`).
    - `init_scale`, `learning_rate`, `width`, `num_steps`, `engine`: as
      `predict`; `learning_rate` and `num_steps` default to
      `default_hyperparameters`, `width` to `DEFAULT_WIDTH = 64` (the real
      layer follows its quadratic form better the wider it is), `engine` to
      `AutoEngine()` (a word of `nqfjax predict --engine` is deprecated here:
      the command maps it with `engine_from_word`).
    - `train_network`: also train and compare.
    - `seed`: the PRNG seed of the initial weights.
    - `progress`: a progress meter (`nqfjax.AbstractProgressMeter`; `True` for a
      `tqdm` bar, `False` for none).

    **Returns:** a `PredictOutput` (the `Prediction`, the trained run and its
    `Agreement`, the paths of `prediction.json` and `prediction.png`).

    **Raises:** `ValueError` (one line naming the problem) for a bad file, data
    set, architecture or hyperparameter, before any long computation.
    """
    xs, ys, source = _load(data, dataset, n)
    if isinstance(engine, str):
        engine = engine_from_word(engine)
        warnings.warn(
            "predict_file's `engine` as a word is deprecated and will be removed in "
            f"the next release; pass the engine as an object: engine={engine!r}.",
            DeprecationWarning,
            stacklevel=2,
        )
    structure = structure_for_data(arch, xs, ys, arch_args)
    width = static_int("width", width, 1)
    if not (np.isfinite(init_scale) and init_scale > 0):
        raise ValueError(f"`init_scale` must be > 0, got {init_scale}.")
    lr0, steps0 = default_hyperparameters(structure, xs, ys, init_scale)
    learning_rate = lr0 if learning_rate is None else learning_rate
    num_steps = steps0 if num_steps is None else num_steps
    key = jr.key(seed)
    bar = as_progress_meter(progress).bar(2 + train_network, "nqfjax predict")
    P = predict(
        structure,
        xs,
        ys,
        init_scale=init_scale,
        learning_rate=learning_rate,
        width=width,
        key=key,
        num_steps=num_steps,
        engine=engine,
    )
    bar.update()
    trained = a = None
    if train_network:
        trained = train(
            structure,
            xs,
            ys,
            num_steps=int(num_steps),
            learning_rate=learning_rate,
            key=key,
            init_scale=init_scale,
            width=width,
            record_at=[int(s) for s in np.asarray(P.ts)],
        )
        bar.update()
        a = agreement(P, trained, num_switches=len(P.switch_times) or 1)
    hyper = {
        "init_scale": init_scale,
        "learning_rate": learning_rate,
        "width": width,
        "num_steps": int(num_steps),
        "seed": seed,
    }
    summary = _summary(source, xs, arch, structure, hyper, P, trained, a)
    title = f"{arch} on {Path(source).name if data is not None else dataset}"
    fig = plots.plot_prediction(P, trained, title)
    files = {"summary": "prediction.json", "figure": "prediction.png"}
    summary = jsonable({**summary, "versions": versions(), "files": files})
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_figure(out / files["figure"], fig)
    write_json(out / files["summary"], summary)
    bar.update()
    bar.close()
    return PredictOutput(
        source=source,
        prediction=P,
        trained=trained,
        agreement=a,
        learning_rate=float(learning_rate),
        num_steps=int(num_steps),
        files={k: out / v for k, v in files.items()},
    )
