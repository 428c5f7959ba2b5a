"""The Lotka-Volterra reduction (`lv_reduce`) and its solver (`solve_lv`): closed
forms, scipy, the non-negative QP of the equilibrium, modes that die, learning
rates and schedules, and the argument checks.

Solves in float64 mostly use one set of options (p = 5, 64 output times,
rtol = atol = 1e-10) so that diffrax compiles once for the module.
"""

import diffrax
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import scipy.integrate

import nqfjax
from nqfjax import NotReducibleError
from nqfjax.engines.reduction import measure_reduction


P, NT, TOL = 5, 64, 1e-10
# rtol = atol = TOL, in solve_lv's max norm on log m
CTRL = nqfjax.lv_stepsize_controller(TOL, rtol=TOL)


def _orth(rng, d):
    return np.linalg.qr(rng.standard_normal((d, d)))[0]


def _solve(lv, m0, ts, **kw):
    return nqfjax.solve_lv(lv, m0, ts, stepsize_controller=CTRL, **kw).ys


def _logistic(t, r, mstar, eps):
    """An isolated mode."""
    with np.errstate(over="ignore"):  # a dying mode's e^{-r t} -> inf, m -> 0
        return mstar / (1.0 + (mstar / eps - 1.0) * np.exp(-r * t))


def _interacting(rng, p=P, eta=0.1):
    """A random interacting system: B = 4 eta (diag + G G^T), r > 0."""
    G = rng.standard_normal((p, p)) / np.sqrt(p)
    B = 4 * eta * (np.diag(rng.uniform(0.5, 1.5, p)) + G @ G.T)
    r = 4 * eta * rng.uniform(0.2, 1.0, p)
    return nqfjax.LotkaVolterra(jnp.asarray(r), jnp.asarray(B))


def _quadratic_commuting(rng, d=P, theta=0.0):
    """Quadratic network, x ~ N(0, S), low-rank teacher M*; S is rotated by
    `theta` in the plane of the teacher's first two eigenvectors (theta = 0:
    S commutes with M*)."""
    Q = _orth(rng, d)
    s = np.linspace(1.0, 0.3, d)
    mu = np.zeros(d)
    mu[:2] = (3.0, 1.0)
    R = np.eye(d)
    R[:2, :2] = [[np.cos(theta), -np.sin(theta)], [np.sin(theta), np.cos(theta)]]
    S = (Q @ R) * s @ (Q @ R).T
    return nqfjax.gaussian_quadratic_task(S, Q * mu @ Q.T)


def test_perceptron_modes_are_logistic():
    """Whitened perceptron: each singular value of E[y x^T] = T gives a logistic
    mode along (a_s, b_s)/sqrt2 with r = 2 c sigma per unit of flow time,
    m* = 2 sigma / c, and solve_lv at `eta` reproduces the logistic closed form
    in steps (rate 2 eta c sigma)."""
    rng = np.random.default_rng(1)
    k, d, eta, c = 2, 3, 0.1, 1.0
    a, b = _orth(rng, k), _orth(rng, d)
    sig = np.array([2.0, 0.5])
    T = a @ np.diag(sig) @ b[:k]
    task = nqfjax.gaussian_perceptron_task(jnp.asarray(T), slope=c)
    lv, U = nqfjax.lv_reduce(task)
    r, B = np.asarray(lv.r), np.asarray(lv.interactions.as_matrix())
    # exact arithmetic up to eigh roundoff (~1e-15)
    np.testing.assert_allclose(r[:2], 2 * c * sig, rtol=1e-12)
    np.testing.assert_allclose(np.diag(B)[:2], c**2, rtol=1e-12)
    for s in range(2):
        u = np.concatenate([a[:, s], b[s]]) / np.sqrt(2)
        assert abs(abs(np.dot(u, np.asarray(U[:, s]))) - 1) < 1e-12
    # the + modes start at eps, the others (paired - modes, null space) at 1e-30,
    # whose coupling (B m ~ 1e-31) is far below the 1e-6 tolerance
    eps = np.array([1e-6, 2e-6])
    m0 = np.full(k + d, 1e-30)
    m0[:2] = eps
    ts = np.linspace(0.0, 300.0, NT)
    m = np.asarray(_solve(lv, jnp.asarray(m0), jnp.asarray(ts), learning_rate=eta))
    mstar = 2 * sig / c
    for s in range(2):
        exact = _logistic(ts, 2 * eta * c * sig[s], mstar[s], eps[s])
        # 1e-6 is the bar; the solve runs at rtol 1e-10 on log m
        np.testing.assert_allclose(m[:, s], exact, rtol=1e-6)
    assert m[-1, 0] > 0.99 * mstar[0] and m[-1, 1] > 0.99 * mstar[1]  # both switched


def test_perceptron_degenerate_singular_values():
    """k = d = 3, rank 2 with equal singular values: C is degenerate in its +,
    - and null eigenspaces; lv_reduce must still find a basis (paired modes) in
    which the task reduces, and lv.loss must equal task.loss there."""
    rng = np.random.default_rng(2)
    a, b = _orth(rng, 3), _orth(rng, 3)
    T = 1.5 * (np.outer(a[:, 0], b[:, 0]) + np.outer(a[:, 1], b[:, 1]))
    task = nqfjax.gaussian_perceptron_task(jnp.asarray(T))
    lv, U = nqfjax.lv_reduce(task)
    np.testing.assert_allclose(np.asarray(U.T @ U), np.eye(6), atol=1e-12)
    # two modes with r = 2 c sigma = 3, two with -3, two in the null space
    np.testing.assert_allclose(
        np.sort(np.asarray(lv.r)), [-3, -3, 0, 0, 3, 3], atol=1e-11
    )
    m = jnp.asarray(rng.uniform(0, 2, 6))
    M = U @ jnp.diag(m) @ U.T
    # the loss identity is exact when the reduction is (roundoff 1e-14)
    np.testing.assert_allclose(lv.loss(m), task.loss(M), rtol=1e-12)
    # reducible means K keeps diag(m) diagonal in the basis
    KM = np.asarray(U.T @ task.K(M) @ U)
    assert np.max(np.abs(KM - np.diag(np.diag(KM)))) < 1e-12


