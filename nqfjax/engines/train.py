"""W-space training: the real layer or its quadratic form, with any optax optimizer."""

from collections.abc import Callable, Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
from jaxtyping import Array, ArrayLike, Bool, Float, Int, PRNGKeyArray

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


_MODELS = ("layer", "quadratic")


class TrainResult(eqx.Module):
    r"""What `nqfjax.train` returns: the loss curve and snapshots of `M = W W^T`.

    Time counts optimizer steps (one full-batch GD step of learning rate
    `learning_rate` is `dt = 1` of the flow
    $\dot W = -\eta(2 G W + \lambda W)$ with $\eta$ the learning rate), so `ts`
    can be passed straight to `solve_mflow(..., learning_rate)` or `solve_lv`.

    **Attributes:**

    - `steps`: the recorded steps, shape `(R,)`, integers from 0 to `num_steps`;
      the state at step `s` is the one after `s` updates.
    - `loss`: the full-data squared loss of the trained model at those steps,
      shape `(R,)`: for `model="layer"`
      $\tfrac1{2n} \sum_s \sum_j (f_j(x_s; W) - y_{s,j})^2$ with
      `f(x; W) = structure.layer(W, x)` the real layer (its value at zero,
      `f(x; 0)`, included: nothing is subtracted); for `model="quadratic"` the
      same with the quadratic model
      $f_j(x; W) = f_j(x; 0) + \mathrm{Tr}[W W^\top A_j(x)]$, which is exactly
      `task_from_samples(structure, xs, ys).loss(W W^T)`. Without the
      weight-decay penalty; NaN or inf once training diverged.
    - `M`: `W W^T` at those steps, shape `(R, p, p)`, or `None` when a `basis` was
      given or `snapshots=False`.
    - `m`: the diagonal of `basis^T W W^T basis` at those steps, shape `(R, q)`,
      or `None` when no `basis` was given.
    - `W`: the final weights, shape `(p, m)`.
    - `diverged`: whether the run diverged (a boolean scalar): the full-data
      loss above became non-finite, or exceeded `divergence_factor` times the
      larger of its initial value and its value at zero weights (see `train`).
    - `diverged_at`: the first step at which that was detected (an int scalar),
      -1 when the run did not diverge.

    Under `jax.vmap` every field gains the mapped axis (`diverged` becomes one
    flag per run).
    """

    steps: Int[Array, " R"]
    loss: Float[Array, " R"]
    M: Float[Array, "R p p"] | None
    m: Float[Array, "R q"] | None
    W: Float[Array, "p m"]
    diverged: Bool[Array, ""]
    diverged_at: Int[Array, ""]

    @property
    def ts(self) -> Float[Array, " R"]:
        """The recorded steps as flow times (`t = step`), in the loss's dtype."""
        return self.steps.astype(self.loss.dtype)


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
    model: str = "layer",
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

    where `f` is either the real layer `structure.layer` (`model="layer"`) or its
    quadratic model $f(x; 0) + \mathrm{Tr}[W W^\top A(x)]$ (`model="quadratic"`,
    `nqf_apply` plus the layer's value at zero).
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
    whose `loss(W W^T)` is the recorded loss of `model="quadratic"` and, to
    leading order in `W`, of `model="layer"`. The recorded loss itself always
    compares the model's full output, offset included, with `y` (see
    `TrainResult.loss`). The offset is zero for perceptrons, quadratic networks
    and the other additive layers.

    **Minibatches.** With `batch_size = b < n`, each step uses `b` distinct
    samples drawn uniformly without replacement, independently at each step
    (from `jax.random.fold_in(batch_key, step)`), so the minibatch gradient is
    unbiased with covariance $\frac{n-b}{b(n-1)}$ times the per-sample one.
    `batch_size=None` (default) or `n` is full batch. The recorded loss is
    always the full-data loss.

    **Recording.** The loop is one `jax.lax.scan` over the steps; at the
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
    - `model`: `"layer"` (the real nonlinear layer) or `"quadratic"` (its
      quadratic form `Tr[W W^T A(x)]`).
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
    # Long only for its docstring (the contract); the code is checks and one call.
    if not isinstance(structure, AbstractStructure):
        raise ValueError(
            f"`structure` must be an nqfjax.AbstractStructure, got {structure!r}."
        )
    if model not in _MODELS:
        raise ValueError(f"`model` must be one of {_MODELS}, got {model!r}.")
    num_steps = static_int("num_steps", num_steps, 1)
    factor = float(divergence_factor)
    if not (np.isfinite(factor) and factor > 1):
        raise ValueError(
            "`divergence_factor` must be a finite float > 1, got "
            f"{divergence_factor!r}."
        )
    if key is not None:
        key = check_key(key)
    xs, ys, dtype = _check_data(structure, xs, ys, W0)
    n = xs.shape[0]
    W0, width, init_scale = _check_init(
        structure, model, W0, width, init_scale, key, dtype
    )
    learning_rate = _check_optimizer(optimizer, learning_rate, dtype)
    weight_decay = jnp.asarray(weight_decay)
    check_shape("weight_decay", weight_decay, ())
    weight_decay = nonnegative("weight_decay", weight_decay.astype(dtype))
    batch_size = _check_batch_size(batch_size, n, key)
    if key is None:
        key = jr.key(0)  # unused: full batch from a given W0
    record = _check_records(record_at, num_records, num_steps)
    if basis is not None:
        basis = jnp.asarray(basis, dtype)
        if basis.ndim != 2 or basis.shape[0] != structure.p:
            raise ValueError(
                f"`basis` must have shape (p, q) = ({structure.p}, q), got "
                f"{basis.shape}."
            )
        basis = finite("basis", basis)

    return _train(
        structure,
        xs,
        ys,
        W0,
        init_scale,
        learning_rate,
        weight_decay,
        basis,
        key,
        optimizer=optimizer,
        num_steps=num_steps,
        width=width,
        batch_size=batch_size,
        model=model,
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
    max_units = getattr(structure, "max_units", None)
    if model == "layer" and max_units is not None and width > max_units:
        raise ValueError(
            f"`width` ({width}) exceeds the {max_units} units this layer holds "
            "(`structure.max_units`)."
        )
    return W0, width, init_scale


def _check_optimizer(optimizer, learning_rate, dtype):
    """The learning rate as `train` uses it (a checked scalar, a schedule, or
    `None` beside a ready transformation)."""
    if isinstance(optimizer, optax.GradientTransformation):
        if learning_rate is not None:
            raise ValueError(
                "`learning_rate` must be None when `optimizer` is a ready "
                "optax.GradientTransformation; pass a factory such as `optax.adam` "
                "to sweep the learning rate."
            )
        return None
    if optimizer is not None and not callable(optimizer):
        raise ValueError(
            "`optimizer` must be None, an optax.GradientTransformation or a "
            f"factory `learning_rate -> GradientTransformation`, got {optimizer!r}."
        )
    if learning_rate is None:
        raise ValueError(
            "Give `learning_rate` (a learning rate > 0 or an optax schedule)."
        )
    if callable(learning_rate):
        return learning_rate
    learning_rate = jnp.asarray(learning_rate)
    check_shape("learning_rate", learning_rate, ())
    return positive("learning_rate", learning_rate.astype(dtype))


def _check_batch_size(batch_size, n, key):
    """The static minibatch size, `None` for full batch."""
    if batch_size is None:
        return None
    batch_size = static_int("batch_size", batch_size, 1)
    if batch_size > n:
        raise ValueError(f"`batch_size` ({batch_size}) exceeds the n = {n} samples.")
    if batch_size == n:
        return None
    if key is None:
        raise ValueError("A `key` is needed to draw minibatches (`batch_size` < n).")
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


# --------------------------------------------------------------------------------
# the compiled loop


def _sample_without_replacement(key, n: int, b: int) -> Int[Array, " b"]:
    """`b` distinct indices out of `n`, uniformly: the first `b` swaps of a
    Fisher-Yates shuffle (O(b) work; `jax.random.choice(replace=False)` sorts all
    `n`, which was measured ~30x slower per step under `vmap` on CPU)."""
    js = jr.randint(key, (b,), jnp.arange(b), n)

    def swap(i, perm):
        j = js[i]
        return perm.at[i].set(perm[j]).at[j].set(perm[i])

    return jax.lax.fori_loop(0, b, swap, jnp.arange(n))[:b]


def _model(structure, model, xs, ys, width, dtype):
    """`(predict, targets)`: the model's output on a batch, and what it is
    compared with, so that `predict(W, xs) - targets` is `f(x; W) - y`."""
    if model == "layer":
        # the data were checked once in `train`; a structure's `layer` and
        # `contract` check only (static) shapes, so no value check runs every step
        def predict(W, xb):
            return jax.vmap(structure.layer, in_axes=(None, 0))(W, xb)

        return predict, ys

    def predict(W, xb):
        # Tr[W W^T A_j(x_s)] for the batch, through the structure's contraction
        # (closed form for the perceptron: no A(x) is built)
        return structure.contract(xb, W @ W.T)

    # the quadratic model is f(x; 0) + Tr[W W^T A(x)]: its form learns y - f(x; 0)
    offsets = jax.vmap(structure.layer, in_axes=(None, 0))(
        jnp.zeros((structure.p, width), dtype), xs
    )
    return predict, ys - offsets


def _snapshotter(basis, snapshots, dtype):
    """What is recorded of `W`: `diag(basis^T W W^T basis)`, `W W^T`, or nothing."""

    def snapshot(W):
        if basis is not None:
            return jnp.sum((basis.T @ W) ** 2, axis=1)
        if snapshots:
            return W @ W.T
        return jnp.zeros((0,), dtype)

    return snapshot


def _optimizer(optimizer, learning_rate) -> optax.GradientTransformation:
    """The optax transformation: plain SGD, a factory's, or the one given."""
    if optimizer is None:
        return optax.sgd(learning_rate)
    if isinstance(optimizer, optax.GradientTransformation):
        return optimizer
    return optimizer(learning_rate)


def _recorder(record, num_steps, snapshot, data_loss, W):
    """The recording slots and buffers: `slots[s]` is the record index of step
    `s` (-1 when not recorded), and `store(W, buffers, slot)` fills one."""
    slots = np.full(num_steps, -1, np.int32)
    for i, s in enumerate(record):
        if s < num_steps:
            slots[s] = i
    snap_shape = jax.eval_shape(snapshot, W)
    buffers = (
        jnp.full((len(record),), jnp.nan, W.dtype),
        jnp.full((len(record), *snap_shape.shape), jnp.nan, W.dtype),
    )

    def store(W, buffers, slot):
        losses, snaps = buffers
        return (
            losses.at[slot].set(data_loss(W)),
            snaps.at[slot].set(snapshot(W)),
        )

    return jnp.asarray(slots), buffers, store


def _first_diverged(record, losses, num_steps, final_loss, first_step, threshold):
    """The first step at which the loss was non-finite or above `threshold`:
    the earliest of the per-step check (`first_step`, -1 for none), the recorded
    losses and the final one (step `num_steps`); -1 for none."""

    def bad(L):
        return ~jnp.isfinite(L) | (L > threshold)

    never = jnp.iinfo(jnp.int32).max
    at_record = jnp.min(jnp.where(bad(losses), jnp.asarray(record, jnp.int32), never))
    at_end = jnp.where(bad(final_loss), num_steps, never)
    per_step = jnp.where(first_step >= 0, first_step, never)
    first = jnp.minimum(jnp.minimum(per_step, at_record), at_end)
    return jnp.where(first == never, -1, first).astype(jnp.int32)


@eqx.filter_jit
def _train(
    structure,
    xs,
    ys,
    W0,
    init_scale,
    learning_rate,
    weight_decay,
    basis,
    key,
    *,
    optimizer,
    num_steps,
    width,
    batch_size,
    model,
    record,
    snapshots,
    divergence_factor,
):
    dtype = xs.dtype
    p, n = structure.p, xs.shape[0]
    init_key, batch_key = jr.split(key)
    Z = jr.normal(init_key, (p, width), dtype) if W0 is None else W0
    W = init_scale * Z
    predict, targets = _model(structure, model, xs, ys, width, dtype)

    def batch_loss(W, xb, tb):
        return 0.5 * jnp.mean(jnp.sum((predict(W, xb) - tb) ** 2, axis=-1))

    def objective(W, xb, tb):
        data = batch_loss(W, xb, tb)
        return data + 0.5 * weight_decay * jnp.sum(W**2), data

    def data_loss(W):
        return batch_loss(W, xs, targets)

    snapshot = _snapshotter(basis, snapshots, dtype)
    opt = _optimizer(optimizer, learning_rate)
    slots, buffers, store = _recorder(record, num_steps, snapshot, data_loss, W)
    # the divergence threshold: factor x max(initial loss, loss at zero weights)
    reference = jnp.maximum(data_loss(W), data_loss(jnp.zeros_like(W)))
    threshold = divergence_factor * reference
    # the batch loss times b/n is a lower bound on the full-data loss
    fraction = 1.0 if batch_size is None else batch_size / n

    def step(carry, inputs):
        W, opt_state, buffers, first = carry
        s, slot = inputs
        buffers = jax.lax.cond(
            slot >= 0, store, lambda W, buffers, slot: buffers, W, buffers, slot
        )
        if batch_size is None:
            xb, tb = xs, targets
        else:
            idx = _sample_without_replacement(jr.fold_in(batch_key, s), n, batch_size)
            xb, tb = xs[idx], targets[idx]
        (_, loss), grads = jax.value_and_grad(objective, has_aux=True)(W, xb, tb)
        bound = fraction * loss
        bad = ~jnp.isfinite(bound) | (bound > threshold)
        first = jnp.where((first < 0) & bad, s, first)
        updates, opt_state = opt.update(grads, opt_state, W)
        W = optax.apply_updates(W, updates)
        return (W, opt_state, buffers, first), None

    carry = (W, opt.init(W), buffers, jnp.asarray(-1, jnp.int32))
    inputs = (jnp.arange(num_steps, dtype=jnp.int32), slots)
    (W, _, buffers, first), _ = jax.lax.scan(step, carry, inputs)
    final_loss = data_loss(W)
    if record[-1] == num_steps:
        buffers = store(W, buffers, len(record) - 1)
    losses, snaps = buffers
    diverged_at = _first_diverged(
        record, losses, num_steps, final_loss, first, threshold
    )
    return TrainResult(
        steps=jnp.asarray(record, jnp.int32),
        loss=losses,
        M=snaps if (basis is None and snapshots) else None,
        m=snaps if basis is not None else None,
        W=W,
        diverged=diverged_at >= 0,
        diverged_at=diverged_at,
    )
