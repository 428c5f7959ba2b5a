"""The cost of a prediction against training the network: the factored M-flow,
the M-flow and LV vs W-space.

The work: the tanh perceptron with `k = 4` outputs and `d = p - 4` inputs (so
`M` is `p x p`, `p = 16 ... 2048`), `m = 64` units, on `n` correlated Gaussian
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
  `solve_lv` from `diag(U^T M0 U)`;
- factored: `solve_mflow_factored(task, W0, ts, eta)` (its defaults: Tsit5),
  the flow of the `(p, m)` factor from the weights themselves (the prediction of
  `predict`'s automatic choice when `m < p`), and the loss along it;
- predict: what `predict`'s automatic choice pays in all, the factored flow
  plus `lv_reduce(task)`'s refusal of these data (tried first; timed once,
  compilation included), `W/pred` = W-space over that sum.

The M-flow and LV columns cost `O(p^3)` per step (and `lv_reduce` `O(p^3)`
once): they are timed up to `--dense-max-p` (default 512) and left out above.

**Memory** (`--memory`): each row's factored prediction (`task_from_samples`
and `solve_mflow_factored` with its loss, as `predict` runs them) is repeated in
a fresh subprocess, which reports its peak resident memory (`VmHWM`, reset after
importing jax and nqfjax and compiling one small program) minus its resident
memory then (so: the data, made in float64 then cast, the task with its dense
`(p, p)` `C`, the solve and its compiled program). The table then gives the
log-log slope of that peak against `p` at each `n` (fixed width `m`).

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
steps", and their curve check is left out (`dlogL` n/a). The M-flow, LV and
factored rows are always measured for real (`--probe-steps` sets the probe's
length: at p = 1024, n = 1e4 a GD step takes seconds).

    python benchmarks/predict_cost.py           # p = 128 ... 2048, n = 1e3, 1e4
    python benchmarks/predict_cost.py --quick   # p = 16, 32; n = 256
    python benchmarks/predict_cost.py --sizes 1024 --samples 10000 --memory
"""

import argparse
import json
import os
import subprocess
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


def _setup(n: int, p: int):
    xs, ys = problem(n, p)
    structure = nqfjax.Perceptron(d=p - K, k=K)
    eta, num_steps = default_hyperparameters(structure, xs, ys, SIGMA)
    record = nqfjax.engines.train.log_spaced_steps(num_steps, RECORDS)
    ts = jnp.asarray(record, jnp.float32)
    W0 = SIGMA * jr.normal(jr.split(jr.key(0))[0], (p, WIDTH), jnp.float32)
    return xs, ys, structure, eta, num_steps, record, ts, W0


def _factored(eta):
    def run(task, W0, ts):
        sol = nqfjax.solve_mflow_factored(task, W0, ts, eta)
        return sol.loss, sol.stats["num_steps"]

    return run


def _engines(structure, eta, num_steps, record, xs, ys, ts, W0, task, dense):
    """The engines to time, `name -> (function, arguments)`, and the one-off
    `lv_reduce` seconds (None without the dense columns)."""

    def m_flow(task, M0, ts):
        sol = nqfjax.solve_mflow(task, M0, ts, eta, solver=diffrax.Tsit5())
        return sol.loss, sol.stats["num_steps"]

    def lv_flow(lv, m0, ts):
        sol = nqfjax.solve_lv(lv, m0, ts, eta)
        return sol.loss, sol.stats["num_steps"]

    engines = {
        "W-space": (w_space(structure, eta, num_steps, record), (xs, ys, W0)),
        "factored": (_factored(eta), (task, W0, ts)),
    }
    if not dense:
        return engines, None
    M0 = W0 @ W0.T
    reduce_s, (lv, basis) = time_call(lambda: nqfjax.lv_reduce(task, tol=np.inf))
    m0 = jnp.einsum("ik,ij,jk->k", basis, M0, basis)
    engines["M-flow"] = (m_flow, (task, M0, ts))
    engines["LV"] = (lv_flow, (lv, m0, ts))
    return engines, reduce_s


def _refused(task) -> None:
    """`lv_reduce(task)`, which `predict` tries first: it must refuse."""
    try:
        nqfjax.lv_reduce(task)
    except nqfjax.NotReducibleError:
        return
    raise SystemExit("lv_reduce accepted the correlated inputs")


