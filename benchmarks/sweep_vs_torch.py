"""An init-scale sweep of the quadratic network: nqfjax against PyTorch.

The work (issue 7, part 1): the quadratic network `f(x) = sum_i (u_i . x)^2`
with `d = 64` inputs and `m = 128` units, trained by full-batch gradient descent
(learning rate 2e-3, 2,000 steps) on `n = 1024` fixed Gaussian samples of a
low-rank diagonal teacher `y = x^T diag(1, 1/2, 1/4, 1/8, 0, ...) x`, from
`W0 = sigma Z` for 32 init scales `sigma` log-spaced in [1e-6, 1e-2] (one fixed
`Z`), all in float32. The loss is recorded at 50 log-spaced steps.

- nqfjax: `sweep(lambda init_scale: train(...).loss, {"init_scale": scales})`,
  i.e. `jax.jit(jax.vmap(train))` over the sweep axis. `sweep` traces and
  compiles on every call, so the script times one `sweep()` call end to end and,
  separately, the compiled program `sweep` runs (`jax.jit(jax.vmap(fn))` on the
  same grid, compiled once; its output is checked equal to `sweep`'s).
- PyTorch, written the way a PyTorch user would: the weights of the whole sweep
  as one `(32, d, m)` tensor, batched matmuls over the sweep axis (`X @ W`, a
  `bmm`), manual GD. Variants: hand-written gradient (the main peer, the
  fastest eager one), autograd gradient (`--autograd`), and `torch.compile` of the
  hand-written step (when it builds). PyTorch runs with the faster of 1 and
  its default number of threads on a short probe (on the loaded 2-core
  machine its 2-thread OpenMP ran 2x slower than 1 thread).

FLOPs counted: the matmuls of the GD steps, `4 n d m` per step and run (forward
`X W`, gradient `X^T (r * 2 H)`), plus `2 n d m` per recorded loss. The float32
matmul peak is measured in the same run (square 2048 matmuls in JAX and in
PyTorch, the best of both).

PyTorch eager allocates large temporaries every step; glibc would hand them back
to the OS each time (measured to double its time on one run), so the script
re-executes itself with `MALLOC_MMAP_THRESHOLD_` / `MALLOC_TRIM_THRESHOLD_` set
(they must be set before the process starts; both sides share the process).

    python benchmarks/sweep_vs_torch.py                     # full (< 5 min idle)
    python benchmarks/sweep_vs_torch.py --quick             # smoke test
    python benchmarks/sweep_vs_torch.py --no-torch-compile  # skip torch.compile
    python benchmarks/sweep_vs_torch.py --autograd          # also torch autograd
"""

import os
import sys


# glibc malloc tunables for the PyTorch peer; they only act if set before the
# process starts, hence the re-exec. The mmap threshold is capped by glibc at
# 32 MiB on 64-bit (larger values are ignored); the per-step temporaries here
# are 16 MiB.
MALLOC_ENV = {
    "MALLOC_MMAP_THRESHOLD_": str(32 * 1024 * 1024),
    "MALLOC_TRIM_THRESHOLD_": str(16 * 1024**3),
}
if __name__ == "__main__" and any(
    os.environ.get(k) != v for k, v in MALLOC_ENV.items()
):
    os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **MALLOC_ENV})

os.environ.setdefault("JAX_PLATFORMS", "cpu")


import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import (  # noqa: E402
    alternate,
    compile_jax,
    compile_line,
    enabled,
    fmt_seconds,
    machine,
    make_parser,
    ratio,
    ratio_line,
    table,
    time_call,
    write_json,
)

import nqfjax  # noqa: E402
from nqfjax import log_spaced_steps  # noqa: E402


TARGET_RATIO = 2.5  # issue 7: nqfjax >= 2.5x faster than PyTorch
TARGET_PEAK = 0.70  # ... and >= 70% of the measured float32 matmul peak
AGREEMENT = 1e-3  # largest relative difference of the loss curves accepted


