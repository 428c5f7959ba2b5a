"""Small argument checks shared across modules.

Shape and dtype problems are caught at trace time with a `ValueError` that names
the argument; value problems (NaN, a negative scale) use `eqx.error_if`, which
works under `jit` and `vmap`.
"""

import functools
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
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


def finite(name: str, x):
    """Return `x`, raising (also under jit/vmap) if it has a NaN or inf."""
    x = jnp.asarray(x)
    if is_concrete(x):
        if not np.all(np.isfinite(np.asarray(x))):
            raise ValueError(f"`{name}` contains NaN or inf.")
        return x
    return eqx.error_if(x, ~jnp.all(jnp.isfinite(x)), f"`{name}` contains NaN or inf.")


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
    return eqx.error_if(x, ~jnp.all(jnp.isfinite(x) & (x > 0)), msg)


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
    return eqx.error_if(x, ~jnp.all(jnp.isfinite(x) & (x >= 0)), msg)


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
    return eqx.error_if(ts, bad, msg)


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
    X = eqx.error_if(X, ~jnp.all(jnp.isfinite(X)), f"`{name}` contains NaN or inf.")
    X = eqx.error_if(X, sym_err > tol, f"`{name}` must be symmetric.")
    return eqx.error_if(
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
