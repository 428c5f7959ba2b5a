"""`nqfjax.engines._rosenbrock`: a Rosenbrock solver for the log-space
Lotka-Volterra system."""

import importlib.util
import pathlib

import diffrax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import lv_interactions
from scipy.integrate import solve_ivp

from nqfjax import (
    DenseInteractions,
    DiagonalInteractions,
    LotkaVolterra,
    LowRankInteractions,
    lv_stepsize_controller,
    solve_lv,
)
from nqfjax.engines._rosenbrock import (
    RODAS4,
    RODAS5P,
    LVRosenbrock,
    RosenbrockTableau,
)


P = 5


def _interactions(p=P):
    return lv_interactions(p)


def _solvers(B, d, U):
    return {
        "dense": LVRosenbrock(DenseInteractions(B)),
        "diag_low_rank": LVRosenbrock(LowRankInteractions(d, U)),
        "generic": LVRosenbrock(),
    }


def _scipy_log(r, B, m0, ts, rtol=1e-11):
    """Reference: scipy Radau in log space with the analytic Jacobian."""
    sol = solve_ivp(
        lambda t, y: r - B @ np.exp(np.minimum(y, 50.0)),  # a trial step may overshoot
        (0.0, ts[-1]),
        np.log(m0),
        method="Radau",
        t_eval=ts,
        rtol=rtol,
        atol=rtol,
        jac=lambda t, y: -B * np.exp(np.minimum(y, 50.0))[None, :],
    )
    assert sol.success
    return np.exp(sol.y.T)


def _rel_err(m, ref):
    return float(np.max(np.abs(np.asarray(m) / ref - 1)))


@pytest.fixture(scope="module")
def system():
    r, B, d, U = _interactions()
    # From 1e-12 the modes switch on (m > 1/2) at t ~ 6, 26, 71, 132, 199: the
    # outputs cover plateaus and transitions, mostly between steps (dense output).
    ts = np.geomspace(0.1, 300.0, 40)
    m0 = np.full(P, 1e-12)
    return r, B, d, U, m0, ts, _scipy_log(r, B, m0, ts)


@pytest.mark.parametrize("mode", ["dense", "diag_low_rank", "generic"])
def test_matches_scipy_from_1e_12(system, mode):
    r, B, d, U, m0, ts, ref = system
    solver = _solvers(B, d, U)[mode]
    kinds = {"dense": DenseInteractions, "diag_low_rank": LowRankInteractions}
    assert isinstance(solver.interactions, kinds.get(mode, type(None)))
    lv = LotkaVolterra(r, B)
    control = lv_stepsize_controller(1e-9, rtol=0.0)
    m = solve_lv(lv, m0, ts, solver=solver, stepsize_controller=control).ys
    # The accuracy target is 1e-6 relative; at atol 1e-9 on log m the error
    # measured is 1e-9 (Radau at 1e-11 is tighter than that).
    assert _rel_err(m, ref) < 1e-6
    # The modes did switch on (so the check covers the stiff phase).
    assert np.all(np.asarray(m)[-1] > 0.1)


def test_independent_modes_are_logistic():
    """Diagonal `B` (`DiagonalInteractions`): each mode follows
    docs/theory/switch-on-times.md,
    `m(t) = m* / (1 + (m*/eps - 1) exp(-r t))` with `m* = r / B_kk`."""
    r = np.array([1.0, 0.3, 0.05])
    b = np.array([2.0, 0.5, 0.1])
    eps = np.array([1e-12, 1e-20, 1e-8])
    ts = np.geomspace(1.0, 1500.0, 40)
    m_star = r / b
    exact = m_star / (1 + (m_star / eps - 1) * np.exp(-r * ts[:, None]))
    solver = LVRosenbrock(DiagonalInteractions(b))
    m = solve_lv(LotkaVolterra(r, np.diag(b)), eps, ts, solver=solver).ys
    # Default float64 tolerances (1e-9): measured error 5e-9; the 1e-6.
    assert _rel_err(m, exact) < 1e-6
    assert np.all(np.asarray(m)[-1] > 0.99 * m_star)  # every mode switched on


def _fixed_step_error(tableau, ns, r, B, m0, T):
    ref = _scipy_log(r, B, m0, np.array([T]), rtol=1e-13)[-1]
    term = diffrax.ODETerm(lambda t, y, args: r - B @ jnp.exp(y))
    solver = LVRosenbrock(DenseInteractions(B), tableau=tableau)

    @jax.jit
    def solve(dt):
        sol = diffrax.diffeqsolve(
            term,
            solver,
            0.0,
            T,
            dt,
            jnp.log(jnp.asarray(m0)),
            stepsize_controller=diffrax.ConstantStepSize(),
            max_steps=max(ns),
        )
        return sol.ys[-1]

    return [float(np.max(np.abs(np.asarray(solve(T / n)) - np.log(ref)))) for n in ns]