def problem(n: int, d: int, m: int, num_scales: int, seed: int = 0):
    """`(xs, ys, Z, scales)` in float32 (numpy)."""
    rng = np.random.default_rng(seed)
    xs = rng.standard_normal((n, d)).astype(np.float32)
    teacher = np.zeros(d, np.float32)
    teacher[:4] = [1.0, 0.5, 0.25, 0.125]  # low-rank diagonal M*
    ys = ((xs**2) @ teacher)[:, None].astype(np.float32)
    Z = rng.standard_normal((d, m)).astype(np.float32)
    scales = np.geomspace(1e-6, 1e-2, num_scales).astype(np.float32)
    return xs, ys, Z, scales


# -- PyTorch ---------------------------------------------------------------------


def torch_step_fn(X, y, lr):
    """One GD step on the whole sweep, gradient written by hand:
    `H = X W` (bmm), `r = sum_m H^2 - y`, `grad = X^T (2 r H) / n`."""
    XT = X.T.contiguous()
    n = X.shape[0]

    def step(W):
        H = torch.matmul(X, W)  # (S, n, m)
        r = (H * H).sum(-1) - y  # (S, n)
        G = torch.matmul(XT, H * (r * (2.0 / n)).unsqueeze(-1))  # (S, d, m)
        return W - lr * G

    return step


def torch_autograd_step_fn(X, y, lr):
    """The same step with the gradient from autograd."""

    def step(W):
        W = W.detach().requires_grad_()
        r = (torch.matmul(X, W) ** 2).sum(-1) - y
        loss = 0.5 * (r * r).mean(-1).sum()  # the members are independent
        (g,) = torch.autograd.grad(loss, W)
        return (W - lr * g).detach()

    return step


def torch_losses(X, y, W):
    with torch.no_grad():
        r = (torch.matmul(X, W) ** 2).sum(-1) - y
        return 0.5 * (r * r).mean(-1)


def torch_sweep(step, X, y, W0, num_steps, record, *, grad=False):
    """Run `num_steps` steps from `W0` (shape `(S, d, m)`), recording the loss at
    the steps in `record`; returns the `(R, S)` losses as numpy. `grad`: whether
    `step` needs autograd."""
    slots = {s: i for i, s in enumerate(record)}
    out = torch.full((len(record), W0.shape[0]), float("nan"))
    W = W0
    with torch.set_grad_enabled(grad):
        for s in range(num_steps):
            if s in slots:
                out[slots[s]] = torch_losses(X, y, W)
            W = step(W)
        if num_steps in slots:
            out[slots[num_steps]] = torch_losses(X, y, W)
    return out.numpy()


def pick_threads(step, X, y, W0, num_steps: int = 20) -> tuple[int, dict]:
    """Set PyTorch's intra-op threads to the faster of 1 and the default on a
    short probe run (on a loaded 2-core machine its 2-thread OpenMP was measured
    2x slower than 1 thread; on an idle one 2 threads should win)."""
    default = torch.get_num_threads()
    probe = {}
    for threads in sorted({1, default}):
        torch.set_num_threads(threads)
        torch_sweep(step, X, y, W0, 2, (0,))  # warm up
        probe[threads] = min(
            time_call(lambda: torch_sweep(step, X, y, W0, num_steps, (0,)))[0]
            for _ in range(2)
        )
    best = min(probe, key=probe.get)
    torch.set_num_threads(best)
    return best, probe


# -- float32 matmul peak ---------------------------------------------------------


def matmul_peak(size: int = 2048, repeats: int = 3) -> dict[str, float]:
    """Best float32 GFLOP/s of a square matmul in JAX and in PyTorch."""
    a = jnp.asarray(np.random.default_rng(1).standard_normal((size, size)), jnp.float32)
    mm, _ = compile_jax(jax.jit(jnp.matmul), a, a)
    at = torch.from_numpy(np.array(a))  # a writable copy
    flops = 2.0 * size**3
    out = {}
    for name, fn in (("jax", lambda: mm(a, a)), ("torch", lambda: at @ at)):
        fn()
        out[name] = flops / min(time_call(fn)[0] for _ in range(repeats)) / 1e9
    return out


