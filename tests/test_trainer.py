"""The one training loop (`train_segments`, `Segment`) and the model trained as
an object (`AbstractModel`: `Layer`, `QuadraticForm`): checked against closed
forms, numpy references and the same run cut differently."""

import inspect

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
import pytest

import nqfjax


def _data(structure, key, n):
    kx, ky = jr.split(key)
    xs = jr.normal(kx, (n, *structure.input_shape))
    ys = jr.normal(ky, (n, structure.k))
    return xs, ys


# ---------------------------------------------------------------------------
# the models


def test_models_predict_the_layer_and_its_quadratic_form(getkey):
    """`Layer()` is the layer itself; `QuadraticForm()` is f(x; 0) plus
    Tr[W W^T A(x)] with A(x) from the structure (einsum, sample by sample)."""
    structure = nqfjax.QKAttention(d=3, T=4)  # f(x; 0) != 0 (a uniform softmax)
    xs = jr.normal(getkey(), (3, *structure.input_shape))
    W = 0.3 * jr.normal(getkey(), (structure.p, 1))
    layer = jax.jit(lambda W, x: structure.layer(W, x))
    A = jax.jit(lambda x: structure.A(x))
    f = np.stack([np.asarray(layer(W, x)) for x in xs])
    zero = np.stack([np.asarray(layer(0 * W, x)) for x in xs])
    assert np.max(np.abs(zero)) > 1e-3  # the offset is really there
    quad = zero + np.stack([np.einsum("im,kij,jm->k", W, A(x), W) for x in xs])
    models = eqx.filter_jit(
        lambda W, xs: [
            m(structure, W, xs) for m in (nqfjax.Layer(), nqfjax.QuadraticForm())
        ]
    )
    got_layer, got_quad = models(W, xs)
    np.testing.assert_allclose(got_layer, f, rtol=1e-12)
    np.testing.assert_allclose(got_quad, quad, rtol=1e-10, atol=1e-12)
    # the layer holds `max_units` units (a mixture of 2 experts: 2); its
    # quadratic form any number
    moe = nqfjax.MixtureOfExperts(d=3, experts=2)
    assert nqfjax.Layer().max_units(moe) == moe.max_units == 2
    assert nqfjax.QuadraticForm().max_units(moe) is None
    xs, ys = _data(moe, getkey(), 5)
    with pytest.raises(ValueError, match="width"):
        nqfjax.train(moe, xs, ys, num_steps=2, learning_rate=0.1, W0=jnp.ones((7, 3)))
    zero = np.stack(
        [np.asarray(jax.jit(lambda x: moe.layer(jnp.zeros((7, 2)), x))(x)) for x in xs]
    )
    np.testing.assert_array_equal(nqfjax.QuadraticForm().offset(moe, xs, 3), zero)


def test_bad_model(getkey):
    structure = nqfjax.Perceptron(d=3, k=2)
    xs, ys = _data(structure, getkey(), 12)
    W0 = jnp.ones((structure.p, 2))
    with pytest.raises(ValueError, match="`model` must be an nqfjax.AbstractModel"):
        nqfjax.train(
            structure, xs, ys, num_steps=2, learning_rate=0.1, W0=W0, model="linear"
        )
    kw = dict(num_steps=2, W0=W0, model="linear")
    with pytest.raises(ValueError, match="`model`"):
        nqfjax.train_method(nqfjax.Method(0.1), structure, xs, ys, **kw)
    with pytest.raises(ValueError, match="`model`"):
        nqfjax.compare_methods([nqfjax.Method(0.1)], structure, xs, ys, **kw)


def test_one_default_model():
    """`train`, `train_segments`, `train_method` and `compare_methods` train the
    real layer unless told otherwise."""
    for fn in (
        nqfjax.train,
        nqfjax.train_segments,
        nqfjax.train_method,
        nqfjax.compare_methods,
    ):
        assert inspect.signature(fn).parameters["model"].default == nqfjax.Layer()


# ---------------------------------------------------------------------------
# segments


