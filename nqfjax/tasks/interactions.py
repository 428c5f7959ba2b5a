r"""The interactions `B` of a Lotka-Volterra system as a typed pytree.

$$\frac{dm_k}{dt} = m_k\Big(r_k - (B m)_k\Big) - \delta\, m_k ,$$

with `B` symmetric positive semi-definite, of size `p x p`. Its form decides
what every operation costs, so it is a type: an abstract module,
`AbstractInteractions`, and final implementations,

- `DenseInteractions(B)`: any symmetric PSD `B`, held as the `p x p` matrix;
- `DiagonalInteractions(d)`: `B = diag(d)`, independent modes;
- `LowRankInteractions(d, U)`: `B = diag(d) + U U^T`, with `U` of shape `(p, q)`.

Each answers the same questions: the product `mv(m) = B m`, the `diagonal()`,
`quadratic(m) = m^T B m`, and `rosenbrock_solver`, the linear solve of the
implicit steps of `solve_lv`; `as_matrix()` is the only operation that builds
the `p x p` matrix. The shape copies lineax's `AbstractLinearOperator`
(`MatrixLinearOperator`, `DiagonalLinearOperator`), specialised to what the
Lotka-Volterra engines need.
"""

import abc
from collections.abc import Callable

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from .._checks import error_if, is_concrete, symmetric_psd
from .._linalg import lu_solver


class AbstractInteractions(eqx.Module):
    r"""Symmetric positive semi-definite interactions `B`, shape `(p, p)`, of a
    Lotka-Volterra system, in a form that each subclass fixes.

    The operations, with their cost for `DenseInteractions` /
    `LowRankInteractions` of rank `q` (`q = 0`: `DiagonalInteractions`):

    - `mv(m)`: $B m$, any leading batch shape of `m`; `O(p^2)` / `O(p q)`.
    - `diagonal()`: $B_{kk}$, shape `(p,)`; `O(p)` / `O(p q)`. `B` is PSD, so
      this is also the largest $|B_{kl}|$ of each row.
    - `quadratic(m)`: $m^\top B m$ (any leading batch shape); as `mv`.
    - `rosenbrock_solver(m, g, gh)`: `b -> gh W^{-1} b` with
      $W = I + g\, B\, \mathrm{diag}(m)$, the matrix of a Rosenbrock step of the
      log-space field (`LVRosenbrock`); `O(p^3)` / `O(p q^2 + q^3)`.
    - `as_matrix()`: the dense `B`, `O(p^2)` memory: the only operation that
      builds it. Nothing in `nqfjax` calls it on a structured system except
      where a dense matrix is the point (the sharp-switch event loop of
      `theory/` on coupled modes, a report's JSON).
    - `is_diagonal()`: whether `B` is diagonal by its type and shapes (a Python
      bool, never from the values).

    Calling the module, `B(m)`, is `B.mv(m)`.

    Subclasses are equinox modules: pytrees, so that a system can be
    `jax.vmap`ped, differentiated and carried through `jax.jit` like any array.
    The concrete classes are final.
    """

    # the number of dimensions of each leaf (in the order of `jax.tree.leaves`)
    # for one system: `solve_lv_batch` reads a leaf with one more as batched
    _unbatched_ndims: eqx.AbstractClassVar[tuple[int, ...]]

    @property
    @abc.abstractmethod
    def size(self) -> int:
        """`p`, the number of modes."""

    @abc.abstractmethod
    def mv(self, m: Float[Array, "... p"]) -> Float[Array, "... p"]:
        """`B m` for every row of `m` (any leading batch shape)."""

    @abc.abstractmethod
    def diagonal(self) -> Float[Array, " p"]:
        """The diagonal `B_kk`, shape `(p,)`."""

    @abc.abstractmethod
    def as_matrix(self) -> Float[Array, "p p"]:
        """The dense matrix `B`, shape `(p, p)`: `O(p^2)` memory for every form."""

    @abc.abstractmethod
    def is_diagonal(self) -> bool:
        """Whether `B` is diagonal by its structure (static: from the type and
        the shapes, never from the values)."""

    @abc.abstractmethod
    def rosenbrock_solver(
        self, m: Float[Array, " p"], g: Float[Array, ""], gh: Float[Array, ""]
    ) -> Callable[[Float[Array, " p"]], Float[Array, " p"]]:
        r"""The solve of a Rosenbrock step: `b -> gh W^{-1} b` with

        $$W = I + g\, B\, \mathrm{diag}(m),$$

        (`I - gh J` for the Jacobian $J = -B\,\mathrm{diag}(m)$ of the log-space
        field, `g = +-gh` with the direction of time), in the dtype of `m`. The
        factorisation is done once, here; the function returned is applied to
        every stage's right-hand side. A singular `W` gives NaN.
        """

    def quadratic(self, m: Float[Array, "... p"]) -> Float[Array, "..."]:
        """`m^T B m` for every row of `m` (any leading batch shape)."""
        return jnp.sum(m * self.mv(m), axis=-1)

    def __call__(self, m: Float[Array, "... p"]) -> Float[Array, "... p"]:
        """`B m`: the same as `mv(m)`."""
        return self.mv(m)


