"""Does the verdict of `Prediction.validity` predict the prediction's error?
(issue 28)

For every row: `nqfjax.predict` (default engine, float64), the real network
trained by full-batch GD from the same weights (`nqfjax.train`, same key, same
learning rate), and `nqfjax.agreement` between them. A row's *measured error*
is the largest relative error of its switch-on times up to the third (by rank,
at the prediction's threshold); its *verdict size* is the largest expected
shift $|\\epsilon_k|$ of the same switch-ons (`Validity.expected_shift`); it is
*flagged* when the verdict says the leading order breaks before the row's
horizon (`validity.breaks_at <= agreement.horizon`, the third switch-on). The
loss-curve landmarks (where the real `ln L` has fallen 10/30/50/70% of its drop
to the horizon) are reported beside them.

The criteria: every row off by more than 5% flagged, no row within 2%
flagged, and among the rows off by more than 2% the verdict's size ranks them
(Spearman >= 0.9). The verdict's cost is timed inside `predict` (the call of
`leading_order_validity`) against the whole call: on the first call
(compiling) and on the shortest of three compiled calls (each of the two
times its shortest: the machine is shared).

Rows (width 64, `default_hyperparameters`: the fastest growth rate 0.01 per
step, the horizon `2.5 ln(1/sigma^2) / r_3`):

- `agreement`: the cases of `predict_agreement.py` (iris, wine, breast cancer,
  digits, teacher sequences at two scales, MNIST-1D) at init `1e-4`, `1e-6`;
- `sweep`: per structure, target scales x init scales `1e-3`, `1e-6`:
  the tanh perceptron on iris (one-hot targets times 0.5, 1, 2); a softmax
  `QKAttention` head on 128 teacher sequences (teacher logits x0.1, 0.3, 1);
  an `OVAttention` with its own query-key circuits (`learn_qk=True`) on 128
  sequences whose target is a softmax-weighted linear readout of the tokens
  (x0.3, 1, 3); a softmax-gated `MixtureOfExperts` of 8 tanh experts (width 8)
  on 256 Gaussian inputs with a tanh teacher (x0.3, 1, 3); `Conv1D` on 200
  MNIST-1D signals (the one-vs-rest target of digit 2 x0.5, 1, 2).

    python benchmarks/validity_calibration.py                 # every row
    python benchmarks/validity_calibration.py --quick         # 3 rows
    python benchmarks/validity_calibration.py --figures docs/images
"""

import json
import os
import sys
import time


os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402


jax.config.update("jax_enable_x64", True)

import jax.random as jr  # noqa: E402
import numpy as np  # noqa: E402


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import machine, make_parser, write_json  # noqa: E402
from predict_agreement import (  # noqa: E402
    CASES as AGREEMENT_CASES,
    case_data,
    mnist1d_one_class,
    teacher_sequences,
)

import nqfjax  # noqa: E402
import nqfjax.experiments.predict as _predict_module  # noqa: E402
from nqfjax.experiments.predict_file import default_hyperparameters  # noqa: E402


WIDTH, FLAG_ABOVE, CLEAR_BELOW, SPEARMAN = 64, 0.05, 0.02, 0.9
WARM_CALLS = 3
SWEEP = {
    "perceptron": (0.5, 1.0, 2.0),
    "qk": (0.1, 0.3, 1.0),
    "ov": (0.3, 1.0, 3.0),
    "moe": (0.3, 1.0, 3.0),
    "conv1d": (0.5, 1.0, 2.0),
}
SWEEP_SCALES = (1e-3, 1e-6)
TITLES = {
    "perceptron": "tanh perceptron (iris)",
    "qk": "softmax QK head",
    "ov": "OV heads (learn_qk)",
    "moe": "mixture of experts",
    "conv1d": "Conv1D (MNIST-1D)",
}
QUICK = (("sweep", "perceptron", 2.0, 1e-3), ("sweep", "perceptron", 1.0, 1e-6))
QUICK += (("sweep", "qk", 1.0, 1e-3),)