@pytest.mark.slow  # two compilations; train_method's segments are in the fast tier
def test_segments_without_keys_are_one_run(getkey):
    """Segments without their own keys draw the run's minibatches at the global
    step: cut anywhere, plain SGD with one batch size and a schedule evaluated
    at the global step is the same run, bit for bit up to round-off."""
    structure = nqfjax.Perceptron(d=3, k=2)
    xs, ys = _data(structure, getkey(), 16)
    sched = optax.exponential_decay(0.1, 10, 0.7)
    kw = dict(key=getkey(), init_scale=0.3, width=3, record_at=[0, 7, 13, 14, 30])
    one = nqfjax.train(
        structure, xs, ys, num_steps=30, learning_rate=sched, batch_size=4, **kw
    )
    cut = [nqfjax.Segment(n, sched, batch_size=4) for n in (13, 1, 16)]
    seg = nqfjax.train_segments(structure, xs, ys, cut, **kw)
    np.testing.assert_array_equal(seg.steps, one.steps)
    np.testing.assert_allclose(seg.loss, one.loss, rtol=1e-12)
    np.testing.assert_allclose(seg.M, one.M, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(seg.W, one.W, rtol=1e-12, atol=1e-15)


def test_weight_decay_segments_closed_form(getkey):
    """Zero inputs: only the penalty acts, W <- (1 - eta_i lam_i) W per step
    of segment i, so M_s = prod_i (1 - eta_i lam_i)^(2 steps_i) M_0."""
    structure = nqfjax.Perceptron(d=3, k=2)
    xs, ys = jnp.zeros((5, 3)), jnp.ones((5, 2))
    W0 = jr.normal(getkey(), (structure.p, 4))
    plan = [(10, 0.1, 0.3), (5, 0.05, 0.0), (20, 0.2, 1.0)]
    segments = [nqfjax.Segment(n, eta, lam) for n, eta, lam in plan]
    record = [0, 10, 12, 15, 25, 35]
    res = nqfjax.train_segments(structure, xs, ys, segments, W0=W0, record_at=record)
    factor, start, expected = 1.0, 0, {}
    for n, eta, lam in plan:
        for j in range(n + 1):
            expected[start + j] = factor * (1 - eta * lam) ** (2 * j)
        factor, start = expected[start + n], start + n
    f = np.array([expected[s] for s in record])
    np.testing.assert_allclose(
        res.M, f[:, None, None] * np.asarray(W0 @ W0.T), rtol=1e-12
    )


@pytest.mark.slow  # four compilations (the schedules' tests are slow too)
def test_train_schedule_is_the_loop_of_train_calls(getkey):
    """`train_schedule` against the loop it replaced: one `train` call per
    segment (minibatch key `fold_in(key, i)`), each from the last weights."""
    xs = jr.normal(getkey(), (24, 3))
    ys = jnp.sum(xs**2, axis=1, keepdims=True)
    W0 = 0.3 * jnp.eye(3)
    eta, b = np.array([0.05, 0.02, 0.01]), np.array([4.0, 24.0, 8.0])
    sched = nqfjax.Schedule(
        jnp.repeat(eta, 5), jnp.repeat(b, 5), jnp.zeros(16), jnp.zeros(()), "s"
    )
    keys = jr.split(getkey(), 2)
    got = nqfjax.train_schedule(sched, xs, ys, W0, keys, num_segments=3)
    net = nqfjax.QuadraticNet(d=3)
    for r, key in enumerate(keys):
        W, losses = W0, []
        for i in range(3):
            res = nqfjax.train(
                net,
                xs,
                ys,
                num_steps=5,
                learning_rate=eta[i],
                W0=W,
                batch_size=None if b[i] >= 24 else int(b[i]),
                key=jr.fold_in(key, i),
                record_at=[0, 5],
                snapshots=False,
            )
            losses += [res.loss[0]] if i == 0 else []
            losses.append(res.loss[1])
            W = res.W
        np.testing.assert_allclose(got[r], losses, rtol=1e-12)


def test_bad_segments(getkey):
    structure = nqfjax.QuadraticNet(d=3)
    xs, ys = _data(structure, getkey(), 8)
    kw = dict(W0=jnp.ones((3, 2)))
    good = nqfjax.Segment(3, 0.1)

    def raises(match, segments, **over):
        with pytest.raises(ValueError, match=match):
            nqfjax.train_segments(structure, xs, ys, segments, **(kw | over))

    raises("at least one Segment", [])
    raises("sequence of nqfjax Segments", good)
    raises(r"`segments\[1\]` must be a Segment", [good, (3, 0.1)])
    raises(
        r"`segments\[1\].learning_rate` must be strictly positive",
        [good, nqfjax.Segment(3, -0.1)],
    )
    raises(r"`segments\[0\].weight_decay`", [nqfjax.Segment(3, 0.1, -1.0), good])
    raises(r"`segments\[1\].num_steps`", [good, nqfjax.Segment(0, 0.1)])
    raises(r"`segments\[1\].batch_size` \(9\)", [good, nqfjax.Segment(3, 0.1, 0.0, 9)])
    raises("A `key` is needed", [good, nqfjax.Segment(3, 0.1, 0.0, 2)])
    raises(r"`segments\[1\].key`", [good, nqfjax.Segment(3, 0.1, 0.0, 2, key=0)])
    raises(r"`learning_rate` must be None", [good], optimizer=optax.sgd(0.1))
    raises("`record_at`", [good, good], record_at=[0, 7])
    # traced values are checked under jit too
    with pytest.raises(RuntimeError, match=r"segments\[1\].learning_rate"):
        jax.jit(
            lambda lr: (
                nqfjax.train_segments(
                    structure, xs, ys, [good, nqfjax.Segment(3, lr)], **kw
                ).loss
            )
        )(-0.1)
