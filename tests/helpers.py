"""Shared test helpers."""

import contextlib
import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import nqfjax


def values(solution):
    """The values of an engine's output: `solve_lv`/`solve_mflow` return a
    `Solution` module with `.ys` (or, before that change, the array itself)."""
    return getattr(solution, "ys", solution)


@contextlib.contextmanager
def count_compiles():
    """Collect the XLA compilations that happen inside the block (one entry per
    backend compile, from `jax.monitoring`), e.g. to assert that a second call
    with new values of the same shapes compiles nothing. Build the call's inputs
    before the block: an eager op on new shapes compiles too."""
    compiles = []

    def listener(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(kwargs.get("fun_name", "?"))

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield compiles
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


def random_input(structure: nqfjax.AbstractStructure, key, dtype=jnp.float64):
    return jax.random.normal(key, structure.input_shape, dtype)


def all_structures():
    """A small instance of every registered structure and variant (the list tests
    parametrise over). Pair with `ids=structure_id`."""
    return list(_all_structures())


#: (registered name, constructor arguments) of each instance in `all_structures`;
#: `test_structures` checks that every name of `nqfjax.structure_names()` is here.
STRUCTURE_CASES = (
    ("perceptron", dict(d=3, k=2)),
    ("perceptron", dict(d=3, k=1, activation=jnp.sin)),
    ("quadratic", dict(d=4)),
    ("qk_attention", dict(T=4, d=3, k=2, softmax=False)),
    ("qk_attention", dict(T=4, d=3, k=2, softmax=True, temperature=2.0, query=1)),
    ("ov_attention", dict(T=4, d=3, k=2)),
    ("ov_attention", dict(T=4, d=3, k=1, learn_qk=True)),
    ("moe", dict(d=3, k=2, experts=3)),
    ("moe", dict(d=3, experts=3, gate="factor")),
    ("conv1d", dict(length=7, kernel_size=3, stride=2, activation=jax.nn.silu)),
    ("conv1d", dict(length=6, kernel_size=2, pool=True)),
)


@functools.cache
def _all_structures():
    return tuple(nqfjax.structure_class(n)(**kw) for n, kw in STRUCTURE_CASES)


def structure_id(structure) -> str:
    """A short readable test id for a structure instance."""
    name = type(structure).__name__
    extra = []
    for flag in ("softmax", "learn_qk", "pool"):
        if getattr(structure, flag, False):
            extra.append(flag)
    gate = getattr(structure, "gate", None)
    if gate is not None:
        extra.append(gate)
    act = getattr(structure, "activation", None)
    if act is not None and act is not jnp.tanh:
        extra.append(getattr(act, "__name__", "act"))
    return "-".join([name, *extra])


def n_units(structure, default: int = 3) -> int:
    """A number of units (default 3) the real layer accepts (`max_units` caps it)."""
    cap = structure.max_units
    return default if cap is None else min(default, cap)


# Compiled entry points shared by every test module: `eqx.filter_jit` caches on the
# structure's static configuration and the shapes, so each structure compiles once
# per dtype however many tests call it.


@eqx.filter_jit
def jit_A(structure, x):
    return structure.A(x)


@eqx.filter_jit
def jit_layer(structure, W, x):
    return structure.layer(W, x)


@eqx.filter_jit
def jit_unit(structure, w, x):
    return structure.unit(w, x)


@eqx.filter_jit
def jit_nqf(structure, W, x):
    return nqfjax.nqf_apply(structure, W, x)


def lv_interactions(p: int):
    """A Lotka-Volterra system with `B = diag(d) + U U^T`, `U` of rank 2 (the
    quadratic network with Gaussian inputs plus a second interaction direction),
    and `r = B 1`, so that every mode has `m* = 1` and eventually switches on.
    Returns `(r, B, d, U)`."""
    lam = 1.0 / np.arange(1, p + 1)
    d = 2 * lam**2
    U = np.stack([lam, 0.5 * lam**2], axis=1)
    B = np.diag(d) + U @ U.T
    return B @ np.ones(p), B, d, U


def logistic_crossings(lv, m0, num_modes=2):
    r"""The switch-ons of independent logistic modes (diagonal `B`), as
    `switch_ons` defines them: the first `num_modes` modes to switch on (the
    smallest logistic half-way times), each $m_k(t) = m^*_k / (1 + (m^*_k/m_{0,k}
    - 1) e^{-r_k t})$ crossing the threshold $\theta$ = half the smallest of their
    $m^*_k = r_k / B_{kk}$, at $t_k = \ln\big((m^*_k/m_{0,k} - 1) / (m^*_k/\theta -
    1)\big) / r_k$, sorted. In the system's time."""
    r = np.asarray(lv.r, np.float64)
    B = np.asarray(lv.interactions.as_matrix(), np.float64)
    m0 = np.asarray(m0, np.float64)
    grow = np.flatnonzero(r > 0)
    mstar = r[grow] / np.diag(B)[grow]
    half = np.log(mstar / m0[grow] - 1) / r[grow]
    pick = np.argsort(half)[:num_modes]
    mstar, rate, start = mstar[pick], r[grow][pick], m0[grow][pick]
    theta = 0.5 * np.min(mstar)
    return np.sort(np.log((mstar / start - 1) / (mstar / theta - 1)) / rate)
