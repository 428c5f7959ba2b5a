"""Training methods on M and delayed generalisation (issue 8 items 4-5;
docs/theory/closed-flow.md).

Methods: the whitened two-layer linear network (the perceptron's quadratic
form) with an orthogonal design, so the sampled task reduces exactly: three
teacher singular values s = (4, 2, 1) give three modes (a_s, b_s)/sqrt2 with
r = 2 eta s per step (docs/theory/lotka-volterra.md).

Time: step `n` of an optimizer with learning rate eta(n) advances the flow by
eta(n) (the clock s(t) = sum of eta); the flow with eta = 1 at s(t) is the
flow with the schedule (`nqfjax.clock`).
"""

import diffrax
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import nqfjax


K = D = 3
N_SAMPLES = 16
SIG = np.array([4.0, 2.0, 1.0])
ETA = 0.00125  # r_1 = 2 eta s_1 = 0.01 per step
N_CLOCK = 10000  # steps of the schedule tests (all three modes switch on)
# one record grid for both M-space tests: solve_mflow compiles once
RECORD = np.r_[0, np.unique(np.rint(np.geomspace(1, N_CLOCK, 60)).astype(int))]


@pytest.fixture(scope="module")
def whitened():
    rng = np.random.default_rng(0)
    xs = np.sqrt(N_SAMPLES) * np.linalg.qr(rng.normal(size=(N_SAMPLES, N_SAMPLES)))[0]
    xs = xs[:, :D]
    U = np.linalg.qr(rng.normal(size=(K, K)))[0]
    V = np.linalg.qr(rng.normal(size=(D, D)))[0]
    ys = xs @ (U @ np.diag(SIG) @ V.T).T
    structure = nqfjax.Perceptron(d=D, k=K)
    task = nqfjax.task_from_samples(structure, xs, ys)
    lv_unit, basis = nqfjax.lv_reduce(task)
    np.testing.assert_allclose(lv_unit.r[:3], 2 * SIG, rtol=1e-10)
    return structure, jnp.asarray(xs), jnp.asarray(ys), task, lv_unit, np.asarray(basis)


# ---------------------------------------------------------------------------
# the clock


def test_clock_closed_forms():
    ts = jnp.array([0.0, 1.0, 2.5, 10.0, 37.0])
    np.testing.assert_allclose(nqfjax.clock(0.3, ts), 0.3 * ts, rtol=1e-15)
    # exponential decay eta_n = a q^n: geometric sums, linear within a step
    a, q = 0.2, 0.9
    sched = optax.exponential_decay(a, 1, q)
    geo = lambda N: a * (1 - q**N) / (1 - q)
    expected = [0.0, geo(1), geo(2) + 0.5 * a * q**2, geo(10), geo(37)]
    np.testing.assert_allclose(nqfjax.clock(sched, ts), expected, rtol=1e-12)
    # continuous clock: int_0^t a q^u du = a (1 - q^t) / ln(1/q)
    cont = a * (1 - q ** np.asarray(ts)) / np.log(1 / q)
    np.testing.assert_allclose(
        nqfjax.clock(sched, ts, discrete=False), cont, rtol=1e-12
    )
    # cosine decay: int_0^T (eta/2)(1 + cos(pi u / T)) du = eta T / 2 at the end
    cos = optax.cosine_decay_schedule(0.5, 40)
    np.testing.assert_allclose(
        nqfjax.clock(cos, jnp.array([40.0]), discrete=False), [10.0], rtol=1e-12
    )
    # heavy ball at constant rate: eta/(1-mu) (N - mu (1 - mu^N)/(1 - mu))
    mu, N = 0.9, np.array([0.0, 1.0, 5.0, 50.0])
    mom = 0.1 / (1 - mu) * (N - mu * (1 - mu**N) / (1 - mu))
    np.testing.assert_allclose(nqfjax.clock(0.1, N, momentum=mu), mom, rtol=1e-12)
    # float32 times give a float32 clock (summed in float64 inside)
    s32 = nqfjax.clock(sched, ts.astype(jnp.float32))
    assert s32.dtype == jnp.float32
    np.testing.assert_allclose(s32, nqfjax.clock(sched, ts), rtol=1e-6)
    # the inverse
    s = nqfjax.clock(sched, ts)
    np.testing.assert_allclose(nqfjax.invert_clock(sched, s), ts, atol=1e-9)
    assert np.isinf(nqfjax.invert_clock(sched, jnp.array([3.0]))[0])  # a/(1-q) = 2
    with pytest.raises(ValueError, match="momentum"):
        nqfjax.clock(0.1, ts, momentum=1.0)
    with pytest.raises(ValueError, match="ts"):
        jax.jit(lambda t: nqfjax.clock(sched, t))(ts)


