"""Training methods on the same `M`: SGD with a batch size, momentum, Adam and
schedules (`Method`, `train_method`), and how far each one's switch-on times
depart from the gradient flow on its clock (`compare_methods`)."""

import sys
import warnings
from collections.abc import Callable, Sequence

import equinox as eqx
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
from jaxtyping import Array, ArrayLike, Float, PRNGKeyArray

from .._checks import check_key, static_int
from ..engines.clock import check_momentum, clock
from ..engines.train import Segment, TrainResult, train_segments
from ..structures.base import AbstractStructure
from ..structures.models import AbstractModel, Layer, as_model
from ._optimizers import ALIASES, OPTIMIZERS, HeavyBall, optimizer_word


# --------------------------------------------------------------------------------
# training methods


def _batch_sizes(b):
    """Batch-size schedules as hashable tuples of `(start, size)` ints."""
    if b is None or isinstance(b, (int, np.integer)):
        return b
    return tuple((int(start), int(size)) for start, size in b)


def _warn_deprecated(message: str) -> None:
    """A `DeprecationWarning` attributed to the first caller outside nqfjax and
    equinox (whose module machinery sits between a user and `Method.__init__`)."""
    frame, level = sys._getframe(1), 2
    while frame.f_back is not None and frame.f_globals.get("__name__", "").partition(
        "."
    )[0] in ("nqfjax", "equinox"):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, DeprecationWarning, stacklevel=level)


def _resolve_optimizer(optimizer, momentum):
    """`(optimizer, clock momentum)` from `Method`'s arguments: a deprecated word
    goes through the one table (`OPTIMIZERS`), `None` with a momentum is a heavy
    ball, and a `HeavyBall` brings its own momentum."""
    if isinstance(optimizer, str):
        word = ALIASES.get(optimizer, optimizer)
        if word not in OPTIMIZERS:
            raise ValueError(
                "`optimizer` must be an optax GradientTransformation, a factory "
                "`learning_rate -> GradientTransformation` or None; the deprecated "
                f"words are {', '.join(map(repr, (*OPTIMIZERS, *ALIASES)))}, got "
                f"{optimizer!r}."
            )
        _warn_deprecated(
            f"Method(optimizer={optimizer!r}) is deprecated and will be removed in "
            "the next release: pass an optax object instead (None for gradient "
            "descent, `optax.adam`, or `momentum=mu` for heavy ball)."
        )
        optimizer = OPTIMIZERS[word]
        if word == "momentum":  # the old default momentum was 0.9
            optimizer = HeavyBall(0.9 if momentum is None else momentum)
        momentum = None
    if optimizer is None and momentum is not None and float(momentum) != 0:
        optimizer = HeavyBall(momentum)
    if isinstance(optimizer, HeavyBall):
        if momentum is not None and check_momentum(momentum) != optimizer.momentum:
            raise ValueError(
                f"`momentum` ({momentum}) differs from the optimizer's "
                f"({optimizer.momentum})."
            )
        return optimizer, optimizer.momentum
    if optimizer is not None and not (
        isinstance(optimizer, optax.GradientTransformation) or callable(optimizer)
    ):
        raise ValueError(
            "`optimizer` must be None, an optax GradientTransformation or a factory "
            f"`learning_rate -> GradientTransformation`, got {optimizer!r}."
        )
    return optimizer, 0.0 if momentum is None else check_momentum(momentum)


def _check_batch_sizes(b) -> None:
    if isinstance(b, tuple):
        starts = [s for s, _ in b]
        if (
            len(b) == 0
            or starts[0] != 0
            or any(t <= s for s, t in zip(starts, starts[1:]))
            or any(int(size) < 1 for _, size in b)
        ):
            raise ValueError(
                "A batch-size schedule must be ((0, b_0), (s_1, b_1), ...) with "
                f"strictly increasing starts from 0 and sizes >= 1, got {b}."
            )
    elif b is not None and int(b) < 1:
        raise ValueError(f"`batch_size` must be >= 1, got {b}.")