class DenseInteractions(AbstractInteractions):
    r"""Dense interactions: any symmetric positive semi-definite `B`.

    The check costs one `O(p^3)` eigenvalue computation, eagerly (`ValueError`)
    or, under `jax.jit`/`jax.vmap`, through `eqx.error_if` threaded into `B` (a
    runtime error whenever `B` is used). `mv` costs `O(p^2)` and the Rosenbrock
    solve one LU factorisation, `O(p^3)`.

    **Arguments:**

    - `B`: shape `(p, p)`, finite, symmetric (to a relative `1e-6` of its largest
      entry) and positive semi-definite.

    **Raises:** `ValueError` if `B` is not square, not finite, not symmetric or
    not positive semi-definite.
    """

    B: Float[Array, "p p"]

    _unbatched_ndims = (2,)

    def __init__(self, B, *, _name: str = "B"):
        B = jnp.asarray(B)
        self.B = symmetric_psd(_name, B.astype(jnp.result_type(B, float)))

    def __check_init__(self):
        if jnp.ndim(self.B) != 2 or jnp.shape(self.B)[0] != jnp.shape(self.B)[1]:
            raise ValueError(f"`B` must have shape (p, p), got {jnp.shape(self.B)}.")

    @property
    def size(self) -> int:
        return self.B.shape[-1]

    def mv(self, m):
        return m @ self.B  # B is symmetric

    def diagonal(self):
        return jnp.diag(self.B)

    def as_matrix(self):
        return self.B

    def is_diagonal(self) -> bool:
        return False

    def rosenbrock_solver(self, m, g, gh):
        """One LU factorisation of `W` (see `AbstractInteractions`)."""
        eye = jnp.eye(m.shape[0], dtype=m.dtype)
        solve = lu_solver(eye + g * self.B.astype(m.dtype) * m[None, :])
        return lambda b: solve(gh * b)


class DiagonalInteractions(AbstractInteractions):
    r"""Diagonal interactions, `B = diag(d)`: independent modes.

    `O(p)` memory and `O(p)` for every operation; `W` of the Rosenbrock step is
    diagonal.

    **Arguments:**

    - `d`: shape `(p,)`, finite and `>= 0` (which makes `B` positive
      semi-definite).

    **Raises:** `ValueError` (eagerly; a runtime error under `jit`/`vmap`) if
    `d` is not a vector or has a negative or non-finite entry.
    """

    d: Float[Array, " p"]

    _unbatched_ndims = (1,)

    def __init__(self, d, *, _name: str = "d"):
        d = jnp.asarray(d)
        d = d.astype(jnp.result_type(d, float))
        if d.ndim != 1:
            raise ValueError(f"`{_name}` must have shape (p,), got {d.shape}.")
        self.d = _nonnegative(
            _name,
            d,
            f"non-negative (this makes B = diag({_name}) positive semi-definite)",
        )

    def __check_init__(self):
        if jnp.ndim(self.d) != 1:
            raise ValueError(f"`d` must have shape (p,), got {jnp.shape(self.d)}.")

    @property
    def size(self) -> int:
        return self.d.shape[-1]

    def mv(self, m):
        return _rows(self.d, m) * m

    def diagonal(self):
        return self.d

    def as_matrix(self):
        return jnp.diag(self.d)

    def is_diagonal(self) -> bool:
        return True

    def rosenbrock_solver(self, m, g, gh):
        """`W = I + g diag(d m)` is diagonal: one division."""
        a = 1 + g * self.d.astype(m.dtype) * m
        return lambda b: gh * b / a