def test_lv_loss_equals_task_loss():
    """lv.loss(m) == task.loss(U diag(m) U^T) for the reducible tasks, and the
    quadratic network's B is 4 (2 diag(s^2) + s s^T) in flow time."""
    rng = np.random.default_rng(3)
    quad = _quadratic_commuting(rng)
    tasks = [
        quad,
        nqfjax.gaussian_perceptron_task(jnp.asarray(rng.standard_normal((2, 3)))),
        nqfjax.power_law_task(6, 1.5, 0.5),
    ]
    for task in tasks:
        lv, U = nqfjax.lv_reduce(task)
        assert float(lv.decay) == 0.0
        for _ in range(3):
            m = jnp.asarray(rng.uniform(0, 3, task.p))
            # roundoff only
            np.testing.assert_allclose(
                lv.loss(m), task.loss(U @ jnp.diag(m) @ U.T), rtol=1e-11
            )
    lv, U = nqfjax.lv_reduce(quad)
    s = np.einsum("ik,ij,jk->k", np.asarray(U), np.asarray(quad.covariance), U)
    np.testing.assert_allclose(
        np.asarray(lv.interactions.as_matrix()),
        4 * (2 * np.diag(s**2) + np.outer(s, s)),
        rtol=1e-11,
    )


def test_quadratic_isotropic_degenerate_reduces():
    """S = I: the teacher's null space is a degenerate eigenspace of C; any basis
    there works, and lv_reduce must accept it with violation ~ roundoff."""
    rng = np.random.default_rng(4)
    Q = _orth(rng, P)
    task = nqfjax.gaussian_quadratic_task(jnp.eye(P), Q * [2.0, 1.0, 0, 0, 0] @ Q.T)
    lv, U = nqfjax.lv_reduce(task, tol=1e-12)
    # r_k = 4 (2 mu_k + Tr M*) for S = I
    np.testing.assert_allclose(
        np.asarray(lv.r), 4 * (2 * np.array([2, 1, 0, 0, 0]) + 3), rtol=1e-12
    )


def test_not_reducible_error():
    """S not commuting with M*: NotReducibleError with the measured violation,
    which grows linearly with the rotation angle and is ~ roundoff at 0."""
    # documented as a ValueError, so callers catching bad input catch it too
    assert issubclass(NotReducibleError, ValueError)
    violations = []
    for theta in (0.01, 0.02, 0.04):
        task = _quadratic_commuting(np.random.default_rng(5), theta=theta)
        with pytest.raises(NotReducibleError, match="violation") as info:
            nqfjax.lv_reduce(task)
        # the message reports the measured violation and the tolerance it broke,
        # the same numbers the exception carries
        err = info.value
        assert err.violation > err.tol
        assert f"violation {err.violation:.3g} > tol {err.tol:.3g}" in str(err)
        assert err.tol == 1e-6  # the float64 default it exceeded
        violations.append(err.violation)
    v = np.array(violations)
    assert np.all((v > 1e-6) & (v < 1))
    # first order in theta: doubling the angle doubles it (second-order terms
    # are O(theta) ~ 4% relative at theta = 0.04)
    np.testing.assert_allclose(v[1:] / v[:-1], 2.0, rtol=0.05)
    lv, _ = nqfjax.lv_reduce(_quadratic_commuting(np.random.default_rng(5)), tol=1e-13)


def test_solve_lv_matches_scipy_lsoda():
    """An interacting system from m0 = 1e-12: solve_lv (log space, Kvaerno5)
    against scipy's LSODA on the plain LV equations at rtol 1e-10."""
    rng = np.random.default_rng(6)
    lv = _interacting(rng)
    r, B = np.asarray(lv.r), np.asarray(lv.interactions.as_matrix())
    m0 = 1e-12 * rng.uniform(0.5, 2.0, P)
    ts = np.linspace(0.0, 400.0, NT)
    ref = scipy.integrate.solve_ivp(
        lambda t, m: m * (r - B @ m),
        (0.0, ts[-1]),
        m0,
        method="LSODA",
        t_eval=ts,
        rtol=1e-10,
        atol=1e-30,
    )
    assert ref.success
    m = np.asarray(_solve(lv, jnp.asarray(m0), jnp.asarray(ts)))
    # both at 1e-10 per step over a few hundred steps: 1e-5 leaves ample room
    np.testing.assert_allclose(m, ref.y.T, rtol=1e-5)
    # interactions matter here: the final state is far from the isolated m*
    assert np.max(np.abs(m[-1] / np.asarray(lv.fixed_point_isolated()) - 1)) > 0.1


