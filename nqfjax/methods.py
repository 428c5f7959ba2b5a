r"""Training methods on `M` (THEORY.md section 6) and delayed generalisation.

Only plain gradient flow is exactly closed in `M`; every other method acts on
the same `M` and is measured against it.

- **The change of clock.** With a learning rate $\eta(t)$ that changes in time
  (an optax schedule), the M-space flow
  $\dot M = -2\eta(t)\,(G M + M G + \lambda M)$ is the constant-rate flow
  ($\eta = 1$) run on the clock $s(t) = \int_0^t \eta$: `clock`,
  `solve_mflow_schedule`, `solve_lv_schedule`, `invert_clock`.
- **Methods.** `Method` describes SGD with a batch size, momentum, Adam,
  learning-rate and batch-size schedules; `train_method` trains it with
  `nqfjax.train`; `compare_methods` reports how far each one's switch-on times
  depart from the gradient flow on its clock (`MethodReport`).
- **Delayed generalisation.** `delayed_generalisation` trains a quadratic
  network on few samples with weight decay (Adam by default) and measures when
  it fits the training set and when the test loss (the closed-form Gaussian
  task's loss at the learned `M`) drops (`DelayResult`); `generalisation_delay`
  measures the two times on given curves; `delay_scaling` fits the delay's
  power law in a hyperparameter.
"""

import functools
from collections.abc import Callable, Mapping, Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
from jaxtyping import Array, ArrayLike, Float, PRNGKeyArray

from ._checks import check_shape, is_concrete
from .lv import LotkaVolterra, lv_reduce, solve_lv
from .mflow import solve_mflow
from .structures.base import Structure
from .tasks import Task, task_from_samples
from .theory import switch_on_times
from .train import TrainResult, log_spaced_steps, train


# --------------------------------------------------------------------------------
# the change of clock


def _check_momentum(momentum) -> float:
    mu = float(momentum)
    if not (np.isfinite(mu) and 0 <= mu < 1):
        raise ValueError(f"`momentum` must be in [0, 1), got {momentum}.")
    return mu


def _rates(learning_rate, steps, mu: float, dtype):
    """The effective rate at (possibly fractional) steps:
    `eta(n) (1 - mu^(n+1)) / (1 - mu)`."""
    steps = jnp.asarray(steps, dtype)
    if callable(learning_rate):
        flat = steps.reshape(-1)
        eta = jax.vmap(lambda n: jnp.asarray(learning_rate(n), dtype))(flat)
        eta = eta.reshape(steps.shape)
    else:
        eta = jnp.broadcast_to(jnp.asarray(learning_rate, dtype), steps.shape)
    if mu == 0:
        return eta
    return eta * (1 - mu ** (steps + 1)) / (1 - mu)


_CHUNK = 16384


def _gauss_legendre(quadrature: int, dtype):
    nodes, weights = np.polynomial.legendre.leggauss(int(quadrature))
    return jnp.asarray(0.5 * (nodes + 1), dtype), jnp.asarray(0.5 * weights, dtype)


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def _increments(learning_rate, mu, discrete, quadrature, start):
    """`s(n + 1) - s(n)` for the `_CHUNK` steps `n = start, start + 1, ...`."""
    dtype = jnp.result_type(float)
    steps = start + jnp.arange(_CHUNK, dtype=dtype)
    if discrete:
        return _rates(learning_rate, steps, mu, dtype)
    nodes, weights = _gauss_legendre(quadrature, dtype)
    return _rates(learning_rate, steps[:, None] + nodes[None, :], mu, dtype) @ weights


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _partial_integral(learning_rate, mu, quadrature, floor, frac):
    """`int_floor^(floor + frac)` of the rate (Gauss-Legendre)."""
    nodes, weights = _gauss_legendre(quadrature, floor.dtype)
    pts = floor[:, None] + frac[:, None] * nodes[None, :]
    return frac * (_rates(learning_rate, pts, mu, floor.dtype) @ weights)


def _cumulative(learning_rate, mu, discrete, quadrature, num_steps, target=None):
    """`s(0), s(1), ..., s(N)` in float64 (NumPy), in chunks of `_CHUNK` steps,
    up to `num_steps`, or until `target` is reached when given."""
    parts, total, start = [np.zeros(1)], 0.0, 0
    while start < num_steps and (target is None or total < target):
        if callable(learning_rate):
            inc = np.asarray(
                _increments(learning_rate, mu, discrete, quadrature, start), np.float64
            )
        else:  # a constant rate in closed form (no compilation per value)
            n = start + np.arange(_CHUNK + 1, dtype=np.float64)
            if mu == 0:
                cum = learning_rate * n
            elif discrete:
                cum = learning_rate / (1 - mu) * (n - mu * (1 - mu**n) / (1 - mu))
            else:
                cum = learning_rate / (1 - mu) * (n - mu * (1 - mu**n) / np.log(1 / mu))
            inc = np.diff(cum)
        if np.any(inc < 0) or not np.all(np.isfinite(inc)):
            raise ValueError(
                "The learning rate must be finite and >= 0: the clock would run "
                f"backwards or diverge between steps {start} and {start + _CHUNK}."
            )
        cum = total + np.cumsum(inc)
        parts.append(cum)
        total, start = float(cum[-1]), start + _CHUNK
    S = np.concatenate(parts)
    return S[: num_steps + 1] if target is None else S


def _static_rate(learning_rate):
    """A learning rate usable as a static (hashable) jit argument."""
    if callable(learning_rate):
        return learning_rate
    eta = float(np.asarray(learning_rate))
    if not (np.isfinite(eta) and eta > 0):
        raise ValueError(f"`learning_rate` must be > 0, got {eta}.")
    return eta


