r"""The Lotka-Volterra system of a reducible task: growth rates `r`, symmetric
PSD interactions `B` (dense, or diagonal plus low rank) and a decay.

It lives beside the tasks because it is one: the task in its modes' coordinates.
`nqfjax.lv_reduce` builds it from a task; `nqfjax.solve_lv` integrates it.
"""

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from .._checks import check_ndim, check_shape, is_concrete


class LotkaVolterra(eqx.Module):
    r"""A Lotka-Volterra system with symmetric PSD interactions (THEORY.md section 3):

    $$\frac{dm_k}{dt} = m_k\Big(r_k - \sum_l B_{kl} m_l\Big) - \delta\, m_k .$$

    With `eta` the learning rate and `lam` the weight decay on `W`,
    `r_k = 4 eta u_k^T C u_k`, `B_kl = 4 eta <u_k u_k^T, K[u_l u_l^T]>` and
    `decay = 2 eta lam`; time counts gradient steps.

    **Arguments:**

    - `r`: growth rates, shape `(p,)`.
    - `B`: interactions, shape `(p, p)`, symmetric positive semi-definite.
    - `decay`: the weight-decay rate `delta >= 0` (default 0).
    - `B_diag`, `B_factor`: instead of `B`, the structure
      `B = diag(B_diag) + B_factor @ B_factor.T` (shapes `(p,)` and `(p, q)`;
      `B_factor` defaults to no columns, i.e. independent modes). Then the vector
      field and the implicit steps of `solve_lv` cost `O(p q)` instead of
      `O(p^2)`-`O(p^3)`; `B` is still materialised for the rest of the API. A
      concrete `B` that is exactly diagonal is recognised as structured too.
    - `loss_scale`, `loss_offset`: `loss(m) = loss_scale * (m^T B m / 2 - r^T m)
      + loss_offset`; `lv_reduce` sets them (`1/(4 eta)` and `E|y|^2 / 2`) so that
      `loss` is the task's loss at the diagonal `M`.
    """

    r: Float[Array, " p"]
    B: Float[Array, "p p"]
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
        r = jnp.asarray(r)
        if (B is None) == (B_diag is None):
            raise ValueError("Give either `B` or `B_diag` (with optional `B_factor`).")
        dtype = jnp.result_type(r, B if B is not None else B_diag, float)
        if B is None:
            B_diag = jnp.asarray(B_diag, dtype)
            check_ndim("B_diag", B_diag, 1, "the diagonal of B")
            if B_factor is None:
                B_factor = jnp.zeros((B_diag.shape[0], 0), dtype)
            B_factor = jnp.asarray(B_factor, dtype)
            if B_factor.ndim != 2 or B_factor.shape[0] != B_diag.shape[0]:
                raise ValueError(
                    f"`B_factor` must have shape ({B_diag.shape[0]}, q), got "
                    f"{B_factor.shape}."
                )
            B = jnp.diag(B_diag) + B_factor @ B_factor.T
        else:
            if B_factor is not None:
                raise ValueError("`B_factor` goes with `B_diag`, not with `B`.")
            B = jnp.asarray(B, dtype)
            if is_concrete(B) and B.ndim == 2 and B.shape[0] == B.shape[1]:
                Bn = np.asarray(B)
                if np.count_nonzero(Bn - np.diag(np.diag(Bn))) == 0:
                    B_diag = jnp.asarray(np.diag(Bn))
                    B_factor = jnp.zeros((Bn.shape[0], 0), dtype)
        self.r = r.astype(dtype)
        self.B = B
        self.decay = jnp.asarray(decay, dtype)
        self.loss_scale = jnp.asarray(loss_scale, dtype)
        self.loss_offset = jnp.asarray(loss_offset, dtype)
        self.B_diag = B_diag
        self.B_factor = B_factor

    def __check_init__(self):
        check_ndim("r", self.r, 1, "a vector of growth rates")
        p = self.r.shape[0]
        check_shape("B", self.B, (p, p))
        check_shape("decay", self.decay, ())
        if is_concrete(self.r, self.B, self.decay):
            r, B = np.asarray(self.r), np.asarray(self.B)
            if not (np.all(np.isfinite(r)) and np.all(np.isfinite(B))):
                raise ValueError("`r` and `B` must be finite.")
            scale = np.max(np.abs(B)) if B.size else 0.0
            if np.max(np.abs(B - B.T), initial=0.0) > 1e-6 * scale:
                raise ValueError("`B` must be symmetric (THEORY.md section 3).")
            diagonal = np.count_nonzero(B - np.diag(np.diag(B))) == 0
            # a diagonal B (independent modes, thousands of them for power laws)
            # is PSD iff its diagonal is non-negative: skip the O(p^3) eigvalsh
            low = (
                np.diag(B).min(initial=0.0)
                if diagonal
                else (np.linalg.eigvalsh(0.5 * (B + B.T)).min() if p else 0.0)
            )
            if low < -1e-6 * scale * p:
                raise ValueError(
                    "`B` must be positive semi-definite; its smallest eigenvalue is "
                    f"{low:.3g}."
                )
            if not (np.isfinite(float(self.decay)) and float(self.decay) >= 0):
                raise ValueError(f"`decay` must be >= 0, got {float(self.decay)}.")

    @property
    def p(self) -> int:
        return self.r.shape[0]

    def interactions(self, m: Float[Array, "... p"]) -> Float[Array, "... p"]:
        """`B m` (any leading batch shape), in `O(p q)` when `B` is structured."""
        return _interactions(self.B, self.B_diag, self.B_factor, m)

    def vector_field(self, m: Float[Array, " p"]) -> Float[Array, " p"]:
        """`dm/dt` at `m`, shape `(p,)`."""
        return m * (self.r - self.interactions(m) - self.decay)

    def loss(self, m: Float[Array, "... p"]) -> Float[Array, "..."]:
        """The loss at the diagonal state `m` (any leading batch shape)."""
        quad = 0.5 * jnp.sum(m * self.interactions(m), axis=-1)
        return self.loss_scale * (quad - m @ self.r) + self.loss_offset

    def fixed_point_isolated(self) -> Float[Array, " p"]:
        """`m*_k = (r_k - decay) / B_kk`: each mode's equilibrium on its own."""
        return (self.r - self.decay) / jnp.diag(self.B)


def _interactions(B, B_diag, B_factor, m):
    if B_diag is None:
        return m @ B  # B is symmetric
    d = B_diag.reshape((1,) * (jnp.ndim(m) - 1) + B_diag.shape)  # batch dims of m
    return d * m + (m @ B_factor) @ B_factor.T