def test_solve_lv_float32_from_1e30():
    """float32 from m0 = 1e-30: isolated modes against the logistic closed form
    (float64), and an interacting system against the float64 solve."""
    rng = np.random.default_rng(7)
    r = np.array([0.5, 0.4, 0.3, 0.2, 0.1])
    Bd = np.array([0.5, 0.2, 0.3, 0.1, 0.05])
    eps = 1e-30
    ts = np.linspace(0.0, 1200.0, NT)
    lv32 = nqfjax.LotkaVolterra(
        jnp.asarray(r, jnp.float32), jnp.asarray(np.diag(Bd), jnp.float32)
    )
    m = np.asarray(
        nqfjax.solve_lv(
            lv32, jnp.full(P, eps, jnp.float32), jnp.asarray(ts, jnp.float32)
        ).ys
    )
    assert m.dtype == np.float32
    exact = np.stack([_logistic(ts, r[i], r[i] / Bd[i], eps) for i in range(P)], 1)
    # default float32 tolerances (on log m) measured ~1e-4 relative error in m
    np.testing.assert_allclose(m, exact, rtol=1e-3)
    lv = _interacting(rng)
    lv32 = nqfjax.LotkaVolterra(
        lv.r.astype(jnp.float32), lv.interactions.as_matrix().astype(jnp.float32)
    )
    m0 = eps * rng.uniform(0.5, 2.0, P)
    ts = np.linspace(0.0, 1500.0, NT)
    m32 = np.asarray(
        nqfjax.solve_lv(
            lv32, jnp.asarray(m0, jnp.float32), jnp.asarray(ts, jnp.float32)
        ).ys
    )
    m64 = np.asarray(_solve(lv, jnp.asarray(m0), jnp.asarray(ts)))
    # relative error on every component, down to 1e-30 (measured ~2e-4)
    np.testing.assert_allclose(m32, m64, rtol=1e-3)
    # a quadratic network whose modes settle at m = 3 and m = 1 (log m ~ 0): with
    # an atol of 1e-6 on log m float32 once stalled here (max_steps reached)
    task = _quadratic_commuting(np.random.default_rng(70))
    task32 = nqfjax.gaussian_quadratic_task(
        task.covariance.astype(jnp.float32), task.M_star.astype(jnp.float32)
    )
    lv32, _ = nqfjax.lv_reduce(task32)
    lv, _ = nqfjax.lv_reduce(task)
    ts = np.linspace(0.0, 1500.0, NT)
    m32 = nqfjax.solve_lv(
        lv32, jnp.full(P, eps, jnp.float32), jnp.asarray(ts, jnp.float32), 0.05
    ).ys
    m64 = _solve(lv, jnp.full(P, eps), jnp.asarray(ts), learning_rate=0.05)
    assert np.max(np.asarray(m64[-1])) == pytest.approx(3.0, rel=1e-3)
    np.testing.assert_allclose(m32, m64, rtol=1e-3)


@pytest.mark.slow  # a long physics check (the slow tier)
def test_solve_lv_grad_matches_finite_differences():
    """d loss(m(t)) / d r through diffrax (RecursiveCheckpointAdjoint) against
    fourth-order central finite differences, float64, at a time in mid-transition
    (the forward solves reuse the module's compiled solve)."""
    rng = np.random.default_rng(8)
    lv = _interacting(rng)
    m0 = jnp.asarray(1e-4 * rng.uniform(0.5, 2.0, P))
    ts = jnp.linspace(0.0, 120.0, NT)
    m = np.asarray(_solve(lv, m0, ts))
    L = np.asarray(lv.loss(m))
    i = int(np.argmin(np.abs(L - 0.5 * (L[0] + L[-1]))))  # mid-transition

    def loss_at(r):
        sys = nqfjax.LotkaVolterra(r, lv.interactions.as_matrix())
        return sys.loss(_solve(sys, m0, ts)[i])

    r0 = lv.r
    grad = np.asarray(jax.grad(loss_at)(r0))
    h = 3e-4

    def f(i, x):
        return float(loss_at(r0.at[i].add(x)))

    fd = np.array(
        [
            (8 * (f(k, h) - f(k, -h)) - (f(k, 2 * h) - f(k, -2 * h))) / (12 * h)
            for k in range(P)
        ]
    )
    # truncation O(h^4 t^5) ~ 1e-8 relative; solver noise 1e-10 / h ~ 3e-7
    np.testing.assert_allclose(grad, fd, rtol=1e-5, atol=1e-5 * np.max(np.abs(fd)))
    assert np.max(np.abs(fd)) > 1e-2  # the loss does depend on r at this time


def test_solve_lv_vmap_and_failure():
    """vmap over initial scales (throw=False, as in sweeps) agrees with separate
    solves, with a batched `Solution`; a solve that hits max_steps returns NaN
    (states and loss), never a truncated curve.
    (Tsit5 here: its compile is cheap and the semantics are solver-independent.)"""
    rng = np.random.default_rng(9)
    lv = _interacting(rng)
    ts = jnp.linspace(0.0, 300.0, NT)
    m0s = jnp.outer(jnp.asarray([1e-10, 1e-6]), jnp.ones(P))
    tsit = diffrax.Tsit5()
    batched = jax.vmap(
        lambda m0: nqfjax.solve_lv(
            lv, m0, ts, stepsize_controller=CTRL, throw=False, solver=tsit
        )
    )(m0s)
    assert batched.ys.shape == (2, NT, P) and batched.loss.shape == (2, NT)
    assert np.all(np.asarray(batched.succeeded))
    steps = batched.stats
    np.testing.assert_array_equal(
        steps["num_steps"], steps["num_accepted_steps"] + steps["num_rejected_steps"]
    )
    for i in range(2):
        # two solvers, each at rtol 1e-10 per step: 1e-6 leaves ample room
        np.testing.assert_allclose(batched.ys[i], _solve(lv, m0s[i], ts), rtol=1e-6)
        # the loss along ts is lv.loss of the states (same arithmetic)
        np.testing.assert_allclose(batched.loss[i], lv.loss(batched.ys[i]), rtol=1e-14)
    bad = nqfjax.solve_lv(lv, m0s[0], ts, max_steps=4, throw=False, solver=tsit)
    assert np.all(np.isnan(np.asarray(bad.ys))) and np.all(np.isnan(bad.loss))
    assert not bool(bad.succeeded)
    assert bad.result == diffrax.RESULTS.max_steps_reached
    assert int(bad.stats["num_steps"]) == 4


def test_solve_lv_bad_input():
    lv = _interacting(np.random.default_rng(10))
    ts = jnp.linspace(0.0, 10.0, 5)
    good = jnp.full(P, 1e-6)
    with pytest.raises(ValueError, match="m0"):
        nqfjax.solve_lv(lv, good.at[0].set(0.0), ts)
    with pytest.raises(ValueError, match="m0"):
        nqfjax.solve_lv(lv, good.at[1].set(-1e-3), ts)
    with pytest.raises(ValueError, match="m0"):
        nqfjax.solve_lv(lv, good.at[2].set(jnp.nan), ts)
    with pytest.raises(ValueError, match="m0"):
        nqfjax.solve_lv(lv, jnp.full(P + 1, 1e-6), ts)  # mismatched p
    with pytest.raises(ValueError, match="ts"):
        nqfjax.solve_lv(lv, good, ts[::-1])
    with pytest.raises(ValueError, match="ts"):
        nqfjax.solve_lv(lv, good, ts.at[2].set(jnp.nan))
    with pytest.raises(ValueError, match="B"):
        nqfjax.LotkaVolterra(jnp.ones(3), jnp.ones((2, 2)))


