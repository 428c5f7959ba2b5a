r"""The singular limit: as the initial scale $\epsilon \to 0$, in rescaled time
$\tau = t / \ln(1/\epsilon)$, the loss becomes a staircase computed by an
event-driven algorithm with no ODE solve (`singular_limit`)."""

from __future__ import annotations

import functools
import warnings
from typing import NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Bool, Float, Int

from ..tasks.lotka_volterra import LotkaVolterra
from ._sharp_switch import (
    LVNumpy,
    Trace,
    check_m0,
    check_max_events,
    diagonal_trace,
    event_loop,
    lv_numpy,
    require_concrete,
)


# ---------------------------------------------------------------------------
# The event-driven sharp-switch dynamics
# ---------------------------------------------------------------------------


class Event(NamedTuple):
    """One event of a staircase: at rescaled time `tau`, `mode` turns on or off."""

    tau: float
    mode: int
    on: bool


class Staircase(eqx.Module):
    r"""The singular-limit staircase of a Lotka-Volterra system (`singular_limit`).

    Times are stored in rescaled units `tau = t / ln(1/eps)`; `jump_times` and
    `loss` work in `t`.

    **Fields:**

    - `log_inv_eps`: `ln(1/eps)`, the rescaling (`log_eps`, its former name, is
      a deprecated alias).
    - `event_tau`, `event_mode`, `event_on`: the events in order, shape `(E,)`:
      when, which mode, and whether it turns on (`True`) or off.
    - `jump_times_tau`: the distinct event times, shape `(J,)`.
    - `plateau_values`: the equilibrium `m` on each plateau, shape `(J + 1, p)`;
      row 0 is before the first event (`m = 0`).
    - `plateau_losses`: `lv.loss` at those equilibria, shape `(J + 1,)`.
    - `active_sets`: which modes are held on each plateau, shape `(J + 1, p)`.
    - `switch_on_tau`: each mode's first switch-on time, shape `(p,)` (`inf`
      for a mode that never switches on).
    """

    log_inv_eps: Float[Array, ""]
    event_tau: Float[Array, " E"]
    event_mode: Int[Array, " E"]
    event_on: Bool[Array, " E"]
    jump_times_tau: Float[Array, " J"]
    plateau_values: Float[Array, "J+1 p"]
    plateau_losses: Float[Array, " J+1"]
    active_sets: Bool[Array, "J+1 p"]
    switch_on_tau: Float[Array, " p"]

    @property
    def log_eps(self) -> Float[Array, ""]:
        """Deprecated name of `log_inv_eps`."""
        warnings.warn(
            "`Staircase.log_eps` is deprecated; use `Staircase.log_inv_eps` "
            "(the same value, ln(1/eps)).",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.log_inv_eps

    @property
    def jump_times(self) -> Float[Array, " J"]:
        """The distinct event times in `t` (`tau * ln(1/eps)`)."""
        return self.jump_times_tau * self.log_inv_eps

    @property
    def switch_on_t(self) -> Float[Array, " p"]:
        """Each mode's first switch-on time in `t`."""
        return self.switch_on_tau * self.log_inv_eps

    @property
    def events(self) -> list[Event]:
        """The events in order, as `Event(tau, mode, on)` tuples."""
        return [
            Event(float(t), int(k), bool(o))
            for t, k, o in zip(
                np.asarray(self.event_tau),
                np.asarray(self.event_mode),
                np.asarray(self.event_on),
            )
        ]

    def loss_tau(self, taus: Float[ArrayLike, "*T"]) -> Float[Array, "*T"]:
        """The staircase loss at rescaled times `taus` (right-continuous steps)."""
        return _lookup(self.jump_times_tau, self.plateau_losses, jnp.asarray(taus))

    def loss(self, ts: Float[ArrayLike, "*T"]) -> Float[Array, "*T"]:
        """The staircase loss at times `ts` (in `t`)."""
        return self.loss_tau(jnp.asarray(ts) / self.log_inv_eps)


def _renamed_keyword(old: str, new: str):
    """Accept the keyword `old` for `new` for one release, with a
    `DeprecationWarning`."""

    def decorator(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if old in kwargs:
                if new in kwargs or len(args) > 1:
                    raise TypeError(f"Give `{new}` only, not both `{new}` and `{old}`.")
                warnings.warn(
                    f"`{fn.__name__}({old}=...)` is deprecated; use `{new}=` (the same "
                    "value).",
                    DeprecationWarning,
                    stacklevel=2,
                )
                kwargs[new] = kwargs.pop(old)
            return fn(*args, **kwargs)

        return wrapper

    return decorator


def _check_log_inv_eps(log_inv_eps) -> float:
    require_concrete("log_inv_eps", log_inv_eps, "singular_limit")
    if jnp.ndim(log_inv_eps) != 0:
        raise ValueError(
            "`log_inv_eps` must be a scalar ln(1/eps), got shape "
            f"{jnp.shape(log_inv_eps)}."
        )
    value = float(log_inv_eps)
    if not (np.isfinite(value) and value > 0):
        raise ValueError(
            f"`log_inv_eps` = ln(1/eps) must be finite and > 0 (eps < 1), got {value}."
        )
    return value


@_renamed_keyword("log_eps", "log_inv_eps")
def singular_limit(
    lv: LotkaVolterra,
    log_inv_eps: float,
    *,
    m0: Float[ArrayLike, " p"] | None = None,
    max_events: int | None = None,
) -> Staircase:
    r"""The staircase the loss becomes as the initial scale `eps -> 0`.

    In rescaled time $\tau = t / \ln(1/\epsilon)$ with exponents
    $q_k = \ln m_k / \ln(1/\epsilon)$ (see the documentation's theory pages):

    - an off mode's exponent moves linearly,
      $dq_k/d\tau = r_k - \delta - (B m)_k$, with `m` the current plateau;
    - it switches on when $q_k$ reaches 0;
    - on each plateau the held modes sit at the stable equilibrium of the system
      restricted to them, the non-negative quadratic program
      $\arg\min_{m \ge 0} \tfrac12 m^\top B m - (r - \delta)^\top m$ over the held
      modes plus the newcomers (`nnqp`);
    - a held mode whose value there is zero switches off, and its exponent falls
      again from 0 at its (now negative) effective rate; it may switch on again.

    Between events nothing changes, so the dynamics is event-driven: each step
    finds the first off mode to reach 0, moves every exponent there, and solves
    one NNQP. There is no ODE solve; the loop runs eagerly in numpy (it has at
    most a few events per mode) and calls the jitted `nnqp`, so it needs concrete
    arguments (not under `jax.jit`/`vmap`/`grad`). Independent modes (diagonal
    `B`) take a vectorised closed form in `O(p log p)`, without building `B`.
    Finite-`eps` solutions approach the staircase with errors of order
    `1 / ln(1/eps)`.

    **Arguments:**

    - `lv`: the system (`B` symmetric PSD, checked by `LotkaVolterra`).
    - `log_inv_eps`: $\ln(1/\epsilon) > 0$; every mode starts at $q_k = -1$.
      (Formerly `log_eps`, still accepted with a `DeprecationWarning`.)
    - `m0`: optional per-mode initial values, shape `(p,)` (or a scalar); then
      $q_k(0) = \ln m_{0,k} / \ln(1/\epsilon)$. Modes with $q_k(0) \ge 0$ that can
      grow switch on at `tau = 0`.
    - `max_events`: cap on events, an int (default `10 p + 10`).

    **Returns:** a `Staircase`.

    **Raises:** `ValueError` for `log_inv_eps <= 0`, bad `m0`, a system without a
    bounded equilibrium, or a traced argument (it names the argument).
    """
    sys = lv_numpy(lv, "singular_limit")
    p = lv.p
    log_inv_eps = _check_log_inv_eps(log_inv_eps)
    level0 = -log_inv_eps if m0 is None else np.log(check_m0(m0, p, "singular_limit"))
    level0 = np.minimum(np.broadcast_to(level0, (p,)), 0.0)
    max_events = check_max_events(max_events, p)
    if sys.diagonal:
        trace = diagonal_trace(sys.diag, sys.r_eff, level0, np.zeros(p))
    else:
        trace = event_loop(
            sys.B, sys.r_eff, level0, corrected=False, max_events=max_events
        )
    return _staircase(lv, trace, log_inv_eps, sys)


def _staircase(lv, trace: Trace, log_inv_eps: float, sys: LVNumpy) -> Staircase:
    dtype = lv.r.dtype
    plateaus = np.stack(trace.plateaus)
    if sys.diagonal:  # lv.loss without the (J + 1) p^2 work
        r = np.asarray(lv.r, np.float64)
        raw = 0.5 * plateaus**2 @ sys.diag - plateaus @ r
        losses = jnp.asarray(float(lv.loss_scale) * raw + float(lv.loss_offset), dtype)
    else:
        losses = lv.loss(jnp.asarray(plateaus, dtype))

    def rescaled(times):
        return jnp.asarray(np.asarray(times, np.float64) / log_inv_eps, dtype)

    return Staircase(
        log_inv_eps=jnp.asarray(log_inv_eps, dtype),
        event_tau=rescaled(trace.times),
        event_mode=jnp.asarray(np.asarray(trace.modes, np.int32)),
        event_on=jnp.asarray(np.asarray(trace.ons, bool)),
        jump_times_tau=rescaled(trace.jump_times),
        plateau_values=jnp.asarray(plateaus, dtype),
        plateau_losses=losses,
        active_sets=jnp.asarray(plateaus > 0),
        switch_on_tau=rescaled(trace.first_on),
    )


@jax.jit
def _lookup(jumps, values, taus):
    """`values[i]` for the number `i` of `jumps` at or before each of `taus`."""
    return values[jnp.searchsorted(jumps, taus, side="right")]