class Method(eqx.Module):
    r"""A training method acting on `M = W W^T` (configuration only; all static).

    **Arguments and fields:**

    - `learning_rate`: `learning_rate > 0`, or an optax schedule
      `step -> learning_rate`.
    - `optimizer`: an optax choice, as `nqfjax.train` takes it: `None` (default:
      plain steps, `optax.sgd`; gradient descent when full batch), a factory
      `learning_rate -> GradientTransformation` called with `learning_rate`
      (e.g. `optax.adam`, or a value of the command line's table
      `nqfjax.experiments.sweep_config.OPTIMIZERS`), or a ready
      `GradientTransformation` (then `learning_rate` only sets the clock it is
      compared on; keep the two consistent). The words `"sgd"`, `"gd"`,
      `"momentum"` and `"adam"` are still accepted, through that same table, with
      a `DeprecationWarning`, for one release.
    - `momentum`: heavy-ball momentum `mu` in `[0, 1)`. With `optimizer=None` it
      makes the method heavy ball (`optax.sgd(learning_rate, momentum=mu)`); with
      the table's heavy ball it must agree with it; with any other optimizer it
      only tells the clock (see below) the momentum the optimizer has. Stored as
      the clock's momentum (0 for none).
    - `batch_size`: `None` (full batch), an int `b`, or a batch-size schedule
      `((0, b_0), (s_1, b_1), ...)`: batch size `b_i` from step `s_i` on
      (starts strictly increasing, from 0). A schedule is trained as segments
      of one run (`train_segments`), each continuing from the last weights,
      with the learning-rate schedule at the global step and fresh minibatch
      keys; the optimizer state (momentum, Adam's moments) restarts at each
      boundary, exactly right for plain SGD. It needs a factory (or `None`),
      not a ready transformation, whose schedule could not be shifted.
    - `name`: a label (default: built from the fields).

    The clock on which the method is compared with gradient flow
    (`Method.clock`): $\sum_n \eta(n)$ for SGD/GD and Adam (for Adam a nominal
    clock: its steps are normalised per coordinate, not proportional to the
    gradient, so no clock makes it the M-space flow), and the momentum clock of
    `clock(..., momentum=mu)` for heavy ball.

    **Raises:** `ValueError` for a non-positive learning rate, an unknown
    optimizer word or object, a momentum outside `[0, 1)` or a malformed
    batch-size schedule.
    """

    learning_rate: float | Callable = eqx.field(static=True)
    optimizer: Callable | optax.GradientTransformation | None = eqx.field(static=True)
    momentum: float = eqx.field(static=True)
    batch_size: int | tuple[tuple[int, int], ...] | None = eqx.field(static=True)
    name: str = eqx.field(static=True)

    def __init__(
        self,
        learning_rate: float | Callable,
        optimizer: Callable | optax.GradientTransformation | str | None = None,
        momentum: float | None = None,
        batch_size: int | Sequence[tuple[int, int]] | None = None,
        name: str = "",
    ):
        if not callable(learning_rate):
            value = float(learning_rate)
            if not (np.isfinite(value) and value > 0):
                raise ValueError(f"`learning_rate` must be > 0, got {value}.")
        self.learning_rate = learning_rate
        self.optimizer, self.momentum = _resolve_optimizer(optimizer, momentum)
        self.batch_size = _batch_sizes(batch_size)
        _check_batch_sizes(self.batch_size)
        if isinstance(self.optimizer, optax.GradientTransformation) and isinstance(
            self.batch_size, tuple
        ):
            raise ValueError(
                "A batch-size schedule restarts the optimizer at each boundary and "
                "shifts the learning-rate schedule: give `optimizer` as a factory "
                "`learning_rate -> GradientTransformation`, not a ready one."
            )
        self.name = str(name)

    @property
    def label(self) -> str:
        """`name`, or a description of the method."""
        if self.name:
            return self.name
        word = optimizer_word(self.optimizer)
        if word == "gd" and self.batch_size is not None:
            word = "sgd"
        if word is None and isinstance(self.optimizer, optax.GradientTransformation):
            word = "optax transformation"
        elif word is None:
            word = getattr(self.optimizer, "__name__", type(self.optimizer).__name__)
        parts = [word]
        if self.momentum:
            parts.append(f"mu={self.momentum}")
        parts.append(
            "lr=schedule"
            if callable(self.learning_rate)
            else f"lr={self.learning_rate}"
        )
        if self.batch_size is not None:
            parts.append(
                "b=schedule"
                if isinstance(self.batch_size, tuple)
                else f"b={self.batch_size}"
            )
        return " ".join(parts)

    @property
    def clock_momentum(self) -> float:
        """The momentum of the method's clock (0 unless heavy ball)."""
        return float(self.momentum)

    def clock(self, ts: Float[ArrayLike, " T"]) -> Float[Array, " T"]:
        """The flow time `s(ts)` this method is compared on (see the class)."""
        return clock(self.learning_rate, ts, momentum=self.clock_momentum)


