"""The factored M-space flow `solve_mflow_factored` (and the task's factored
gradient and loss) against `solve_mflow`, central finite differences, float32,
and its argument checks. The solves are in the slow tier (each compiles a
diffrax solve); the fast tier checks the task's factored pass and the checks."""

import diffrax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nqfjax
from nqfjax.tasks.base import Task
from nqfjax.tasks.sampled import _sampled_gradient_factor


TOL = 1e-10
CTRL = diffrax.PIDController(rtol=TOL, atol=TOL)


def _quadratic(theta=0.4, seed=0, P=5):
    """Quadratic network, x ~ N(0, S) not commuting with the rank-2 teacher."""
    rng = np.random.default_rng(seed)
    Q = np.linalg.qr(rng.standard_normal((P, P)))[0]
    s = np.linspace(1.0, 0.3, P)
    mu = np.zeros(P)
    mu[:2] = [3.0, 1.0]
    R = np.eye(P)
    R[:2, :2] = [[np.cos(theta), -np.sin(theta)], [np.sin(theta), np.cos(theta)]]
    S = (Q @ R) * s @ (Q @ R).T
    return nqfjax.gaussian_quadratic_task(S, Q * mu @ Q.T)


@pytest.fixture(scope="module")
def wine():
    """The wine perceptron's task (p = 3 + 13 = 16), float64, and its rate of
    fastest growth 0.02 per step."""
    xs, ys = nqfjax.load_dataset("wine", dtype=np.float64)
    task = nqfjax.task_from_samples(nqfjax.Perceptron(d=13, k=3), xs, ys)
    eta = 0.02 / (4 * float(np.max(np.linalg.eigvalsh(np.asarray(task.C)))))
    return xs, ys, task, eta


def _outer(W):
    return jnp.einsum("tpr,tqr->tpq", W, W)


def test_factored_gradient_and_loss_of_a_sampled_task(wine, getkey):
    # the residuals' pass over the samples (chunks that do not divide n, and one
    # chunk) against the defaults through G(W W^T) and L(W W^T)
    xs, ys, task, _ = wine
    W = 0.3 * jax.random.normal(getkey(), (task.p, 4))
    for batch_size in (50, None):
        t = nqfjax.task_from_samples(task.structure, xs, ys, batch_size=batch_size)
        np.testing.assert_allclose(
            t.gradient_factor(W), Task.gradient_factor(t, W), rtol=1e-12, atol=1e-13
        )
        np.testing.assert_allclose(t.loss_factor(W), t.loss(W @ W.T), rtol=1e-12)
    # the perceptron's closed-form hooks take the samples in one chunk whatever
    # batch_size (a chunk holds only the outputs beside the resident data); its
    # chunked pass, as a structure with the default hooks runs it:
    assert t._factor_batch() == xs.shape[0]
    chunked = _sampled_gradient_factor(t.structure, t.xs, t.targets, W, 50)
    np.testing.assert_allclose(
        chunked, Task.gradient_factor(t, W), rtol=1e-12, atol=1e-13
    )
    with pytest.raises(ValueError, match=r"`W` must have shape \(p, r\) = \(16, r\)"):
        task.gradient_factor(W[:5])


@pytest.mark.slow  # two or more compiled solves (~10-30 s on 2 shared cores)
def test_factored_flow_is_the_mflow_on_a_gaussian_task(getkey):
    # M = W W^T against solve_mflow from M0 = W0 W0^T (rank 2 of p = 5), at
    # tolerance 1e-10: agreement to ~1e-8 relative (the error of both solves)
    task = _quadratic()
    W0 = 1e-3 * jax.random.normal(getkey(), (task.p, 2))
    ts = jnp.concatenate([jnp.zeros(1), jnp.geomspace(0.5, 200.0, 40)])
    fact = nqfjax.solve_mflow_factored(task, W0, ts, 0.05, stepsize_controller=CTRL)
    full = nqfjax.solve_mflow(
        task, W0 @ W0.T, ts, 0.05, solver=diffrax.Tsit5(), stepsize_controller=CTRL
    )
    assert fact.ys.shape == (ts.shape[0], task.p, 2)
    M = _outer(fact.ys)
    scale = jnp.max(jnp.abs(full.ys), axis=(1, 2), keepdims=True)
    np.testing.assert_allclose(M / scale, full.ys / scale, rtol=0, atol=1e-7)
    np.testing.assert_allclose(fact.loss, full.loss, rtol=0, atol=1e-8 * full.loss[0])
    np.testing.assert_allclose(fact.ys[0], W0, rtol=1e-12)
    # the flow of M does not depend on the factor: W0 Q gives the same M(t)
    Q = np.linalg.qr(np.random.default_rng(1).standard_normal((2, 2)))[0]
    rot = nqfjax.solve_mflow_factored(task, W0 @ Q, ts, 0.05, stepsize_controller=CTRL)
    np.testing.assert_allclose(_outer(rot.ys) / scale, M / scale, rtol=0, atol=1e-8)
    assert fact.loss[-1] < 0.1 * fact.loss[0]


