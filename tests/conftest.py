import os


# Keep tests on the CPU and single-threaded BLAS friendly on two cores.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("MPLBACKEND", "Agg")

import jax  # noqa: E402
import pytest  # noqa: E402


# float64 is what the precision tests need. The float32 path a user gets by
# default (no `jax_enable_x64`) is tested end to end in `test_float32.py`, inside
# `jax.enable_x64(False)`; other tests check float32 by casting their inputs.
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
