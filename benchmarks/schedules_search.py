"""Where does a designed schedule gain most? The criterion alone (no real
SGD) on varied settings of the quadratic network (issue 31).

For each candidate setting (input spectrum, teacher, label noise, steps,
budget, initial scale), `schedules_vs_sgd.design` tunes the standard shapes
on `TypicalLoss` and designs from the best of them, checked as run; the
predicted gain is the design's over the best shape tuned on the criterion
(among those that lose at most 5% of the judge's paths), with its paired
bootstrap standard error on `--gain-paths` paths of another key. The
settings with the largest predicted gains are the ones to verify in real
SGD (`schedules_vs_sgd.py --settings ...`). The measured table is in
benchmarks/README.md.
"""

import argparse
import os
import sys
import time

import numpy as np


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from schedules_vs_sgd import SETTINGS, design, paired_gain, paths_final  # noqa: E402


def k(d):
    return np.arange(1, d + 1, dtype=float)


A, B, C = (SETTINGS[n] for n in sorted(SETTINGS)[:3])

CANDIDATES = {
    # C's and A's tasks without label noise (the loss can fall without floor)
    "C, sigma^2=0": {**C, "sigma2": 0.0},
    "A, sigma^2=0": {**A, "sigma2": 0.0},
    # A's task, one thing changed
    "A, m0=1e-6": {**A, "m0": 1e-6},
    "A, b=4": {**A, "batch": 4},
    "A, sigma^2=0.1": {**A, "sigma2": 0.1},
    # other spectra and teachers
    "d=8, s=k^-2, flat teacher, sigma^2=0.01, T=400, b=8": dict(
        s=k(8) ** -2, mu=np.ones(8), sigma2=0.01, T=400, m0=1e-3, batch=8
    ),
    "d=6, s=2^-k, teacher rising 0.1-1, sigma^2=0.01, T=400, b=12": dict(
        s=2.0 ** -np.arange(6),
        mu=np.linspace(0.1, 1.0, 6),
        sigma2=0.01,
        T=400,
        m0=1e-3,
        batch=12,
    ),
    "B, sigma^2=0": {**B, "sigma2": 0.0},
    "d=3, s=1, teacher (1,.5,.25), sigma^2=0.001, T=200, b=4": dict(
        s=np.ones(3),
        mu=np.array([1.0, 0.5, 0.25]),
        sigma2=0.001,
        T=200,
        m0=1e-3,
        batch=4,
    ),
    "d=5, s=4^-k, flat teacher, sigma^2=0.01, T=400, b=8": dict(
        s=4.0 ** -np.arange(5), mu=np.ones(5), sigma2=0.01, T=400, m0=1e-3, batch=8
    ),
    "A, T=1000": {**A, "T": 1000},
    "C, T=1000": {**C, "T": 1000},
}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", type=str, nargs="*", default=None)
    parser.add_argument("--paths", type=int, default=128)
    parser.add_argument("--iterations", type=int, default=40)
    parser.add_argument("--peaks", type=int, default=24)
    parser.add_argument("--gain-paths", type=int, default=2048)
    args = parser.parse_args()
    args.minibatch, args.design_max_diverged = "sampled", 0.05
    args.check_paths, args.check_confidence = 2048, 0.95
    names = args.only if args.only is not None else list(CANDIDATES)
    print(
        "| setting | best shape (criterion) | its peak | design's peak "
        "| gain predicted | paths diverged: design, shape | s |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name in names:
        cfg = CANDIDATES[name]
        t0 = time.perf_counter()
        d = design(cfg, args)
        ok = [x for x in d["judged"][:4] if np.isfinite(float(x.final_loss))]
        best = min(ok, key=lambda x: float(x.final_loss))
        des = d["judged"][-1]
        pb = paths_final(
            d, best.learning_rates, best.batch_sizes, args.gain_paths, args.minibatch
        )
        pd = paths_final(
            d, des.learning_rates, d["b_int"], args.gain_paths, args.minibatch
        )
        g = paired_gain(pb, pd)
        print(
            f"| {name} | {best.name} | {float(np.max(best.learning_rates)):.4f} "
            f"| {float(np.max(des.learning_rates)):.4f} "
            f"| {g[0]:.1%} +- {g[1]:.1%} | {np.mean(pd[1]):.1%}, {np.mean(pb[1]):.1%} "
            f"| {time.perf_counter() - t0:.0f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