def ov_sequences(n: int, scale: float, seed: int = 0, T: int = 4, d: int = 4):
    """`(xs, ys)`: Gaussian token sequences; the target `scale` times a
    softmax-weighted linear readout `sum_b alpha_b w.x_b` (logits of order 1
    from a fixed query-key teacher), which the OV circuit learns first."""
    rng = np.random.default_rng(seed)
    xs = rng.standard_normal((n, T, d))
    w = rng.standard_normal(d) / np.sqrt(d)
    qk = rng.standard_normal((d, d)) / np.sqrt(d)
    logits = np.einsum("ni,ij,nbj->nb", xs[:, -1], qk, xs)
    alpha = np.exp(logits - logits.max(1, keepdims=True))
    alpha /= alpha.sum(1, keepdims=True)
    return xs, scale * np.einsum("nb,nbi,i->n", alpha, xs, w)[:, None]


def moe_data(n: int, scale: float, seed: int = 0, d: int = 4):
    """`(xs, ys)`: Gaussian inputs, the target `scale` times a sum of two tanh
    units of unequal strength."""
    rng = np.random.default_rng(seed)
    xs = rng.standard_normal((n, d))
    U = np.linalg.qr(rng.standard_normal((d, 2)))[0]
    y = np.tanh(xs @ U) @ np.array([1.0, 0.6])
    return xs, scale * (y - y.mean())[:, None]


def sweep_data(structure: str, scale: float):
    """`(structure, xs, ys, width, description)` of a sweep row."""
    if structure == "perceptron":
        xs, ys = nqfjax.load_dataset("iris", dtype=np.float64)
        return nqfjax.Perceptron(d=4, k=3), xs, scale * ys, WIDTH, "iris"
    if structure == "qk":
        xs, ys = teacher_sequences(128, scale)
        return nqfjax.QKAttention(T=4, d=4), xs, ys, WIDTH, "teacher sequences"
    if structure == "ov":
        xs, ys = ov_sequences(128, scale)
        head = nqfjax.OVAttention(T=4, d=4, learn_qk=True)
        return head, xs, ys, WIDTH, "softmax readout"
    if structure == "moe":
        xs, ys = moe_data(256, scale)
        moe = nqfjax.MixtureOfExperts(d=4, experts=8)
        return moe, xs, ys, 8, "tanh teacher"
    if structure == "conv1d":
        xs, ys = mnist1d_one_class(200)
        conv = nqfjax.Conv1D(length=40, kernel_size=5, stride=5)
        return conv, xs, scale * ys, WIDTH, "MNIST-1D"
    raise ValueError(structure)


#: What `predict` does only for its verdict, timed as the verdict's cost:
#: `leading_order_validity` (the weights turned into the units' frame
#: inside it).
_VERDICT_PARTS = ("leading_order_validity",)


class _Timer:
    """Times the calls of `_VERDICT_PARTS` made inside `predict` (installed
    with `with _Timer() as timer:`)."""

    def __init__(self):
        self.seconds = 0.0
        self._inner = {n: getattr(_predict_module, n) for n in _VERDICT_PARTS}

    def _timed(self, inner):
        def call(*args, **kwargs):
            start = time.perf_counter()
            out = inner(*args, **kwargs)
            self.seconds += time.perf_counter() - start
            return out

        return call

    def __enter__(self):
        for name, inner in self._inner.items():
            setattr(_predict_module, name, self._timed(inner))
        return self

    def __exit__(self, *exc):
        for name, inner in self._inner.items():
            setattr(_predict_module, name, inner)


def landmark_errors(pred, trained, horizon) -> list[float]:
    """Relative errors (measured / predicted - 1) of the times where `ln L`
    has fallen 10/30/50/70% of the real run's drop from step 0 to `horizon`."""
    t_m = np.asarray(trained.ts, np.float64)
    t_p = np.asarray(pred.ts, np.float64)
    log_m = np.log(np.asarray(trained.loss, np.float64))
    log_p = np.log(np.asarray(pred.loss, np.float64))
    end = max(int(np.searchsorted(t_m, horizon, side="right")), 2)
    drop = log_m[0] - log_m[end - 1]
    out = []
    for f in (0.1, 0.3, 0.5, 0.7):
        level = log_m[0] - f * drop
        i, j = np.argmax(log_m <= level), np.argmax(log_p <= level)
        if not (log_m[i] <= level and log_p[j] <= level and i and j):
            out.append(float("nan"))
            continue
        # linear interpolation of the crossing in t
        tm = np.interp(level, log_m[[i, i - 1]], t_m[[i, i - 1]])
        tp = np.interp(level, log_p[[j, j - 1]], t_p[[j, j - 1]])
        out.append(float(tm / tp - 1.0))
    return out


