"""W-space training: the real layer or its quadratic form, with any optax
optimizer, as one run (`train`) or as segments of steps (`train_segments`)."""

from collections.abc import Callable, Sequence

import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
from jaxtyping import ArrayLike, Float, PRNGKeyArray

from .._checks import (
    check_key,
    check_shape,
    finite,
    is_concrete,
    nonnegative,
    positive,
    static_int,
)
from ..structures.base import AbstractStructure
from ..structures.models import AbstractModel, Layer, as_model
from ._train_loop import Segment, TrainResult, run_segments


__all__ = ["Segment", "TrainResult", "log_spaced_steps", "train", "train_segments"]


def log_spaced_steps(num_steps: int, num_records: int) -> tuple[int, ...]:
    """Step 0 and about `num_records - 1` log-spaced steps from 1 to `num_steps`
    (rounded to integers, duplicates dropped, so possibly fewer); the last is
    always `num_steps` (`num_records = 2`: steps 0 and `num_steps`)."""
    if num_records < 2:
        raise ValueError(f"`num_records` must be >= 2, got {num_records}.")
    # geomspace with one point returns its start: take the end instead
    start = 1 if num_records > 2 else num_steps
    steps = np.unique(np.rint(np.geomspace(start, num_steps, num_records - 1)))
    return (0, *(int(s) for s in steps))