class LowRankInteractions(AbstractInteractions):
    r"""Diagonal plus low rank interactions,

    $$B = \mathrm{diag}(d) + U U^\top ,$$

    with `d` of shape `(p,)` and `U` of shape `(p, q)` (for example the quadratic
    network with Gaussian inputs, where `U` is one column). `d >= 0` makes `B`
    symmetric positive semi-definite by construction, so the check costs
    `O(p q)`; the module holds `O(p q)` memory, never the `p x p` matrix. `mv`
    costs `O(p q)` and the Rosenbrock solve `O(p q^2 + q^3)`, by the Woodbury
    identity with a `q x q` capacitance matrix.

    **Arguments:**

    - `d`: shape `(p,)`, finite and `>= 0`.
    - `U`: shape `(p, q)`, finite; `q = 0` is a diagonal `B`.

    **Raises:** `ValueError` (eagerly; a runtime error under `jit`/`vmap`) for
    wrong shapes, a negative or non-finite `d` or a non-finite `U`.
    """

    d: Float[Array, " p"]
    U: Float[Array, "p q"]

    _unbatched_ndims = (1, 2)

    def __init__(self, d, U, *, _names: tuple[str, str] = ("d", "U")):
        d, U = jnp.asarray(d), jnp.asarray(U)
        dtype = jnp.result_type(d, U, float)
        d, U = d.astype(dtype), U.astype(dtype)
        if d.ndim != 1:
            raise ValueError(f"`{_names[0]}` must have shape (p,), got {d.shape}.")
        p = d.shape[0]
        if U.ndim != 2 or U.shape[0] != p:
            raise ValueError(f"`{_names[1]}` must have shape ({p}, q), got {U.shape}.")
        self.d = _nonnegative(
            _names[0],
            d,
            f"non-negative (this makes B = diag({_names[0]}) + {_names[1]} "
            f"{_names[1]}^T symmetric positive semi-definite)",
        )
        self.U = _finite(_names[1], U)

    def __check_init__(self):
        p = jnp.shape(self.d)[0] if jnp.ndim(self.d) == 1 else None
        if p is None or jnp.ndim(self.U) != 2 or jnp.shape(self.U)[0] != p:
            raise ValueError(
                "`d` and `U` must have shapes (p,) and (p, q), got "
                f"{jnp.shape(self.d)} and {jnp.shape(self.U)}."
            )

    @property
    def size(self) -> int:
        return self.d.shape[-1]

    @property
    def rank(self) -> int:
        """`q`, the number of columns of `U`."""
        return self.U.shape[-1]

    def mv(self, m):
        return _rows(self.d, m) * m + (m @ self.U) @ self.U.T

    def diagonal(self):
        return self.d + jnp.sum(self.U**2, axis=1)

    def as_matrix(self):
        return jnp.diag(self.d) + self.U @ self.U.T

    def is_diagonal(self) -> bool:
        return self.rank == 0

    def rosenbrock_solver(self, m, g, gh):
        r"""By Woodbury: `W = A + g U (M U)^T` with `A = I + g diag(d m)` diagonal,
        so `W^-1 = A^-1 - g A^-1 U S^-1 U^T M A^-1` with the capacitance
        `S = I + g U^T diag(m / A) U` (symmetric positive definite when `g > 0`,
        `d >= 0`). Hand-written: no library solves diagonal plus low rank with
        the analytic log-space Jacobian (lineax's operators would need `W`
        formed or solved iteratively)."""
        dtype = m.dtype
        d = self.d.astype(dtype)
        U = self.U.astype(dtype)
        q = U.shape[1]
        a = 1 + g * d * m
        if q == 0:  # no columns: a diagonal B
            return lambda b: gh * b / a
        S = jnp.eye(q, dtype=dtype) + g * (U.T * (m / a)[None, :]) @ U
        if q == 1:
            solve_small = lambda v: v / S[0, 0]
        else:
            solve_small = lu_solver(S)

        def solve(b):
            z = gh * b / a
            return z - g * (U @ solve_small(U.T @ (m * z))) / a

        return solve


def _rows(d, m):
    """`d` with a leading 1 for each batch dimension of `m` (explicit: the rank
    promotion of `d * m` may be set to raise)."""
    return d.reshape((1,) * (jnp.ndim(m) - 1) + d.shape)


def _finite(name, x):
    """`x`, checked finite (eagerly, or threaded `eqx.error_if` when traced)."""
    msg = f"`{name}` must be finite (it contains NaN or inf)."
    if is_concrete(x):
        if not np.all(np.isfinite(np.asarray(x))):
            raise ValueError(msg)
        return x
    return error_if(x, ~jnp.all(jnp.isfinite(x)), msg)


def _nonnegative(name, x, what):
    """`x`, checked finite and `>= 0` with a message saying why (`what`)."""
    msg = f"`{name}` must be finite and {what}"
    if is_concrete(x):
        xn = np.asarray(x)
        bad = ~(np.isfinite(xn) & (xn >= 0))
        if np.any(bad):
            raise ValueError(f"{msg}; got {xn[bad].ravel()[0]:.3g}.")
        return x
    return error_if(x, ~jnp.all(jnp.isfinite(x) & (x >= 0)), msg + ".")