def _key(row: dict) -> tuple:
    return (row["kind"], row["case"], float(row["target_scale"]), float(row["sigma"]))


def one_row(
    kind: str, name: str, scale: float, sigma: float, quick: bool, measured=None
) -> dict:
    """A row: the prediction and its verdict; the real network trained from the
    same weights and its agreement, or, with `measured` (an earlier row of the
    same case: training is deterministic), its measured errors."""
    if kind == "agreement":
        structure, xs, ys, description = case_data(name, quick)
        width = WIDTH
    else:
        structure, xs, ys, width, description = sweep_data(name, scale)
    eta, num_steps = default_hyperparameters(structure, xs, ys, sigma)
    common = dict(init_scale=sigma, learning_rate=eta, width=width, key=jr.key(0))
    seconds = {}
    # the first call compiles; the compiled calls are timed WARM_CALLS times and
    # the shortest kept (of the whole call and of the verdict, each: the machine
    # is shared)
    for when in ("cold",) + ("warm",) * WARM_CALLS:
        with _Timer() as timer:
            start = time.perf_counter()
            pred = nqfjax.predict(structure, xs, ys, num_steps=num_steps, **common)
            took = (time.perf_counter() - start, timer.seconds)
        seconds[when] = tuple(map(min, zip(seconds.get(when, took), took)))
    if measured is None:
        record = [int(t) for t in np.asarray(pred.ts)]
        start = time.perf_counter()
        trained = nqfjax.train(
            structure, xs, ys, num_steps=num_steps, record_at=record, **common
        )
        jax.block_until_ready(trained.loss)
        train_s = time.perf_counter() - start
        agree = nqfjax.agreement(pred, trained)
        errors = np.asarray(agree.time_errors, np.float64)
        horizon = float(agree.horizon)
        landmarks = landmark_errors(pred, trained, horizon)
    else:
        errors = np.asarray(measured["time_errors"], np.float64)
        horizon = float(measured["horizon"])
        landmarks = measured["landmark_errors"]
        train_s = measured["seconds"]["train"]
    c = errors.shape[0]
    v = pred.validity
    shift = np.asarray(v.expected_shift, np.float64)[:c]
    finite = errors[np.isfinite(errors)]
    return {
        "kind": kind,
        "case": name,
        "data": description,
        "structure": type(structure).__name__,
        "target_scale": scale,
        "sigma": sigma,
        "n": int(xs.shape[0]),
        "p": int(structure.p),
        "width": width,
        "steps": num_steps,
        "engine": pred.engine,
        "time_errors": [float(e) for e in errors],
        "error": float(np.max(np.abs(finite))) if finite.size else float("nan"),
        "landmark_errors": landmarks,
        "expected_shift": [float(e) for e in shift],
        "verdict_size": float(np.nanmax(np.abs(shift)))
        if np.any(np.isfinite(shift))
        else float("nan"),
        "breaks_at": float(v.breaks_at),
        "horizon": horizon,
        "flagged": bool(v.breaks_at <= horizon),
        "max_departure": float(np.nanmax(np.asarray(v.departure)))
        if np.any(np.isfinite(np.asarray(v.departure)))
        else float("nan"),
        "verdict": v.verdict,
        "seconds": {
            "predict": seconds["cold"][0],
            "validity": seconds["cold"][1],
            "predict_warm": seconds["warm"][0],
            "validity_warm": seconds["warm"][1],
            "train": train_s,
        },
    }


def spearman(a, b) -> float:
    """Spearman's rank correlation of `a` and `b` (no ties expected)."""
    ra = np.argsort(np.argsort(a)).astype(float)
    rb = np.argsort(np.argsort(b)).astype(float)
    if len(a) < 2:
        return float("nan")
    return float(np.corrcoef(ra, rb)[0, 1])