def clock(
    learning_rate: Float[ArrayLike, ""] | Callable,
    ts: Float[ArrayLike, " T"],
    *,
    momentum: float = 0.0,
    discrete: bool = True,
    quadrature: int = 8,
) -> Float[Array, " T"]:
    r"""The flow time $s(t)$ that `t` steps of a learning-rate schedule amount to.

    The M-space flow with a time-dependent rate,
    $\dot M = -2\eta(t)(GM + MG + \lambda M)$, is the flow with $\eta = 1$ at
    $s(t)$, since $dM/ds = \dot M / \eta$ (THEORY.md section 2). Two clocks:

    - `discrete=True` (default): what gradient descent with the optax schedule
      does, step `n` (from 0) taking rate $\eta(n)$ (optax counts from 0):
      $s(N) = \sum_{n < N} \eta(n)$, linear in between, i.e. the integral of the
      step function $\eta(\lfloor t \rfloor)$. The flow on this clock is the limit
      of GD in which each step is split into many substeps of the same rate.
    - `discrete=False`: the integral $s(t) = \int_0^t \eta(u)\,du$ of the
      schedule as a function of continuous time (Gauss-Legendre with
      `quadrature` nodes per unit interval; exact for polynomials of degree
      `2 quadrature - 1` between integers). The flow on this clock is the limit
      of GD with steps `h -> 0` and rates $h\,\eta(j h)$.

    **Momentum.** Heavy-ball momentum `mu` (`optax.sgd(eta, momentum=mu)`:
    $v \leftarrow g + \mu v$, $W \leftarrow W - \eta v$) moves, while the gradient
    changes slowly, by $\eta(n)(1 - \mu^{n+1})/(1 - \mu)$ times the gradient at
    step `n`: that is the rate used, so the clock runs `1/(1 - mu)` times faster
    after a transient of about `1/(1 - mu)` steps. At a constant rate,
    $s(N) = \frac{\eta}{1-\mu}\big(N - \mu\frac{1 - \mu^N}{1 - \mu}\big)$.

    A constant `learning_rate` is handled in closed form and traces (`jit`,
    `vmap`, `grad` in `eta` and `ts`); a schedule is summed in float64 in chunks
    (one compilation per schedule), so `ts` must then be concrete.

    **Arguments:**

    - `learning_rate`: `eta > 0` or an optax schedule `step -> eta`.
    - `ts`: times in steps, shape `(T,)`, `>= 0`.
    - `momentum`: `mu` in `[0, 1)` (default 0).
    - `discrete`: the clock of the optimizer's steps (default) or the integral.
    - `quadrature`: Gauss-Legendre nodes per unit interval (`discrete=False`).

    **Returns:** `s(ts)`, shape `(T,)`.

    **Raises:** `ValueError` for negative or non-finite `ts`, traced `ts` with a
    schedule, a negative or non-finite rate, or `momentum` outside `[0, 1)`.
    """
    mu = _check_momentum(momentum)
    ts = jnp.asarray(ts)
    if ts.ndim != 1:
        raise ValueError(f"`ts` must be a 1-D array of times, got shape {ts.shape}.")
    dtype = jnp.result_type(ts, float)
    ts = ts.astype(dtype)
    if is_concrete(ts):
        tn = np.asarray(ts)
        if tn.size and (not np.all(np.isfinite(tn)) or tn.min() < 0):
            raise ValueError("`ts` must be finite and >= 0.")
    if not callable(learning_rate):
        eta = jnp.asarray(learning_rate, dtype)
        check_shape("learning_rate", eta, ())
        if is_concrete(eta) and not float(eta) > 0:
            raise ValueError(f"`learning_rate` must be > 0, got {float(eta)}.")
        if mu == 0:
            return eta * ts
        scale = eta / (1 - mu)
        if not discrete:
            return scale * (ts - mu * (1 - mu**ts) / np.log(1 / mu))
        floor = jnp.floor(ts)
        at_floor = floor - mu * (1 - mu**floor) / (1 - mu)
        return scale * (at_floor + (ts - floor) * (1 - mu ** (floor + 1)))
    if not is_concrete(ts):
        raise ValueError(
            "`ts` must be concrete (not traced) with a schedule: the number of "
            "steps to sum is read from it."
        )
    tn = np.asarray(ts, np.float64)
    if tn.size == 0:
        return ts
    N = int(np.ceil(tn.max())) + 1
    S = _cumulative(learning_rate, mu, discrete, int(quadrature), N)
    floor = np.minimum(np.floor(tn), N - 1).astype(int)
    frac = tn - floor
    if discrete:
        s = S[floor] + frac * (S[floor + 1] - S[floor])
    else:
        part = _partial_integral(
            learning_rate,
            mu,
            int(quadrature),
            jnp.asarray(floor, jnp.result_type(float)),
            jnp.asarray(frac, jnp.result_type(float)),
        )
        s = S[floor] + np.asarray(part, np.float64)
    return jnp.asarray(s, dtype)


def invert_clock(
    learning_rate: Float[ArrayLike, ""] | Callable,
    s: Float[ArrayLike, " J"],
    *,
    momentum: float = 0.0,
    discrete: bool = True,
    max_steps: int = 10**6,
) -> Float[Array, " J"]:
    r"""The step `t` at which the clock reaches `s` (the inverse of `clock`):
    maps flow times in units of $\eta = 1$ (for example `switch_on_times` of a
    `lv_reduce(task, 1.0)` system) to steps of a schedule. `inf` where the clock
    does not reach `s` within `max_steps` steps (a decaying schedule may never
    get there). Exact for the discrete clock (piecewise linear); for
    `discrete=False` linear between integer steps. Runs eagerly.

    **Arguments:**

    - `learning_rate`, `momentum`, `discrete`: as in `clock`.
    - `s`: flow times, shape `(J,)` (`inf`/NaN pass through).
    - `max_steps`: the horizon searched (default `10**6`).

    **Returns:** `t(s)`, shape `(J,)`.
    """
    mu = _check_momentum(momentum)
    s = np.asarray(s, np.float64)
    if s.ndim != 1:
        raise ValueError(f"`s` must be 1-D, got shape {s.shape}.")
    finite = np.isfinite(s)
    target = float(np.max(s[finite])) if np.any(finite) else 0.0
    S = _cumulative(
        _static_rate(learning_rate), mu, discrete, 8, int(max_steps), target=target
    )
    S = S[: int(max_steps) + 1]
    out = np.full(s.shape, np.inf)
    ok = finite & (s <= S[-1])
    # S is non-decreasing: the first step at which it reaches s, interpolated
    idx = np.clip(np.searchsorted(S, s[ok], side="left"), 1, len(S) - 1)
    s0, s1 = S[idx - 1], S[idx]
    frac = np.where(s1 > s0, (s[ok] - s0) / np.where(s1 > s0, s1 - s0, 1.0), 0.0)
    out[ok] = np.where(s[ok] <= 0, 0.0, idx - 1 + frac)
    out[np.isnan(s)] = np.nan
    return jnp.asarray(out, jnp.result_type(float))


