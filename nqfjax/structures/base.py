r"""`AbstractStructure`: a layer that is a sum over interchangeable units.

Near small weights every such layer is, to leading order, the quadratic form
$f_j(x; W) - f_j(x; 0) = \mathrm{Tr}[W W^\top A_j(x)]$, and everything nqfjax
computes from data -- sampled tasks, the M-space flow, the quadratic model in
`train` -- reaches the structure through the few methods declared here.

## Writing your own structure

Either give the unit function to `structure_from_layer` (automatic
differentiation finds `A(x)`; nothing else to write), or subclass
`AbstractStructure` and implement its abstract attributes and methods. Concrete
classes are final: to change a built-in, wrap it (hold it as a field and forward
to it) rather than subclass it.

```python
import typing
import equinox as eqx
import jax.numpy as jnp
import nqfjax

@typing.final
class Bilinear(nqfjax.AbstractStructure):
    # f(x) = sum_i (a_i . x)(b_i . x): unit w = (a, b), p = 2d, one output
    d: int = eqx.field(static=True)
    k = 1
    additive = True

    @property
    def p(self):
        return 2 * self.d

    @property
    def input_shape(self):
        return (self.d,)

    def A(self, x):  # (k, p, p) = (1, 2d, 2d)
        xx = 0.5 * jnp.outer(x, x)
        zero = jnp.zeros_like(xx)
        return jnp.block([[zero, xx], [xx, zero]])[None]

    def unit(self, w, x):
        return (w[: self.d] @ x * (w[self.d :] @ x))[None]

    def layer(self, W, x):
        return jnp.sum((W[: self.d].T @ x) * (W[self.d :].T @ x))[None]
```

That is enough for `task_from_samples`, `solve_mflow` and `train`. They reach
`A` only through the batch hooks `contract` and `weighted_sum`, whose defaults
build `A(x_s)` for a chunk of samples, `O(b k p^2)` numbers; a structure whose
`A(x)` is sparse or low-rank overrides them (and `sample_size`) with a closed
form -- here `contract(xs, X)[s] = x_s^T (X_ab + X_ba) x_s / 2`, `O(d^2)` per
sample instead of `O(p^2)` -- and should check the override against the default
(`AbstractStructure.contract(self, xs, X)` calls it explicitly).
"""

import abc
import functools
import os
import sys
import warnings
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from .._checks import check_shape, static_int