def criteria(rows: list[dict]) -> dict:
    """The issue's three criteria over `rows` (those with a measured error)."""
    rows = [r for r in rows if np.isfinite(r["error"])]
    missed = [r for r in rows if r["error"] > FLAG_ABOVE and not r["flagged"]]
    false = [r for r in rows if r["error"] <= CLEAR_BELOW and r["flagged"]]
    off = [r for r in rows if r["error"] > CLEAR_BELOW]
    rho = spearman([r["error"] for r in off], [r["verdict_size"] for r in off])
    cost = [r["seconds"]["validity"] / r["seconds"]["predict"] for r in rows]
    warm = [
        r["seconds"]["validity_warm"] / r["seconds"]["predict_warm"]
        for r in rows
        if "predict_warm" in r["seconds"]
    ]
    return {
        "validity_cost_warm_median": float(np.median(warm)) if warm else float("nan"),
        "validity_cost_warm_max": float(np.max(warm)) if warm else float("nan"),
        "rows": len(rows),
        "off_by_more_than_5pc_unflagged": [_label(r) for r in missed],
        "within_2pc_flagged": [_label(r) for r in false],
        "off_by_more_than_2pc": len(off),
        "spearman": rho,
        "validity_cost_median": float(np.median(cost)) if cost else float("nan"),
        "validity_cost_max": float(np.max(cost)) if cost else float("nan"),
    }


def _label(row: dict) -> str:
    scale = "" if row["kind"] == "agreement" else f" x{row['target_scale']:g}"
    return f"{row['case']}{scale} {row['sigma']:.0e}"


