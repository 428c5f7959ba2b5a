"""`structure_from_layer`: A(x) as half the Hessian at zero."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import all_structures, jit_A, random_input, structure_id

import nqfjax


@eqx.filter_jit
def _autodiff(structure, x):
    A = nqfjax.structure_from_layer(structure.unit, structure.p)
    return A(x), A.offset(x), A.gradient(x)


@pytest.mark.parametrize("structure", all_structures(), ids=structure_id)
def test_closed_form_equals_autodiff(structure, getkey):
    # The closed form must agree with autodiff of the real unit (the layer with
    # only that unit on, minus the layer at zero), float64, to 1e-10.
    for _ in range(3):
        x = random_input(structure, getkey())
        A, offset, gradient = _autodiff(structure, x)
        assert A.shape == (structure.k, structure.p, structure.p)
        np.testing.assert_allclose(A, jit_A(structure, x), rtol=0, atol=1e-10)
        # The unit is defined relative to the layer at zero: no offset, and the
        # theory's condition holds: zero gradient (exactly, for these units).
        np.testing.assert_allclose(offset, 0.0, atol=1e-15)
        np.testing.assert_allclose(gradient, 0.0, atol=1e-15)
    # The eager route (concrete values, Python-side checks) gives the same.
    np.testing.assert_allclose(
        nqfjax.structure_from_layer(structure.unit, structure.p)(x), A, atol=1e-15
    )


def test_hand_computed_units(getkey):
    x = jax.random.normal(getkey(), (3,))
    # (w . x)^2 -> x x^T exactly.
    A = nqfjax.structure_from_layer(lambda w, x: jnp.dot(w, x) ** 2, 3)(x)
    assert A.shape == (1, 3, 3)
    np.testing.assert_allclose(A[0], jnp.outer(x, x), rtol=1e-14)
    # a sin(2 u . x): c = 2, A = (c/2)(e x^T + x e^T) in the (a, u) layout.
    A = nqfjax.structure_from_layer(lambda w, x: w[0] * jnp.sin(2 * w[1:] @ x), 4)(x)
    expected = jnp.zeros((4, 4)).at[0, 1:].set(x).at[1:, 0].set(x)
    np.testing.assert_allclose(A[0], expected, rtol=1e-14, atol=1e-15)
    # Two outputs (a_1, a_2) tanh(u . x).
    A = nqfjax.structure_from_layer(lambda w, x: w[:2] * jnp.tanh(w[2:] @ x), 5)(x)
    np.testing.assert_allclose(A, nqfjax.Perceptron(d=3, k=2).A(x), atol=1e-15)


def test_offset_is_reported_not_refused(getkey):
    # Softmax attention with only one unit on, NOT minus its value at zero: the
    # offset is the mean value (uniform softmax), and A is unchanged.
    s = nqfjax.QKAttention(T=5, d=3, k=2)
    x = random_input(s, getkey())
    A_auto = nqfjax.structure_from_layer(lambda w, x: s.layer(w[:, None], x), s.p)
    np.testing.assert_allclose(A_auto.offset(x), s.values.mean(0), rtol=1e-14)
    np.testing.assert_allclose(A_auto(x), s.A(x), atol=1e-12)
    # A constant plus a quadratic: offset 1.5, A = x x^T.
    A_auto = nqfjax.structure_from_layer(lambda w, x: 1.5 + (w @ x) ** 2, 3)
    y = jnp.array([1.0, -2.0, 0.5])
    np.testing.assert_allclose(A_auto.offset(y), [1.5])
    np.testing.assert_allclose(A_auto(y)[0], jnp.outer(y, y), rtol=1e-14)


def test_nonzero_gradient_is_refused(getkey):
    # sigma(0) != 0 makes a * sigmoid(u . x) linear in a at zero: gradient
    # sigmoid(0) = 1/2 along a.
    unit = lambda w, x: w[0] * jax.nn.sigmoid(w[1:] @ x)
    A_auto = nqfjax.structure_from_layer(unit, 4)
    x = jax.random.normal(getkey(), (3,))
    np.testing.assert_allclose(A_auto.gradient(x)[0], [0.5, 0, 0, 0])
    with pytest.raises(ValueError, match="the theory does not apply.*nonzero gradient"):
        A_auto(x)
    # Under jit and vmap the same message comes from eqx.error_if, raised as a
    # RuntimeError (jax's JaxRuntimeError under jax.jit, eqx.EquinoxRuntimeError
    # under eqx.filter_jit; both subclass RuntimeError).
    with pytest.raises(RuntimeError, match="the theory does not apply"):
        jax.jit(A_auto)(x)
    with pytest.raises(RuntimeError, match="the theory does not apply"):
        jax.vmap(A_auto)(jnp.stack([x, x]))
    # A gradient at round-off level is accepted, a tiny real one is refused with
    # an explicit atol.
    tiny = lambda w, x: 1e-9 * w[0] + (w @ x) ** 2
    A_auto = nqfjax.structure_from_layer(tiny, 3, atol=1e-6)
    np.testing.assert_allclose(A_auto(x)[0], jnp.outer(x, x), rtol=1e-14)
    with pytest.raises(ValueError, match="max \\|grad\\| = 1e-09"):
        nqfjax.structure_from_layer(tiny, 3)(x)


def test_transforms_and_dtypes(getkey):
    s = nqfjax.Perceptron(d=3, k=2)
    A_auto = nqfjax.structure_from_layer(s.unit, s.p)

    @jax.jit
    def both(xs, B):
        # vmap, and grad through the Hessian w.r.t. the input, for both routes.
        grad = lambda A: jax.grad(lambda x: jnp.sum(A(x) * B))(xs[0])
        return jax.vmap(A_auto)(xs), jax.vmap(s.A)(xs), grad(A_auto), grad(s.A)

    xs = jax.random.normal(getkey(), (4, 3))
    B = jax.random.normal(getkey(), (2, 5, 5))
    auto, closed, g_auto, g_closed = both(xs, B)
    # Same quantities by two float64 routes: agreement to round-off.
    np.testing.assert_allclose(auto, closed, atol=1e-14)
    np.testing.assert_allclose(g_auto, g_closed, rtol=1e-13, atol=1e-14)
    # float32 in, float32 out, equal to float64 up to float32 round-off.
    A32 = A_auto(xs[0].astype(jnp.float32))
    assert A32.dtype == jnp.float32
    np.testing.assert_allclose(A32, closed[0], rtol=1e-6, atol=1e-6)


def test_bad_arguments():
    with pytest.raises(ValueError, match="`unit_fn` must be callable"):
        nqfjax.structure_from_layer(3.0, 2)  # pyright: ignore
    with pytest.raises(ValueError, match="`p` must be a positive integer"):
        nqfjax.structure_from_layer(lambda w, x: w @ w, 0)
    with pytest.raises(ValueError, match="`p` must be a positive integer"):
        nqfjax.structure_from_layer(lambda w, x: w @ w, 2.5)  # pyright: ignore
    with pytest.raises(ValueError, match="`atol`"):
        nqfjax.structure_from_layer(lambda w, x: w @ w, 2, atol=-1.0)
    with pytest.raises(ValueError, match="must return a scalar or a vector"):
        nqfjax.structure_from_layer(lambda w, x: jnp.outer(w, w), 2)(jnp.ones(2))
    with pytest.raises(ValueError, match="NaN or inf"):
        nqfjax.structure_from_layer(lambda w, x: (w @ x) ** 2, 2)(
            jnp.array([1.0, jnp.nan])
        )
