r"""The Lotka-Volterra system of a reducible task: growth rates `r`, symmetric
PSD interactions `B` (an `AbstractInteractions`: dense, diagonal, or diagonal
plus low rank) and a decay.

It lives beside the tasks because it is one: the task in its modes' coordinates.
`nqfjax.lv_reduce` builds it from a task; `nqfjax.solve_lv` integrates it.
"""

import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from .._checks import check_ndim, check_shape, is_concrete
from .interactions import (
    AbstractInteractions,
    DenseInteractions,
    DiagonalInteractions,
    LowRankInteractions,
    _finite,
    _nonnegative,
)


class LotkaVolterra(eqx.Module):
    r"""A Lotka-Volterra system with symmetric PSD interactions:

    $$\frac{dm_k}{dt} = m_k\Big(r_k - \sum_l B_{kl} m_l\Big) - \delta\, m_k .$$

    The system of a task (`lv_reduce(task)`) holds its data only, in flow time
    $s = \int \eta\, dt$: `r_k = 4 u_k^T C u_k`,
    `B_kl = 4 <u_k u_k^T, K[u_l u_l^T]>`, no decay (see the documentation's
    theory pages). The learning rate and the weight decay on `W` of a training
    run are `solve_lv`'s arguments, as they are `solve_mflow`'s.

    `B` is the field `interactions`, an `AbstractInteractions` whose type is its
    form (see `nqfjax/tasks/interactions.py`):

    - `DenseInteractions(B)`: `B` of shape `(p, p)`, checked to be symmetric and
      positive semi-definite (one `O(p^3)` eigenvalue computation).
    - `LowRankInteractions(d, U)`: `B = diag(d) + U U^T` with `d >= 0` of shape
      `(p,)` and `U` of shape `(p, q)`: PSD by construction, checked in
      `O(p q)`. The system then holds `O(p q)` memory, never the `p x p`
      matrix, and the vector field and the implicit steps of `solve_lv` cost
      `O(p q)` instead of `O(p^2)`-`O(p^3)`.
    - `DiagonalInteractions(d)`: `B = diag(d)`, independent modes, `O(p)`.

    Construction:

    - `LotkaVolterra(r, interactions)`: any `AbstractInteractions`, held as given
      (cast to the common dtype).
    - `LotkaVolterra(r, B)`: `B` an array of shape `(p, p)`; a concrete `B` that
      is exactly diagonal becomes `DiagonalInteractions`, any other
      `DenseInteractions`.
    - `LotkaVolterra(r, B_diag=d, B_factor=U)`: `LowRankInteractions(d, U)`
      (`DiagonalInteractions(d)` without `B_factor`, or with no columns).

    The checks hold eagerly (`ValueError`) and under `jax.jit`/`jax.vmap`
    (through `eqx.error_if`, threaded into the field it guards: a runtime error
    with the same message whenever that field is used, e.g. by `solve_lv`).

    **Arguments:**

    - `r`: growth rates, shape `(p,)`, finite.
    - `B`: the interactions: an `AbstractInteractions` of size `p`, or an array
      of shape `(p, p)`, finite, symmetric positive semi-definite.
    - `decay`: the system's own death rate `delta >= 0` per unit of its time
      (default 0; a training run's weight decay is `solve_lv`'s
      `weight_decay`, which adds `2 weight_decay` to it).
    - `B_diag`, `B_factor`: instead of `B`, the diagonal-plus-low-rank form.
    - `loss_scale`, `loss_offset`: `loss(m) = loss_scale * (m^T B m / 2 - r^T m)
      + loss_offset`; `lv_reduce` sets them (`1/4` and `E|y|^2 / 2`) so that
      `loss` is the task's loss at the diagonal `M`.

    **Fields:** `r`, `interactions`, `decay`, `loss_scale`, `loss_offset`.
    `lv.interactions(m)` is `B m` (the module is callable, as before this field
    replaced the method of that name). The properties `B`, `B_dense`, `B_diag`
    and `B_factor` of earlier releases are deprecated: use `interactions`
    (`interactions.as_matrix()` for the dense matrix, `O(p^2)`).

    **Raises:** `ValueError` (eagerly; a runtime error naming the argument under
    `jit`/`vmap`) for wrong shapes, non-finite `r`/`B`, a non-symmetric or
    indefinite `B`, a negative `B_diag`, `decay < 0`, or interactions of
    another size than `r`.
    """

    r: Float[Array, " p"]
    interactions: AbstractInteractions
    decay: Float[Array, ""]
    loss_scale: Float[Array, ""]
    loss_offset: Float[Array, ""]

    def __init__(
        self,
        r,
        B=None,
        decay=0.0,
        *,
        B_diag=None,
        B_factor=None,
        loss_scale=1.0,
        loss_offset=0.0,
    ):
        arrays = (("B", B), ("B_diag", B_diag), ("B_factor", B_factor))
        given = {k for k, v in arrays if v is not None}
        if ("B" in given) == ("B_diag" in given):
            raise ValueError("Give either `B` or `B_diag` (with optional `B_factor`).")
        if given == {"B", "B_factor"}:
            raise ValueError("`B_factor` goes with `B_diag`, not with `B`.")
        if isinstance(B, AbstractInteractions):
            leaves = [jnp.asarray(r), *jax.tree.leaves(B)]
        else:
            leaves = [
                jnp.asarray(r),
                *(jnp.asarray(v) for _, v in arrays if v is not None),
            ]
        dtype = jnp.result_type(*leaves, float)
        r = jnp.asarray(r, dtype)
        check_ndim("r", r, 1, "a vector of growth rates")
        p = r.shape[0]
        self.r = _finite("r", r)
        if isinstance(B, AbstractInteractions):
            if B.size != p:
                raise ValueError(
                    f"The interactions have size {B.size} but `r` has shape {r.shape}."
                )
            self.interactions = jax.tree.map(lambda x: jnp.asarray(x, dtype), B)
        elif "B" in given:
            self.interactions = _from_matrix(jnp.asarray(B, dtype), p)
        else:
            B_diag = jnp.asarray(B_diag, dtype)
            check_shape("B_diag", B_diag, (p,))
            if "B_factor" in given:
                B_factor = jnp.asarray(B_factor, dtype)
                if B_factor.ndim != 2 or B_factor.shape[0] != p:
                    raise ValueError(
                        f"`B_factor` must have shape ({p}, q), got {B_factor.shape}."
                    )
            if "B_factor" not in given or B_factor.shape[1] == 0:
                self.interactions = DiagonalInteractions(B_diag, _name="B_diag")
            else:
                self.interactions = LowRankInteractions(
                    B_diag, B_factor, _names=("B_diag", "B_factor")
                )
        decay = jnp.asarray(decay, dtype)
        check_shape("decay", decay, ())
        self.decay = _nonnegative("decay", decay, ">= 0 (a weight-decay rate)")
        self.loss_scale = jnp.asarray(loss_scale, dtype)
        self.loss_offset = jnp.asarray(loss_offset, dtype)
        check_shape("loss_scale", self.loss_scale, ())
        check_shape("loss_offset", self.loss_offset, ())

    @property
    def p(self) -> int:
        return self.r.shape[0]

    @property
    def B(self) -> Float[Array, "p p"]:
        """Deprecated: `interactions.as_matrix()`, the dense matrix (`O(p^2)`)."""
        _deprecated("B", "`lv.interactions.as_matrix()` (the dense matrix)")
        return self.interactions.as_matrix()

    @property
    def B_dense(self) -> Float[Array, "p p"] | None:
        """Deprecated: the dense matrix of `DenseInteractions`, else None."""
        _deprecated("B_dense", "`lv.interactions` (a `DenseInteractions` has `.B`)")
        inter = self.interactions
        return inter.B if isinstance(inter, DenseInteractions) else None

    @property
    def B_diag(self) -> Float[Array, " p"] | None:
        """Deprecated: `d` of a diagonal or diagonal-plus-low-rank system, else
        None."""
        _deprecated("B_diag", "`lv.interactions` (its `.d`)")
        inter = self.interactions
        if isinstance(inter, (DiagonalInteractions, LowRankInteractions)):
            return inter.d
        return None

    @property
    def B_factor(self) -> Float[Array, "p q"] | None:
        """Deprecated: `U` of a diagonal-plus-low-rank system (no columns for a
        diagonal one), else None."""
        _deprecated("B_factor", "`lv.interactions` (its `.U`)")
        inter = self.interactions
        if isinstance(inter, LowRankInteractions):
            return inter.U
        if isinstance(inter, DiagonalInteractions):
            return jnp.zeros((*inter.d.shape, 0), inter.d.dtype)
        return None

    def self_interactions(self) -> Float[Array, " p"]:
        """The diagonal `B_kk`, shape `(p,)` (`interactions.diagonal()`), in
        `O(p q)`. `B` is PSD, so this is also the largest `|B_kl|` of each row."""
        return self.interactions.diagonal()

    def vector_field(self, m: Float[Array, " p"]) -> Float[Array, " p"]:
        """`dm/dt` at `m`, shape `(p,)`."""
        return m * (self.r - self.interactions.mv(m) - self.decay)

    def loss(self, m: Float[Array, "... p"]) -> Float[Array, "..."]:
        """The loss at the diagonal state `m` (any leading batch shape)."""
        quad = 0.5 * self.interactions.quadratic(m)
        return self.loss_scale * (quad - m @ self.r) + self.loss_offset

    def fixed_point_isolated(self) -> Float[Array, " p"]:
        """`m*_k = (r_k - decay) / B_kk`: each mode's equilibrium on its own."""
        return (self.r - self.decay) / self.self_interactions()