def train(
    structure: AbstractStructure,
    xs: Float[ArrayLike, "n ..."],
    ys: Float[ArrayLike, "n k"],
    *,
    num_steps: int,
    learning_rate: Float[ArrayLike, ""] | Callable | None = None,
    optimizer: optax.GradientTransformation | Callable | None = None,
    key: PRNGKeyArray | None = None,
    init_scale: Float[ArrayLike, ""] | None = None,
    width: int | None = None,
    W0: Float[ArrayLike, "p m"] | None = None,
    weight_decay: Float[ArrayLike, ""] = 0.0,
    batch_size: int | None = None,
    model: AbstractModel = Layer(),
    num_records: int = 50,
    record_at: Sequence[int] | None = None,
    basis: Float[ArrayLike, "p q"] | None = None,
    snapshots: bool = True,
    divergence_factor: float = 1e4,
) -> TrainResult:
    r"""Train the weights `W` (`p x m`, units as columns) on data `(xs, ys)`.

    Minimises, with the given optax optimizer,

    $$\mathcal L(W) = \frac{1}{2 b} \sum_{s \in \text{batch}} \sum_j
      \big(f_j(x_s; W) - y_{s,j}\big)^2 + \frac{\lambda}{2} |W|^2,$$

    where `f` is the model's prediction: the real layer `structure.layer`
    (`model=Layer()`, the default) or its quadratic model
    $f(x; 0) + \mathrm{Tr}[W W^\top A(x)]$ (`model=QuadraticForm()`, `nqf_apply`
    plus the layer's value at zero).
    Plain gradient descent (the default, `optax.sgd(learning_rate)`) takes steps
    $W \leftarrow W - \eta (2 G W + \lambda W)$ with $G = \partial L / \partial M$
    and $\eta$ the learning rate: the Euler discretisation with `dt = 1` of the
    flow $\dot W = -\eta(2GW + \lambda W)$, so step `s` corresponds to flow time
    `t = s` with the learning rate inside the flow. The weight decay is an L2
    penalty on the objective (with Adam this is not AdamW; pass `optax.adamw`
    for decoupled decay).

    **The offset.** The layer's value at zero weights, `f(x; 0)` (for example the
    mean value under a uniform softmax), is an offset of the target: the units
    learn `y - f(x; 0)`, exactly as in `task_from_samples(structure, xs, ys)`,
    whose `loss(W W^T)` is the recorded loss of `QuadraticForm()` and, to
    leading order in `W`, of `Layer()`. The recorded loss itself always
    compares the model's full output, offset included, with `y` (see
    `TrainResult.loss`). The offset is zero for perceptrons, quadratic networks
    and the other additive layers.

    **Minibatches.** With `batch_size = b < n`, each step uses `b` distinct
    samples drawn uniformly without replacement, independently at each step
    (from `jax.random.fold_in(batch_key, step)`), so the minibatch gradient is
    unbiased with covariance $\frac{n-b}{b(n-1)}$ times the per-sample one.
    `batch_size=None` (default) or `n` is full batch. The recorded loss is
    always the full-data loss.

    **Recording.** `train` is one segment of the one training loop
    (`train_segments`), a `jax.lax.scan` over the steps; at the
    recorded steps (log-spaced by default, or `record_at`) a `lax.cond` whose
    predicate depends only on the step, so it stays a branch under `vmap`,
    stores the full-data loss and `M = W W^T` (or its diagonal in `basis`).
    Memory is `O(R p^2)` (or `O(R q)`), independent of `num_steps`.

    **Divergence.** A run has diverged once its full-data loss (without the
    penalty) is NaN or inf, or exceeds `divergence_factor` times
    $L_{\rm ref} = \max(L(W_0), L(0))$, the larger of its initial value and its
    value at zero weights (so that a start near a fit, whose initial loss is
    tiny, is not flagged for ordinary noise). It is checked at every step, on
    the loss each step computes anyway: with full batches that is the full-data
    loss; with minibatches of `b` out of `n` the lower bound
    $\tfrac bn L_{\rm batch} \le L$, plus the full-data loss at the recorded
    steps, so a divergence is never reported falsely and is found no later than
    the next record. `TrainResult.diverged` and `TrainResult.diverged_at` say
    whether and when; nothing is raised, so a sweep over learning rates keeps
    its other runs.

    **Transforms.** Numbers that a sweep varies (`init_scale`, `learning_rate`,
    `weight_decay`, `key`, `W0`, `xs`, `ys`, `basis`) are traced, so
    `jax.vmap(lambda s: train(..., init_scale=s))` and friends work, as does
    `jax.grad` with respect to them. Everything that fixes shapes or the program
    (`num_steps`, `width`, `batch_size`, `model`, `record_at`, `optimizer`, a
    schedule, `divergence_factor`) is static. The work is jitted once per static
    configuration; optimizer factories and schedules are static and compared by
    identity, so create them once (not a fresh `lambda` per call) to reuse the
    compilation.

    **Arguments:**

    - `structure`: the architecture.
    - `xs`: inputs, shape `(n, *structure.input_shape)`.
    - `ys`: targets, shape `(n, k)`.
    - `num_steps`: number of optimizer steps (static int >= 1).
    - `learning_rate`: the learning rate `> 0`, or an optax schedule
      `step -> learning_rate`. Required unless `optimizer` is a ready
      `GradientTransformation`.
    - `optimizer`: `None` for plain SGD/GD (`optax.sgd`), a factory called as
      `optimizer(learning_rate)` (e.g. `optax.adam`, or
      `lambda lr: optax.sgd(lr, momentum=0.9)`), so that the learning rate can be
      swept; or a ready `optax.GradientTransformation` (then `learning_rate`
      must be `None`).
    - `key`: a PRNG key (`jax.random.key(seed)`, or a legacy
      `jax.random.PRNGKey(seed)`) for the isotropic init and the minibatches.
    - `init_scale`: `sigma > 0`: the initial weights are `sigma * Z`, with `Z`
      standard normal of shape `(p, width)` drawn from `key`, or `Z = W0` when
      `W0` is given (then `init_scale` defaults to 1).
    - `width`: number of units `m` (static); taken from `W0` when given.
    - `W0`: initial weights (direction), shape `(p, m)`.
    - `weight_decay`: `lambda >= 0` (default 0).
    - `batch_size`: minibatch size `b` in `1..n` (static), `None` for full batch.
    - `model`: an `AbstractModel`: `Layer()` (default: the real nonlinear
      layer) or `QuadraticForm()` (its quadratic form, `f(x; 0) +
      Tr[W W^T A(x)]`). The words `"layer"` and `"quadratic"` are accepted for
      one release, with a `DeprecationWarning`.
    - `num_records`: about how many log-spaced steps to record (default 50;
      steps 0 and `num_steps` always included).
    - `record_at`: the exact steps to record instead (increasing ints in
      `[0, num_steps]`).
    - `basis`: shape `(p, q)`: record only `diag(basis^T M basis)` (e.g. the mode
      amplitudes of `lv_reduce`, for comparison with `solve_lv`), not `M`.
    - `snapshots`: `False` records the loss only.
    - `divergence_factor`: how many times $L_{\rm ref}$ the loss may reach
      before the run counts as diverged (static float `> 1`, default `1e4`).

    **Returns:** a `TrainResult`.

    **Raises:** `ValueError` (at trace time) for mismatched shapes, a `key` that
    is not a PRNG key, a missing key, width or learning rate, non-static sizes,
    or more units than the layer holds (`structure.max_units`); for
    `init_scale <= 0`, `learning_rate <= 0`, `weight_decay < 0` or NaN/inf in
    the data or `W0`, a `ValueError` when the values are concrete and an
    `eqx.error_if` runtime error under `jit`/`vmap`.
    """
    # Long only for its docstring (the contract); the code is one call.
    segment = Segment(num_steps, learning_rate, weight_decay, batch_size)
    return train_segments(
        structure,
        xs,
        ys,
        [segment],
        optimizer=optimizer,
        key=key,
        init_scale=init_scale,
        width=width,
        W0=W0,
        model=as_model(model),
        num_records=num_records,
        record_at=record_at,
        basis=basis,
        snapshots=snapshots,
        divergence_factor=divergence_factor,
    )


