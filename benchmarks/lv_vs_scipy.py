"""A batch of interacting Lotka-Volterra systems: nqfjax against scipy.

The work (issue 7, part 3): 256 systems with p = 64 modes,
`B = 2 diag(lam^2) + lam lam^T`, `lam_k = 1/k` (the quadratic network with
Gaussian inputs of covariance `diag(lam)` and `4 eta = 1`,
docs/theory/lotka-volterra.md),
`r = B 1` (a teacher with every `m*_k = 1`, so every mode eventually switches
on), no decay; initial values `m0_k = 10^U(-12, -4)` drawn independently for
every mode of every system; 200 log-spaced outputs from `t = 1e-2` to `1e4`.

Everyone integrates `y = log m` (so `atol` with `rtol = 0` bounds the relative
error of `m`, for tiny and large modes alike):

- nqfjax batch: `solve_lv_batch(lv, m0s, ts)`, the same solver and controller
  in one fused loop over the batch (each system with its own step size);
- nqfjax: `jax.vmap` of `solve_lv(lv, m0, ts)` on the structured system
  `LotkaVolterra(r, B_diag=d, B_factor=U)` (`B = diag(d) + U U^T`, rank 1), so
  `solve_lv`'s defaults apply: the vector field in O(p q),
  `LVRosenbrock(LowRankInteractions(d, U))` (Rodas4 with the analytic
  Jacobian, Woodbury solves) and a PID controller in the max norm over modes;
  for reference the same at `solve_lv`'s default `atol = 1e-9` (timed once),
  and (on a subset: they are slow) `solve_lv` on the dense
  `LotkaVolterra(r, B)` (dense field, dense LU) and with `diffrax.Kvaerno5`;
- scipy: `solve_ivp` looped over the systems, LSODA with the analytic Jacobian,
  and the best of RK45 / DOP853 (on a subset: they are very slow here).

Accuracy is measured against a tight reference (nqfjax at `atol = 1e-10`,
itself checked against LSODA at `rtol = atol = 1e-12`) as the largest
`|m / m_ref - 1|` over systems, modes and output times. Each solver's tolerance
is the loosest of a ladder whose error stays below 1e-6 on a calibration subset
("equal accuracy"); the same-tolerance comparison is printed too.

    python benchmarks/lv_vs_scipy.py            # the full benchmark (< 5 min)
    python benchmarks/lv_vs_scipy.py --quick    # a few systems, one repeat
"""

import os
import sys
import time


os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402


jax.config.update("jax_enable_x64", True)

import diffrax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from scipy.integrate import solve_ivp  # noqa: E402


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

from nqfjax import (  # noqa: E402
    LotkaVolterra,
    lv_stepsize_controller,
    solve_lv,
    solve_lv_batch,
)


TARGET_RATIO = 5.0  # issue 7: nqfjax >= 5x faster than LSODA at equal accuracy
BATCH_TARGET = 50.0  # issue 15: solve_lv_batch >= 50x faster than LSODA
ACCURACY = 1e-6  # ... where accuracy is the max relative error of m
# Tolerance ladders (atol on log m, rtol = 0), loosest first.
NQF_LADDER = (3e-6, 2e-6, 1.5e-6, 1e-6, 7e-7, 5e-7, 3e-7, 2e-7, 1e-7, 5e-8)
SCIPY_LADDER = (1e-6, 3e-7, 1e-7, 3e-8, 1e-8, 3e-9, 1e-9, 3e-10, 1e-10)
REF_ATOL = 1e-10
DEFAULT_ATOL = 1e-9  # solve_lv's documented float64 default atol (rtol = 0)


def problem(n_systems: int, p: int = 64, seed: int = 0):
    """`(r, B, diag, factor, m0, ts)` of the benchmark (numpy, float64)."""
    lam = 1.0 / np.arange(1, p + 1)
    diag = 2 * lam**2
    factor = lam[:, None]
    B = np.diag(diag) + factor @ factor.T
    r = B @ np.ones(p)
    rng = np.random.default_rng(seed)
    m0 = 10 ** rng.uniform(-12, -4, size=(n_systems, p))
    ts = np.geomspace(1e-2, 1e4, 200)
    return r, B, diag, factor, m0, ts


