"""W-space training: the real layer or its quadratic form, with any optax optimizer."""

from collections.abc import Callable, Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
from jaxtyping import Array, ArrayLike, Float, Int, PRNGKeyArray

from .._checks import (
    check_shape,
    finite,
    is_concrete,
    nonnegative,
    positive,
    static_int,
)
from ..structures.base import Structure


_MODELS = ("layer", "quadratic")


class TrainResult(eqx.Module):
    r"""What `nqfjax.train` returns: the loss curve and snapshots of `M = W W^T`.

    Time counts optimizer steps (THEORY.md section 2: one full-batch GD step of
    learning rate `eta` is `dt = 1` of the flow $\dot W = -\eta(2 G W + \lambda W)$),
    so `ts` can be passed straight to `solve_mflow(..., eta)` or `solve_lv`.

    **Attributes:**

    - `steps`: the recorded steps, shape `(R,)`, integers from 0 to `num_steps`;
      the state at step `s` is the one after `s` updates.
    - `loss`: the full-data loss
      $\tfrac12 \frac1n \sum_s \sum_j (f_j(x_s; W) - f_j(x_s; 0) - y_{s,j})^2$
      at those steps, shape `(R,)` (without the weight-decay penalty, so that it
      is the task's `loss(M)`; NaN once training diverged).
    - `M`: `W W^T` at those steps, shape `(R, p, p)`, or `None` when a `basis` was
      given or `snapshots=False`.
    - `m`: the diagonal of `basis^T W W^T basis` at those steps, shape `(R, q)`,
      or `None` when no `basis` was given.
    - `W`: the final weights, shape `(p, m)`.
    """

    steps: Int[Array, " R"]
    loss: Float[Array, " R"]
    M: Float[Array, "R p p"] | None
    m: Float[Array, "R q"] | None
    W: Float[Array, "p m"]

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
    structure: Structure,
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
) -> TrainResult:
    r"""Train the weights `W` (`p x m`, units as columns) on data `(xs, ys)`.

    Minimises, with the given optax optimizer,

    $$\mathcal L(W) = \frac{1}{2 b} \sum_{s \in \text{batch}} \sum_j
      \big(f_j(x_s; W) - y_{s,j}\big)^2 + \frac{\lambda}{2} |W|^2,$$

    where `f` is either the real layer `structure.layer` (`model="layer"`) or its
    quadratic model $f(x; 0) + \mathrm{Tr}[W W^\top A(x)]$ (`model="quadratic"`,
    `nqf_apply` plus the layer's value at zero).
    Plain gradient descent (the default, `optax.sgd(learning_rate)`) takes steps
    $W \leftarrow W - \eta (2 G W + \lambda W)$ with $G = \partial L / \partial M$:
    the Euler discretisation with `dt = 1` of THEORY.md section 2's
    $\dot W = -\eta(2GW + \lambda W)$, so step `s` corresponds to flow time
    `t = s` with the learning rate inside the flow. The weight decay is an L2
    penalty on the objective (with Adam this is not AdamW; pass `optax.adamw`
    for decoupled decay).

    **The offset.** The layer's value at zero weights, `f(x; 0)` (for example the
    mean value under a uniform softmax), is an offset of the target: the units
    learn `y - f(x; 0)` (THEORY.md section 1), exactly as in
    `task_from_samples(structure, xs, ys)`, so that the recorded loss is that
    task's `loss(W W^T)` to leading order. The offset is zero for perceptrons,
    quadratic networks and the other additive layers.

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

    **Transforms.** Numbers that a sweep varies (`init_scale`, `learning_rate`,
    `weight_decay`, `key`, `W0`, `xs`, `ys`, `basis`) are traced, so
    `jax.vmap(lambda s: train(..., init_scale=s))` and friends work, as does
    `jax.grad` with respect to them. Everything that fixes shapes or the program
    (`num_steps`, `width`, `batch_size`, `model`, `record_at`, `optimizer`, a
    schedule) is static. The work is jitted once per static configuration;
    optimizer factories and schedules are static and compared by identity, so
    create them once (not a fresh `lambda` per call) to reuse the compilation.

    **Arguments:**

    - `structure`: the architecture.
    - `xs`: inputs, shape `(n, *structure.input_shape)`.
    - `ys`: targets, shape `(n, k)`.
    - `num_steps`: number of optimizer steps (static int >= 1).
    - `learning_rate`: `eta > 0`, or an optax schedule `step -> eta`. Required
      unless `optimizer` is a ready `GradientTransformation`.
    - `optimizer`: `None` for plain SGD/GD (`optax.sgd`), a factory called as
      `optimizer(learning_rate)` (e.g. `optax.adam`, or
      `lambda lr: optax.sgd(lr, momentum=0.9)`), so that the learning rate can be
      swept; or a ready `optax.GradientTransformation` (then `learning_rate`
      must be `None`).
    - `key`: a PRNG key for the isotropic init and the minibatches.
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

    **Returns:** a `TrainResult`.

    **Raises:** `ValueError` (at trace time) for mismatched shapes, a missing key,
    width or learning rate, non-static sizes, or more units than the layer holds
    (`structure.max_units`); for `init_scale <= 0`,
    `learning_rate <= 0`, `weight_decay < 0` or NaN/inf in the data or `W0`, a
    `ValueError` when the values are concrete and an `eqx.error_if` runtime error
    under `jit`/`vmap`.
    """
    if not isinstance(structure, Structure):
        raise ValueError(f"`structure` must be an nqfjax.Structure, got {structure!r}.")
    if model not in _MODELS:
        raise ValueError(f"`model` must be one of {_MODELS}, got {model!r}.")
    num_steps = static_int("num_steps", num_steps, 1)

    # data
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
    xs = finite("xs", xs.astype(dtype))
    ys = finite("ys", ys.astype(dtype))
    p = structure.p

    # initialisation
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

    # optimizer
    if isinstance(optimizer, optax.GradientTransformation):
        if learning_rate is not None:
            raise ValueError(
                "`learning_rate` must be None when `optimizer` is a ready "
                "optax.GradientTransformation; pass a factory such as `optax.adam` "
                "to sweep the learning rate."
            )
    else:
        if optimizer is not None and not callable(optimizer):
            raise ValueError(
                "`optimizer` must be None, an optax.GradientTransformation or a "
                f"factory `learning_rate -> GradientTransformation`, got {optimizer!r}."
            )
        if learning_rate is None:
            raise ValueError("Give `learning_rate` (eta > 0 or an optax schedule).")
        if not callable(learning_rate):
            learning_rate = jnp.asarray(learning_rate)
            check_shape("learning_rate", learning_rate, ())
            learning_rate = positive("learning_rate", learning_rate.astype(dtype))
    weight_decay = jnp.asarray(weight_decay)
    check_shape("weight_decay", weight_decay, ())
    weight_decay = nonnegative("weight_decay", weight_decay.astype(dtype))

    # minibatches
    if batch_size is not None:
        batch_size = static_int("batch_size", batch_size, 1)
        if batch_size > n:
            raise ValueError(
                f"`batch_size` ({batch_size}) exceeds the n = {n} samples."
            )
        if batch_size == n:
            batch_size = None
    if batch_size is not None and key is None:
        raise ValueError("A `key` is needed to draw minibatches (`batch_size` < n).")
    if key is None:
        key = jr.key(0)  # unused: full batch from a given W0

    # recording
    if record_at is None:
        record = log_spaced_steps(num_steps, static_int("num_records", num_records, 2))
    else:
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
    if basis is not None:
        basis = jnp.asarray(basis, dtype)
        if basis.ndim != 2 or basis.shape[0] != p:
            raise ValueError(
                f"`basis` must have shape (p, q) = ({p}, q), got {basis.shape}."
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
    )


