"""The learned modes' levels settled where the real layer holds them
(`experiments._settle`): against a root found by scipy, and the cases where
nothing settles."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.optimize

import nqfjax
from nqfjax.experiments._settle import level_curvature, real_gradient, settle


#: Newton steps from zero that the tests check (each cuts the distance to the
#: settled levels by about 0.4 on the softmax head; see `_settle`).
COLD_STEPS = 3


def _from_zero(structure, xs, ys, W, g_real, g_quad, lam, U, learned, steps=COLD_STEPS):
    """The real gradient at the levels that `steps` Newton steps from zero
    reach at `W` (`settle` iterated at one record; `g_real` the real
    gradient at `W` itself)."""
    s, g = jnp.zeros(lam.shape, W.dtype), g_real
    for _ in range(steps):
        s = settle(structure, xs, ys, W, g_quad, lam, U, learned, s, g)[1]
        g = None
    return settle(structure, xs, ys, W, g_quad, lam, U, learned, s, g)[0]


def _head_case(seed=0, n=200):
    """A softmax query-key head whose two largest modes are learned at logits
    of order one (where the real layer and its quadratic form part), a third
    small, and targets from the same head with those two levels higher:
    `(structure, xs, ys, W, g_real, g_quad, lam, U)`, float64."""
    rng = np.random.default_rng(seed)
    structure = nqfjax.QKAttention(T=4, d=4)
    p = structure.p
    xs = jnp.asarray(rng.standard_normal((n, 4, 4)))
    basis = np.linalg.qr(rng.standard_normal((p, p)))[0]
    units = np.linalg.qr(rng.standard_normal((p, p)))[0]

    def weights(*top):
        levels = np.array([*top, 1e-3] + [1e-6] * (p - 3))
        return jnp.asarray(basis @ np.diag(np.sqrt(levels)) @ units)

    layer = jax.vmap(structure.layer, in_axes=(None, 0))
    ys = layer(weights(2.0, 1.4), xs)
    W = weights(1.2, 0.8)
    f0 = layer(jnp.zeros((p, 1)), xs)
    G = structure.weighted_sum(xs, (f0 + structure.contract_factor(xs, W) - ys) / n)
    g_quad = 2.0 * G @ W
    g_real = real_gradient(structure, xs, ys, W)
    lam, U = jnp.linalg.eigh(W @ W.T)
    return structure, xs, ys, W, g_real, g_quad, lam[::-1][:3], U[:, ::-1][:, :3]


def _force(W, g, lam, U, learned):
    return 0.5 * np.einsum("pa,pm,ma->a", U, g, W.T @ U)[:learned] / lam[:learned]


def _settled_root(structure, xs, ys, W, g_quad, lam, U, learned=2, start=None):
    """The `learned` levels whose real-layer drive equals the quadratic
    form's at `W`, by scipy's `root` on the exact drive by autodiff (to
    1e-12 of the levels; from the levels `start`, default zero), and the
    real layer's gradient there: `(root, gradient)`; `(None, None)` where
    scipy finds none."""
    W_, lam_, U_ = np.asarray(W), np.asarray(lam), np.asarray(U)
    target = _force(W_, np.asarray(g_quad), lam_, U_, learned)

    def gradient(s):
        shift = np.concatenate([s, np.zeros(lam_.shape[0] - learned)])
        at = W_ + 0.5 * ((U_ * (shift / lam_)) @ U_.T) @ W_
        return np.asarray(real_gradient(structure, xs, ys, jnp.asarray(at)))

    def mismatch(x):  # in units of the levels (a root near 0 converges)
        return _force(W_, gradient(x * lam_[:learned]), lam_, U_, learned) - target

    x0 = np.zeros(learned) if start is None else np.asarray(start) / lam_[:learned]
    root = scipy.optimize.root(mismatch, x0, tol=1e-12)
    # converged, or stalled at the drive's float64 roundoff
    found = np.max(np.abs(root.fun)) < 1e-14 * np.max(np.abs(target))
    if not (root.success or found):
        return None, None  # no root: the real layer cannot match the drive
    s = root.x * lam_[:learned]
    return s, gradient(s)


def test_settled_levels_solve_the_real_layers_balance():
    """With the two largest modes learned: the levels `s` whose real-layer
    drive equals the quadratic form's at `W` (found by scipy's `root` on the
    exact drive by autodiff, to 1e-12) and the gradient there, against
    Newton's steps on the quadratic form's curvature iterated at `W`: 30
    land on it (1e-9: float64 roundoff of the drive), and each cuts the
    distance to it by at least half (measured: the gradient's distance 0.42,
    0.070 and 0.011 of the settling's change after 1, 3 and 5 steps)."""
    with jax.enable_x64(True):
        structure, xs, ys, W, g_real, g_quad, lam, U = _head_case()
        root, expect = _settled_root(structure, xs, ys, W, g_quad, lam, U)
        # at the root the real layer's drive is the quadratic form's (measured
        # 6e-16 of it), where at W itself it is 1.6 times as large
        drive = [
            _force(*(np.asarray(a) for a in (W, g, lam, U)), 2)
            for g in (g_quad, expect, g_real)
        ]
        size = np.abs(drive[0]).max()
        np.testing.assert_allclose(drive[1], drive[0], rtol=0, atol=1e-12 * size)
        assert np.abs(drive[2] - drive[0]).max() > 0.3 * size
        # the real layer holds these levels higher than its quadratic form
        assert np.all(root > 0.05)

        case = (structure, xs, ys, W, g_real, g_quad, lam, U, 2)
        got = _from_zero(*case, steps=30)
        np.testing.assert_allclose(np.asarray(got), expect, rtol=0, atol=1e-9)

        change = np.linalg.norm(expect - np.asarray(g_real))
        for steps in (1, 3, 5):
            got = np.asarray(_from_zero(*case, steps=steps))
            assert np.linalg.norm(got - expect) < 0.5**steps * change


@pytest.mark.parametrize("learned", [0, 2])
def test_nothing_settles_where_nothing_is_learned_or_the_layer_is_quadratic(learned):
    """No mode learned: the real layer's gradient at `W` itself. The quadratic
    network (its real layer is its quadratic form): the drive already balances,
    so nothing moves (exactly 0 up to roundoff)."""
    with jax.enable_x64(True):
        rng = np.random.default_rng(1)
        structure = nqfjax.QuadraticNet(d=5)
        xs = jnp.asarray(rng.standard_normal((60, 5)))
        ys = jnp.asarray(rng.standard_normal((60, 1)))
        W = jnp.asarray(0.7 * rng.standard_normal((structure.p, 6)))
        f0 = jax.vmap(lambda x: structure.layer(jnp.zeros((structure.p, 1)), x))(xs)
        G = structure.weighted_sum(
            xs, (f0 + structure.contract_factor(xs, W) - ys) / xs.shape[0]
        )
        g_quad = 2.0 * G @ W
        g_real = real_gradient(structure, xs, ys, W)
        np.testing.assert_allclose(np.asarray(g_real), np.asarray(g_quad), atol=1e-12)
        lam, U = jnp.linalg.eigh(W @ W.T)
        got = _from_zero(
            structure,
            xs,
            ys,
            W,
            g_real,
            g_quad,
            lam[::-1][:3],
            U[:, ::-1][:, :3],
            learned,
        )
        np.testing.assert_allclose(np.asarray(got), np.asarray(g_real), atol=1e-12)


def test_settling_under_jit_with_a_traced_count():
    """The count of learned modes is traced: one compilation serves 0 and 2;
    0 gives the real gradient at `W` back and 2 the eager steps' (to float64
    roundoff: the gradients are recomputed under `jit`)."""
    with jax.enable_x64(True):
        case = _head_case(seed=2, n=50)
        g_real = np.asarray(case[4])
        f = jax.jit(lambda L: _from_zero(*case, L))
        size = np.linalg.norm(g_real)
        np.testing.assert_allclose(np.asarray(f(0)), g_real, atol=1e-12 * size)
        eager = np.asarray(_from_zero(*case, 2))
        np.testing.assert_allclose(np.asarray(f(2)), eager, atol=1e-12 * size)
        assert np.linalg.norm(eager - g_real) > 1e-6


def test_settling_in_float32_is_float64s():
    """The float32 path (JAX's default): the settled gradient of the head case
    in float32 against float64, within 1e-5 of its size (measured 3e-7:
    float32 roundoff through three Newton steps), where settling moves it
    by about half its size."""
    with jax.enable_x64(True):
        case = _head_case()
        ref = np.asarray(_from_zero(*case, 2))
        before = np.asarray(case[4])
    as32 = [case[0]] + [jnp.asarray(np.asarray(a), jnp.float32) for a in case[1:]]
    got = _from_zero(*as32, 2)
    assert got.dtype == jnp.float32
    size = np.linalg.norm(ref)
    assert np.linalg.norm(ref - before) > 0.3 * size
    assert np.linalg.norm(np.asarray(got, np.float64) - ref) < 1e-5 * size


def test_one_newton_step_along_a_trajectory():
    """`settle` as `validity` reads a trajectory: the real layer's gradient
    at $W(s_0)$ exactly (its one pass), and the next record's levels one
    Newton step on the quadratic form's curvature away. From the root
    (scipy's, as above) that step stays there (1e-12: float64 roundoff of
    the drive); from 0.9 of it or from zero it cuts the distance to the root
    by 0.39 (measured; < 0.5: the real layer's curvature of these levels is
    steeper than its quadratic form's, so the step falls short but never
    overshoots)."""
    from nqfjax.experiments._settle import level_weights

    with jax.enable_x64(True):
        structure, xs, ys, W, g_real, g_quad, lam, U = _head_case()
        root, _ = _settled_root(structure, xs, ys, W, g_quad, lam, U)
        for fraction in (1.0, 0.9, 0.0):
            s0 = jnp.asarray(np.concatenate([fraction * root, [0.0]]))
            g, s = settle(structure, xs, ys, W, g_quad, lam, U, 2, s0)
            at = real_gradient(structure, xs, ys, level_weights(W, lam, U, s0))
            np.testing.assert_array_equal(np.asarray(g), np.asarray(at))
            s = np.asarray(s)
            assert s[2] == 0.0  # the third mode is not learned
            before = np.linalg.norm((1.0 - fraction) * root)
            after = np.linalg.norm(s[:2] - root)
            if fraction == 1.0:
                assert after < 1e-12 * np.linalg.norm(root)
            else:
                assert 0.0 < after < 0.5 * before
                assert np.all(s[:2] < root)  # short of it, not beyond


def _perceptron_case(seed):
    """A tanh perceptron (d = 4, k = 2) on 300 Gaussian inputs, float64:
    `(structure, xs, layer, f0, weights)`, `weights(levels)` the weights whose
    `W W^T` has those eigenvalues in a random basis, over random units."""
    rng = np.random.default_rng(seed)
    structure = nqfjax.Perceptron(d=4, k=2)
    p = structure.p
    xs = jnp.asarray(rng.standard_normal((300, 4)))
    basis = np.linalg.qr(rng.standard_normal((p, p)))[0]
    units = np.linalg.qr(rng.standard_normal((p, p)))[0]
    layer = jax.vmap(structure.layer, in_axes=(None, 0))
    f0 = layer(jnp.zeros((p, 1)), xs)

    def weights(levels):
        return jnp.asarray(basis @ np.diag(np.sqrt(levels)) @ units)

    return structure, xs, layer, f0, weights


@pytest.mark.parametrize("growing", [True, False])
def test_level_curvature_is_the_drives_derivative(growing):
    """`level_curvature` against central finite differences (step 1e-4 of the
    level: error ~1e-8) of the quadratic form's drive on the levels, the
    drive as `settle` reads it (`_force`) at $W(s)$: a tanh perceptron on
    Gaussian inputs, two learned modes. While they still grow (levels 1e-3,
    targets far above) the mode's own drive over its level is most of it (the
    couplings alone off by more than half); at their plateau the couplings
    are (1e-6: float64 roundoff of a drive near zero)."""
    with jax.enable_x64(True):
        structure, xs, _, f0, weights = _perceptron_case(1)
        p, n = structure.p, xs.shape[0]
        top = np.array([0.5, 0.3])
        teacher = weights(np.concatenate([top, np.full(p - 2, 1e-8)]))
        ys = f0 + structure.contract_factor(xs, teacher)  # the quadratic form's
        levels = np.array([1e-3, 6e-4]) if growing else top
        W = weights(np.concatenate([levels, np.full(p - 2, 1e-8)]))

        def g_quad(W):
            f = f0 + structure.contract_factor(xs, W)
            return 2.0 * structure.weighted_sum(xs, (f - ys) / n) @ W

        lam, U = jnp.linalg.eigh(W @ W.T)
        lam, U = lam[::-1][:2], U[:, ::-1][:, :2]
        W_, lam_, U_ = np.asarray(W), np.asarray(lam), np.asarray(U)

        def drive(s):
            at = W_ + 0.5 * ((U_ * (s / lam_)) @ U_.T) @ W_
            return _force(W_, np.asarray(g_quad(jnp.asarray(at))), lam_, U_, 2)

        J = np.asarray(
            level_curvature(structure, xs, lam, U, jnp.asarray(drive(0.0 * lam_)))
        )
        fd = np.stack(
            [
                (drive(h * e) - drive(-h * e)) / (2 * h)
                for e, h in zip(np.eye(2), 1e-4 * lam_)
            ],
            axis=1,
        )
        np.testing.assert_allclose(J, fd, rtol=1e-5, atol=1e-6 * np.abs(fd).max())
        H = np.asarray(structure.mode_gram(xs, U)) / n
        if growing:
            assert np.max(np.abs(H - fd)) > 0.5 * np.abs(fd).max()
        else:
            np.testing.assert_allclose(H, fd, rtol=1e-3, atol=1e-6 * np.abs(fd).max())


def test_warm_start_follows_a_growing_mode():
    """Along 25 records of a tanh perceptron's learned mode growing from 1e-3
    to 0.3 of its teacher's 0.5 (each record's levels one Newton step from
    the record before's, as `validity` reads a trajectory): wherever scipy
    finds where the real layer holds the level (its root, followed from the
    record before's), the step's levels are within a tenth of the mode's
    level of it (measured: at most 0.049, at level 0.09 where the
    curvature's two parts nearly cancel; the gap, read one record behind,
    0.12 there and within 0.026 below 0.06). At the two records after
    (levels 0.12 and 0.15) there is no root: the real layer's drive cannot
    match the quadratic form's; the levels move by no more than the trust
    region allows (to 0.42 and -0.17 of the level) and then land within
    0.014 of the root on its other side. With the levels' couplings alone
    as the curvature (before 2026-12-06) the warm start overshot by the
    mode's drive over its level, and the overshoot compounded from record to
    record: 2.2 times the level off by the twelfth record (with the trust
    region; without it, without bound)."""
    with jax.enable_x64(True):
        structure, xs, layer, f0, weights = _perceptron_case(2)
        p, n = structure.p, xs.shape[0]
        ys = layer(weights(np.array([0.5, 0.3] + [1e-8] * (p - 2))), xs)
        s, root, missing = jnp.zeros(2), np.zeros(1), 0
        for level in np.geomspace(1e-3, 0.3, 25):
            W = weights(np.array([level, 1e-4] + [1e-8] * (p - 2)))
            f = f0 + structure.contract_factor(xs, W)
            g_quad = 2.0 * structure.weighted_sum(xs, (f - ys) / n) @ W
            lam, U = jnp.linalg.eigh(W @ W.T)
            lam, U = lam[::-1][:2], U[:, ::-1][:, :2]
            args = (structure, xs, ys, W, g_quad, lam, U)
            s = settle(*args, 1, s)[1]
            root, _ = _settled_root(*args, 1, start=root)
            if root is None:  # none near the last: from zero
                root, _ = _settled_root(*args, 1)
            if root is None:
                missing += 1
                assert abs(float(s[0])) <= float(lam[0])
            else:
                assert abs(float(s[0]) - root[0]) <= 0.1 * float(lam[0])
        assert missing == 2
