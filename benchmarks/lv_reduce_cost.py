"""The cost of `lv_reduce` against p (issue 27, second item).

The work: `lv_reduce(task)` on the sampled task of a tanh `Perceptron(d, k=10)`
(`p = d + 10`) with `n = 10^4` samples, float32 and float64, at p = 128, 512,
1024 and 2048, for two data sets: Gaussian inputs with decaying scales and a
tanh teacher (`raw`: the task does not reduce; `lv_reduce` refuses it at the
first step of the basis search, after one `eigh` of `C` and one application of
`K`) and the same inputs whitened (`whitened`: the task reduces exactly, and
`C`'s null space of dimension `d - k` is searched for the basis, then the mode
couplings and the probes are computed). For `raw` the whole search is timed
too (`full`: what `ApproximateLVEngine` pays, `measure_reduction(task,
early=False)`), with the K part of its violation estimated from 8 probes.

The peer is the previous implementation: the whole search with the `K`-image
of every mode, `U^T K[u_l u_l^T] U` for `l = 1..p` (`O(p)` applications of
`K`, `O(p^4)` flops), which the reduction still uses when `p <= num_probes`
and so runs as `measure_reduction(task, early=False, num_probes=p)` (with
today's basis search, which is faster than the previous one's); its K part is
the exact value the estimate is compared with. It runs only up to `--old-max`
(default 128); above, its time is extrapolated from the largest measured size
by `p^4` and marked as such.

Each row is the first call (compilation included; a few seconds, small against
the work at p >= 1024) and, with `--repeats N`, the best of N more (warm); the
previous implementation is timed warm.

    python benchmarks/lv_reduce_cost.py            # p = 128, 512, 1024, 2048
    python benchmarks/lv_reduce_cost.py --quick    # p = 64 and 128, n = 1000
"""

import os
import sys
import time


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import fmt_seconds, machine, make_parser, write_json  # noqa: E402


def problem(p: int, n: int, dtype, whitened: bool, k: int = 10):
    """The sampled task of a tanh perceptron with `p = d + k`."""
    import numpy as np

    import nqfjax

    d = p - k
    rng = np.random.default_rng(0)
    X = rng.standard_normal((n, d)) * np.linspace(1.0, 0.2, d)
    if whitened:
        X -= X.mean(0)
        X = X @ np.linalg.inv(np.linalg.cholesky(X.T @ X / n)).T
    Y = np.tanh(X @ rng.standard_normal((d, k)) / np.sqrt(d))
    return nqfjax.task_from_samples(
        nqfjax.Perceptron(d=d, k=k), X.astype(dtype), Y.astype(dtype)
    )


def reduce_once(task, **kw) -> tuple[float, float, bool]:
    """Seconds of one `lv_reduce(task, **kw)`, the violation, whether it reduced."""
    import jax
    import numpy as np

    import nqfjax

    start = time.perf_counter()
    try:
        lv, basis = jax.block_until_ready(nqfjax.lv_reduce(task, **kw))
    except nqfjax.NotReducibleError as err:
        return time.perf_counter() - start, err.violation, False
    del lv, basis
    return time.perf_counter() - start, float(np.nan), True


def search_once(task, **kw) -> tuple[float, float]:
    """Seconds of the whole search (`measure_reduction(task, early=False,
    **kw)`) and the K part of its violation."""
    import jax

    from nqfjax.engines.reduction import measure_reduction

    start = time.perf_counter()
    red = measure_reduction(task, early=False, **kw)
    jax.block_until_ready(red.lv)
    return time.perf_counter() - start, red.k_part


def main(argv=None) -> dict:
    parser = make_parser(__doc__, quick_help="p = 64 and 128, n = 1000")
    parser.add_argument("--old-max", type=int, default=128)
    parser.add_argument("--sizes", type=int, nargs="*", default=None)
    args = parser.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    jax.config.update("jax_enable_x64", True)

    sizes = args.sizes or ([64, 128] if args.quick else [128, 512, 1024, 2048])
    n = 1000 if args.quick else 10_000
    rows = []
    for dtype in ("float32", "float64"):
        old_at = {}  # case -> (p, seconds) of the largest measured previous run
        for p in sizes:
            for case in ("raw", "whitened"):
                task = problem(p, n, dtype, case == "whitened")
                jax.block_until_ready(task.C)
                first, viol, ok = reduce_once(task)
                warm = [reduce_once(task)[0] for _ in range(args.repeats or 0)]
                row = dict(
                    p=p,
                    n=n,
                    dtype=dtype,
                    case=case,
                    first_s=first,
                    warm_s=min(warm) if warm else None,
                    reduced=ok,
                    violation=viol,
                )
                if not ok:
                    row["full_s"], row["k_part"] = search_once(task)
                if p <= args.old_max:
                    search_once(task, num_probes=p)  # compile
                    old, k_old = search_once(task, num_probes=p)
                    row.update(old_s=old, old_k_part=k_old, old_measured=True)
                    old_at[case] = (p, old)
                elif case in old_at:
                    p_old, s_old = old_at[case]
                    row.update(old_s=s_old * (p / p_old) ** 4, old_measured=False)
                rows.append(row)
                print(_line(row), flush=True)
    print(machine())
    write_json(args.json, {"rows": rows, "machine": machine()})
    return {"rows": rows}


def _line(row: dict) -> str:
    old = ""
    if "old_s" in row:
        mark = "" if row["old_measured"] else " (p^4 extrapolated)"
        old = f"  previous {fmt_seconds(row['old_s'])}{mark}"
        if row["old_measured"] and not row["reduced"]:
            old += f", exact K part {row['old_k_part']:.3g}"
    warm = "" if row["warm_s"] is None else f", warm {fmt_seconds(row['warm_s'])}"
    what = "reduced"
    if not row["reduced"]:
        what = (
            f"refused, violation {row['violation']:.3g}; whole search "
            f"{fmt_seconds(row['full_s'])}, K part {row['k_part']:.3g}"
        )
    return (
        f"p={row['p']:>5} {row['dtype']} {row['case']:>8}: first "
        f"{fmt_seconds(row['first_s'])}{warm} ({what}){old}"
    )


if __name__ == "__main__":
    main()