def _sample_without_replacement(key, n: int, b: int) -> Int[Array, " b"]:
    """`b` distinct indices out of `n`, uniformly: the first `b` swaps of a
    Fisher-Yates shuffle (O(b) work; `jax.random.choice(replace=False)` sorts all
    `n`, which was measured ~30x slower per step under `vmap` on CPU)."""
    js = jr.randint(key, (b,), jnp.arange(b), n)

    def swap(i, perm):
        j = js[i]
        return perm.at[i].set(perm[j]).at[j].set(perm[i])

    return jax.lax.fori_loop(0, b, swap, jnp.arange(n))[:b]


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
):
    dtype = xs.dtype
    p, n = structure.p, xs.shape[0]
    init_key, batch_key = jr.split(key)
    Z = jr.normal(init_key, (p, width), dtype) if W0 is None else W0
    W = init_scale * Z

    # The data were checked once in `train`; a structure's `layer` and `contract`
    # check only (static) shapes, so no value check runs at every step.
    if model == "layer":

        def predict(W, xb):
            return jax.vmap(structure.layer, in_axes=(None, 0))(W, xb)

        targets = ys
    else:

        def predict(W, xb):
            # Tr[W W^T A_j(x_s)] for the batch, through the structure's contraction
            # (closed form for the perceptron: no A(x) is built)
            return structure.contract(xb, W @ W.T)

        # the quadratic model is f(x; 0) + Tr[W W^T A(x)]: its form learns y - f(x; 0)
        offsets = jax.vmap(structure.layer, in_axes=(None, 0))(
            jnp.zeros((p, width), dtype), xs
        )
        targets = ys - offsets

    def data_loss(W, xb, tb):
        f = predict(W, xb)
        return 0.5 * jnp.mean(jnp.sum((f - tb) ** 2, axis=-1))

    def objective(W, xb, tb):
        return data_loss(W, xb, tb) + 0.5 * weight_decay * jnp.sum(W**2)

    if optimizer is None:
        opt = optax.sgd(learning_rate)
    elif isinstance(optimizer, optax.GradientTransformation):
        opt = optimizer
    else:
        opt = optimizer(learning_rate)
    opt_state = opt.init(W)

    num_records = len(record)
    slots = np.full(num_steps, -1, np.int32)
    for i, s in enumerate(record):
        if s < num_steps:
            slots[s] = i

    def snapshot(W):
        if basis is not None:
            return jnp.sum((basis.T @ W) ** 2, axis=1)
        if snapshots:
            return W @ W.T
        return jnp.zeros((0,), dtype)

    snap_shape = jax.eval_shape(snapshot, W)
    buffers = (
        jnp.full((num_records,), jnp.nan, dtype),
        jnp.full((num_records, *snap_shape.shape), jnp.nan, dtype),
    )

    def store(W, buffers, slot):
        losses, snaps = buffers
        return (
            losses.at[slot].set(data_loss(W, xs, targets)),
            snaps.at[slot].set(snapshot(W)),
        )

    def step(carry, inputs):
        W, opt_state, buffers = carry
        s, slot = inputs
        buffers = jax.lax.cond(
            slot >= 0, store, lambda W, buffers, slot: buffers, W, buffers, slot
        )
        if batch_size is None:
            xb, tb = xs, targets
        else:
            idx = _sample_without_replacement(jr.fold_in(batch_key, s), n, batch_size)
            xb, tb = xs[idx], targets[idx]
        grads = jax.grad(objective)(W, xb, tb)
        updates, opt_state = opt.update(grads, opt_state, W)
        W = optax.apply_updates(W, updates)
        return (W, opt_state, buffers), None

    inputs = (jnp.arange(num_steps), jnp.asarray(slots))
    (W, _, buffers), _ = jax.lax.scan(step, (W, opt_state, buffers), inputs)
    if record[-1] == num_steps:
        buffers = store(W, buffers, num_records - 1)
    losses, snaps = buffers
    M = snaps if (basis is None and snapshots) else None
    m = snaps if basis is not None else None
    return TrainResult(steps=jnp.asarray(record, jnp.int32), loss=losses, M=M, m=m, W=W)
