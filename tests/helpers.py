"""Shared test helpers."""

import jax
import jax.numpy as jnp
import numpy as np

import nqfjax


def tree_allclose(x, y, *, rtol=1e-5, atol=1e-8) -> bool:
    """Whether two pytrees have the same structure and allclose leaves."""
    if jax.tree.structure(x) != jax.tree.structure(y):
        return False
    return all(
        np.allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=atol)
        for a, b in zip(jax.tree.leaves(x), jax.tree.leaves(y))
    )


def random_input(structure: nqfjax.Structure, key, dtype=jnp.float64):
    return jax.random.normal(key, structure.input_shape, dtype)


def all_structures():
    """A small instance of every structure (the list tests parametrise over)."""
    return [
        nqfjax.Perceptron(d=3, k=2),
        nqfjax.Perceptron(d=3, k=1, activation=jnp.sin),
        nqfjax.QuadraticNet(d=4),
    ]
