"""Many tiny training runs: `nqfjax.sweep` against a Python loop of jitted runs.

The work (issue 7, part 2): 1,024 runs of the quadratic network with `d = 8`
inputs and `m = 16` units, full-batch GD (learning rate 1e-2, 500 steps) on
`n = 64` fixed Gaussian samples of the teacher `y = x^T diag(1, 1/2, 0, ...) x`,
over a 32 x 32 grid of init scales (log-spaced in [1e-6, 1e-2]) and seeds
(isotropic Gaussian init from `jax.random.key(seed)`), float32, the loss
recorded at 20 log-spaced steps. This is the dispatch-bound case: one run is far
too small to keep two cores busy.

- nqfjax: `sweep(fn, {"init_scale": ..., "seed": ...}, chunk=32)`, which runs
  `jax.jit(jax.vmap(fn))` over the points, 32 at a time (32 runs keep a step's
  intermediates in the L2 cache; one chunk of all 1,024 runs was measured ~3x
  slower, and is timed too). `sweep` traces and compiles its chunk program on
  its first call and keeps it for later calls with the same function and
  shapes: the script times a first `sweep()` call end to end, a second one on
  other init scales (counting the XLA compilations it triggers, through
  `jax.monitoring`: there should be none), and, separately, the compiled
  program `sweep` runs (compiled once, applied chunk by chunk; its output is
  checked equal to `sweep`'s).
- Python loop: `jax.jit(fn)` (the same `fn`) called once per grid point, the
  results collected in a list and stacked (asynchronous dispatch lets the loop
  run ahead of the computation; the clock stops when the stack is ready).

    python benchmarks/small_sweep.py           # full (< 1 min idle)
    python benchmarks/small_sweep.py --quick   # smoke test
"""

import os
import sys


