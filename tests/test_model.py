"""`nqf_apply`: the quadratic form Tr[W W^T A(x)]."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import all_structures, jit_A, jit_nqf, random_input, structure_id

import nqfjax


parametrize_structures = pytest.mark.parametrize(
    "structure", all_structures(), ids=structure_id
)


@parametrize_structures
def test_trace_form_and_invariances(structure):
    rng = np.random.default_rng(1)
    x = rng.standard_normal(structure.input_shape)
    W = rng.standard_normal((structure.p, 5))
    f = jit_nqf(structure, W, x)
    # Tr[M A_j] with M = W W^T formed explicitly (float64 round-off).
    M = W @ W.T
    A = np.asarray(jit_A(structure, x))
    np.testing.assert_allclose(f, np.einsum("ab,kba->k", M, A), rtol=1e-12, atol=1e-12)
    # W -> W Q for a random orthogonal Q, and a permutation of units: M unchanged.
    Q, _ = np.linalg.qr(rng.standard_normal((5, 5)))
    np.testing.assert_allclose(jit_nqf(structure, W @ Q, x), f, rtol=1e-12, atol=1e-12)
    perm = rng.permutation(5)
    np.testing.assert_allclose(
        jit_nqf(structure, W[:, perm], x), f, rtol=1e-12, atol=1e-12
    )


@eqx.filter_jit
def _batched_and_grads(structure, W, xs, c):
    out = jax.vmap(nqfjax.nqf_apply, in_axes=(None, None, 0))(structure, W, xs)
    f = lambda W, x: jnp.dot(c, nqfjax.nqf_apply(structure, W, x))
    return out, jax.grad(f, argnums=(0, 1))(W, xs[0])


@parametrize_structures
def test_vmap_jit_grad(structure, getkey):
    xs = jnp.stack([random_input(structure, getkey()) for _ in range(4)])
    W = jax.random.normal(getkey(), (structure.p, 3))
    c = jnp.arange(1.0, structure.k + 1.0)
    out, (g_W, g_x) = _batched_and_grads(structure, W, xs, c)
    assert out.shape == (4, structure.k)
    for i in range(4):
        # Batched and unbatched compiled calls: same float64 arithmetic.
        np.testing.assert_allclose(
            out[i], jit_nqf(structure, W, xs[i]), rtol=1e-12, atol=1e-13
        )
    # d/dW sum_j c_j Tr[W W^T A_j] = 2 sum_j c_j A_j W (A symmetric).
    expected = 2 * jnp.einsum("k,kab,bm->am", c, jit_A(structure, xs[0]), W)
    np.testing.assert_allclose(g_W, expected, rtol=1e-12, atol=1e-12)
    # grad w.r.t. the input against a central finite difference: every A(x) here
    # is a polynomial of degree <= 2 in x, so the difference is exact up to
    # round-off eps/h ~ 1e-11.
    V = jax.random.normal(getkey(), xs[0].shape)
    h = 1e-5
    fp = jnp.dot(c, jit_nqf(structure, W, xs[0] + h * V))
    fm = jnp.dot(c, jit_nqf(structure, W, xs[0] - h * V))
    np.testing.assert_allclose(
        jnp.sum(g_x * V), (fp - fm) / (2 * h), rtol=1e-8, atol=1e-9
    )


@parametrize_structures
def test_float32(structure, getkey):
    x = random_input(structure, getkey())
    W = jax.random.normal(getkey(), (structure.p, 3))
    f32 = jit_nqf(structure, W.astype(jnp.float32), x.astype(jnp.float32))
    assert f32.dtype == jnp.float32
    # float32 round-off on sums of ~p^2 m terms of O(1).
    np.testing.assert_allclose(f32, jit_nqf(structure, W, x), rtol=1e-5, atol=1e-4)


def test_bad_input(getkey):
    s = nqfjax.Perceptron(d=3, k=2)
    x = jnp.ones(3)
    with pytest.raises(ValueError, match=r"`W` must have shape \(p, m\) = \(5, m\)"):
        nqfjax.nqf_apply(s, jnp.ones((4, 2)), x)
    with pytest.raises(ValueError, match=r"`W` must have shape \(p, m\)"):
        nqfjax.nqf_apply(s, jnp.ones(5), x)
    with pytest.raises(ValueError, match=r"`x` must have shape \(3,\)"):
        nqfjax.nqf_apply(s, jnp.ones((5, 2)), jnp.ones(4))
    with pytest.raises(ValueError, match="`W` contains NaN"):
        nqfjax.nqf_apply(s, jnp.ones((5, 2)).at[1, 1].set(jnp.nan), x)
    with pytest.raises(ValueError, match="`x` contains NaN"):
        nqfjax.nqf_apply(s, jnp.ones((5, 2)), x.at[0].set(jnp.nan))
    # under jit the eqx.error_if check raises a RuntimeError with the same message
    with pytest.raises(RuntimeError, match="`W` contains NaN"):
        jax.jit(lambda W: nqfjax.nqf_apply(s, W, x))(jnp.full((5, 2), jnp.nan))
    with pytest.raises(
        ValueError, match="`structure` must be an nqfjax.AbstractStructure"
    ):
        nqfjax.nqf_apply("perceptron", jnp.ones((5, 2)), x)  # pyright: ignore