def _solve_on_clock(solve, s):
    """Solve at the distinct clock values `s` (a schedule may pause the clock)
    and map back (traced `s`, from a constant rate, is solved as it is)."""
    if not is_concrete(s):
        return solve(s)
    unique, inverse = np.unique(np.asarray(s), return_inverse=True)
    if unique.shape == s.shape:
        return solve(s)
    return solve(jnp.asarray(unique, s.dtype))[jnp.asarray(inverse.reshape(-1))]


def solve_mflow_schedule(
    task: Task,
    M0: Float[ArrayLike, "p p"],
    ts: Float[ArrayLike, " T"],
    learning_rate: Float[ArrayLike, ""] | Callable,
    weight_decay: Float[ArrayLike, ""] = 0.0,
    *,
    momentum: float = 0.0,
    discrete: bool = True,
    **solve_options,
) -> Float[Array, "T p p"]:
    r"""The M-space flow under a learning-rate schedule: `M(ts)` in steps.

    $$\frac{dM}{dt} = -2\eta(t)\,(G M + M G) - 2\eta(t)\lambda M
    \quad\Longleftrightarrow\quad M(t) = M_{\eta=1}\big(s(t)\big),\quad
    s(t) = \int_0^t \eta,$$

    so this is `solve_mflow(task, M0, clock(learning_rate, ts), 1.0,
    weight_decay)`: no change to the integrator, and the tolerances act on the
    same trajectory whatever the schedule. Clock values that repeat (a rate of
    zero) are solved once.

    **Arguments:**

    - `task`, `M0`, `weight_decay`: as in `solve_mflow`.
    - `ts`: output times in steps, shape `(T,)`, increasing, concrete.
    - `learning_rate`: `eta > 0` or an optax schedule.
    - `momentum`, `discrete`: the clock (see `clock`).
    - `**solve_options`: passed to `solve_mflow` (`rtol`, `atol`, `solver`, ...).

    **Returns:** `M(ts)`, shape `(T, p, p)`.
    """
    s = clock(learning_rate, ts, momentum=momentum, discrete=discrete)
    return _solve_on_clock(
        lambda su: solve_mflow(task, M0, su, 1.0, weight_decay, **solve_options), s
    )


def solve_lv_schedule(
    lv_unit: LotkaVolterra,
    m0: Float[ArrayLike, " p"],
    ts: Float[ArrayLike, " T"],
    learning_rate: Float[ArrayLike, ""] | Callable,
    *,
    momentum: float = 0.0,
    discrete: bool = True,
    **solve_options,
) -> Float[Array, "T p"]:
    r"""The Lotka-Volterra reduction under a learning-rate schedule: `m(ts)`.

    `lv_unit` must be the reduction at unit learning rate,
    `lv_reduce(task, 1.0, weight_decay)` (its `r`, `B` and `decay` are then per
    unit of flow time $s$); this is `solve_lv(lv_unit, m0, clock(learning_rate,
    ts))`.

    **Arguments:**

    - `lv_unit`: the system at `eta = 1`.
    - `m0`: initial mode values, shape `(p,)`, positive.
    - `ts`, `learning_rate`, `momentum`, `discrete`: as in `solve_mflow_schedule`.
    - `**solve_options`: passed to `solve_lv`.

    **Returns:** `m(ts)`, shape `(T, p)`.
    """
    s = clock(learning_rate, ts, momentum=momentum, discrete=discrete)
    return _solve_on_clock(lambda su: solve_lv(lv_unit, m0, su, **solve_options), s)


# --------------------------------------------------------------------------------
# training methods


_OPTIMIZERS = ("sgd", "momentum", "adam")


@functools.cache
def _momentum_factory(mu: float):
    # cached: `train` compiles once per optimizer factory (compared by identity)
    return lambda lr: optax.sgd(lr, momentum=mu)


@functools.cache
def _shifted(schedule, offset: int):
    return lambda n: schedule(n + offset)


def _batch_sizes(b):
    """Batch-size schedules as hashable tuples of `(start, size)` ints."""
    if b is None or isinstance(b, (int, np.integer)):
        return b
    return tuple((int(start), int(size)) for start, size in b)


class Method(eqx.Module):
    r"""A training method acting on `M = W W^T` (configuration only; all static).

    **Fields:**

    - `learning_rate`: `eta > 0`, or an optax schedule `step -> eta`.
    - `optimizer`: `"sgd"` (plain steps; gradient descent when full batch),
      `"momentum"` (heavy ball, `optax.sgd(eta, momentum=mu)`) or `"adam"`
      (`optax.adam(eta)`).
    - `momentum`: `mu` in `[0, 1)` for `"momentum"` (default 0.9).
    - `batch_size`: `None` (full batch), an int `b`, or a batch-size schedule
      `((0, b_0), (s_1, b_1), ...)`: batch size `b_i` from step `s_i` on
      (starts strictly increasing, from 0). A schedule is trained as a loop of
      `nqfjax.train` segments, each continuing from the last weights, with the
      learning-rate schedule shifted to the global step and fresh minibatch
      keys; the optimizer state (momentum, Adam's moments) restarts at each
      boundary, exactly right for plain SGD.
    - `name`: a label (default: built from the fields).

    The clock on which the method is compared with gradient flow
    (`Method.clock`): $\sum_n \eta(n)$ for SGD/GD and Adam (for Adam a nominal
    clock: its steps are normalised per coordinate, not proportional to the
    gradient, so no clock makes it the M-space flow), and the momentum clock of
    `clock(..., momentum=mu)` for `"momentum"`.
    """

    learning_rate: float | Callable = eqx.field(static=True)
    optimizer: str = eqx.field(static=True, default="sgd")
    momentum: float = eqx.field(static=True, default=0.9)
    batch_size: int | tuple[tuple[int, int], ...] | None = eqx.field(
        static=True, default=None, converter=_batch_sizes
    )
    name: str = eqx.field(static=True, default="")

    def __check_init__(self):
        if self.optimizer not in _OPTIMIZERS:
            raise ValueError(
                f"`optimizer` must be one of {_OPTIMIZERS}, got {self.optimizer!r}."
            )
        if not callable(self.learning_rate):
            eta = float(self.learning_rate)
            if not (np.isfinite(eta) and eta > 0):
                raise ValueError(f"`learning_rate` must be > 0, got {eta}.")
        if self.optimizer == "momentum":
            _check_momentum(self.momentum)
        b = self.batch_size
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

    @property
    def label(self) -> str:
        """`name`, or a description of the method."""
        if self.name:
            return self.name
        parts = [self.optimizer]
        if self.optimizer == "momentum":
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
        """The momentum of the method's clock (0 unless `"momentum"`)."""
        return float(self.momentum) if self.optimizer == "momentum" else 0.0

    def clock(self, ts: Float[ArrayLike, " T"]) -> Float[Array, " T"]:
        """The flow time `s(ts)` this method is compared on (see the class)."""
        return clock(self.learning_rate, ts, momentum=self.clock_momentum)

    def _optax(self):
        if self.optimizer == "sgd":
            return None
        if self.optimizer == "momentum":
            return _momentum_factory(float(self.momentum))
        return optax.adam