@pytest.mark.parametrize("tableau, order", [(RODAS4, 4), (RODAS5P, 5)])
def test_convergence_order(tableau, order):
    """Global error at T against the step size, by regression on a log-log plot."""
    r, B, _, _ = _interactions(3)
    m0 = np.array([1e-2, 1e-3, 1e-4])
    ns = [16, 32, 64, 128, 256]
    assert tableau.order == order
    errs = _fixed_step_error(tableau, ns, r, B, m0, T=8.0)
    slope = np.polyfit(np.log(1.0 / np.array(ns)), np.log(errs), 1)[0]
    # Measured slopes: 4.05 (rodas4) and 4.8 (rodas5p, still approaching 5 from
    # below). A wrong Jacobian or coefficient drops the order to 1-2; errors here
    # span 2e-6 .. 3e-12, above roundoff (~1e-15 on log m ~ -9).
    assert abs(slope - order) < 0.5, (slope, errs)


def test_float32_from_1e_30():
    r, B, d, U = _interactions()
    ts = np.geomspace(1.0, 600.0, 30)  # from 1e-30: m > 1/2 at t ~ 15, 62, ..., 538
    m0 = np.full(P, 1e-30)
    ref = _scipy_log(r, B, m0, ts)
    lv = LotkaVolterra(jnp.asarray(r, jnp.float32), jnp.asarray(B, jnp.float32))
    solver = LVRosenbrock(
        LowRankInteractions(jnp.asarray(d, jnp.float32), jnp.asarray(U, jnp.float32))
    )
    m = solve_lv(lv, jnp.asarray(m0, jnp.float32), ts, solver=solver).ys
    assert m.dtype == jnp.float32
    # float32 resolves log m ~ -69 to ~4e-6 and the default float32 tolerances are
    # (1e-5, 1e-6); measured relative error of m: 2e-5 .. 4e-5. Target 1e-4.
    assert _rel_err(m, ref) < 1e-4
    assert np.all(np.asarray(m)[-1] > 0.1)


@pytest.mark.slow  # a long physics check (the slow tier)
@pytest.mark.parametrize("mode", ["dense", "diag_low_rank", "generic"])
def test_gradient_matches_finite_differences(mode):
    """d/dr and d/d(scale of B) of the loss during the switch-ons, reverse mode
    through `RecursiveCheckpointAdjoint`, against central differences, for each
    linear algebra (the LU solves are differentiated implicitly, with
    `custom_linear_solve`; the scale of `B` enters the matrix that is factorised)."""
    r, B, d, U = _interactions(3)
    m0 = jnp.array([1e-6, 1e-5, 1e-4])
    ts = jnp.array([5.0, 20.0, 40.0])

    @jax.jit
    def loss(theta):
        r_, s = theta[:3], theta[3]
        B_ = s * jnp.asarray(B)
        solver = _solvers(B_, s * jnp.asarray(d), jnp.sqrt(s) * jnp.asarray(U))[mode]
        lv = LotkaVolterra(r_, B_)
        sol = solve_lv(
            lv,
            m0,
            ts,
            solver=solver,
            rtol=0.0,
            atol=1e-10,
            max_steps=10_000,  # 1,509 needed
            adjoint=diffrax.RecursiveCheckpointAdjoint(),
        )
        return jnp.sum(sol.loss)

    theta = jnp.concatenate([jnp.asarray(r), jnp.ones(1)])
    grad = jax.grad(loss)(theta)
    eps = 1e-5
    fd = np.array(
        [
            (loss(theta.at[i].add(eps)) - loss(theta.at[i].add(-eps))) / (2 * eps)
            for i in range(4)
        ]
    )
    # Central differences: truncation ~eps^2 ~ 1e-10 relative. Measured agreement
    # ~1e-9; 1e-7 leaves room for the adaptive step sizes, which move with theta.
    np.testing.assert_allclose(np.asarray(grad), fd, rtol=1e-7)
    assert np.all(np.abs(fd) > 1.0)  # a real dependence, not zero


def test_vmap_equals_separate_solves():
    r, B, d, U = _interactions()
    key = np.random.default_rng(1)
    m0s = 10 ** key.uniform(-12, -4, size=(4, P))
    rs = r * key.uniform(0.8, 1.2, size=(4, P))
    ts = jnp.geomspace(0.1, 300.0, 20)

    def one(r_, m0):
        lv = LotkaVolterra(r_, jnp.asarray(B))
        solver = LVRosenbrock(LowRankInteractions(d, U))
        control = lv_stepsize_controller(1e-8, rtol=0.0)
        return solve_lv(lv, m0, ts, solver=solver, stepsize_controller=control).ys

    batched = jax.jit(jax.vmap(one))(jnp.asarray(rs), jnp.asarray(m0s))
    single = jax.jit(one)
    separate = np.stack([single(rs[i], m0s[i]) for i in range(4)])
    assert batched.shape == (4, 20, P)
    # Under vmap every member keeps its own step sizes, so only roundoff differs.
    np.testing.assert_allclose(np.asarray(batched), separate, rtol=1e-10)


