"""The moment equation of minibatch SGD (`sgd_moments`) against Wick's theorem
(Monte Carlo), the exact full-batch map, finite differences, and real W-space
SGD training of the quadratic network over a grid of learning rates and batch
sizes, including the divergence boundary; the typical run's divergence boundary
(`sgd_divergence_boundary`) against the boundary crisis of the one-mode map and
the learning rate at which half of the seeds of real SGD diverge."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nqfjax
from nqfjax.engines.sgd_moments import _gaussian_moments, _sample_moments


D = 4
S = np.array([1.0, 0.6, 0.35, 0.2])  # distinct: the modes switch on in turn
MU = np.ones(D)
SIGMA2 = 0.05  # label noise: the minibatch noise floor does not vanish
M0 = np.full(D, 0.01)
T = 300


def _task():
    return nqfjax.gaussian_quadratic_task(np.diag(S), np.diag(MU))


@pytest.fixture(scope="module")
def data():
    """1024 samples: 64 Gaussian draws, each with all 2^4 sign patterns, so that
    every odd moment of the empirical distribution vanishes exactly (its
    `K` is diagonal, as the moment equation assumes) while its even moments
    are the draws'."""
    k1, k2 = jax.random.split(jax.random.key(1))
    base = np.asarray(jax.random.normal(k1, (64, D))) * np.sqrt(S)
    signs = np.array(list(itertools.product([1.0, -1.0], repeat=D)))
    xs = (base[:, None, :] * signs[None]).reshape(-1, D)
    # one noise draw per base sample, shared by its sign copies (so that y is
    # even in every x_k, like the teacher)
    noise = np.sqrt(SIGMA2) * np.asarray(jax.random.normal(k2, (64, 1)))
    noise = np.broadcast_to(noise, (64, len(signs))).reshape(-1)
    ys = (xs**2 @ MU + noise)[:, None]
    return jnp.asarray(xs), jnp.asarray(ys)


def _predict(xs_ys, eta, b, steps=T):
    return nqfjax.sgd_moments(
        _task(),
        jnp.full(steps, eta),
        jnp.full(steps, float(b)),
        M0,
        samples=xs_ys,
    )


def _train(xs_ys, eta, b, keys, steps=T, record_at=None):
    xs, ys = xs_ys
    W0 = jnp.diag(jnp.sqrt(jnp.asarray(M0)))
    record = list(range(0, steps + 1, 10)) if record_at is None else record_at

    def one(key, eta):
        return nqfjax.train(
            nqfjax.QuadraticNet(D),
            xs,
            ys,
            num_steps=steps,
            learning_rate=eta,
            W0=W0,
            batch_size=b,
            key=key,
            record_at=record,
            snapshots=False,
        )

    return jax.vmap(one, in_axes=(0, None))(keys, eta)


def test_wick_moments_match_monte_carlo():
    # the closed-form Gaussian moments (Wick) against 200k samples: the worst
    # estimate, E[x^8], has a relative standard error sqrt(E x^16 / 105^2 - 1)
    # / sqrt(n) = 3.0%, so 10% is more than 3 standard errors
    n = 200_000
    k1, k2 = jax.random.split(jax.random.key(3))
    xs = jax.random.normal(k1, (n, D)) * np.sqrt(S)[None]
    ys = xs**2 @ MU + np.sqrt(SIGMA2) * jax.random.normal(k2, (n,))
    exact = _gaussian_moments(S, MU, SIGMA2, jnp.float64)
    sampled = _sample_moments(xs, ys, jnp.float64)
    for name in ("F4", "F8", "cy", "Y6", "Y8", "y2"):
        a, b = getattr(exact, name), getattr(sampled, name)
        np.testing.assert_allclose(b, a, rtol=0.10, err_msg=name)


def test_full_batch_is_gradient_descent_exactly(data):
    # b = n: no noise, and on sign-symmetric data M stays diagonal, so the
    # moment map is the exact gradient-descent map of the modes,
    # m <- (1 - 2 eta g)^2 m; agreement to rounding
    xs, ys = data
    n = xs.shape[0]
    eta = 0.05
    pred = _predict(data, eta, n)
    real = _train(data, eta, None, jax.random.split(jax.random.key(0), 1))
    steps = np.arange(0, T + 1, 10)
    np.testing.assert_allclose(real.loss[0], pred.loss[steps], rtol=1e-9)
    assert float(pred.fluctuation[-1]) == 0.0


