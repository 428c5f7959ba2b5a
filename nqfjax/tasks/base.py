r"""The abstract `Task`: what a data distribution contributes to the flow of `M`.

A task is the triple $(K, C, \mathbb{E}|y|^2)$,

$$C = \mathbb{E} \sum_j y_j A_j(x), \qquad
K[X] = \mathbb{E} \sum_j A_j(x)\, \mathrm{Tr}[A_j(x) X], \qquad
L(M) = \tfrac12 \langle M, K[M] \rangle - \langle C, M \rangle
+ \tfrac12 \mathbb{E}|y|^2,$$

with `K` applied matrix-free (the `p^4` tensor is never formed). See the docs'
theory page "The closed flow of M".
"""

import abc

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from .._checks import (
    check_shape,
)
from .._linalg import frobenius
from .lotka_volterra import LotkaVolterra


class Task(eqx.Module):
    r"""What a data distribution contributes to the dynamics of `M`
    (docs/theory/closed-flow.md): the matrix-free PSD map `K`, the matrix `C`
    and `E|y|^2`.

    Concrete tasks provide `C`, `y2` and `_K`; `K`, `loss` and `gradient` are
    shared. `K` is linear and self-adjoint in the Frobenius inner product; it is
    meant for symmetric arguments (a non-symmetric `X` acts through its
    symmetric part for the tasks here).

    **Attributes:**

    - `p`: parameters per unit (the size of `M`).
    - `C`: $\mathbb{E}\sum_j y_j A_j(x)$, shape `(p, p)`, symmetric.
    - `y2`: $\mathbb{E}|y|^2$, a scalar.
    """

    C: eqx.AbstractVar[Float[Array, "p p"]]
    y2: eqx.AbstractVar[Float[Array, ""]]

    @abc.abstractmethod
    def _K(self, X: Float[Array, "p p"]) -> Float[Array, "p p"]: ...

    @property
    def p(self) -> int:
        """Parameters per unit: `M` is `p x p`."""
        return self.C.shape[0]

    @property
    def dtype(self):
        return self.C.dtype

    def K(self, X: Float[Array, "p p"]) -> Float[Array, "p p"]:
        r"""$K[X] = \mathbb{E}\sum_j A_j(x)\,\mathrm{Tr}[A_j(x) X]$, shape `(p, p)`.

        **Arguments:**

        - `X`: a symmetric matrix, shape `(p, p)`.

        **Raises:** `ValueError` if `X` is not `(p, p)`.
        """
        X = jnp.asarray(X)
        check_shape("X", X, (self.p, self.p))
        return self._K(X)

    def gradient(self, M: Float[Array, "p p"]) -> Float[Array, "p p"]:
        r"""$G(M) = \partial L / \partial M = K[M] - C$, shape `(p, p)`."""
        return self.K(M) - self.C

    def loss(self, M: Float[Array, "p p"]) -> Float[Array, ""]:
        r"""$L(M) = \tfrac12\langle M, K[M]\rangle - \langle C, M\rangle
        + \tfrac12 \mathbb{E}|y|^2$, the squared loss of the quadratic model
        $f_j(x) = \mathrm{Tr}[M A_j(x)]$ (a scalar).

        **Arguments:**

        - `M`: shape `(p, p)`, symmetric (usually PSD, `M = W W^T`).
        """
        M = jnp.asarray(M)
        check_shape("M", M, (self.p, self.p))
        return 0.5 * frobenius(M, self._K(M)) - frobenius(self.C, M) + 0.5 * self.y2

    def mode_couplings(
        self,
        U: Float[Array, "p r"],
        probes: Float[Array, "r N"] | None = None,
    ) -> Float[Array, "r r"] | tuple[Float[Array, "r r"], Float[Array, "N p p"]]:
        r"""The couplings of the rank-one modes $u_l u_l^\top$ of the columns of
        `U`, and optionally the `K`-images of random combinations of them:

        $$D_{kl} = \langle u_k u_k^\top, K[u_l u_l^\top]\rangle, \qquad
        Z_i = K\big[U \mathrm{diag}(g_i)\, U^\top\big],$$

        with $g_i$ the columns of `probes`. `lv_reduce` builds
        $B = 4 D$ from them and estimates its violation from the $Z_i$.

        The default applies `K` to each $u_l u_l^\top$ (`r` applications and
        `O(r p^3)` flops) and to each probe; `SampledTask` overrides it through
        the structure's `contract_factor` and `weighted_sum` in one pass over the
        samples (`O(n k p r)` for `F`, `O(n k r^2)` for $D = F^\top F / n$).
        Computed in the task's dtype.

        **Arguments:**

        - `U`: shape `(p, r)`, the modes as columns (usually orthonormal).
        - `probes`: shape `(r, N)`, or `None` (default).

        **Returns:** `D`, shape `(r, r)`, symmetric; with `probes`, `(D, Z)` with
        `Z` of shape `(N, p, p)`.

        **Raises:** `ValueError` for shapes that do not match.
        """
        U, G = check_modes(self, U, probes)
        D = _image_couplings(self, U)
        if probes is None:
            return D
        return D, _probe_images(self, U, G)

    def gradient_factor(self, W: Float[Array, "p r"]) -> Float[Array, "p r"]:
        r"""$G(W W^\top)\, W = K[W W^\top] W - C W$, shape `(p, r)`: the
        gradient of the factored M-space flow,
        $\dot W = -\eta\,(2 G(W W^\top) W + \lambda W)$.

        The default forms $W W^\top$ and calls `gradient` (`O(p^2 r)` plus one
        `K`); `SampledTask` sums over the samples through the structure's
        factored hooks instead, never forming a `(p, p)` matrix.

        **Arguments:**

        - `W`: a factor, shape `(p, r)`.
        """
        W = jnp.asarray(W)
        check_factor(W, self.p)
        return self.gradient(W @ W.T) @ W

    def loss_factor(self, W: Float[Array, "p r"]) -> Float[Array, ""]:
        r"""$L(W W^\top)$ (a scalar), the loss at $M = W W^\top$ (see `loss`).
        The default forms $W W^\top$; `SampledTask` reads it off the model's
        outputs $\mathrm{Tr}[A_j(x_s) W W^\top]$ instead.

        **Arguments:**

        - `W`: a factor, shape `(p, r)`.
        """
        W = jnp.asarray(W)
        check_factor(W, self.p)
        return self.loss(W @ W.T)

    def known_reduction(
        self, eta=1.0, weight_decay=0.0
    ) -> tuple[LotkaVolterra, Float[Array, "p p"]] | None:
        """The Lotka-Volterra reduction `(lv, basis)` when the task knows it in
        closed form, else `None` (the default), in which case `nqfjax.lv_reduce`
        searches for the shared eigenbasis numerically. Tasks whose basis is known
        (independent modes, say) override this so that `lv_reduce` needs no
        search. The system is in flow time at the defaults (`lv_reduce(task)`);
        `eta` and `weight_decay` carry `lv_reduce`'s deprecated arguments for one
        release (rates times `eta`, decay `2 eta weight_decay`)."""
        del eta, weight_decay
        return None