def nqfjax_batch(lv, ts, solver=None):
    """`jit(vmap(solve_lv))` over `m0` for the system `lv` (solver: `solve_lv`'s
    default unless given), with `atol` a traced argument (one compile serves
    every tolerance). Returns `f(m0s, atol) -> (m, num_steps)`."""
    ts = jnp.asarray(ts)

    def one(m0, atol):
        control = lv_stepsize_controller(atol, rtol=0.0)
        sol = solve_lv(lv, m0, ts, solver=solver, stepsize_controller=control)
        return sol.ys, sol.stats["num_steps"]

    return jax.jit(jax.vmap(one, in_axes=(0, None)))


def nqfjax_fused(lv, ts):
    """`solve_lv_batch` called as a user calls it (eagerly: the checks on the
    host, then one compiled loop, cached per shape). Returns `f(m0s, atol) ->
    (m, num_steps)`."""

    def run(m0s, atol):
        pid = diffrax.PIDController(rtol=0.0, atol=atol)
        sol = solve_lv_batch(lv, m0s, ts, stepsize_controller=pid)
        return sol.ys, sol.stats["num_steps"]

    return run


def scipy_batch(r, B, m0s, ts, method, tol):
    """`solve_ivp` in log space, looped over the systems; `m` of shape (n, T, p)."""

    def f(t, y):
        return r - B @ np.exp(y)

    def jac(t, y):
        return -B * np.exp(y)[None, :]

    kw = dict(jac=jac) if method in ("LSODA", "BDF", "Radau") else {}
    out = []
    for m0 in m0s:
        sol = solve_ivp(
            f,
            (0.0, ts[-1]),
            np.log(m0),
            method=method,
            t_eval=ts,
            rtol=1e-13,  # ~0: atol alone bounds the error of log m
            atol=tol,
            **kw,
        )
        if not sol.success:
            raise RuntimeError(f"scipy {method} failed: {sol.message}")
        out.append(np.exp(sol.y.T))
    return np.stack(out)


def max_rel_err(m, ref) -> float:
    """Largest `|m / m_ref - 1|` over every system, output time and mode."""
    return float(np.max(np.abs(np.expm1(np.log(np.asarray(m)) - np.log(ref)))))


def calibrate(run, ladder, ref, accuracy=ACCURACY):
    """The loosest tolerance of `ladder` whose error against `ref` is below
    `accuracy`. Returns `(tol, err, tried)`; `tried` lists (tol, err)."""
    tried = []
    for tol in ladder:
        err = max_rel_err(run(tol), ref)
        tried.append((tol, err))
        if err <= accuracy:
            return tol, err, tried
    return ladder[-1], err, tried


