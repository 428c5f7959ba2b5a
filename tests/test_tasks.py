"""Tasks: closed forms, sampled tasks and power-law tasks."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import all_structures, n_units, structure_id

import nqfjax


def _orth(rng, d):
    return np.linalg.qr(rng.standard_normal((d, d)))[0]


def _spd(rng, d):
    G = rng.standard_normal((d, d))
    return G @ G.T / d + 0.5 * np.eye(d)


def _sym(rng, p):
    X = rng.standard_normal((p, p))
    return jnp.asarray(X + X.T)


def _structures():
    """A representative subset of all_structures(): the sampled-task code is
    generic, so one additive vector-input layer (k = 2), the quadratic network
    and softmax attention (2-D inputs, a nonzero offset f(x; 0)) cover it."""
    keep = ("Perceptron", "QuadraticNet", "QKAttention-softmax")
    return [s for s in all_structures() if structure_id(s) in keep]


@eqx.filter_jit
def _sampled_vs_dense(structure, xs, ys, W, X):
    """Everything the next test compares, in one compiled function."""
    n, p = xs.shape[0], structure.p
    chunked = nqfjax.task_from_samples(structure, xs, ys, batch_size=3)
    whole = nqfjax.task_from_samples(structure, xs, ys)
    raw = nqfjax.task_from_samples(structure, xs, ys, subtract_offset=False)
    A = jax.vmap(structure.A)(xs)  # (n, k, p, p)
    K4 = jnp.einsum("skij,skab->ijab", A, A) / n  # the dense p^4 reference
    f0 = jax.vmap(lambda x: structure.layer(jnp.zeros((p, 1)), x))(xs)
    fq = jax.vmap(lambda x: nqfjax.nqf_apply(structure, W, x))(xs)
    M = W @ W.T
    return dict(
        K=(chunked.K(X), jnp.einsum("ijab,ab->ij", K4, X)),
        K_whole=(whole.K(X), chunked.K(X)),
        C=(chunked.C, jnp.einsum("sk,skij->ij", ys - f0, A) / n),
        y2=(chunked.y2, jnp.mean(jnp.sum((ys - f0) ** 2, 1))),
        loss=(chunked.loss(M), 0.5 * jnp.mean(jnp.sum((f0 + fq - ys) ** 2, 1))),
        loss_raw=(raw.loss(M), 0.5 * jnp.mean(jnp.sum((fq - ys) ** 2, 1))),
        gradient=(jax.grad(chunked.loss)(M), chunked.gradient(M)),
    )


@pytest.mark.parametrize("structure", _structures(), ids=structure_id)
def test_sampled_task_matches_dense_reference(structure, getkey):
    """The matrix-free K, C and y2 of a sampled task (chunks of 3 over 7 samples:
    a remainder chunk) equal the dense p^4 einsum over the stacked A(x_s);
    task.loss(W W^T) is the empirical squared loss of the quadratic model
    f(x; 0) + Tr[W W^T A(x)] (offset subtracted from ys by default; without it
    when subtract_offset=False); gradient = dL/dM."""
    n = 7
    xs = jax.random.normal(getkey(), (n, *structure.input_shape))
    ys = jax.random.normal(getkey(), (n, structure.k))
    W = jax.random.normal(getkey(), (structure.p, n_units(structure)))
    X = _sym(np.random.default_rng(0), structure.p)
    out = _sampled_vs_dense(structure, xs, ys, W, X)
    for name, (got, want) in out.items():
        # the same sums in another order: roundoff only
        np.testing.assert_allclose(got, want, rtol=1e-11, atol=1e-12, err_msg=name)


def _convergence(make_xy, closed, X, ns, seeds=32):
    """RMS over seeds of the relative errors of (C, K[X], y2) for each n."""
    out = []
    for n in ns:

        @jax.jit
        @jax.vmap
        def errs(key):
            task = make_xy(key, n)
            return jnp.stack(
                [
                    jnp.linalg.norm(task.C - closed.C) / jnp.linalg.norm(closed.C),
                    jnp.linalg.norm(task.K(X) - closed.K(X))
                    / jnp.linalg.norm(closed.K(X)),
                    jnp.abs(task.y2 - closed.y2) / closed.y2,
                ]
            )

        e = errs(jax.random.split(jax.random.key(n), seeds))
        out.append(np.sqrt(np.mean(np.asarray(e) ** 2, axis=0)))
    return np.array(out)  # (len(ns), 3)


def _check_rate(errors, ns):
    # The error of a sample mean has RMS exactly sigma / sqrt(n); with 32 seeds
    # each RMS is known to ~12%, so the fitted log-log slope over 1.8 decades is
    # -0.5 within ~0.05 (1 sd). A wrong closed form would leave a bias and flatten
    # the slope towards 0.
    slopes = np.polyfit(np.log(ns), np.log(errors), 1)[0]
    np.testing.assert_allclose(slopes, -0.5, atol=0.12)
    assert np.all(errors[-1] < 0.1)


NS = np.array([250, 2000, 16000])


@pytest.mark.slow
def test_sampled_quadratic_converges_to_gaussian_closed_form():
    """Quadratic network, x ~ N(0, S), indefinite teacher M*: task_from_samples
    converges to gaussian_quadratic_task at the rate n^-1/2."""
    rng = np.random.default_rng(0)
    d = 3
    S = _spd(rng, d)
    M_star = np.asarray(_sym(rng, d))
    closed = nqfjax.gaussian_quadratic_task(S, M_star)
    L = np.linalg.cholesky(S)
    structure = nqfjax.QuadraticNet(d=d)

    def make(key, n):
        xs = jax.random.normal(key, (n, d)) @ L.T
        ys = jnp.einsum("si,ij,sj->s", xs, M_star, xs)[:, None]
        return nqfjax.task_from_samples(structure, xs, ys)

    errors = _convergence(make, closed, _sym(rng, d), NS)
    _check_rate(errors, NS)


def test_sampled_perceptron_converges_to_gaussian_closed_form():
    """Perceptron (tanh, k = 2), x ~ N(0, S) with a general covariance, linear
    teacher: task_from_samples converges to gaussian_perceptron_task at n^-1/2."""
    rng = np.random.default_rng(1)
    k, d = 2, 3
    S = _spd(rng, d)
    T = rng.standard_normal((k, d))
    closed = nqfjax.gaussian_perceptron_task(T, S)
    L = np.linalg.cholesky(S)
    structure = nqfjax.Perceptron(d=d, k=k)

    def make(key, n):
        xs = jax.random.normal(key, (n, d)) @ L.T
        return nqfjax.task_from_samples(structure, xs, xs @ T.T)

    errors = _convergence(make, closed, _sym(rng, k + d), NS)
    _check_rate(errors, NS)


def test_gaussian_perceptron_closed_form_loss():
    """The perceptron task's loss is 0.5 Tr[(c M_au - T) S (c M_au - T)^T], the
    squared loss of the linear network f(x) = c M_au x, for slopes 1 and 2."""
    rng = np.random.default_rng(2)
    k, d = 2, 4
    S, T = _spd(rng, d), rng.standard_normal((k, d))
    W = rng.standard_normal((k + d, 3))
    M = W @ W.T
    for c in (1.0, 2.0):
        task = nqfjax.gaussian_perceptron_task(T, S, slope=c)
        R = c * M[:k, k:] - T
        np.testing.assert_allclose(
            task.loss(M), 0.5 * np.trace(R @ S @ R.T), rtol=1e-12
        )
        np.testing.assert_allclose(
            jax.grad(task.loss)(jnp.asarray(M)),
            task.gradient(M),
            rtol=1e-12,
            atol=1e-12,
        )
    whitened = nqfjax.gaussian_perceptron_task(T)
    np.testing.assert_allclose(whitened.y2, np.sum(T**2), rtol=1e-14)


def test_gaussian_quadratic_closed_form():
    """loss(M) = E (x^T (M - M*) x)^2 / 2 = Tr[(S D)^2] + Tr[S D]^2 / 2 (Wick),
    zero at the teacher; K is self-adjoint and PSD; gradient = dL/dM."""
    rng = np.random.default_rng(3)
    d = 4
    S, M_star = _spd(rng, d), np.asarray(_sym(rng, d))
    task = nqfjax.gaussian_quadratic_task(S, M_star)
    M = np.asarray(_sym(rng, d))
    D = M - M_star
    np.testing.assert_allclose(
        task.loss(M), np.trace(S @ D @ S @ D) + 0.5 * np.trace(S @ D) ** 2, rtol=1e-12
    )
    assert abs(float(task.loss(M_star))) < 1e-12 * float(task.y2)
    X, Y = _sym(rng, d), _sym(rng, d)
    np.testing.assert_allclose(
        jnp.sum(X * task.K(Y)), jnp.sum(task.K(X) * Y), rtol=1e-12
    )
    assert float(jnp.sum(X * task.K(X))) > 0
    np.testing.assert_allclose(
        jax.grad(task.loss)(jnp.asarray(M)), task.gradient(M), rtol=1e-12, atol=1e-12
    )


def test_power_law_task():
    """lam_k = k^-alpha, m*_k = k^-beta: the reduction is exact in the standard
    basis with r = 4 k^-(alpha+beta), B = 4 diag(lam) (flow time); L(0) is the sum of
    the unlearned costs lam m*^2 / 2, L(diag m*) = 0; the
    exponents are differentiable."""
    p, alpha, beta = 50, 1.3, 0.4
    task = nqfjax.power_law_task(p, alpha, beta)
    k = np.arange(1, p + 1.0)
    lv, U = nqfjax.lv_reduce(task)
    np.testing.assert_allclose(lv.r, 4 * k ** -(alpha + beta), rtol=1e-13)
    np.testing.assert_allclose(
        lv.interactions.as_matrix(), np.diag(4 * k**-alpha), rtol=1e-13
    )
    np.testing.assert_allclose(lv.fixed_point_isolated(), k**-beta, rtol=1e-13)
    np.testing.assert_allclose(U, np.eye(p))
    np.testing.assert_allclose(
        task.loss(jnp.zeros((p, p))), 0.5 * np.sum(k ** -(alpha + 2 * beta)), rtol=1e-13
    )
    assert abs(float(task.loss(jnp.diag(k**-beta)))) < 1e-14
    X = _sym(np.random.default_rng(4), p)
    np.testing.assert_allclose(task.K(X), np.diag(k**-alpha * np.diag(X)), rtol=1e-13)
    # d y2 / d alpha = -sum ln k k^-(alpha + 2 beta), through jit
    g = jax.jit(jax.grad(lambda a: nqfjax.power_law_task(p, a, beta).y2))(alpha)
    np.testing.assert_allclose(
        g, -np.sum(np.log(k) * k ** -(alpha + 2 * beta)), rtol=1e-12
    )


def test_float32_tasks():
    """float32 inputs give float32 tasks whose values match float64."""
    rng = np.random.default_rng(5)
    S, M_star = _spd(rng, 3), np.asarray(_sym(rng, 3))
    t64 = nqfjax.gaussian_quadratic_task(S, M_star)
    t32 = nqfjax.gaussian_quadratic_task(
        S.astype(np.float32), M_star.astype(np.float32)
    )
    assert (
        t32.C.dtype == jnp.float32
        and t32.loss(jnp.eye(3, dtype=jnp.float32)).dtype == jnp.float32
    )
    # float32 roundoff
    np.testing.assert_allclose(t32.C, t64.C, rtol=1e-5, atol=1e-5)
    p32 = nqfjax.power_law_task(5, 1.0, 0.5, dtype=jnp.float32)
    assert p32.C.dtype == jnp.float32
    xs = rng.standard_normal((6, 3)).astype(np.float32)
    s32 = nqfjax.task_from_samples(nqfjax.Perceptron(d=3, k=1), xs, xs[:, :1])
    assert (
        s32.C.dtype == jnp.float32
        and s32.K(jnp.eye(4, dtype=jnp.float32)).dtype == jnp.float32
    )


def test_task_bad_input():
    S = np.eye(3)
    with pytest.raises(ValueError, match="covariance"):
        nqfjax.gaussian_quadratic_task(np.diag([1.0, -1.0, 1.0]), S)  # not PSD
    with pytest.raises(ValueError, match="covariance"):
        nqfjax.gaussian_quadratic_task(np.triu(np.ones((3, 3))), S)  # not symmetric
    with pytest.raises(ValueError, match="M_star"):
        nqfjax.gaussian_quadratic_task(S, np.eye(4))
    with pytest.raises(ValueError, match="M_star"):
        nqfjax.gaussian_quadratic_task(S, np.triu(np.ones((3, 3))))
    with pytest.raises(ValueError, match="NaN"):
        nqfjax.gaussian_quadratic_task(S, np.full((3, 3), np.nan))
    with pytest.raises(ValueError, match="teacher"):
        nqfjax.gaussian_perceptron_task(np.ones(3))
    with pytest.raises(ValueError, match="covariance"):
        nqfjax.gaussian_perceptron_task(np.ones((2, 3)), np.eye(2))
    with pytest.raises(ValueError, match="slope"):
        nqfjax.gaussian_perceptron_task(np.ones((2, 3)), slope=0.0)
    structure = nqfjax.Perceptron(d=3, k=2)
    xs = np.ones((4, 3))
    with pytest.raises(ValueError, match="xs"):
        nqfjax.task_from_samples(structure, np.ones((4, 2)), np.ones((4, 2)))
    with pytest.raises(ValueError, match="ys"):
        nqfjax.task_from_samples(structure, xs, np.ones((4, 3)))
    with pytest.raises(ValueError, match="ys"):
        nqfjax.task_from_samples(structure, xs, np.full((4, 2), np.nan))
    with pytest.raises(ValueError, match="xs"):
        nqfjax.task_from_samples(
            structure, np.where(np.eye(4, 3) > 0, np.nan, xs), np.ones((4, 2))
        )
    with pytest.raises(ValueError, match="`batch_size` must be >= 1"):
        nqfjax.task_from_samples(structure, xs, np.ones((4, 2)), batch_size=0)
    with pytest.raises(ValueError, match="`batch_size` must be a static Python int"):
        nqfjax.task_from_samples(structure, xs, np.ones((4, 2)), batch_size=1.5)
    # batch_size fixes the chunk shape: refused at trace time under jit too
    with pytest.raises(ValueError, match="`batch_size` must be a static Python int"):
        jax.jit(
            lambda xs: (
                nqfjax.task_from_samples(
                    structure, xs, jnp.ones((4, 2)), batch_size=2.0
                ).C
            )
        )(xs)
    with pytest.raises(ValueError, match="p"):
        nqfjax.power_law_task(0, 1.0, 1.0)
    with pytest.raises(ValueError, match="alpha"):
        nqfjax.power_law_task(3, np.nan, 1.0)
    task = nqfjax.gaussian_quadratic_task(S, S)
    with pytest.raises(ValueError, match="M"):
        task.loss(np.eye(4))  # mismatched p
    with pytest.raises(ValueError, match="X"):
        task.K(np.eye(2))


@pytest.mark.parametrize(
    "alpha, beta, match",
    [
        (-1.0, 2.0, r"`alpha` must be > 0"),
        (0.0, 1.0, r"`alpha` must be > 0"),
        (1.0, 0.0, r"`alpha \+ 2 beta` must be > 1"),
        (0.5, 0.2, r"`alpha \+ 2 beta` must be > 1"),
        (2.0, -0.6, r"`alpha \+ 2 beta` must be > 1"),
    ],
)
def test_power_law_task_exponent_range(alpha, beta, match):
    """Outside alpha > 0, alpha + 2 beta > 1 there is no power law (the range of
    `power_law_exponent`): refused eagerly, under jit, and under vmap when one
    member of the batch is out of range."""
    with pytest.raises(ValueError, match=match):
        nqfjax.power_law_task(4, alpha, beta)
    y2 = lambda a, b: nqfjax.power_law_task(4, a, b).y2
    with pytest.raises(eqx.EquinoxRuntimeError, match=match):
        eqx.filter_jit(y2)(alpha, beta)
    with pytest.raises(eqx.EquinoxRuntimeError, match=match):
        eqx.filter_jit(jax.vmap(y2))(jnp.array([1.0, alpha]), jnp.array([0.5, beta]))
    # the boundary cases just inside are accepted, and give the same task
    # eagerly and under jit
    np.testing.assert_allclose(
        y2(1e-3, 0.5 + 1e-3), eqx.filter_jit(y2)(1e-3, 0.5 + 1e-3), rtol=1e-14
    )


def test_power_law_task_p_must_be_an_int():
    with pytest.raises(ValueError, match="`p` must be a static Python int"):
        nqfjax.power_law_task(4.0, 1.0, 0.5)
    with pytest.raises(ValueError, match="`p` must be >= 1"):
        nqfjax.power_law_task(0, 1.0, 0.5)


# --------------------------------------------------------------------------------
# Closed-form batch hooks against the generic path through A(x)


class _Generic(nqfjax.AbstractStructure):
    """A structure seen only through `A`, `unit` and `layer`: its batch hooks are
    the base class's defaults, which stack `A(x_s)` (the generic path a user's
    structure takes before it overrides them)."""

    inner: nqfjax.AbstractStructure
    p = property(lambda self: self.inner.p)
    k = property(lambda self: self.inner.k)
    input_shape = property(lambda self: self.inner.input_shape)
    additive = property(lambda self: self.inner.additive)
    max_units = property(lambda self: self.inner.max_units)

    def A(self, x):
        return self.inner.A(x)

    def unit(self, w, x):
        return self.inner.unit(w, x)

    def layer(self, W, x):
        return self.inner.layer(W, x)


def _task_outputs(structure, xs, ys, X):
    task = nqfjax.task_from_samples(structure, xs, ys, batch_size=3)
    return task.C, task.K(X), task.y2


def _dense_stacks(jaxpr, p: int) -> list[tuple[int, ...]]:
    """Shapes of the intermediates of `jaxpr` (and of every jaxpr inside it:
    scans, jitted calls) that stack `(p, p)` matrices, i.e. `A(x_s)` densified."""
    found = []
    for eqn in jaxpr.eqns:
        for v in eqn.outvars:
            shape = getattr(v.aval, "shape", ())
            if len(shape) >= 3 and tuple(shape[-2:]) == (p, p):
                found.append(tuple(shape))
        for param in eqn.params.values():
            for sub in param if isinstance(param, list | tuple) else [param]:
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    found += _dense_stacks(sub.jaxpr, p)
                elif isinstance(sub, jax.extend.core.Jaxpr):
                    found += _dense_stacks(sub, p)
    return found


@pytest.mark.parametrize("structure", all_structures(), ids=structure_id)
def test_closed_form_hooks_match_the_generic_task(structure, getkey):
    """For every built-in structure, `task_from_samples` (C, K[X], y2; 7 samples
    in chunks of 3, so a remainder chunk) through the closed-form hooks equals
    the same task through the generic path (float64 round-off), and its K and C
    never stack the matrices A(x_s) -- while the generic path does, so the check
    can fail. `solve_mflow` reaches the data only through `task.K` and `task.C`."""
    n, p = 7, structure.p
    xs = jax.random.normal(getkey(), (n, *structure.input_shape))
    ys = jax.random.normal(getkey(), (n, structure.k))
    G = jax.random.normal(getkey(), (p, p))
    X = G + G.T
    fast = eqx.filter_jit(_task_outputs)(structure, xs, ys, X)
    slow = eqx.filter_jit(_task_outputs)(_Generic(structure), xs, ys, X)
    for name, a, b in zip(("C", "K", "y2"), fast, slow):
        # the same sums in another order: float64 round-off only
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12, err_msg=name)
    closed = jax.make_jaxpr(lambda *a: _task_outputs(structure, *a))(xs, ys, X)
    assert _dense_stacks(closed.jaxpr, p) == []
    generic = jax.make_jaxpr(lambda *a: _task_outputs(_Generic(structure), *a))(
        xs, ys, X
    )
    assert (3, structure.k, p, p) in _dense_stacks(generic.jaxpr, p)
