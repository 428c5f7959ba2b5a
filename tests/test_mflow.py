"""The M-space flow `solve_mflow` against the LV reduction, an independent
W-space gradient flow, and closed forms; its `Solution`, learning-rate schedules
and argument checks."""

import diffrax
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import nqfjax
from nqfjax._linalg import psd_sqrt


P, NT, TOL = 5, 64, 1e-10
CTRL = diffrax.PIDController(rtol=TOL, atol=TOL)  # solve_mflow's norm (RMS)
LV_CTRL = nqfjax.lv_stepsize_controller(TOL, rtol=TOL)  # solve_lv's (max)


def _orth(rng, d):
    return np.linalg.qr(rng.standard_normal((d, d)))[0]


def _quadratic(theta=0.0, seed=0):
    """Quadratic network, x ~ N(0, S), rank-2 teacher; S commutes with M* at
    theta = 0 and is rotated by theta in the teacher's plane otherwise."""
    rng = np.random.default_rng(seed)
    Q = _orth(rng, P)
    s = np.linspace(1.0, 0.3, P)
    mu = np.array([3.0, 1.0, 0.0, 0.0, 0.0])
    R = np.eye(P)
    R[:2, :2] = [[np.cos(theta), -np.sin(theta)], [np.sin(theta), np.cos(theta)]]
    S = (Q @ R) * s @ (Q @ R).T
    return nqfjax.gaussian_quadratic_task(S, Q * mu @ Q.T), Q


def _mflow(task, M0, ts, eta, lam=0.0, **kw):
    return nqfjax.solve_mflow(task, M0, ts, eta, lam, stepsize_controller=CTRL, **kw).ys


TS = jnp.concatenate([jnp.zeros(1), jnp.geomspace(0.5, 500.0, NT - 1)])


@pytest.mark.parametrize("lam, scale", [(0.0, 1e-6), (0.1, 1e-6), (0.0, 1e-20)])
def test_mflow_matches_lv_aligned(lam, scale):
    """Covariance commuting with a low-rank M*, init diagonal in the shared basis:
    solve_mflow and solve_lv give the same loss curve to 1e-3 relative wherever
    the loss is above 1e-8 of its start (with and without weight decay, and from
    a 1e-20 initialisation)."""
    task, Q = _quadratic()
    eta = 0.05
    M0 = Q * (scale * np.array([1.0, 3.0, 2.0, 1.0, 0.5])) @ Q.T
    lv, U = nqfjax.lv_reduce(task)  # both engines take eta and lam
    m0 = jnp.diag(U.T @ M0 @ U)
    m = nqfjax.solve_lv(lv, m0, TS, eta, lam, stepsize_controller=LV_CTRL).ys
    M = _mflow(task, jnp.asarray(M0), TS, eta, lam)
    L_lv, L_m = np.asarray(lv.loss(m)), np.asarray(jax.vmap(task.loss)(M))
    keep = L_lv > 1e-8 * L_lv[0]
    assert keep.sum() > NT // 2  # the comparison covers the transitions
    # the bar; both engines run at 1e-10, measured agreement ~1e-5
    np.testing.assert_allclose(L_m[keep], L_lv[keep], rtol=1e-3)
    # M stays diagonal in the basis, with the LV values on the diagonal
    Mt = np.einsum("ia,tij,jb->tab", np.asarray(U), np.asarray(M), np.asarray(U))
    diag = np.diagonal(Mt, axis1=1, axis2=2)
    np.testing.assert_allclose(
        diag[keep], np.asarray(m)[keep], rtol=1e-3, atol=1e-6 * np.max(diag)
    )