def test_lv_reduce_bad_input():
    task = nqfjax.power_law_task(4, 1.0, 0.5)
    quad = _quadratic_commuting(np.random.default_rng(11))
    for eta in (0.0, -1.0, np.nan):  # the deprecated arguments are still checked
        with pytest.raises(ValueError, match="learning_rate"):
            with pytest.warns(DeprecationWarning):
                nqfjax.lv_reduce(quad, eta)
    with pytest.raises(ValueError, match="weight_decay"):
        with pytest.warns(DeprecationWarning):
            nqfjax.lv_reduce(quad, 0.1, -0.5)
    with pytest.raises(ValueError, match="eagerly"):
        jax.jit(lambda a: nqfjax.lv_reduce(nqfjax.power_law_task(4, a, 0.5))[0].r)(1.0)
    with pytest.raises(ValueError, match="Task"):
        nqfjax.lv_reduce(np.eye(3))
    # the power-law shortcut traces (no basis search)
    r = jax.jit(lambda a: nqfjax.power_law_task(4, a, 0.5).lotka_volterra().r)(1.0)
    np.testing.assert_allclose(r, 4 * np.arange(1, 5.0) ** -1.5, rtol=1e-14)
    for kw, name in ((dict(weight_decay=-0.5), "weight_decay"),):
        with pytest.raises(ValueError, match=name):
            nqfjax.solve_lv(task.lotka_volterra(), jnp.ones(4), jnp.ones(1), **kw)


def test_solve_lv_decay_closed_form():
    """Weight decay: an isolated mode is logistic with r - decay and
    m* = (r - decay) / B ()."""
    r, b, delta, eps = 0.6, 0.3, 0.2, 1e-8
    rs = np.array([r, 0.5, 0.4, 0.3, 0.25])
    lv = nqfjax.LotkaVolterra(jnp.asarray(rs), jnp.diag(jnp.full(P, b)), delta)
    ts = np.linspace(0.0, 200.0, NT)
    m = np.asarray(_solve(lv, jnp.full(P, eps), jnp.asarray(ts)))
    for i in range(P):
        exact = _logistic(ts, rs[i] - delta, (rs[i] - delta) / b, eps)
        np.testing.assert_allclose(m[:, i], exact, rtol=1e-6)
    np.testing.assert_allclose(lv.fixed_point_isolated(), (rs - delta) / b)
    # the weight decay of a run adds 2 weight_decay to the system's decay
    plain = nqfjax.LotkaVolterra(jnp.asarray(rs), jnp.diag(jnp.full(P, b)))
    m_wd = _solve(plain, jnp.full(P, eps), jnp.asarray(ts), weight_decay=delta / 2)
    np.testing.assert_array_equal(m_wd, m)


# --------------------------------------------------------------------------------
# modes that die (r < 0, or suppressed by the others)


@pytest.mark.parametrize("dtype, T", [(jnp.float32, 1e7), (jnp.float64, 1e12)])
def test_dying_mode_costs_few_steps(dtype, T):
    """r = [-1, 1], B = I (issue 13: float32 from T = 1e6 and float64 from
    T = 1e12 used to end in "max_steps reached"): both modes are logistic (the
    dying one with m* = r = -1, i.e. m = 1 / (3 e^t - 1) from 1/2) down to the
    smallest normal float, the dying one is reported as 0 below it, and the
    whole solve takes a few hundred steps."""
    lv = nqfjax.LotkaVolterra(jnp.asarray([-1.0, 1.0], dtype), jnp.eye(2, dtype=dtype))
    m0 = np.array([0.5, 1e-3])
    ts = np.geomspace(1e-2, T, 40)
    sol = nqfjax.solve_lv(lv, jnp.asarray(m0, dtype), jnp.asarray(ts, dtype))
    assert sol.ys.dtype == dtype and bool(sol.succeeded)
    # measured 90 (float32) and 450 (float64) steps
    assert int(sol.stats["num_steps"]) < 1000
    m = np.asarray(sol.ys, np.float64)
    np.testing.assert_array_equal(m[-1], [0.0, 1.0])
    tiny = float(jnp.finfo(dtype).tiny)
    decay = _logistic(ts, -1.0, -1.0, m0[0])
    off = decay < tiny
    assert off.sum() > 10 and (~off).sum() > 10  # both regimes are sampled
    np.testing.assert_array_equal(m[off, 0], 0.0)
    # default tolerances: atol 1e-5 (float32) / 1e-9 (float64) per step on log m
    rtol = 1e-3 if dtype == jnp.float32 else 1e-6
    np.testing.assert_allclose(m[~off, 0], decay[~off], rtol=rtol)
    np.testing.assert_allclose(m[:, 1], _logistic(ts, 1.0, 1.0, m0[1]), rtol=rtol)


