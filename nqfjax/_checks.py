"""Small argument checks shared across modules.

Shape and dtype problems are caught at trace time with a `ValueError` that names
the argument. Value problems (NaN, a negative scale) go through `error_if`, the one
concrete-or-traced check: a `ValueError` at once on concrete values, a runtime
error (`eqx.error_if`) on traced ones, under `jit`, `vmap`, `grad` and inside
`shard_map` -- where a device program must not raise (a callback raising in a
multi-device CPU program can abort the process), so a `deferred_errors` block on
the host records the failures instead and the driver (`sweep`) raises them after
the program has finished.
"""

import contextlib
import functools
import threading
import warnings
from collections.abc import Iterator

import equinox as eqx
import equinox.internal as eqxi
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np


def check_shape(name: str, x, shape: tuple[int, ...]) -> None:
    """Raise `ValueError` unless `x.shape == shape`."""
    if tuple(jnp.shape(x)) != tuple(shape):
        raise ValueError(
            f"`{name}` must have shape {tuple(shape)}, got {tuple(jnp.shape(x))}."
        )


def static_int(name: str, value, minimum: int = 1) -> int:
    """`value` as a Python int `>= minimum`; `ValueError` naming `name` for a
    tracer, a bool, a float or a smaller value (it is static: it fixes shapes,
    loop lengths or step limits)."""
    if isinstance(value, jax.core.Tracer) or not np.issubdtype(
        np.asarray(value).dtype, np.integer
    ):
        raise ValueError(
            f"`{name}` must be a static Python int (it fixes array shapes, loop "
            f"lengths or step limits), got {value!r}."
        )
    value = int(value)
    if value < minimum:
        raise ValueError(f"`{name}` must be >= {minimum}, got {value}.")
    return value


def check_ndim(name: str, x, ndim: int, what: str) -> None:
    if jnp.ndim(x) != ndim:
        raise ValueError(
            f"`{name}` must be {what} ({ndim}-dimensional), got shape "
            f"{tuple(jnp.shape(x))}."
        )


def is_concrete(*xs) -> bool:
    """True when none of `xs` is a tracer, so values can be checked eagerly."""
    return not any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(xs))


def eager_only(function: str, why: str, **arguments) -> None:
    """Raise a `ValueError` naming `function` and the first traced argument:
    `function` runs eagerly, on concrete arrays (`why` says what needs them), so
    it cannot be called under `jax.jit`, `vmap`, `grad` or inside `shard_map`."""
    for name, x in arguments.items():
        if not is_concrete(x):
            raise ValueError(
                f"`{function}` runs eagerly (on concrete arrays: {why}), but `{name}` "
                "is traced: call it outside jax.jit/vmap/grad/shard_map."
            )


# the messages of failed runtime checks, while a `deferred_errors` block is open
_DEFERRED_LOCK = threading.Lock()
_deferred: list[str] | None = None


@contextlib.contextmanager
def deferred_errors() -> Iterator[list[str]]:
    """Record, instead of raise, the runtime checks (`error_if`) that fail in the
    programs run inside this block; yields the list of their messages.

    The choice is made when a program *runs*, not when it is traced, so a
    program compiled (or cached by an inner `jax.jit`) outside the block behaves
    the same inside it. Materialise the outputs inside the block: a program still
    running when it closes raises as usual. Blocks do not nest.
    """
    global _deferred
    with _DEFERRED_LOCK:
        if _deferred is not None:
            raise RuntimeError("`deferred_errors` blocks do not nest.")
        _deferred = messages = []
    try:
        yield messages
    finally:
        with _DEFERRED_LOCK:
            _deferred = None


def _record(msg: str):
    def callback(failed):
        if not np.any(failed):
            return np.bool_(False)
        with _DEFERRED_LOCK:
            if _deferred is None:
                return np.bool_(False)
            if msg not in _deferred:
                _deferred.append(msg)
            return np.bool_(True)

    return callback


