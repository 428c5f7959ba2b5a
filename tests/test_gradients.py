"""Hyperparameter gradients through the engines, against central finite differences.

Each engine is wrapped in one jitted function of all its hyperparameters (log
sigma, learning rate, weight decay, the power-law task's `alpha` and `beta`, and
for `solve_lv` the system's own `r` and `B`) that returns a loss curve;
`jax.jacrev` of that curve (reverse mode; through diffrax with
`RecursiveCheckpointAdjoint`) gives the derivative of the loss at every recorded
time at once (the loss at a time, and any weighted whole-curve objective as a
linear combination), compared with `(f(x + h) - f(x - h)) / 2h` of the same jitted
function. Array hyperparameters (`r`, `B`) are checked along random directions.

Tolerances: solves run at rtol = atol = 1e-11 in float64. The finite difference
then carries a truncation error ~h^2 f''' / 6 (h = 1e-5 relative: ~1e-10) and a
solver-noise error ~1e-11 / h ~ 1e-6 relative at worst (the adaptive step sequence
differs between x + h and x - h); measured agreement is 1e-11 to 2e-7, so the
bound 1e-5 (tighter than the issue's 1e-4) keeps a margin of 50. Plain GD (`train`)
has no adaptive steps: 1e-6 there.
"""

import diffrax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.linalg

import nqfjax


# rtol = atol = 1e-11, each engine in its own norm
TOL = dict(stepsize_controller=nqfjax.lv_stepsize_controller(1e-11, rtol=1e-11))
TOL_MFLOW = dict(stepsize_controller=diffrax.PIDController(rtol=1e-11, atol=1e-11))


def _fd(f, args, i, direction, h):
    """Central difference of `f(*args)` along `direction` in argument `i`."""
    plus = list(args)
    minus = list(args)
    plus[i] = args[i] + h * direction
    minus[i] = args[i] - h * direction
    return (np.asarray(f(*plus)) - np.asarray(f(*minus))) / (2 * h)


def _check_all(f, args, key, *, rtol=1e-5):
    """Compare `jax.jacrev(f)` with central differences for every argument."""
    jac = jax.jacrev(f, argnums=tuple(range(len(args))))(*args)
    scale = np.max(np.abs(np.asarray(f(*args))))
    for i, (arg, J) in enumerate(zip(args, jac)):
        arg = jnp.asarray(arg)
        key, sub = jax.random.split(key)
        v = jax.random.normal(sub, arg.shape, arg.dtype)
        if arg.ndim == 2:
            v = 0.5 * (v + v.T)  # symmetric perturbations keep B symmetric
        v = v / jnp.linalg.norm(v)
        h = 1e-5 * max(1.0, float(jnp.max(jnp.abs(arg))))
        fd = _fd(f, args, i, v, h)
        ad = np.tensordot(np.asarray(J), np.asarray(v), axes=arg.ndim)
        # The derivative must be nonzero for the comparison to mean anything.
        assert np.max(np.abs(ad)) > 1e-6 * scale, f"argument {i}: zero gradient"
        np.testing.assert_allclose(
            ad, fd, rtol=rtol, atol=rtol * np.max(np.abs(fd)), err_msg=f"argument {i}"
        )


# --------------------------------------------------------------------------------
# solve_lv


B_INTERACT = jnp.array([[0.0, 0.3, 0.1], [0.3, 0.0, 0.2], [0.1, 0.2, 0.0]])


@jax.jit
def _lv_curve(log_sigma, eta, weight_decay, alpha, beta, r, B):
    """`power_law_task(3, alpha, beta)` reduced (in flow time), with `r` and `B`
    added to its rates and interactions (so the modes interact and the
    derivatives with respect to `r` and `B` are the LV system's own), solved at
    learning rate `eta` and weight decay `weight_decay`; the loss at four times
    (in steps) from `m0 = sigma^2 c`."""
    base = nqfjax.power_law_task(3, alpha, beta).lotka_volterra()
    lv = nqfjax.LotkaVolterra(
        base.r + r,
        base.interactions.as_matrix() + B,
        loss_scale=base.loss_scale,
        loss_offset=base.loss_offset,
    )
    m0 = jnp.exp(2 * log_sigma) * jnp.array([1.0, 2.0, 3.0])
    ts = jnp.array([20.0, 40.0, 80.0, 160.0])
    return nqfjax.solve_lv(
        lv, m0, ts, eta, weight_decay, solver=diffrax.Tsit5(), **TOL
    ).loss


@pytest.mark.slow  # a long physics check (the slow tier)
def test_solve_lv_gradients(getkey):
    # log sigma, learning rate, weight decay, (alpha, beta) of the task, r, B
    args = tuple(jnp.asarray(x) for x in (-3.0, 0.1, 0.01, 1.2, 0.6))
    args += (jnp.zeros(3), 0.05 * B_INTERACT)
    _check_all(_lv_curve, args, getkey())