def train_segments(
    structure: AbstractStructure,
    xs: Float[ArrayLike, "n ..."],
    ys: Float[ArrayLike, "n k"],
    segments: Sequence[Segment],
    *,
    optimizer: optax.GradientTransformation | Callable | None = None,
    key: PRNGKeyArray | None = None,
    init_scale: Float[ArrayLike, ""] | None = None,
    width: int | None = None,
    W0: Float[ArrayLike, "p m"] | None = None,
    model: AbstractModel = Layer(),
    num_records: int = 50,
    record_at: Sequence[int] | None = None,
    basis: Float[ArrayLike, "p q"] | None = None,
    snapshots: bool = True,
    divergence_factor: float = 1e4,
) -> TrainResult:
    r"""Train `W` through `segments`, one after the other: the one training loop
    of `train` (one segment), `train_method` and `train_schedule`.

    Segment `i` runs the global steps `[s_i, s_i + num_steps_i)`
    ($s_i$ the sum of the earlier segments' steps) with its own learning rate
    (a schedule is evaluated at the global step), weight decay, batch size and
    minibatch stream (see `Segment`), from the weights the previous one ended
    with; the optimizer (`optimizer`, as in `train`, built anew with each
    segment's learning rate) restarts its state at each boundary -- exactly
    right for plain SGD, a fresh start for momentum or Adam. All segments run in
    one compiled program, recorded at global steps into one `TrainResult`;
    the divergence reference is the loss at the start of the run.

    **Arguments:** `segments`, a non-empty sequence of `Segment`s; the others
    as in `train` (`num_records` and `record_at` count global steps up to the
    total). `train(..., num_steps=N, learning_rate=eta, weight_decay=lam,
    batch_size=b)` is `train_segments(..., [Segment(N, eta, lam, b)])`.

    **Returns:** a `TrainResult`.

    **Raises:** as `train`; a segment's argument is named `segments[i].NAME`
    when there are several.
    """
    if not isinstance(structure, AbstractStructure):
        raise ValueError(
            f"`structure` must be an nqfjax.AbstractStructure, got {structure!r}."
        )
    model = as_model(model)
    factor = float(divergence_factor)
    if not (np.isfinite(factor) and factor > 1):
        raise ValueError(
            "`divergence_factor` must be a finite float > 1, got "
            f"{divergence_factor!r}."
        )
    if key is not None:
        key = check_key(key)
    xs, ys, dtype = _check_data(structure, xs, ys, W0)
    W0, width, init_scale = _check_init(
        structure, model, W0, width, init_scale, key, dtype
    )
    segments = _check_segments(segments, optimizer, xs.shape[0], key, dtype)
    if key is None:
        key = jr.key(0)  # unused: full batches (or the segments' keys) from W0
    num_steps = sum(s.num_steps for s in segments)
    record = _check_records(record_at, num_records, num_steps)
    if basis is not None:
        basis = jnp.asarray(basis, dtype)
        if basis.ndim != 2 or basis.shape[0] != structure.p:
            raise ValueError(
                f"`basis` must have shape (p, q) = ({structure.p}, q), got "
                f"{basis.shape}."
            )
        basis = finite("basis", basis)
    return run_segments(
        structure,
        model,
        xs,
        ys,
        W0,
        init_scale,
        key,
        segments,
        basis,
        optimizer=optimizer,
        width=width,
        record=record,
        snapshots=snapshots,
        divergence_factor=factor,
    )