def train_method(
    method: Method,
    structure: Structure,
    xs: Float[ArrayLike, "n ..."],
    ys: Float[ArrayLike, "n k"],
    *,
    num_steps: int,
    W0: Float[ArrayLike, "p m"],
    key: PRNGKeyArray | None = None,
    weight_decay: Float[ArrayLike, ""] = 0.0,
    model: str = "quadratic",
    record_at: Sequence[int] | None = None,
    num_records: int = 50,
    basis: Float[ArrayLike, "p q"] | None = None,
    snapshots: bool = True,
) -> TrainResult:
    r"""Train `W` from `W0` with a `Method` through `nqfjax.train`.

    A constant batch size is one `train` call. A batch-size schedule is a loop
    of `train` segments (see `Method`): segment `i` runs steps
    `[s_i, s_{i+1})` with batch size `b_i`, from the weights the previous segment
    ended with, with the learning-rate schedule evaluated at the global step
    and minibatch key `fold_in(key, i)`; the records are stitched into one
    `TrainResult` whose `steps` are global. `jax.vmap` works over `key` (and
    `W0`), with a batch-size schedule too (one compilation per segment length
    and batch size).

    **Arguments:**

    - `method`: the `Method`.
    - `structure`, `xs`, `ys`, `num_steps`, `W0`, `weight_decay`, `model`,
      `record_at`, `num_records`, `basis`, `snapshots`: as in `nqfjax.train`
      (`model` defaults to `"quadratic"` here).
    - `key`: PRNG key for the minibatches (needed when `batch_size < n`).

    **Returns:** a `TrainResult`.
    """
    if not isinstance(method, Method):
        raise ValueError(f"`method` must be a Method, got {type(method)}.")
    kw = dict(
        optimizer=method._optax(),
        W0=W0,
        weight_decay=weight_decay,
        model=model,
        basis=basis,
        snapshots=snapshots,
    )
    b = method.batch_size
    if not isinstance(b, tuple):
        return train(
            structure,
            xs,
            ys,
            num_steps=num_steps,
            learning_rate=method.learning_rate,
            key=key,
            batch_size=b,
            record_at=record_at,
            num_records=num_records,
            **kw,
        )
    num_steps = int(num_steps)
    n = jnp.shape(xs)[0]
    record = (
        log_spaced_steps(num_steps, num_records)
        if record_at is None
        else tuple(int(s) for s in record_at)
    )
    bounds = [s for s, _ in b if s < num_steps] + [num_steps]
    if key is None:
        key = jr.key(0)
    pieces, W = [], jnp.asarray(W0)
    for i, (a, e) in enumerate(zip(bounds[:-1], bounds[1:])):
        size = min(int(b[i][1]), n)
        last = e == num_steps
        local = sorted({0} | {s - a for s in record if a <= s < e or (last and s == e)})
        lr = method.learning_rate
        if callable(lr) and a:
            lr = _shifted(lr, a)
        res = train(
            structure,
            xs,
            ys,
            num_steps=e - a,
            learning_rate=lr,
            key=jr.fold_in(key, i),
            batch_size=size,
            record_at=local,
            **{**kw, "W0": W},
        )
        keep = np.flatnonzero([a + s in record for s in local])
        pieces.append((np.asarray(local)[keep] + a, res, keep))
        W = res.W

    def cat(name):
        # integer indices (not boolean masks), so that this also runs under vmap
        return jnp.concatenate([getattr(r, name)[jnp.asarray(k)] for _, r, k in pieces])

    steps = np.concatenate([s for s, _, _ in pieces])
    return TrainResult(
        steps=jnp.asarray(steps, jnp.int32),
        loss=cat("loss"),
        M=None if pieces[0][1].M is None else cat("M"),
        m=None if pieces[0][1].m is None else cat("m"),
        W=W,
    )


