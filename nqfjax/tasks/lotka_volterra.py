r"""The Lotka-Volterra system of a reducible task: growth rates `r`, symmetric
PSD interactions `B` (dense, or diagonal plus low rank) and a decay.

It lives beside the tasks because it is one: the task in its modes' coordinates.
`nqfjax.lv_reduce` builds it from a task; `nqfjax.solve_lv` integrates it.
"""

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from .._checks import check_ndim, check_shape, error_if, is_concrete, symmetric_psd


class LotkaVolterra(eqx.Module):
    r"""A Lotka-Volterra system with symmetric PSD interactions:

    $$\frac{dm_k}{dt} = m_k\Big(r_k - \sum_l B_{kl} m_l\Big) - \delta\, m_k .$$

    With `learning_rate` the learning rate and `lam` the weight decay on `W`,
    `r_k = 4 learning_rate u_k^T C u_k`,
    `B_kl = 4 learning_rate <u_k u_k^T, K[u_l u_l^T]>` and
    `decay = 2 learning_rate lam`; time counts gradient steps (see the
    documentation's theory pages).

    `B` comes in one of two forms:

    - dense: `LotkaVolterra(r, B)`, `B` of shape `(p, p)`, checked to be symmetric
      and positive semi-definite (one `O(p^3)` eigenvalue computation). A concrete
      `B` that is exactly diagonal is stored in the structured form with `q = 0`.
    - structured: `LotkaVolterra(r, B_diag=d, B_factor=U)`, meaning
      `B = diag(d) + U U^T` with `d` of shape `(p,)` and `U` of shape `(p, q)`
      (`U` defaults to no columns: independent modes). It requires `d >= 0`,
      which makes `B` symmetric and positive semi-definite by construction, so
      the check costs `O(p q)`. The system then holds `O(p q)` memory, never the
      `p x p` matrix, and the vector field and the implicit steps of `solve_lv`
      cost `O(p q)` instead of `O(p^2)`-`O(p^3)`.

    The checks hold eagerly (`ValueError`) and under `jax.jit`/`jax.vmap`
    (through `eqx.error_if`, threaded into the field it guards: a runtime error
    with the same message whenever that field is used, e.g. by `solve_lv`).

    **Arguments:**

    - `r`: growth rates, shape `(p,)`, finite.
    - `B`: interactions, shape `(p, p)`, finite, symmetric positive semi-definite.
    - `decay`: the weight-decay rate `delta >= 0` (default 0).
    - `B_diag`, `B_factor`: instead of `B`, the structured form above.
    - `loss_scale`, `loss_offset`: `loss(m) = loss_scale * (m^T B m / 2 - r^T m)
      + loss_offset`; `lv_reduce` sets them (`1/(4 learning_rate)` and
      `E|y|^2 / 2`) so that `loss` is the task's loss at the diagonal `M`.

    **Fields:** `r`, `decay`, `loss_scale`, `loss_offset`; `B_dense` (the dense
    matrix, or `None` for a structured system); `B_diag`, `B_factor` (or `None`
    for a dense one). The property `B` gives the dense matrix in either case.

    **Raises:** `ValueError` (eagerly; a runtime error naming the argument under
    `jit`/`vmap`) for wrong shapes, non-finite `r`/`B`, a non-symmetric or
    indefinite `B`, a negative `B_diag`, or `decay < 0`.
    """

    r: Float[Array, " p"]
    B_dense: Float[Array, "p p"] | None
    decay: Float[Array, ""]
    loss_scale: Float[Array, ""]
    loss_offset: Float[Array, ""]
    B_diag: Float[Array, " p"] | None
    B_factor: Float[Array, "p q"] | None

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
        if (B is None) == (B_diag is None):
            raise ValueError("Give either `B` or `B_diag` (with optional `B_factor`).")
        if B is not None and B_factor is not None:
            raise ValueError("`B_factor` goes with `B_diag`, not with `B`.")
        leaves = [jnp.asarray(x) for x in (r, B, B_diag, B_factor) if x is not None]
        dtype = jnp.result_type(*leaves, float)
        r = jnp.asarray(r, dtype)
        check_ndim("r", r, 1, "a vector of growth rates")
        p = r.shape[0]
        self.r = _finite("r", r)
        if B is not None:
            B = jnp.asarray(B, dtype)
            check_shape("B", B, (p, p))
            diagonal = _concrete_diagonal(B)
            if diagonal is None:
                self.B_dense = symmetric_psd("B", B)
                self.B_diag = self.B_factor = None
            else:  # exactly diagonal: PSD iff the diagonal is >= 0
                self.B_dense = None
                self.B_diag = _nonnegative(
                    "B",
                    diagonal,
                    "positive semi-definite (its diagonal, which is "
                    "its eigenvalues, must be >= 0)",
                )
                self.B_factor = jnp.zeros((p, 0), dtype)
        else:
            B_diag = jnp.asarray(B_diag, dtype)
            check_shape("B_diag", B_diag, (p,))
            B_factor = jnp.zeros((p, 0), dtype) if B_factor is None else B_factor
            B_factor = jnp.asarray(B_factor, dtype)
            if B_factor.ndim != 2 or B_factor.shape[0] != p:
                raise ValueError(
                    f"`B_factor` must have shape ({p}, q), got {B_factor.shape}."
                )
            self.B_dense = None
            self.B_diag = _nonnegative(
                "B_diag",
                B_diag,
                "non-negative (this makes B = diag(B_diag) + "
                "B_factor B_factor^T symmetric positive semi-definite)",
            )
            self.B_factor = _finite("B_factor", B_factor)
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
        """The dense interactions, shape `(p, p)`. For a structured system it is
        built on each access (`O(p^2)` memory): prefer `interactions` and
        `self_interactions`, which cost `O(p q)`."""
        if self.B_dense is not None:
            return self.B_dense
        return jnp.diag(self.B_diag) + self.B_factor @ self.B_factor.T

    def self_interactions(self) -> Float[Array, " p"]:
        """The diagonal `B_kk`, shape `(p,)`, in `O(p q)`. `B` is PSD, so this is
        also the largest `|B_kl|` of each row."""
        if self.B_dense is not None:
            return jnp.diag(self.B_dense)
        return self.B_diag + jnp.sum(self.B_factor**2, axis=1)

    def interactions(self, m: Float[Array, "... p"]) -> Float[Array, "... p"]:
        """`B m` (any leading batch shape), in `O(p q)` when `B` is structured."""
        return _interactions(self.B_dense, self.B_diag, self.B_factor, m)

    def vector_field(self, m: Float[Array, " p"]) -> Float[Array, " p"]:
        """`dm/dt` at `m`, shape `(p,)`."""
        return m * (self.r - self.interactions(m) - self.decay)

    def loss(self, m: Float[Array, "... p"]) -> Float[Array, "..."]:
        """The loss at the diagonal state `m` (any leading batch shape)."""
        quad = 0.5 * jnp.sum(m * self.interactions(m), axis=-1)
        return self.loss_scale * (quad - m @ self.r) + self.loss_offset

    def fixed_point_isolated(self) -> Float[Array, " p"]:
        """`m*_k = (r_k - decay) / B_kk`: each mode's equilibrium on its own."""
        return (self.r - self.decay) / self.self_interactions()


def _interactions(B, B_diag, B_factor, m):
    """`B m` from the dense `B` (when `B_diag` is None) or the structured form."""
    if B_diag is None:
        return m @ B  # B is symmetric
    d = B_diag.reshape((1,) * (jnp.ndim(m) - 1) + B_diag.shape)  # batch dims of m
    return d * m + (m @ B_factor) @ B_factor.T


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


def _finite(name, x):
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