# -- main ------------------------------------------------------------------------


def main(argv=None) -> dict:
    parser = make_parser(
        __doc__,
        toggles=(
            (
                "torch-compile",
                "also time torch.compile (default: on, off with --quick)",
            ),
        ),
    )
    parser.add_argument(
        "--autograd",
        action="store_true",
        help="also time PyTorch with autograd, once (default: off)",
    )
    args = parser.parse_args(argv)

    if args.quick:
        n, d, m, num_scales, num_steps, repeats = 256, 64, 128, 4, 50, 1
    else:
        n, d, m, num_scales, num_steps, repeats = 1024, 64, 128, 32, 2000, 2
    repeats = args.repeats or repeats
    use_compile = enabled(args, "torch-compile")
    use_autograd = bool(args.autograd)
    lr = 2e-3
    torch.manual_seed(0)

    print(f"machine: {machine()}, torch threads {torch.get_num_threads()}")
    print(
        f"work: quadratic network d={d}, m={m}, n={n}, {num_steps} full-batch GD "
        f"steps (lr {lr}), {num_scales} init scales, float32"
    )
    print("malloc: " + ", ".join(f"{k}={os.environ.get(k)}" for k in MALLOC_ENV))

    xs, ys, Z, scales = problem(n, d, m, num_scales)
    record = log_spaced_steps(num_steps, 50)
    structure = nqfjax.QuadraticNet(d=d)

    def fn(init_scale):
        result = nqfjax.train(
            structure,
            xs,
            ys,
            num_steps=num_steps,
            learning_rate=lr,
            W0=Z,
            init_scale=init_scale,
            record_at=record,
            snapshots=False,
        )
        return result.loss

    # nqfjax: sweep() end to end (trace + compile + run), then the same program
    # compiled once.
    grid = {"init_scale": scales}
    sweep_s, swept = time_call(lambda: nqfjax.sweep(fn, grid, progress=False))
    loss_sweep = np.asarray(swept.outputs)  # (S, R)
    point = {"init_scale": jnp.asarray(scales)}
    program, compile_s = compile_jax(jax.jit(jax.vmap(lambda pt: fn(**pt))), point)
    loss_jax = np.asarray(program(point))
    same_as_sweep = bool(np.array_equal(loss_jax, loss_sweep))

    # PyTorch
    X, y = torch.from_numpy(xs), torch.from_numpy(ys[:, 0])
    W0 = torch.from_numpy(scales)[:, None, None] * torch.from_numpy(Z)
    steps = {"torch eager": torch_step_fn(X, y, lr)}
    if use_autograd:
        steps["torch autograd"] = torch_autograd_step_fn(X, y, lr)
    # threads first: torch.compile may bake the thread count into its kernels
    threads, probe = pick_threads(steps["torch eager"], X, y, W0)
    probe_line = ", ".join(f"{t} thread(s) {fmt_seconds(s)}" for t, s in probe.items())
    compile_note = "not tried (--no-torch-compile)"
    torch_compile_s = None
    if use_compile:
        try:
            compiled_step = torch.compile(torch_step_fn(X, y, lr))
            with torch.no_grad():
                torch_compile_s, _ = time_call(lambda: compiled_step(W0))
            steps["torch.compile"] = compiled_step
            compile_note = "built"
        except Exception as e:  # report, do not fail the benchmark
            compile_note = f"did not build: {type(e).__name__}: {str(e)[:200]}"
    # warm up every torch variant on a few steps (the JAX program ran above)
    for name, step in steps.items():
        torch_sweep(step, X, y, W0, 5, (0, 5), grad=name == "torch autograd")

    losses = {}  # the loss curves of the last timed run of each torch variant

    def torch_run(name):
        grad = name == "torch autograd"
        losses[name] = torch_sweep(steps[name], X, y, W0, num_steps, record, grad=grad)
        return losses[name]

    runs = {"nqfjax": lambda: program(point)}
    for name in steps:
        runs[name] = lambda name=name: torch_run(name)
    peak_before = matmul_peak()
    # the main pair with `repeats`; the secondary torch variants once each
    main_names = ["nqfjax", "torch eager"] + (
        ["torch.compile"] if "torch.compile" in runs else []
    )
    times = alternate({k: runs[k] for k in main_names}, repeats=repeats, warmup=0)
    if use_autograd:  # slower than eager: timed once, after the main pair
        times.update(
            alternate({"torch autograd": runs["torch autograd"]}, warmup=0, repeats=1)
        )
    peak_after = matmul_peak()
    peak = max(*peak_before.values(), *peak_after.values())

    # agreement of the loss curves
    diffs = {
        name: float(np.max(np.abs(loss_jax - L.T) / np.abs(L.T)))
        for name, L in losses.items()
    }
    finite = bool(np.all(np.isfinite(loss_jax)))

    flops = num_scales * (num_steps * 4.0 + len(record) * 2.0) * n * d * m
    gflops = {k: flops / np.median(v) / 1e9 for k, v in times.items()}
    best_torch = min(
        (k for k in times if k != "nqfjax"), key=lambda k: np.median(times[k])
    )

    print()
    print(compile_line("nqfjax (jit(vmap(train)))", compile_s))
    print(f"nqfjax sweep() call, trace + compile + run: {fmt_seconds(sweep_s)}")
    print(f"torch threads: 20-step probe {probe_line}; using {threads}")
    if torch_compile_s is not None:
        print(compile_line("torch.compile (first step)", torch_compile_s))
    print(f"torch.compile: {compile_note}")
    print(table(times, notes={k: f"{gflops[k]:6.1f} GFLOP/s" for k in times}))
    best = {k: max(peak_before[k], peak_after[k]) for k in peak_before}
    print(
        f"float32 matmul peak (2048^2, best): jax {best['jax']:.1f}, "
        f"torch {best['torch']:.1f} GFLOP/s "
        f"(before {peak_before['jax']:.1f}/{peak_before['torch']:.1f}, after "
        f"{peak_after['jax']:.1f}/{peak_after['torch']:.1f})"
    )
    frac = gflops["nqfjax"] / peak
    print(
        f"PEAK nqfjax: {gflops['nqfjax']:.1f} GFLOP/s = {100 * frac:.0f}% of the "
        f"measured float32 matmul peak; target >= {100 * TARGET_PEAK:.0f}%: "
        f"{'MET' if frac >= TARGET_PEAK else 'NOT MET'}"
    )
    for name in times:
        if name != "nqfjax":
            target = TARGET_RATIO if name == best_torch else None
            print(ratio_line(name, "nqfjax", times, target=target))
    print(
        "agreement: max relative difference of the loss curves, nqfjax vs "
        + ", ".join(f"{k} {v:.2e}" for k, v in diffs.items())
        + f" (accepted <= {AGREEMENT:g}); compiled program == sweep(): {same_as_sweep}"
    )

    result = dict(
        quick=args.quick,
        max_rel_diff=diffs,
        same_as_sweep=same_as_sweep,
        finite=finite,
        agree=bool(finite and same_as_sweep and max(diffs.values()) <= AGREEMENT),
        times=times,
        compile_s=compile_s,
        sweep_call_s=sweep_s,
        torch_compile=compile_note,
        torch_threads=threads,
        torch_thread_probe=probe,
        torch_compile_s=torch_compile_s,
        gflops=gflops,
        peak_gflops=peak,
        peak_fraction=frac,
        ratio=ratio(times[best_torch], times["nqfjax"]),
        best_torch=best_torch,
        machine=machine(),
    )
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
