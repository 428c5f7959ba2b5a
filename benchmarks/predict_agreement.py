"""How closely `predict` follows real training, on real data sets (issue 17).

Each case builds a network on a real data set (standardised, not whitened),
predicts its training with `nqfjax.predict` (the M-space flow where the data do
not reduce, which is every case here) and trains the real network with
`nqfjax.train` (full-batch GD, float64) from the same key, hence the same
initial weights `W0`, at the same learning rate, recording `M = W W^T` at the
prediction's steps. `nqfjax.agreement` then compares the first three switch-on
times by rank (`switch_ons` at the prediction's threshold, half its smallest
learned value: the k-th switch-on is the first time k eigenvalues of `M` are
above it, for the prediction and the trained network alike) and the largest
`|ln L_trained - ln L_predicted|` up to the third switch-on. The same network's
quadratic model (`train(..., model=nqfjax.QuadraticForm())`: `f(x; 0) + Tr[W W^T A(x)]`,
trained by the same GD steps) separates the engine's error (the flow against
GD on the quadratic form: only the discretisation, a lag of about `r/4`
per switch-on, 0.25% of a switch-on time at `r = 0.01`)
from the real layer's departure from its quadratic form (the cubic term of
tanh, the softmax beyond its linearisation). Each case also runs
the approximate Lotka-Volterra reduction (`engine=nqfjax.ApproximateLVEngine()`: the LV
system in the eigenbasis of `C`, whatever the violation of commutation) and
reports its residual (the violation measured by the whole basis search; the
automatic engine reports `lv_reduce`'s refusal at its first step, a lower
bound) and its departure from the M-space flow. Each row also says whether
the prediction's verdict flags it (`Prediction.validity`: the leading order
breaks before the third switch-on; `validity_calibration.py` measures how well
the flag and the expected shifts predict the errors).

Cases (width 64 units, the learning rate that makes the fastest growth rate
`r_1 = 4 eta lambda_1(C) = 0.01` per step, the horizon of
`default_hyperparameters`: `2.5 ln(1/sigma^2) / r_3` steps):

- the tanh perceptron on wine, iris, breast cancer and digits (500 samples, 16
  principal components: variances kept, not whitened), one-hot targets minus
  the class frequencies, init scales `1e-4` and `1e-6`;
- `Conv1D` (kernel 5, stride 5, tanh: `p = 8 + 5`) on MNIST-1D (300 signals of
  length 40; one output channel, so the scalar target "is it a 2", centred and
  scaled to unit variance), both init scales;
- `QKAttention` (softmax, 4 tokens of dimension 4, the default values) on a
  sequence task: 1,000 sequences of Gaussian tokens labelled by a teacher head
  of the same form whose `W_Q W_K^T` has singular values 1.5, 1.0, 0.6
  (`sequences`: logits of order 1, where the softmax is far from linear) or a
  tenth of that (`sequences_small`), both init scales.

    python benchmarks/predict_agreement.py           # every case
    python benchmarks/predict_agreement.py --quick   # iris, attention (1e-4)
"""

import os
import sys
import time


os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402


jax.config.update("jax_enable_x64", True)  # float64: precision is the point here

import jax.random as jr  # noqa: E402
import numpy as np  # noqa: E402


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import machine, make_parser, write_json  # noqa: E402

import nqfjax  # noqa: E402
from nqfjax.experiments.predict_file import default_hyperparameters  # noqa: E402


WIDTH, RECORDS, CRITERION = 64, 200, 0.05
SCALES = (1e-4, 1e-6)
#: the data sets of the full run, in the table's order
CASES = (
    "wine",
    "iris",
    "breast_cancer",
    "digits",
    "sequences",
    "sequences_small",
    "mnist1d",
)