def main(argv=None) -> dict:
    parser = make_parser(__doc__, quick_help="a few systems, once")
    parser.add_argument("--systems", type=int, default=None)
    args = parser.parse_args(argv)
    quick = args.quick
    n = args.systems or (4 if quick else 256)
    repeats = args.repeats or (1 if quick else 3)
    n_cal = n if quick else 32  # calibration subset (every n // n_cal-th system)
    n_slow = 8  # subset for the very slow solvers (scaled to n in the table)

    t_start = time.perf_counter()
    print(machine())
    r, B, diag, factor, m0, ts = problem(n)
    cal = np.arange(0, n, max(1, n // n_cal))[:n_cal]
    slow = cal[:n_slow]
    print(f"{n} systems, p = {r.shape[0]}, {ts.shape[0]} outputs to t = {ts[-1]:g}")

    # nqfjax: compile once per batch shape (atol is traced); a tight reference.
    m0_j = jnp.asarray(m0)
    compiles = {}
    lv = LotkaVolterra(jnp.asarray(r), B_diag=jnp.asarray(diag), B_factor=factor)
    nqf = nqfjax_batch(lv, ts)
    nqf_c, compiles["nqfjax"] = compile_jax(nqf, m0_j, 1e-7)
    nqf_cal_c = nqf_c if len(cal) == n else compile_jax(nqf, m0_j[cal], 1e-7)[0]
    fused = nqfjax_fused(lv, ts)
    # a first call: its compilation and one run
    compiles["nqfjax batch (first call)"], _ = time_call(lambda: fused(m0_j, 1e-7))
    if len(cal) != n:
        time_call(lambda: fused(m0_j[cal], 1e-7))  # compile the subset's shape
    t_ref, (ref_cal, ref_steps) = time_call(lambda: nqf_cal_c(m0_j[cal], REF_ATOL))
    ref_cal = np.asarray(ref_cal)
    print(
        f"reference: nqfjax atol {REF_ATOL:g} on {len(cal)} systems "
        f"({int(ref_steps.max())} steps, {fmt_seconds(t_ref)})"
    )
    check = cal[:2]
    lsoda_tight = scipy_batch(r, B, m0[check], ts, "LSODA", 1e-12)
    ref_check = max_rel_err(lsoda_tight, ref_cal[:2])
    print(f"  vs LSODA at rtol = atol = 1e-12 ({len(check)} systems): {ref_check:.1e}")

    # Equal accuracy: each gets the loosest tolerance with error <= 1e-6 on `cal`.
    fmt = lambda tried: ", ".join(f"{t:g}: {e:.1e}" for t, e in tried)
    print(f"calibration (atol: max rel error on {len(cal)} systems)")
    tol, tried = {}, {}
    tol["nqfjax"], _, tried["nqfjax"] = calibrate(
        lambda a: nqf_cal_c(m0_j[cal], a)[0], NQF_LADDER, ref_cal
    )
    tol["nqfjax batch"], _, tried["nqfjax batch"] = calibrate(
        lambda a: fused(m0_j[cal], a)[0], NQF_LADDER, ref_cal
    )
    tol["scipy LSODA"], _, tried["scipy LSODA"] = calibrate(
        lambda a: scipy_batch(r, B, m0[cal], ts, "LSODA", a), SCIPY_LADDER, ref_cal
    )
    runs = {
        "nqfjax batch": lambda: fused(m0_j, tol["nqfjax batch"]),
        "nqfjax": lambda: nqf_c(m0_j, tol["nqfjax"]),
        "scipy LSODA": lambda: scipy_batch(r, B, m0, ts, "LSODA", tol["scipy LSODA"]),
    }
    notes = {
        "nqfjax batch": "solve_lv_batch, B = diag(d) + U U^T",
        "nqfjax": "vmap(solve_lv), defaults, B = diag(d) + U U^T",
        "scipy LSODA": "solve_ivp, analytic Jacobian",
    }
    for name in tried:
        print(f"  {name:16} {fmt(tried[name])}  -> {tol[name]:g}")
    # Warm-up: the nqfjax functions are compiled already, one call settles them;
    # scipy has nothing to warm up (and one LSODA pass costs as much as a repeat).
    times = alternate(runs, repeats=repeats, warmup={"scipy LSODA": 0})

    # Accuracy of the timed runs on the calibration subset, and their agreement.
    m_nqf, steps = nqf_c(m0_j, tol["nqfjax"])
    m_nqf, steps = np.asarray(m_nqf), np.asarray(steps)
    m_lsoda = scipy_batch(r, B, m0[cal], ts, "LSODA", tol["scipy LSODA"])
    m_fused, steps_fused = (np.asarray(x) for x in fused(m0_j, tol["nqfjax batch"]))
    err = {
        "nqfjax batch": max_rel_err(m_fused[cal], ref_cal),
        "nqfjax": max_rel_err(m_nqf[cal], ref_cal),
        "scipy LSODA": max_rel_err(m_lsoda, ref_cal),
    }
    agreement = max_rel_err(m_nqf[cal], m_lsoda)
    print(
        f"nqfjax steps per system: {steps.min()} - {steps.max()} "
        f"(under vmap every system runs {steps.max()}); nqfjax batch "
        f"{steps_fused.min()} - {steps_fused.max()} (each its own)"
    )
    # LSODA at nqfjax's tolerance (same tolerance, rather than equal accuracy).
    same_tol_err = max_rel_err(
        scipy_batch(r, B, m0[cal], ts, "LSODA", tol["nqfjax"]), ref_cal
    )

    # The slow ones, on a subset of `n_slow` systems, timed once, scaled to n.
    slow_rows = {}
    if not quick:
        # nqfjax at solve_lv's default tolerance (what a call without `atol`
        # gets: far more accurate than this comparison needs), all systems, once.
        name = "nqfjax default atol"
        t_d, (m_d, steps_d) = time_call(lambda: nqf_c(m0_j, DEFAULT_ATOL))
        slow_rows[name] = (t_d * n_slow / n, max_rel_err(np.asarray(m_d)[cal], ref_cal))
        tol[name] = DEFAULT_ATOL
        notes[name] = f"solve_lv defaults; {int(np.max(steps_d))} steps"
        # solve_lv on the dense system (dense field, LVRosenbrock with a dense
        # LU: any B) and with Kvaerno5, both at nqfjax's tolerance.
        dense = LotkaVolterra(jnp.asarray(r), jnp.asarray(B))
        for name, system, solver, note in [
            ("nqfjax dense B", dense, None, "solve_lv(LotkaVolterra(r, B))"),
            ("nqfjax Kvaerno5", lv, diffrax.Kvaerno5(), "solve_lv, Kvaerno5"),
        ]:
            f = nqfjax_batch(system, ts, solver)
            f_c, compiles[name] = compile_jax(f, m0_j[slow], 1e-7)
            t_f, (m_f, _) = time_call(lambda: f_c(m0_j[slow], tol["nqfjax"]))
            slow_rows[name] = (t_f, max_rel_err(m_f, ref_cal[:n_slow]))
            notes[name] = f"{note}, same atol as nqfjax ({tol['nqfjax']:g})"
        # Explicit scipy methods: calibrate on 2 systems, time on the subset.
        best = None
        for method in ("RK45", "DOP853"):
            a, _, _ = calibrate(
                lambda a: scipy_batch(r, B, m0[slow[:2]], ts, method, a),
                SCIPY_LADDER[4:8],
                ref_cal[:2],
            )
            t_ex, m_ex = time_call(lambda: scipy_batch(r, B, m0[slow], ts, method, a))
            e_ex = max_rel_err(m_ex, ref_cal[:n_slow])
            print(f"  scipy {method}: atol {a:g}, {fmt_seconds(t_ex)} for {n_slow}")
            if best is None or t_ex < best[1]:
                best = (method, t_ex, e_ex, a)
        name = f"scipy {best[0]}"
        slow_rows[name] = (best[1], best[2])
        tol[name] = best[3]
        notes[name] = "best of RK45 / DOP853"
        for name, (t, e) in slow_rows.items():
            times[name] = [t * n / n_slow]
            err[name] = e
            if name == "nqfjax default atol":
                notes[name] += f"; {n} systems timed once"
            else:
                notes[name] += f"; {n_slow} systems timed once, x{n / n_slow:g}"

    print()
    for name, seconds in compiles.items():
        print(compile_line(name, seconds))
    print(f"run times for {n} systems ({repeats} alternating repeats)")
    for name in times:
        extra = f"atol {tol[name]:g}; " if name in tol else ""
        notes[name] = f"{extra}max rel err {err[name]:.1e}; {notes[name]}"
    print(table(times, notes))
    print(
        f"max rel difference nqfjax vs LSODA: {agreement:.1e} "
        f"(LSODA at nqfjax's atol {tol['nqfjax']:g}: max rel err {same_tol_err:.1e})"
    )
    print(ratio_line("scipy LSODA", "nqfjax batch", times, target=BATCH_TARGET))
    print(ratio_line("scipy LSODA", "nqfjax", times, target=TARGET_RATIO))
    print(ratio_line("nqfjax", "nqfjax batch", times))
    for name in slow_rows:
        print(ratio_line(name, "nqfjax", times))
    if any(err[k] > ACCURACY for k in runs):
        print(f"WARNING: an error above {ACCURACY:g}: not an equal-accuracy comparison")
    r_main = ratio(times["scipy LSODA"], times["nqfjax"])
    r_batch = ratio(times["scipy LSODA"], times["nqfjax batch"])
    print(
        f"README row: | LV batch, solve_lv_batch vs scipy LSODA ({n} x p=64, 1e-6 "
        f"rel) | {fmt_seconds(np.median(times['nqfjax batch']))} | "
        f"{fmt_seconds(np.median(times['scipy LSODA']))} | {r_batch:.1f}x | "
        f">= {BATCH_TARGET:g}x | {'met' if r_batch >= BATCH_TARGET else 'not met'} |"
    )
    print(
        f"README row: | LV batch vs scipy LSODA ({n} x p=64, 1e-6 rel) | "
        f"{fmt_seconds(np.median(times['nqfjax']))} | "
        f"{fmt_seconds(np.median(times['scipy LSODA']))} | {r_main:.1f}x | "
        f">= {TARGET_RATIO:g}x | {'met' if r_main >= TARGET_RATIO else 'not met'} |"
    )
    print(
        f"total {fmt_seconds(time.perf_counter() - t_start)}; load average at the "
        f"end (1, 5, 15 min): {', '.join(f'{x:.1f}' for x in os.getloadavg())}"
    )
    result = dict(
        times=times,
        err=err,
        agreement=agreement,
        reference_check=ref_check,
        tolerances=tol,
        ratio=r_main,
        ratio_batch=r_batch,
        load_average=os.getloadavg(),
    )
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
