"""The cost of a sampled task: closed-form batch hooks against the generic path.

The work: `task_from_samples(structure, xs, ys)` (which computes `C` and `y2`)
followed by one application `task.K(X)`, for every built-in structure at its
user default, float32, with `n = 256` samples and `p` from 16 to 512
(structures whose `p` is fixed by a formula get the nearest `p`: the softmax
mixture of experts has `p = 2d + 1`). This is the per-step work of the M-space
flow (`solve_mflow` applies `K` at every vector-field evaluation) and the
one-off work of building a task.

- closed form: the built-in structure, whose `contract` and `weighted_sum`
  hooks never form a `(p, p)` matrix per sample.
- generic: the same structure seen only through `A`, `unit` and `layer` (a
  wrapper), so the hooks are `AbstractStructure`'s defaults, which stack
  `A(x_s)` for a chunk of samples: the path a user's own structure takes until
  it overrides them.

Both are compiled once (compile time not in the run time, printed per row) and
timed alternately; the two agree to float32 round-off (`max rel diff`). The
ratio is generic over closed form, median over median.

Memory: XLA's compiled temporary buffer (`memory_analysis().temp_size_in_bytes`)
of `K` at `p = 512` for chunks of 8, 16, 32 and 64 samples: the slope is the
memory per sample processed at once, linear in the chunk and independent of
`n`; the closed form's slope is `O(sample_size())` numbers, the generic one's
`k p^2`.

    python benchmarks/task_cost.py           # full (a few minutes)
    python benchmarks/task_cost.py --quick   # smoke test: p = 16, 32, n = 32
"""

import os
import sys


os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import (  # noqa: E402
    alternate,
    compile_jax,
    fmt_seconds,
    machine,
    make_parser,
    ratio,
    write_json,
)

import nqfjax  # noqa: E402


class Generic(nqfjax.AbstractStructure):
    """`inner` seen only through `A`, `unit` and `layer`: the default hooks."""

    inner: nqfjax.AbstractStructure
    p = property(lambda self: self.inner.p)
    k = property(lambda self: self.inner.k)
    input_shape = property(lambda self: self.inner.input_shape)
    additive = property(lambda self: self.inner.additive)
    max_units = property(lambda self: self.inner.max_units)

    def A(self, x):
        return self.inner.A(x)

    def unit(self, w, x):
        return self.inner.unit(w, x)

    def layer(self, W, x):
        return self.inner.layer(W, x)


