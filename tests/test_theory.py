"""Switch-on times, the singular-limit staircase and its quadratic program
(docs/theory/switch-on-times.md), checked against `solve_lv`, closed forms and scipy.

Power laws are in `test_power_law.py`, plateau detection and W-space training in
`test_plateaus.py`.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.optimize

import nqfjax
from nqfjax import nnqp


# every solve_lv call here has p = 6 modes and N_TAU output times, so that they
# share one compilation
N_TAU = 3000


# ---------------------------------------------------------------------------
# The quadratic program
# ---------------------------------------------------------------------------


def _random_qp(rng, p, rank):
    A = rng.normal(size=(rank, p))
    B = A.T @ A / rank
    r = rng.normal(size=p)
    if rank < p:
        # keep the program bounded: r in the range of B plus a part that only
        # pushes the null directions towards zero
        r = B @ rng.normal(size=p) - np.abs(rng.normal(size=p)) * 0.1
    return B, r


def _objective(B, r, m):
    return 0.5 * m @ B @ m - r @ m


def test_nnqp_matches_scipy_nnls():
    """Positive-definite programs: `B = L L^T`, `r = L b`, so the program is
    `min |L^T m - b|^2 / 2` over `m >= 0`, which `scipy.optimize.nnls` solves
    exactly (an independent Lawson-Hanson on the least-squares form)."""
    rng = np.random.default_rng(0)
    for trial in range(20):
        p = 6  # one size, one compilation (shared with the staircase tests)
        B, r = _random_qp(rng, p, p + 3)
        L = np.linalg.cholesky(B)
        b = np.linalg.solve(L, r)
        m_ref, _ = scipy.optimize.nnls(L.T, b)
        sol = nnqp(B, r)
        assert bool(sol.converged)
        # both solve the same strictly convex program to rounding (cond(B) is
        # at most ~1e3 here): 1e-9 relative
        np.testing.assert_allclose(sol.m, m_ref, rtol=1e-9, atol=1e-9)
        # half the variables masked: same as the program on the rest
        mask = rng.random(p) < 0.5
        sol = nnqp(B, r, jnp.asarray(mask))
        keep = np.flatnonzero(mask)
        if keep.size:
            Lk = np.linalg.cholesky(B[np.ix_(keep, keep)])
            mk, _ = scipy.optimize.nnls(Lk.T, np.linalg.solve(Lk, r[keep]))
            np.testing.assert_allclose(sol.m[keep], mk, rtol=1e-9, atol=1e-9)
        np.testing.assert_array_equal(np.asarray(sol.m)[~mask], 0.0)


def test_nnqp_psd_matches_lbfgsb():
    """Rank-deficient (PSD, singular) programs against scipy's L-BFGS-B with
    bounds; the minimiser need not be unique there, so compare the optimal value
    and the KKT conditions, which are unique."""
    rng = np.random.default_rng(1)
    for trial in range(20):
        p = 6
        B, r = _random_qp(rng, p, int(rng.integers(1, p)))
        ref = scipy.optimize.minimize(
            lambda m: (_objective(B, r, m), B @ m - r),
            np.zeros(p),
            jac=True,
            method="L-BFGS-B",
            bounds=[(0, None)] * p,
            options=dict(ftol=1e-15, gtol=1e-12, maxiter=10_000),
        )
        sol = nnqp(B, r)
        assert bool(sol.converged)
        m = np.asarray(sol.m)
        # L-BFGS-B stops at ftol 1e-15 relative: our value is no worse
        assert _objective(B, r, m) <= ref.fun + 1e-10 * max(1, abs(ref.fun))
        grad = B @ m - r
        assert np.all(m >= 0)
        # KKT: zero gradient where m > 0, non-negative where m = 0 (1e-10 covers
        # rounding of a solve with cond(B_PP) up to ~1e4)
        assert np.all(np.abs(grad[m > 0]) < 1e-10 * (1 + np.abs(r).max()))
        assert np.all(grad[m == 0] > -1e-10 * (1 + np.abs(r).max()))


def test_nnqp_jit_vmap_float32():
    rng = np.random.default_rng(2)
    p = 6
    B, r = _random_qp(rng, p, p + 2)
    masks = rng.random((p, p)) < 0.7
    batch = jax.jit(jax.vmap(nnqp, in_axes=(None, None, 0)))(B, r, jnp.asarray(masks))
    for i, mask in enumerate(masks):
        ref = nnqp(B, r, jnp.asarray(mask))
        # same algorithm and arithmetic, batched: agreement to rounding
        np.testing.assert_allclose(batch.m[i], ref.m, rtol=1e-12, atol=1e-14)
        assert bool(batch.converged[i])
    sol32 = nnqp(jnp.asarray(B, jnp.float32), jnp.asarray(r, jnp.float32))
    assert sol32.m.dtype == jnp.float32 and bool(sol32.converged)
    # float32 solve of a program with cond(B) ~ 1e2: ~1e-5 relative
    np.testing.assert_allclose(sol32.m, nnqp(B, r).m, rtol=1e-4, atol=1e-5)


def test_nnqp_unbounded_is_flagged():
    # modes 0 and 1 can grow together without bound: d = e_0 + e_1 has B d = 0
    # and r . d > 0 (B is PSD, not PD)
    B = np.eye(6)
    B[:2, :2] = [[1.0, -1.0], [-1.0, 1.0]]
    r = np.ones(6)
    assert not bool(nnqp(B, r).converged)
    # bounded once r . d <= 0: then it converges, to the KKT point
    r2 = np.array([1.0, -1.5, 1, 1, 1, 1])
    sol = nnqp(B, r2)
    assert bool(sol.converged)
    np.testing.assert_allclose(sol.m, [1.0, 0, 1, 1, 1, 1], atol=1e-12)
    lv = nqfjax.LotkaVolterra(r, B)
    with pytest.raises(ValueError, match="no bounded equilibrium"):
        nqfjax.singular_limit(lv, 10.0)
    # independent modes: B_kk = 0 with r_k > 0
    lv = nqfjax.LotkaVolterra(np.ones(6), np.diag([1.0, 0, 1, 1, 1, 1]))
    with pytest.raises(ValueError, match="grows without bound"):
        nqfjax.singular_limit(lv, 10.0)
    with pytest.raises(ValueError, match="grows without bound"):
        nqfjax.switch_on_times(lv, 1e-8)


def test_bad_input():
    lv = _quadratic_network_lv(*ALL_ON)
    # B not symmetric or not PSD: LotkaVolterra and nnqp refuse it
    B = np.asarray(lv.interactions.as_matrix()).copy()
    B[0, 1] += 0.1
    with pytest.raises(ValueError, match="symmetric"):
        nqfjax.LotkaVolterra(lv.r, B)
    with pytest.raises(ValueError, match="symmetric"):
        nnqp(B, lv.r)
    not_psd = np.diag([1.0, -0.5, 1, 1, 1, 1])
    with pytest.raises(ValueError, match="positive semi-definite"):
        nqfjax.LotkaVolterra(np.ones(6), not_psd)
    with pytest.raises(ValueError, match="positive semi-definite"):
        nnqp(not_psd, np.ones(6))
    with pytest.raises(ValueError, match="shape"):
        nnqp(np.eye(6), np.ones(5))
    with pytest.raises(ValueError, match="boolean"):
        nnqp(np.eye(6), np.ones(6), jnp.ones(6))
    # ln(1/eps) must be > 0 (eps < 1) and a scalar
    for bad in (0.0, -1.0, np.nan, np.inf):
        with pytest.raises(ValueError, match="log_inv_eps"):
            nqfjax.singular_limit(lv, bad)
    with pytest.raises(ValueError, match="log_inv_eps"):
        nqfjax.singular_limit(lv, np.ones(2))
    with pytest.raises(ValueError, match="max_events"):
        nqfjax.singular_limit(lv, 10.0, max_events=2.5)
    # initial values: positive, shape (p,)
    for bad in (0.0, -1e-8, np.full(6, np.nan)):
        with pytest.raises(ValueError, match="m0"):
            nqfjax.switch_on_times(lv, bad)
    with pytest.raises(ValueError, match="m0"):
        nqfjax.switch_on_times(lv, np.full(5, 1e-8))
    with pytest.raises(ValueError, match="m0"):
        nqfjax.singular_limit(lv, 10.0, m0=-np.ones(6))


def test_eager_functions_refuse_traced_arguments():
    """The event loop runs in numpy: under `jit`/`vmap`/`grad` every traced
    argument is refused with a `ValueError` that names it (not a
    `TracerArrayConversionError` from inside numpy)."""
    lv = _quadratic_network_lv(*ALL_ON)
    traced = {
        "lv": lambda lv_, x: nqfjax.singular_limit(lv_, 10.0).jump_times,
        "log_inv_eps": lambda lv_, x: nqfjax.singular_limit(lv, x).jump_times,
        "m0": lambda lv_, x: nqfjax.singular_limit(lv, 10.0, m0=x).jump_times,
    }
    for name, fn in traced.items():
        with pytest.raises(ValueError, match=f"`{name}` is traced.*outside `jax.jit`"):
            jax.jit(fn)(lv, 1e-8)
    with pytest.raises(ValueError, match="`lv` is traced"):
        jax.jit(lambda lv_: nqfjax.switch_on_times(lv_, 1e-8))(lv)
    with pytest.raises(ValueError, match="`m0` is traced"):
        jax.jit(lambda m0: nqfjax.switch_on_times(lv, m0))(1e-8)
    with pytest.raises(ValueError, match="`m0` is traced"):
        jax.vmap(lambda m0: nqfjax.switch_on_times(lv, m0))(jnp.full((2, 6), 1e-8))
    with pytest.raises(ValueError, match="`log_inv_eps` is traced"):
        jax.grad(lambda x: nqfjax.singular_limit(lv, x).jump_times[0])(10.0)
    with pytest.raises(ValueError, match="max_events"):
        jax.jit(lambda n: nqfjax.switch_on_times(lv, 1e-8, max_events=n))(5)
    # concrete arguments, but inside a jit the NNQP would be staged
    with pytest.raises(ValueError, match="run eagerly.*outside `jax.jit`"):
        jax.jit(lambda: nqfjax.switch_on_times(lv, 1e-8))()
    # the same calls with concrete values run (and agree with each other)
    t = nqfjax.switch_on_times(lv, 1e-8, corrected=False)
    st = nqfjax.singular_limit(lv, np.log(1e8))
    np.testing.assert_allclose(t, st.switch_on_t, rtol=1e-12)


def test_log_eps_is_a_deprecated_name():
    lv = _quadratic_network_lv(*ALL_ON)
    st = nqfjax.singular_limit(lv, 12.0)
    assert float(st.log_inv_eps) == 12.0
    with pytest.warns(DeprecationWarning, match="log_inv_eps"):
        old = nqfjax.singular_limit(lv, log_eps=12.0)
    np.testing.assert_array_equal(old.jump_times_tau, st.jump_times_tau)
    with pytest.warns(DeprecationWarning, match="log_inv_eps"):
        assert float(st.log_eps) == 12.0
    with pytest.raises(TypeError, match="not both"):
        nqfjax.singular_limit(lv, 12.0, log_eps=12.0)


def test_singular_limit_float32():
    lv = _quadratic_network_lv(*ON_OFF)
    lv32 = nqfjax.LotkaVolterra(
        jnp.asarray(lv.r, jnp.float32),
        jnp.asarray(lv.interactions.as_matrix(), jnp.float32),
        loss_offset=jnp.asarray(lv.loss_offset, jnp.float32),
    )
    st, st32 = nqfjax.singular_limit(lv, 10.0), nqfjax.singular_limit(lv32, 10.0)
    assert st32.plateau_losses.dtype == jnp.float32
    assert [(e.mode, e.on) for e in st32.events] == [(e.mode, e.on) for e in st.events]
    # float32 rates and B: ~1e-6 relative
    np.testing.assert_allclose(st32.jump_times_tau, st.jump_times_tau, rtol=1e-5)
    np.testing.assert_allclose(st32.plateau_losses, st.plateau_losses, rtol=1e-4)


# ---------------------------------------------------------------------------
# Independent modes: closed forms
# ---------------------------------------------------------------------------


def _half_way_times(ts, m, half):
    """First crossing of `m_k = half_k`, interpolating `ln(m / (2 half - m))`,
    which is linear in `t` for a logistic (so the interpolation is exact)."""
    out = []
    for k in range(m.shape[1]):
        y = np.log(m[:, k]) - np.log(np.maximum(2 * half[k] - m[:, k], 1e-300))
        i = np.flatnonzero(y >= 0)
        if i.size == 0 or i[0] == 0:
            out.append(np.inf)
            continue
        i = i[0]
        out.append(ts[i - 1] + (ts[i] - ts[i - 1]) * (-y[i - 1]) / (y[i] - y[i - 1]))
    return np.array(out)


def test_switch_on_times_independent_modes():
    r = np.array([1.0, 0.7, 0.5, 0.3, 0.2, 0.05])
    Bd = np.array([1.0, 2.0, 0.5, 1.0, 0.4, 1.0])
    decay = 0.1
    lv = nqfjax.LotkaVolterra(r, np.diag(Bd), decay)
    m0 = np.array([1e-8, 1e-10, 3e-6, 1e-12, 1e-5, 1e-8])
    t = np.asarray(nqfjax.switch_on_times(lv, m0))
    r_eff = (r - decay)[:5]
    mstar = r_eff / Bd[:5]
    closed = np.log(mstar / m0[:5] - 1) / r_eff
    np.testing.assert_allclose(t[:5], closed, rtol=1e-12)
    assert np.isinf(t[5])  # r - decay < 0: never switches on
    # the half-way time measured on solve_lv; the solver's 1e-9 tolerance on
    # ln m moves a crossing by ~1e-9 ln(m*/m0) / r: 1e-6 relative is ample
    ts = np.linspace(0.0, 1.2 * t[:5].max(), N_TAU + 1)[1:]
    m = np.asarray(nqfjax.solve_lv(lv, m0, ts).ys)
    measured = _half_way_times(ts, m[:, :5], mstar / 2)
    np.testing.assert_allclose(measured, t[:5], rtol=1e-6)
    # a scalar m0 broadcasts
    np.testing.assert_allclose(
        nqfjax.switch_on_times(lv, 1e-8)[:5],
        np.log(mstar / 1e-8 - 1) / r_eff,
        rtol=1e-12,
    )
    # float32 in, float32 out
    lv32 = nqfjax.LotkaVolterra(
        jnp.asarray(r, jnp.float32), jnp.asarray(np.diag(Bd), jnp.float32), decay
    )
    t32 = nqfjax.switch_on_times(lv32, jnp.asarray(m0, jnp.float32))
    assert t32.dtype == jnp.float32
    np.testing.assert_allclose(t32[:5], closed, rtol=1e-5)


def test_singular_limit_independent_modes():
    """Diagonal `B`: mode k switches on at tau_k = -q_k(0) / r_k and the plateau
    after it adds its own -loss_scale r_k m*_k / 2."""
    r = np.array([0.4, 1.0, 0.25, 0.6])
    Bd = np.array([0.5, 1.0, 2.0, 1.5])
    lv = nqfjax.LotkaVolterra(r, np.diag(Bd), loss_scale=2.0, loss_offset=3.0)
    st = nqfjax.singular_limit(lv, 20.0)
    order = np.argsort(-r)
    np.testing.assert_allclose(st.jump_times_tau, 1 / r[order], rtol=1e-14)
    np.testing.assert_allclose(st.jump_times, 20.0 / r[order], rtol=1e-14)
    assert [e.mode for e in st.events] == order.tolist()
    assert all(e.on for e in st.events)
    gains = -2.0 * 0.5 * r * (r / Bd)
    expected = 3.0 + np.concatenate([[0.0], np.cumsum(gains[order])])
    np.testing.assert_allclose(st.plateau_losses, expected, rtol=1e-14)
    np.testing.assert_allclose(st.switch_on_tau, 1 / r, rtol=1e-14)
    # per-mode initial scales: q_k(0) = ln m0_k / ln(1/eps)
    m0 = np.exp(-20.0 * np.array([1.0, 3.0, 0.5, 1.0]))
    st = nqfjax.singular_limit(lv, 20.0, m0=m0)
    np.testing.assert_allclose(st.switch_on_tau, [1 / 0.4, 3.0, 0.5 / 0.25, 1 / 0.6])
    # the staircase loss at given times
    taus = np.array([0.1, 1.9, 2.1, 2.6])
    expected = st.plateau_losses[np.searchsorted(st.jump_times_tau, taus, "right")]
    np.testing.assert_allclose(st.loss_tau(taus), expected)
    np.testing.assert_allclose(st.loss(taus * 20.0), expected)


# ---------------------------------------------------------------------------
# Interacting modes: the quadratic network with Gaussian inputs
# ---------------------------------------------------------------------------


def _quadratic_network_lv(cov, mu, eta=0.25):
    r"""The quadratic network `f(x) = sum_i (u_i . x)^2` on Gaussian inputs with
    covariance `S = diag(cov)`, teacher `y = x^T diag(mu) x`. From
    `K[X] = 2 S X S + S Tr[S X]` and `C = K[diag(mu)]` (docs/theory/closed-flow.md),
    in the standard basis: `B = 4 eta (2 diag(cov^2) + cov cov^T)` (diagonal plus
    rank one), `r = B mu`, and the loss is `(m - mu)^T B (m - mu) / (8 eta)`."""
    cov = np.asarray(cov, np.float64)
    mu = np.asarray(mu, np.float64)
    Khat = 2 * np.diag(cov**2) + np.outer(cov, cov)
    B = 4 * eta * Khat
    return nqfjax.LotkaVolterra(
        B @ mu, B, loss_scale=1 / (4 * eta), loss_offset=0.5 * mu @ Khat @ mu
    )


# A teacher with positive eigenvalues: six modes switch on one after another
# (chosen by a search for well-separated jumps and large drops).
ALL_ON = (
    [1.5, 1.236, 1.019, 0.84, 0.692, 0.57],
    [2.93, 2.47, 1.76, 1.68, 1.51, 0.94],
)
# A teacher with one negative eigenvalue on the largest-variance direction: the
# rank-one coupling (S Tr[S X]) first makes mode 0 grow and switch on; once the
# other modes hold their share of Tr[S M], mode 0 is pushed back off (its NNQP
# value is 0) when mode 4 switches on.
ON_OFF = (
    [1.5, 0.857, 0.489, 0.28, 0.16, 0.091],
    [-0.67, 2.05, 3.82, 11.11, 23.47, 64.25],
)
EPSILONS = (1e-4, 1e-8, 1e-16, 1e-32)


@pytest.mark.parametrize("config", [ALL_ON, ON_OFF], ids=["all_on", "on_off"])
def test_quadratic_network_system_matches_lv_reduce(config):
    """The closed form used here against the library's route: the Gaussian
    task of `gaussian_quadratic_task` reduced by `lv_reduce` (modes ordered by
    decreasing r, so compare up to that permutation)."""
    cov, mu = map(np.asarray, config)
    lv = _quadratic_network_lv(cov, mu, eta=1.0)  # flow time, as lv_reduce
    task = nqfjax.gaussian_quadratic_task(np.diag(cov), np.diag(mu))
    lv_ref, basis = nqfjax.lv_reduce(task)
    perm = np.argmax(np.abs(np.asarray(basis)), axis=0)
    assert sorted(perm) == list(range(len(cov)))
    # both are exact: agreement to rounding
    np.testing.assert_allclose(
        lv_ref.interactions.as_matrix(),
        np.asarray(lv.interactions.as_matrix())[np.ix_(perm, perm)],
        atol=1e-12,
    )
    np.testing.assert_allclose(lv_ref.r, np.asarray(lv.r)[perm], atol=1e-12)
    m = np.linspace(0.1, 1.0, len(cov))
    np.testing.assert_allclose(lv_ref.loss(m[perm]), lv.loss(m), rtol=1e-12)


def _crossing(x, y, level, start=0):
    """First `x` after index `start` where `y` crosses `level` (linear interp)."""
    above = y[start:] >= level
    flips = np.flatnonzero(above[1:] != above[:-1])
    if flips.size == 0:
        return np.inf, len(y)
    i = start + flips[0]
    return x[i] + (x[i + 1] - x[i]) * (level - y[i]) / (y[i + 1] - y[i]), i + 1


def _measure(st, taus, m):
    """Measured time of every staircase event from `m(tau)`: a mode switches on
    when `m_k` crosses half its value on the plateau it switches on into, and off
    when it falls below half its value on the plateau before."""
    J = np.asarray(st.jump_times_tau)
    P = np.asarray(st.plateau_values)
    out, on_index = [], {}
    for e in st.events:
        j = int(np.argmin(np.abs(J - e.tau)))
        k = e.mode
        logm = np.log(m[:, k])
        if e.on:
            t, i = _crossing(taus, logm, np.log(0.5 * P[j + 1, k]))
            on_index[k] = i
        else:
            t, _ = _crossing(taus, logm, np.log(0.5 * P[j, k]), on_index[k])
        out.append(t)
    return np.array(out)


@pytest.fixture(scope="module")
def interacting_runs():
    """`solve_lv` of both quadratic-network systems at every eps, on grids of the
    same `N_TAU` points in rescaled time (one compilation for all)."""
    runs = {}
    for name, (cov, mu) in dict(all_on=ALL_ON, on_off=ON_OFF).items():
        lv = _quadratic_network_lv(cov, mu)
        st = nqfjax.singular_limit(lv, 1.0)
        J = np.asarray(st.jump_times_tau)
        taus = np.geomspace(J[0] / 5, 2 * J[-1], N_TAU)
        sols = {}
        for eps in EPSILONS:
            log_eps = np.log(1 / eps)
            sols[eps] = np.asarray(
                nqfjax.solve_lv(lv, np.full(lv.p, eps), taus * log_eps).ys
            )
        runs[name] = (lv, st, taus, sols)
    return runs


@pytest.mark.slow  # a long physics check (the slow tier)
@pytest.mark.parametrize("name", ["all_on", "on_off"])
def test_staircase_is_the_small_eps_limit(interacting_runs, name):
    lv, st, taus, sols = interacting_runs[name]
    J = np.asarray(st.jump_times_tau)
    assert len(J) >= 6
    L_stair = np.asarray(st.loss_tau(taus))
    # the staircase in tau does not depend on the ln(1/eps) used to build it
    st2 = nqfjax.singular_limit(lv, 37.0)
    np.testing.assert_allclose(st2.jump_times_tau, J, rtol=1e-12)
    np.testing.assert_allclose(st2.jump_times, 37.0 * J, rtol=1e-12)
    np.testing.assert_allclose(st2.plateau_losses, st.plateau_losses, rtol=1e-12)

    jump_err, curve_err = [], []
    for eps in EPSILONS:
        m = sols[eps]
        measured = _measure(st, taus, m)
        jump_err.append(np.max(np.abs(measured - np.asarray(st.event_tau))))
        L = np.asarray(lv.loss(jnp.asarray(m)))
        # L1 distance of the curves over log-tau, relative to the initial loss
        curve_err.append(
            np.trapezoid(np.abs(L - L_stair), np.log(taus))
            / float(st.plateau_losses[0])
        )
    # finite-eps corrections are O(1/ln(1/eps)), and ln(1/eps) doubles at each
    # step: both errors must shrink every time (measured: ~halving)
    assert np.all(np.diff(jump_err) < 0), jump_err
    assert np.all(np.diff(curve_err) < 0), curve_err
    assert jump_err[-1] < 0.7 * jump_err[-2], jump_err
    # plateau losses at the smallest eps, geometrically mid-way between jumps;
    # the last plateau of a realizable teacher is 0, so the tolerance is 1% of
    # the plateau plus 1e-8 of the initial loss
    mids = np.concatenate([[J[0] / 3], np.sqrt(J[:-1] * J[1:]), [1.5 * J[-1]]])
    L = np.asarray(lv.loss(jnp.asarray(sols[EPSILONS[-1]])))
    measured = np.interp(np.log(mids), np.log(taus), L)
    expected = np.asarray(st.plateau_losses)
    np.testing.assert_array_less(
        np.abs(measured - expected), 0.01 * expected + 1e-8 * expected[0]
    )


def test_mode_switches_on_then_off(interacting_runs):
    lv, st, taus, sols = interacting_runs["on_off"]
    events = st.events
    off = [e for e in events if not e.on]
    assert [(e.mode, e.on) for e in events] == [
        (0, True),
        (1, True),
        (2, True),
        (3, True),
        (4, True),
        (0, False),
        (5, True),
    ]
    assert len(off) == 1 and off[0].mode == 0
    # it leaves when mode 4 arrives, at the same tau
    assert off[0].tau == [e.tau for e in events if e.mode == 4][0]
    P = np.asarray(st.plateau_values)
    active = np.asarray(st.active_sets)
    assert active[1:5, 0].all() and not active[5:, 0].any()
    # the off is real in solve_lv: after its plateau mode 0 falls by orders of
    # magnitude, at the rate the staircase predicts for its exponent,
    # dq_0/dtau = r_0 - (B m)_0 on the last plateau (2%: the O(1/ln(1/eps))
    # corrections at eps = 1e-32 are ~1% here)
    eps = EPSILONS[-1]
    log_eps = np.log(1 / eps)
    m0 = sols[eps][:, 0]
    J = np.asarray(st.jump_times_tau)
    assert m0[-1] < 1e-6 * P[4, 0]
    a, b = np.searchsorted(taus, [1.15 * J[-1], 1.9 * J[-1]])
    slope = (np.log(m0[b]) - np.log(m0[a])) / (log_eps * (taus[b] - taus[a]))
    rate = float((lv.r - lv.interactions.as_matrix() @ st.plateau_values[-1])[0])
    assert rate < 0
    np.testing.assert_allclose(slope, rate, rtol=0.02)


@pytest.mark.parametrize("name", ["all_on", "on_off"])
def test_switch_on_times_interacting(interacting_runs, name):
    """`switch_on_times` against the half-way times measured on `solve_lv` at
    eps = 1e-16: the leading order `tau_k ln(1/eps)` is off by O(1) (a few %),
    the first-order correction removes most of it (measured < 0.5%)."""
    lv, st, taus, sols = interacting_runs[name]
    eps = 1e-16
    log_eps = np.log(1 / eps)
    on_events = [i for i, e in enumerate(st.events) if e.on]
    measured = _measure(st, taus, sols[eps])[on_events] * log_eps
    modes = [st.events[i].mode for i in on_events]
    corrected = np.asarray(nqfjax.switch_on_times(lv, eps))[modes]
    leading = np.asarray(nqfjax.switch_on_times(lv, eps, corrected=False))[modes]
    np.testing.assert_allclose(
        leading, np.asarray(st.switch_on_tau)[modes] * log_eps, rtol=1e-12
    )
    np.testing.assert_allclose(corrected, measured, rtol=0.01)
    assert np.all(np.abs(corrected - measured) < np.abs(leading - measured))
