"""The cost of a prediction against training the network: M-flow and LV vs W-space.

The work: the tanh perceptron with `k = 4` outputs and `d = p - 4` inputs (so
`M` is `p x p`, `p = 16 ... 512`), `m = 64` units, on `n` correlated Gaussian
inputs (covariance with eigenvalues `1 / (1 + j)`, in a random basis: not
whitened, so `lv_reduce` refuses them) labelled by a linear teacher whose
singular values are `0.5 * 0.7^j`; init scale `1e-4`, the learning rate that
makes the fastest growth rate 0.01 per step, and the horizon past the third
switch-on (`2.5 ln(1/sigma^2) / r_3` steps, `default_hyperparameters`), float32.
Each row times, at the same horizon and 100 log-spaced records:

- W-space: `nqfjax.train` of the real layer (full-batch GD, `m` units);
- M-flow: `solve_mflow(task, M0, ts, eta, solver=diffrax.Tsit5())` and the loss
  along it, from `M0 = W0 W0^T` (the prediction of
  `predict(engine=nqfjax.MFlowEngine(solver=diffrax.Tsit5()))`);
- LV: the approximate reduction of `predict(engine=nqfjax.ApproximateLVEngine())`:
  `lv_reduce(task, tol=inf)` (a one-off cost, printed apart) and
  `solve_lv` from `diag(U^T M0 U)`.

Each engine is compiled once per size (compile printed apart, not in the
ratios); the ratios are median W-space time over median engine time, and the
M-flow curve is checked against the W-space one (largest `|ln L_W / L_M|` up to
the horizon: the cubic term of tanh and GD's discretisation, not the solver).
The ODE solvers' step counts (`solver_steps`, accepted and rejected) are
printed with each row: the cost of a solve is its step count times the cost of
a step.

**Extrapolated W-space rows.** Where the W-space training to the horizon would
take longer than `--w-budget` seconds (estimated from a first timed run of
`PROBE_STEPS` steps), the row times `PROBE_STEPS` steps of the same compiled
full-batch GD (the same `nqfjax.train` program, shorter scan) and scales that
time linearly to the horizon. This is exact up to the fixed cost of one call
(microseconds against seconds): full-batch GD does the same work at every step
(one forward and backward pass over all `n` samples, one update), so its cost
is `steps x (cost per step)`. The table marks such rows "extrapolated from N
steps", and their curve check is left out (`dlogL` n/a). The M-flow and LV rows
are always measured for real.

    python benchmarks/predict_cost.py           # p = 16 ... 512, n = 256, 4096
    python benchmarks/predict_cost.py --quick   # p = 16, 32; n = 256
    python benchmarks/predict_cost.py --sizes 16,32,64 --samples 4096
"""

import os
import sys


os.environ.setdefault("JAX_PLATFORMS", "cpu")

import diffrax  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import jax.random as jr  # noqa: E402
import numpy as np  # noqa: E402


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import (  # noqa: E402
    compile_jax,
    fmt_seconds,
    machine,
    make_parser,
    time_call,
    write_json,
)

import nqfjax  # noqa: E402
from nqfjax.experiments.predict_file import default_hyperparameters  # noqa: E402


SIGMA, K, WIDTH, RECORDS = 1e-4, 4, 64, 100
PROBE_STEPS = 500  # W-space steps timed where a row is extrapolated


def problem(n: int, p: int, seed: int = 0):
    """`(xs, ys)` in float32: correlated Gaussian inputs, a linear teacher."""
    d = p - K
    rng = np.random.default_rng(seed)
    basis, _ = np.linalg.qr(rng.standard_normal((d, d)))
    xs = rng.standard_normal((n, d)) / np.sqrt(1.0 + np.arange(d)) @ basis.T
    left, _ = np.linalg.qr(rng.standard_normal((K, K)))
    right, _ = np.linalg.qr(rng.standard_normal((d, K)))
    ys = xs @ ((left * (0.5 * 0.7 ** np.arange(K))) @ right.T).T
    return xs.astype(np.float32), ys.astype(np.float32)


def w_space(structure, eta: float, num_steps: int, record):
    """`nqfjax.train` of the real layer for `num_steps` full-batch GD steps, as
    a function of `(xs, ys, W0)` returning the recorded loss."""

    def run(xs, ys, W0):
        out = nqfjax.train(
            structure,
            xs,
            ys,
            num_steps=num_steps,
            learning_rate=eta,
            W0=W0,
            record_at=record,
            snapshots=False,
        )
        return out.loss

    return run


