r"""The model W-space training fits: the prediction $f(x; W)$ of a structure's
weights, as the real layer (`Layer`) or its quadratic form (`QuadraticForm`).

A model splits its prediction as $f(x; W) = f_0(x) + g(x; W)$: the offset
$f_0$, which does not depend on `W`, is subtracted from the targets once, and
`g` is evaluated at every step, so that the residual $f - y = g - (y - f_0)$
costs nothing for the offset.
"""

import abc
import warnings
from typing import final

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from .base import AbstractStructure


class AbstractModel(eqx.Module):
    r"""The prediction $f(x; W)$ that `nqfjax.train` fits to the targets.

    **Abstract methods** (for a batch of inputs `xs`, shape
    `(n, *structure.input_shape)`, and weights `W`, shape `(p, m)`; no value
    checks -- `train` checks its data once -- so that they can run every step):

    - `offset(structure, xs, width)`: $f_0(x)$, the part that does not depend
      on `W`, shape `(n, k)`.
    - `apply(structure, W, xs)`: $g(x; W) = f(x; W) - f_0(x)$, shape `(n, k)`.

    **Method with a default:** `max_units(structure)`, the most units the model
    holds (`None`: any number).

    `model(structure, W, xs)` is the whole prediction $f_0 + g$. Concrete
    models are final.
    """

    @abc.abstractmethod
    def offset(
        self, structure: AbstractStructure, xs, width: int
    ) -> Float[Array, "n k"]:
        """$f_0(x)$: the part of the prediction that does not depend on `W`."""

    @abc.abstractmethod
    def apply(
        self, structure: AbstractStructure, W: Float[Array, "p m"], xs
    ) -> Float[Array, "n k"]:
        """$g(x; W) = f(x; W) - f_0(x)$ for a batch of inputs."""

    def max_units(self, structure: AbstractStructure) -> int | None:
        """The most units (columns of `W`) the model holds; `None`: no limit."""
        return None

    def __call__(
        self, structure: AbstractStructure, W: Float[Array, "p m"], xs
    ) -> Float[Array, "n k"]:
        r"""The prediction $f(x_s; W) = f_0(x_s) + g(x_s; W)$, shape `(n, k)`."""
        return self.offset(structure, xs, W.shape[1]) + self.apply(structure, W, xs)


@final
class Layer(AbstractModel):
    r"""The real layer: $f(x; W) = $ `structure.layer(W, x)`, its value at
    zero weights included ($f_0 = 0$: nothing is split off).

    At most `structure.max_units` units (e.g. one for a single attention head).
    """

    def offset(self, structure, xs, width):
        return jnp.zeros((xs.shape[0], structure.k), xs.dtype)

    def apply(self, structure, W, xs):
        return jax.vmap(structure.layer, in_axes=(None, 0))(W, xs)

    def max_units(self, structure):
        return structure.max_units


@final
class QuadraticForm(AbstractModel):
    r"""The layer's quadratic form:
    $f_j(x; W) = f_j(x; 0) + \mathrm{Tr}[W W^\top A_j(x)]$.

    $f_0(x) = f(x; 0)$ is the layer at zero weights (its `max_units` at most,
    so the form may have more units than the layer); $g$ goes through the
    structure's batch contraction (`structure.contract`, a closed form where
    the structure has one: no `A(x)` is built). Its squared loss is exactly
    `task_from_samples(structure, xs, ys).loss(W W^T)`. Any number of units.
    """

    def offset(self, structure, xs, width):
        # the layer at zero weights, with at most the units the layer holds (a
        # mixture of experts' form may have more units than experts)
        cap = structure.max_units
        width = width if cap is None else min(width, cap)
        zero = jnp.zeros((structure.p, width), xs.dtype)
        return jax.vmap(structure.layer, in_axes=(None, 0))(zero, xs)

    def apply(self, structure, W, xs):
        return structure.contract(xs, W @ W.T)


#: The command line's words for the models (a sweep configuration's `model`).
MODELS: dict[str, AbstractModel] = {"layer": Layer(), "quadratic": QuadraticForm()}


def as_model(model, *, stacklevel: int = 3) -> AbstractModel:
    """`model` as an `AbstractModel`; the words `"layer"` and `"quadratic"` are
    accepted for one release with a `DeprecationWarning` (attributed
    `stacklevel` frames up: the default is the caller of the function that
    calls this). `ValueError` for anything else."""
    if isinstance(model, AbstractModel):
        return model
    if isinstance(model, str) and model in MODELS:
        new = type(MODELS[model]).__name__
        warnings.warn(
            f'`model="{model}"` is deprecated and will be removed in the next '
            f"release: pass `model=nqfjax.{new}()`.",
            DeprecationWarning,
            stacklevel=stacklevel,
        )
        return MODELS[model]
    raise ValueError(
        "`model` must be an nqfjax.AbstractModel (`nqfjax.Layer()` or "
        f"`nqfjax.QuadraticForm()`), got {model!r}."
    )