def error_if(x, pred, msg: str, exception: type[Exception] = ValueError):
    """Return `x`, failing with `msg` where `pred` holds: the one concrete-or-traced
    check.

    Concrete `pred`: `exception(msg)` at once (`ValueError` for a bad argument,
    `RuntimeError` for a failed solve). Traced `pred` (under `jit`,
    `vmap`, `grad`, `shard_map`): at run time, through `eqx.error_if` (whose
    error carries `msg`; under `vmap` any failing member fails the batch), unless
    the program runs inside a `deferred_errors` block, which records `msg` and
    lets the program finish (its outputs are then not to be used).
    """
    if is_concrete(pred):
        if np.any(np.asarray(pred)):
            raise exception(msg)
        return x
    failed = eqxi.unvmap_any(jnp.any(pred))
    # the host is asked only when the check failed: a callback costs a round trip
    deferred = jax.lax.cond(
        failed,
        lambda f: jax.pure_callback(
            _record(msg), jax.ShapeDtypeStruct((), jnp.bool_), f
        ),
        lambda f: jnp.zeros((), jnp.bool_),
        failed,
    )
    return eqx.error_if(x, failed & ~deferred, msg)


def finite(name: str, x):
    """Return `x`, raising (also under jit/vmap) if it has a NaN or inf."""
    x = jnp.asarray(x)
    if is_concrete(x):
        if not np.all(np.isfinite(np.asarray(x))):
            raise ValueError(f"`{name}` contains NaN or inf.")
        return x
    return error_if(x, ~jnp.all(jnp.isfinite(x)), f"`{name}` contains NaN or inf.")


def positive(name: str, x):
    """Return `x`, raising if any entry is not strictly positive (or is NaN)."""
    x = jnp.asarray(x)
    msg = f"`{name}` must be strictly positive and finite."
    if is_concrete(x):
        xn = np.asarray(x)
        if not np.all(np.isfinite(xn) & (xn > 0)):
            raise ValueError(
                msg + f" Got {xn if xn.size < 8 else 'an array with bad entries'}."
            )
        return x
    return error_if(x, ~jnp.all(jnp.isfinite(x) & (x > 0)), msg)


def nonnegative(name: str, x):
    """Return `x`, raising if any entry is negative or not finite."""
    x = jnp.asarray(x)
    msg = f"`{name}` must be non-negative and finite."
    if is_concrete(x):
        xn = np.asarray(x)
        if not np.all(np.isfinite(xn) & (xn >= 0)):
            raise ValueError(
                msg + f" Got {xn if xn.size < 8 else 'an array with bad entries'}."
            )
        return x
    return error_if(x, ~jnp.all(jnp.isfinite(x) & (x >= 0)), msg)


def increasing(name: str, ts):
    """Return `ts`, raising unless it is 1-D, finite and strictly increasing."""
    check_ndim(name, ts, 1, "a 1-D array of times")
    ts = jnp.asarray(ts)
    msg = f"`{name}` must be finite and strictly increasing."
    if ts.shape[0] < 2:
        return finite(name, ts)
    if is_concrete(ts):
        tn = np.asarray(ts)
        if not (np.all(np.isfinite(tn)) and np.all(np.diff(tn) > 0)):
            raise ValueError(msg)
        return ts
    bad = ~(jnp.all(jnp.isfinite(ts)) & jnp.all(jnp.diff(ts) > 0))
    return error_if(ts, bad, msg)


