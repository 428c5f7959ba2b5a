"""The `nqfjax` command: a thin shell over the library.

`nqfjax demo` calls `run_demo`; `nqfjax sweep` calls `load_sweep_config` and
`run_sweep_config`; `nqfjax fit` calls `fit_curve_file`; `nqfjax predict` calls
`predict_file`, all from `nqfjax.experiments`; each returns a module of named
fields, which this module alone prints as text. Every command checks its output
folder before any work. Bad input (a malformed config or CSV, a truncated,
damaged or mis-encoded input file, an output folder that cannot be written, a
checkpoint from another configuration or one that cannot be read) ends with a
one-line `nqfjax: error: ...` on stderr and exit status 2; an interrupt
(SIGINT, Ctrl-C) with exit status 130, a sweep's checkpoint whole.
"""

import argparse
import gc
import math
import os
import sys
from pathlib import Path

import jax
import numpy as np

import nqfjax
from nqfjax import experiments
from nqfjax.experiments.engines import ENGINE_WORDS, engine_from_word
from nqfjax.experiments.predict_file import DEFAULT_WIDTH
from nqfjax.io import check_output_dir
from nqfjax.sweep import defer_interrupts


_DESCRIPTION = """\
Simulate and analyse sudden learning and scaling laws with the neural quadratic
form theory (W-space training, M-space flow, Lotka-Volterra reduction).
Run `nqfjax COMMAND --help` for the options of each command; try
`nqfjax demo` first."""

_EPILOG = """\
exit status: 0 on success, 2 for bad input (a one-line message on stderr),
130 when interrupted (a sweep resumes where it stopped when rerun).

Every command keeps its compiled programs in JAX's persistent compilation
cache, in $XDG_CACHE_HOME/nqfjax/jax (default ~/.cache/nqfjax/jax), so a second
run compiles only the programs JAX cannot cache (those holding runtime checks:
the ODE solves and the vmapped sweep). Set NQFJAX_NO_COMPILATION_CACHE=1 to
keep nothing; a cache folder of your own (JAX_COMPILATION_CACHE_DIR) is used as
it is."""

_DEMO = """\
Train a tanh perceptron with several outputs from a small initialisation
(init scale about 1e-4), run the M-space flow and the Lotka-Volterra reduction
beside it, and write to DIR: staircase.png (loss curves, predicted switch-on
times, the singular-limit staircase), init_scale.png (switch-on times against
ln(1/sigma) with the predicted slopes 2/r_k), power_law.png (thousands of modes,
fitted and predicted exponents), structures.png (the structure matrix of each
architecture), report.json (every number, the configuration and library
versions) and report.md (a readable summary embedding the figures). Under a
minute on two CPU cores (about 30 s once its programs are cached), --quick
(without the M-space flow) about 14 s of CPU once its programs are cached."""

_SWEEP = """\
Train the real network at every point of a grid of hyperparameters: the full
product of init scales, learning rates, seeds, optimizers and architectures
given in a TOML config file (read with tomllib), on Gaussian inputs labelled by
a teacher of the same architecture. Each (optimizer, architecture) group is one
compiled, vmapped nqfjax.sweep, checkpointed chunk by chunk to
OUT/checkpoint/<optimizer>-<architecture>/: rerunning an interrupted sweep with
the same config and --out loads the finished chunks and computes only the rest.

config schema (sections and keys; see examples/sweep_small.toml, commented):
  [data]    n_samples, teacher_units, teacher_scale, noise, seed
  [train]   num_steps (required), width, num_records, batch_size,
            weight_decay, model ("layer" | "quadratic"),
            precision ("float32" | "float64")
  [grid]    lists: init_scale (> 0, required), learning_rate (> 0, required),
            seed (>= 0), optimizer ("gd" | "momentum" | "adam"),
            architecture ("perceptron" | "quadratic" | "qk_attention" |
            "ov_attention" | "moe" | "conv1d")
  [architectures.NAME]  constructor arguments, e.g. d, k
  [sweep]   chunk (grid points per compiled call and checkpoint file)
Unknown keys and bad values are rejected, with the key named, before anything
is written.

outputs (in OUT, each written atomically once the whole grid is done):
  results.npz      loss[optimizer, architecture, init_scale, learning_rate,
                   seed, step], steps, and the grid axes
  summary.json     the config, versions, chunk counts, and per run the
                   initial and final loss and the step where the loss halved
  loss_curves.png  the loss curves, one panel per group, with the predicted
                   switch-on time of each mode as a tick (full-batch GD
                   groups: the theory of gradient flow)"""