def _w_flow(task, W0, ts, eta, lam):
    """Independent engine: gradient flow on W, dW/dt = -eta (dL/dW + lam W), with
    dL/dW from autodiff of task.loss(W W^T) (explicit Tsit5, tight tolerances);
    `eta` a constant or a function of t."""

    def field(t, W, args):
        g = jax.grad(lambda W: task.loss(W @ W.T))(W)
        rate = eta(t) if callable(eta) else eta
        return -rate * (g + lam * W)

    sol = diffrax.diffeqsolve(
        diffrax.ODETerm(field),
        diffrax.Tsit5(),
        0.0,
        ts[-1],
        None,
        W0,
        saveat=diffrax.SaveAt(ts=ts),
        stepsize_controller=diffrax.PIDController(rtol=1e-10, atol=1e-14),
        max_steps=200_000,
    )
    return jnp.einsum("tim,tjm->tij", sol.ys, sol.ys)


@pytest.mark.slow  # 19 s; the suite keeps test_agreement's M-space vs W-space
# check on a task that does not reduce
def test_mflow_matches_w_space_not_reducible(getkey):
    """Covariance not commuting with M* (lv_reduce refuses) and a random
    rank-3 (width 3 < p) init: solve_mflow still matches the W-space gradient
    flow, and M stays PSD with rank 3."""
    task, _ = _quadratic(theta=0.3)
    with pytest.raises(nqfjax.NotReducibleError):
        nqfjax.lv_reduce(task)
    eta, lam = 0.05, 0.05
    W0 = 1e-3 * jax.random.normal(getkey(), (P, 3))
    ts = TS[TS <= 2000.0]
    ts = jnp.concatenate([ts, jnp.linspace(ts[-1] + 1, 3000.0, NT - len(ts))])
    M = np.asarray(_mflow(task, W0 @ W0.T, ts, eta, lam))
    M_ref = np.asarray(_w_flow(task, W0, ts, eta, lam))
    scale = np.max(np.abs(M_ref), axis=(1, 2), keepdims=True)
    # both at 1e-10 tolerances; 1e-6 relative to the largest entry of M(t)
    np.testing.assert_allclose(M / scale, M_ref / scale, atol=1e-6)
    L = np.asarray(jax.vmap(task.loss)(jnp.asarray(M)))
    assert L[-1] < 0.1 * L[0]  # it learned something: the check covers the dynamics
    eig = np.linalg.eigvalsh(M)
    assert np.all(eig[:, :2] <= 1e-12 * eig[:, -1:])  # rank 3 kept, no negative
    assert np.all(eig >= -1e-14 * eig[:, -1:])


def test_mflow_perceptron_logistic():
    """Whitened linear-teacher perceptron from an aligned init: the + modes are
    logistic, here through the M-space flow."""
    rng = np.random.default_rng(3)
    k, d, eta = 2, 3, 0.1
    a, b = _orth(rng, k), _orth(rng, d)
    sig = np.array([2.0, 0.5])
    task = nqfjax.gaussian_perceptron_task(jnp.asarray(a @ np.diag(sig) @ b[:k]))
    u = [np.concatenate([a[:, s], b[s]]) / np.sqrt(2) for s in range(2)]
    eps = np.array([1e-6, 2e-6])
    M0 = sum(e * np.outer(v, v) for e, v in zip(eps, u))
    ts = jnp.linspace(0.0, 300.0, NT)
    M = np.asarray(_mflow(task, jnp.asarray(M0), ts, eta))
    for s in range(2):
        r, mstar = 2 * eta * sig[s], 2 * sig[s]
        exact = mstar / (1 + (mstar / eps[s] - 1) * np.exp(-r * np.asarray(ts)))
        # rtol 1e-10 on an O(1) factor; entries of the small mode sit below the
        # large one by sqrt(m/m_max), so 1e-5 relative is the resolution to ask
        np.testing.assert_allclose(
            np.einsum("i,tij,j->t", u[s], M, u[s]), exact, rtol=1e-5
        )