os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import jax.random as jr  # noqa: E402
import numpy as np  # noqa: E402


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import (  # noqa: E402
    alternate,
    compile_jax,
    compile_line,
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


TARGET_RATIO = 20.0  # issue 7: vmap >= 20x faster than the Python loop
AGREEMENT = 1e-4  # largest relative difference of the loss curves accepted


def problem(n: int, d: int, num_scales: int, num_seeds: int, seed: int = 0):
    """`(xs, ys, grid)` in float32 / int32 (numpy); `grid` is zipped."""
    rng = np.random.default_rng(seed)
    xs = rng.standard_normal((n, d)).astype(np.float32)
    teacher = np.zeros(d, np.float32)
    teacher[:2] = [1.0, 0.5]
    ys = ((xs**2) @ teacher)[:, None].astype(np.float32)
    grid = nqfjax.grid_product(
        {
            "init_scale": np.geomspace(1e-6, 1e-2, num_scales).astype(np.float32),
            "seed": np.arange(num_seeds, dtype=np.int32),
        }
    )
    return xs, ys, grid


def main(argv=None) -> dict:
    parser = make_parser(__doc__)
    parser.add_argument(
        "--chunk",
        type=int,
        default=32,
        help="sweep chunk size (default 32: measured fastest on a 2-core CPU)",
    )
    args = parser.parse_args(argv)

    if args.quick:
        num_scales, num_seeds, num_steps, repeats = 8, 8, 100, 1
    else:
        num_scales, num_seeds, num_steps, repeats = 32, 32, 500, 3
    repeats = args.repeats or repeats
    n, d, m, lr = 64, 8, 16, 1e-2

    print(f"machine: {machine()}")
    print(
        f"work: {num_scales * num_seeds} runs of the quadratic network d={d}, m={m}, "
        f"n={n}, {num_steps} full-batch GD steps (lr {lr}), float32"
    )
    xs, ys, grid = problem(n, d, num_scales, num_seeds)
    structure = nqfjax.QuadraticNet(d=d)

    def fn(init_scale, seed):
        result = nqfjax.train(
            structure,
            xs,
            ys,
            num_steps=num_steps,
            learning_rate=lr,
            key=jr.key(seed),
            init_scale=init_scale,
            width=m,
            num_records=20,
            snapshots=False,
        )
        return result.loss

    # nqfjax: sweep() end to end, then the same program compiled once
    chunk = min(args.chunk, len(grid["seed"]))
    sweep_s, swept = time_call(
        lambda: nqfjax.sweep(fn, grid, chunk=chunk, progress=False)
    )
    loss_sweep = np.asarray(swept.outputs)
    # a second call, other init scales: the chunk program is reused
    compiles = []

    def listener(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(duration)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        again = {**grid, "init_scale": grid["init_scale"] * 2}
        second_s, _ = time_call(
            lambda: nqfjax.sweep(fn, again, chunk=chunk, progress=False).outputs
        )
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    second_compile_s = float(sum(compiles))
    # the program `sweep` runs, applied chunk by chunk as `sweep` does (each chunk
    # copied to the host before the next starts)
    chunks = [
        {k: jnp.asarray(v[i : i + chunk]) for k, v in grid.items()}
        for i in range(0, len(grid["seed"]), chunk)
    ]
    batched = jax.jit(jax.vmap(lambda pt: fn(**pt)))
    program, compile_s = compile_jax(batched, chunks[0])

    def vmapped():
        return np.concatenate([np.asarray(program(c)) for c in chunks])

    loss_vmap = vmapped()
    same_as_sweep = bool(np.array_equal(loss_vmap, loss_sweep))
    runs = {"nqfjax sweep (vmap)": vmapped}

    # the Python loop over a jitted single run
    single = jax.jit(fn)
    _, single_compile_s = compile_jax(single, grid["init_scale"][0], grid["seed"][0])
    pairs = list(zip(grid["init_scale"], grid["seed"]))  # numpy scalars
    out = {}

    def loop():
        out["loop"] = jnp.stack([single(s, k) for s, k in pairs])
        return out["loop"]

    runs["python loop"] = loop
    whole_compile_s = None
    if not args.quick:  # for reference: all points in one chunk (`sweep`'s default)
        points = {k: jnp.asarray(v) for k, v in grid.items()}
        whole, whole_compile_s = compile_jax(batched, points)
        runs["vmap, one chunk"] = lambda: whole(points)
    times = alternate(runs, repeats=repeats)
    loss_loop = np.asarray(out["loop"])
    diff = float(np.max(np.abs(loss_vmap - loss_loop) / np.abs(loss_loop)))
    finite = bool(np.all(np.isfinite(loss_vmap)))

    print()
    print(compile_line(f"nqfjax (jit(vmap(train)), chunk {chunk})", compile_s))
    if whole_compile_s is not None:
        print(compile_line("nqfjax, one chunk of all runs", whole_compile_s))
    print(compile_line("single run (jit(train))", single_compile_s))
    print(f"nqfjax sweep() call, trace + compile + run: {fmt_seconds(sweep_s)}")
    print(
        f"nqfjax second sweep() call, same function and shapes: "
        f"{fmt_seconds(second_s)}, {len(compiles)} XLA compilations "
        f"({fmt_seconds(second_compile_s)} compiling)"
    )
    print(table(times))
    per_run = {k: 1e6 * np.median(v) / len(pairs) for k, v in times.items()}
    print("per run: " + ", ".join(f"{k} {v:.0f} us" for k, v in per_run.items()))
    print(ratio_line("python loop", "nqfjax sweep (vmap)", times, target=TARGET_RATIO))
    if "vmap, one chunk" in times:
        print(ratio_line("python loop", "vmap, one chunk", times))
    print(
        f"agreement: max relative difference of the loss curves, vmap vs loop "
        f"{diff:.2e} (accepted <= {AGREEMENT:g}); compiled program == sweep(): "
        f"{same_as_sweep}"
    )
    result = dict(
        quick=args.quick,
        max_rel_diff=diff,
        same_as_sweep=same_as_sweep,
        finite=finite,
        agree=bool(finite and same_as_sweep and diff <= AGREEMENT),
        times=times,
        compile_s=compile_s,
        single_compile_s=single_compile_s,
        sweep_call_s=sweep_s,
        second_call_s=second_s,
        second_call_compiles=len(compiles),
        second_call_compile_s=second_compile_s,
        ratio=ratio(times["python loop"], times["nqfjax sweep (vmap)"]),
        machine=machine(),
    )
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
