"""The structure matrix of any unit function, by automatic differentiation."""

from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from .._checks import error_if, is_concrete


class AutodiffStructureMatrix(eqx.Module):
    r"""`x -> A(x)`: half the Hessian at zero of a unit function, by autodiff.

    For a unit $\phi(w, x)$ with $w \in R^p$ (see the documentation's theory pages),

    $$\phi(w, x) = \phi(0, x) + \nabla_w\phi(0, x)\cdot w + w^\top A(x) w + O(|w|^3),
    \qquad A(x) = \tfrac12 \mathrm{Hess}_w \phi(0, x).$$

    The theory needs $\nabla_w\phi(0, x) = 0$; calling this object raises if the
    gradient is nonzero. A nonzero value $\phi(0, x)$ is allowed: it is an offset
    of the target (e.g. the mean value under a uniform softmax), reported by
    [`offset`][] rather than refused.

    Built by [`structure_from_layer`][]; see there for the arguments.

    **Methods:**

    - `__call__(x)`: `A(x)`, shape `(k, p, p)`, symmetric.
    - `offset(x)`: $\phi(0, x)$, shape `(k,)`: subtract it from the targets.
    - `gradient(x)`: $\nabla_w\phi(0, x)$, shape `(k, p)` (zero when the theory
      applies).
    """

    unit_fn: Callable
    p: int = eqx.field(static=True)
    atol: float | None = eqx.field(static=True, default=None)

    def _zero(self, x):
        dtype = (
            jnp.result_type(x)
            if jnp.issubdtype(jnp.result_type(x), jnp.inexact)
            else float
        )
        return jnp.zeros((self.p,), dtype)

    def _fn(self, w, x):
        out = jnp.asarray(self.unit_fn(w, x))
        if out.ndim > 1:
            raise ValueError(
                "`unit_fn(w, x)` must return a scalar or a vector of shape (k,), got "
                f"shape {out.shape}."
            )
        return jnp.atleast_1d(out)

    def offset(self, x) -> Float[Array, " k"]:
        """The unit's value at zero weights, $\\phi(0, x)$, shape `(k,)`."""
        return _derivatives(self, x)[0]

    def gradient(self, x) -> Float[Array, "k p"]:
        """The unit's gradient at zero weights, shape `(k, p)`."""
        return _derivatives(self, x)[1]

    def __call__(self, x) -> Float[Array, "k p p"]:
        f0, grad, A = _derivatives(self, x)
        if self.atol is None:
            eps = jnp.finfo(A.dtype).eps
            big = jnp.max(jnp.abs(A), initial=0) + jnp.max(jnp.abs(f0), initial=0)
            tol = 1e3 * eps * (1 + big)
        else:
            tol = self.atol
        gmax = jnp.max(jnp.abs(grad), initial=0)
        msg = (
            "the theory does not apply: `unit_fn` has a nonzero gradient at w = 0, so "
            "the unit is not a quadratic form at small weights (it needs phi(0, x) "
            "smooth with grad_w phi(0, x) = 0, e.g. a product of two weight factors "
            "such as a * sigma(u . x) with sigma(0) = 0)"
        )
        if is_concrete(A, gmax, tol):
            if not np.all(np.isfinite(np.asarray(A))) or not np.isfinite(float(gmax)):
                raise ValueError(
                    "`unit_fn` gave a NaN or inf derivative at w = 0 (is `x` finite "
                    "and the unit smooth at zero?)."
                )
            if float(gmax) > float(tol):
                raise ValueError(f"{msg}; max |grad| = {float(gmax):.3g}.")
            return A
        return error_if(A, ~(gmax <= tol), msg + ".")


@eqx.filter_jit
def _derivatives(matrix: AutodiffStructureMatrix, x):
    """Value, gradient and half the (symmetrised) Hessian at `w = 0`, compiled as
    one program (evaluating them op by op is far slower)."""
    w0 = matrix._zero(x)
    f0 = matrix._fn(w0, x)
    grad = jax.jacrev(matrix._fn)(w0, x)
    hess = jax.jacfwd(jax.jacrev(matrix._fn))(w0, x)
    return f0, grad, 0.25 * (hess + jnp.swapaxes(hess, -1, -2))


def structure_from_layer(
    unit_fn: Callable, p: int, *, atol: float | None = None
) -> AutodiffStructureMatrix:
    r"""The structure matrix $A(x) = \tfrac12\mathrm{Hess}_w\phi(0, x)$ of any unit.

    The automatic route to the structure matrix: a closed-form `A(x)` is a
    convenience that must agree with this. For an
    [`AbstractStructure`][nqfjax.AbstractStructure], pass its `unit` (the layer
    with only that unit switched on, minus the layer at zero):
    `structure_from_layer(s.unit, s.p)(x)` equals `s.A(x)`.

    Example:

    ```python
    A = structure_from_layer(lambda w, x: w[0] * jnp.tanh(w[1:] @ x), p=4)
    A(x)          # (1, 4, 4)
    A.offset(x)   # (1,): the target offset phi(0, x), here 0
    ```

    **Arguments:**

    - `unit_fn`: `(w, x) -> out`, one unit with weights `w` of shape `(p,)` at one
      input `x` (any shape), returning a scalar or shape `(k,)`; it must be
      twice differentiable at `w = 0` and is evaluated in the dtype of `x`.
    - `p`: parameters per unit.
    - `atol`: a gradient with max |entry| up to `atol` counts as zero (default
      `1e3 * eps * (1 + max|A| + max|phi(0, x)|)` in the dtype of `x`, i.e.
      round-off).

    **Returns:** an [`AutodiffStructureMatrix`][]: call it on one input for
    `A(x)` (shape `(k, p, p)`; it works under `jit`, `vmap` and `grad`), and use
    its `offset(x)` for the value at zero, which is an offset of the target and
    is reported there, not refused.

    **Raises:** `ValueError` if `unit_fn` is not callable or `p` is not a
    positive integer; when called, `ValueError` ("the theory does not apply")
    if the gradient at zero is nonzero (under `jit`/`vmap` the same message comes
    as a runtime error from `eqx.error_if`).
    """
    if not callable(unit_fn):
        raise ValueError(f"`unit_fn` must be callable (w, x) -> out, got {unit_fn!r}.")
    if isinstance(p, bool) or not isinstance(p, int | np.integer) or p < 1:
        raise ValueError(f"`p` must be a positive integer, got {p!r}.")
    if atol is not None and not (np.isfinite(atol) and atol >= 0):
        raise ValueError(f"`atol` must be finite and non-negative, got {atol!r}.")
    return AutodiffStructureMatrix(unit_fn, int(p), atol)