@pytest.mark.slow  # two or more compiled solves (~10-30 s on 2 shared cores)
def test_factored_flow_is_the_mflow_on_wine_and_keeps_the_rank(wine, getkey):
    # real data (the input covariance does not commute with C), r = 4 < p = 16,
    # Tsit5 for both, the default float64 tolerances 1e-9: ~1e-8 apart
    _, _, task, eta = wine
    W0 = 1e-4 * jax.random.normal(getkey(), (task.p, 4))
    ts = jnp.geomspace(1.0, 2500.0, 30)
    fact = nqfjax.solve_mflow_factored(task, W0, ts, eta)
    full = nqfjax.solve_mflow(task, W0 @ W0.T, ts, eta, solver=diffrax.Tsit5())
    M = np.asarray(_outer(fact.ys))
    top = np.max(np.linalg.eigvalsh(np.asarray(full.ys)), axis=1)
    np.testing.assert_allclose(
        M / top[:, None, None], full.ys / top[:, None, None], rtol=0, atol=1e-7
    )
    np.testing.assert_allclose(fact.loss, full.loss, rtol=1e-7)
    # two modes learned (eigenvalues O(1) from 1e-8)
    lam = np.linalg.svd(np.asarray(fact.ys[-1]), compute_uv=False) ** 2
    assert lam[1] > 0.1 and lam[0] / lam[-1] > 1e5
    # rank M <= r by construction: r columns, and M's (r+1)-th eigenvalue is 0
    # to the roundoff of forming M from them
    assert fact.ys.shape[-1] == 4
    ev = np.linalg.eigvalsh(M[-1])[::-1]
    assert ev[4] < 1e-14 * ev[0]


@pytest.mark.slow  # two or more compiled solves (~10-30 s on 2 shared cores)
def test_factored_flow_gradient_in_the_learning_rate(getkey):
    # reverse mode through the default adjoint against central differences
    task = _quadratic(P=4)
    W0 = 1e-2 * jax.random.normal(getkey(), (task.p, 2))
    ts = jnp.array([0.0, 20.0, 60.0])

    def loss(eta):
        sol = nqfjax.solve_mflow_factored(task, W0, ts, eta, stepsize_controller=CTRL)
        return sol.loss[-1]

    eta, h = 0.05, 1e-5
    grad = jax.grad(loss)(eta)
    fd = (loss(eta + h) - loss(eta - h)) / (2 * h)
    np.testing.assert_allclose(grad, fd, rtol=1e-5)
    assert abs(float(grad)) > 1e-3


@pytest.mark.slow  # two or more compiled solves (~10-30 s on 2 shared cores)
def test_factored_flow_in_float32(wine):
    # float32 data and factor, the float32 default tolerances (rtol 1e-5, atol
    # 1e-6) against float64: the loss within 2e-4 relative (measured 4e-6:
    # the tolerances, amplified along the exponential growth of the modes)
    xs, ys, task64, eta = wine
    task32 = nqfjax.task_from_samples(
        task64.structure, xs.astype(np.float32), ys.astype(np.float32)
    )
    W0 = 1e-4 * jax.random.normal(jax.random.key(3), (task64.p, 4))
    ts = jnp.geomspace(1.0, 2500.0, 30)
    s32 = nqfjax.solve_mflow_factored(task32, W0.astype(jnp.float32), ts, eta)
    s64 = nqfjax.solve_mflow_factored(task64, W0, ts, eta)
    assert s32.ys.dtype == jnp.float32 and s32.loss.dtype == jnp.float32
    np.testing.assert_allclose(s32.loss, s64.loss, rtol=2e-4)


def test_factored_flow_bad_input():
    task = _quadratic()
    W0 = 1e-3 * jnp.ones((task.p, 2))
    ts = jnp.array([0.0, 1.0])
    solve = nqfjax.solve_mflow_factored
    with pytest.raises(ValueError, match=r"`W0` must have shape \(p, r\) = \(5, r\)"):
        solve(task, jnp.ones((4, 2)), ts, 0.1)
    with pytest.raises(ValueError, match=r"`W0` must have shape"):
        solve(task, jnp.ones(5), ts, 0.1)
    with pytest.raises(ValueError, match="`W0` must be nonzero"):
        solve(task, jnp.zeros((5, 2)), ts, 0.1)
    with pytest.raises(ValueError, match="`W0` contains NaN"):
        solve(task, W0.at[0, 0].set(jnp.nan), ts, 0.1)
    with pytest.raises(ValueError, match="`learning_rate` must be > 0"):
        solve(task, W0, ts, -0.1)
    with pytest.raises(ValueError, match="`weight_decay` must be non-negative"):
        solve(task, W0, ts, 0.1, -1.0)
    with pytest.raises(ValueError, match="strictly increasing"):
        solve(task, W0, jnp.array([1.0, 0.5]), 0.1)
    with pytest.raises(ValueError, match="at least one time"):
        solve(task, W0, jnp.zeros(0), 0.1)
    with pytest.raises(ValueError, match="`task` must be a Task"):
        solve("task", W0, ts, 0.1)
    with pytest.raises(ValueError, match="`solver` must be a diffrax"):
        solve(task, W0, ts, 0.1, solver="tsit5")