def test_gaussian_task_full_batch_growth_is_discrete():
    # the first steps from a tiny start: mode k grows by (1 + r_k/2)^2 per
    # step, r_k = 4 eta C_kk (the discrete map, not e^(r_k))
    eta, m0 = 0.05, np.full(D, 1e-8)
    pred = nqfjax.sgd_moments(_task(), jnp.full(3, eta), jnp.full(3, 1e9), m0)
    Ckk = (2 * S**2 + S * (S @ MU)) * MU  # diag of C = K[M*]
    order = np.argsort(S + 0.6180339887)  # the basis sgd_moments chose
    r = 4 * eta * Ckk[order]
    np.testing.assert_allclose(pred.m[1] / pred.m[0], (1 + r / 2) ** 2, rtol=1e-6)


@pytest.mark.slow  # W-space SGD over 32 seeds on a 3 x 3 grid
def test_mean_loss_matches_sgd_over_grid(data):
    # 3 learning rates x 3 batch sizes, 32 seeds: the mean full-data loss of
    # real W-space SGD against the prediction, in log loss at every 10th step.
    # 10% is the tolerance; measured worst 0.07 (the closure at
    # b = 16, the statistical error of 32 seeds is about 0.02)
    keys = jax.random.split(jax.random.key(7), 32)
    worst = 0.0
    for b in (16, 32, 64):
        for eta in (0.01, 0.02, 0.04):
            real = _train(data, eta, b, keys)
            assert not np.any(real.diverged)
            pred = _predict(data, eta, b)
            measured = np.mean(np.asarray(real.loss), axis=0)
            predicted = np.asarray(pred.loss)[::10]
            err = np.max(np.abs(np.log(predicted) - np.log(measured)))
            worst = max(worst, err)
            assert err < 0.10, (b, eta, err)
    assert worst > 0.0


def _largest_stable(diverges, lo, hi, iters=7):
    """Bisection in log learning rate between a stable `lo` and a diverging
    `hi`: the boundary to a factor (hi/lo)^(2^-iters)."""
    assert not diverges(lo) and diverges(hi)
    for _ in range(iters):
        mid = np.sqrt(lo * hi)
        lo, hi = (lo, mid) if diverges(mid) else (mid, hi)
    return np.sqrt(lo * hi)


def test_divergence_boundary_full_batch(data):
    # gradient descent: the largest stable learning rate of the prediction and
    # of real training agree within 20% (issue's tolerance; measured ~1%)
    n = data[0].shape[0]
    key = jax.random.split(jax.random.key(0), 1)

    def real(eta):
        res = _train(data, eta, None, key, record_at=[0, T])
        return bool(res.diverged[0])

    def model(eta):
        return bool(_predict(data, eta, n).diverged)

    measured = _largest_stable(real, 0.05, 0.5)
    predicted = _largest_stable(model, 0.05, 0.5)
    assert abs(predicted / measured - 1) < 0.2, (predicted, measured)
    # the typical-run model at b = n is gradient descent on the modes: the same
    # boundary (measured 0.2383), to the bisection's resolution 10^(1/128) = 1.8%
    typical = nqfjax.sgd_divergence_boundary(
        _task(), float(n), M0, num_steps=T, samples=data, paths=1
    )
    assert abs(float(typical) / measured - 1) < 0.02, (typical, measured)
    # not the linear stability of the minimum: the orbit stays bounded (period 2,
    # then chaotic) up to 1.5 times that learning rate here
    q = np.asarray(data[0]) ** 2
    F4 = q.T @ q / n
    m_hat = np.linalg.solve(F4, q.T @ np.asarray(data[1])[:, 0] / n)
    flip = 1 / (2 * np.linalg.eigvalsh(np.sqrt(np.outer(m_hat, m_hat)) * F4)[-1])
    assert measured > 1.4 * flip, (measured, flip)


def test_typical_boundary_one_mode_is_the_boundary_crisis():
    # one mode, full batch: u <- (1 - c (u - 1))^2 u with u = m / mu and
    # c = 2 eta lambda, lambda = 3 s^2 mu. The minimum turns unstable at c = 1,
    # but the orbit stays bounded until its peak 4 (1 + c)^3 / (27 c) reaches the
    # far fixed point 1 + 2 / c, at c = 2 (boundary crisis): eta = 1 / lambda.
    # From m0 = 0.01 the chaotic orbit finds the gap within 300 steps to 1e-4
    # (measured 4e-5 in float64); the tolerance 1e-3 is far below the factor 2
    # to the flip, and holds in float32 too (the path users get by default)
    s, mu = 0.7, 1.3
    lam = 3 * s**2 * mu
    kw = dict(num_steps=T, num_samples=100, paths=1, iterations=24)
    for x64 in (True, False):
        with jax.enable_x64(x64):
            task = nqfjax.gaussian_quadratic_task(np.diag([s]), np.diag([mu]))
            m0 = jnp.asarray([0.01])
            bounds = (0.1 / lam, 2 / lam)
            eta = nqfjax.sgd_divergence_boundary(
                task, 100.0, m0, learning_rate_bounds=bounds, **kw
            )
            assert eta.dtype == (jnp.float64 if x64 else jnp.float32)
            np.testing.assert_allclose(float(eta), 1 / lam, rtol=1e-3)
            # a bracket below the boundary (the same compiled program)
            with pytest.raises(Exception, match="learning_rate_bounds"):
                nqfjax.sgd_divergence_boundary(
                    task, 100.0, m0, learning_rate_bounds=(0.1 / lam, 0.2 / lam), **kw
                ).block_until_ready()


