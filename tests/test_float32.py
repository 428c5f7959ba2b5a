"""The float32 path users get by default, end to end, against the float64 answer.

The suite enables float64 globally (`conftest.py`) for the precision tests; here
each user-facing call runs inside `jax.enable_x64(False)`, as in a fresh
session where nobody set `jax_enable_x64`: numpy inputs become float32 arrays
and every result must come back float32. The reference is the same call in
float64 (or a closed form), and each tolerance is the measured float32 error
times a stated margin (float32 round-off is `eps = 6e-8`).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.integrate
from helpers import values

import nqfjax


def float32():
    """JAX's default precision, as a user without `jax_enable_x64` has it."""
    return jax.enable_x64(False)


@pytest.fixture(scope="module")
def whitened():
    """The README's whitened perceptron task: `n = 32` orthogonal inputs in
    `d = 6`, a linear teacher of scale 0.005, and a fixed init direction `Z`
    (numpy float64; a float32 call sees it rounded)."""
    rng = np.random.default_rng(0)
    net = nqfjax.Perceptron(d=6, k=3)
    n = 32
    xs = np.sqrt(n) * np.linalg.qr(rng.normal(size=(n, n)))[0][:, :6]
    ys = xs @ (0.005 * rng.normal(size=(3, 6))).T
    Z = rng.normal(size=(net.p, 16))
    return net, xs, ys, Z


@pytest.fixture(scope="module")
def tasks(whitened):
    """`task_from_samples` of the whitened task in float32 and float64."""
    net, xs, ys, _ = whitened
    with float32():
        task32 = nqfjax.task_from_samples(net, xs, ys)
    return task32, nqfjax.task_from_samples(net, xs, ys)


def test_train(whitened):
    net, xs, ys, Z = whitened

    def run():
        return nqfjax.train(
            net,
            xs,
            ys,
            num_steps=4000,
            learning_rate=1.0,
            W0=Z,  # the same init in both precisions (a key draws other numbers)
            init_scale=1e-3,
            num_records=40,
        )

    with float32():
        res32 = run()
    res64 = run()
    assert res32.loss.dtype == jnp.float32 and res32.M.dtype == jnp.float32
    L32, L64 = np.asarray(res32.loss, np.float64), np.asarray(res64.loss)
    # the curve covers the switch-ons: from L0 down to the tanh floor, 1e-6 L0
    assert L64[-1] < 1e-5 * L64[0]
    # Measured: <= 5e-7 relative while L > 1e-2 L0, growing to 1.2e-4 at the
    # floor, where the residuals f - y are 1e-3 of y and keep eps * |y| / |f - y|
    # = 6e-5 of their own size; the absolute error stays <= 9e-8 L0 throughout.
    # 5e-4 is a 4x margin over the worst point.
    np.testing.assert_allclose(L32, L64, rtol=5e-4)


def test_solve_lv_logistic_from_1e_30():
    # one logistic mode dm/dt = m (r - B m), m* = r / B = 0.5, from 1e-30:
    # m(t) = m* / (1 + (m*/m0 - 1) e^{-r t}); it switches on at t ~ 69
    ts = np.linspace(1.0, 120.0, 60)
    with float32():
        lv = nqfjax.LotkaVolterra(jnp.array([1.0]), B_diag=jnp.array([2.0]))
        m = values(nqfjax.solve_lv(lv, jnp.array([1e-30]), ts))
    assert m.dtype == jnp.float32
    expected = 0.5 / (1 + (0.5 / 1e-30 - 1) * np.exp(-ts[:, None]))
    assert expected[0, 0] < 1e-28 and expected[-1, 0] > 0.4999  # the whole switch
    # The float32 default is atol 1e-5 on log m, a relative error of m: measured
    # 1.3e-5 over the curve (solve_lv's docstring: 3e-5..4e-5 on its problems);
    # 1e-4 leaves a 2.5x margin over the worst of those.
    np.testing.assert_allclose(np.asarray(m, np.float64), expected, rtol=1e-4)


def test_lv_reduce_and_solve_lv(whitened, tasks):
    _, _, _, Z = whitened
    M0 = 1e-6 * (Z @ Z.T)
    ts = np.geomspace(1.0, 5000.0, 50)
    task32, task64 = tasks
    with float32():
        lv32, basis32 = nqfjax.lv_reduce(task32)
        m0 = jnp.diag(basis32.T @ M0 @ basis32)
        L32 = lv32.loss(values(nqfjax.solve_lv(lv32, m0, ts)))
    assert L32.dtype == jnp.float32

    # float64 reference: the float64 reduction integrated by scipy (Radau, log
    # space, 1e-10; it agrees with float64 solve_lv to 6e-10 of m)
    lv, basis = nqfjax.lv_reduce(task64)
    m0 = np.diag(np.asarray(basis).T @ M0 @ np.asarray(basis))
    r, B = np.asarray(lv.r), np.asarray(lv.interactions.as_matrix())
    sol = scipy.integrate.solve_ivp(
        lambda t, y: r - B @ np.exp(y),
        (0.0, ts[-1]),
        np.log(m0),
        method="Radau",
        t_eval=ts,
        rtol=1e-10,
        atol=1e-10,
        jac=lambda t, y: -B * np.exp(y)[None, :],
    )
    assert sol.success
    L64 = np.asarray(lv.loss(np.exp(sol.y.T)))
    L0 = L64[0]
    assert L64[-1] < 1e-10 * L0  # every mode switched on
    # The loss is a difference of O(L0) terms (the offset E|y|^2/2 against
    # r^T m), so float32 resolves it to an absolute error, not a relative one:
    # measured 1.5e-6 L0 (the float32 task's K and C are 1e-7 off, see below).
    # 1e-5 L0 is a 7x margin; a wrong mode or switch time is O(L0).
    np.testing.assert_allclose(np.asarray(L32, np.float64), L64, rtol=0, atol=1e-5 * L0)


def test_task_from_samples(tasks):
    task32, task64 = tasks
    X = np.random.default_rng(1).normal(size=(task64.p, task64.p))
    X = X + X.T
    with float32():
        K32 = task32.K(X)
    assert task32.C.dtype == K32.dtype == jnp.float32
    # sums of 32 float32 products: measured 1.0e-7 (K) and 6.9e-8 (C) of the
    # largest entry; 1e-6 is a 10x margin
    for got, ref in ((K32, task64.K(X)), (task32.C, task64.C)):
        scale = float(np.max(np.abs(ref)))
        np.testing.assert_allclose(
            np.asarray(got, np.float64), ref, rtol=0, atol=1e-6 * scale
        )
    np.testing.assert_allclose(float(task32.y2), float(task64.y2), rtol=1e-6)


@pytest.mark.slow  # a long physics check (the slow tier)
def test_fit_power_law():
    ts = np.geomspace(1.0, 1e6, 200)
    with float32():
        fit = nqfjax.fit_power_law(ts, 2.0 * ts**-0.66)
    assert jnp.asarray(fit.gamma).dtype == jnp.float32
    # a clean power law: the whole range is the window, and gamma is exact up to
    # the fit's convergence. With optimistix's Levenberg-Marquardt in float32 the
    # fit stops 1.2e-4 from 0.66 (measured; its step tolerances are relative, and
    # float32 round-off of log L ~ O(10) is ~1e-6); 5e-4 leaves a 4x margin and
    # is still far below any statistical error a real curve has
    assert fit.window == (1.0, 1e6)
    assert abs(float(fit.gamma) - 0.66) < 5e-4
