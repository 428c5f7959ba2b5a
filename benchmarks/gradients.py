"""Gradients of a loss through `solve_lv`: reverse and forward mode against finite
differences, at equal accuracy.

The work (issue 7, part 5): the Lotka-Volterra system of the quadratic network
with Gaussian inputs of covariance `diag(lam)`, `lam_k = 1/k`, `p = 64` modes
(docs/theory/lotka-volterra.md): in task units `B^ = 2 diag(lam^2) + lam lam^T`
(diagonal
plus rank one) and growth rates `r` (initially `B^ 1`, so every `m*_k = 1`);
learning rate `eta` and init scale `sigma` enter as

    dm/dt = eta m (r - B^ m),   m(0) = sigma^2 eps,   eps_k = 10^U(-2, 0),

and the loss at `T = 30` (mid-way through the staircase) is
`F = m(T)^T B^ m(T) / 2 - r^T m(T)`. The gradient of `F` with respect to the
`P = 66` parameters `theta = (log sigma, eta, r_1..r_64)` is computed by

- reverse mode: `jax.grad` through `solve_lv` (`RecursiveCheckpointAdjoint`):
  one forward solve plus one backward pass for all `P` entries;
- forward mode: `jax.jacfwd` with `adjoint=diffrax.ForwardMode()` (`P` tangents);
- central finite differences: `2 P = 132` forward solves, both vmapped in one
  call and as a Python loop of one jitted solve (the faster counts);
- the same through `solve_lv_batch` (issue 15): reverse mode by its discrete
  adjoint (`jax.grad` of the batch of one system), and central differences with
  the 132 perturbed systems as the members of one fused loop.

The target compares the faster reverse mode with the fastest finite differences.

`solve_lv` runs with its default solver (`LVRosenbrock`, here with the
diagonal-plus-low-rank `B`, `O(p)` per step), float64, `rtol = 0` and `atol`
(on `log m`, i.e. a relative error of `m`) from a ladder. Accuracy: the largest
error over the `P` entries divided by the largest entry,
`max_i |g_i - g_ref_i| / max_i |g_ref_i|`, against a reference from reverse mode
at `atol = 1e-12` (cross-checked against finite differences at that tolerance).
"Equal accuracy": each method runs at the loosest `atol` of the ladder (and,
for finite differences, the best step `h` of a few) whose error is <= 1e-5.

`--dense` also times the reverse gradient with `B` given as a dense matrix
(`LVRosenbrock(DenseInteractions(B))`, an LU solve per stage, differentiated
implicitly); see benchmarks/README.md.

    python benchmarks/gradients.py           # full (< 5 min idle)
    python benchmarks/gradients.py --quick   # smoke test (p = 8)
"""

import os
import sys


os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402


jax.config.update("jax_enable_x64", True)

import diffrax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402


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
    write_json,
)

import nqfjax  # noqa: E402


TARGET_RATIO = 20.0  # issue 7: reverse >= 20x cheaper than central FD ...
ACCURACY = 1e-5  # ... at equal accuracy
# atol on log m, loosest first
LADDER = (1e-3, 3e-4, 1e-4, 3e-5, 1e-5, 3e-6, 1e-6, 3e-7, 1e-7, 1e-8, 1e-9, 1e-10)
FD_STEPS = (1e-3, 3e-4, 1e-4)  # relative FD steps h tried at each atol
REF_ATOL = 1e-12
AGREEMENT = 1e-4  # reverse and FD gradients accepted as agreeing


def problem(p: int, seed: int = 0):
    """`(theta0, B_diag, B_factor, eps, T)`: `theta0 = (log sigma, eta, r)` flat."""
    lam = 1.0 / np.arange(1, p + 1)
    B_diag, B_factor = 2 * lam**2, lam[:, None]
    B = np.diag(B_diag) + B_factor @ B_factor.T
    r = B @ np.ones(p)
    eps = 10 ** np.random.default_rng(seed).uniform(-2, 0, p)
    theta0 = np.concatenate([[np.log(1e-3), 1.0], r])
    return theta0, B_diag, B_factor, eps, 30.0


def _start(theta, B_diag, B_factor, eps, dense=False):
    """The system and initial values of `theta = (log sigma, eta, r)`:
    `(LotkaVolterra(eta r, eta B), sigma^2 eps)`, `B` given as diagonal plus
    `B_factor B_factor^T` (dense: as one matrix)."""
    log_sigma, eta, r = theta[0], theta[1], theta[2:]
    if dense:
        B = jnp.diag(B_diag) + B_factor @ B_factor.T
        lv = nqfjax.LotkaVolterra(eta * r, eta * B)
    else:
        lv = nqfjax.LotkaVolterra(
            eta * r, B_diag=eta * B_diag, B_factor=jnp.sqrt(eta) * B_factor
        )
    return lv, jnp.exp(2 * log_sigma) * eps