# name -> p -> the structure with (about) p parameters per unit
FAMILIES = {
    "perceptron (k=2)": lambda p: nqfjax.Perceptron(d=p - 2, k=2),
    "quadratic": lambda p: nqfjax.QuadraticNet(d=p),
    "qk_attention (T=8)": lambda p: nqfjax.QKAttention(T=8, d=p // 2),
    "ov_attention (T=8)": lambda p: nqfjax.OVAttention(T=8, d=p - 1),
    "moe softmax (E=4)": lambda p: nqfjax.MixtureOfExperts(d=(p - 1) // 2),
    "moe factor": lambda p: nqfjax.MixtureOfExperts(d=p // 2, gate="factor"),
    "conv1d (s=3)": lambda p: nqfjax.Conv1D(length=p - 1, kernel_size=3),
}


def _build_and_apply(structure, xs, ys, X, batch_size=None):
    task = nqfjax.task_from_samples(structure, xs, ys, batch_size=batch_size)
    return task.C, task.K(X)


def _data(structure, n, key):
    kx, ky, kX = jax.random.split(key, 3)
    xs = jax.random.normal(kx, (n, *structure.input_shape), jnp.float32)
    ys = jax.random.normal(ky, (n, structure.k), jnp.float32)
    G = jax.random.normal(kX, (structure.p, structure.p), jnp.float32)
    return xs, ys, (G + G.T) / structure.p


def _rel_diff(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def time_row(structure, n, repeats, key):
    args = _data(structure, n, key)
    fns, out, compile_s = {}, {}, {}
    for name, s in (("closed", structure), ("generic", Generic(structure))):
        jitted = jax.jit(lambda *a, s=s: _build_and_apply(s, *a))
        compiled, compile_s[name] = compile_jax(jitted, *args)
        fns[name] = lambda compiled=compiled: compiled(*args)
        out[name] = fns[name]()
    times = alternate(fns, repeats=repeats)
    diff = max(_rel_diff(a, b) for a, b in zip(out["closed"], out["generic"]))
    return times, compile_s, diff


def temp_bytes(structure, n, batch_size, key) -> int:
    xs, ys, X = _data(structure, n, key)
    task = nqfjax.task_from_samples(structure, xs, ys, batch_size=batch_size)
    compiled = jax.jit(lambda X: task.K(X)).lower(X).compile()
    return int(compiled.memory_analysis().temp_size_in_bytes)


def main() -> None:
    args = make_parser(__doc__, quick_help="p = 16, 32 and n = 32").parse_args()
    ps = [16, 32] if args.quick else [16, 64, 256, 512]
    n = 32 if args.quick else 256
    repeats = args.repeats or (1 if args.quick else 3)
    key = jax.random.key(0)
    print(machine())
    print(f"n = {n} samples, float32, task_from_samples + one K application\n")
    rows, worst = [], 0.0
    header = (
        f"{'structure':20} {'p':>4}  {'closed':>9}  {'generic':>9}  {'ratio':>7}"
        f"  {'compile c/g':>17}  max rel diff"
    )
    print(header)
    for family, make in FAMILIES.items():
        for p in ps:
            structure = make(p)
            key, sub = jax.random.split(key)
            times, comp, diff = time_row(structure, n, repeats, sub)
            worst = max(worst, diff)
            r = ratio(times["generic"], times["closed"])
            med = {k: float(np.median(v)) for k, v in times.items()}
            rows.append(
                dict(
                    structure=family,
                    p=structure.p,
                    closed_s=med["closed"],
                    generic_s=med["generic"],
                    ratio=r,
                    compile_s=comp,
                    max_rel_diff=diff,
                )
            )
            print(
                f"{family:20} {structure.p:>4}  {fmt_seconds(med['closed']):>9}  "
                f"{fmt_seconds(med['generic']):>9}  {r:>6.1f}x  "
                f"{fmt_seconds(comp['closed']):>8}/{fmt_seconds(comp['generic']):>8}"
                f"  {diff:.1e}"
            )

    p_mem = ps[-1]
    print(f"\nK's temporary memory at p ~ {p_mem} against the chunk size")
    chunks = [8, 16, 32] if args.quick else [8, 16, 32, 64]
    memory = {}
    for family, make in FAMILIES.items():
        structure = make(p_mem)
        per = {}
        for name, s in (("closed", structure), ("generic", Generic(structure))):
            key, sub = jax.random.split(key)
            per[name] = [temp_bytes(s, 2 * chunks[-1], b, sub) for b in chunks]
        slope = {name: float(np.polyfit(chunks, v, 1)[0]) for name, v in per.items()}
        memory[family] = dict(chunks=chunks, temp_bytes=per, bytes_per_sample=slope)
        print(
            f"{family:20} p = {structure.p:>4}: temp bytes "
            f"closed {per['closed']}, generic {per['generic']}; per sample "
            f"{slope['closed']:.0f} B (sample_size {structure.sample_size()} "
            f"numbers) vs {slope['generic']:.0f} B (k p^2 = "
            f"{structure.k * structure.p**2} numbers)"
        )
    print(f"\nlargest relative difference closed vs generic: {worst:.1e}")
    write_json(
        args.json,
        dict(
            machine=machine(),
            n=n,
            rows=rows,
            memory=memory,
            max_rel_diff=worst,
            finite=bool(np.isfinite(worst)),
        ),
    )


if __name__ == "__main__":
    main()