@pytest.mark.slow  # a long physics check (the slow tier)
def test_typical_boundary_matches_sgd_half_of_seeds(data):
    # the measured boundary: the learning rate at which half of 128 seeds of
    # W-space SGD diverge within T = 300 steps (bisection in log eta between
    # 0.03 and 0.3, 9 steps: resolution 10^(2^-9) = 0.5%). Its statistical
    # resolution: the diverged fraction rises by ~0.45 over +-5% in eta, so
    # the seeds' error 0.5 / sqrt(128) = 0.044 is ~1% in eta. The model's own
    # error (512 paths) is ~0.3%. Issue's tolerance 20%; measured: the model
    # is optimistic by 12% (b = 8), 10% (16), 4% (64); also 18% (4), 7% (32),
    # 1% (128), 0% (256). The mean-loss closure's boundary is 31-42% low.
    keys = jax.random.split(jax.random.key(5), 128)

    def fraction(eta, b):
        res = _train(data, eta, b, keys, record_at=[0, T])
        return float(np.mean(np.asarray(res.diverged)))

    for b in (8, 16, 64):
        lo, hi = 0.03, 0.3
        for _ in range(9):
            mid = np.sqrt(lo * hi)
            lo, hi = (lo, mid) if fraction(mid, b) >= 0.5 else (mid, hi)
        measured = np.sqrt(lo * hi)
        predicted = nqfjax.sgd_divergence_boundary(
            _task(), float(b), M0, num_steps=T, samples=data, iterations=12
        )
        assert abs(float(predicted) / measured - 1) < 0.2, (b, predicted, measured)
        # the moment closure (mean loss) is the pessimistic one at these b
        assert _predict(data, 0.95 * measured, b).diverged, b


def test_typical_boundary_bad_input(data):
    task = _task()
    with pytest.raises(ValueError, match="batch_size"):
        nqfjax.sgd_divergence_boundary(task, 0.5, M0, num_steps=10)
    with pytest.raises(ValueError, match="batch_size"):
        nqfjax.sgd_divergence_boundary(task, 2000.0, M0, num_steps=10, samples=data)
    with pytest.raises(ValueError, match="m0"):
        nqfjax.sgd_divergence_boundary(task, 4.0, np.ones(3), num_steps=10)
    with pytest.raises(ValueError, match="num_steps"):
        nqfjax.sgd_divergence_boundary(task, 4.0, M0, num_steps=10.0)
    with pytest.raises(ValueError, match="task"):
        nqfjax.sgd_divergence_boundary(
            nqfjax.power_law_task(4, 1.0, 0.5), 4.0, M0, num_steps=10
        )


def test_gradient_wrt_schedule_matches_finite_differences():
    # d(final loss)/d(eta_t, b_t) through the scan, against central differences
    steps = T
    task = _task()
    eta = jnp.linspace(0.05, 0.02, steps)
    b = jnp.linspace(4.0, 32.0, steps)

    def final(eta, b):
        out = nqfjax.sgd_moments(task, eta, b, M0, noise_variance=SIGMA2)
        return out.final_loss

    g_eta, g_b = jax.grad(final, argnums=(0, 1))(eta, b)
    for t in (0, 17, T - 1):
        h = 1e-6
        e = jnp.zeros(steps).at[t].set(h)
        fd_eta = (final(eta + e, b) - final(eta - e, b)) / (2 * h)
        fd_b = (final(eta, b + e * 1e3) - final(eta, b - e * 1e3)) / (2e3 * h)
        np.testing.assert_allclose(g_eta[t], fd_eta, rtol=1e-5)
        np.testing.assert_allclose(g_b[t], fd_b, rtol=1e-5)


def test_float32_matches_float64():
    # the float32 path a user gets by default, against float64: the recursion
    # is contractive after the switch-ons, so rounding stays ~1e-6 relative
    with jax.enable_x64(False):
        out32 = nqfjax.sgd_moments(
            _task(),
            jnp.full(T, 0.03, jnp.float32),
            jnp.full(T, 16.0, jnp.float32),
            jnp.asarray(M0, jnp.float32),
            noise_variance=SIGMA2,
        )
        assert out32.loss.dtype == jnp.float32
        loss32 = np.asarray(out32.loss)
    out64 = nqfjax.sgd_moments(
        _task(), jnp.full(T, 0.03), jnp.full(T, 16.0), M0, noise_variance=SIGMA2
    )
    np.testing.assert_allclose(loss32, out64.loss, rtol=1e-4)