def test_mflow_float32():
    """float32 from a 1e-8 init follows the float64 solve: relative Frobenius
    error of M(t) below 1e-3 at every time, from M ~ 1e-8 to M ~ M*. (From 1e-30
    the second mode sits below float32 resolution inside the dense factor when
    the first switches on, and roundoff seeds it early; see solve_mflow's notes.)"""
    task, Q = _quadratic()
    M0 = Q * (1e-8 * np.array([1.0, 3.0, 2.0, 1.0, 0.5])) @ Q.T
    task32 = nqfjax.gaussian_quadratic_task(
        task.covariance.astype(jnp.float32), task.M_star.astype(jnp.float32)
    )
    M32 = nqfjax.solve_mflow(task32, jnp.asarray(M0, jnp.float32), TS, 0.05).ys
    assert M32.dtype == jnp.float32
    M64 = np.asarray(_mflow(task, jnp.asarray(M0), TS, 0.05))
    err = np.linalg.norm(np.asarray(M32) - M64, axis=(1, 2))
    # default float32 tolerances (1e-5, 1e-6) on an O(1) factor: measured <1e-4
    assert np.all(err <= 1e-3 * np.linalg.norm(M64, axis=(1, 2)))
    assert np.linalg.norm(M64[-1] - np.asarray(task.M_star)) < 1e-2  # learned


def test_mflow_solution_and_failure():
    """The `Solution`: the loss along `ts` is the task's loss of `ys`, the step
    counts add up; max_steps reached gives NaN (states and loss) with
    throw=False, and an error naming max_steps with throw=True."""
    task, Q = _quadratic()
    M0 = jnp.asarray(Q * 1e-6 @ Q.T)
    tsit = diffrax.Tsit5()
    sol = nqfjax.solve_mflow(task, M0, TS, 0.05, solver=tsit)
    assert bool(sol.succeeded) and sol.ys.shape == (NT, P, P)
    np.testing.assert_array_equal(sol.ts, TS)
    np.testing.assert_allclose(sol.loss, jax.vmap(task.loss)(sol.ys), rtol=1e-14)
    st = sol.stats
    assert int(st["num_steps"]) == int(st["num_accepted_steps"]) + int(
        st["num_rejected_steps"]
    )
    bad = nqfjax.solve_mflow(task, M0, TS, 0.05, max_steps=4, throw=False, solver=tsit)
    assert np.all(np.isnan(np.asarray(bad.ys))) and np.all(np.isnan(bad.loss))
    assert not bool(bad.succeeded) and int(bad.stats["num_steps"]) == 4
    with pytest.raises(RuntimeError, match="max_steps` = 4"):
        nqfjax.solve_mflow(task, M0, TS, 0.05, max_steps=4, solver=tsit)


@pytest.mark.slow  # a long physics check (the slow tier)
def test_mflow_schedule_matches_w_space():
    """A learning-rate schedule (optax exponential decay) on the continuous
    clock: the flow with eta(t) in W-space (an independent engine, the rate in
    the vector field) against `solve_mflow(..., schedule, discrete=False)`, which
    integrates once at unit rate on s(t); and a constant schedule (the clock
    path) equals the constant rate (the rate in the field)."""
    task, _ = _quadratic(theta=0.3)
    W0 = 1e-3 * jax.random.normal(jax.random.key(3), (P, 3))
    sched = optax.exponential_decay(0.1, 400.0, 0.5)  # smooth in t
    ts = jnp.linspace(0.0, 3000.0, NT)
    tsit = dict(solver=diffrax.Tsit5(), stepsize_controller=CTRL)
    M = np.asarray(
        nqfjax.solve_mflow(task, W0 @ W0.T, ts, sched, discrete=False, **tsit).ys
    )
    M_ref = np.asarray(_w_flow(task, W0, ts, sched, 0.0))
    scale = np.max(np.abs(M_ref), axis=(1, 2), keepdims=True)
    L = np.asarray(jax.vmap(task.loss)(jnp.asarray(M)))
    assert L[-1] < 0.1 * L[0]  # the decaying rate still learns
    # both at 1e-10 tolerances; the clock's quadrature is exact to roundoff here
    np.testing.assert_allclose(M / scale, M_ref / scale, atol=1e-6)
    const = nqfjax.solve_mflow(
        task, W0 @ W0.T, ts, optax.constant_schedule(0.05), **tsit
    )
    np.testing.assert_allclose(
        const.ys,
        nqfjax.solve_mflow(task, W0 @ W0.T, ts, 0.05, **tsit).ys,
        rtol=1e-6,
        atol=1e-8 * float(np.max(np.abs(np.asarray(const.ys)))),
    )


