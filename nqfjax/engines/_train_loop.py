r"""The one W-space training loop: segments of optimizer steps, compiled once.

A run is a sequence of `Segment`s, each `num_steps` steps with its own learning
rate (or schedule), weight decay, batch size and minibatch key, continuing from
the weights the previous one ended with; the optimizer state restarts at each
boundary. `nqfjax.train` is one segment; `train_method`'s batch-size schedules
and `train_schedule`'s piecewise-constant schedules are several. The arguments
are checked by `engines/train.py` (`train_segments`); nothing here checks
values.
"""

from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
from jaxtyping import Array, ArrayLike, Bool, Float, Int, PRNGKeyArray


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
      shape `(R,)`: $\tfrac1{2n} \sum_s \sum_j (f_j(x_s; W) - y_{s,j})^2$ with
      `f` the model's whole prediction (`Layer()`: the real layer, its value
      at zero included, nothing subtracted; `QuadraticForm()`:
      $f_j(x; 0) + \mathrm{Tr}[W W^\top A_j(x)]$, which is exactly
      `task_from_samples(structure, xs, ys).loss(W W^T)`). Without the
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


class Segment(eqx.Module):
    r"""`num_steps` optimizer steps with one learning rate, weight decay, batch
    size and minibatch stream (one piece of a run of `train_segments`).

    **Arguments and fields:**

    - `num_steps`: the number of steps (static int >= 1).
    - `learning_rate`: `eta > 0`, or an optax schedule `step -> eta` evaluated
      at the run's global step; `None` beside a ready optax transformation.
    - `weight_decay`: `lambda >= 0` (default 0).
    - `batch_size`: the minibatch size `b` (static), `None` for full batch.
    - `key`: the segment's own minibatch key: step `j` of the segment (counted
      from its start) draws from `fold_in(key, j)`. `None` (default): the
      run's stream, `fold_in(batch_key, s)` at the global step `s` with
      `batch_key` the second half of `split(key)` of the run's `key` (so
      segments without keys draw exactly the minibatches of one long run).
    """

    num_steps: int = eqx.field(static=True)
    learning_rate: Float[ArrayLike, ""] | Callable | None = None
    weight_decay: Float[ArrayLike, ""] = 0.0
    batch_size: int | None = eqx.field(static=True, default=None)
    key: PRNGKeyArray | None = None


def sample_without_replacement(key, n: int, b: int) -> Int[Array, " b"]:
    """`b` distinct indices out of `n`, uniformly: the first `b` swaps of a
    Fisher-Yates shuffle (O(b) work; `jax.random.choice(replace=False)` sorts all
    `n`, which was measured ~30x slower per step under `vmap` on CPU)."""
    js = jr.randint(key, (b,), jnp.arange(b), n)

    def swap(i, perm):
        j = js[i]
        return perm.at[i].set(perm[j]).at[j].set(perm[i])

    return jax.lax.fori_loop(0, b, swap, jnp.arange(n))[:b]


def _snapshotter(basis, snapshots, dtype):
    """What is recorded of `W`: `diag(basis^T W W^T basis)`, `W W^T`, or nothing."""

    def snapshot(W):
        if basis is not None:
            return jnp.sum((basis.T @ W) ** 2, axis=1)
        if snapshots:
            return W @ W.T
        return jnp.zeros((0,), dtype)

    return snapshot


def _optimizer(optimizer, learning_rate, start: int) -> optax.GradientTransformation:
    """The optax transformation of a segment starting at global step `start`:
    plain SGD, a factory's, or the one given; a schedule is shifted to the
    global step (the optimizer's own count restarts with the segment)."""
    if isinstance(optimizer, optax.GradientTransformation):
        return optimizer
    if callable(learning_rate) and start:
        schedule = learning_rate
        learning_rate = lambda count: schedule(count + start)  # noqa: E731
    if optimizer is None:
        return optax.sgd(learning_rate)
    return optimizer(learning_rate)


def _recorder(record, snapshot, data_loss, W):
    """The recording buffers, and `store(W, buffers, slot)`, which fills one."""
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

    return buffers, store


def _slots(record, start: int, stop: int) -> Int[Array, " L"]:
    """`slots[j]` is the record index of global step `start + j` (-1: none)."""
    slots = np.full(stop - start, -1, np.int32)
    for i, s in enumerate(record):
        if start <= s < stop:
            slots[s - start] = i
    return jnp.asarray(slots)


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