def figures(rows: list[dict], folder: str) -> list[str]:
    """One figure per structure of the sweep: the measured error and the
    verdict's size against the target scale, one line per init scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [s for s in SWEEP if any(r["case"] == s for r in rows)]
    fig, axes = plt.subplots(1, len(names), figsize=(3.0 * len(names), 3.4))
    axes = np.atleast_1d(axes)
    for ax, name in zip(axes, names):
        for sigma, color in zip(SWEEP_SCALES, ("C0", "C3")):
            sel = [
                r
                for r in rows
                if r["kind"] == "sweep" and r["case"] == name and r["sigma"] == sigma
            ]
            sel.sort(key=lambda r: r["target_scale"])
            x = [r["target_scale"] for r in sel]
            ax.plot(
                x,
                [100 * r["error"] for r in sel],
                "o-",
                color=color,
                label=f"measured, init {sigma:.0e}",
            )
            ax.plot(
                x,
                [100 * r["verdict_size"] for r in sel],
                "x--",
                color=color,
                label=f"verdict, init {sigma:.0e}",
            )
        ax.axhspan(0.05, 100 * CLEAR_BELOW, color="0.9", zorder=0)
        ax.axhline(100 * FLAG_ABOVE, color="0.5", lw=0.8, ls=":")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_ylim(0.05, 150)
        ax.set_xticks(SWEEP[name], [f"{a:g}" for a in SWEEP[name]])
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xlabel("target scale")
        ax.set_title(TITLES[name], fontsize=9)
    axes[0].set_ylabel("largest switch-on error (%)")
    axes[-1].legend(fontsize=7)
    fig.tight_layout()
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "validity_calibration.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


def markdown(rows: list[dict]) -> str:
    """The rows as a markdown table (for docs/how-to/validity.md)."""
    out = [
        "| row | structure | switch-on errors | expected shifts | error | verdict "
        "| flagged |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        errs = ", ".join(f"{100 * e:+.1f}%" for e in r["time_errors"])
        shifts = ", ".join(f"{100 * e:+.1f}%" for e in r["expected_shift"])
        out.append(
            f"| {_label(r)} | `{r['structure']}` | {errs} | {shifts} | "
            f"{100 * r['error']:.1f}% | {100 * r['verdict_size']:.1f}% | "
            f"{'yes' if r['flagged'] else 'no'} |"
        )
    return "\n".join(out)


def _print_row(row: dict) -> None:
    errs = " ".join(f"{100 * e:+6.2f}%" for e in row["time_errors"]) or "-"
    shifts = " ".join(f"{100 * e:+6.2f}%" for e in row["expected_shift"]) or "-"
    marks = " ".join(f"{100 * e:+5.1f}" for e in row["landmark_errors"])
    sec = row["seconds"]
    cost = sec["validity"] / sec["predict"]
    warm = sec.get("validity_warm", np.nan) / sec.get("predict_warm", np.nan)
    print(
        f"{_label(row):<24} {row['structure']:<16} {errs:>26} | {shifts:>26} "
        f"| {100 * row['error']:5.2f}% {100 * row['verdict_size']:5.2f}% "
        f"{'FLAG' if row['flagged'] else '    '} | {marks:>24} "
        f"| {sec['predict']:5.1f}s {100 * cost:4.1f}% "
        f"| {sec.get('predict_warm', np.nan):5.2f}s {100 * warm:4.1f}%",
        flush=True,
    )


def plan_of(args) -> list[tuple]:
    if args.quick:
        return list(QUICK)
    plan = []
    if args.kinds in ("all", "agreement"):
        plan += [
            ("agreement", n, 1.0, s) for n in AGREEMENT_CASES for s in (1e-4, 1e-6)
        ]
    if args.kinds in ("all", "sweep"):
        plan += [
            ("sweep", n, a, s) for n in SWEEP for a in SWEEP[n] for s in SWEEP_SCALES
        ]
    if args.only:
        keep = set(args.only.split(","))
        plan = [p for p in plan if p[1] in keep]
    return plan


def main(argv=None) -> dict:
    parser = make_parser(__doc__)
    parser.add_argument("--kinds", default="all", help="all, agreement or sweep")
    parser.add_argument("--only", default=None, help="comma-separated case names")
    parser.add_argument("--figures", default=None, help="write the figure here")
    parser.add_argument(
        "--markdown", action="store_true", help="print the rows as a markdown table"
    )
    parser.add_argument(
        "--from-json", default=None, help="rows from earlier runs (comma-separated)"
    )
    parser.add_argument(
        "--measured",
        default=None,
        help="earlier runs' JSON (comma-separated) whose measured errors to reuse "
        "(training is deterministic): only the predictions are rerun",
    )
    args = parser.parse_args(argv)
    print(f"machine: {machine()}")
    print(
        f"{'row':<24} {'structure':<16} {'switch-on errors':>26} | "
        f"{'expected shifts':>26} | {'error':>6} {'size':>6} flag | "
        f"{'landmarks (%)':>24} | predict validity | warm: predict validity"
    )
    rows = []
    if args.from_json:
        for path in args.from_json.split(","):
            with open(path) as f:
                rows += json.load(f)["rows"]
        for row in rows:
            _print_row(row)
    else:
        earlier = {}
        for path in (args.measured or "").split(","):
            if path:
                with open(path) as f:
                    earlier.update({_key(r): r for r in json.load(f)["rows"]})
        for kind, name, scale, sigma in plan_of(args):
            measured = earlier.get((kind, name, float(scale), float(sigma)))
            row = one_row(kind, name, scale, sigma, args.quick, measured)
            rows.append(row)
            _print_row(row)
            write_json(args.json, {"machine": machine(), "rows": rows})  # so far
    summary = criteria(rows)
    print(
        f"rows {summary['rows']}; off by > 5% and not flagged: "
        f"{summary['off_by_more_than_5pc_unflagged'] or 'none'}; within 2% and "
        f"flagged: {summary['within_2pc_flagged'] or 'none'}; Spearman over the "
        f"{summary['off_by_more_than_2pc']} rows off by > 2%: "
        f"{summary['spearman']:.3f}; the verdict's share of predict: median "
        f"{100 * summary['validity_cost_median']:.1f}%, max "
        f"{100 * summary['validity_cost_max']:.1f}% (cold, compiling); warm: median "
        f"{100 * summary['validity_cost_warm_median']:.1f}%, max "
        f"{100 * summary['validity_cost_warm_max']:.1f}%"
    )
    result = {
        "machine": machine(),
        "date": time.strftime("%Y-%m-%d"),
        "rows": rows,
        "criteria": summary,
    }
    if args.figures:
        result["figures"] = figures(rows, args.figures)
    if args.markdown:
        print(markdown(rows))
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