@pytest.mark.parametrize("dtype, T", [(jnp.float32, 1e7), (jnp.float64, 1e12)])
def test_suppressed_modes_end_at_the_nnqp(dtype, T):
    """Ten interacting modes, some with r < 0 and some suppressed by the others:
    the solve reaches T in a few hundred steps and ends at the stable
    equilibrium, the non-negative QP's solution (active set, `nqfjax.nnqp`), with
    the dead modes reported as exactly 0."""
    rng = np.random.default_rng(4)
    p = 10
    G = rng.standard_normal((p, p)) / np.sqrt(p)
    B = np.diag(rng.uniform(0.5, 1.5, p)) + G @ G.T
    r = rng.uniform(-0.5, 1.0, p)
    ref = np.asarray(nqfjax.nnqp(jnp.asarray(B), jnp.asarray(r)).m)
    assert np.sum((ref == 0) & (r < 0)) == 2 and np.sum((ref == 0) & (r > 0)) == 2
    lv = nqfjax.LotkaVolterra(jnp.asarray(r, dtype), jnp.asarray(B, dtype))
    ts = jnp.asarray(np.geomspace(1.0, T, 20), dtype)
    sol = nqfjax.solve_lv(lv, jnp.full(p, 1e-6, dtype), ts)
    assert int(sol.stats["num_steps"]) < 2000  # measured 196 and 1145
    m = np.asarray(sol.ys[-1], np.float64)
    np.testing.assert_array_equal(m[ref == 0], 0.0)
    # the equilibrium to roundoff (measured 4e-8 and 6e-16)
    np.testing.assert_allclose(m, ref, atol=(1e-5 if dtype == jnp.float32 else 1e-12))


def test_m0_below_the_smallest_normal_refused():
    """A subnormal m0 (1e-40 in float32, 1e-310 in float64) is flushed to zero in
    arithmetic: refused with a message saying so, eagerly and under jit."""
    lv32 = nqfjax.LotkaVolterra(jnp.ones(2, jnp.float32), jnp.eye(2, dtype=jnp.float32))
    lv64 = nqfjax.LotkaVolterra(jnp.ones(2), jnp.eye(2))
    ts = jnp.asarray([1.0, 2.0])
    with pytest.raises(ValueError, match="smallest normal float32"):
        nqfjax.solve_lv(lv32, np.array([1e-40, 1e-3], np.float32), ts)
    with pytest.raises(ValueError, match="smallest normal float64"):
        nqfjax.solve_lv(lv64, np.array([1e-310, 1e-3]), ts)
    f = jax.jit(lambda m0: nqfjax.solve_lv(lv64, m0, ts, solver=diffrax.Tsit5()).ys)
    with pytest.raises(RuntimeError, match="smallest normal float64"):
        f(jnp.asarray([1e-310, 1e-3]))


def test_max_steps_reached_names_the_moving_modes():
    """r = (1, 1e-3), m0 = (1e-3, 1e-6) to t = 2e4 needs 784 steps: stopped at
    500, the fast mode has settled and the slow one is still growing, which
    `stats["moving"]` says; with throw=True the error names max_steps."""
    lv = nqfjax.LotkaVolterra(jnp.array([1.0, 1e-3]), jnp.diag(jnp.array([1.0, 1e-3])))
    m0, ts = jnp.array([1e-3, 1e-6]), jnp.array([2e4])
    sol = nqfjax.solve_lv(lv, m0, ts, max_steps=500, throw=False)
    assert not bool(sol.succeeded) and np.all(np.isnan(np.asarray(sol.ys)))
    assert int(sol.stats["num_steps"]) == 500
    # measured: settled from 400 steps on, the second mode moves until 784
    np.testing.assert_array_equal(sol.stats["moving"], [False, True])
    with pytest.raises(RuntimeError, match=r"max_steps` = 500.*moving"):
        nqfjax.solve_lv(lv, m0, ts, max_steps=500)
    for bad in (0, -1, 2.5, None):
        with pytest.raises(ValueError, match="max_steps"):
            nqfjax.solve_lv(lv, m0, ts, max_steps=bad)


# --------------------------------------------------------------------------------
# tolerances and times


def test_bad_tolerances_refused():
    """Issue 13: one logistic mode with rtol = -1 came back 5000% off, with
    atol = -1 25% off. Every negative or non-finite tolerance (and rtol = atol =
    0) is refused naming it: by `lv_stepsize_controller`, in a given controller
    eagerly and under jit; good tolerances give the closed form."""
    lv = nqfjax.LotkaVolterra(jnp.array([0.5]), jnp.array([[0.5]]))
    m0, ts = jnp.array([1e-6]), jnp.linspace(1.0, 60.0, 8)
    ctrl = nqfjax.lv_stepsize_controller(1e-10, rtol=0.0)
    good = nqfjax.solve_lv(lv, m0, ts, stepsize_controller=ctrl).ys[:, 0]
    np.testing.assert_allclose(
        good, _logistic(np.asarray(ts), 0.5, 1.0, 1e-6), rtol=1e-7
    )
    bad = [
        (dict(rtol=-1.0), "rtol"),
        (dict(atol=-1.0), "atol"),
        (dict(rtol=np.nan), "rtol"),
        (dict(atol=np.inf), "atol"),
        (dict(rtol=0.0, atol=0.0), "both be 0"),
    ]
    for kw, name in bad:
        with pytest.raises(ValueError, match=name):
            nqfjax.lv_stepsize_controller(**kw)
        control = diffrax.PIDController(**{"rtol": 1e-6, "atol": 1e-6, **kw})
        with pytest.raises(ValueError, match=name):
            nqfjax.solve_lv(lv, m0, ts, stepsize_controller=control)
        # a closed-over tolerance is concrete under jit: the same eager error
        with pytest.raises(ValueError, match=name):
            jax.jit(
                lambda m0, c=control: (
                    nqfjax.solve_lv(lv, m0, ts, stepsize_controller=c).ys
                )
            )(m0)
    with pytest.raises(ValueError, match="not both"):
        with pytest.warns(DeprecationWarning):
            nqfjax.solve_lv(lv, m0, ts, stepsize_controller=ctrl, atol=1.0)
    for kw, name in (
        (dict(solver=diffrax.ConstantStepSize()), "solver"),
        (dict(adjoint=diffrax.Tsit5()), "adjoint"),
        (dict(stepsize_controller=diffrax.Tsit5()), "stepsize_controller"),
    ):
        with pytest.raises(ValueError, match=name):
            nqfjax.solve_lv(lv, m0, ts, **kw)
    # traced tolerances are checked when the solve runs
    f = jax.jit(
        lambda rtol, atol: (
            nqfjax.solve_lv(
                lv,
                m0,
                ts,
                stepsize_controller=nqfjax.lv_stepsize_controller(atol, rtol=rtol),
            ).ys
        )
    )
    with pytest.raises(RuntimeError, match="rtol"):
        f(-1.0, 1e-9)
    with pytest.raises(RuntimeError, match="atol"):
        f(0.0, -1.0)
    np.testing.assert_allclose(f(0.0, 1e-10)[:, 0], good, rtol=1e-12)