def one_size(n: int, p: int, repeats: int, w_budget: float) -> dict:
    xs, ys = problem(n, p)
    structure = nqfjax.Perceptron(d=p - K, k=K)
    eta, num_steps = default_hyperparameters(structure, xs, ys, SIGMA)
    record = nqfjax.engines.train.log_spaced_steps(num_steps, RECORDS)
    ts = jnp.asarray(record, jnp.float32)
    key = jr.key(0)
    W0 = SIGMA * jr.normal(jr.split(key)[0], (p, WIDTH), jnp.float32)
    M0 = W0 @ W0.T

    task_s, task = time_call(lambda: nqfjax.task_from_samples(structure, xs, ys))
    reduce_s, (lv, basis) = time_call(lambda: nqfjax.lv_reduce(task, tol=np.inf))
    m0 = jnp.einsum("ik,ij,jk->k", basis, M0, basis)

    # W-space: a first timed probe decides between the full horizon and the
    # linear extrapolation of PROBE_STEPS steps (constant cost per GD step)
    probe_steps = min(PROBE_STEPS, num_steps)
    probe_record = nqfjax.engines.train.log_spaced_steps(probe_steps, 10)
    probe, probe_compile_s = compile_jax(
        jax.jit(w_space(structure, eta, probe_steps, probe_record)), xs, ys, W0
    )
    time_call(lambda: probe(xs, ys, W0))  # warm-up
    estimate = time_call(lambda: probe(xs, ys, W0))[0] * num_steps / probe_steps
    extrapolated = estimate > w_budget

    def m_flow(task, M0, ts):
        sol = nqfjax.solve_mflow(task, M0, ts, eta, solver=diffrax.Tsit5())
        return sol.loss, sol.stats["num_steps"]

    def lv_flow(lv, m0, ts):
        sol = nqfjax.solve_lv(lv, m0, ts, eta)
        return sol.loss, sol.stats["num_steps"]

    engines = {
        "W-space": (w_space(structure, eta, num_steps, record), (xs, ys, W0)),
        "M-flow": (m_flow, (task, M0, ts)),
        "LV": (lv_flow, (lv, m0, ts)),
    }
    compiled, compile_s, times, curves, solver_steps = {}, {}, {}, {}, {}
    scale = {name: 1.0 for name in engines}
    for name, (fn, args) in engines.items():
        if name == "W-space" and extrapolated:
            compiled[name], compile_s[name] = probe, probe_compile_s
            scale[name] = num_steps / probe_steps
        else:
            compiled[name], compile_s[name] = compile_jax(jax.jit(fn), *args)
        times[name] = []
    for _ in range(repeats):  # alternate, so a slow spell hits every engine
        for name, (_, args) in engines.items():
            seconds, out = time_call(lambda: compiled[name](*args))
            times[name].append(seconds * scale[name])
            if name != "W-space":  # the ODE solvers also return their step count
                out, solver_steps[name] = out[0], int(out[1])
            curves[name] = np.asarray(out, np.float64)
    med = {name: float(np.median(t)) for name, t in times.items()}
    departure = None
    if not extrapolated:
        ratio = curves["W-space"] / curves["M-flow"]
        departure = float(np.max(np.abs(np.log(ratio))))
    return {
        "n": n,
        "p": p,
        "steps": num_steps,
        "seconds": med,
        "W_extrapolated_from_steps": probe_steps if extrapolated else None,
        "solver_steps": solver_steps,
        "compile_seconds": compile_s,
        "task_seconds": task_s,
        "lv_reduce_seconds": reduce_s,
        "W_over_mflow": med["W-space"] / med["M-flow"],
        "W_over_lv": med["W-space"] / med["LV"],
        "W_over_lv_with_reduce": med["W-space"] / (med["LV"] + reduce_s),
        "mflow_vs_W_max_dlogL": departure,
    }


def _sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise SystemExit(f"--sizes/--samples: expected e.g. 16,32,64, got {text!r}")
    if not sizes or min(sizes) <= K:
        raise SystemExit(f"--sizes/--samples: every value must be > {K}, got {text!r}")
    return sizes


def main(argv=None) -> dict:
    parser = make_parser(__doc__)
    parser.add_argument("--max-p", type=int, default=512, help="largest p")
    parser.add_argument(
        "--sizes", help="comma-separated p (default: 16,32,64,128,256,512)"
    )
    parser.add_argument("--samples", help="comma-separated n (default: 256,4096)")
    parser.add_argument(
        "--w-budget",
        type=float,
        default=60.0,
        help="seconds above which a W-space row is extrapolated (default 60)",
    )
    args = parser.parse_args(argv)
    if args.quick:
        sizes, samples, repeats = (16, 32), (256,), 1
    else:
        sizes = tuple(p for p in (16, 32, 64, 128, 256, 512) if p <= args.max_p)
        samples, repeats = (256, 4096), 2
    sizes = _sizes(args.sizes) if args.sizes else sizes
    samples = _sizes(args.samples) if args.samples else samples
    repeats = args.repeats or repeats
    print(f"machine: {machine()}")
    print(
        f"work: tanh perceptron k={K}, d=p-{K}, m={WIDTH}, sigma={SIGMA:g}, "
        "correlated Gaussian inputs, float32"
    )
    header = (
        f"{'n':>5} {'p':>4} {'steps':>6} {'W-space':>9} {'M-flow':>9} {'LV':>9} "
        f"{'lv_reduce':>9}  {'W/M-flow':>8} {'W/LV':>8} {'W/(LV+red)':>10} "
        f"{'dlogL':>6} {'M/LV steps':>11}  load"
    )
    print(header)
    rows = []
    for n in samples:
        for p in sizes:
            row = one_size(n, p, repeats, args.w_budget)
            row["load_average"] = os.getloadavg()
            rows.append(row)
            s = row["seconds"]
            dlog = row["mflow_vs_W_max_dlogL"]
            probe = row["W_extrapolated_from_steps"]
            note = "" if probe is None else f"  W extrapolated from {probe} steps"
            print(
                f"{n:>5} {p:>4} {row['steps']:>6} {fmt_seconds(s['W-space']):>9} "
                f"{fmt_seconds(s['M-flow']):>9} {fmt_seconds(s['LV']):>9} "
                f"{fmt_seconds(row['lv_reduce_seconds']):>9}  "
                f"{row['W_over_mflow']:>7.2f}x {row['W_over_lv']:>7.1f}x "
                f"{row['W_over_lv_with_reduce']:>9.2f}x "
                f"{'n/a' if dlog is None else f'{dlog:.3f}':>6} "
                f"{row['solver_steps']['M-flow']:>5}/{row['solver_steps']['LV']:<5}  "
                f"{row['load_average'][0]:.1f}{note}",
                flush=True,
            )
            ok = all(np.isfinite(v) for v in s.values())
            if not ok:
                raise SystemExit(f"non-finite timing at n={n}, p={p}")
    result = {"machine": machine(), "rows": rows}
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