def symmetric_psd(name: str, X, *, rtol: float = 1e-6):
    """Return `X`, raising unless it is symmetric positive semi-definite.

    Tolerances are relative to the largest absolute entry.
    """
    X = jnp.asarray(X)
    if X.ndim != 2 or X.shape[0] != X.shape[1]:
        raise ValueError(f"`{name}` must be a square matrix, got shape {X.shape}.")
    if is_concrete(X):
        # on the host, in numpy: no small XLA programs to compile for a check
        Xn = np.asarray(X)
        if not np.all(np.isfinite(Xn)):
            raise ValueError(f"`{name}` contains NaN or inf.")
        tol = rtol * np.max(np.abs(Xn)) + np.finfo(Xn.dtype).tiny
        sym_err = np.max(np.abs(Xn - Xn.T))
        Xs = Xn.astype(np.promote_types(Xn.dtype, np.float32))  # LAPACK types
        min_eig = np.min(np.linalg.eigvalsh(0.5 * (Xs + Xs.T)))
        if float(sym_err) > float(tol):
            raise ValueError(
                f"`{name}` must be symmetric; max |X - X^T| = {float(sym_err):.3g}."
            )
        if float(min_eig) < -float(tol) * X.shape[0]:
            raise ValueError(
                f"`{name}` must be positive semi-definite; its smallest eigenvalue is "
                f"{float(min_eig):.3g}."
            )
        return X
    tol = rtol * jnp.max(jnp.abs(X)) + jnp.finfo(X.dtype).tiny
    sym_err = jnp.max(jnp.abs(X - X.T))
    min_eig = jnp.min(jnp.linalg.eigvalsh(0.5 * (X + X.T)))
    X = error_if(X, ~jnp.all(jnp.isfinite(X)), f"`{name}` contains NaN or inf.")
    X = error_if(X, sym_err > tol, f"`{name}` must be symmetric.")
    return error_if(
        X, min_eig < -tol * X.shape[0], f"`{name}` must be positive semi-definite."
    )


def renamed_keywords(**renames: str):
    """Decorator: accept the keyword `old` of `old="new"` for one release, with a
    `DeprecationWarning`, as the keyword `new` of the decorated function."""

    def decorate(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            for old, new in renames.items():
                if old in kwargs:
                    if new in kwargs:
                        raise TypeError(
                            f"{fn.__name__}() got both `{old}` and `{new}`; `{old}` "
                            f"is the deprecated name of `{new}`."
                        )
                    warnings.warn(
                        f"The keyword `{old}` of {fn.__name__}() is deprecated; use "
                        f"`{new}`.",
                        DeprecationWarning,
                        stacklevel=2,
                    )
                    kwargs[new] = kwargs.pop(old)
            return fn(*args, **kwargs)

        return wrapper

    return decorate


def check_symmetric(name: str, X, *, rtol: float = 1e-6):
    """Return `X`, raising unless it is a finite symmetric matrix."""
    X = finite(name, X)
    if X.ndim != 2 or X.shape[0] != X.shape[1]:
        raise ValueError(f"`{name}` must be a square matrix, got shape {X.shape}.")
    tol = rtol * jnp.max(jnp.abs(X)) + jnp.finfo(X.dtype).tiny
    err = jnp.max(jnp.abs(X - X.T))
    if is_concrete(X):
        if float(err) > float(tol):
            raise ValueError(f"`{name}` must be symmetric; max |X - X^T| = {err:.3g}.")
        return X
    return error_if(X, err > tol, f"`{name}` must be symmetric.")


def check_key(key, name: str = "key"):
    """`key` if it is one PRNG key: a typed key (`jax.random.key`) of shape `()`,
    or a legacy raw key (`jax.random.PRNGKey`, uint32 of the default
    implementation's shape); `ValueError` naming `name` otherwise (an int seed
    would otherwise fail deep inside JAX's PRNG code)."""
    dtype = getattr(key, "dtype", None)
    if dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key):
        if jnp.shape(key) == ():
            return key
    elif dtype == jnp.uint32 and jnp.shape(key) == _raw_key_shape():
        return key
    seed = isinstance(key, int | float | np.integer | np.floating)
    raise ValueError(
        f"`{name}` must be one PRNG key, `jax.random.key(seed)` (or a legacy "
        f"`jax.random.PRNGKey(seed)`), got {key!r}"
        + ("; pass jax.random.key(seed), not the seed." if seed else ".")
    )


@functools.cache
def _raw_key_shape() -> tuple[int, ...]:
    """The shape of a legacy key of the default PRNG implementation (abstractly
    evaluated: nothing runs, and nothing at import time)."""
    return tuple(jax.eval_shape(lambda: jr.key_data(jr.key(0))).shape)