def test_bad_times_refused():
    """Empty `ts`, and a float64 `ts` whose times merge when cast to a float32
    system (it used to fail as "not increasing"), named as such."""
    lv32 = nqfjax.LotkaVolterra(jnp.ones(2, jnp.float32), jnp.eye(2, dtype=jnp.float32))
    m0 = jnp.full(2, 1e-3, jnp.float32)
    with pytest.raises(ValueError, match="at least one time"):
        nqfjax.solve_lv(lv32, m0, [])
    with pytest.raises(ValueError, match="1-D"):
        nqfjax.solve_lv(lv32, m0, jnp.ones((2, 2)))
    ts64 = jnp.asarray([1.0, 1e7, 1e7 + 0.25], jnp.float64)  # 1 ulp of 1e7 is 1
    with pytest.raises(ValueError, match="once cast to the system's float32"):
        nqfjax.solve_lv(lv32, m0, ts64)
    f = jax.jit(lambda ts: nqfjax.solve_lv(lv32, m0, ts, solver=diffrax.Tsit5()).ys)
    with pytest.raises(RuntimeError, match="once cast to the system's float32"):
        f(ts64)
    with pytest.raises(ValueError, match="t0"):
        nqfjax.solve_lv(lv32, m0, jnp.asarray([1.0, 2.0]), t0=1.5)


# --------------------------------------------------------------------------------
# learning rates and schedules (the change of clock)


def test_solve_lv_learning_rate_is_a_clock():
    """`solve_lv(lv_unit, m0, ts, eta)` equals the system built at `eta` (rates and
    interactions times eta), and with a schedule or momentum each isolated mode
    is the logistic curve at the clock's closed form: exponential decay
    `eta_n = a q^n` sums to `a (1 - q^N) / (1 - q)` after N steps, a constant rate
    with heavy-ball momentum to `eta/(1-mu) (N - mu (1 - mu^N) / (1 - mu))`."""
    lv = _interacting(np.random.default_rng(12))
    eta = 0.3
    lv_eta = nqfjax.LotkaVolterra(eta * lv.r, eta * lv.interactions.as_matrix())
    m0 = jnp.full(P, 1e-6)
    ts = jnp.linspace(0.0, 400.0, NT)
    on_clock = nqfjax.solve_lv(lv, m0, ts, eta, stepsize_controller=CTRL).ys
    # two different systems and step sequences, each at 1e-10 per step
    np.testing.assert_allclose(on_clock, _solve(lv_eta, m0, ts), rtol=1e-6)

    r = np.array([0.5, 0.4, 0.3, 0.2, 0.1])
    b = np.array([0.5, 0.2, 0.3, 0.1, 0.05])
    iso = nqfjax.LotkaVolterra(jnp.asarray(r), jnp.diag(jnp.asarray(b)))
    N = np.unique(np.rint(np.geomspace(1, 3000, NT - 1))).astype(float)
    N = np.concatenate([N, 3000 + np.arange(1, NT - len(N) + 1)])  # NT steps
    a, q, mu = 0.2, 0.998, 0.9
    clocks = {
        "decay": (optax.exponential_decay(a, 1, q), 0.0, a * (1 - q**N) / (1 - q)),
        "momentum": (0.05, mu, 0.05 / (1 - mu) * (N - mu * (1 - mu**N) / (1 - mu))),
    }
    for name, (rate, momentum, s) in clocks.items():
        m = nqfjax.solve_lv(
            iso,
            jnp.full(P, 1e-8),
            jnp.asarray(N),
            rate,
            momentum=momentum,
            stepsize_controller=CTRL,
        ).ys
        exact = np.stack([_logistic(s, r[k], r[k] / b[k], 1e-8) for k in range(P)], 1)
        assert exact[-1, 0] > 0.5 * r[0] / b[0], name  # a mode switched on
        np.testing.assert_allclose(m, exact, rtol=1e-6, err_msg=name)


def test_learning_rate_and_weight_decay_have_one_home():
    """`lv_reduce(task)` and `PowerLawTask.lotka_volterra()` give the system in
    flow time, and `solve_lv(lv, m0, ts, eta, lam)` the run at learning rate
    `eta` and weight decay `lam`: each power-law mode is the logistic curve of
    rate `eta (4 lam_k m*_k - 2 lam)` (closed form). The old forms
    `lv_reduce(task, eta, lam)`, `lotka_volterra(eta, lam)` (and `eta=`) warn
    and still give the system in steps, with the same numbers; `eta=` together
    with `learning_rate=` is an error."""
    eta, lam, eps = 0.2, 0.05, 1e-6
    task = nqfjax.power_law_task(4, 1.0, 0.5)
    new = task.lotka_volterra()
    for call in (
        lambda: task.lotka_volterra(eta, lam),
        lambda: task.lotka_volterra(eta=eta, weight_decay=lam),
        lambda: nqfjax.lv_reduce(task, eta, lam)[0],
        lambda: nqfjax.lv_reduce(task, eta=eta, weight_decay=lam)[0],
    ):
        with pytest.warns(DeprecationWarning, match="solve_lv"):
            old = call()
        np.testing.assert_allclose(old.r, eta * new.r, rtol=1e-15)
        np.testing.assert_allclose(
            old.interactions.as_matrix(), eta * new.interactions.as_matrix()
        )
        assert float(old.decay) == pytest.approx(2 * eta * lam, rel=1e-15)
        assert float(new.decay) == 0.0
    ts = jnp.linspace(0.0, 400.0, NT)
    m_old = _solve(old, jnp.full(4, eps), ts)
    m_new = _solve(new, jnp.full(4, eps), ts, learning_rate=eta, weight_decay=lam)
    r_flow = 4 * np.asarray(task.lam * task.mstar) - 2 * lam
    exact = np.stack(
        [
            _logistic(np.asarray(ts), eta * r_flow[k], r_flow[k] / 4 / task.lam[k], eps)
            for k in range(4)
        ],
        1,
    )
    np.testing.assert_allclose(m_new, exact, rtol=1e-6)
    # two integrations of one flow at 1e-10 per step, in s and in t
    np.testing.assert_allclose(m_old, m_new, rtol=1e-7)
    L_old = old.loss(m_old)
    np.testing.assert_allclose(L_old, new.loss(m_old), rtol=1e-12, atol=1e-14)
    # the searched reduction: the same systems
    quad = _quadratic_commuting(np.random.default_rng(13))
    unit, _ = nqfjax.lv_reduce(quad)
    with pytest.warns(DeprecationWarning, match="eta"):
        old, _ = nqfjax.lv_reduce(quad, eta=0.1)
    np.testing.assert_allclose(old.r, 0.1 * unit.r, rtol=1e-14, atol=1e-15)
    with pytest.raises(TypeError, match="both"):
        nqfjax.lv_reduce(quad, learning_rate=0.1, eta=0.1)


