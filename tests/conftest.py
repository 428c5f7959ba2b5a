import ctypes
import ctypes.util
import gc
import os
import shutil
import tempfile


# Keep tests on the CPU and single-threaded BLAS friendly on two cores.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("MPLBACKEND", "Agg")

# One persistent compilation cache for the whole run, shared by the xdist
# workers and by every subprocess a test starts (the CLI, the multi-process
# sweeps, the notebooks' kernels inherit the environment): a program that
# several of them compile is compiled once. JAX stores only programs without
# host callbacks, so the ODE solves (equinox's runtime checks are callbacks)
# are compiled in every process all the same. The folder is new for each run
# (made by the first process, inherited by the workers it starts), so the
# suite's time is that of a cold cache, as on a fresh machine.
_OWN_CACHE = "NQFJAX_TEST_JAX_CACHE" not in os.environ
if _OWN_CACHE:
    os.environ["NQFJAX_TEST_JAX_CACHE"] = tempfile.mkdtemp(prefix="nqfjax-jax-cache-")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.environ["NQFJAX_TEST_JAX_CACHE"])
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import pytest  # noqa: E402


def _glibc():
    """glibc, for `malloc_trim`; `None` elsewhere (macOS, musl)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return libc if libc is not None and hasattr(libc, "malloc_trim") else None


_LIBC = _glibc()


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


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
    """Free each test module's compiled programs once it is done: modules rarely
    share one, and kept they grow each xdist worker by gigabytes over the suite
    (the suite's peak memory was 4.3 GB with two workers)."""
    yield
    jax.clear_caches()
    eqx.clear_caches()
    gc.collect()
    # and hand the freed heap back to the system: without it glibc keeps it and
    # a worker stays at its largest module's size (measured: 780 MB -> 370 MB
    # after a module's programs are freed)
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def pytest_unconfigure(config):
    """The process that made the run's compilation cache removes it."""
    if _OWN_CACHE:
        shutil.rmtree(os.environ["NQFJAX_TEST_JAX_CACHE"], ignore_errors=True)