def train_method(
    method: Method,
    structure: AbstractStructure,
    xs: Float[ArrayLike, "n ..."],
    ys: Float[ArrayLike, "n k"],
    *,
    num_steps: int,
    W0: Float[ArrayLike, "p m"],
    key: PRNGKeyArray | None = None,
    weight_decay: Float[ArrayLike, ""] = 0.0,
    model: AbstractModel = Layer(),
    record_at: Sequence[int] | None = None,
    num_records: int = 50,
    basis: Float[ArrayLike, "p q"] | None = None,
    snapshots: bool = True,
) -> TrainResult:
    r"""Train `W` from `W0` with a `Method`, through the one training loop
    (`train_segments`).

    A constant batch size is one segment, the same run as `nqfjax.train`. A
    batch-size schedule is one segment per entry (see `Method`): segment `i`
    runs steps `[s_i, s_{i+1})` with batch size `b_i` (at most `n`), from the
    weights the previous segment ended with, with the learning-rate schedule
    evaluated at the global step and the minibatch key
    `split(fold_in(key, i))[1]`; the records are one `TrainResult` whose `steps`
    are global. `jax.vmap` works over `key` (and `W0`), with a batch-size
    schedule too.

    **Arguments:**

    - `method`: the `Method`.
    - `structure`, `xs`, `ys`, `num_steps`, `W0`, `weight_decay`, `model`,
      `record_at`, `num_records`, `basis`, `snapshots`: as in `nqfjax.train`
      (`model` defaults to `Layer()`, as there; pass `QuadraticForm()` for the
      quadratic form, whose gradient flow is the M-space flow).
    - `key`: PRNG key for the minibatches (needed when `batch_size < n`).

    **Returns:** a `TrainResult`.

    **Raises:** `ValueError` for a `method` that is not a `Method`, a `key` that
    is not a PRNG key, and as `nqfjax.train`.
    """
    if not isinstance(method, Method):
        raise ValueError(f"`method` must be a Method, got {type(method)}.")
    model = as_model(model)
    b = method.batch_size
    lr = method.learning_rate  # a ready transformation brings its own
    if isinstance(method.optimizer, optax.GradientTransformation):
        lr = None
    num_steps = static_int("num_steps", num_steps)
    if isinstance(b, tuple):
        key = jr.key(0) if key is None else check_key(key)
        n = jnp.shape(xs)[0]
        bounds = [s for s, _ in b if s < num_steps] + [num_steps]
        segments = [
            # the key of the former per-segment `train(key=fold_in(key, i))` calls
            Segment(
                e - a,
                lr,
                weight_decay,
                min(int(b[i][1]), n),
                key=jr.split(jr.fold_in(key, i))[1],
            )
            for i, (a, e) in enumerate(zip(bounds[:-1], bounds[1:]))
        ]
    else:
        segments = [Segment(num_steps, lr, weight_decay, b)]
    return train_segments(
        structure,
        xs,
        ys,
        segments,
        optimizer=method.optimizer,
        key=key,
        W0=W0,
        model=model,
        record_at=record_at,
        num_records=num_records,
        basis=basis,
        snapshots=snapshots,
    )
