"""Schedules designed through the moment equation (`optimize_schedule` with
`MeanLoss`) against the standard ones, predicted and measured in real W-space
SGD; the typical-run criterion (`TypicalLoss`, `sgd_paths`, `stability_edge`)
against the moment equation, gradient descent and an independent online-SGD
loop."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nqfjax


D = 4
S = np.array([1.0, 0.6, 0.35, 0.2])
MU = np.ones(D)
SIGMA2 = 0.05
M0 = np.full(D, 0.01)
T, SEGMENTS, BUDGET, ETA_MAX = 300, 10, 16 * 300, 0.15


MEAN = nqfjax.MeanLoss()


@pytest.fixture(scope="module")
def setting():
    """The task, a sign-symmetric dataset of 1024 samples (see
    test_sgd_moments.py), and the schedules: the four standard ones tuned on the
    model, and the optimised one started from the best of them."""
    k1, k2 = jax.random.split(jax.random.key(1))
    base = np.asarray(jax.random.normal(k1, (64, D))) * np.sqrt(S)
    signs = np.array(list(itertools.product([1.0, -1.0], repeat=D)))
    xs = (base[:, None, :] * signs[None]).reshape(-1, D)
    noise = np.sqrt(SIGMA2) * np.asarray(jax.random.normal(k2, (64, 1)))
    ys = (xs**2 @ MU + np.broadcast_to(noise, (64, 16)).reshape(-1))[:, None]
    xs, ys = jnp.asarray(xs), jnp.asarray(ys)
    task = nqfjax.gaussian_quadratic_task(np.diag(S), np.diag(MU))
    model = dict(samples=(xs, ys))
    standard = nqfjax.standard_schedules(
        task,
        BUDGET,
        M0,
        num_steps=T,
        max_learning_rate=ETA_MAX,
        criterion=MEAN,
        **model,
    )[:4]
    best = min(standard, key=lambda s: float(s.final_loss))
    optimised = nqfjax.optimize_schedule(
        task,
        BUDGET,
        M0,
        num_steps=T,
        max_learning_rate=ETA_MAX,
        init=best,
        num_iterations=40,
        criterion=MEAN,
        **model,
    )
    run = [
        nqfjax.piecewise_constant(s, SEGMENTS, task, M0, criterion=MEAN, **model)
        for s in (*standard, optimised)
    ]
    # the rounded batch sizes fixed, the learning rates polished on segments
    polished = nqfjax.optimize_schedule(
        task,
        BUDGET,
        M0,
        num_steps=T,
        max_learning_rate=ETA_MAX,
        init=run[-1],
        num_knots=SEGMENTS,
        num_iterations=20,
        batch_sizes=run[-1].batch_sizes,
        criterion=MEAN,
        **model,
    )
    run[-1] = nqfjax.piecewise_constant(
        polished, SEGMENTS, task, M0, criterion=MEAN, **model
    )
    keys = jax.random.split(jax.random.key(5), 8)
    W0 = jnp.diag(jnp.sqrt(jnp.asarray(M0)))
    # the same 8 minibatch seeds for every schedule (common random numbers)
    measured = [
        np.asarray(
            nqfjax.train_schedule(s, xs, ys, W0, keys, num_segments=SEGMENTS)[:, -1]
        )
        for s in run
    ]
    return dict(task=task, model=model, run=run, measured=measured)


@pytest.mark.slow  # real SGD training of every schedule over 8 seeds
def test_optimised_beats_standard_in_the_model(setting):
    run = setting["run"]
    predicted = [float(s.final_loss) for s in run]
    assert predicted[-1] < min(predicted[:-1])
    # the sample budget holds after rounding to powers of two (and is mostly
    # used: the rounding gives back at most half of any segment)
    total = float(jnp.sum(run[-1].batch_sizes))
    assert BUDGET / 2 <= total <= BUDGET
    assert float(jnp.max(run[-1].learning_rates)) <= ETA_MAX


@pytest.mark.slow  # real SGD training of every schedule over 8 seeds
def test_optimised_is_no_worse_in_training_and_gain_as_predicted(setting):
    run, measured = setting["run"], setting["measured"]
    means = [float(np.mean(m)) for m in measured]
    assert all(np.all(np.isfinite(m)) for m in measured)
    # measured over 8 seeds: no worse than the best standard schedule
    assert means[-1] <= min(means[:-1]), means
    # the gain over the standard schedule the model ranked best, measured
    # against predicted: within 30% (the tolerance; measured ~10%,
    # the standard error of a difference of 8-seed means is ~10% of it)
    ref = int(np.argmin([float(s.final_loss) for s in run[:-1]]))
    predicted_gain = float(run[ref].final_loss - run[-1].final_loss)
    measured_gain = means[ref] - means[-1]
    assert predicted_gain > 0
    assert abs(measured_gain / predicted_gain - 1) < 0.3, (
        measured_gain,
        predicted_gain,
    )


@pytest.mark.slow  # shares the fixture
def test_bad_input(setting):
    task = setting["task"]
    with pytest.raises(ValueError, match="budget"):
        nqfjax.optimize_schedule(task, 10, M0, num_steps=T, max_learning_rate=0.1)
    for bad in (-1, 2.5):  # named eagerly, before any optimisation
        with pytest.raises(ValueError, match="check_paths"):
            nqfjax.optimize_schedule(
                task, BUDGET, M0, num_steps=T, max_learning_rate=0.1, check_paths=bad
            )
    with pytest.raises(ValueError, match="max_learning_rate"):
        nqfjax.standard_schedules(task, BUDGET, M0, num_steps=T, max_learning_rate=0)
    with pytest.raises(ValueError, match="num_segments"):
        nqfjax.piecewise_constant(setting["run"][0], 7, task, M0)


def _task():
    return nqfjax.gaussian_quadratic_task(np.diag(S), np.diag(MU))


@pytest.mark.slow  # compiles the path map (5-30 s on a loaded 2-core machine)
def test_paths_one_step_mean_is_the_moment_equation():
    # one step from a diagonal M: the Gaussian map's noise has the minibatch
    # gradient's mean and covariance, so the mean over paths of the new loss is
    # the moment equation's (exact at one step up to the O(eta^3) products the
    # closure drops, ~0.3% here). 8192 paths: the Monte Carlo standard error se
    # of the mean loss is 0.4%; tolerance 4 se + 0.5%. Pinned to the Gaussian
    # map: with real minibatches (the sampled map) the gradient's third and
    # fourth cumulants, which the closure drops, move this mean 7% below the
    # moment equation's (an independent NumPy Monte Carlo of one SGD step
    # agrees with the sampled map to 1%).
    eta, b = 0.05, 8.0
    m0 = np.array([0.3, 0.6, 0.9, 1.2])
    kw = dict(noise_variance=SIGMA2)
    paths = nqfjax.sgd_paths(
        _task(),
        jnp.full(1, eta),
        jnp.full(1, b),
        m0,
        paths=8192,
        minibatch="gaussian",
        **kw,
    )
    moments = nqfjax.sgd_moments(_task(), jnp.full(1, eta), jnp.full(1, b), m0, **kw)
    loss = np.asarray(paths.loss[:, 1])
    se = loss.std() / np.sqrt(loss.size) / loss.mean()
    assert se < 0.005
    assert abs(loss.mean() / float(moments.loss[1]) - 1) < 4 * se + 0.005
    # the noise is there: the paths spread
    assert loss.std() > 0.1 * loss.mean()


@pytest.mark.slow  # compiles the path map
def test_paths_full_batch_is_gradient_descent():
    # c_b = 0 (batch = dataset size): every path of the Gaussian map is
    # gradient descent on the modes, which the moment equation is exactly at
    # the full batch (pinned to the Gaussian map: on this dataset, not
    # symmetric under x_k -> -x_k, the sampled map's full batch is real gradient
    # descent, whose gradient has an off-diagonal part the moments leave out)
    data = (
        jnp.asarray(np.random.default_rng(0).normal(size=(64, D)) * np.sqrt(S)),
        None,
    )
    xs = data[0]
    ys = (xs**2 @ jnp.asarray(MU))[:, None]
    eta, steps = jnp.full(60, 0.05), jnp.full(60, 64.0)
    kw = dict(samples=(xs, ys))
    paths = nqfjax.sgd_paths(
        _task(), eta, steps, M0, paths=3, minibatch="gaussian", **kw
    )
    gd = nqfjax.sgd_moments(_task(), eta, steps, M0, **kw)
    for p in range(3):
        np.testing.assert_allclose(paths.loss[p], gd.loss, rtol=1e-9)
    assert not bool(jnp.any(paths.diverged))


def test_typical_criterion_bad_input():
    task = _task()
    eta, b = jnp.full(5, 0.1), jnp.full(5, 4.0)
    with pytest.raises(ValueError, match="criterion"):
        nqfjax.evaluate_schedule(task, eta, b, M0, criterion="typical")
    with pytest.raises(ValueError, match="max_diverged"):
        nqfjax.TypicalLoss(max_diverged=1.0)
    with pytest.raises(ValueError, match="paths"):
        nqfjax.TypicalLoss(paths=0)
    with pytest.raises(ValueError, match="key"):
        nqfjax.TypicalLoss(key=3)
    with pytest.raises(ValueError, match="paths"):
        nqfjax.sgd_paths(task, eta, b, M0, paths=2.5)
    with pytest.raises(ValueError, match="m0"):
        nqfjax.sgd_paths(task, eta, b, -M0)
    with pytest.raises(ValueError, match="`minibatch` must be 'sampled' or"):
        nqfjax.sgd_paths(task, eta, b, M0, minibatch="poisson")
    with pytest.raises(ValueError, match="max_samples"):
        nqfjax.sgd_paths(task, eta, b, M0, max_samples=0)
    with pytest.raises(ValueError, match="minibatch"):
        nqfjax.TypicalLoss(minibatch=None)
    with pytest.raises(ValueError, match="max_samples"):
        nqfjax.TypicalLoss(max_samples=2.0)
    with pytest.raises(ValueError, match="task"):  # not a Gaussian quadratic task
        nqfjax.sgd_paths(object(), eta, b, M0)
    with pytest.raises(ValueError, match="learning_rate_bounds"):
        nqfjax.stability_edge(
            task, 4.0, M0, num_steps=5, learning_rate_bounds=(2e-3, 1e-3)
        )
    kw = dict(num_steps=5, max_learning_rate=0.1)
    for bad in (0.3, 1.0):  # named eagerly, before any optimisation
        with pytest.raises(ValueError, match="check_confidence"):
            nqfjax.optimize_schedule(task, 20, M0, check_confidence=bad, **kw)
    # 32 paths cannot show p <= 5% at 95%: even 0 of 32 has probability
    # 0.95^32 = 0.19 > 0.05 at p = 5%
    with pytest.raises(ValueError, match="check_paths.*too few"):
        nqfjax.optimize_schedule(task, 20, M0, check_paths=32, **kw)


def test_fresh_path_check_is_the_clopper_pearson_bound():
    # the most diverged paths the check lets pass, against scipy's one-sided
    # Clopper-Pearson upper bound (a beta quantile): the bound at k is <= the
    # cap and the bound at k + 1 is above it
    from scipy.stats import beta

    from nqfjax.experiments.schedules import _allowed_count

    for n, cap, conf in itertools.product(
        (60, 128, 512, 1024, 4096), (0.01, 0.05, 0.2), (0.5, 0.9, 0.95, 0.99)
    ):
        k = _allowed_count(n, cap, conf)
        if k >= 0:
            assert beta.ppf(conf, k + 1, n - k) <= cap, (n, cap, conf, k)
        assert beta.ppf(conf, k + 2, n - k - 1) > cap, (n, cap, conf, k)
    assert _allowed_count(512, 0.05, 0.95) == 17  # the docstring's example
    assert _allowed_count(100, 0.0, 0.95) == 0  # max_diverged = 0: none


def _online_sgd(eta, b, keys, steps=T):
    """An independent plain-JAX online-SGD loop (fresh Gaussian samples each
    step): final full-data losses and whether each run diverged."""
    s, mu = jnp.asarray(S), jnp.asarray(MU)

    def loss(M):
        SD = s[:, None] * (M - jnp.diag(mu))
        return 0.5 * (2 * jnp.trace(SD @ SD) + jnp.trace(SD) ** 2 + SIGMA2)

    W0 = jnp.diag(jnp.sqrt(jnp.asarray(M0)))
    threshold = 1e4 * jnp.maximum(loss(W0 @ W0.T), loss(0 * W0))

    def one(key):
        def step(carry, inputs):
            W, bad = carry
            k, eta_t = inputs
            k1, k2 = jax.random.split(k)
            x = jax.random.normal(k1, (b, D)) * jnp.sqrt(s)[None, :]
            y = x**2 @ mu + jnp.sqrt(SIGMA2) * jax.random.normal(k2, (b,))
            e = jnp.einsum("bi,ij,bj->b", x, W @ W.T, x) - y
            W_new = W - 2 * eta_t * ((x * e[:, None]).T @ x / b) @ W
            L = loss(W_new @ W_new.T)
            bad = bad | ~jnp.isfinite(L) | (L > threshold)
            return (jnp.where(bad, W, W_new), bad), None

        (W, bad), _ = jax.lax.scan(
            step, (W0, False), (jax.random.split(key, steps), eta)
        )
        return loss(W @ W.T), bad

    return jax.jit(jax.vmap(one))(keys)


def _real_edge(guess, b, keys):
    """The constant rate at which half of the seeds of `_online_sgd` diverge:
    bisection in log eta, 6 steps from a factor-2.5 bracket around `guess`
    (resolution 2%; the seeds' fraction error 0.06 for 64 seeds, ~2% in eta)."""
    lo, hi = guess / 2.5, guess * 2.5

    def unstable(eta):
        _, bad = _online_sgd(jnp.full(T, eta), b, keys)
        return float(np.mean(bad)) >= 0.5

    assert not unstable(lo) and unstable(hi)
    for _ in range(6):
        mid = np.sqrt(lo * hi)
        lo, hi = (lo, mid) if unstable(mid) else (mid, hi)
    return np.sqrt(lo * hi)


@pytest.mark.slow  # online SGD over 64 seeds at 8 learning rates, 300 steps
def test_sampled_edge_matches_online_sgd_at_batch_4():
    # batch 4, where the Gaussian map's edge is 35% low: the sampled map's
    # (half of 128 paths diverge) against online SGD's (half of 64 seeds).
    # Issue's tolerance 20%; measured +1.4% (the Gaussian map: -35%).
    b = 4
    crit = nqfjax.TypicalLoss(paths=128)
    edge = float(
        nqfjax.stability_edge(
            _task(), b, M0, num_steps=T, criterion=crit, noise_variance=SIGMA2
        )
    )
    real = _real_edge(edge, b, jax.random.split(jax.random.key(3), 64))
    assert abs(edge / real - 1) < 0.2, (edge, real)


@pytest.mark.slow  # online SGD over 64 seeds at 8 learning rates, 300 steps
def test_typical_edge_and_final_loss_match_online_sgd():
    # batch 16: the designer's edge (half of 128 paths of the sampled map
    # diverge) against the rate at which half of 64 seeds of online SGD
    # diverge. Issue's tolerance 20%; measured +1.4% (the Gaussian map:
    # -11 to -15%).
    b = 16
    kw = dict(noise_variance=SIGMA2)
    crit = nqfjax.TypicalLoss(paths=128)
    edge = float(
        nqfjax.stability_edge(_task(), b, M0, num_steps=T, criterion=crit, **kw)
    )
    keys = jax.random.split(jax.random.key(3), 64)
    real = _real_edge(edge, b, keys)
    assert abs(edge / real - 1) < 0.2, (edge, real)
    # the typical final loss of two schedules that converge: the geometric mean
    # over the seeds (64: its standard error ~1%) against the paths' (256);
    # tolerance 10% (the issue's), measured within 2%
    t = jnp.arange(T)
    for shape, peak in ((jnp.ones(T), 0.4), (0.5 * (1 + jnp.cos(jnp.pi * t / T)), 0.5)):
        eta = peak * edge * shape + 1e-6
        final, bad = _online_sgd(eta, b, keys)
        assert not bool(jnp.any(bad))
        measured = float(jnp.exp(jnp.mean(jnp.log(final))))
        predicted = nqfjax.evaluate_schedule(
            _task(), eta, jnp.full(T, float(b)), M0, criterion=crit, **kw
        )
        assert float(predicted.diverged_fraction) == 0
        assert abs(float(predicted.final_loss) / measured - 1) < 0.1, (
            peak,
            float(predicted.final_loss),
            measured,
        )


def _wick_loss(M, s, mu):
    """`E (x^T M x - y)^2 / 2`, `x ~ N(0, diag s)`, `y = x^2 . mu + xi`."""
    SD = s[:, None] * (M - np.diag(mu))
    return 0.5 * (2 * np.trace(SD @ SD) + np.trace(SD) ** 2 + SIGMA2)


@pytest.mark.slow  # compiles the sampled path map twice
@pytest.mark.parametrize("draw", ["population", "dataset"])
def test_sampled_paths_are_sgd_on_W(draw):
    # the sampled map (the exact step on M) against plain NumPy SGD on W,
    # W <- W - 2 eta G_hat W with G_hat = mean_s e_s x_s x_s^T, on the same
    # minibatches (drawn as sgd_paths draws them: the keys split(key, (P, T)),
    # fresh samples or distinct rows of a sign-symmetric dataset), in the mode
    # basis; the full-data loss in closed form or over the dataset. Equal to
    # rounding (float64).
    from nqfjax.engines._sgd_paths import dataset_draw, population_draw

    steps, P, b = 60, 3, 4
    # from half the edge at batch 4 (fresh samples ~0.08; this small dataset,
    # with a row of |x|^2 = 9.5, diverges above ~0.02)
    eta = np.linspace(0.04 if draw == "population" else 0.015, 0.005, steps)
    key = jax.random.key(4)
    if draw == "population":
        kw = dict(noise_variance=SIGMA2)
    else:
        base = np.random.default_rng(1).normal(size=(8, D)) * np.sqrt(S)
        signs = np.array(list(itertools.product([1.0, -1.0], repeat=D)))
        xs = (base[:, None, :] * signs[None]).reshape(-1, D)
        # label noise shared by the sign-flipped copies of a row (symmetry)
        noise = np.repeat(0.2 * np.random.default_rng(2).normal(size=8), 16)
        ys = xs**2 @ MU + noise
        kw = dict(samples=(xs, ys))
    out = nqfjax.sgd_paths(
        _task(), eta, np.full(steps, float(b)), M0, paths=P, key=key, **kw
    )
    assert not bool(jnp.any(out.diverged))
    U = np.asarray(out.basis)
    s, mu = np.diag(U.T @ np.diag(S) @ U), np.diag(U.T @ np.diag(MU) @ U)
    if draw == "dataset":
        xs_m = xs @ U

        def loss(M):
            return 0.5 * np.mean((np.einsum("ni,ij,nj->n", xs_m, M, xs_m) - ys) ** 2)
    else:

        def loss(M):
            return _wick_loss(M, s, mu)

    keys = jax.random.split(key, (P, steps))
    for p in range(P):
        W = np.diag(np.sqrt(M0))
        losses = [loss(W @ W.T)]
        for t in range(steps):
            if draw == "population":
                x, y = population_draw(
                    keys[p, t], b, jnp.asarray(s), jnp.asarray(mu), SIGMA2
                )
            else:
                x, y = dataset_draw(keys[p, t], b, jnp.asarray(xs_m), jnp.asarray(ys))
            x, y = np.asarray(x), np.asarray(y)
            e = np.einsum("si,ij,sj->s", x, W @ W.T, x) - y
            G = (x * e[:, None]).T @ x / b
            W = W - 2 * eta[t] * G @ W
            losses.append(loss(W @ W.T))
        np.testing.assert_allclose(out.loss[p], losses, rtol=1e-9)
    # the runs move: the loss falls by orders of magnitude
    assert float(out.loss[0, -1]) < 0.1 * float(out.loss[0, 0])


@pytest.mark.slow  # compiles the sampled map and its gradient
def test_sampled_paths_gradient_in_batch_sizes_matches_finite_differences():
    # a real batch size b takes floor(b) samples and rescales the gradient's
    # deviation by sqrt(c_b / c_floor(b)): the criterion is differentiable in
    # b (what optimize_schedule needs). Its gradient along a uniform shift of
    # b, against a central difference within the same floor (h = 0.05; the
    # same draws: common random numbers); measured equal to 2e-5.
    crit = nqfjax.TypicalLoss(paths=32)
    steps = 100

    def objective(eta, b):
        return crit.objective(_task(), eta, b, M0, dict(noise_variance=SIGMA2))

    eta, b = jnp.full(steps, 0.05), jnp.full(steps, 12.4)
    grad_eta, grad_b = jax.grad(objective, argnums=(0, 1))(eta, b)
    assert bool(jnp.all(jnp.isfinite(grad_eta)))
    h = 0.05
    fd = (objective(eta, b + h) - objective(eta, b - h)) / (2 * h)
    assert float(fd) < 0  # larger batches, less noise, lower loss
    np.testing.assert_allclose(float(jnp.sum(grad_b)), float(fd), rtol=1e-3)


@pytest.mark.slow  # compiles the sampled path map and its gradient
def test_design_keeps_within_the_divergence_cap_on_fresh_paths():
    # a design on 64 paths of one key sits at the divergence edge of those
    # paths; the fresh-key check (256 paths of another key) backs its learning
    # rates off until at most 6 of those diverge (the exact binomial test:
    # then p <= 5% at 95% confidence). Judged on 1024 paths of a third key
    # (a fraction's standard error ~0.6% at 4%): within the cap, and the
    # unchecked design above it by more than twice that error. Measured
    # (2026-12-04): 3.8% with the check, 9.0% without it (`check_paths=0`),
    # 5.9% with the check at `check_confidence=0.5` (about the plain
    # fraction's test, k/n <= 5%: it stops where the fresh paths sit at 5%).
    kw = dict(noise_variance=SIGMA2)
    design = nqfjax.TypicalLoss(paths=64, key=jax.random.key(0))
    judge = nqfjax.TypicalLoss(paths=1024, key=jax.random.key(9))
    args = (_task(), 16 * T, M0)
    opt = dict(num_steps=T, max_learning_rate=0.3, num_iterations=20)
    fracs = {}
    for check in (0, None):
        x = nqfjax.optimize_schedule(
            *args, criterion=design, check_paths=check, **opt, **kw
        )
        y = nqfjax.evaluate_schedule(
            _task(), x.learning_rates, x.batch_sizes, M0, criterion=judge, **kw
        )
        fracs[check] = float(y.diverged_fraction)
    assert fracs[0] > 0.05 + 0.012, fracs  # the unchecked design overshoots
    assert fracs[None] <= 0.05, fracs
    # checked again as run (the how-to's step 4): integer batches (the
    # cumulative sum rounded), the rates kept exactly (one knot per step, no
    # iteration) up to one back-off scale, and within the cap on the judge's
    # paths as rounded
    c = np.rint(np.cumsum(np.asarray(x.batch_sizes)))
    b_int = np.maximum(np.diff(np.concatenate([[0.0], c])), 1.0)
    init = nqfjax.Schedule(x.learning_rates, jnp.asarray(b_int), x.predicted_loss, 0.0)
    z = nqfjax.optimize_schedule(
        *args,
        criterion=design,
        init=init,
        batch_sizes=b_int,
        num_knots=T,
        **{**opt, "num_iterations": 0},
        **kw,
    )
    scale = np.asarray(z.learning_rates) / np.asarray(x.learning_rates)
    np.testing.assert_allclose(scale, scale[0], rtol=1e-9)
    assert 0 < scale[0] <= 1
    y = nqfjax.evaluate_schedule(
        _task(), z.learning_rates, b_int, M0, criterion=judge, **kw
    )
    assert float(y.diverged_fraction) <= 0.05, float(y.diverged_fraction)


@pytest.mark.slow  # two designs on the sampled path map, ~90 s
def test_design_worse_than_its_start_on_fresh_paths_returns_the_start():
    # without label noise the loss falls exponentially at a rate set by the
    # learning rate, up to the divergence edge: a design on 32 paths pushes
    # past the edge those paths show (unchecked, it loses 12.5% of 2048 judge
    # paths, measured 2026-12-04), and backed off below its start it ends
    # above it. The fresh check's 2048 paths (other key) find the start, a
    # constant 0.1 that passes unscaled (2.4% diverged), better: it is
    # returned as given
    T = 300
    task = nqfjax.gaussian_quadratic_task(np.diag([1.0, 0.6, 0.35, 0.2]), np.eye(4))
    m0 = np.full(4, 1e-2)
    design = nqfjax.TypicalLoss(paths=32, key=jax.random.key(0))
    judge = nqfjax.TypicalLoss(paths=2048, key=jax.random.key(9))
    start = nqfjax.evaluate_schedule(
        task, jnp.full(T, 0.1), jnp.full(T, 16.0), m0, criterion=design
    )
    kw = dict(num_steps=T, max_learning_rate=0.24, init=start, criterion=design)
    kw |= dict(num_iterations=20)
    x = nqfjax.optimize_schedule(task, 16 * T, m0, check_paths=2048, **kw)
    np.testing.assert_allclose(x.learning_rates, 0.1, rtol=1e-12)
    np.testing.assert_allclose(x.batch_sizes, 16.0, rtol=1e-12)
    unchecked = nqfjax.optimize_schedule(task, 16 * T, m0, check_paths=0, **kw)
    frac = nqfjax.evaluate_schedule(
        task, unchecked.learning_rates, unchecked.batch_sizes, m0, criterion=judge
    ).diverged_fraction
    assert float(frac) > 0.05 + 3 * 0.005, float(frac)  # 3 s.e. over the cap