def test_backward_in_time_returns_to_start():
    """`diffeqsolve` from t1 back to t0 (the term is wrapped with direction -1)."""
    r, B, d, U = _interactions(3)
    term = diffrax.ODETerm(lambda t, y, args: r - B @ jnp.exp(y))
    solver = LVRosenbrock(LowRankInteractions(d, U))
    control = diffrax.PIDController(rtol=0.0, atol=1e-10)

    @jax.jit
    def solve(t0, t1, y0):
        sol = diffrax.diffeqsolve(
            term, solver, t0, t1, None, y0, stepsize_controller=control
        )
        return sol.ys[-1]

    y0 = jnp.log(jnp.array([0.1, 0.2, 0.3]))
    back = solve(3.0, 0.0, solve(0.0, 3.0, y0))
    # Forward then backward over a non-stiff stretch: two errors of ~atol each.
    np.testing.assert_allclose(np.asarray(back), np.asarray(y0), atol=1e-8)


def test_bad_arguments():
    r, B, d, U = _interactions()
    with pytest.raises(ValueError, match="AbstractInteractions"):
        LVRosenbrock(jnp.asarray(B))
    with pytest.raises(ValueError, match="tableau"):
        LVRosenbrock(tableau="rodas4")
    with pytest.raises(ValueError, match="Tableau 'broken'"):
        RosenbrockTableau(
            "broken", 2, 0.5, ((),), ((),), (0.0,), (1.0,), (1.0, 2.0), ()
        )
    lv = LotkaVolterra(r, B)
    with pytest.raises(ValueError, match="size 3"):
        solver = LVRosenbrock(DiagonalInteractions(jnp.ones(3)))
        solve_lv(lv, np.full(P, 0.1), [1.0, 2.0], solver=solver)


def test_legacy_keywords_are_deprecated():
    """`LVRosenbrock(B=...)` and `LVRosenbrock(diag=..., factor=...)` still work
    for one release, with a `DeprecationWarning` at the caller, building the
    interactions (`.mode` too); their bad combinations are refused."""
    r, B, d, U = _interactions()
    with pytest.warns(DeprecationWarning, match="LVRosenbrock\\(lv.interactions\\)"):
        dense = LVRosenbrock(B=jnp.asarray(B))
    with pytest.warns(DeprecationWarning) as record:
        low_rank = LVRosenbrock(diag=jnp.asarray(d), factor=jnp.asarray(U))
    assert record[0].filename == __file__  # attributed to the caller
    with pytest.warns(DeprecationWarning):
        diagonal = LVRosenbrock(diag=jnp.asarray(d), factor=jnp.zeros((P, 0)))
    np.testing.assert_array_equal(dense.interactions.B, B)
    assert isinstance(low_rank.interactions, LowRankInteractions)
    assert isinstance(diagonal.interactions, DiagonalInteractions)
    with pytest.warns(DeprecationWarning, match="mode"):
        assert low_rank.mode == "diag_low_rank"
    with pytest.warns(DeprecationWarning):
        assert (dense.mode, LVRosenbrock().mode) == ("dense", "generic")
    for kw, match in (
        (dict(diag=jnp.asarray(d)), "together"),
        (
            dict(B=jnp.asarray(B), diag=jnp.asarray(d), factor=jnp.asarray(U)),
            "not both",
        ),
        (dict(B=jnp.ones((3, 4))), "shape"),
    ):
        with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match=match):
            LVRosenbrock(**kw)
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="not both"):
        LVRosenbrock(DiagonalInteractions(d), B=jnp.asarray(B))


@pytest.mark.slow  # 15 s; test_lv_batch checks the same solves against scipy
def test_benchmark_quick_agrees():
    """Smoke test of `benchmarks/lv_vs_scipy.py --quick`: numbers only, no timing."""
    path = pathlib.Path(__file__).parents[1] / "benchmarks" / "lv_vs_scipy.py"
    spec = importlib.util.spec_from_file_location("lv_vs_scipy", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = bench.main(["--quick"])
    # The reference (nqfjax at atol 1e-10) agrees with LSODA at 1e-12.
    assert out["reference_check"] < 1e-8
    # Both sides were calibrated to 1e-6 relative error against it ...
    assert out["err"]["nqfjax"] <= 1e-6
    assert out["err"]["scipy LSODA"] <= 1e-6
    # ... so they agree with each other to within the sum.
    assert out["agreement"] <= 2e-6


def test_method_string_is_deprecated():
    """`LVRosenbrock(method="rodas5p")` still works for one release, with a
    `DeprecationWarning`, and is the same solver as `tableau=RODAS5P`."""
    with pytest.warns(DeprecationWarning, match="tableau=RODAS5P"):
        old = LVRosenbrock(DiagonalInteractions(jnp.ones(2)), method="rodas5p")
    assert old.tableau is RODAS5P
    new = LVRosenbrock(DiagonalInteractions(jnp.ones(2)), tableau=RODAS5P)
    assert old.tableau == new.tableau and hash(old.tableau) == hash(RODAS5P)
    assert LVRosenbrock().tableau is RODAS4
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="method"):
        LVRosenbrock(method="rodas9")