class MethodReport(eqx.Module):
    r"""How far a method's switch-on times depart from gradient flow
    (`compare_methods`). Modes are the columns of the basis; `q` of them.

    **Fields:**

    - `name`: the method's label.
    - `ts`: recorded steps, shape `(R,)`.
    - `clock`: the method's flow time `s(ts)` (`Method.clock`), shape `(R,)`.
    - `m`: the mode amplitudes $u_k^\top M u_k$ of the trained network, averaged
      over seeds, shape `(R, q)`; `loss`: its training loss, averaged, `(R,)`.
    - `flow_m`, `flow_loss`: the gradient flow from the same `M0` on the same
      clock (`solve_mflow`), shapes `(R, q)` and `(R,)`.
    - `switch_times`: each mode's switch-on time in the trained network, the
      first time $m_k$ reaches `level` times the peak of the flow's $m_k$
      (log-linear interpolation between records), averaged over seeds, shape
      `(q,)`; NaN for modes that do not switch on (and settle) in the flow.
    - `switch_times_se`: their standard error over seeds (0 for one seed).
    - `flow_switch_times`: the same measurement on the flow, shape `(q,)`.
    - `theory_switch_times`: `switch_on_times` of the Lotka-Volterra reduction
      from the diagonal of `M0`, mapped to steps through the clock
      (`invert_clock`), shape `(q,)`.
    - `departure`: `switch_times / flow_switch_times - 1`, shape `(q,)`: the
      method's delay (> 0) or advance (< 0) relative to gradient flow on its
      clock, averaged over seeds.
    - `departure_rms`: the root-mean-square over seeds of each run's
      `t / t_flow - 1`, shape `(q,)`: how far one run departs (for SGD mostly
      the seed-to-seed spread; equal to `|departure|` for one seed).
    - `ratio_departure`: the same for the ratios to the first mode's time,
      $(t_k / t_{k_0}) / (t^{\rm flow}_k / t^{\rm flow}_{k_0}) - 1$, shape `(q,)`:
      independent of the clock (a method that only rescales time has 0 here).
    - `seeds`: the number of seeds averaged.
    """

    name: str = eqx.field(static=True)
    ts: Float[Array, " R"]
    clock: Float[Array, " R"]
    m: Float[Array, "R q"]
    loss: Float[Array, " R"]
    flow_m: Float[Array, "R q"]
    flow_loss: Float[Array, " R"]
    switch_times: Float[Array, " q"]
    switch_times_se: Float[Array, " q"]
    flow_switch_times: Float[Array, " q"]
    theory_switch_times: Float[Array, " q"]
    departure: Float[Array, " q"]
    departure_rms: Float[Array, " q"]
    ratio_departure: Float[Array, " q"]
    seeds: int = eqx.field(static=True)

    @property
    def max_departure(self) -> float:
        """The largest `|departure|` over the modes that switch on."""
        return float(np.nanmax(np.abs(np.asarray(self.departure))))


def switch_times_from_curves(
    ts: Float[ArrayLike, " R"],
    m: Float[ArrayLike, "R q"],
    level: float = 0.5,
    peak: Float[ArrayLike, " q"] | None = None,
) -> Float[Array, " q"]:
    """For each column of `m`, the first time it reaches `level` times its peak
    value (its own largest value, or `peak` when given), interpolated
    log-linearly between records: the half-way time of a logistic rise for
    `level = 0.5`. NaN where it never gets there, or is there from `ts[0]`.
    Runs eagerly.

    **Arguments:**

    - `ts`: times, shape `(R,)`, increasing.
    - `m`: positive curves, shape `(R, q)`.
    - `level`: in `(0, 1)`.
    - `peak`: optional reference values, shape `(q,)`.

    **Returns:** shape `(q,)`.
    """
    ts = np.asarray(ts, np.float64)
    m = np.asarray(m, np.float64)
    if m.ndim != 2 or m.shape[0] != ts.shape[0]:
        raise ValueError(f"`m` must have shape (R, q) with R = {ts.shape[0]}.")
    if not 0 < level < 1:
        raise ValueError(f"`level` must be in (0, 1), got {level}.")
    peak = (
        m.max(0)
        if peak is None
        else np.broadcast_to(np.asarray(peak, float), m.shape[1:])
    )
    out = np.full(m.shape[1], np.nan)
    for k in range(m.shape[1]):
        col = m[:, k]
        target = level * peak[k]
        if not (np.all(np.isfinite(col)) and np.isfinite(target)):
            continue
        reached = col >= target
        i = int(np.argmax(reached))
        if i == 0:
            continue
        a, b = col[i - 1], col[i]
        if a > 0 and b > 0:
            a, b, target = np.log(a), np.log(b), np.log(target)
        out[k] = ts[i - 1] + (ts[i] - ts[i - 1]) * (target - a) / (b - a)
    return jnp.asarray(out)