@pytest.mark.slow  # a long physics check (the slow tier)
def test_schedule_mflow_matches_w_space(whitened):
    """The M-space flow on the clock of a warmup-cosine schedule matches full-batch
    GD with that schedule to 1e-3, from a random (unaligned) init. GD's O(eta)
    discretisation error is removed by Richardson extrapolation over runs that
    split every step in two: (i) each half step at eta(floor(j/2))/2, which keeps
    the discrete clock, and (ii) at eta(j/2)/2, whose limit is the continuous
    clock (the integral of the schedule)."""
    structure, xs, ys, task, lv_unit, basis = whitened
    n_steps = N_CLOCK
    sched = optax.warmup_cosine_decay_schedule(0.2 * ETA, ETA, 1000, n_steps, 0.5 * ETA)
    split = lambda j: sched(j // 2) / 2
    smooth = lambda j: sched(j / 2) / 2
    W0 = 1e-3 * np.random.default_rng(1).normal(size=(structure.p, 6))
    record = RECORD
    kw = dict(model=nqfjax.QuadraticForm(), W0=W0, snapshots=False)
    coarse = np.asarray(
        nqfjax.train(
            structure,
            xs,
            ys,
            num_steps=n_steps,
            learning_rate=sched,
            record_at=record,
            **kw,
        ).loss
    )
    fine = {
        name: np.asarray(
            nqfjax.train(
                structure,
                xs,
                ys,
                num_steps=2 * n_steps,
                learning_rate=lr,
                record_at=2 * record,
                **kw,
            ).loss
        )
        for name, lr in (("split", split), ("smooth", smooth))
    }
    ts = jnp.asarray(record, jnp.float64)
    # an explicit solver (the Kvaerno5 default compiles far longer); tolerances
    # 1e-10 put the solve ~1e-8 from the exact flow (measured against 1e-12)
    opts = dict(
        solver=diffrax.Tsit5(),
        stepsize_controller=diffrax.PIDController(rtol=1e-10, atol=1e-10),
    )
    for name, discrete in (("split", True), ("smooth", False)):
        L = np.asarray(
            nqfjax.solve_mflow(
                task, W0 @ W0.T, ts, sched, discrete=discrete, **opts
            ).loss
        )
        assert L[-1] < 1e-2 * L[0]  # all three modes learned
        mask = L > 1e-8 * L[0]
        rel = lambda a: np.max(np.abs(a - L)[mask] / L[mask])
        # raw GD is off by O(eta) (measured ~1e-2 and half that at eta/2) ...
        assert 1.6 < rel(coarse) / rel(fine[name]) < 2.4
        # ... which extrapolates away (measured ~1e-4)
        assert rel(2 * fine[name] - coarse) < 1e-3, name
    # the two clocks differ by more than the tolerance: the test tells them apart
    s_d = nqfjax.clock(sched, ts)
    s_c = nqfjax.clock(sched, ts, discrete=False)
    assert np.max(np.abs(np.asarray(s_d - s_c))) > 0.3 * ETA


@pytest.mark.slow
def test_lv_on_the_clock_matches_mflow(whitened):
    """From an init aligned with the modes the reduction is exact, on any clock."""
    structure, xs, ys, task, lv_unit, basis = whitened
    eps = np.array([1e-6, 3e-6, 2e-6, 1e-6, 1e-6, 1e-6])
    M0 = basis @ np.diag(eps) @ basis.T
    sched = optax.exponential_decay(2 * ETA, 4000, 0.3)
    ts = jnp.asarray(RECORD, jnp.float64)
    m = nqfjax.solve_lv(lv_unit, eps, ts, sched).ys
    opts = dict(
        solver=diffrax.Tsit5(),
        stepsize_controller=diffrax.PIDController(rtol=1e-10, atol=1e-10),
    )
    M = nqfjax.solve_mflow(task, M0, ts, sched, **opts).ys
    m_flow = np.einsum("pk,tpq,qk->tk", basis, np.asarray(M), basis)
    # both solvers at ~1e-10 tolerances: the growing modes agree to ~1e-7
    # relative; the shrinking ones (down to 1e-13) only absolutely in M-space,
    # which resolves a mode relative to the largest (solve_mflow's docstring)
    np.testing.assert_allclose(m[:, :3], m_flow[:, :3], rtol=1e-5)
    np.testing.assert_allclose(m[:, 3:], m_flow[:, 3:], atol=1e-9 * float(m.max()))
    assert float(m[-1, 2]) > 0.4  # the weakest mode switched on (m* = 2)
    # the deprecated aliases warn and give the same numbers
    with pytest.warns(DeprecationWarning, match="solve_lv_schedule"):
        m_old = nqfjax.solve_lv_schedule(lv_unit, eps, ts, sched)
    np.testing.assert_array_equal(m_old, m)
    with pytest.warns(DeprecationWarning, match="solve_mflow_schedule"):
        M_old = nqfjax.solve_mflow_schedule(task, M0, ts, sched, **opts)
    np.testing.assert_array_equal(M_old, M)


# ---------------------------------------------------------------------------
# methods


def test_batch_schedule_segments_equal_one_run(whitened):
    """A batch-size schedule runs as train segments; with every batch the full
    set the segments must reproduce one full-batch run exactly, including the
    learning-rate schedule shifted to the global step."""
    structure, xs, ys, task, lv_unit, basis = whitened
    sched = optax.exponential_decay(0.05, 100, 0.5)
    W0 = 1e-2 * np.random.default_rng(2).normal(size=(structure.p, 4))
    record = [0, 3, 50, 99, 100, 101, 150, 200]
    kw = dict(num_steps=200, W0=W0, record_at=record, model=nqfjax.QuadraticForm())
    one = nqfjax.train_method(nqfjax.Method(sched), structure, xs, ys, **kw)
    seg = nqfjax.train_method(
        nqfjax.Method(sched, batch_size=((0, N_SAMPLES), (100, N_SAMPLES))),
        structure,
        xs,
        ys,
        **kw,
    )
    np.testing.assert_array_equal(seg.steps, record)
    np.testing.assert_allclose(seg.loss, one.loss, rtol=1e-12)
    np.testing.assert_allclose(seg.M, one.M, rtol=1e-10, atol=1e-18)


@pytest.fixture(scope="module")
def reports(whitened):
    structure, xs, ys, task, lv_unit, basis = whitened
    eps = 1e-6
    W0 = basis * np.sqrt(eps)  # aligned: the LV reference is the exact flow
    n_steps = 9000  # the weakest mode switches on at ~5800 and settles by ~8000
    methods = {
        "gd": nqfjax.Method(ETA),
        "sgd2": nqfjax.Method(ETA, batch_size=2),
        "sgd8": nqfjax.Method(ETA, batch_size=8),
        "momentum": nqfjax.Method(ETA / 10, momentum=0.9),
        "adam": nqfjax.Method(ETA, optax.adam),
        "lr_schedule": nqfjax.Method(optax.exponential_decay(2 * ETA, n_steps, 0.25)),
        "batch_schedule": nqfjax.Method(ETA, batch_size=((0, 2), (3500, 8))),
    }
    return nqfjax.compare_methods(
        methods,
        structure,
        xs,
        ys,
        num_steps=n_steps,
        W0=W0,
        seeds=16,
        model=nqfjax.QuadraticForm(),  # the form, whose gradient flow is the LV
        record_at=np.linspace(0, n_steps, 351).astype(int),
        reference=nqfjax.LVEngine(),
    ), lv_unit


@pytest.mark.slow  # a long physics check (the slow tier)
def test_gd_and_momentum_departures(reports):
    """Full-batch GD grows a mode by (1 + a)^2 per step (a = r/2) instead of
    e^{2a}: ln(1 + a) = a - a^2/2, a lag of a/2 = r/4 relative. Heavy ball at
    the same effective rate eta/(1-mu) grows by the root z of
    z^2 - (1 + mu + a(1-mu)) z + mu = 0, ln z = a - a^2 (1/2 + mu/(1-mu)):
    a lag of r/4 + (r/2) mu/(1-mu), 19 times GD's. Both are measured at the
    half-way point, which includes the saturation (measured 80-90% of the
    exponential-phase lag)."""
    rep, lv_unit = reports
    r = np.asarray(lv_unit.r[:3]) * ETA
    gd, mom = reports[0]["gd"], reports[0]["momentum"]
    ratio = np.asarray(gd.departure[:3]) / (r / 4)
    assert np.all((ratio > 0.7) & (ratio < 1.05)), ratio
    mu = 0.9
    ratio = np.asarray(mom.departure[:3]) / (r / 4 + r / 2 * mu / (1 - mu))
    assert np.all((ratio > 0.7) & (ratio < 1.05)), ratio
    # the theory's switch-on times on the same clock (switch_on_times mapped
    # through invert_clock) against the half-of-peak crossings of the flow
    # (measured within 0.02%; the records every 26 steps are interpolated)
    np.testing.assert_allclose(
        gd.theory_switch_times[:3], gd.flow_switch_times[:3], rtol=2e-3
    )
    # the decaying schedule: a GD lag at its (larger) rates, still below 1%
    sched = reports[0]["lr_schedule"]
    assert np.all(np.abs(np.asarray(sched.departure[:3])) < 0.01)
    assert np.all(np.isnan(np.asarray(gd.departure[3:])))  # the shrinking modes


@pytest.mark.slow  # shares the `reports` fixture (~40 s) with the test above
def test_sgd_departure_shrinks_with_batch_size(reports):
    """Minibatch gradients are unbiased with covariance f(b) = (n-b)/(b(n-1))
    times the per-sample one: to leading order the switch-on times scatter
    around GD's with a spread ~ sqrt(f(b)), and the mean stays at GD's within
    that spread / sqrt(seeds)."""
    rep = reports[0]
    gd = np.asarray(rep["gd"].departure[:3])
    f = lambda b: (N_SAMPLES - b) / (b * (N_SAMPLES - 1))
    spread = {b: np.asarray(rep[f"sgd{b}"].departure_rms[:3]) for b in (2, 8)}
    # SGD departs more than GD (whose departure is the deterministic r/4), and
    # less for the larger batch; 16 seeds give each rms ~18% error, so the
    # ratio averaged over the 3 modes is within ~40% of sqrt(f(2)/f(8)) = 2.6
    assert np.all(spread[2] > spread[8])
    assert np.mean(spread[8]) > np.mean(np.abs(gd))
    ratio = np.mean(spread[2]) / np.mean(spread[8])
    assert 0.6 * np.sqrt(f(2) / f(8)) < ratio < 1.4 * np.sqrt(f(2) / f(8)), ratio
    # still small: below 5% for every mode (measured <= 2%)
    assert np.all(spread[2] < 0.05)
    for b in (2, 8):
        r = rep[f"sgd{b}"]
        se = np.asarray(r.switch_times_se[:3] / r.flow_switch_times[:3])
        assert np.all(np.abs(np.asarray(r.departure[:3]) - gd) < 4 * se + 1e-4)
    # the batch-size schedule (b = 2, then 8) stays within the b = 2 spread
    bs = np.asarray(rep["batch_schedule"].departure_rms[:3])
    assert np.all(bs < 2 * spread[2])


@pytest.mark.slow  # shares the `reports` fixture (~40 s) with the test above
def test_adam_departs_by_order_one(reports):
    """Adam normalises each coordinate's step: every mode grows at ~lr per step
    whatever its r_k, so on the clock of its nominal rate the modes switch on
    far earlier than the flow (measured 80-90% earlier), and the ratios of
    their times change by O(1) too (measured -20% and +25%; their sign depends
    on how the modes sit in the coordinates, which Adam is not invariant to),
    where GD's ratios are within 0.5% of the flow's."""
    adam = reports[0]["adam"]
    dep = np.asarray(adam.departure[:3])
    assert np.all(dep < -0.5), dep
    assert np.max(np.abs(np.asarray(adam.ratio_departure[1:3]))) > 0.1
    gd = reports[0]["gd"]
    np.testing.assert_allclose(gd.ratio_departure[1:3], 0.0, atol=5e-3)


# ---------------------------------------------------------------------------
# delayed generalisation


def test_generalisation_delay_closed_form():
    """Exponential curves cross their levels at known times; log-log
    interpolation between log-spaced records is exact for power laws and
    accurate to O(spacing^2) otherwise."""
    ts = jnp.concatenate([jnp.zeros(1), jnp.geomspace(1.0, 1e4, 400)])
    train = jnp.exp(-ts / 10.0)
    test = 1.0 / (1.0 + (ts / 2000.0) ** 3)
    t_fit, t_gen, delay = jax.jit(nqfjax.generalisation_delay)(
        ts, train, test, 1e-3, 1e-2
    )
    np.testing.assert_allclose(t_fit, 10 * np.log(1e3), rtol=1e-3)
    np.testing.assert_allclose(t_gen, 2000 * 99 ** (1 / 3), rtol=1e-3)
    np.testing.assert_allclose(delay, t_gen - t_fit, rtol=1e-12)
    _, t_never, d_never = nqfjax.generalisation_delay(ts, train, test, 1e-3, 1e-9)
    assert np.isnan(t_never) and np.isnan(d_never)


def _anisotropic_task(n):
    """A rank-one teacher in the 3 strong directions of a 12-dimensional input
    whose other 9 directions have variance 0.05. With n = 20 samples (< the 78
    entries of M) many M fit the data; Adam fits them within ~100 steps with a
    test loss still ~15% of the scale, and the L2 penalty (|W|^2 = Tr M, cheap
    along the strong directions) then drifts the network to the teacher."""
    d, k = 12, 3
    rng = np.random.default_rng(0)
    var = np.r_[np.ones(k), 0.05 * np.ones(d - k)]
    u = np.zeros(d)
    u[:k] = rng.normal(size=k)
    M_star = np.outer(u, u) / (u @ u)
    xs = rng.normal(size=(n, d)) * np.sqrt(var)
    ys = np.einsum("si,ij,sj->s", xs, M_star, xs)[:, None]
    test = nqfjax.gaussian_quadratic_task(np.diag(var), M_star)
    return nqfjax.QuadraticNet(d=d), jnp.asarray(xs), jnp.asarray(ys), test


def test_delay_grows_as_weight_decay_shrinks():
    structure, xs, ys, test = _anisotropic_task(20)

    def fn(lam):
        r = nqfjax.delayed_generalisation(
            structure,
            xs,
            ys,
            test,
            weight_decay=lam,
            learning_rate=1e-2,
            num_steps=3000,
            key=jax.random.key(0),
            init_scale=0.1,
            width=12,
            num_records=120,
        )
        return r.t_fit, r.t_generalise, r.delay, r.test_loss, r.ts, r.test_level

    lams = np.geomspace(1e-4, 1e-2, 5)
    out = nqfjax.sweep(fn, {"lam": lams}, progress=False)
    t_fit, t_gen, delay, test_loss, ts, level = (np.asarray(o) for o in out.outputs)
    assert np.all(np.isfinite(delay))
    # monotone over the grid: the smaller the weight decay, the longer the delay
    # (measured 2250, 1280, 680, 340, 170 steps)
    assert np.all(np.diff(delay) < 0), delay
    # it fits long before it generalises: at the fit the test loss is still
    # many times the threshold (measured ~14x), and t_gen > 3 t_fit throughout
    assert np.all(t_gen > 3 * t_fit), (t_fit, t_gen)
    for i in range(len(lams)):
        at_fit = np.interp(t_fit[i], ts[i], test_loss[i])
        assert at_fit > 5 * level[i]
    # the scaling: delay ~ lam^slope, measured slope -0.56 +- 0.02
    fit = nqfjax.delay_scaling(lams, delay)
    assert -0.9 < float(fit.slope) < -0.3, float(fit.slope)


def test_method_optimizers_are_optax_objects(whitened):
    """A Method holds an optax choice: the heavy ball built from `momentum`, the
    same transformation given ready-made, and a hand-written factory train the
    same weights (bit for bit: the same optax code path), and the clock knows the
    momentum."""
    structure, xs, ys, task, lv_unit, basis = whitened
    W0 = 1e-2 * np.random.default_rng(3).normal(size=(structure.p, 4))
    kw = dict(num_steps=50, W0=W0, record_at=[0, 10, 50], model=nqfjax.QuadraticForm())
    lr, mu = 0.05, 0.9
    methods = {
        "momentum": nqfjax.Method(lr, momentum=mu),
        "ready": nqfjax.Method(lr, optax.sgd(lr, momentum=mu), momentum=mu),
        "factory": nqfjax.Method(lr, lambda r: optax.sgd(r, momentum=mu), momentum=mu),
    }
    Ws = {
        k: nqfjax.train_method(m, structure, xs, ys, **kw).W for k, m in methods.items()
    }
    np.testing.assert_array_equal(Ws["ready"], Ws["momentum"])
    np.testing.assert_array_equal(Ws["factory"], Ws["momentum"])
    # ... and differ from plain GD (the momentum is really used)
    gd = nqfjax.train_method(nqfjax.Method(lr), structure, xs, ys, **kw).W
    assert np.max(np.abs(np.asarray(gd - Ws["momentum"]))) > 1e-6
    ts = jnp.array([0.0, 5.0, 50.0])
    for m in methods.values():
        assert m.clock_momentum == mu
        np.testing.assert_allclose(
            m.clock(ts), nqfjax.clock(lr, ts, momentum=mu), rtol=1e-15
        )
    assert nqfjax.Method(lr, optax.adam).clock_momentum == 0.0


def test_method_strings_are_deprecated_words_of_the_one_table():
    """The old optimizer strings still work for one release, with a
    DeprecationWarning, and resolve through the command line's table."""
    from nqfjax.experiments.sweep_config import OPTIMIZERS

    for word, expected in (("sgd", None), ("gd", None), ("adam", OPTIMIZERS["adam"])):
        with pytest.warns(DeprecationWarning, match="deprecated"):
            m = nqfjax.Method(0.1, optimizer=word)
        assert m.optimizer is expected
        assert m.momentum == 0.0
    with pytest.warns(DeprecationWarning):
        m = nqfjax.Method(0.1, optimizer="momentum", momentum=0.5)
    assert m.optimizer == nqfjax.Method(0.1, momentum=0.5).optimizer
    assert m.clock_momentum == 0.5
    with pytest.warns(DeprecationWarning):
        m = nqfjax.Method(0.1, "momentum")  # the old default momentum
    assert m.optimizer == OPTIMIZERS["momentum"] and m.clock_momentum == 0.9
    # the table's heavy ball is the optax one
    np.testing.assert_array_equal(
        OPTIMIZERS["momentum"](0.1).update(
            jnp.ones(2), OPTIMIZERS["momentum"](0.1).init(jnp.ones(2))
        )[0],
        optax.sgd(0.1, momentum=0.9).update(
            jnp.ones(2), optax.sgd(0.1, momentum=0.9).init(jnp.ones(2))
        )[0],
    )


def test_bad_input(whitened):
    structure, xs, ys, task, lv_unit, basis = whitened
    with pytest.raises(ValueError, match="optimizer"):
        nqfjax.Method(0.1, optimizer="lbfgs")
    with pytest.raises(ValueError, match="optimizer"):
        nqfjax.Method(0.1, optimizer=3)
    with pytest.raises(ValueError, match="momentum"):
        nqfjax.Method(0.1, momentum=1.5)
    with pytest.raises(ValueError, match="momentum"):
        nqfjax.Method(0.1, nqfjax.Method(0.1, momentum=0.9).optimizer, momentum=0.5)
    with pytest.raises(ValueError, match="factory"):
        nqfjax.Method(0.1, optax.adam(0.1), batch_size=((0, 2), (5, 4)))
    with pytest.raises(ValueError, match="batch-size schedule"):
        nqfjax.Method(0.1, batch_size=((10, 2),))
    with pytest.raises(ValueError, match="learning_rate"):
        nqfjax.Method(-0.1)
    with pytest.raises(ValueError, match="reference"):
        nqfjax.compare_methods(
            [nqfjax.Method(0.1)],
            structure,
            xs,
            ys,
            num_steps=2,
            W0=np.eye(6),
            reference="exact",
        )
    with pytest.raises(ValueError, match="test_task"):
        nqfjax.delayed_generalisation(
            structure,
            xs,
            ys,
            nqfjax.gaussian_quadratic_task(np.eye(2), np.eye(2)),
            weight_decay=0.1,
            learning_rate=0.1,
            num_steps=2,
            key=jax.random.key(0),
            init_scale=0.1,
            width=2,
        )
    with pytest.raises(ValueError, match="two points"):
        nqfjax.delay_scaling([1.0, 2.0], [np.nan, 1.0])