@pytest.mark.slow  # ~25 s: it compiles the solve twice, old spelling and new
def test_deprecated_tolerances_same_numbers():
    """`rtol`/`atol` (deprecated) warn naming the controller to pass and give
    exactly the numbers of `lv_stepsize_controller` (a missing `rtol` is
    `atol / |log floor|` of the system's dtype, in float32 too); the default
    controller is `lv_stepsize_controller()`. Checked against the closed form."""
    r, b, eps = 0.5, 0.25, 1e-6
    for dtype, tol in ((jnp.float64, 1e-7), (jnp.float32, 1e-3)):
        lv = nqfjax.LotkaVolterra(jnp.array([r], dtype), jnp.array([[b]], dtype))
        m0, ts = jnp.array([eps], dtype), jnp.linspace(1.0, 60.0, 8, dtype=dtype)
        exact = _logistic(np.asarray(ts, np.float64), r, r / b, eps)
        default = nqfjax.solve_lv(lv, m0, ts).ys[:, 0]
        same = nqfjax.solve_lv(
            lv, m0, ts, stepsize_controller=nqfjax.lv_stepsize_controller(dtype=dtype)
        ).ys[:, 0]
        np.testing.assert_array_equal(default, same)
        np.testing.assert_allclose(default, exact, rtol=tol)
        for kw in (dict(atol=1e-4), dict(rtol=1e-3, atol=1e-4)):
            with pytest.warns(DeprecationWarning, match="lv_stepsize_controller"):
                old = nqfjax.solve_lv(lv, m0, ts, **kw).ys[:, 0]
            ctrl = nqfjax.lv_stepsize_controller(
                kw["atol"], rtol=kw.get("rtol"), dtype=dtype
            )
            new = nqfjax.solve_lv(lv, m0, ts, stepsize_controller=ctrl).ys[:, 0]
            np.testing.assert_array_equal(old, new)
            np.testing.assert_allclose(new, exact, rtol=1e-2)


# --------------------------------------------------------------------------------
# the reduction's cost: mode couplings in one pass, the violation from probes


def _standardised(X, labels, k):
    X = (X - X.mean(0)) / np.maximum(X.std(0), 1e-12)
    Y = np.eye(k)[labels]
    return X, Y - Y.mean(0)


def _whitened_perceptron(rng, n=500, d=9, k=3):
    X = rng.standard_normal((n, d))
    X -= X.mean(0)
    X = X @ np.linalg.inv(np.linalg.cholesky(X.T @ X / n)).T
    Y = X @ rng.standard_normal((k, d)).T
    return nqfjax.task_from_samples(nqfjax.Perceptron(d=d, k=k), X, Y)


def _violation(task, **kw):
    """The K part of lv_reduce's violation (the probes' estimate above
    `num_probes`), from the whole search."""
    return measure_reduction(task, early=False, **kw).k_part


def test_refused_at_the_first_step(monkeypatch):
    """Data that do not reduce are refused after one application of K (the
    first step of the basis search: K of a combination of C's eigenprojectors
    does not commute with C), before the mode couplings are computed; the error
    carries that part of the violation, the same number the whole search
    measures as its `first_step`, and no more than its full violation. An exact
    reduction's first step is at roundoff. Standardised wine (p = 16) and
    quadratic tasks rotated away from commuting, float64."""
    from sklearn.datasets import load_wine

    X, Y = _standardised(load_wine().data, load_wine().target, 3)
    tasks = [nqfjax.task_from_samples(nqfjax.Perceptron(d=13, k=3), X, Y)]
    tasks += [
        _quadratic_commuting(np.random.default_rng(5), theta=t) for t in (0.01, 0.1)
    ]
    for task in tasks:
        full = measure_reduction(task, early=False)
        assert full.first_step > 1e-3 and full.violation >= full.first_step
        with monkeypatch.context() as m:
            m.setattr(type(task), "mode_couplings", _never)
            with pytest.raises(NotReducibleError, match="first step") as info:
                nqfjax.lv_reduce(task)
        assert info.value.violation == pytest.approx(full.first_step, rel=1e-12)
    exact = measure_reduction(_whitened_perceptron(np.random.default_rng(3)))
    assert exact.violation < 1e-12 and exact.first_step < 1e-13


def _never(*args, **kwargs):
    raise AssertionError("mode_couplings called after a refusal at the first step")