def _objective(m, r, B):
    """`F = m^T B m / 2 - r^T m` at the final `m`."""
    return 0.5 * m @ (B @ m) - r @ m


def make_batch_loss(B_diag, B_factor, eps, T):
    """`F(thetas, atol)`: the loss at `T` of each row of `thetas` `(n, P)`, the
    `n` systems in one `solve_lv_batch` (its gradient: the discrete adjoint)."""
    B_diag, B_factor, eps = map(jnp.asarray, (B_diag, B_factor, eps))
    B = jnp.diag(B_diag) + B_factor @ B_factor.T

    def F(thetas, atol):
        lv, m0 = jax.vmap(lambda th: _start(th, B_diag, B_factor, eps))(thetas)
        ts = jnp.full((1,), T, thetas.dtype)
        pid = diffrax.PIDController(rtol=0.0, atol=atol)
        m = nqfjax.solve_lv_batch(lv, m0, ts, stepsize_controller=pid).ys[:, -1]
        return jax.vmap(_objective, in_axes=(0, 0, None))(m, thetas[:, 2:], B)

    return F


def central_fd_batch(F_rows, num_params):
    """Central differences with the `2 P` perturbed systems as the members of
    one `solve_lv_batch` (the fused loop: no `vmap`). Returns `(1, P)`."""

    def fd(theta, atol, hs):
        steps = hs[0] * jnp.maximum(1.0, jnp.abs(theta))
        E = jnp.diag(steps)
        vals = F_rows(jnp.concatenate([theta + E, theta - E]), atol)
        return ((vals[:num_params] - vals[num_params:]) / (2 * steps))[None]

    return fd


def make_loss(B_diag, B_factor, eps, T, *, dense=False):
    """`F(theta, atol, adjoint)`: the loss at `T` through `solve_lv`."""
    B_diag, B_factor, eps = map(jnp.asarray, (B_diag, B_factor, eps))
    B = jnp.diag(B_diag) + B_factor @ B_factor.T

    def F(theta, atol, adjoint=diffrax.RecursiveCheckpointAdjoint()):
        lv, m0 = _start(theta, B_diag, B_factor, eps, dense)
        ts = jnp.full((1,), T, theta.dtype)
        control = nqfjax.lv_stepsize_controller(atol, rtol=0.0)
        m = nqfjax.solve_lv(
            lv, m0, ts, stepsize_controller=control, adjoint=adjoint
        ).ys[-1]
        return _objective(m, theta[2:], B)

    return F


def central_fd(F, num_params):
    """Central differences of `F` at `theta` for the relative steps `hs` (steps
    `h max(1, |theta_i|)`), all `2 P len(hs)` solves in one vmapped call.
    Returns `(len(hs), P)`."""

    def fd(theta, atol, hs):
        scale = jnp.maximum(1.0, jnp.abs(theta))
        steps = hs[:, None] * scale[None, :]  # (H, P)
        E = jax.vmap(jnp.diag)(steps)  # (H, P, P)
        pert = jnp.concatenate([theta + E, theta - E], axis=1).reshape(-1, num_params)
        vals = jax.vmap(lambda v: F(v, atol))(pert).reshape(len(hs), 2, num_params)
        return (vals[:, 0] - vals[:, 1]) / (2 * steps)

    return fd


def error(g, ref) -> float:
    return float(np.max(np.abs(np.asarray(g) - ref)) / np.max(np.abs(ref)))