# --------------------------------------------------------------------------------
# the engine


def test_factor_of(getkey):
    # pure numpy: the eigh factor of a rank-3 M0 (the factored engine's start
    # when it is given M0 without a factor)
    from nqfjax.experiments.engines import factor_of

    rng = np.random.default_rng(0)
    W = rng.standard_normal((7, 3))
    F = factor_of(W @ W.T)
    assert F.shape == (7, 3)
    np.testing.assert_allclose(F @ F.T, W @ W.T, rtol=0, atol=1e-12)
    assert factor_of(np.zeros((4, 4))).shape == (4, 1)


RAW_STRUCTURE = nqfjax.Perceptron(d=3, k=2)


@pytest.fixture(scope="module")
def raw():
    """Gaussian inputs and a tanh teacher (does not reduce), p = 5."""
    rng = np.random.default_rng(0)
    xs = rng.normal(size=(40, 3))
    return xs, np.tanh(xs @ rng.normal(size=(3, 2)))


def test_predict_gives_the_factored_engine_its_weights(monkeypatch, raw):
    # predict passes W0 (the weights train would draw) to an engine whose run
    # takes `factor`, and M0 = W0 W0^T beside it; other engines get M0 alone
    seen = {}

    def run(self, task, M0, ts, learning_rate, weight_decay=0.0, *, W0=None):
        seen["M0"], seen["factor"] = M0, W0
        t = np.asarray(ts, np.float64)
        return nqfjax.experiments.engines.EngineRun(
            engine="mflow",
            reason="stand-in",
            violation=float("nan"),
            loss=1.0 / (1.0 + t),
            mode_curves=(1.0 + t)[:, None],
            modes=np.eye(task.p)[:, :1],
            mode_values=np.array([1.0 + t[-1]]),
        )

    monkeypatch.setattr(nqfjax.FactoredMFlowEngine, "run", run)
    kw = dict(init_scale=1e-3, learning_rate=0.02, key=jax.random.key(0))
    pred = nqfjax.predict(
        RAW_STRUCTURE,
        *raw,
        width=2,
        ts=[0.0, 1.0],
        engine=nqfjax.FactoredMFlowEngine(),
        **kw,
    )
    assert seen["factor"].shape == (5, 2)
    np.testing.assert_allclose(seen["factor"] @ seen["factor"].T, pred.M0, rtol=1e-12)
    assert pred.reason == "stand-in"


@pytest.mark.slow  # three compiled solves (~30 s on 2 shared cores)
def test_factored_engine_and_the_automatic_choice(raw):
    # width 2 < p = 5 on data that do not reduce: the automatic choice is the
    # factored flow from the weights themselves, and says so; the same loss as
    # the dense M-space flow to its tolerance; at most `width` modes learned
    kw = dict(init_scale=1e-3, learning_rate=0.02, key=jax.random.key(0))
    run = lambda engine, width=2: nqfjax.predict(  # noqa: E731
        RAW_STRUCTURE,
        *raw,
        width=width,
        num_steps=800,
        num_records=40,
        engine=engine,
        **kw,
    )
    auto = run(None)
    assert auto.engine == "mflow" and "(p, r) = (5, 2) factor" in auto.reason
    assert "lv_reduce refused the data" in auto.reason and float(auto.violation) > 0.1
    factored = run(nqfjax.FactoredMFlowEngine())
    np.testing.assert_array_equal(auto.loss, factored.loss)
    dense = run(nqfjax.MFlowEngine(solver=diffrax.Tsit5()))
    np.testing.assert_allclose(auto.loss, dense.loss, rtol=1e-6)
    assert 1 <= len(auto.mode_values) <= 2
    np.testing.assert_allclose(
        auto.mode_values, dense.mode_values[: len(auto.mode_values)], rtol=1e-5
    )
    np.testing.assert_allclose(
        auto.switch_times, dense.switch_times[: len(auto.switch_times)], rtol=1e-4
    )
    # from M0 alone the engine factors it (eigh): the same flow of M
    task = nqfjax.task_from_samples(RAW_STRUCTURE, *raw)
    from_m0 = nqfjax.FactoredMFlowEngine().run(task, auto.M0, auto.ts, 0.02)
    np.testing.assert_allclose(from_m0.loss, auto.loss, rtol=1e-7)
    # a full-width start keeps the dense flow
    wide = run(None, width=8)
    assert "factor" not in wide.reason