class AbstractStructure(eqx.Module):
    r"""A layer whose units are interchangeable, and its structure matrices.

    Near small weights every such layer is, to leading order, the quadratic form

    $$f_j(x; W) - f_j(x; 0) = \mathrm{Tr}[W W^\top A_j(x)] + O(|W|^3),
    \qquad A(x) = \tfrac12 \mathrm{Hess}_w \phi(0, x),$$

    with `W` of shape `(p, m)` holding one unit per column and $\phi(w, x)$ the
    layer with the single unit `w` switched on, minus the layer at zero (see the
    documentation's theory pages). See this module's docstring for how to write
    your own.

    **Abstract attributes** (a field, a property or a class attribute):

    - `p`: parameters per unit.
    - `k`: number of outputs.
    - `input_shape`: the shape of one input `x`.
    - `additive`: whether `layer(W, x) - layer(0, x)` is exactly the sum of
      `unit` over the columns of `W` (false for the softmax cases, where it
      holds to leading order).

    **Abstract methods:** `A(x)`, `unit(w, x)`, `layer(W, x)`, each for one input
    and without value checks (the library's entry points -- `nqf_apply`,
    `task_from_samples`, `train` -- check their data once; these run in loops).

    **Hooks with defaults** (override for speed; an override must equal the
    default up to round-off): `contract(xs, X)`, `weighted_sum(xs, c)`, their
    factored forms `contract_factor(xs, W)` and `weighted_apply(xs, c, W)`,
    `sample_size()`, and `max_units`.
    """

    p: eqx.AbstractVar[int]
    k: eqx.AbstractVar[int]
    input_shape: eqx.AbstractVar[tuple[int, ...]]
    additive: eqx.AbstractVar[bool]

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        for base in cls.__bases__:
            if getattr(base, "__final__", False):
                raise TypeError(
                    f"`{base.__name__}` is final and cannot be subclassed; wrap it "
                    "instead (hold it as a field of an `AbstractStructure` subclass "
                    "and forward to it)."
                )
        _install_legacy_hooks(cls)

    @property
    def max_units(self) -> int | None:
        """The most units (columns of `W`) the real layer holds, or `None` when
        any number will do (a mixture of experts has a fixed number of experts;
        the quadratic form itself takes any `m`). Default `None`."""
        return None

    @abc.abstractmethod
    def A(self, x) -> Float[Array, "k p p"]:
        r"""The structure matrices of one input, $A_j(x) = \tfrac12
        \mathrm{Hess}_w \phi_j(0, x)$.

        **Arguments:**

        - `x`: one input, shape `input_shape`.

        **Returns:** shape `(k, p, p)`, each `A_j(x)` symmetric, in the dtype of `x`.
        """

    @abc.abstractmethod
    def unit(self, w, x) -> Float[Array, " k"]:
        r"""$\phi(w, x)$: the layer with only the unit `w` switched on, minus the
        layer at zero weights.

        **Arguments:**

        - `w`: one unit, shape `(p,)`.
        - `x`: one input, shape `input_shape`.

        **Returns:** shape `(k,)`.
        """

    @abc.abstractmethod
    def layer(self, W, x) -> Float[Array, " k"]:
        r"""The real nonlinear layer $f(x; W)$ with units as the columns of `W`.

        **Arguments:**

        - `W`: weights, shape `(p, m)` (`m <= max_units`).
        - `x`: one input, shape `input_shape`.

        **Returns:** shape `(k,)`.
        """

    def contract(self, xs, X: Float[Array, "p p"]) -> Float[Array, "b k"]:
        r"""$\mathrm{Tr}[A_j(x_s) X]$ for a batch of inputs: the quadratic model
        $f_j(x_s) = \mathrm{Tr}[M A_j(x_s)]$ at `X = M`, and the inner step of
        $K[X] = \frac1n \sum_{s,j} A_j(x_s) \mathrm{Tr}[A_j(x_s) X]$.

        The default stacks `A(x_s)` (`O(b k p^2)` numbers); override it with a
        closed form when `A(x)` is sparse or low-rank.

        **Arguments:**

        - `xs`: inputs, shape `(b, *input_shape)`.
        - `X`: shape `(p, p)`, symmetric (implementations may read one triangle).

        **Returns:** shape `(b, k)`, in the dtype of `X`.
        """
        A = jax.vmap(self.A)(xs).astype(X.dtype)
        return jnp.einsum("bkij,ij->bk", A, X)

    def weighted_sum(self, xs, c: Float[Array, "b k"]) -> Float[Array, "p p"]:
        r"""$\sum_s \sum_j c_{sj} A_j(x_s)$ for a batch of inputs: the outer step
        of `K` (with $c_{sj} = \mathrm{Tr}[A_j(x_s) X]$) and of $C$ (with the
        targets).

        The default stacks `A(x_s)` (`O(b k p^2)` numbers); override it with a
        closed form when `A(x)` is sparse or low-rank.

        **Arguments:**

        - `xs`: inputs, shape `(b, *input_shape)`.
        - `c`: weights, shape `(b, k)`.

        **Returns:** shape `(p, p)`, symmetric, in the dtype of `c`.
        """
        A = jax.vmap(self.A)(xs).astype(c.dtype)
        return jnp.einsum("bk,bkij->ij", c, A)

    def contract_factor(self, xs, W: Float[Array, "p r"]) -> Float[Array, "b k"]:
        r"""$\mathrm{Tr}[A_j(x_s) W W^\top]$ for a batch of inputs and a factor
        `W`: `contract(xs, W @ W.T)` without the `(p, p)` product, the quadratic
        model at $M = W W^\top$ and the inner step of the factored flow
        $K[W W^\top] W$.

        The default forms `W @ W.T` and calls `contract` (`O(p^2 r)`); a
        structure with closed-form hooks overrides it in `O(b k p r)` or less.

        **Arguments:**

        - `xs`: inputs, shape `(b, *input_shape)`.
        - `W`: shape `(p, r)`.

        **Returns:** shape `(b, k)`, in the dtype of `W`.
        """
        return self.contract(xs, W @ W.T)

    def weighted_apply(
        self, xs, c: Float[Array, "b k"], W: Float[Array, "p r"]
    ) -> Float[Array, "p r"]:
        r"""$\sum_s \sum_j c_{sj} A_j(x_s) W$ for a batch of inputs: the outer
        step of the factored flow, `weighted_sum(xs, c) @ W` without the `(p, p)`
        sum.

        The default is `weighted_sum(xs, c) @ W` (`O(p^2 r)`); a structure with
        closed-form hooks overrides it in `O(b k p r)` or less.

        **Arguments:**

        - `xs`: inputs, shape `(b, *input_shape)`.
        - `c`: weights, shape `(b, k)`.
        - `W`: shape `(p, r)`.

        **Returns:** shape `(p, r)`, in the dtype of `W`.
        """
        return self.weighted_sum(xs, c.astype(W.dtype)) @ W

    def mode_gram(self, xs, U: Float[Array, "p r"]) -> Float[Array, "r r"]:
        r"""The Gram matrix of the modes' outputs over a batch,
        $\sum_s \sum_j F_{sj,l} F_{sj,m}$ with
        $F_{sj,l} = \mathrm{Tr}[A_j(x_s) u_l u_l^\top]$ = `contract_factor(xs,
        U[:, l:l+1])`: summed over the samples and divided by `n`, the mode
        couplings $D_{lm} = \langle u_l u_l^\top, K[u_m u_m^\top] \rangle$ of
        the Lotka-Volterra reduction (`Task.mode_couplings`).

        The default forms `F` (shape `(b k, r)`), column by column through
        `contract_factor`, and returns $F^\top F$ (`O(b k r^2)` on top of `F`);
        a structure whose `F` factors overrides it (the readout structures:
        $F_{sj,l} = 2 s\,(V U_c)_{sl} (U_r)_{jl}$, so the Gram is
        $4 s^2 (U_r^\top U_r) \circ ((V U_c)^\top V U_c)$, `O(b n r + b r^2)`).

        **Arguments:**

        - `xs`: inputs, shape `(b, *input_shape)`.
        - `U`: the modes as columns, shape `(p, r)`.

        **Returns:** shape `(r, r)`, in the dtype of `U`.
        """
        (p, r), b = U.shape, xs.shape[0]
        # per column: the (b, k) result, and the (p, p) product u u^T of the default
        per_column = b * self.k + (p if has_closed_factor_hooks(self) else p * p)
        columns = max(1, min(r, 2**22 // per_column))
        F = jax.lax.map(
            lambda u: self.contract_factor(xs, u[:, None]), U.T, batch_size=columns
        )  # (r, b, k)
        F = F.reshape(r, -1)
        return F @ F.T

    def sample_size(self) -> int:
        """How many numbers `contract` and `weighted_sum` hold per sample: sets
        the default chunk of samples in `task_from_samples`, so that the memory of
        applying `K` is `O(batch_size * sample_size() + p^2)`. Default
        `k * p * p` (the stacked `A(x_s)`); override it with the hooks."""
        return self.k * self.p * self.p

    # Deprecated private spellings of the methods above (kept for one release).

    def _A(self, x):
        _deprecated("_A", "A")
        return self.A(x)

    def _unit(self, w, x):
        _deprecated("_unit", "unit")
        return self.unit(w, x)

    def _layer(self, W, x):
        _deprecated("_layer", "layer")
        return self.layer(W, x)

    def _contract(self, xs, X):
        _deprecated("_contract", "contract")
        return self.contract(xs, X)

    def _weighted_sum(self, xs, c):
        _deprecated("_weighted_sum", "weighted_sum")
        return self.weighted_sum(xs, c)

    def _sample_size(self):
        _deprecated("_sample_size", "sample_size")
        return self.sample_size()


# --------------------------------------------------------------------------------
# Converters of the built-in structures' static fields (`eqx.field(converter=...)`)


def size(name: str, minimum: int = 1) -> Callable[[object], int]:
    """A converter to a Python int `>= minimum`: `ValueError` naming `name` for a
    float (`d=2.5`), a bool or a smaller value (sizes fix array shapes)."""
    return functools.partial(static_int, name, minimum=minimum)


def flag(name: str) -> Callable[[object], bool]:
    """A converter to a Python bool: `ValueError` naming `name` for anything but a
    bool (`pool="False"` would otherwise count as true)."""

    def convert(value) -> bool:
        if not isinstance(value, bool | np.bool_):
            raise ValueError(f"`{name}` must be a bool, got {value!r}.")
        return bool(value)

    return convert


# --------------------------------------------------------------------------------
# Checks the built-in structures run on their arguments. Only shapes: they are
# static, so these cost nothing under `jit` (values are checked at the entry
# points, once).


def check_input(structure: AbstractStructure, x):
    """`x` as an array, after checking that its shape is `structure.input_shape`."""
    check_shape("x", x, tuple(structure.input_shape))
    return jnp.asarray(x)


def has_closed_factor_hooks(structure: AbstractStructure) -> bool:
    """Whether `structure` overrides `contract_factor` (a closed form that
    never forms `W W^T` nor any `A(x_s)`), rather than keeping the default."""
    return type(structure).contract_factor is not AbstractStructure.contract_factor


def check_batch(structure: AbstractStructure, xs):
    """`xs` as an array, after checking that its shape is `(b, *input_shape)`."""
    xs = jnp.asarray(xs)
    shape = tuple(structure.input_shape)
    if xs.ndim != 1 + len(shape) or tuple(xs.shape[1:]) != shape:
        raise ValueError(
            f"`xs` must have shape (b, *input_shape) = (b, *{shape}), got {xs.shape}."
        )
    return xs


def check_unit(structure: AbstractStructure, w):
    """`w` as an array, after checking that its shape is `(p,)`."""
    check_shape("w", w, (structure.p,))
    return jnp.asarray(w)


def check_weights(structure: AbstractStructure, W):
    """`W` as an array, after checking that it is `(p, m)` with `m <= max_units`."""
    W = jnp.asarray(W)
    if W.ndim != 2 or W.shape[0] != structure.p:
        raise ValueError(
            f"`W` must have shape (p, m) = ({structure.p}, m) with units as columns, "
            f"got {W.shape}."
        )
    cap = structure.max_units
    if cap is not None and W.shape[1] > cap:
        raise ValueError(
            f"`W` must have at most {cap} columns (units) for this layer, got "
            f"shape {W.shape}."
        )
    return W


# --------------------------------------------------------------------------------
# The private spellings of a previous release

_LEGACY = {
    "_A": "A",
    "_unit": "unit",
    "_layer": "layer",
    "_contract": "contract",
    "_weighted_sum": "weighted_sum",
    "_sample_size": "sample_size",
}


def _deprecated(old: str, new: str) -> None:
    warnings.warn(
        f"`Structure.{old}` is deprecated: use `{new}`.",
        DeprecationWarning,
        stacklevel=_caller_stacklevel(),
    )


def _install_legacy_hooks(cls) -> None:
    """A subclass written for the previous release implements `_A`, `_unit`,
    `_layer` (and maybe `_contract`, `_weighted_sum`, `_sample_size`): forward the
    public names to them, with a `DeprecationWarning`."""
    found = {
        old: new
        for old, new in _LEGACY.items()
        if old in cls.__dict__ and new not in cls.__dict__
    }
    if not found:
        return
    warnings.warn(
        f"`{cls.__name__}` implements {', '.join(f'`{o}`' for o in found)}, "
        "deprecated spellings: implement "
        f"{', '.join(f'`{n}`' for n in found.values())} instead.",
        DeprecationWarning,
        stacklevel=_caller_stacklevel(),
    )
    for old, new in found.items():
        setattr(cls, new, _forward(old))


def _forward(old: str):
    def method(self, *args):
        return getattr(type(self), old)(self, *args)

    return method


def _caller_stacklevel() -> int:
    """The `stacklevel`, for a `warnings.warn` in the calling function, of the
    first frame outside this module, equinox and `abc`: the user's call, or the
    class statement of the subclass being created."""
    skip = (
        os.path.dirname(os.path.abspath(eqx.__file__)),
        os.path.abspath(__file__),
        os.path.abspath(abc.__file__),
    )
    frame, level = sys._getframe(1), 1
    while frame is not None:
        name = frame.f_code.co_filename
        if not (name.startswith(skip) or name.startswith("<frozen")):
            break
        frame, level = frame.f_back, level + 1
    return level
