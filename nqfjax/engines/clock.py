r"""Learning-rate schedules as a change of clock.

With a learning rate $\eta(t)$ that changes in time (an optax schedule), the
flows are the constant-rate flows ($\eta = 1$) run on the clock
$s(t) = \int_0^t \eta$ (`clock`, `invert_clock`); momentum rescales the clock by
$1/(1-\mu)$ once its average has built up. `solve_mflow` and `solve_lv` take the
schedule as their `learning_rate` and integrate on this clock.
"""

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Float

from .._checks import check_shape, is_concrete


# --------------------------------------------------------------------------------
# the change of clock


def check_momentum(momentum) -> float:
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
    $s(t)$, since $dM/ds = \dot M / \eta$. Two clocks:

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
    mu = check_momentum(momentum)
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
    `lv_reduce(task)` system) to steps of a schedule. `inf` where the clock
    does not reach `s` within `max_steps` steps (a decaying schedule may never
    get there). Exact for the discrete clock (piecewise linear); for
    `discrete=False` linear between integer steps. Runs eagerly.

    **Arguments:**

    - `learning_rate`, `momentum`, `discrete`: as in `clock`.
    - `s`: flow times, shape `(J,)` (`inf`/NaN pass through).
    - `max_steps`: the horizon searched (default `10**6`).

    **Returns:** `t(s)`, shape `(J,)`.
    """
    mu = check_momentum(momentum)
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