def one_size(
    n: int, p: int, repeats: int, w_budget: float, probe_steps: int, dense: bool
) -> dict:
    xs, ys, structure, eta, num_steps, record, ts, W0 = _setup(n, p)
    task_s, task = time_call(lambda: nqfjax.task_from_samples(structure, xs, ys))
    refusal_s, _ = time_call(lambda: _refused(task))

    # W-space: a first timed probe decides between the full horizon and the
    # linear extrapolation of probe_steps steps (constant cost per GD step)
    probe_steps = min(probe_steps, num_steps)
    probe_record = nqfjax.engines.train.log_spaced_steps(probe_steps, 10)
    probe, probe_compile_s = compile_jax(
        jax.jit(w_space(structure, eta, probe_steps, probe_record)), xs, ys, W0
    )
    time_call(lambda: probe(xs, ys, W0))  # warm-up
    estimate = time_call(lambda: probe(xs, ys, W0))[0] * num_steps / probe_steps
    extrapolated = estimate > w_budget

    engines, reduce_s = _engines(
        structure, eta, num_steps, record, xs, ys, ts, W0, task, dense
    )
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
    dlog = lambda a, b: float(np.max(np.abs(np.log(curves[a] / curves[b]))))  # noqa: E731
    over = lambda name: med["W-space"] / med[name] if name in med else None  # noqa: E731
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
        "W_over_mflow": over("M-flow"),
        "W_over_lv": over("LV"),
        "W_over_lv_with_reduce": (
            None if reduce_s is None else med["W-space"] / (med["LV"] + reduce_s)
        ),
        "W_over_factored": over("factored"),
        "refusal_seconds": refusal_s,
        "W_over_predict": med["W-space"] / (med["factored"] + refusal_s),
        "mflow_vs_W_max_dlogL": (
            None if extrapolated or not dense else dlog("W-space", "M-flow")
        ),
        "factored_vs_W_max_dlogL": None
        if extrapolated
        else dlog("W-space", "factored"),
        "factored_vs_mflow_max_dlogL": dlog("factored", "M-flow") if dense else None,
    }