def teacher_sequences(
    n: int, scale: float = 1.0, seed: int = 0, T: int = 4, d: int = 4
):
    """`(xs, ys)`: `n` sequences of `T` Gaussian tokens of dimension `d`, the
    target the output of a softmax query-key head (the default values of
    `QKAttention`) whose `W_Q W_K^T` has singular values `scale` times 1.5, 1.0,
    0.6 in random orthonormal bases."""
    rng = np.random.default_rng(seed)
    xs = rng.standard_normal((n, T, d))
    left, _ = np.linalg.qr(rng.standard_normal((d, 3)))
    right, _ = np.linalg.qr(rng.standard_normal((d, 3)))
    Wqk = (left * (scale * np.array([1.5, 1.0, 0.6]))) @ right.T
    values = np.asarray(nqfjax.QKAttention(T=T, d=d).values, np.float64)[:, 0]
    logits = np.einsum("ni,ij,nbj->nb", xs[:, -1], Wqk, xs)
    alpha = np.exp(logits - logits.max(1, keepdims=True))
    alpha /= alpha.sum(1, keepdims=True)
    return xs, (alpha @ values)[:, None]


def mnist1d_one_class(n: int, digit: int = 2):
    """`(xs, ys)`: `n` MNIST-1D signals (standardised) and the one-vs-rest target
    of `digit`, centred and scaled to unit variance (one output channel). For
    `Conv1D(kernel_size=5, stride=5)`, digit 2's first three modes have growth
    rates 1 : 0.64 : 0.33 (the class label as a target: 1 : 0.16 : 0.06, a
    run 5 times longer)."""
    xs, ys = nqfjax.load_dataset("mnist1d", n=n, dtype=np.float64)
    y = ys[:, digit : digit + 1]
    return xs, y / y.std()


def case_data(name: str, quick: bool):
    """`(structure, xs, ys, description)` of a case."""
    if name in ("wine", "iris", "breast_cancer"):
        xs, ys = nqfjax.load_dataset(name, dtype=np.float64)
        return nqfjax.Perceptron(d=xs.shape[1], k=ys.shape[1]), xs, ys, name
    if name == "digits":
        xs, ys = nqfjax.load_dataset("digits", n=500, pca=16, dtype=np.float64)
        return nqfjax.Perceptron(d=16, k=10), xs, ys, "digits (500, 16 PCs)"
    if name == "mnist1d":
        n = 200 if quick else 300
        xs, ys = mnist1d_one_class(n)
        conv = nqfjax.Conv1D(length=40, kernel_size=5, stride=5)
        return conv, xs, ys, f"MNIST-1D ({n}, class 2 or not)"
    if name in ("sequences", "sequences_small"):
        n = 128 if quick else 1000
        scale = 1.0 if name == "sequences" else 0.1
        xs, ys = teacher_sequences(n, scale)
        head = nqfjax.QKAttention(T=4, d=4)
        return head, xs, ys, f"teacher sequences ({n}, teacher x{scale:g})"
    raise ValueError(name)


def _floats(x) -> list[float]:
    return [float(v) for v in np.asarray(x, np.float64)]