def test_mode_couplings_equal_the_k_images():
    """`Task.mode_couplings(U, probes)` against the straightforward computation
    through `task.K`: D[k, l] = (U^T K[u_l u_l^T] U)[k, k] and the probes'
    K[U diag(g) U^T], float64, for a sampled perceptron (one pass through
    contract_factor and weighted_sum; Perceptron.contract_factor in closed form)
    and a Gaussian task (the default, through K), at roundoff."""
    rng = np.random.default_rng(20)
    k, d = 3, 7
    xs, ys = rng.standard_normal((300, d)), rng.standard_normal((300, k))
    structure = nqfjax.Perceptron(d=d, k=k)
    tasks = [
        nqfjax.task_from_samples(structure, xs, ys, batch_size=64),  # 4 chunks + 44
        _quadratic_commuting(rng, d=8, theta=0.3),
    ]
    # the closed form of the factored hook equals the default (through contract)
    W = jnp.asarray(rng.standard_normal((k + d, 4)))
    np.testing.assert_allclose(
        structure.contract_factor(jnp.asarray(xs[:5]), W),
        nqfjax.AbstractStructure.contract_factor(structure, jnp.asarray(xs[:5]), W),
        rtol=1e-13,
    )
    for task in tasks:
        p = task.p
        U = _orth(rng, p)[:, : p - 1]  # r < p columns are allowed
        G = rng.choice([-1.0, 1.0], size=(p - 1, 3))
        K = [np.asarray(task.K(np.outer(u, u))) for u in U.T]
        D_ref = np.stack([np.diag(U.T @ Kl @ U) for Kl in K], axis=1)
        Z_ref = np.stack([np.asarray(task.K((U * g) @ U.T)) for g in G.T])
        D, Z = task.mode_couplings(U, G)
        assert D.shape == (p - 1, p - 1) and Z.shape == (3, p, p)
        scale = np.max(np.abs(D_ref))
        np.testing.assert_allclose(D, D_ref, rtol=0, atol=1e-12 * scale)
        np.testing.assert_allclose(Z, Z_ref, rtol=0, atol=1e-12 * np.max(np.abs(Z_ref)))
        np.testing.assert_allclose(
            task.mode_couplings(U), D, rtol=0, atol=1e-14 * scale
        )
    with pytest.raises(ValueError, match="U"):
        tasks[0].mode_couplings(np.eye(3))
    with pytest.raises(ValueError, match="probes"):
        tasks[0].mode_couplings(np.eye(k + d), np.ones((3, 2)))


@pytest.mark.slow  # ~35 s under load: 15 reductions of four tasks
def test_violation_estimate_within_its_spread():
    """Above `num_probes` modes the K part of the violation is estimated from
    random sign probes; lv_reduce's docstring gives its spread as about 20%
    (measured over 20 seeds: ratios to the exact value 0.54-1.36, standard
    deviation 0.06-0.18). Against the exact value (`num_probes=p`, the K-image of
    every mode), over seeds, on three families: a perceptron on standardised
    real data (wine, p = 16; digits, p = 74, is in benchmarks/README.md), random
    quadratic tasks made non-reducible by a rotation (p = 24), and an exact
    reduction (whitened perceptron, p = 12), accepted at roundoff either way."""
    from sklearn.datasets import load_wine

    rng = np.random.default_rng(21)
    X, Y = _standardised(load_wine().data, load_wine().target, 3)
    tasks = [nqfjax.task_from_samples(nqfjax.Perceptron(d=13, k=3), X, Y)]
    for _ in range(2):
        Q = _orth(rng, 24)
        A = rng.standard_normal((24, 24))
        R = np.asarray(jax.scipy.linalg.expm(jnp.asarray(0.05 * (A - A.T) / 2)))
        S = (Q @ R) * np.linspace(1.0, 0.3, 24) @ (Q @ R).T
        M_star = Q[:, :3] * np.array([3.0, 1.0, 0.5]) @ Q[:, :3].T
        tasks.append(nqfjax.gaussian_quadratic_task(S, M_star))
    ratios = []
    for task in tasks:
        exact = _violation(task, num_probes=task.p)
        assert exact > 1e-3  # far from reducible
        for seed in range(4):
            ratios.append(_violation(task, seed=seed) / exact)
    ratios = np.array(ratios)
    assert np.all((ratios > 0.5) & (ratios < 1.5)), ratios
    assert abs(np.mean(ratios) - 1) < 0.15, ratios  # unbiased in the square
    # an exact reduction: accepted at roundoff by the estimate too
    task = _whitened_perceptron(rng)
    assert task.p > 8  # the default num_probes: the estimate is used
    assert _violation(task) < 1e-13 and _violation(task, num_probes=task.p) < 1e-13


def test_exact_reductions_above_num_probes():
    """Whitened perceptrons (sampled, p = 12; Gaussian, p = 14) go through the
    estimate (p > num_probes = 8):
    accepted at a roundoff tolerance, the same system as the exact path
    (num_probes = p) to roundoff, and lv.loss equals task.loss."""
    rng = np.random.default_rng(22)
    tasks = [
        _whitened_perceptron(rng),
        nqfjax.gaussian_perceptron_task(rng.standard_normal((4, 10))),
    ]
    for task in tasks:
        lv, U = nqfjax.lv_reduce(task, tol=1e-12)
        lv_exact, U_exact = nqfjax.lv_reduce(task, tol=1e-12, num_probes=task.p)
        np.testing.assert_array_equal(U, U_exact)  # the same basis search
        B = np.asarray(lv.interactions.as_matrix())
        np.testing.assert_allclose(
            B, lv_exact.interactions.as_matrix(), rtol=0, atol=1e-12 * np.max(B)
        )
        np.testing.assert_array_equal(lv.r, lv_exact.r)
        m = jnp.asarray(rng.uniform(0, 2, task.p))
        np.testing.assert_allclose(
            lv.loss(m), task.loss(U @ jnp.diag(m) @ U.T), rtol=1e-11
        )
    with pytest.raises(ValueError, match="num_probes"):
        nqfjax.lv_reduce(tasks[0], num_probes=0)
