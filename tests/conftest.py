import os


# Keep tests on the CPU and single-threaded BLAS friendly on two cores.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("MPLBACKEND", "Agg")

import jax  # noqa: E402
import pytest  # noqa: E402


# float64 is what the precision tests need; float32 paths are exercised explicitly
# by casting inputs (`jnp.float32`) in the tests that check them.
jax.config.update("jax_enable_x64", True)
jax.config.update("jax_numpy_rank_promotion", "raise")


@pytest.fixture
def getkey():
    """A fresh PRNG key on every call, deterministic across runs."""
    state = {"key": jax.random.key(0)}

    def _getkey():
        state["key"], sub = jax.random.split(state["key"])
        return sub

    return _getkey