def main(argv=None) -> dict:
    parser = make_parser(
        __doc__,
        toggles=(
            ("forward", "also time forward mode (default: on, off with --quick)"),
            (
                "dense",
                "also time reverse mode with a dense B (default: on, off with --quick)",
            ),
        ),
    )
    args = parser.parse_args(argv)
    p, repeats = (8, 1) if args.quick else (64, 5)
    repeats = args.repeats or repeats
    use_forward = enabled(args, "forward")
    use_dense = enabled(args, "dense")

    theta0_np, B_diag, B_factor, eps, T = problem(p)
    P = theta0_np.shape[0]
    theta0 = jnp.asarray(theta0_np)
    print(f"machine: {machine()}")
    print(
        f"work: d F(T={T:g}) / d (log sigma, eta, r) for p={p} modes (P={P} "
        "parameters) through solve_lv, float64, B diagonal + rank 1"
    )

    F = make_loss(B_diag, B_factor, eps, T)
    F_rows = make_batch_loss(B_diag, B_factor, eps, T)
    F_batch = lambda v, atol: F_rows(v[None], atol)[0]
    atol0 = jnp.asarray(LADDER[0])
    hs0 = jnp.asarray(FD_STEPS[:1])
    fwd_mode = diffrax.ForwardMode()
    programs = {
        "forward solve": (lambda v, atol: F(v, atol), (theta0, atol0)),
        "reverse": (jax.grad(F), (theta0, atol0)),
        "FD (vmap)": (central_fd(F, P), (theta0, atol0, hs0)),
        "forward solve (batch)": (F_batch, (theta0, atol0)),
        "reverse (batch)": (jax.grad(F_batch), (theta0, atol0)),
        "FD (batch)": (central_fd_batch(F_rows, P), (theta0, atol0, hs0)),
    }
    if use_forward:
        programs["forward"] = (
            jax.jacfwd(lambda v, atol: F(v, atol, fwd_mode)),
            (theta0, atol0),
        )
    compiled, compile_s = {}, {}
    for name, (fn, fn_args) in programs.items():
        compiled[name], compile_s[name] = compile_jax(jax.jit(fn), *fn_args)

    # reference, cross-checked against FD at the same tight tolerance
    ref = np.asarray(compiled["reverse"](theta0, jnp.asarray(REF_ATOL)))
    ref_check = min(
        error(
            compiled["FD (vmap)"](theta0, jnp.asarray(REF_ATOL), jnp.asarray([h]))[0],
            ref,
        )
        for h in FD_STEPS
    )

    # the loosest atol reaching ACCURACY, per method
    def calibrate(name):
        errors = {}
        for atol in LADDER:
            a = jnp.asarray(atol)
            if name.startswith("FD"):
                errs = [
                    error(compiled[name](theta0, a, jnp.asarray([h]))[0], ref)
                    for h in FD_STEPS
                ]
                i = int(np.argmin(errs))
                errors[atol] = (errs[i], FD_STEPS[i])
            else:
                errors[atol] = (error(compiled[name](theta0, a), ref), None)
            if errors[atol][0] <= ACCURACY:
                return atol, errors[atol], errors
        return None, errors[LADDER[-1]], errors

    chosen = {}
    calibrated = ("reverse", "FD (vmap)", "reverse (batch)", "FD (batch)")
    for name in calibrated + (("forward",) if use_forward else ()):
        atol, (err, h), _ = calibrate(name)
        if atol is None:  # never reached: time it at the tightest
            atol = LADDER[-1]
        chosen[name] = dict(atol=atol, error=err, h=h)
    fd_atol = jnp.asarray(chosen["FD (vmap)"]["atol"])
    fd_h = jnp.asarray([chosen["FD (vmap)"]["h"]])
    rev_atol = jnp.asarray(chosen["reverse"]["atol"])

    # FD as a Python loop over one jitted forward solve (2 P calls)
    solve = compiled["forward solve"]
    scale = np.maximum(1.0, np.abs(theta0_np)) * chosen["FD (vmap)"]["h"]
    pert = [theta0_np + s * scale[i] * np.eye(P)[i] for s in (1, -1) for i in range(P)]

    def fd_loop():
        vals = jnp.stack([solve(v, fd_atol) for v in pert])
        return (vals[:P] - vals[P:]) / (2 * scale)

    chosen["FD (loop)"] = dict(chosen["FD (vmap)"])
    batch_rev_atol = jnp.asarray(chosen["reverse (batch)"]["atol"])
    batch_fd_atol = jnp.asarray(chosen["FD (batch)"]["atol"])
    batch_fd_h = jnp.asarray([chosen["FD (batch)"]["h"]])
    runs = {
        "reverse": lambda: compiled["reverse"](theta0, rev_atol),
        "reverse (batch)": lambda: compiled["reverse (batch)"](theta0, batch_rev_atol),
        "FD (vmap)": lambda: compiled["FD (vmap)"](theta0, fd_atol, fd_h),
        "FD (batch)": lambda: compiled["FD (batch)"](theta0, batch_fd_atol, batch_fd_h),
        "FD (loop)": fd_loop,
        "forward solve": lambda: solve(theta0, rev_atol),
        "forward solve (batch)": lambda: compiled["forward solve (batch)"](
            theta0, batch_rev_atol
        ),
    }
    if use_forward:
        fw_atol = jnp.asarray(chosen["forward"]["atol"])
        runs["forward"] = lambda: compiled["forward"](theta0, fw_atol)
    times = alternate(runs, repeats=repeats)
    g_rev = np.asarray(runs["reverse"]())
    g_fd = np.asarray(runs["FD (loop)"]())
    agreement = error(g_rev, np.asarray(g_fd))

    g_batch = np.asarray(runs["reverse (batch)"]())
    agreement_batch = error(g_batch, np.asarray(g_fd))
    fd_best = min(
        ("FD (vmap)", "FD (loop)", "FD (batch)"), key=lambda k: np.median(times[k])
    )
    rev_best = min(("reverse", "reverse (batch)"), key=lambda k: np.median(times[k]))
    dense = None
    if use_dense:
        Fd = make_loss(B_diag, B_factor, eps, T, dense=True)
        grad_d, grad_d_c = compile_jax(jax.jit(jax.grad(Fd)), theta0, rev_atol)
        solve_d, _ = compile_jax(jax.jit(lambda v, a: Fd(v, a)), theta0, rev_atol)
        t_dense = alternate(
            {
                "dense reverse": lambda: grad_d(theta0, rev_atol),
                "dense forward solve": lambda: solve_d(theta0, rev_atol),
            },
            repeats=min(repeats, 2),
        )
        dense = dict(
            times=t_dense,
            compile_s=grad_d_c,
            error=error(grad_d(theta0, rev_atol), ref),
        )

    print()
    for name in programs:
        print(compile_line(name, compile_s[name]))
    print(
        f"reference: reverse mode at atol {REF_ATOL:g}; FD at that atol agrees to "
        f"{ref_check:.1e}"
    )
    notes = {
        name: f"atol {c['atol']:g}, error {c['error']:.1e}"
        + (f", h {c['h']:g}" if c["h"] else "")
        for name, c in chosen.items()
    }
    notes["forward solve"] = f"one solve of F at atol {chosen['reverse']['atol']:g}"
    notes["forward solve (batch)"] = (
        f"one solve_lv_batch of F at atol {chosen['reverse (batch)']['atol']:g}"
    )
    print(table(times, notes=notes))
    # cost in forward solves: per solve, one call alone (latency-bound, noisy on a
    # loaded machine) and amortised over the 2P calls of the FD loop
    solve_one = np.median(times["forward solve"])
    solve_loop = np.median(times["FD (loop)"]) / (2 * P)
    print(
        f"one forward solve: {fmt_seconds(solve_one)} alone, "
        f"{fmt_seconds(solve_loop)} amortised in the FD loop"
    )
    for name in (
        "reverse",
        "reverse (batch)",
        "FD (vmap)",
        "FD (batch)",
        "FD (loop)",
    ) + (("forward",) if use_forward else ()):
        t = np.median(times[name])
        print(
            f"{name}: {t / solve_one:.1f} forward solves (alone), "
            f"{t / solve_loop:.1f} (amortised)"
        )
    print(ratio_line(fd_best, rev_best, times, target=TARGET_RATIO))
    print(ratio_line("FD (vmap)", rev_best, times))
    other = "reverse" if rev_best == "reverse (batch)" else "reverse (batch)"
    print(ratio_line(fd_best, other, times))
    batch_solves = np.median(times["reverse (batch)"]) / np.median(
        times["forward solve (batch)"]
    )
    print(f"reverse (batch): {batch_solves:.1f} of its own forward solves")
    if use_forward:
        print(ratio_line(fd_best, "forward", times))
    if dense is not None:
        td = dense["times"]
        dense_cost = np.median(td["dense reverse"]) / np.median(
            td["dense forward solve"]
        )
        print(compile_line("dense reverse", dense["compile_s"]))
        print(table(td))
        print(
            f"dense B: reverse costs {dense_cost:.0f} forward solves (structured B: "
            f"{np.median(times['reverse']) / solve_one:.1f}); "
            f"error {dense['error']:.1e}"
        )
    print(
        f"agreement: reverse vs FD (loop) {agreement:.1e}, reverse (batch) vs FD "
        f"(loop) {agreement_batch:.1e} of max |grad| (accepted <= {AGREEMENT:g})"
    )

    result = dict(
        quick=args.quick,
        p=p,
        chosen=chosen,
        agreement=agreement,
        ref_check=ref_check,
        agreement_batch=agreement_batch,
        agree=bool(
            max(agreement, agreement_batch) <= AGREEMENT and ref_check <= AGREEMENT
        ),
        times=times,
        compile_s=compile_s,
        ratio=ratio(times[fd_best], times[rev_best]),
        ratio_vmap=ratio(times["FD (vmap)"], times[rev_best]),
        fd_best=fd_best,
        rev_best=rev_best,
        dense=dense,
        machine=machine(),
    )
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
