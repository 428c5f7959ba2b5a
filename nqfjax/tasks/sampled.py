"""Tasks from samples through any structure (`task_from_samples`): `K` and `C`
as averages over the data, applied in batches through the structure's hooks."""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float

from .._checks import (
    check_shape,
    finite,
    static_int,
)
from .._linalg import sym
from ..structures.base import AbstractStructure, has_closed_factor_hooks
from .base import Task, check_factor, check_modes


# --------------------------------------------------------------------------------
# Tasks from samples


def _default_batch_size(n: int, structure: AbstractStructure) -> int:
    # Keep what one chunk of samples holds in the batch hooks (b * sample_size()
    # numbers: the stacked A(x_s), b k p^2, with the default hooks) near 2^21.
    return int(max(1, min(n, 2**21 // max(1, structure.sample_size()))))


def _chunked_sum(structure, xs, aux, coef, batch_size):
    r"""$\frac1n\sum_s\sum_j c_{sj} A_j(x_s)$ with `c = coef(x_b, aux_b)` (shape
    `(b, k)`) for each chunk of `batch_size` samples (a `lax.scan` over full
    chunks, then the remainder), through the structure's `weighted_sum`."""
    p, n, b = structure.p, xs.shape[0], batch_size
    dtype = aux.dtype

    def block(xb, ab):
        return structure.weighted_sum(xb, coef(xb, ab).astype(dtype))

    total = jnp.zeros((p, p), dtype)
    nb = n // b
    if nb > 0:
        xr = xs[: nb * b].reshape((nb, b) + xs.shape[1:])
        ar = aux[: nb * b].reshape((nb, b) + aux.shape[1:])

        def body(acc, xa):
            return acc + block(*xa), None

        total, _ = jax.lax.scan(body, total, (xr, ar))
    if n % b:
        total = total + block(xs[nb * b :], aux[nb * b :])
    return total / n


# Module-level jitted kernels: the cache is hit across calls and tasks (a closure
# rebuilt per call would recompile the scan every time when used eagerly).


@eqx.filter_jit
def _sampled_C(structure, xs, targets, batch_size):
    return _chunked_sum(structure, xs, targets, lambda xb, t: t, batch_size)


@eqx.filter_jit
def _sampled_K(structure, xs, X, batch_size):
    Xs = sym(X).astype(xs.dtype)
    dummy = jnp.zeros((xs.shape[0], 0), xs.dtype)
    return _chunked_sum(
        structure, xs, dummy, lambda xb, _: structure.contract(xb, Xs), batch_size
    )


def _chunked_residuals(structure, xs, targets, W, batch_size, *, apply: bool):
    r"""One pass over the samples for a factor `W` (shape `(p, r)`): the
    residuals $e_{sj} = \mathrm{Tr}[A_j(x_s) W W^\top] - t_{sj}$ of the outputs
    against the targets, chunk by chunk of `batch_size` samples (a `lax.scan`
    over full chunks, then the remainder) through the factored hooks.

    **Returns:** `(G W, L)`: $G W = \frac1n \sum_{s,j} e_{sj} A_j(x_s) W$
    (shape `(p, r)`; zeros unless `apply`) and
    $L = \frac1{2n} \sum_{s,j} e_{sj}^2$."""
    n, b = xs.shape[0], batch_size

    def block(xb, tb):
        res = structure.contract_factor(xb, W) - tb.astype(W.dtype)
        GW = structure.weighted_apply(xb, res, W) if apply else jnp.zeros_like(W)
        return GW, 0.5 * jnp.sum(res**2)

    total = (jnp.zeros(W.shape, W.dtype), jnp.zeros((), W.dtype))
    nb = n // b
    if nb > 0:
        xr = xs[: nb * b].reshape((nb, b) + xs.shape[1:])
        tr = targets[: nb * b].reshape((nb, b) + targets.shape[1:])

        def body(acc, xt):
            return jax.tree.map(jnp.add, acc, block(*xt)), None

        total, _ = jax.lax.scan(body, total, (xr, tr))
    if n % b:
        total = jax.tree.map(jnp.add, total, block(xs[nb * b :], targets[nb * b :]))
    return jax.tree.map(lambda x: x / n, total)


@eqx.filter_jit
def _sampled_gradient_factor(structure, xs, targets, W, batch_size):
    return _chunked_residuals(structure, xs, targets, W, batch_size, apply=True)[0]


@eqx.filter_jit
def _sampled_loss_factor(structure, xs, targets, W, batch_size):
    return _chunked_residuals(structure, xs, targets, W, batch_size, apply=False)[1]


@eqx.filter_jit
def _offsets(structure, xs):
    W0 = jnp.zeros((structure.p, 1), xs.dtype)
    return jax.vmap(lambda x: structure.layer(W0, x))(xs).astype(xs.dtype)


def _sum_over_chunks(block, xs, b, zero):
    """`sum(block(x_chunk))` over chunks of `b` samples: a `lax.scan` over full
    chunks, then the remainder."""
    n, nb = xs.shape[0], xs.shape[0] // b
    total = zero
    if nb > 0:
        xr = xs[: nb * b].reshape((nb, b) + xs.shape[1:])

        def body(acc, xb):
            return jax.tree.map(jnp.add, acc, block(xb)), None

        total, _ = jax.lax.scan(body, total, xr)
    if n % b:
        total = jax.tree.map(jnp.add, total, block(xs[nb * b :]))
    return total


@eqx.filter_jit
def _sampled_couplings(structure, xs, U, G, gram_batch, batch_size):
    r"""`D = F^T F / n` with $F_{(s,j),l} = \mathrm{Tr}[A_j(x_s) u_l u_l^\top]$
    (the structure's `mode_gram`), and
    $Z_i = \frac1n \sum_s \sum_j (F g_i)_{sj} A_j(x_s)$, in two passes over
    the samples: the
    probe's outputs $F g = \mathrm{Tr}[A_j(x_s)\, U \mathrm{diag}(g) U^\top]$
    are `contract_factor` of $U \mathrm{diag}(g_+)^{1/2}$ minus that of
    $U \mathrm{diag}(g_-)^{1/2}$ (the positive and negative parts of `g`),
    never `F` itself. The Gram in chunks of `gram_batch` samples (the default
    `mode_gram` holds `F` of a chunk, `gram_batch * k * r` numbers), the probes
    in chunks of the task's `batch_size` (what applying `K` holds)."""
    (p, r), N = U.shape, G.shape[1]
    n = xs.shape[0]
    zero = jnp.zeros((r, r), U.dtype)
    D = _sum_over_chunks(lambda xb: structure.mode_gram(xb, U), xs, gram_batch, zero)
    D = 0.5 * (D + D.T) / n
    if N == 0:
        return D, jnp.zeros((0, p, p), U.dtype)
    plus = U[None] * jnp.sqrt(jnp.maximum(G, 0.0)).T[:, None, :]  # (N, p, r)
    minus = U[None] * jnp.sqrt(jnp.maximum(-G, 0.0)).T[:, None, :]

    def probes(xb):
        def one(Wp, Wm):
            c = structure.contract_factor(xb, Wp) - structure.contract_factor(xb, Wm)
            return structure.weighted_sum(xb, c)

        return jax.lax.map(lambda w: one(*w), (plus, minus))

    zero = jnp.zeros((N, p, p), U.dtype)
    return D, _sum_over_chunks(probes, xs, batch_size, zero) / n


class SampledTask(Task):
    r"""The empirical task of `n` samples through an `AbstractStructure`:

    $$K[X] = \frac1n \sum_s \sum_j A_j(x_s)\,\mathrm{Tr}[A_j(x_s) X], \qquad
    C = \frac1n \sum_s \sum_j \tilde y_{sj} A_j(x_s), \qquad
    y2 = \frac1n \sum_s |\tilde y_s|^2,$$

    with targets $\tilde y_s = y_s - f(x_s; 0)$ (`offsets`, the layer at zero
    weights; zero for perceptrons and quadratic networks). `K` and `C` reach the
    samples only through the structure's batch hooks `contract` and
    `weighted_sum`, in chunks of `batch_size` samples, so the memory of applying
    `K` is `O(batch_size * structure.sample_size() + p^2)` and nothing of size
    `p^4` or `n k p^2` is stored. The built-in structures contract the samples
    in closed form, without building any `A(x_s)`; a structure that keeps the
    default hooks recomputes `A(x_s)` per chunk (`sample_size() = k p^2`).

    `loss(M)` is the empirical squared loss of the quadratic model including its
    offset, $\frac1{2n}\sum_s |f(x_s; 0) + \mathrm{Tr}[M A(x_s)] - y_s|^2$.

    Build with `task_from_samples`.
    """

    structure: AbstractStructure
    xs: Array
    ys: Float[Array, "n k"]
    offsets: Float[Array, "n k"]
    C: Float[Array, "p p"]
    y2: Float[Array, ""]
    batch_size: int = eqx.field(static=True)

    def __init__(self, structure, xs, ys, offsets, batch_size):
        self.structure = structure
        self.xs = xs
        self.ys = ys
        self.offsets = offsets
        self.batch_size = batch_size
        targets = ys - offsets
        self.C = _sampled_C(structure, xs, targets, batch_size)
        self.y2 = jnp.mean(jnp.sum(targets**2, axis=1))

    @property
    def n(self) -> int:
        return self.xs.shape[0]

    @property
    def targets(self) -> Float[Array, "n k"]:
        """`ys - offsets`: what the quadratic form has to fit."""
        return self.ys - self.offsets

    def _K(self, X):
        return _sampled_K(self.structure, self.xs, X, self.batch_size)

    def mode_couplings(self, U, probes=None):
        r"""`Task.mode_couplings` in two passes over the samples (the Gram,
        then the probes), through the structure's hooks: $D = F^\top F / n$ with
        $F_{(s,j),l} = \mathrm{Tr}[A_j(x_s) u_l u_l^\top]$ by `mode_gram`
        (closed form for the readout structures, `O(n d r + n r^2)`), and for
        each probe $g_i$, $Z_i = \frac1n \sum_{s,j} (F g_i)_{sj} A_j(x_s)$,
        its outputs by `contract_factor` and the sum by `weighted_sum`, chunk by
        chunk of samples. No `K` application and no `p x p x r` product."""
        U, G = check_modes(self, U, probes)
        b = max(1, min(self.batch_size, 2**22 // (self.structure.k * U.shape[1])))
        D, Z = _sampled_couplings(self.structure, self.xs, U, G, b, self.batch_size)
        return D if probes is None else (D, Z)

    def _factor_batch(self) -> int:
        """The chunk of samples of a factored pass. With closed-form factored
        hooks a chunk holds only its `(b, k)` outputs beside the data, which
        are resident anyway, so the samples go in chunks of up to `2^24 /
        sample_size()` (all of them for data up to 64 MB in float32): each
        chunk of a `lax.scan` copies its slice of the data, which made a pass
        over `n = 10^4` samples twice as slow in chunks of 2,048. The default
        hooks keep `batch_size` (they build `A(x_s)` per sample)."""
        if not has_closed_factor_hooks(self.structure):
            return self.batch_size
        cap = 2**24 // max(1, self.structure.sample_size())
        return int(min(self.xs.shape[0], max(self.batch_size, cap)))

    def gradient_factor(self, W):
        r"""$G(W W^\top) W = \frac1n \sum_{s,j} (f_{sj} - \tilde y_{sj})
        A_j(x_s) W$ with $f_{sj} = \mathrm{Tr}[A_j(x_s) W W^\top]$, shape
        `(p, r)`: one pass over the samples through the structure's
        `contract_factor` and `weighted_apply`, never a `(p, p)` matrix
        (`O(n k p r)` or less for the built-in structures)."""
        W = jnp.asarray(W)
        check_factor(W, self.p)
        return _sampled_gradient_factor(
            self.structure, self.xs, self.targets, W, self._factor_batch()
        )

    def loss_factor(self, W):
        r"""$L(W W^\top) = \frac1{2n}\sum_{s,j} (f_{sj} - \tilde y_{sj})^2$ from
        the outputs $f_{sj} = \mathrm{Tr}[A_j(x_s) W W^\top]$
        (`contract_factor`), never a `(p, p)` matrix."""
        W = jnp.asarray(W)
        check_factor(W, self.p)
        return _sampled_loss_factor(
            self.structure, self.xs, self.targets, W, self._factor_batch()
        )


def task_from_samples(
    structure: AbstractStructure,
    xs: ArrayLike,
    ys: Float[ArrayLike, "n k"],
    *,
    subtract_offset: bool = True,
    batch_size: int | None = None,
) -> SampledTask:
    r"""The empirical task of samples `(xs, ys)` through `structure`.

    $K[X] = \frac1n\sum_s\sum_j A_j(x_s)\,\mathrm{Tr}[A_j(x_s) X]$ is applied
    matrix-free, chunk by chunk of samples through the structure's batch hooks
    (never a `p^4` tensor; no `A(x_s)` at all for the built-in structures),
    $C = \frac1n\sum_s\sum_j \tilde y_{sj} A_j(x_s)$ and
    $y2 = \frac1n \sum_s |\tilde y_s|^2$.

    The targets are $\tilde y_s = y_s - f(x_s; 0)$ when `subtract_offset` (the
    default): the layer at zero weights, `structure.layer(zeros((p, 1)), x)`,
    is a constant of the dynamics, not something the units learn (it vanishes
    for perceptrons and quadratic networks, not for softmax attention). Then
    `task.loss(W W^T)` equals the empirical squared loss
    $\frac1{2n}\sum_s |f(x_s;0) + \mathrm{Tr}[W W^\top A(x_s)] - y_s|^2$ of the
    quadratic model, which is what `train(structure, xs, ys,
    model=QuadraticForm())` minimises.
    With `subtract_offset=False` the offset is ignored.

    As `n` grows the task converges to the population task (for Gaussian inputs,
    `gaussian_quadratic_task` / `gaussian_perceptron_task`) with errors
    `O(n^{-1/2})`.

    **Arguments:**

    - `structure`: the architecture.
    - `xs`: inputs, shape `(n, *structure.input_shape)`.
    - `ys`: targets, shape `(n, k)` (`(n,)` is accepted when `k = 1`).
    - `subtract_offset`: subtract `f(x; 0)` from `ys` (default `True`).
    - `batch_size`: samples per chunk when applying `K`, a Python int `>= 1`
      (default: chunks of about `2^21` numbers, see `structure.sample_size()`).

    **Returns:** a `Task` with `p = structure.p`.

    **Raises:** `ValueError` for shapes that do not match the structure, `n = 0`,
    NaN in `xs` or `ys`, or a `batch_size` that is not an int `>= 1`.
    """
    if not isinstance(structure, AbstractStructure):
        raise ValueError(
            "`structure` must be an nqfjax.AbstractStructure, got "
            f"{type(structure).__name__}."
        )
    xs, ys = jnp.asarray(xs), jnp.asarray(ys)
    shape = tuple(structure.input_shape)
    if xs.ndim != 1 + len(shape) or tuple(xs.shape[1:]) != shape:
        raise ValueError(
            f"`xs` must have shape (n, *input_shape) = (n, *{shape}), got {xs.shape}."
        )
    n, k = xs.shape[0], structure.k
    if n < 1:
        raise ValueError("`xs` must hold at least one sample.")
    if ys.ndim == 1 and k == 1:
        ys = ys[:, None]
    check_shape("ys", ys, (n, k))
    dtype = jnp.result_type(xs, ys, float)
    xs = finite("xs", xs.astype(dtype))
    ys = finite("ys", ys.astype(dtype))
    if subtract_offset:
        offsets = _offsets(structure, xs)
    else:
        offsets = jnp.zeros_like(ys)
    if batch_size is None:
        batch_size = _default_batch_size(n, structure)
    else:
        batch_size = static_int("batch_size", batch_size, 1)
    return SampledTask(structure, xs, ys, offsets, min(batch_size, n))