def _run_segment(carry, segment, start, run_key, optimizer, problem, record):
    """One segment's `lax.scan`; `carry = (W, buffers, first)`."""
    xs, targets, batch_loss, store, threshold = problem
    n, b = xs.shape[0], segment.batch_size
    lam = segment.weight_decay
    opt = _optimizer(optimizer, segment.learning_rate, start)
    # the batch loss times b/n is a lower bound on the full-data loss
    fraction = 1.0 if b is None else b / n

    def objective(W, xb, tb):
        data = batch_loss(W, xb, tb)
        return data + 0.5 * lam * jnp.sum(W**2), data

    def step(carry, inputs):
        W, opt_state, buffers, first = carry
        s, slot = inputs  # s: the global step
        buffers = jax.lax.cond(
            slot >= 0, store, lambda W, buffers, slot: buffers, W, buffers, slot
        )
        if b is None:
            xb, tb = xs, targets
        else:
            if segment.key is None:
                key = jr.fold_in(run_key, s)
            else:
                key = jr.fold_in(segment.key, s - start)
            idx = sample_without_replacement(key, n, b)
            xb, tb = xs[idx], targets[idx]
        (_, loss), grads = jax.value_and_grad(objective, has_aux=True)(W, xb, tb)
        bound = fraction * loss
        bad = ~jnp.isfinite(bound) | (bound > threshold)
        first = jnp.where((first < 0) & bad, s, first)
        updates, opt_state = opt.update(grads, opt_state, W)
        W = optax.apply_updates(W, updates)
        return (W, opt_state, buffers, first), None

    W, buffers, first = carry
    stop = start + segment.num_steps
    inputs = (jnp.arange(start, stop, dtype=jnp.int32), _slots(record, start, stop))
    (W, _, buffers, first), _ = jax.lax.scan(
        step, (W, opt.init(W), buffers, first), inputs
    )
    return W, buffers, first


@eqx.filter_jit
def run_segments(
    structure,
    model,
    xs,
    ys,
    W0,
    init_scale,
    key,
    segments,
    basis,
    *,
    optimizer,
    width,
    record,
    snapshots,
    divergence_factor,
) -> TrainResult:
    """Train from `init_scale * W0` (or `init_scale * Z`, `Z` standard normal
    from the first half of `split(key)`, when `W0` is None) through `segments`,
    recording the full-data loss and snapshots at the global steps `record`."""
    dtype = xs.dtype
    init_key, run_key = jr.split(key)
    Z = jr.normal(init_key, (structure.p, width), dtype) if W0 is None else W0
    W = init_scale * Z
    # the residual f - y = g(x; W) - (y - f_0(x)): the offset goes once
    targets = ys - model.offset(structure, xs, width)

    def batch_loss(W, xb, tb):
        r = model.apply(structure, W, xb) - tb
        return 0.5 * jnp.mean(jnp.sum(r**2, axis=-1))

    def data_loss(W):
        return batch_loss(W, xs, targets)

    snapshot = _snapshotter(basis, snapshots, dtype)
    buffers, store = _recorder(record, snapshot, data_loss, W)
    # the divergence threshold: factor x max(initial loss, loss at zero weights)
    reference = jnp.maximum(data_loss(W), data_loss(jnp.zeros_like(W)))
    threshold = divergence_factor * reference
    problem = (xs, targets, batch_loss, store, threshold)
    carry, start = (W, buffers, jnp.asarray(-1, jnp.int32)), 0
    for segment in segments:
        carry = _run_segment(carry, segment, start, run_key, optimizer, problem, record)
        start += segment.num_steps
    W, buffers, first = carry
    final_loss = data_loss(W)
    if record[-1] == start:
        buffers = store(W, buffers, len(record) - 1)
    losses, snaps = buffers
    diverged_at = _first_diverged(record, losses, start, final_loss, first, threshold)
    return TrainResult(
        steps=jnp.asarray(record, jnp.int32),
        loss=losses,
        M=snaps if (basis is None and snapshots) else None,
        m=snaps if basis is not None else None,
        W=W,
        diverged=diverged_at >= 0,
        diverged_at=diverged_at,
    )
