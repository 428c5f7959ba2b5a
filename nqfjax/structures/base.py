"""The abstract `Structure`: a layer that is a sum over interchangeable units."""

import abc

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from .._checks import check_shape, finite


class Structure(eqx.Module):
    r"""A layer whose units are interchangeable, and its structure matrix.

    Near small weights every such layer is, to leading order, the quadratic form

    $$f_j(x; W) - f_j(x; 0) = \mathrm{Tr}[W W^\top A_j(x)] + O(|W|^3),
    \qquad A(x) = \tfrac12 \mathrm{Hess}_w \phi(0, x),$$

    with `W` of shape `(p, m)` holding one unit per column (THEORY.md section 1).

    Concrete structures implement `_A`, `_unit` and `_layer` for one input; the
    public `A`, `unit` and `layer` check shapes and values first. Sampled tasks
    (`task_from_samples`) reach `A` only through `_contract` and `_weighted_sum`
    over a batch of inputs; their defaults build every `A(x_s)`, and a structure
    whose `A` is sparse or low-rank overrides them (with `_sample_size`, the
    numbers held per sample) so that `K` costs less than `O(n k p^2)`.

    **Attributes:**

    - `p`: parameters per unit.
    - `k`: number of outputs.
    - `input_shape`: the shape of one input `x`.
    - `additive`: whether `layer(W, x) - layer(0, x)` is exactly the sum of
      `unit` over the columns of `W` (false for the softmax cases, where it
      holds to leading order).
    - `max_units`: the most units (columns of `W`) the real layer holds, or
      `None` when any number will do (a mixture of experts has a fixed number of
      experts; the quadratic form itself takes any `m`).
    """

    k: eqx.AbstractVar[int]

    @property
    @abc.abstractmethod
    def p(self) -> int:
        """Parameters per unit."""

    @property
    @abc.abstractmethod
    def input_shape(self) -> tuple[int, ...]:
        """The shape of one input."""

    @property
    @abc.abstractmethod
    def additive(self) -> bool:
        """Whether the layer is exactly the sum of its units plus its value at 0."""

    @property
    def max_units(self) -> int | None:
        """The most units `layer` accepts (`None`: unbounded)."""
        return None

    @abc.abstractmethod
    def _A(self, x) -> Float[Array, "k p p"]: ...

    @abc.abstractmethod
    def _unit(self, w, x) -> Float[Array, " k"]: ...

    @abc.abstractmethod
    def _layer(self, W, x) -> Float[Array, " k"]: ...

    def _contract(self, xs, X) -> Float[Array, "b k"]:
        """`Tr[A_j(x_s) X]` for a batch `xs` (shape `(b, *input_shape)`) and a
        symmetric `X` (shape `(p, p)`)."""
        A = jax.vmap(self._A)(xs).astype(X.dtype)
        return jnp.einsum("bkij,ij->bk", A, X)

    def _weighted_sum(self, xs, c) -> Float[Array, "p p"]:
        """`sum_s sum_j c_sj A_j(x_s)` for a batch `xs` and weights `c` (shape
        `(b, k)`)."""
        A = jax.vmap(self._A)(xs).astype(c.dtype)
        return jnp.einsum("bk,bkij->ij", c, A)

    def _sample_size(self) -> int:
        """Numbers that `_contract` and `_weighted_sum` hold per sample (sets the
        default chunk of samples in `task_from_samples`)."""
        return self.k * self.p * self.p

    def _check_x(self, x):
        check_shape("x", x, self.input_shape)
        return finite("x", jnp.asarray(x))

    def A(self, x) -> Float[Array, "k p p"]:
        """The structure matrices of one input, shape `(k, p, p)`, symmetric.

        **Arguments:**

        - `x`: one input, shape `input_shape`.
        """
        return self._A(self._check_x(x))

    def unit(self, w, x) -> Float[Array, " k"]:
        """The layer with only the unit `w` (shape `(p,)`) switched on, minus the
        layer at zero, at one input `x`. Shape `(k,)`."""
        x = self._check_x(x)
        check_shape("w", w, (self.p,))
        return self._unit(finite("w", jnp.asarray(w)), x)

    def layer(self, W, x) -> Float[Array, " k"]:
        """The real nonlinear layer with units as the columns of `W` (shape
        `(p, m)`), at one input `x`. Shape `(k,)`."""
        x = self._check_x(x)
        W = jnp.asarray(W)
        if W.ndim != 2 or W.shape[0] != self.p:
            raise ValueError(
                f"`W` must have shape (p, m) = ({self.p}, m) with units as columns, "
                f"got {W.shape}."
            )
        if self.max_units is not None and W.shape[1] > self.max_units:
            raise ValueError(
                f"`W` must have at most {self.max_units} columns (units) for this "
                f"layer, got shape {W.shape}."
            )
        return self._layer(finite("W", W), x)
