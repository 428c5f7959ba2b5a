"""W-space training (`nqfjax.train`): checked against hand-written numpy loops,
closed forms, and the predictions of docs/theory/closed-flow.md for SGD and Adam."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
import pytest

import nqfjax


# ---------------------------------------------------------------------------
# numpy references, written from the formulas of docs/theory/, independent
# of nqfjax


def _np_A(structure, xs):
    """A(x_s) for every sample, shape (n, k, p, p), from the closed forms."""
    xs = np.asarray(xs, np.float64)
    if isinstance(structure, nqfjax.QuadraticNet):
        return np.einsum("si,sj->sij", xs, xs)[:, None]
    k, d, c = structure.k, structure.d, structure.slope
    A = np.zeros((xs.shape[0], k, k + d, k + d))
    for j in range(k):
        A[:, j, j, k:] = 0.5 * c * xs
        A[:, j, k:, j] = 0.5 * c * xs
    return A


def _np_quadratic_grad(A, ys, W, lam):
    """grad of (1/2n) sum_s |Tr[W W^T A_s] - y_s|^2 + (lam/2)|W|^2."""
    f = np.einsum("im,skij,jm->sk", W, A, W)
    res = f - ys
    G = np.einsum("sk,skij->ij", res, A) / A.shape[0]  # dL/dM
    return (G + G.T) @ W + lam * W, 0.5 * np.mean(np.sum(res**2, -1))


def _np_tanh_perceptron_grad(k, xs, ys, W, lam):
    """Hand-written backprop for f(x) = a tanh(U^T x) with W = [a; U]."""
    a, U = W[:k], W[k:]
    h = np.tanh(xs @ U)  # (n, m)
    res = h @ a.T - ys  # (n, k)
    n = xs.shape[0]
    grad_a = res.T @ h / n
    grad_U = xs.T @ ((res @ a) * (1 - h**2)) / n
    return np.concatenate([grad_a, grad_U]) + lam * W, 0.5 * np.mean(np.sum(res**2, -1))


def _np_gd(grad_fn, W0, etas, record):
    """Plain GD with per-step learning rates; loss and M at the record steps."""
    W = np.array(W0, np.float64)
    losses, Ms = {}, {}
    for s in range(len(etas) + 1):
        g, loss = grad_fn(W)
        if s in record:
            losses[s], Ms[s] = loss, W @ W.T
        if s < len(etas):
            W = W - etas[s] * g
    return np.array([losses[s] for s in record]), np.array([Ms[s] for s in record])


def _data(structure, key, n):
    kx, kt = jr.split(key)
    xs = jr.normal(kx, (n, *structure.input_shape))
    teacher = jr.normal(kt, (structure.k, structure.input_shape[0]))
    ys = xs @ teacher.T if isinstance(structure, nqfjax.Perceptron) else xs[:, :1] ** 2
    return xs, ys


# ---------------------------------------------------------------------------
# GD against numpy, in float64 and float32


@pytest.mark.parametrize(
    "structure",
    [nqfjax.QuadraticNet(d=3), nqfjax.Perceptron(d=3, k=2)],
    ids=["quadratic_net", "perceptron"],
)
def test_gd_quadratic_form_matches_numpy(structure, getkey):
    xs, ys = _data(structure, getkey(), 20)
    W0 = 0.3 * jr.normal(getkey(), (structure.p, 4))
    eta, lam, steps = 0.05, 0.1, 60
    res = nqfjax.train(
        structure,
        xs,
        ys,
        num_steps=steps,
        learning_rate=eta,
        W0=W0,
        weight_decay=lam,
        model=nqfjax.QuadraticForm(),
        num_records=10,
    )
    A, ysn = _np_A(structure, xs), np.asarray(ys)
    record = [int(s) for s in res.steps]
    loss, M = _np_gd(
        lambda W: _np_quadratic_grad(A, ysn, W, lam), W0, [eta] * steps, record
    )
    assert record[0] == 0 and record[-1] == steps
    # float64 throughout; 60 steps of round-off ~1e-14, so 1e-10 is generous.
    np.testing.assert_allclose(res.loss, loss, rtol=1e-10)
    np.testing.assert_allclose(res.M, M, rtol=1e-10, atol=1e-13)
    assert res.M.dtype == jnp.float64 and res.W.shape == (structure.p, 4)

    # float32 inputs train in float32; agreement to float32 round-off over 60
    # steps (~60 * 1e-7 relative, amplified mildly by the dynamics).
    res32 = nqfjax.train(
        structure,
        xs.astype(jnp.float32),
        ys.astype(jnp.float32),
        num_steps=steps,
        learning_rate=eta,
        W0=W0.astype(jnp.float32),
        weight_decay=lam,
        model=nqfjax.QuadraticForm(),
        num_records=10,
    )
    assert res32.loss.dtype == jnp.float32 and res32.M.dtype == jnp.float32
    np.testing.assert_allclose(res32.loss, loss, rtol=2e-4)


def test_gd_real_tanh_layer_matches_numpy(getkey):
    structure = nqfjax.Perceptron(d=3, k=2)
    xs, ys = _data(structure, getkey(), 20)
    W0 = 0.5 * jr.normal(getkey(), (structure.p, 3))
    eta, lam, steps = 0.1, 0.05, 50
    res = nqfjax.train(
        structure,
        xs,
        ys,
        num_steps=steps,
        learning_rate=eta,
        W0=W0,
        weight_decay=lam,
        num_records=8,
    )
    record = [int(s) for s in res.steps]
    loss, M = _np_gd(
        lambda W: _np_tanh_perceptron_grad(2, np.asarray(xs), np.asarray(ys), W, lam),
        W0,
        [eta] * steps,
        record,
    )
    # float64 round-off only.
    np.testing.assert_allclose(res.loss, loss, rtol=1e-10)
    np.testing.assert_allclose(res.M, M, rtol=1e-10, atol=1e-13)


def test_layer_offset_is_an_offset_of_the_target(getkey):
    """A layer with f(x; 0) != 0 learns y - f(x; 0): training it on y + offset is
    identical to training the same layer without the offset on y, and its
    quadratic model (f(x; 0) + Tr[W W^T A]) does the same."""

    class Shifted(nqfjax.AbstractStructure):
        base: nqfjax.QuadraticNet
        k: int = eqx.field(static=True, default=1)

        p = property(lambda self: self.base.p)
        input_shape = property(lambda self: self.base.input_shape)
        additive = property(lambda self: True)

        def A(self, x):
            return self.base.A(x)

        def unit(self, w, x):
            return self.base.unit(w, x)

        def layer(self, W, x):
            return self.base.layer(W, x) + 3.0 + jnp.sum(x)

    base = nqfjax.QuadraticNet(d=3)
    xs, ys = _data(base, getkey(), 16)
    W0 = 0.2 * jr.normal(getkey(), (3, 2))
    kw = dict(num_steps=30, learning_rate=0.05, W0=W0, num_records=6)
    offset = 3.0 + jnp.sum(xs, axis=1, keepdims=True)
    b = nqfjax.train(base, xs, ys, **kw)
    for model in (nqfjax.Layer(), nqfjax.QuadraticForm()):
        a = nqfjax.train(Shifted(base), xs, ys + offset, model=model, **kw)
        # the offset cancels exactly; round-off of adding 3 + sum x
        np.testing.assert_allclose(a.loss, b.loss, rtol=1e-12)
        np.testing.assert_allclose(a.M, b.M, rtol=1e-12)


# ---------------------------------------------------------------------------
# weight decay, schedules, momentum


@pytest.mark.parametrize(
    "model", [nqfjax.Layer(), nqfjax.QuadraticForm()], ids=["layer", "quadratic"]
)
def test_weight_decay_closed_form(model, getkey):
    """With zero inputs the data gradient vanishes, and GD on
    (lam/2)|W|^2 gives W_s = (1 - eta lam)^s W_0, M_s = (1 - eta lam)^{2s} M_0:
    the discrete form of dW/dt = -eta lam W, i.e. LotkaVolterra.decay = 2 eta lam
    for M. A factor-2 mistake in the penalty would give (1 - 2 eta lam)^s."""
    structure = nqfjax.Perceptron(d=3, k=2)
    xs = jnp.zeros((5, 3))
    ys = jnp.ones((5, 2))
    W0 = jr.normal(getkey(), (5, 4))
    eta, lam = 0.1, 0.3
    res = nqfjax.train(
        structure,
        xs,
        ys,
        num_steps=40,
        learning_rate=eta,
        W0=W0,
        weight_decay=lam,
        model=model,
        num_records=8,
    )
    factor = (1 - eta * lam) ** (2.0 * np.asarray(res.steps))
    M0 = np.asarray(W0 @ W0.T)
    np.testing.assert_allclose(res.M, factor[:, None, None] * M0, rtol=1e-12)
    # the deprecated words give the same numbers (the same compiled program)
    word = {"Layer": "layer", "QuadraticForm": "quadratic"}[type(model).__name__]
    with pytest.warns(DeprecationWarning, match=f"nqfjax.{type(model).__name__}"):
        old = nqfjax.train(
            structure,
            xs,
            ys,
            num_steps=40,
            learning_rate=eta,
            W0=W0,
            weight_decay=lam,
            model=word,
            num_records=8,
        )
    np.testing.assert_array_equal(old.M, res.M)
    np.testing.assert_allclose(res.W, (1 - eta * lam) ** 40 * W0, rtol=1e-12)
    # the recorded loss is the data loss, without the penalty: (1/2)|y|^2 = 1
    np.testing.assert_allclose(res.loss, 1.0, rtol=1e-14)


def test_schedule_and_momentum_match_numpy(getkey):
    structure = nqfjax.QuadraticNet(d=3)
    xs, ys = _data(structure, getkey(), 20)
    W0 = 0.3 * jr.normal(getkey(), (3, 3))
    steps = 40
    schedule = optax.piecewise_constant_schedule(0.05, {10: 0.4, 25: 0.5})
    etas = [float(schedule(s)) for s in range(steps)]
    np.testing.assert_allclose([etas[9], etas[10], etas[30]], [0.05, 0.02, 0.01])
    res = nqfjax.train(
        structure,
        xs,
        ys,
        num_steps=steps,
        learning_rate=schedule,
        W0=W0,
        model=nqfjax.QuadraticForm(),
        record_at=range(0, steps + 1, 5),
    )
    A, ysn = _np_A(structure, xs), np.asarray(ys)
    record = list(range(0, steps + 1, 5))
    np.testing.assert_array_equal(res.steps, record)
    loss, M = _np_gd(lambda W: _np_quadratic_grad(A, ysn, W, 0.0), W0, etas, record)
    np.testing.assert_allclose(res.loss, loss, rtol=1e-10)  # float64 round-off
    # a constant schedule would not match: the schedule is really applied
    const, _ = _np_gd(
        lambda W: _np_quadratic_grad(A, ysn, W, 0.0), W0, [0.05] * steps, record
    )
    assert np.max(np.abs(const - loss) / loss) > 1e-2

    # heavy-ball momentum through an optimizer factory (learning rate swept):
    # v <- g + mu v, W <- W - eta v (optax.sgd's convention)
    eta, mu = 0.02, 0.9
    res = nqfjax.train(
        structure,
        xs,
        ys,
        num_steps=steps,
        learning_rate=eta,
        optimizer=lambda lr: optax.sgd(lr, momentum=mu),
        W0=W0,
        model=nqfjax.QuadraticForm(),
        record_at=[steps],
    )
    W, v = np.array(W0), np.zeros_like(W0)
    for _ in range(steps):
        g, _ = _np_quadratic_grad(A, ysn, W, 0.0)
        v = g + mu * v
        W = W - eta * v
    np.testing.assert_allclose(res.W, W, rtol=1e-10)  # float64 round-off


# ---------------------------------------------------------------------------
# transforms: vmap over seeds / scales / learning rates, grad, recording


@pytest.mark.slow  # a long physics check (the slow tier)
def test_vmap_equals_separate_runs(getkey):
    structure = nqfjax.Perceptron(d=3, k=1)
    xs, ys = _data(structure, getkey(), 24)
    keys = jr.split(getkey(), 3)
    scales = jnp.array([1e-3, 1e-2, 1e-1])
    etas = jnp.array([0.05, 0.1, 0.2])

    def run(key, scale, eta):
        return nqfjax.train(
            structure,
            xs,
            ys,
            num_steps=200,
            learning_rate=eta,
            key=key,
            init_scale=scale,
            width=3,
            batch_size=8,
            num_records=12,
        )

    batched = jax.vmap(run)(keys, scales, etas)
    assert batched.loss.shape == (3, len(batched.steps[0]))
    assert batched.M.shape == (3, len(batched.steps[0]), 4, 4)
    for i in range(3):
        single = run(keys[i], scales[i], etas[i])
        # same program per member; vmapped matmuls may reassociate sums
        np.testing.assert_allclose(batched.loss[i], single.loss, rtol=1e-12)
        np.testing.assert_allclose(batched.M[i], single.M, rtol=1e-10, atol=1e-20)
    # the init is sigma * Z with Z standard normal from the key: M(0) = sigma^2 Z Z^T
    Z = jr.normal(jr.split(keys[1])[0], (4, 3))
    np.testing.assert_allclose(batched.M[1, 0], 1e-4 * Z @ Z.T, rtol=1e-12)


def test_grad_through_training(getkey):
    """d(final loss)/d(eta, sigma) by autodiff against central finite
    differences (float64; step 1e-6 relative gives ~1e-8 truncation+round-off)."""
    structure = nqfjax.QuadraticNet(d=3)
    xs, ys = _data(structure, getkey(), 16)
    Z = jr.normal(getkey(), (3, 3))

    def final_loss(params):
        eta, sigma = params
        res = nqfjax.train(
            structure,
            xs,
            ys,
            num_steps=50,
            learning_rate=eta,
            W0=Z,
            init_scale=sigma,
            model=nqfjax.QuadraticForm(),
            record_at=[50],
        )
        return res.loss[-1]

    x = jnp.array([0.02, 0.1])
    g = jax.grad(final_loss)(x)
    fd = []
    for i in range(2):
        h = 1e-6 * x[i]
        e = jnp.zeros(2).at[i].set(h)
        fd.append((final_loss(x + e) - final_loss(x - e)) / (2 * h))
    np.testing.assert_allclose(g, fd, rtol=1e-5)


def test_basis_snapshots_and_record_steps(getkey):
    structure = nqfjax.QuadraticNet(d=3)
    xs, ys = _data(structure, getkey(), 16)
    basis = jnp.linalg.qr(jr.normal(getkey(), (3, 3)))[0][:, :2]
    kw = dict(num_steps=100, learning_rate=0.05, key=getkey(), init_scale=0.1, width=2)
    full = nqfjax.train(structure, xs, ys, **kw, num_records=12)
    diag = nqfjax.train(structure, xs, ys, **kw, num_records=12, basis=basis)
    assert diag.M is None and full.m is None and diag.m.shape == (len(full.steps), 2)
    expected = jnp.einsum("pq,tpr,rq->tq", basis, full.M, basis)
    np.testing.assert_allclose(diag.m, expected, rtol=1e-12)
    np.testing.assert_allclose(diag.loss, full.loss, rtol=1e-14)
    # log-spaced record points: 0, then geometric from 1 to num_steps
    steps = np.asarray(full.steps)
    assert steps[0] == 0 and steps[1] == 1 and steps[-1] == 100
    ratios = steps[2:] / steps[1:-1]
    assert np.all(ratios > 1) and np.max(ratios) < 2.0 * 100 ** (1 / 10)
    # the fewest records: the start and the end
    assert nqfjax.train(structure, xs, ys, **kw, num_records=2).steps.tolist() == [
        0,
        100,
    ]


# ---------------------------------------------------------------------------
# SGD: minibatches drawn from the key, following GD in expectation


def _sign_symmetric_samples(base, scales):
    """Every sign pattern of each base sample: odd moments vanish exactly, so
    the coordinate axes are the modes of a quadratic net
    (docs/theory/lotka-volterra.md)."""
    d = base.shape[1]
    signs = np.array(np.meshgrid(*[[1.0, -1.0]] * d)).reshape(d, -1).T
    return (base[:, None, :] * signs[None]).reshape(-1, d) * np.asarray(scales)


def test_minibatch_uses_the_key(getkey):
    structure = nqfjax.QuadraticNet(d=3)
    xs, ys = _data(structure, getkey(), 32)
    W0 = 0.1 * jr.normal(getkey(), (3, 3))
    k1, k2 = getkey(), getkey()

    def run(key, b):
        res = nqfjax.train(
            structure,
            xs,
            ys,
            num_steps=100,
            learning_rate=0.05,
            W0=W0,
            key=key,
            batch_size=b,
            model=nqfjax.QuadraticForm(),
            num_records=10,
            snapshots=False,
        )
        assert res.M is None and res.m is None  # loss only
        return res.loss

    a, a2, b = run(k1, 4), run(k1, 4), run(k2, 4)
    np.testing.assert_array_equal(a, a2)  # same key, same curve, bit for bit
    assert np.max(np.abs(a - b) / a) > 1e-3  # different key, different batches
    # batch_size = n is full-batch GD whatever the key
    full = nqfjax.train(
        structure,
        xs,
        ys,
        num_steps=100,
        learning_rate=0.05,
        W0=W0,
        model=nqfjax.QuadraticForm(),
        num_records=10,
        snapshots=False,
    ).loss
    np.testing.assert_allclose(run(k2, 32), full, rtol=1e-13)


@pytest.mark.slow  # a long physics check (the slow tier)
def test_sgd_follows_gd_in_expectation():
    r"""Minibatch gradients are unbiased with covariance f(b) Sigma,
    f(b) = (n - b)/(b (n - 1)) (sampling without replacement). To leading order
    in the noise the deviation of W (hence of M = W W^T) from GD is linear in the
    noise, so (i) the spread of M over seeds scales as sqrt(f(b)) and (ii) the
    seed average of M follows GD within its standard error; the loss, quadratic
    around the plateaus, picks up an O(eta f(b)) bias (the stationary excess loss
    of SGD), so (iii) its seed average follows GD within the standard error plus
    a bias scaling like f(b). Tolerances for b = 16 are *derived from the batch
    size*: the b = 4 spread and bias rescaled by f(16)/f(4).
    """
    structure = nqfjax.QuadraticNet(d=3)
    rng = np.random.default_rng(0)
    xs = jnp.asarray(rng.normal(size=(64, 3)) * np.array([1.0, 0.8, 0.6]))
    ys = (xs[:, :1] ** 2) + 0.5 * (xs[:, 1:2] ** 2)
    W0 = jnp.asarray(1e-2 * rng.normal(size=(3, 3)))
    n, eta, steps, seeds = 64, 0.008, 1250, 128
    kw = dict(
        num_steps=steps,
        learning_rate=eta,
        W0=W0,
        model=nqfjax.QuadraticForm(),
        num_records=30,
    )
    gd = nqfjax.train(structure, xs, ys, **kw)
    gd_loss, gd_M = np.asarray(gd.loss)[1:], np.asarray(gd.M)[1:]
    keys = jr.split(jr.key(3), seeds)
    spread, mean_M, mean_loss, loss_spread = {}, {}, {}, {}
    for b in (4, 16):
        res = jax.vmap(
            lambda k: nqfjax.train(structure, xs, ys, key=k, batch_size=b, **kw)
        )(keys)
        M = np.asarray(res.M)[:, 1:]
        spread[b] = np.sqrt(np.sum(M.var(0, ddof=1), axis=(1, 2)))
        mean_M[b] = M.mean(0)
        mean_loss[b] = np.asarray(res.loss)[:, 1:].mean(0)
        loss_spread[b] = np.asarray(res.loss)[:, 1:].std(0, ddof=1)
    f = {b: (n - b) / (b * (n - 1)) for b in (4, 16)}

    # (i) spread ratio, where the b = 4 spread is small enough for linear response
    # (below 30% of |M|; measured: all points but the two mid-transition ones).
    # Each spread from 128 seeds has relative error ~1/sqrt(2 * 127) ~ 6%, a ratio
    # of two ~9%: 30% per point is > 3 sigma, 10% on the median.
    linear = spread[4] < 0.3 * np.linalg.norm(gd_M, axis=(1, 2))
    assert linear.sum() >= 20
    ratio = (spread[4] / spread[16]) / np.sqrt(f[4] / f[16])
    assert np.all(np.abs(ratio[linear] - 1) < 0.3), ratio
    assert abs(np.median(ratio[linear]) - 1) < 0.1, ratio

    # (ii) mean of M within 4 predicted standard errors of GD at every record
    # (the norm of a 9-vector of errors is ~1 standard error; measured max ~2.3)
    predicted_se = spread[4] * np.sqrt(f[16] / f[4]) / np.sqrt(seeds)
    gap = np.linalg.norm(mean_M[16] - gd_M, axis=(1, 2))
    assert np.all(gap <= 4 * predicted_se), gap / predicted_se

    # (iii) mean loss: within 4 of its standard errors plus the b = 4 bias
    # rescaled by f(16)/f(4) (measured: at most ~0.45 of this tolerance)
    bias_4 = np.abs(mean_loss[4] - gd_loss)
    tol = (f[16] / f[4]) * bias_4 + 4 * loss_spread[16] / np.sqrt(seeds)
    assert np.all(np.abs(mean_loss[16] - gd_loss) <= tol)
    # and SGD is not GD: the spread is real (the checks above could fail)
    assert np.min(spread[16] / np.linalg.norm(gd_M, axis=(1, 2))) > 1e-3


# ---------------------------------------------------------------------------
# Adam is not the M-space flow


def _two_mode_data():
    # sign-symmetric inputs with covariance diag(1, 0.36): the axes are the
    # modes; teacher M* = diag(1, 1/0.36) so both modes have the same output
    # scale but growth rates r_k that differ through the covariance.
    rng = np.random.default_rng(0)
    xs = _sign_symmetric_samples(rng.normal(size=(16, 2)), [1.0, 0.6])
    ys = (xs**2 @ np.array([1.0, 1 / 0.36]))[:, None]
    return nqfjax.QuadraticNet(d=2), jnp.asarray(xs), jnp.asarray(ys)


def test_adam_departs_from_the_m_flow():
    """GD follows the closed M-space flow (d ln m_k/dt = r_k - (B m)_k): the
    weaker mode switches on ~ln(m*/eps)/r_k, many times later than the stronger
    one, and since M = W W^T is invariant under W -> W O, GD gives the same M(t)
    from W0 and W0 O. Adam normalises each coordinate's gradient: every mode
    grows at ~lr per step whatever r_k, so the modes switch on much closer
    together, and the result depends on how the init is rotated (Adam is not
    rotation-equivariant)."""
    structure, xs, ys = _two_mode_data()
    W0 = 1e-3 * jnp.eye(2, 3)  # one unit per mode, a third unit at zero
    rot = jnp.asarray(np.linalg.qr(np.random.default_rng(1).normal(size=(3, 3)))[0])
    kw = dict(
        num_steps=3000, model=nqfjax.QuadraticForm(), record_at=range(0, 3001, 10)
    )

    def switch_times(res):
        diag = np.asarray(jnp.diagonal(res.M, axis1=1, axis2=2))
        # both modes converge to m* = (1, 1/0.36); switch-on = half-way
        np.testing.assert_allclose(diag[-1], [1.0, 1 / 0.36], rtol=1e-3)
        return np.array(
            [res.steps[np.argmax(diag[:, k] >= 0.5 * diag[-1, k])] for k in (0, 1)]
        )

    runs = {}
    for name, opt in [
        ("gd", dict(learning_rate=0.01)),
        ("adam", dict(learning_rate=3e-3, optimizer=optax.adam)),
    ]:
        runs[name] = [
            nqfjax.train(structure, xs, ys, W0=W, **opt, **kw) for W in (W0, W0 @ rot)
        ]
    gd, gd_rot = runs["gd"]
    adam, adam_rot = runs["adam"]
    t_gd, t_adam = switch_times(gd), switch_times(adam)
    # measured: GD 140 and 1850 steps (ratio 13), Adam 130 and 600 (ratio 4.6)
    assert t_gd[1] / t_gd[0] > 10
    assert t_adam[1] / t_adam[0] < 0.5 * t_gd[1] / t_gd[0]

    def rel_gap(a, b):
        return np.max(
            np.linalg.norm(a.M - b.M, axis=(1, 2)) / np.linalg.norm(a.M, axis=(1, 2))
        )

    assert rel_gap(gd, gd_rot) < 1e-10  # float64 round-off
    np.testing.assert_array_equal(switch_times(gd_rot), t_gd)
    # Adam from the rotated init switches the weak mode on ~3x earlier
    # (measured 180 vs 600 steps) and M differs by O(1) (measured ~2)
    assert switch_times(adam_rot)[1] < 0.6 * t_adam[1]
    assert rel_gap(adam, adam_rot) > 0.5


# ---------------------------------------------------------------------------
# what the recorded loss is (each documented convention against the value)


@pytest.fixture(scope="module")
def attention_data():
    """A softmax QK head, whose value at zero weights is the mean value (not
    zero), with targets of a teacher head of the same architecture: the target
    includes that offset, so a loss that subtracted f(x; 0) from the model but
    not from y would be ~|mean value|^2 / 2 instead of small."""
    structure = nqfjax.QKAttention(T=4, d=3)
    rng = np.random.default_rng(0)
    xs = jnp.asarray(rng.normal(size=(8, 4, 3)))
    teacher = 0.3 * jnp.asarray(rng.normal(size=(structure.p, 2)))
    ys = jax.vmap(lambda x: structure.layer(teacher, x))(xs)
    offsets = jax.vmap(lambda x: structure.layer(jnp.zeros((structure.p, 1)), x))(xs)
    assert float(jnp.min(jnp.abs(offsets))) > 0.1  # the value at zero is not zero
    return structure, xs, ys, offsets


def _explicit_quadratic_loss(structure, xs, ys, offsets, M):
    """(1/2n) sum_s sum_j (f_j(x_s; 0) + Tr[M A_j(x_s)] - y_sj)^2, from the public
    `A(x)` (not the batched contraction the library uses)."""
    A = np.asarray(jax.vmap(structure.A)(jnp.asarray(xs)))  # (n, k, p, p)
    f = np.asarray(offsets) + np.einsum("skij,ij->sk", A, np.asarray(M))
    return 0.5 * np.mean(np.sum((f - np.asarray(ys)) ** 2, axis=-1))


def test_loss_conventions_on_softmax_attention(attention_data):
    """`TrainResult.loss`, `Task.loss` and `LotkaVolterra.loss` are what their
    docstrings say, on a layer with f(x; 0) != 0 (float64: round-off only)."""
    structure, xs, ys, offsets = attention_data
    W0 = 0.05 * jr.normal(jr.key(1), (structure.p, 3))
    kw = dict(num_steps=40, learning_rate=0.5, W0=W0, record_at=[0, 10, 40])

    # model=nqfjax.Layer(): (1/2n) sum |f(x; W) - y|^2 with the real layer, offset kept
    res = nqfjax.train(structure, xs, ys, **kw)

    def layer_output(W):
        return np.asarray(jax.vmap(structure.layer, in_axes=(None, 0))(W, xs))

    def layer_loss(W):
        return 0.5 * np.mean(np.sum((layer_output(W) - np.asarray(ys)) ** 2, axis=-1))

    np.testing.assert_allclose(res.loss[0], layer_loss(W0), rtol=1e-12)
    np.testing.assert_allclose(res.loss[-1], layer_loss(res.W), rtol=1e-12)
    # the formula the docstring used to give, |f(x; W) - f(x; 0) - y|^2 / 2, is
    # another number altogether here (measured ~50x larger)
    f0 = layer_output(W0)
    old = 0.5 * np.mean(np.sum((f0 - np.asarray(offsets) - np.asarray(ys)) ** 2, -1))
    assert old > 10 * float(res.loss[0])

    # model=nqfjax.QuadraticForm(): f(x; 0) + Tr[W W^T A(x)], which is Task.loss(W W^T)
    task = nqfjax.task_from_samples(structure, xs, ys)
    quad = nqfjax.train(structure, xs, ys, model=nqfjax.QuadraticForm(), **kw)
    for i in range(3):
        explicit = _explicit_quadratic_loss(structure, xs, ys, offsets, quad.M[i])
        np.testing.assert_allclose(quad.loss[i], explicit, rtol=1e-12)
        np.testing.assert_allclose(task.loss(quad.M[i]), explicit, rtol=1e-10)

    # Task.loss at any symmetric M (not only W W^T)
    B = jr.normal(jr.key(2), (structure.p, structure.p))
    M = 0.3 * (B + B.T)
    np.testing.assert_allclose(
        task.loss(M),
        _explicit_quadratic_loss(structure, xs, ys, offsets, M),
        rtol=1e-10,
    )


def test_lotka_volterra_loss_is_the_task_loss_on_softmax_attention(attention_data):
    """`LotkaVolterra.loss(m)` of `lv_reduce` is the task's loss at the diagonal
    `M = basis diag(m) basis^T`. One sample and one output make the attention
    task reducible (K[X] = A Tr[A X] and C = (y - f(x; 0)) A share A's
    eigenbasis); its loss keeps the offset f(x; 0) != 0."""
    structure, xs, ys, offsets = attention_data
    x1 = xs[:1]
    y1 = jax.vmap(lambda x: structure.layer(0.6 * jnp.ones((structure.p, 1)), x))(x1)
    task = nqfjax.task_from_samples(structure, x1, y1)
    lv, basis = nqfjax.lv_reduce(task)
    m = jnp.abs(jr.normal(jr.key(3), (lv.p,)))
    M = basis @ jnp.diag(m) @ basis.T
    off = jax.vmap(lambda x: structure.layer(jnp.zeros((structure.p, 1)), x))(x1)
    explicit = _explicit_quadratic_loss(structure, x1, y1, off, M)
    np.testing.assert_allclose(task.loss(M), explicit, rtol=1e-10)
    np.testing.assert_allclose(lv.loss(m), explicit, rtol=1e-9)


# ---------------------------------------------------------------------------
# divergence


def _diverging_setup():
    structure = nqfjax.Perceptron(d=3, k=2)
    rng = np.random.default_rng(0)
    # float32: the path users get by default
    xs = jnp.asarray(rng.normal(size=(16, 3)), jnp.float32)
    ys = jnp.asarray(rng.normal(size=(16, 2)), jnp.float32)
    W0 = jnp.asarray(0.1 * rng.normal(size=(structure.p, 4)), jnp.float32)
    return structure, xs, ys, W0


def _first_bad(loss, reference, factor=1e4):
    """The first index where a loss curve recorded at every step is non-finite
    or above factor * reference; -1 for none."""
    bad = ~np.isfinite(loss) | (loss > factor * reference)
    return int(np.argmax(bad)) if bad.any() else -1


def test_divergence_is_flagged_with_its_step():
    """A learning rate of 50 blows up (the loss passes 1e4 times its start within
    a few steps, then overflows to inf and NaN) and is flagged at the first step
    whose loss is beyond 1e4 x max(initial loss, loss at W = 0); a learning rate
    of 0.05 converges and is not flagged. Recording every step gives the
    reference independently of the flag."""
    structure, xs, ys, W0 = _diverging_setup()
    steps = 60
    every = list(range(steps + 1))
    # the loss at zero weights of a perceptron is |y|^2 / 2
    L_zero = 0.5 * float(np.mean(np.sum(np.asarray(ys) ** 2, axis=-1)))
    for lr, diverges in ((0.05, False), (50.0, True)):
        res = nqfjax.train(
            structure,
            xs,
            ys,
            num_steps=steps,
            learning_rate=lr,
            W0=W0,
            record_at=every,
        )
        loss = np.asarray(res.loss)
        expected = _first_bad(loss, max(loss[0], L_zero))
        assert bool(res.diverged) is diverges
        assert int(res.diverged_at) == expected
        if diverges:
            assert 0 < expected < steps and not np.isfinite(loss[-1])
        else:
            assert np.all(np.isfinite(loss)) and loss[-1] < loss[0]
        # sparse records find it at the same step: the check runs every step
        sparse = nqfjax.train(
            structure,
            xs,
            ys,
            num_steps=steps,
            learning_rate=lr,
            W0=W0,
            record_at=[0, steps],
        )
        assert int(sparse.diverged_at) == expected

    # under vmap: one flag per run, the same as the separate runs
    def run(lr):
        return nqfjax.train(
            structure,
            xs,
            ys,
            num_steps=steps,
            learning_rate=lr,
            W0=W0,
            record_at=[0, steps],
        )

    lrs = jnp.asarray([0.05, 50.0, 0.1], jnp.float32)
    batched = jax.vmap(run)(lrs)
    np.testing.assert_array_equal(batched.diverged, [False, True, False])
    for i, lr in enumerate(lrs):
        assert int(batched.diverged_at[i]) == int(run(lr).diverged_at)


def test_minibatch_divergence_is_never_flagged_early():
    """With minibatches the per-step check sees (b/n) x the batch loss, a lower
    bound on the full-data loss: a sparse record flags no earlier than the true
    first step (from a run recording every step, same key so the same
    trajectory), and the dense record finds that step exactly."""
    structure, xs, ys, W0 = _diverging_setup()
    steps = 80
    kw = dict(num_steps=steps, W0=W0, batch_size=4, key=jr.key(5))
    for lr in (0.05, 2.0, 50.0):
        dense = nqfjax.train(
            structure, xs, ys, learning_rate=lr, record_at=range(steps + 1), **kw
        )
        sparse = nqfjax.train(structure, xs, ys, learning_rate=lr, num_records=5, **kw)
        assert bool(dense.diverged) == bool(sparse.diverged)
        if lr == 0.05:
            assert not bool(dense.diverged) and int(dense.diverged_at) == -1
        else:
            first = int(dense.diverged_at)
            assert 0 < first <= int(sparse.diverged_at)
            L_zero = 0.5 * float(np.mean(np.sum(np.asarray(ys) ** 2, axis=-1)))
            ref = max(float(dense.loss[0]), L_zero)
            assert first == _first_bad(np.asarray(dense.loss), ref)


def test_key_must_be_a_prng_key(getkey):
    """An int seed, or an array that is not one key, is refused with an error
    naming `key` (it used to fail inside JAX's PRNG code); new-style typed keys
    and legacy uint32 keys are both accepted and draw the same init."""
    structure = nqfjax.Perceptron(d=3, k=1)
    xs, ys = _data(structure, getkey(), 8)
    kw = dict(num_steps=3, learning_rate=0.1, init_scale=0.1, width=2)
    for bad in (0, 3.5, np.arange(3), jr.split(jr.key(0), 2), "seed"):
        with pytest.raises(ValueError, match="`key` must be one PRNG key"):
            nqfjax.train(structure, xs, ys, key=bad, **kw)
    typed = nqfjax.train(structure, xs, ys, key=jr.key(7), **kw)
    legacy = nqfjax.train(structure, xs, ys, key=jr.PRNGKey(7), **kw)
    np.testing.assert_array_equal(typed.M, legacy.M)
    # train_method and compare_methods pass it on, and say the same
    with pytest.raises(ValueError, match="`key`"):
        nqfjax.train_method(
            nqfjax.Method(0.1, batch_size=((0, 2), (2, 4))),
            structure,
            xs,
            ys,
            num_steps=3,
            W0=jnp.ones((structure.p, 2)),
            key=0,
        )
    # under vmap the mapped keys are still keys
    res = jax.vmap(lambda k: nqfjax.train(structure, xs, ys, key=k, **kw).loss)(
        jr.split(jr.key(0), 2)
    )
    assert res.shape[0] == 2


# ---------------------------------------------------------------------------
# bad input


def test_bad_input(getkey):
    structure = nqfjax.QuadraticNet(d=3)
    xs, ys = _data(structure, getkey(), 8)
    key = getkey()
    kw = dict(num_steps=5, learning_rate=0.1, key=key, init_scale=0.1, width=2)

    def raises(match, **over):
        with pytest.raises(ValueError, match=match):
            nqfjax.train(
                structure, over.pop("xs", xs), over.pop("ys", ys), **(kw | over)
            )

    raises("init_scale", init_scale=0.0)
    raises("init_scale", init_scale=-1.0)
    raises("init_scale", init_scale=jnp.nan)
    raises("learning_rate", learning_rate=-0.1)
    raises("weight_decay", weight_decay=-1.0)
    raises("xs", xs=xs.at[0, 0].set(jnp.nan))
    raises("ys", ys=ys.at[0, 0].set(jnp.inf))
    raises(r"`xs` must have shape \(n, \*input_shape\) = \(n, 3\)", xs=xs[:, :2])
    raises(r"`ys` must have shape \(8, 1\)", ys=ys[:5])
    raises(r"`ys` must have shape \(8, 1\)", ys=ys[:, 0])
    raises(r"`W0` must have shape \(p, m\) = \(3, m\)", W0=jnp.ones((2, 2)))
    raises("W0", W0=jnp.full((3, 2), jnp.nan))
    raises("width", W0=jnp.ones((3, 2)), width=3)
    raises("key", key=None)
    raises("width", width=None)
    raises("batch_size", batch_size=9)
    raises("num_steps", num_steps=0)
    raises("num_steps", num_steps=5.0)
    raises("model", model="linear")
    raises("learning_rate", optimizer=optax.sgd(0.1))
    raises("record_at", record_at=[0, 3, 3])
    raises("record_at", record_at=[0, 6])
    raises("divergence_factor", divergence_factor=0.5)
    raises(r"`basis` must have shape \(p, q\)", basis=jnp.eye(2))

    # the same value checks under vmap/jit, where they are eqx.error_if errors
    # (RuntimeError: jax's JaxRuntimeError carrying the message)
    def run(scale):
        return nqfjax.train(structure, xs, ys, **(kw | dict(init_scale=scale))).loss

    with pytest.raises(RuntimeError, match="init_scale"):
        jax.vmap(run)(jnp.array([0.1, -0.1]))
    with pytest.raises(RuntimeError, match="xs"):
        jax.jit(lambda x: nqfjax.train(structure, x, ys, **kw).loss)(
            xs.at[1, 1].set(jnp.nan)
        )
    ok = jax.vmap(run)(jnp.array([0.1, 0.2]))  # and good values pass
    assert np.all(np.isfinite(ok))