def compare_methods(
    methods: Sequence[Method] | Mapping[str, Method],
    structure: Structure,
    xs: Float[ArrayLike, "n ..."],
    ys: Float[ArrayLike, "n k"],
    *,
    num_steps: int,
    W0: Float[ArrayLike, "p m"],
    weight_decay: float = 0.0,
    key: PRNGKeyArray | None = None,
    seeds: int = 1,
    model: str = "quadratic",
    record_at: Sequence[int] | None = None,
    basis: Float[ArrayLike, "p q"] | None = None,
    level: float = 0.5,
    min_growth: float = 100.0,
    reference: str = "mflow",
    solve_options: Mapping | None = None,
) -> dict[str, MethodReport]:
    r"""Train each method and measure how far its switch-on times depart from the
    gradient-flow prediction on its clock.

    For each method: the network is trained from `W0` (`train_method`, `seeds`
    minibatch keys for stochastic methods, vmapped), recording the mode
    amplitudes $m_k = u_k^\top M u_k$ in `basis` (default: the Lotka-Volterra
    basis of `lv_reduce(task_from_samples(structure, xs, ys), 1.0)`); the
    M-space flow from $M_0 = W_0 W_0^\top$ is run on the method's clock
    (`solve_mflow_schedule`: exact gradient flow for any `W0`, aligned or not).
    The switch-on time of a mode is the first time it reaches `level` times the
    peak of its flow curve, measured the same way on both
    (`switch_times_from_curves`); modes that grow less than `min_growth` times
    in the flow, or are still growing at the end of the run (more than 5% over
    its last tenth), are not counted as switched on and get NaN. What to expect
    (THEORY.md sections 2 and 6):

    - full-batch GD: a mode's `W` component grows by $1 + a$ per step with
      $a = r/2$ (`r` per step), so $\ln m$ gains $2\ln(1 + a) = r - r^2/4$
      instead of `r`: GD lags the flow by a relative $\approx r/4$, small and
      positive (measured 0.8-0.9 of it at the half-way point, which includes
      the saturation);
    - SGD with batch `b`: unbiased gradients with covariance
      $\propto f(b) = (n - b)/(b(n - 1))$; the switch-on times scatter around
      GD's by $\propto \sqrt{f(b)}$ (`departure_rms`), small and shrinking as
      `b` grows, and their mean stays at GD's;
    - heavy-ball momentum `mu`: on the momentum clock the growth factor per
      step is the root $z$ of $z^2 - (1 + \mu + a(1-\mu))z + \mu = 0$ (`a` at
      the effective rate), $\ln z = a - a^2(\tfrac12 + \tfrac{\mu}{1-\mu})$: a lag
      of $r/4 + \tfrac r2 \tfrac{\mu}{1-\mu}$;
    - Adam: each coordinate's step is normalised, so every mode grows at
      $\approx$ lr per step whatever its `r_k`: on its nominal clock the
      switch-on times depart by O(1), and so do their ratios (which depend on
      how the modes sit in the coordinates: Adam is not rotation-equivariant);
    - learning-rate schedules: the flow on the schedule's clock (`clock`), up
      to GD's discretisation at the current rate; batch-size schedules: SGD
      segment by segment.

    **The reference.** `reference="mflow"` (default) integrates
    `solve_mflow_schedule` from $M_0$ (exact for any `W0`; its default
    implicit solver compiles slowly, pass e.g.
    `solve_options=dict(solver=diffrax.Tsit5())` for small problems);
    `reference="lv"` integrates `solve_lv_schedule` from the diagonal of $M_0$
    in the Lotka-Volterra basis, exact when `W0` is aligned with the modes
    (then `basis` must not be given) and much cheaper.

    **Arguments:**

    - `methods`: a sequence of `Method`s (keyed by their `label`) or a dict.
    - `structure`, `xs`, `ys`: the architecture and data.
    - `num_steps`: steps per run.
    - `W0`: the initial weights, shape `(p, m)`.
    - `weight_decay`: `lambda >= 0`.
    - `key`: PRNG key for the minibatches (default `key(0)`).
    - `seeds`: minibatch seeds averaged for methods with a batch size (default 1).
    - `model`: `"quadratic"` (default) or `"layer"`.
    - `record_at`: the recorded steps (default 401 evenly spaced).
    - `basis`: the modes, shape `(p, q)`, orthonormal columns.
    - `level`: the fraction of a mode's peak that defines its switch-on.
    - `min_growth`: growth factor in the flow below which a mode is off.
    - `reference`: `"mflow"` or `"lv"` (see above).
    - `solve_options`: passed to `solve_mflow` or `solve_lv` (e.g. tolerances).

    **Returns:** a dict `label -> MethodReport`.

    **Raises:** `ValueError` for a task that does not reduce when no `basis` is
    given (`NotReducibleError`), or bad arguments.
    """
    if isinstance(methods, Mapping):
        items = list(methods.items())
    else:
        items = [(mth.label, mth) for mth in methods]
    for label, mth in items:
        if not isinstance(mth, Method):
            raise ValueError(f"`methods[{label!r}]` must be a Method, got {type(mth)}.")
    if seeds < 1:
        raise ValueError(f"`seeds` must be >= 1, got {seeds}.")
    if reference not in ("mflow", "lv"):
        raise ValueError(f'`reference` must be "mflow" or "lv", got {reference!r}.')
    if reference == "lv" and basis is not None:
        raise ValueError(
            '`reference="lv"` uses the basis of `lv_reduce`: omit `basis`.'
        )
    num_steps = int(num_steps)
    record = (
        np.unique(np.linspace(0, num_steps, 401).astype(int))
        if record_at is None
        else np.asarray(record_at, int)
    )
    W0 = jnp.asarray(W0)
    task = task_from_samples(structure, xs, ys)
    lv_unit, lv_basis = (
        lv_reduce(task, 1.0, weight_decay) if basis is None else (None, None)
    )
    if basis is None:
        basis = lv_basis
    basis = jnp.asarray(basis, W0.dtype)
    M0 = W0 @ W0.T
    m0 = np.asarray(jnp.diag(basis.T @ M0 @ basis))
    s_theory = None
    if lv_unit is not None:
        s_theory = np.asarray(switch_on_times(lv_unit, np.maximum(m0, 1e-300)))
    key = jr.key(0) if key is None else key
    ts = jnp.asarray(record, W0.dtype)
    opts = dict(solve_options or {})

    reports = {}
    for label, mth in items:
        stochastic = mth.batch_size is not None
        n_seeds = seeds if stochastic else 1
        run = lambda k, mth=mth: train_method(
            mth,
            structure,
            xs,
            ys,
            num_steps=num_steps,
            W0=W0,
            key=k,
            weight_decay=weight_decay,
            model=model,
            record_at=record,
            basis=basis,
        )
        keys = jr.split(key, n_seeds)
        if n_seeds > 1:
            res = jax.vmap(run)(keys)
            m_runs, loss_runs = np.asarray(res.m), np.asarray(res.loss)
        else:
            outs = [run(k) for k in keys]
            m_runs = np.stack([np.asarray(o.m) for o in outs])
            loss_runs = np.stack([np.asarray(o.loss) for o in outs])

        if reference == "mflow":
            M_flow = solve_mflow_schedule(
                task,
                M0,
                ts,
                mth.learning_rate,
                weight_decay,
                momentum=mth.clock_momentum,
                **opts,
            )
            flow_m = np.asarray(jnp.einsum("pk,tpq,qk->tk", basis, M_flow, basis))
            flow_loss = np.asarray(jax.vmap(task.loss)(M_flow))
        else:
            flow_m = np.asarray(
                solve_lv_schedule(
                    lv_unit,
                    np.maximum(m0, np.finfo(m0.dtype).tiny),
                    ts,
                    mth.learning_rate,
                    momentum=mth.clock_momentum,
                    **opts,
                )
            )
            flow_loss = np.asarray(lv_unit.loss(jnp.asarray(flow_m)))
        # a mode is on if it grew `min_growth`-fold and had settled by the end
        # (over the last tenth of the run it grew by less than 5%), so that its
        # peak is its plateau value and not where the run happened to stop
        peak = flow_m.max(0)
        i90 = int(np.searchsorted(record, 0.9 * record[-1]))
        settled = flow_m[-1] <= 1.05 * flow_m[min(i90, len(record) - 1)]
        on = (peak >= min_growth * np.maximum(m0, np.finfo(float).tiny)) & settled
        t_flow = np.where(
            on,
            np.asarray(switch_times_from_curves(record, flow_m, level, peak)),
            np.nan,
        )
        t_runs = np.stack(
            [
                np.asarray(switch_times_from_curves(record, mr, level, peak))
                for mr in m_runs
            ]
        )
        t_runs = np.where(on[None], t_runs, np.nan)
        t_mean = t_runs.mean(0)
        t_se = (
            t_runs.std(0, ddof=1) / np.sqrt(n_seeds)
            if n_seeds > 1
            else np.zeros_like(t_mean)
        )
        if s_theory is not None:
            t_theory = np.asarray(
                invert_clock(mth.learning_rate, s_theory, momentum=mth.clock_momentum)
            )
        else:
            t_theory = np.full(t_mean.shape, np.nan)
        k0 = int(np.nanargmin(t_flow)) if np.any(on) else 0
        reports[label] = MethodReport(
            name=label,
            ts=ts,
            clock=mth.clock(ts),
            m=jnp.asarray(m_runs.mean(0)),
            loss=jnp.asarray(loss_runs.mean(0)),
            flow_m=jnp.asarray(flow_m),
            flow_loss=jnp.asarray(flow_loss),
            switch_times=jnp.asarray(t_mean),
            switch_times_se=jnp.asarray(t_se),
            flow_switch_times=jnp.asarray(t_flow),
            theory_switch_times=jnp.asarray(t_theory),
            departure=jnp.asarray(t_mean / t_flow - 1),
            departure_rms=jnp.asarray(np.sqrt(np.mean((t_runs / t_flow - 1) ** 2, 0))),
            ratio_departure=jnp.asarray(
                (t_mean / t_mean[k0]) / (t_flow / t_flow[k0]) - 1
            ),
            seeds=n_seeds,
        )
    return reports


