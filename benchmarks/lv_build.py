"""Building a large structured Lotka-Volterra system: time and memory against p.

The work (issue 13, item 10): `LotkaVolterra(r, B_diag=d, B_factor=U)` with
`B = diag(d) + U U^T`, `U` of rank q = 4, at p = 2,500 ... 10,000 modes (and the
diagonal system, q = 0), float64: the build (argument checks included), one
vector field `dm/dt` and one loss. Each size runs in a fresh process so that its
peak resident memory (`resource.getrusage(...).ru_maxrss`, which only grows) can
be attributed to it: the row reports the peak minus the resident memory just
before the build, after the inputs exist. The structure needs O(p q) memory; a
dense `p x p` float64 matrix would be 8 p^2 bytes (800 MB at p = 10,000).

There is no peer: the comparison is with the dense route, which this script
prints as the size of the `p x p` matrix it would hold.

    python benchmarks/lv_build.py            # p = 2,500, 5,000, 10,000, 20,000
    python benchmarks/lv_build.py --quick    # p = 1,000 and 2,000
"""

import argparse
import json
import os
import subprocess
import sys


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import fmt_seconds, machine, make_parser, write_json  # noqa: E402


def measure(p: int, q: int) -> dict:
    """Build one system of `p` modes and rank `q` in this process; return the
    build time, the time of the first vector field and loss, and the peak
    resident memory added by them (MB)."""
    import resource
    import time

    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp
    import numpy as np

    from nqfjax import LotkaVolterra

    rng = np.random.default_rng(0)
    lam = 1.0 / np.arange(1, p + 1)
    r = jnp.asarray(lam)
    d = jnp.asarray(2 * lam**2)
    U = jnp.asarray(rng.standard_normal((p, q)) * lam[:, None] / np.sqrt(max(q, 1)))
    m = jnp.asarray(rng.uniform(0, 1, p))
    jax.block_until_ready((r, d, U, m))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # kB on Linux

    start = time.perf_counter()
    lv = LotkaVolterra(r, B_diag=d, B_factor=U)
    jax.block_until_ready(lv)
    build_s = time.perf_counter() - start
    start = time.perf_counter()
    out = jax.block_until_ready((lv.vector_field(m), lv.loss(m)))
    use_s = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    held = sum(x.nbytes for x in jax.tree.leaves(lv))
    assert np.all(np.isfinite(np.asarray(out[0])))
    return dict(
        p=p,
        q=q,
        build_s=build_s,
        field_and_loss_s=use_s,
        peak_added_mb=(after - before) / 1024,
        held_mb=held / 2**20,
        dense_mb=8 * p * p / 2**20,
    )


def main(argv=None) -> list[dict]:
    parser = make_parser(__doc__, quick_help="p = 1,000 and 2,000 only")
    parser.add_argument("--child", nargs=2, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(measure(*args.child)))
        return []
    sizes = [1_000, 2_000] if args.quick else [2_500, 5_000, 10_000, 20_000]
    rows = []
    for q in (4, 0):
        for p in sizes:
            out = subprocess.run(
                [sys.executable, os.path.abspath(__file__), "--child", str(p), str(q)],
                capture_output=True,
                text=True,
                check=True,
            )
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(machine())
    print(
        f"{'p':>7} {'q':>2}  {'build':>9}  {'field+loss':>10}  {'peak added':>10}  "
        f"{'held':>8}  {'dense B would be':>16}"
    )
    for row in rows:
        print(
            f"{row['p']:>7} {row['q']:>2}  {fmt_seconds(row['build_s']):>9}  "
            f"{fmt_seconds(row['field_and_loss_s']):>10}  "
            f"{row['peak_added_mb']:>7.1f} MB  {row['held_mb']:>5.2f} MB  "
            f"{row['dense_mb']:>13.0f} MB"
        )
    write_json(args.json, {"rows": rows, "machine": machine()})
    return rows


if __name__ == "__main__":
    main()