def _status_mb(field: str) -> float:
    """A field of `/proc/self/status` (`VmRSS`, `VmHWM`), in MB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024.0
    raise SystemExit(f"no {field} in /proc/self/status")


def memory_child(n: int, p: int) -> dict:
    """In a fresh process: the peak resident memory of the factored prediction
    (data, task, solve, loss) above the resident memory after the imports and a
    first compile. The high-water mark is reset there (`/proc/self/clear_refs`,
    Linux): `ru_maxrss` cannot be, and the transient peak of importing jax and
    nqfjax (~680 MB here) hides any prediction smaller than it."""
    jax.block_until_ready(jax.jit(lambda x: 2 * x)(jnp.ones(4)))
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current VmRSS
    baseline = _status_mb("VmRSS")
    xs, ys, structure, eta, _, _, ts, W0 = _setup(n, p)
    after_data = _status_mb("VmHWM")
    task = nqfjax.task_from_samples(structure, xs, ys)
    loss, _ = jax.block_until_ready(jax.jit(_factored(eta))(task, W0, ts))
    if not np.all(np.isfinite(np.asarray(loss))):
        raise SystemExit(f"non-finite factored loss at n={n}, p={p}")
    return {
        "baseline_mb": baseline,
        "data_mb": after_data - baseline,
        "peak_mb": _status_mb("VmHWM") - baseline,
    }


def peak_memory(n: int, p: int) -> dict:
    """`memory_child(n, p)` run in a fresh interpreter (its own high-water mark)."""
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--memory-child", f"{n},{p}"],
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        raise SystemExit(f"memory child failed at n={n}, p={p}:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def memory_slopes(rows: list[dict]) -> dict:
    """The log-log slope of the factored prediction's peak memory against `p`,
    per `n` (rows with a memory measurement, at least two sizes)."""
    slopes = {}
    for n in sorted({row["n"] for row in rows}):
        pts = [(r["p"], r["memory"]["peak_mb"]) for r in rows if r["n"] == n]
        pts = [(p, m) for p, m in pts if m > 0]
        if len(pts) >= 2:
            x, y = np.log([p for p, _ in pts]), np.log([m for _, m in pts])
            slopes[str(n)] = float(np.polyfit(x, y, 1)[0])
    return slopes


def _sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise SystemExit(f"--sizes/--samples: expected e.g. 16,32,64, got {text!r}")
    if not sizes or min(sizes) <= K:
        raise SystemExit(f"--sizes/--samples: every value must be > {K}, got {text!r}")
    return sizes


def _print_row(row: dict) -> None:
    s = row["seconds"]
    cell = lambda v: "-" if v is None else fmt_seconds(v)  # noqa: E731
    x = lambda v, f: "-" if v is None else f"{v:{f}}x"  # noqa: E731
    dlog = row["factored_vs_W_max_dlogL"]
    probe = row["W_extrapolated_from_steps"]
    note = "" if probe is None else f"  W extrapolated from {probe} steps"
    mem = row.get("memory")
    mem = "-" if mem is None else f"{mem['peak_mb']:.0f} MB"
    steps = row["solver_steps"]
    print(
        f"{row['n']:>6} {row['p']:>5} {row['steps']:>6} {cell(s['W-space']):>9} "
        f"{cell(s['factored']):>9} {cell(s.get('M-flow')):>9} "
        f"{cell(s.get('LV')):>9} {cell(row['lv_reduce_seconds']):>9}  "
        f"{cell(row['refusal_seconds']):>9} {x(row['W_over_predict'], '.1f'):>8} "
        f"{x(row['W_over_factored'], '.1f'):>8} {x(row['W_over_mflow'], '.2f'):>8} "
        f"{x(row['W_over_lv'], '.1f'):>8} "
        f"{'n/a' if dlog is None else f'{dlog:.3f}':>6} "
        f"{steps['factored']:>5}/{steps.get('M-flow', '-')!s:<5} {mem:>8}  "
        f"{row['load_average'][0]:.1f}{note}",
        flush=True,
    )


def main(argv=None) -> dict:
    parser = make_parser(__doc__)
    parser.add_argument("--max-p", type=int, default=2048, help="largest p")
    parser.add_argument(
        "--sizes", help="comma-separated p (default: 128,512,1024,2048)"
    )
    parser.add_argument("--samples", help="comma-separated n (default: 1000,10000)")
    parser.add_argument(
        "--w-budget",
        type=float,
        default=60.0,
        help="seconds above which a W-space row is extrapolated (default 60)",
    )
    parser.add_argument(
        "--probe-steps",
        type=int,
        default=PROBE_STEPS,
        help=f"W-space steps timed for an extrapolated row (default {PROBE_STEPS})",
    )
    parser.add_argument(
        "--dense-max-p",
        type=int,
        default=512,
        help="largest p for the O(p^3) M-flow and LV columns (default 512)",
    )
    parser.add_argument(
        "--memory",
        action="store_true",
        help="measure each row's peak memory in a fresh subprocess",
    )
    parser.add_argument("--memory-child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.memory_child:
        n, p = (int(v) for v in args.memory_child.split(","))
        print(json.dumps(memory_child(n, p)))
        return {}
    if args.quick:
        sizes, samples, repeats = (16, 32), (256,), 1
    else:
        sizes = tuple(p for p in (128, 512, 1024, 2048) if p <= args.max_p)
        samples, repeats = (1000, 10000), 2
    sizes = _sizes(args.sizes) if args.sizes else sizes
    samples = _sizes(args.samples) if args.samples else samples
    repeats = args.repeats or repeats
    print(f"machine: {machine()}")
    print(
        f"work: tanh perceptron k={K}, d=p-{K}, m={WIDTH}, sigma={SIGMA:g}, "
        "correlated Gaussian inputs, float32"
    )
    header = (
        f"{'n':>6} {'p':>5} {'steps':>6} {'W-space':>9} {'factored':>9} "
        f"{'M-flow':>9} {'LV':>9} {'lv_reduce':>9}  {'refusal':>9} {'W/pred':>8} "
        f"{'W/fact':>8} {'W/M-flow':>8} "
        f"{'W/LV':>8} {'dlogL':>6} {'F/M steps':>11} {'peak mem':>8}  load"
    )
    print(header)
    rows = []
    for n in samples:
        for p in sizes:
            dense = p <= args.dense_max_p
            row = one_size(n, p, repeats, args.w_budget, args.probe_steps, dense)
            if args.memory:
                row["memory"] = peak_memory(n, p)
            row["load_average"] = os.getloadavg()
            rows.append(row)
            _print_row(row)
            if not all(np.isfinite(v) for v in row["seconds"].values()):
                raise SystemExit(f"non-finite timing at n={n}, p={p}")
    result = {"machine": machine(), "rows": rows}
    if args.memory:
        result["memory_slopes"] = memory_slopes(rows)
        for n, slope in result["memory_slopes"].items():
            print(f"peak memory against p at n = {n}: slope {slope:.2f} (log-log)")
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