# --------------------------------------------------------------------------------
# argument checks


def _check_data(structure, xs, ys, W0):
    """`xs`, `ys` as finite arrays of one float dtype (promoted with `W0`'s)."""
    xs = jnp.asarray(xs)
    ys = jnp.asarray(ys)
    if xs.ndim != 1 + len(structure.input_shape) or xs.shape[1:] != tuple(
        structure.input_shape
    ):
        raise ValueError(
            f"`xs` must have shape (n, *input_shape) = (n, "
            f"{', '.join(map(str, structure.input_shape))}), got {xs.shape}."
        )
    n = xs.shape[0]
    if n < 1:
        raise ValueError("`xs` must hold at least one sample.")
    check_shape("ys", ys, (n, structure.k))
    dtype = jnp.result_type(xs.dtype, ys.dtype, float)
    if W0 is not None:
        dtype = jnp.result_type(dtype, jnp.asarray(W0).dtype)
    return finite("xs", xs.astype(dtype)), finite("ys", ys.astype(dtype)), dtype


def _check_init(structure, model, W0, width, init_scale, key, dtype):
    """`(W0, width, init_scale)`: the start is `init_scale * W0`, or
    `init_scale * Z` with `Z` drawn from `key` when `W0` is `None`."""
    p = structure.p
    if W0 is not None:
        W0 = jnp.asarray(W0, dtype)
        if W0.ndim != 2 or W0.shape[0] != p:
            raise ValueError(f"`W0` must have shape (p, m) = ({p}, m), got {W0.shape}.")
        if width is not None and static_int("width", width, 1) != W0.shape[1]:
            raise ValueError(
                f"`width` ({width}) does not match `W0.shape[1]` ({W0.shape[1]})."
            )
        width = W0.shape[1]
        W0 = finite("W0", W0)
        if init_scale is None:
            init_scale = 1.0
    else:
        if width is None:
            raise ValueError("Give `width` (number of units) or `W0`.")
        width = static_int("width", width, 1)
        if init_scale is None:
            raise ValueError("Give `init_scale` (sigma > 0) or `W0`.")
        if key is None:
            raise ValueError("A `key` is needed to draw the isotropic initial weights.")
    init_scale = jnp.asarray(init_scale)
    check_shape("init_scale", init_scale, ())
    init_scale = positive("init_scale", init_scale.astype(dtype))
    max_units = model.max_units(structure)
    if max_units is not None and width > max_units:
        raise ValueError(
            f"`width` ({width}) exceeds the {max_units} units this layer holds "
            "(`structure.max_units`)."
        )
    return W0, width, init_scale