def test_psd_sqrt_derivative_degenerate():
    """The square root of M0 has a finite derivative at degenerate eigenvalues
    (M0 = sigma^2 I gives d sqrt / d sigma = I), matching finite differences."""
    rng = np.random.default_rng(5)
    Q = _orth(rng, 4)
    base = Q * np.array([2.0, 2.0, 1.0, 0.0]) @ Q.T  # degenerate and singular

    def f(sig):
        return psd_sqrt(sig**2 * jnp.asarray(base))

    d = jax.jacfwd(f)(1.3)
    exact = Q * np.sqrt([2.0, 2.0, 1.0, 0.0]) @ Q.T
    np.testing.assert_allclose(d, exact, atol=1e-12)
    g = jax.grad(lambda s: jnp.sum(f(s) ** 2))(1.3)  # = d/ds s^2 Tr base
    np.testing.assert_allclose(g, 2 * 1.3 * np.trace(base), rtol=1e-12)


def test_mflow_bad_input():
    task, Q = _quadratic()
    good = jnp.asarray(Q * 1e-6 @ Q.T)
    with pytest.raises(ValueError, match="M0"):
        nqfjax.solve_mflow(task, jnp.diag(jnp.array([1.0, -1.0, 1, 1, 1])), TS, 0.1)
    with pytest.raises(ValueError, match="M0"):
        nqfjax.solve_mflow(task, good + jnp.triu(jnp.ones((P, P)), 1), TS, 0.1)
    with pytest.raises(ValueError, match="M0"):
        nqfjax.solve_mflow(task, jnp.eye(P + 1), TS, 0.1)  # mismatched p
    with pytest.raises(ValueError, match="M0"):
        nqfjax.solve_mflow(task, good.at[0, 0].set(jnp.nan), TS, 0.1)
    with pytest.raises(ValueError, match="M0"):
        nqfjax.solve_mflow(task, jnp.zeros((P, P)), TS, 0.1)
    with pytest.raises(ValueError, match="ts"):
        nqfjax.solve_mflow(task, good, TS[::-1], 0.1)
    with pytest.raises(ValueError, match="at least one time"):
        nqfjax.solve_mflow(task, good, [], 0.1)
    for bad in (0.0, jnp.nan, -0.1, jnp.ones(2)):
        with pytest.raises(ValueError, match="learning_rate"):
            nqfjax.solve_mflow(task, good, TS, bad)
    with pytest.raises(ValueError, match="weight_decay"):
        nqfjax.solve_mflow(task, good, TS, 0.1, -1.0)
    with pytest.raises(ValueError, match="Task"):
        nqfjax.solve_mflow(np.eye(P), good, TS, 0.1)
    for kw, name in [
        (dict(rtol=-1.0), "rtol"),
        (dict(atol=-1.0), "atol"),
        (dict(rtol=np.inf), "rtol"),
        (dict(atol=np.nan), "atol"),
    ]:
        control = diffrax.PIDController(**{"rtol": 1e-6, "atol": 1e-6, **kw})
        with pytest.raises(ValueError, match=name):
            nqfjax.solve_mflow(task, good, TS, 0.1, stepsize_controller=control)
    for kw, name in [
        (dict(max_steps=0), "max_steps"),
        (dict(max_steps=-1), "max_steps"),
        (dict(solver=diffrax.ConstantStepSize()), "solver"),
        (dict(adjoint=diffrax.Tsit5()), "adjoint"),
        (dict(stepsize_controller=diffrax.Tsit5()), "stepsize_controller"),
    ]:
        with pytest.raises(ValueError, match=name):
            nqfjax.solve_mflow(task, good, TS, 0.1, **kw)
    # traced values are checked when the solve runs (Tsit5: a cheap compile)
    # (M0 passed in: symmetric_psd cannot check a closed-over M0 under jit)
    f = jax.jit(
        lambda M0, eta, rtol: (
            nqfjax.solve_mflow(
                task,
                M0,
                TS,
                eta,
                stepsize_controller=diffrax.PIDController(rtol=rtol, atol=1e-6),
                solver=diffrax.Tsit5(),
            ).ys
        )
    )
    with pytest.raises(RuntimeError, match="rtol"):
        f(good, 0.1, -1.0)
    with pytest.raises(RuntimeError, match="learning_rate"):
        f(good, -0.1, 1e-6)
    # a float64 `ts` whose times merge in the float32 task's precision
    task32 = nqfjax.gaussian_quadratic_task(
        task.covariance.astype(jnp.float32), task.M_star.astype(jnp.float32)
    )
    with pytest.raises(ValueError, match="once cast to the system's float32"):
        nqfjax.solve_mflow(
            task32, good.astype(jnp.float32), jnp.asarray([0.0, 1e8, 1e8 + 1.0]), 0.1
        )