def check_modes(task: Task, U, probes):
    """`U` (`(p, r)`) and `probes` (`(r, N)`, or no columns when `None`) as arrays
    of the task's dtype, after checking their shapes."""
    U = jnp.asarray(U, task.dtype)
    if U.ndim != 2 or U.shape[0] != task.p:
        raise ValueError(f"`U` must have shape (p, r) = ({task.p}, r), got {U.shape}.")
    if probes is None:
        return U, jnp.zeros((U.shape[1], 0), task.dtype)
    G = jnp.asarray(probes, task.dtype)
    if G.ndim != 2 or G.shape[0] != U.shape[1]:
        raise ValueError(
            f"`probes` must have shape (r, N) = ({U.shape[1]}, N), got {G.shape}."
        )
    return U, G


def _per_call(p: int) -> int:
    """Columns per batch when each holds a `(p, p)` matrix (about 2^22 numbers)."""
    return max(1, 2**22 // (p * p))


@eqx.filter_jit
def _image_couplings(task, U):
    def one(u):  # diag(U^T K[u u^T] U): column l of D
        return jnp.sum(U * (task.K(jnp.outer(u, u)) @ U), axis=0)

    return jax.lax.map(one, U.T, batch_size=_per_call(U.shape[0])).T


@eqx.filter_jit
def _probe_images(task, U, G):
    def one(g):
        return task.K((U * g[None, :]) @ U.T)

    return jax.lax.map(one, G.T, batch_size=_per_call(U.shape[0]))


def check_factor(W, p: int) -> None:
    """`ValueError` unless `W` is a factor of shape `(p, r)`."""
    if W.ndim != 2 or W.shape[0] != p:
        raise ValueError(f"`W` must have shape (p, r) = ({p}, r), got {W.shape}.")