def _deprecated(name: str, instead: str):
    # at the caller: this function, the property, and the `__getattribute__` of
    # equinox's modules, which reads the property
    warnings.warn(
        f"`LotkaVolterra.{name}` is deprecated; use {instead}.",
        DeprecationWarning,
        stacklevel=4,
    )


def _from_matrix(B, p: int) -> AbstractInteractions:
    """The interactions of a dense array `B`: `DiagonalInteractions` when it is
    concrete and exactly diagonal (PSD iff its diagonal is `>= 0`), else
    `DenseInteractions` (checked symmetric PSD)."""
    check_shape("B", B, (p, p))
    diagonal = _concrete_diagonal(B)
    if diagonal is None:
        return DenseInteractions(B)
    diagonal = _nonnegative(
        "B",
        diagonal,
        "positive semi-definite (its diagonal, which is its eigenvalues, must be >= 0)",
    )
    return DiagonalInteractions(diagonal, _name="B")


def _concrete_diagonal(B):
    """The diagonal of a concrete, exactly diagonal `B`; None otherwise (traced,
    or with a nonzero entry off the diagonal)."""
    if not is_concrete(B):
        return None
    Bn = np.asarray(B)
    diag = np.diag(Bn)
    if np.count_nonzero(Bn - np.diag(diag)) != 0 or not np.all(np.isfinite(diag)):
        return None
    return jnp.asarray(diag, B.dtype)