def one_case(name: str, sigma: float, quick: bool) -> dict:
    structure, xs, ys, description = case_data(name, quick)
    eta, num_steps = default_hyperparameters(structure, xs, ys, sigma)
    common = dict(init_scale=sigma, learning_rate=eta, width=WIDTH, key=jr.key(0))
    start = time.perf_counter()
    flow = nqfjax.predict(structure, xs, ys, num_steps=num_steps, **common)
    flow_s = time.perf_counter() - start
    start = time.perf_counter()
    approx = nqfjax.predict(
        structure, xs, ys, ts=flow.ts, engine=nqfjax.ApproximateLVEngine(), **common
    )
    approx_s = time.perf_counter() - start
    record = [int(t) for t in np.asarray(flow.ts)]
    start = time.perf_counter()
    trained = nqfjax.train(
        structure, xs, ys, num_steps=num_steps, record_at=record, **common
    )
    jax.block_until_ready(trained.loss)
    train_s = time.perf_counter() - start
    quadratic = nqfjax.train(
        structure,
        xs,
        ys,
        num_steps=num_steps,
        record_at=record,
        model=nqfjax.QuadraticForm(),
        **common,
    )
    agree = nqfjax.agreement(flow, trained)
    agree_q = nqfjax.agreement(flow, quadratic)
    departure = nqfjax.agreement(flow, approx)
    errors = np.asarray(agree.time_errors, np.float64)
    passed = bool(
        errors.size
        and np.all(np.abs(errors) < CRITERION)
        and float(agree.log_loss_departure) < CRITERION
    )
    return {
        "case": name,
        "data": description,
        "structure": type(structure).__name__,
        "n": int(xs.shape[0]),
        "p": int(structure.p),
        "sigma": sigma,
        "learning_rate": eta,
        "steps": num_steps,
        "engine": flow.engine,
        "violation": float(flow.violation),
        "modes": int(flow.switch_times.shape[0]),
        "predicted_times": _floats(agree.predicted_times),
        "measured_times": _floats(agree.measured_times),
        "time_errors": _floats(errors),
        "subspace_overlaps": _floats(agree.subspace_overlaps),
        "log_loss_departure": float(agree.log_loss_departure),
        "horizon": float(agree.horizon),
        "passed": passed,
        "validity": {  # the verdict: see benchmarks/validity_calibration.py
            "expected_shift": _floats(flow.validity.expected_shift[: errors.size]),
            "breaks_at": float(flow.validity.breaks_at),
            "flagged": bool(flow.validity.breaks_at <= float(agree.horizon)),
            "verdict": flow.validity.verdict,
        },
        "quadratic_model": {
            "time_errors": _floats(agree_q.time_errors),
            "log_loss_departure": float(agree_q.log_loss_departure),
        },
        "approximate_lv": {
            "violation": float(approx.violation),
            "time_errors": _floats(departure.time_errors),
            "log_loss_departure": float(departure.log_loss_departure),
        },
        "seconds": {"mflow": flow_s, "approximate_lv": approx_s, "train": train_s},
    }


def _fmt_errors(errors: list[float]) -> str:
    return " ".join(f"{100 * e:+6.2f}%" for e in errors) or "-"


def main(argv=None) -> dict:
    parser = make_parser(__doc__)
    parser.add_argument(
        "--cases",
        default=None,
        help="comma-separated subset of wine,iris,breast_cancer,digits,sequences,"
        "sequences_small,mnist1d",
    )
    parser.add_argument(
        "--scales", default=None, help="comma-separated init scales (default 1e-4,1e-6)"
    )
    args = parser.parse_args(argv)
    scales = (
        SCALES if args.scales is None else tuple(map(float, args.scales.split(",")))
    )
    if args.quick:
        plan = [(name, 1e-4) for name in ("iris", "sequences_small")]
    else:
        names = CASES
        if args.cases:
            names = tuple(args.cases.split(","))
        plan = [(name, sigma) for name in names for sigma in scales]
    print(f"machine: {machine()}")
    print(f"width {WIDTH}, r_1 = 0.01 per step, float64, criterion {CRITERION:.0%}")
    print(
        f"{'case':<14} {'p':>3} {'sigma':>6} {'viol':>5} {'switch-on errors':>26} "
        f"{'dlogL':>6} {'pass':>4} {'flag':>4} | {'quadratic model':>26} {'dlogL':>6} "
        f"| {'approx LV errors':>26} {'dlogL':>6} "
        f"| {'flow':>6} {'train':>6}"
    )
    rows = []
    for name, sigma in plan:
        row = one_case(name, sigma, args.quick)
        rows.append(row)
        lv, qm = row["approximate_lv"], row["quadratic_model"]
        print(
            f"{name:<14} {row['p']:>3} {sigma:>6.0e} {row['violation']:>5.2f} "
            f"{_fmt_errors(row['time_errors']):>26} "
            f"{row['log_loss_departure']:>6.3f} {'yes' if row['passed'] else 'NO':>4} "
            f"{'yes' if row['validity']['flagged'] else 'no':>4} "
            f"| {_fmt_errors(qm['time_errors']):>26} "
            f"{qm['log_loss_departure']:>6.3f} "
            f"| {_fmt_errors(lv['time_errors']):>26} "
            f"{lv['log_loss_departure']:>6.3f} "
            f"| {row['seconds']['mflow']:>5.1f}s {row['seconds']['train']:>5.1f}s",
            flush=True,
        )
        write_json(args.json, {"machine": machine(), "rows": rows})  # so far
    result = {"machine": machine(), "date": time.strftime("%Y-%m-%d"), "rows": rows}
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