# --------------------------------------------------------------------------------
# delayed generalisation


def _first_below(ts, y, level):
    """First time the curve `y(ts)` is below `level`, interpolating `log y`
    linearly in `log t` between records (linearly in `t` from `t = 0`); NaN if
    it never is. Traceable."""
    below = y < level
    i = jnp.argmax(below)
    found = below[i]
    i0 = jnp.maximum(i - 1, 0)
    t0, t1 = ts[i0], ts[i]
    tiny = jnp.finfo(y.dtype).tiny
    ly0, ly1 = jnp.log(jnp.maximum(y[i0], tiny)), jnp.log(jnp.maximum(y[i], tiny))
    frac = jnp.where(ly1 < ly0, (ly0 - jnp.log(level)) / (ly0 - ly1), 1.0)
    frac = jnp.clip(frac, 0.0, 1.0)
    log_ok = t0 > 0
    lt0, lt1 = jnp.log(jnp.where(log_ok, t0, 1.0)), jnp.log(jnp.where(log_ok, t1, 1.0))
    t = jnp.where(log_ok, jnp.exp(lt0 + frac * (lt1 - lt0)), t0 + frac * (t1 - t0))
    t = jnp.where(i == 0, ts[0], t)
    return jnp.where(found, t, jnp.nan)


def generalisation_delay(
    ts: Float[ArrayLike, " R"],
    train_loss: Float[ArrayLike, " R"],
    test_loss: Float[ArrayLike, " R"],
    fit_level: Float[ArrayLike, ""],
    test_level: Float[ArrayLike, ""],
) -> tuple[Float[Array, ""], Float[Array, ""], Float[Array, ""]]:
    r"""When a run fits its training data, when it generalises, and the delay.

    `t_fit` is the first time `train_loss < fit_level` and `t_generalise` the
    first time `test_loss < test_level` (interpolating $\log L$ linearly in
    $\log t$ between records); `delay = t_generalise - t_fit`. NaN when a level
    is never reached. Traceable (`jit`/`vmap`).

    **Arguments:**

    - `ts`: record times, shape `(R,)`, increasing, `>= 0`.
    - `train_loss`, `test_loss`: the curves, shape `(R,)`.
    - `fit_level`, `test_level`: the two thresholds.

    **Returns:** `(t_fit, t_generalise, delay)`, scalars.
    """
    ts, train_loss, test_loss = (jnp.asarray(a) for a in (ts, train_loss, test_loss))
    check_shape("train_loss", train_loss, ts.shape)
    check_shape("test_loss", test_loss, ts.shape)
    t_fit = _first_below(ts, train_loss, jnp.asarray(fit_level, train_loss.dtype))
    t_gen = _first_below(ts, test_loss, jnp.asarray(test_level, test_loss.dtype))
    return t_fit, t_gen, t_gen - t_fit


class DelayResult(eqx.Module):
    r"""A delayed-generalisation run (`delayed_generalisation`).

    **Fields:**

    - `ts`: recorded steps, shape `(R,)`.
    - `train_loss`: the training loss (without the penalty), shape `(R,)`.
    - `test_loss`: the test loss, `test_task.loss(M)` at the recorded `M`,
      shape `(R,)`.
    - `fit_level`, `test_level`: the absolute thresholds used.
    - `t_fit`: first time `train_loss < fit_level`.
    - `t_generalise`: first time `test_loss < test_level`.
    - `delay`: `t_generalise - t_fit` (NaN if either is never reached).
    """

    ts: Float[Array, " R"]
    train_loss: Float[Array, " R"]
    test_loss: Float[Array, " R"]
    fit_level: Float[Array, ""]
    test_level: Float[Array, ""]
    t_fit: Float[Array, ""]
    t_generalise: Float[Array, ""]
    delay: Float[Array, ""]