def test_bad_input():
    task = _task()
    good = dict(learning_rates=jnp.full(T, 0.01), batch_sizes=jnp.full(T, 4.0))
    with pytest.raises(ValueError, match="learning_rates"):
        nqfjax.sgd_moments(task, jnp.full(T, -0.01), good["batch_sizes"], M0)
    with pytest.raises(ValueError, match="batch_sizes"):
        nqfjax.sgd_moments(task, good["learning_rates"], jnp.full(T, 0.5), M0)
    with pytest.raises(ValueError, match="batch_sizes"):
        nqfjax.sgd_moments(task, good["learning_rates"], jnp.full(4, 4.0), M0)
    with pytest.raises(ValueError, match="m0"):
        nqfjax.sgd_moments(task, **good, m0=np.zeros(D))
    with pytest.raises(ValueError, match="noise_variance"):
        nqfjax.sgd_moments(task, **good, m0=M0, noise_variance=-1.0)
    with pytest.raises(ValueError, match="commute"):
        S2 = np.array([[1.0, 0.3], [0.3, 1.0]])
        nqfjax.sgd_moments(
            nqfjax.gaussian_quadratic_task(S2, np.diag([1.0, 0.5])),
            jnp.full(2, 0.01),
            jnp.full(2, 2.0),
            np.ones(2),
        )
    with pytest.raises(ValueError, match="task"):
        nqfjax.sgd_moments(nqfjax.power_law_task(4, 1.0, 0.5), **good, m0=M0)
    # under jit the value checks are runtime errors
    f = jax.jit(lambda e: nqfjax.sgd_moments(task, e, good["batch_sizes"], M0).loss)
    with pytest.raises(Exception, match="learning_rates"):
        f(jnp.full(T, -0.01)).block_until_ready()


def test_diagonal_loss_is_the_expanded_form():
    # (m - m*)^T F4 (m - m*) / 2 + floor equals (m^T F4 m - 2 cy.m + y2) / 2
    # (float64, away from the minimum, where the expanded form is accurate),
    # for the closed-form and the sample moments; F4 m* = cy
    from nqfjax.engines.sgd_moments import diagonal_loss, residual_gradient

    rng = np.random.default_rng(0)
    xs = rng.normal(size=(300, 4)) * np.sqrt([1.0, 0.5, 0.3, 0.1])
    ys = xs**2 @ np.array([1.0, 0.4, -0.2, 0.3]) + 0.1 * rng.normal(size=300)
    for mom in (
        _gaussian_moments(jnp.asarray(S), jnp.asarray(MU), SIGMA2, jnp.float64),
        _sample_moments(xs, ys, jnp.float64),
    ):
        np.testing.assert_allclose(mom.F4 @ mom.m_star, mom.cy, rtol=1e-12)
        for m in rng.normal(size=(5, 4)):
            expanded = 0.5 * (m @ mom.F4 @ m - 2 * mom.cy @ m + mom.y2)
            np.testing.assert_allclose(diagonal_loss(mom, m), expanded, rtol=1e-12)
            np.testing.assert_allclose(
                residual_gradient(mom, m), mom.F4 @ m - mom.cy, rtol=1e-12
            )
    # the sample floor is the least-squares residual, >= 0 however small
    assert float(mom.floor) > 0


def test_noiseless_typical_loss_in_float32():
    # without label noise the paths' loss falls to ~1e-8 of its start in 300
    # steps, below float32's rounding of the expanded form (~1e-7 of y2): it
    # came out negative on 15% of the paths and TypicalLoss was NaN. Against
    # float64: the float32 paths round differently near the divergence edge
    # (2 of 256 paths flip here) and their geometric mean differs by 10%
    # (measured), so 25%

    def final():
        s = np.diag([1.0, 0.6, 0.35, 0.2])
        task = nqfjax.gaussian_quadratic_task(s, np.eye(4))  # in the current dtype
        crit = nqfjax.TypicalLoss(paths=256, key=jax.random.key(3))
        etas, bs = np.full(300, 0.1), np.full(300, 16.0)
        s = nqfjax.evaluate_schedule(task, etas, bs, np.full(4, 1e-2), criterion=crit)
        return float(s.final_loss)

    with jax.enable_x64(False):
        loss32 = final()
    loss64 = final()
    assert 0 < loss64 < 1e-7
    np.testing.assert_allclose(loss32, loss64, rtol=0.25)