_FIT = """\
Analyse a loss curve of your own: detect its plateaus and drops, fit a power
law L = L_inf + c (t + t0)^-gamma on an automatically chosen window, and fit
the power-law spectrum (alpha, beta) of the Lotka-Volterra model of
independent modes that reproduces it, with the exponents the theory predicts
from that spectrum. With --forecast-to T, forecast the rest of the curve to
step T: the fitted mode spectrum continued, with a band, the next switch-on
times and the final level. A curve with nothing to fit (zero, flat, rising)
gets a line saying so, not a number.

CSV format: a header line naming the columns, then one row per recorded step;
blank lines and lines starting with # are ignored, other columns too. The time
column (t, time or step, or --time-column) holds training steps: numbers >= 0,
strictly increasing. The loss column (loss, or --loss-column) holds finite
numbers >= 0. At least 10 rows. For example:

  step,loss
  0,0.52
  10,0.518
  ...

A simulated example: examples/power_law_curve.csv.

outputs (in OUT): fit.json (every fitted number) and fit.png (the curve with
the plateaus, the power law and its window, the spectrum model and the
forecast)."""


def _parser() -> argparse.ArgumentParser:
    # One declaration per option, read top to bottom like the `--help` it makes;
    # one function per command.
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(
        prog="nqfjax", description=_DESCRIPTION, epilog=_EPILOG, formatter_class=raw
    )
    parser.add_argument(
        "--version", action="version", version=f"nqfjax {nqfjax.__version__}"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    _add_demo_parser(sub)
    _add_sweep_parser(sub)
    _add_fit_parser(sub)
    _add_predict_parser(sub)
    return parser


def _add_demo_parser(sub) -> None:
    raw = argparse.RawDescriptionHelpFormatter
    demo = sub.add_parser(
        "demo",
        help="the headline experiment: figures and a report",
        description=_DEMO,
        formatter_class=raw,
    )
    demo.add_argument(
        "--out",
        metavar="DIR",
        type=Path,
        default=Path("nqfjax-out"),
        help="output directory (default: ./nqfjax-out)",
    )
    demo.add_argument(
        "--quick",
        action="store_true",
        help="a smaller problem with the same four figures and five checks (two "
        "modes, 100 records, three init scales, 1000 power-law modes in closed "
        "form, no M-space flow): 13 s measured on two idle cores, warm cache",
    )


def _add_sweep_parser(sub) -> None:
    raw = argparse.RawDescriptionHelpFormatter
    sweep = sub.add_parser(
        "sweep",
        help="train over a grid of hyperparameters (TOML config), resumable",
        description=_SWEEP,
        formatter_class=raw,
    )
    sweep.add_argument(
        "config", metavar="CONFIG.toml", type=Path, help="the sweep configuration"
    )
    sweep.add_argument(
        "--out",
        metavar="DIR",
        type=Path,
        help="output and checkpoint directory (default: "
        "./nqfjax-out/sweep-<config name>); rerun with the same DIR to resume",
    )
    sweep.add_argument(
        "--quiet", action="store_true", help="no progress bars or group lines"
    )


def _add_fit_parser(sub) -> None:
    raw = argparse.RawDescriptionHelpFormatter
    fit = sub.add_parser(
        "fit",
        help="analyse a loss curve (CSV): plateaus, power law, spectrum",
        description=_FIT,
        formatter_class=raw,
    )
    fit.add_argument("curve", metavar="CURVE.csv", type=Path, help="the loss curve")
    fit.add_argument(
        "--out",
        metavar="DIR",
        type=Path,
        help="output directory (default: ./nqfjax-out/fit-<csv name>)",
    )
    fit.add_argument(
        "--time-column",
        metavar="NAME",
        help="header of the time column (default: the first of t, time, step)",
    )
    fit.add_argument(
        "--loss-column",
        metavar="NAME",
        default="loss",
        help="header of the loss column (default: loss)",
    )
    fit.add_argument(
        "--modes",
        metavar="P",
        type=int,
        default=200,
        help="number of modes of the spectrum model (default: 200)",
    )
    fit.add_argument(
        "--total-modes",
        metavar="N",
        type=float,
        default=float("inf"),
        help="total number of modes of the spectrum behind the curve; the model's "
        "modes beyond --modes are kept as a continuum tail (default: inf, an "
        "unbounded power-law spectrum)",
    )
    fit.add_argument(
        "--spectrum-method",
        choices=nqfjax.analysis.spectrum.SPECTRUM_METHODS,
        default=nqfjax.analysis.spectrum.DEFAULT_SPECTRUM_METHOD,
        help="how the spectrum model's modes are computed: the closed-form "
        "logistic curve (default, fast) or the ODE solver solve_lv (slow)",
    )
    fit.add_argument(
        "--forecast-to",
        metavar="T",
        type=float,
        help="forecast the curve to step T (after its last): the fitted mode "
        "spectrum continued, with a band, the next switch-on times and the "
        "final level",
    )
    fit.add_argument(
        "--no-spectrum",
        action="store_true",
        help="skip the spectrum fit (plateaus and power law only)",
    )
    fit.add_argument("--quiet", action="store_true", help="no progress bar")


NO_CACHE_ENV = "NQFJAX_NO_COMPILATION_CACHE"


def compilation_cache_dir(environ=os.environ) -> Path | None:
    """Where `nqfjax` keeps JAX's compilation cache: `$XDG_CACHE_HOME/nqfjax/jax`
    (default `~/.cache/nqfjax/jax`); `None` when `NQFJAX_NO_COMPILATION_CACHE`
    is set or JAX already has a cache folder (the user's choice wins)."""
    if environ.get(NO_CACHE_ENV) or jax.config.jax_compilation_cache_dir:
        return None
    base = environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "nqfjax" / "jax"


def _enable_compilation_cache() -> None:
    # most of a first `demo --quick` or `fit --forecast-to` is compiling; every
    # program is cached, however quick to compile: ~200 small ones add up
    path = compilation_cache_dir()
    if path is not None:
        jax.config.update("jax_compilation_cache_dir", os.fspath(path))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


def _demo(args) -> None:
    check_output_dir(args.out, "--out")
    # the ~400k objects importing jax leaves live: ~0.4 s of a quick run saved
    gc.freeze()
    result = experiments.run_demo(args.out, quick=args.quick, progress=True)
    print("nqfjax demo: prediction vs measurement")
    fmt = lambda v: ", ".join(f"{x:.4g}" for x in v)  # noqa: E731
    for check in result.checks:
        # the reference is a prediction, or another simulation (`compares`)
        ref = "predicted" if check.compares.endswith("theory") else "ref."
        print(
            f"  {check.what}: {ref} {fmt(check.predicted)}, measured "
            f"{fmt(check.measured)} (max error {check.max_rel_error:.2%}, "
            f"{'ok' if check.passed else 'OUTSIDE the tolerance'})"
        )
    print(f"  report:  {args.out / 'report.md'} (numbers: {args.out / 'report.json'})")
    if not result.passed:
        print("nqfjax: error: a prediction missed its tolerance", file=sys.stderr)
        return 1
    return 0


def _sweep(args) -> None:
    config = experiments.load_sweep_config(args.config)  # before anything is written
    out = args.out or Path("nqfjax-out") / f"sweep-{args.config.stem}"
    check_output_dir(out, "--out")
    # SIGINT only at chunk boundaries: KeyboardInterrupt -> exit 130, see `main`
    with defer_interrupts():
        result = experiments.run_sweep_config(config, out, progress=not args.quiet)
    for note in result.checkpoint_warnings:
        print(f"nqfjax: warning: {note}", file=sys.stderr)
    n_runs = result.step_diverged.size
    print(
        f"nqfjax sweep: {n_runs} runs; {result.n_computed} chunks "
        f"computed, {result.n_loaded} loaded from the checkpoint"
    )
    diverged = np.argwhere(np.isfinite(result.step_diverged))  # in C order
    if len(diverged):
        print(
            f"  diverged: {len(diverged)} of {n_runs} runs (divergence is a "
            f"result: {result.criterion}):"
        )
        grid = result.config.grid
        for idx in diverged[:_MAX_LISTED]:
            point = ", ".join(
                f"{key}={grid[key][i]}" for key, i in zip(_GRID_KEYS, idx)
            )
            print(f"    {point} (from step {result.step_diverged[tuple(idx)]:g})")
        if len(diverged) > _MAX_LISTED:
            print(f"    ... and {len(diverged) - _MAX_LISTED} more (see summary)")
    for name in ("results", "summary", "figure"):
        print(f"  {name + ':':9s}{result.files[name]}")


_MAX_LISTED = 20
_GRID_KEYS = ("optimizer", "architecture", "init_scale", "learning_rate", "seed")


def _fmt(x) -> str:
    """A number to 4 digits; `n/a` for `None`, NaN or inf (JSON's `null`)."""
    return "n/a" if x is None or not math.isfinite(x) else f"{x:.4g}"


def _fit(args) -> None:
    if args.modes < 1:
        raise ValueError(f"--modes must be a positive integer, got {args.modes}.")
    out = args.out or Path("nqfjax-out") / f"fit-{args.curve.stem}"
    check_output_dir(out, "--out")
    result = experiments.fit_curve_file(
        args.curve,
        out,
        time_column=args.time_column,
        loss_column=args.loss_column,
        modes=None if args.no_spectrum else args.modes,
        total_modes=args.total_modes,
        spectrum_method=args.spectrum_method,
        forecast_to=args.forecast_to,
        progress=not args.quiet,
    )
    analysis = result.analysis
    print(f"nqfjax fit: {analysis.ts.size} points from {args.curve}")
    for label, name in _FIT_LINES:
        step = getattr(analysis, name)
        if step is not None:
            print(f"  {label + ':':11s}{_fit_line(step, analysis)}")
    for name in ("summary", "figure"):
        print(f"  {name + ':':9s}{result.files[name]}")


# the lines of `nqfjax fit`, in order: (label, `CurveAnalysis` field)
_FIT_LINES = (
    ("shape", "model"),
    ("plateaus", "plateaus"),
    ("power law", "power_law"),
    ("spectrum", "spectrum"),
    ("forecast", "forecast"),
)


def _fit_line(step, analysis) -> str:
    """One step of a `CurveAnalysis` as the text after its label."""
    if isinstance(step, experiments.Failed):
        return step.error
    if isinstance(step, experiments.Skipped):
        return step.reason
    if isinstance(step, nqfjax.ModelSelection):
        return (
            f"{step.best} (by {step.criterion}; runner-up {step.runner_up or 'none'}: "
            f"{step.why or '-'})"
        )
    if isinstance(step, nqfjax.Plateaus):
        return str(len(step)) if len(step) else step.reason
    if isinstance(step, nqfjax.PowerLawFit):
        lo, hi = step.window
        return (
            f"gamma = {_fmt(float(step.gamma))} +- {_fmt(float(step.gamma_err))} "
            f"on t in [{lo:.3g}, {hi:.3g}]"
        )
    if isinstance(step, nqfjax.SpectrumFit):
        a, b = float(step.alpha), float(step.beta)
        try:
            lazy = nqfjax.power_law_exponent(a, b, "lazy")
        except ValueError:  # undefined there: fit.json's null
            lazy = None
        return (
            f"alpha = {_fmt(a)}, beta = {_fmt(b)}; predicted gamma = "
            f"{_fmt(float(step.gamma))} (rich), {_fmt(lazy)} (lazy)"
        )
    lo, hi = float(step.final_lower), float(step.final_upper)  # a Forecast
    nxt = ", ".join(f"{float(t):.4g}" for t in step.switch_on_times) or "none"
    return (
        f"loss {_fmt(float(step.final_level))} (band {lo:.3g} to {hi:.3g}) at t = "
        f"{analysis.forecast_to:.4g}; next switch-ons at t = {nxt}"
    )


_PREDICT = """\
Predict the training of a network on your data from small initialisation: the
loss curve, when each mode switches on, the loss on each plateau, the learned
modes. Uses the Lotka-Volterra reduction where the data allow it and the
M-space flow where they do not, and says which and why. With --train it also
trains the real network (full-batch gradient descent from the same initial
weights) and reports the agreement per switch-on.

data: DATA.npz with arrays xs (n, d), or (n, T, d) for attention, and ys (n, k)
or (n,) (numpy.savez(path, xs=..., ys=...)); or DATA.csv with a header, the
columns y, y0, y1, ... (or y_NAME) the targets and the others the features.
Or --dataset NAME: a real data set from scikit-learn or MNIST-1D (standardised,
one-hot targets minus their means; `pip install 'nqfjax[data]'`).

width: the prediction is the layer's quadratic form. The real layer's cubic
term is shared by its units, so the trained network follows the prediction
better the wider it is (and M = W W^T has rank at most the width). Measured
with --train (tanh perceptron, init 1e-4): on wine the switch-ons were 26-47%
off at width 4, within 1.8% at 16 and 0.5% at 64; on digits (9 modes) only 4
could be timed at width 4, the median error was 5% at 16 and 0.9% at 64; the
run time did not depend on the width. The default is 64; give the width you
train.

outputs (in OUT): prediction.json (every number) and prediction.png (the
predicted curve, the switch-on times, and the trained curve with --train)."""


def _arch_arg(text: str) -> tuple[str, object]:
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    low = value.strip().lower()
    if low in ("true", "false"):
        return name.strip(), low == "true"
    for kind in (int, float):
        try:
            return name.strip(), kind(value)
        except ValueError:
            pass
    return name.strip(), value.strip()


def _add_predict_parser(sub) -> None:
    predict = sub.add_parser(
        "predict",
        help="predict a network's training on your data (npz/csv or a data set)",
        description=_PREDICT,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    predict.add_argument(
        "data", metavar="DATA.npz|DATA.csv", type=Path, nargs="?", help="the data"
    )
    predict.add_argument(
        "--dataset",
        choices=("wine", "digits", "breast_cancer", "iris", "mnist1d"),
        help="a bundled real data set instead of a file",
    )
    predict.add_argument(
        "--n", type=int, metavar="N", help="at most N samples of --dataset"
    )
    predict.add_argument(
        "--arch",
        default="perceptron",
        choices=(
            "perceptron",
            "quadratic",
            "conv1d",
            "qk_attention",
            "ov_attention",
            "moe",
        ),
        help="the architecture, sized from the data (default: perceptron)",
    )
    predict.add_argument(
        "--arch-arg",
        type=_arch_arg,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="another constructor argument, e.g. kernel_size=5 (repeatable)",
    )
    predict.add_argument(
        "--init-scale", type=float, default=1e-4, help="sigma (default: 1e-4)"
    )
    predict.add_argument(
        "--lr",
        type=float,
        help="learning rate (default: growth rate 0.01 per step for the first mode)",
    )
    predict.add_argument(
        "--width",
        type=int,
        default=DEFAULT_WIDTH,
        help=f"units (default: {DEFAULT_WIDTH}; the real layer follows its quadratic "
        "form better the wider it is: give the width you train)",
    )
    predict.add_argument(
        "--steps", type=int, help="horizon in steps (default: past the third mode)"
    )
    predict.add_argument(
        "--engine",
        choices=ENGINE_WORDS,
        default="auto",
        help="auto (default): LV where the data reduce, else the M-space flow",
    )
    predict.add_argument(
        "--train", action="store_true", help="also train the real network, compare"
    )
    predict.add_argument("--seed", type=int, default=0, help="init seed (default 0)")
    predict.add_argument(
        "--out",
        metavar="DIR",
        type=Path,
        help="output directory (default: ./nqfjax-out/predict-<data name>)",
    )
    predict.add_argument("--quiet", action="store_true", help="no progress bar")


def _predict(args) -> None:
    if (args.data is None) == (args.dataset is None):
        raise ValueError("give a data file (DATA.npz or DATA.csv) or --dataset NAME.")
    name = args.dataset if args.data is None else args.data.stem
    out = args.out or Path("nqfjax-out") / f"predict-{name}"
    result = experiments.predict_file(
        out,
        data=args.data,
        dataset=args.dataset,
        n=args.n,
        arch=args.arch,
        arch_args=dict(args.arch_arg),
        init_scale=args.init_scale,
        learning_rate=args.lr,
        width=args.width,
        num_steps=args.steps,
        engine=engine_from_word(args.engine),
        train_network=args.train,
        seed=args.seed,
        progress=not args.quiet,
    )
    P = result.prediction
    print(f"nqfjax predict: {P.engine}: {P.reason}")
    times = ", ".join(f"{t:.4g}" for t in np.asarray(P.switch_times) if t >= 0)
    print(f"  switch-on times (steps): {times or 'none within the horizon'}")
    print(f"  validity: {P.validity.verdict}")
    a = result.agreement
    rows = [] if a is None else zip(a.predicted_times, a.measured_times, a.time_errors)
    for predicted, measured, err in rows:
        err = float(err)
        print(
            f"  trained: predicted {float(predicted):.4g}, measured "
            f"{_fmt(float(measured))} "
            f"({f'{err:+.2%}' if math.isfinite(err) else 'n/a'})"
        )
    for what in ("summary", "figure"):
        print(f"  {what + ':':9s}{result.files[what]}")


def main(argv=None) -> int:
    """Run the `nqfjax` command.

    **Arguments:**

    - `argv`: the arguments without the program name (default `sys.argv[1:]`).

    **Returns:** the exit status: 0 on success, 2 for bad input (after printing
    `nqfjax: error: ...` on stderr), 130 when interrupted. `--help` and argparse's
    own usage errors raise `SystemExit` (status 0 and 2) as usual.
    """
    args = _parser().parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")  # the command only writes figures to files
    _enable_compilation_cache()
    handler = {"demo": _demo, "sweep": _sweep, "fit": _fit, "predict": _predict}[
        args.command
    ]
    try:
        status = handler(args)
    except ValueError as e:
        message = " ".join(str(e).split())
        print(f"nqfjax: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        hint = "; rerun the same command to resume" if args.command == "sweep" else ""
        print(f"nqfjax: interrupted{hint}", file=sys.stderr)
        return 130
    return status or 0


if __name__ == "__main__":
    sys.exit(main())