def delayed_generalisation(
    structure: Structure,
    xs: Float[ArrayLike, "n ..."],
    ys: Float[ArrayLike, "n k"],
    test_task: Task,
    *,
    weight_decay: Float[ArrayLike, ""],
    learning_rate: Float[ArrayLike, ""],
    num_steps: int,
    key: PRNGKeyArray,
    init_scale: Float[ArrayLike, ""],
    width: int,
    optimizer: Callable | None = optax.adam,
    fit_threshold: float = 1e-3,
    test_threshold: float = 1e-2,
    num_records: int = 200,
) -> DelayResult:
    r"""Train on few samples with weight decay and measure how long after fitting
    the training data the network generalises.

    The network (the quadratic form of `structure`, `model="quadratic"`) is
    trained from $W_0 = \sigma Z$ with `optimizer(learning_rate)` (Adam by
    default) on the L2-penalised objective
    $\frac1{2n}\sum_s |f(x_s) - y_s|^2 + \frac\lambda2 |W|^2$ (`nqfjax.train`).
    With fewer samples than parameters many `M` fit the data; the first one
    reached fits but does not generalise, and the penalty ($|W|^2 = \mathrm{Tr}
    M$) then moves the network slowly along the set of fits towards small trace
    (THEORY.md section 6), so the test loss drops long after the training loss
    did, later the smaller $\lambda$ is. The test loss is the population loss
    `test_task.loss(M)` (for Gaussian inputs the closed form
    `gaussian_quadratic_task(cov, M_star)`). Thresholds are relative to the
    loss at `M = 0`: fitted when the training loss is below `fit_threshold`
    times $\tfrac1{2n}\sum_s |y_s|^2$, generalised when the test loss is below
    `test_threshold` times `test_task.y2 / 2`.

    Traceable in `weight_decay`, `learning_rate`, `init_scale` and `key`, so
    `jax.vmap` and `nqfjax.sweep` map it over grids (the number of samples
    fixes shapes: one sweep per `n`).

    **Arguments:**

    - `structure`: the architecture (e.g. `QuadraticNet(d)`).
    - `xs`, `ys`: the training samples, shapes `(n, *input_shape)`, `(n, k)`.
    - `test_task`: a `Task` whose `loss(M)` is the test error.
    - `weight_decay`: $\lambda \ge 0$.
    - `learning_rate`: the optimizer's learning rate.
    - `num_steps`: steps (static).
    - `key`, `init_scale`, `width`: the random start $\sigma Z$, `Z` of shape
      `(p, width)`.
    - `optimizer`: an optax factory `lr -> GradientTransformation` (default
      `optax.adam`), or `None` for gradient descent.
    - `fit_threshold`, `test_threshold`: relative thresholds (defaults 1e-3, 1e-2).
    - `num_records`: about how many log-spaced records (default 200).

    **Returns:** a `DelayResult`.

    **Raises:** `ValueError` if `test_task.p != structure.p` (and as `train`).
    """
    if not isinstance(test_task, Task):
        raise ValueError(f"`test_task` must be a Task, got {type(test_task)}.")
    if test_task.p != structure.p:
        raise ValueError(
            f"`test_task.p` ({test_task.p}) must equal `structure.p` ({structure.p})."
        )
    res = train(
        structure,
        xs,
        ys,
        num_steps=num_steps,
        learning_rate=learning_rate,
        optimizer=optimizer,
        key=key,
        init_scale=init_scale,
        width=width,
        weight_decay=weight_decay,
        model="quadratic",
        num_records=num_records,
    )
    ys = jnp.asarray(ys, res.loss.dtype)
    test_loss = jax.vmap(test_task.loss)(res.M.astype(test_task.dtype))
    fit_level = fit_threshold * 0.5 * jnp.mean(jnp.sum(ys**2, axis=-1))
    test_level = test_threshold * 0.5 * test_task.y2
    t_fit, t_gen, delay = generalisation_delay(
        res.ts, res.loss, test_loss, fit_level, test_level
    )
    return DelayResult(
        ts=res.ts,
        train_loss=res.loss,
        test_loss=test_loss,
        fit_level=fit_level,
        test_level=test_level,
        t_fit=t_fit,
        t_generalise=t_gen,
        delay=delay,
    )


class DelayScaling(eqx.Module):
    r"""A power law `delay ~ c x^slope` fitted in log-log (`delay_scaling`).

    **Fields:** `slope` and its standard error `slope_err`, the prefactor `c`,
    and `n_points` used (finite, positive delays).
    """

    slope: Float[Array, ""]
    slope_err: Float[Array, ""]
    c: Float[Array, ""]
    n_points: int = eqx.field(static=True)

    def __call__(self, x: Float[ArrayLike, "*N"]) -> Float[Array, "*N"]:
        return self.c * jnp.asarray(x) ** self.slope


def delay_scaling(
    x: Float[ArrayLike, " N"], delay: Float[ArrayLike, " N"]
) -> DelayScaling:
    r"""Least-squares line through $(\ln x, \ln \text{delay})$: the exponent of
    `delay ~ c x^slope` with its standard error (from the residual scatter; 0
    with two points). Points with a non-finite or non-positive delay are left
    out. For the fit of a full curve with an offset and a floor, use
    `fit_power_law(x, delay)` (which fits `L_inf + c (x + x0)^-gamma`, so
    `gamma ~ -slope`). Runs eagerly.

    **Arguments:**

    - `x`: the hyperparameter values, shape `(N,)`, positive.
    - `delay`: the delays, shape `(N,)`.

    **Returns:** a `DelayScaling`.

    **Raises:** `ValueError` for fewer than two usable points or bad shapes.
    """
    x = np.asarray(x, np.float64)
    y = np.asarray(delay, np.float64)
    if x.ndim != 1 or y.shape != x.shape:
        raise ValueError(
            f"`x` and `delay` must be 1-D of equal length, got {x.shape}, {y.shape}."
        )
    ok = np.isfinite(x) & (x > 0) & np.isfinite(y) & (y > 0)
    if ok.sum() < 2:
        raise ValueError("Need at least two points with x > 0 and a finite delay > 0.")
    lx, ly = np.log(x[ok]), np.log(y[ok])
    A = np.stack([lx, np.ones_like(lx)], 1)
    coef, *_ = np.linalg.lstsq(A, ly, rcond=None)
    resid = ly - A @ coef
    dof = ok.sum() - 2
    if dof > 0:
        s2 = np.sum(resid**2) / dof
        err = np.sqrt(s2 / np.sum((lx - lx.mean()) ** 2))
    else:
        err = 0.0
    return DelayScaling(
        slope=jnp.asarray(coef[0]),
        slope_err=jnp.asarray(err),
        c=jnp.asarray(np.exp(coef[1])),
        n_points=int(ok.sum()),
    )