def _switch_times(lv, m0, t_guess):
    """When each mode reaches half its isolated equilibrium, measured on the
    `solve_lv` solution (one solve per mode, vmapped) and differentiable: Newton
    steps on `g_k(t) = log m_k(t) - log(m*_k / 2)`, all but the last with the
    gradient stopped, so the derivative is the implicit-function one,
    `dt/dx = -(dg/dx) / (dg/dt)` at `g = 0`. Forward mode (`diffrax.ForwardMode`,
    used with `jax.jacfwd`): one hyperparameter, several outputs."""
    target = jnp.log(lv.fixed_point_isolated() / 2)
    idx = jnp.arange(lv.p)

    def solve_at(t):
        return nqfjax.solve_lv(
            lv,
            m0,
            t[None],
            solver=diffrax.Tsit5(),
            adjoint=diffrax.ForwardMode(),
            **TOL,
        ).ys[0]

    def newton(t):
        m = jax.vmap(solve_at)(t)  # (p modes, p): row k is m(t_k)
        g = jnp.log(m[idx, idx]) - target
        dgdt = (
            lv.r - jnp.sum(lv.interactions.as_matrix() * m, axis=1) - lv.decay
        )  # d log m_k/dt at t_k
        return t - g / dgdt

    t = jax.lax.fori_loop(0, 6, lambda _, t: jax.lax.stop_gradient(newton(t)), t_guess)
    return newton(t)


@pytest.mark.slow  # a long physics check (the slow tier)
def test_switch_on_time_gradient_is_minus_two_over_r():
    # Independent modes: t_k = ln(m*_k/eps_k - 1)/r_k with eps_k = sigma^2 c_k, so
    # dt_k / d log sigma = -(2 / r_k) m*_k / (m*_k - eps_k) = -2/r_k (1 + O(eps)).
    r = jnp.array([1.0, 0.5, 0.2])
    lv = nqfjax.LotkaVolterra(r, jnp.diag(jnp.array([1.0, 2.0, 0.5])))
    c = jnp.array([1.0, 3.0, 0.5])
    mstar = np.asarray(lv.fixed_point_isolated())

    @jax.jit
    def times(log_sigma):
        m0 = jnp.exp(2 * log_sigma) * c
        # start 20% early; Newton on the solution does the measuring
        return _switch_times(lv, m0, 0.8 * jnp.log(mstar / m0) / r)

    log_sigma = jnp.asarray(-6.0)
    t = times(log_sigma)
    grad = jax.jit(jax.jacfwd(times))(log_sigma)
    # the measured times equal the logistic closed form (solver tolerance 1e-11)
    eps = np.exp(2 * -6.0) * np.asarray(c)
    np.testing.assert_allclose(t, np.log(mstar / eps - 1) / np.asarray(r), rtol=1e-8)
    # ... and their gradient is -2/r_k: exactly with the O(eps / m*) ~ 1e-5
    # correction (to the solver tolerance), and to 1e-4 without it.
    exact = -2 / np.asarray(r) * mstar / (mstar - eps)
    np.testing.assert_allclose(grad, exact, rtol=1e-7)
    np.testing.assert_allclose(grad, -2 / np.asarray(r), rtol=1e-4)


# --------------------------------------------------------------------------------
# solve_mflow


W0 = jax.random.normal(jax.random.key(42), (3, 4))


@jax.jit
def _mflow_curve(log_sigma, eta, weight_decay, alpha, beta):
    task = nqfjax.power_law_task(3, alpha, beta)
    M0 = jnp.exp(2 * log_sigma) * W0 @ W0.T
    ts = jnp.array([10.0, 20.0, 40.0, 80.0])
    return nqfjax.solve_mflow(
        task, M0, ts, eta, weight_decay, solver=diffrax.Tsit5(), **TOL_MFLOW
    ).loss


@pytest.mark.slow  # a long physics check (the slow tier)
def test_solve_mflow_gradients(getkey):
    args = tuple(jnp.asarray(x) for x in (-3.0, 0.1, 0.01, 1.2, 0.6))
    _check_all(_mflow_curve, args, getkey())


# --------------------------------------------------------------------------------
# train (W-space, the real tanh layer)


def _diagonal_data(alpha, beta, d=4):
    """`n = 8` inputs whose empirical covariance is exactly `diag(k^-alpha)` (columns
    of a Hadamard matrix), and the diagonal teacher `y_k = k^-beta x_k`: a
    perceptron task with independent modes and power-law spectra."""
    k = jnp.arange(1.0, d + 1)
    xs = jnp.asarray(scipy.linalg.hadamard(8)[:, :d], float) * k[None, :] ** (
        -alpha / 2
    )
    return xs, xs * k[None, :] ** -beta


@jax.jit
def _train_curve(log_sigma, eta, weight_decay, alpha, beta):
    xs, ys = _diagonal_data(alpha, beta)
    result = nqfjax.train(
        nqfjax.Perceptron(d=4, k=4),
        xs,
        ys,
        num_steps=400,
        learning_rate=eta,
        key=jax.random.key(0),
        init_scale=jnp.exp(log_sigma),
        width=4,
        weight_decay=weight_decay,
        record_at=(50, 100, 200, 400),
        snapshots=False,
    )
    return result.loss


@pytest.mark.slow  # a long physics check (the slow tier)
def test_train_gradients(getkey):
    # Plain GD is a fixed sequence of smooth maps (no adaptive steps), so the
    # finite difference is limited by truncation (~1e-10) and round-off only.
    args = tuple(jnp.asarray(x) for x in (-3.0, 0.05, 0.01, 1.2, 0.6))
    _check_all(_train_curve, args, getkey(), rtol=1e-6)