def _check_segments(segments, optimizer, n, key, dtype) -> list[Segment]:
    """The segments with checked values: static sizes, learning rates and weight
    decays as scalars of the data's dtype (arguments named `segments[i].NAME`
    when there are several)."""
    if isinstance(segments, Segment) or not isinstance(segments, Sequence):
        raise ValueError(
            f"`segments` must be a sequence of nqfjax Segments, got {segments!r}."
        )
    if len(segments) == 0:
        raise ValueError("`segments` must hold at least one Segment.")
    if not (
        optimizer is None
        or isinstance(optimizer, optax.GradientTransformation)
        or callable(optimizer)
    ):
        raise ValueError(
            "`optimizer` must be None, an optax.GradientTransformation or a "
            f"factory `learning_rate -> GradientTransformation`, got {optimizer!r}."
        )
    checked = []
    for i, seg in enumerate(segments):
        pre = f"segments[{i}]." if len(segments) > 1 else ""
        if not isinstance(seg, Segment):
            raise ValueError(f"`segments[{i}]` must be a Segment, got {seg!r}.")
        lam = jnp.asarray(seg.weight_decay)
        check_shape(pre + "weight_decay", lam, ())
        lam = nonnegative(pre + "weight_decay", lam.astype(dtype))
        has_key = key is not None or seg.key is not None
        checked.append(
            Segment(
                static_int(pre + "num_steps", seg.num_steps, 1),
                _check_learning_rate(pre, optimizer, seg.learning_rate, dtype),
                lam,
                _check_batch_size(pre, seg.batch_size, n, has_key),
                None if seg.key is None else check_key(seg.key, pre + "key"),
            )
        )
    return checked


def _check_learning_rate(pre, optimizer, learning_rate, dtype):
    """The learning rate as the loop uses it (a checked scalar, a schedule, or
    `None` beside a ready transformation)."""
    if isinstance(optimizer, optax.GradientTransformation):
        if learning_rate is not None:
            raise ValueError(
                f"`{pre}learning_rate` must be None when `optimizer` is a ready "
                "optax.GradientTransformation; pass a factory such as `optax.adam` "
                "to sweep the learning rate."
            )
        return None
    if learning_rate is None:
        raise ValueError(
            f"Give `{pre}learning_rate` (a learning rate > 0 or an optax schedule)."
        )
    if callable(learning_rate):
        return learning_rate
    learning_rate = jnp.asarray(learning_rate)
    check_shape(pre + "learning_rate", learning_rate, ())
    return positive(pre + "learning_rate", learning_rate.astype(dtype))


def _check_batch_size(pre, batch_size, n, has_key):
    """The static minibatch size, `None` for full batch."""
    if batch_size is None:
        return None
    batch_size = static_int(pre + "batch_size", batch_size, 1)
    if batch_size > n:
        raise ValueError(
            f"`{pre}batch_size` ({batch_size}) exceeds the n = {n} samples."
        )
    if batch_size == n:
        return None
    if not has_key:
        raise ValueError(
            f"A `key` is needed to draw minibatches (`{pre}batch_size` < n)."
        )
    return batch_size


def _check_records(record_at, num_records, num_steps) -> tuple[int, ...]:
    """The recorded steps, a static tuple of increasing ints in `[0, num_steps]`."""
    if record_at is None:
        return log_spaced_steps(num_steps, static_int("num_records", num_records, 2))
    if not is_concrete(record_at):
        raise ValueError("`record_at` must be static (a list of Python ints).")
    record = tuple(int(s) for s in np.asarray(record_at).reshape(-1))
    if (
        len(record) == 0
        or record[0] < 0
        or record[-1] > num_steps
        or any(b <= a for a, b in zip(record, record[1:]))
    ):
        raise ValueError(
            "`record_at` must be strictly increasing integers in "
            f"[0, num_steps={num_steps}]."
        )
    return record