def test_mflow_eta_keyword_deprecated():
    """`eta=` (the old name of `learning_rate`) works for one release with a
    DeprecationWarning and the same numbers."""
    task, Q = _quadratic()
    M0 = jnp.asarray(Q * 1e-6 @ Q.T)
    with pytest.warns(DeprecationWarning, match="eta"):
        old = nqfjax.solve_mflow(task, M0, TS[:3], eta=0.05, solver=diffrax.Tsit5())
    np.testing.assert_array_equal(
        old.ys, nqfjax.solve_mflow(task, M0, TS[:3], 0.05, solver=diffrax.Tsit5()).ys
    )


@pytest.mark.slow  # ~25 s: it compiles the solve twice, old spelling and new
def test_deprecated_tolerances_same_numbers():
    """`rtol`/`atol` (deprecated) warn naming `diffrax.PIDController` and give
    exactly the numbers of that controller (a missing one at its default); the
    default is `PIDController(1e-9, 1e-9)` in float64. Checked against the
    W-space flow, integrated independently."""
    task, _ = _quadratic(theta=0.3)
    W0 = 1e-3 * jax.random.normal(jax.random.key(5), (P, 3))
    M0, ts, tsit = W0 @ W0.T, jnp.linspace(0.0, 200.0, 8), diffrax.Tsit5()
    ref = np.asarray(_w_flow(task, W0, ts, 0.05, 0.0))
    default = nqfjax.solve_mflow(task, M0, ts, 0.05, solver=tsit).ys
    same = nqfjax.solve_mflow(
        task,
        M0,
        ts,
        0.05,
        solver=tsit,
        stepsize_controller=diffrax.PIDController(rtol=1e-9, atol=1e-9),
    ).ys
    np.testing.assert_array_equal(default, same)
    np.testing.assert_allclose(default, ref, rtol=1e-5, atol=1e-8 * np.max(ref))
    for kw in (dict(rtol=1e-6), dict(rtol=1e-6, atol=1e-7)):
        with pytest.warns(DeprecationWarning, match="PIDController"):
            old = nqfjax.solve_mflow(task, M0, ts, 0.05, solver=tsit, **kw).ys
        control = diffrax.PIDController(**{"atol": 1e-9, **kw})
        new = nqfjax.solve_mflow(
            task, M0, ts, 0.05, solver=tsit, stepsize_controller=control
        ).ys
        np.testing.assert_array_equal(old, new)
        np.testing.assert_allclose(new, ref, rtol=1e-3, atol=1e-6 * np.max(ref))
