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

from .._checks import check_shape, is_concrete, static_int
from ..tasks.lotka_volterra import LotkaVolterra
from .nnqp import _nnqp_impl


# ---------------------------------------------------------------------------
# The event-driven sharp-switch dynamics
# ---------------------------------------------------------------------------


class Event(NamedTuple):
    """One event of a staircase: at rescaled time `tau`, `mode` turns on or off."""

    tau: float
    mode: int
    on: bool


def _is_diagonal(B: np.ndarray) -> bool:
    off = B - np.diag(np.diag(B))
    scale = np.max(np.abs(B)) if B.size else 0.0
    return bool(np.max(np.abs(off), initial=0.0) <= 100 * np.finfo(B.dtype).eps * scale)


def _concrete(name: str, x, function: str):
    """Raise a `ValueError` naming `name` if `x` holds a tracer: `function` runs
    an event loop in numpy, eagerly."""
    if not is_concrete(x):
        raise ValueError(
            f"`{function}` runs eagerly (an event loop in numpy) and needs concrete "
            f"values, but `{name}` is traced; call it outside `jax.jit`, "
            "`jax.vmap` and `jax.grad`."
        )


class _LVNumpy(NamedTuple):
    """The system in float64 numpy: `B` dense (None when diagonal), its diagonal,
    the effective rates `r - decay`, and whether the modes are independent."""

    B: np.ndarray | None
    diag: np.ndarray
    r_eff: np.ndarray
    diagonal: bool


def _lv_numpy(lv: LotkaVolterra, function: str) -> _LVNumpy:
    """`lv` in numpy; interactions diagonal by their structure are never
    densified (the event loop of coupled modes is dense numpy: `O(p^2)`)."""
    if not isinstance(lv, LotkaVolterra):
        raise ValueError(f"`lv` must be a LotkaVolterra system, got {type(lv)}.")
    _concrete("lv", lv, function)
    # numpy from here: jnp operations would be staged (traced) inside a jit;
    # the interactions' own, on concrete values, run now
    r_eff = np.asarray(lv.r, np.float64) - float(lv.decay)
    inter = lv.interactions
    with jax.ensure_compile_time_eval():
        diag = np.array(inter.diagonal(), np.float64)
        if inter.is_diagonal():
            return _LVNumpy(None, diag, r_eff, True)
        B = np.asarray(inter.as_matrix(), np.float64)
    B = 0.5 * (B + B.T)
    if _is_diagonal(B):
        return _LVNumpy(None, diag, r_eff, True)
    return _LVNumpy(B, diag, r_eff, False)


class _Trace(NamedTuple):
    times: list  # event times (in the units of the levels' time)
    modes: list
    ons: list
    jump_times: list  # distinct event times
    plateaus: list  # equilibrium m on each plateau (before the first event too)
    first_on: np.ndarray  # first switch-on time per mode (inf: never)


def _event_loop(B, r_eff, level0, *, corrected: bool, max_events: int) -> _Trace:
    r"""The sharp-switch dynamics, eagerly in numpy (small: one NNQP per event).

    `level_k = ln m_k` moves at `r_k - (B m)_k` with `m` the current plateau's
    equilibrium; an off mode switches on when its level reaches its threshold
    (0 in the singular limit; `ln m_k^new`, its value on the next plateau, with the
    first-order correction); the new plateau is the NNQP on the held modes plus the
    newcomers; held modes whose value is zero there switch off and their level
    falls again from 0 (or from `ln` of their last value, corrected).
    """
    p = r_eff.shape[0]
    dtype = jnp.float64 if jax.config.jax_enable_x64 else jnp.float32
    Bj = jnp.asarray(B, dtype)
    rj = jnp.asarray(r_eff, dtype)
    max_iter = jnp.asarray(3 * p + 10)
    if not is_concrete(rj + 0):  # every argument is concrete, but jnp is staged
        raise ValueError(
            "`singular_limit` and `switch_on_times` run eagerly (an event loop in "
            "numpy): call them outside `jax.jit`, `jax.vmap` and `jax.grad`."
        )
    solve_batch = jax.vmap(_nnqp_impl, in_axes=(None, None, 0, None))

    def solve(mask):
        sol = _nnqp_impl(Bj, rj, jnp.asarray(mask), max_iter)
        if not bool(sol.converged):
            raise ValueError(
                "The plateau's quadratic program did not converge: the "
                "Lotka-Volterra system has no bounded equilibrium on the modes "
                f"{np.flatnonzero(mask).tolist()} (some d >= 0 with B d = 0 and "
                "r . d > 0)."
            )
        return np.asarray(sol.m, np.float64)

    level = np.array(level0, np.float64)
    held = np.zeros(p, bool)
    m_eq = np.zeros(p)
    t = 0.0
    trace = _Trace([], [], [], [], [m_eq.copy()], np.full(p, np.inf))
    for _ in range(max_events + 1):
        rate = r_eff - B @ m_eq
        # rates below 1e-10 of the scale are rounding (and would take ~1e10
        # time units to matter)
        rate_tol = 1e-10 * (np.max(np.abs(r_eff)) + np.max(np.abs(B @ m_eq)))
        grow = ~held & (rate > rate_tol)
        if not np.any(grow):
            return trace
        threshold = np.zeros(p)
        if corrected:
            # one batch of all p candidates (a fixed shape: one compilation)
            masks = held[None, :] | np.eye(p, dtype=bool)
            sols = solve_batch(Bj, rj, jnp.asarray(masks), max_iter)
            converged = np.asarray(sols.converged)
            if not np.all(converged[grow]):
                solve(masks[np.flatnonzero(grow & ~converged)[0]])
            m_new = np.diag(np.asarray(sols.m, np.float64))
            threshold = np.where(
                grow, np.log(np.maximum(m_new, np.finfo(np.float64).tiny)), 0.0
            )
        wait = np.where(grow, (threshold - level) / np.where(grow, rate, 1), np.inf)
        wait = np.maximum(wait, 0.0)
        dt = float(np.min(wait))
        new = grow & (wait <= dt + 1e-12 * (abs(t) + dt) + 1e-300)
        t += dt
        level = np.where(held, level, level + rate * dt)
        level[new] = threshold[new]
        m_new = solve(held | new)
        tiny = 1e-9 * max(np.max(m_new), 1e-300)
        now = m_new > tiny
        on, off = new & now, held & ~now
        if not (np.any(on) or np.any(off)):
            # A newcomer at zero: it cannot grow on the new plateau either.
            m_eq = np.where(now, m_new, 0.0)
            continue
        for k in np.flatnonzero(on):
            trace.times.append(t), trace.modes.append(int(k)), trace.ons.append(True)
            trace.first_on[k] = min(trace.first_on[k], t)
        for k in np.flatnonzero(off):
            trace.times.append(t), trace.modes.append(int(k)), trace.ons.append(False)
        if corrected:
            level = np.where(off, np.log(np.maximum(m_eq, 1e-300)), level)
            level = np.where(now, np.log(np.maximum(m_new, 1e-300)), level)
        else:
            level = np.where(off | now, 0.0, level)
        held = now
        m_eq = np.where(now, m_new, 0.0)
        trace.jump_times.append(t)
        trace.plateaus.append(m_eq.copy())
    raise ValueError(
        f"The staircase did not end within {max_events} events (modes switching "
        "on and off in a cycle?). Raise `max_events` if the system is large."
    )


def _check_bounded(diag, r_eff):
    """Independent modes: refuse one that grows (`r_k - decay > 0`) unopposed."""
    grows = r_eff > 0
    if np.any(grows & (diag <= 0)):
        k = int(np.flatnonzero(grows & (diag <= 0))[0])
        raise ValueError(
            f"Mode {k} has r_k - decay > 0 and B_kk = 0: it grows without bound "
            "(no bounded equilibrium)."
        )
    return grows


def _diagonal_trace(diag, r_eff, level0, threshold) -> _Trace:
    """Independent modes (`diag` = `B_kk`): every mode grows at `r_k` from
    `level0_k` to `threshold_k`."""
    p = r_eff.shape[0]
    grows = _check_bounded(diag, r_eff)
    t_on = np.where(
        grows, np.maximum(threshold - level0, 0) / np.where(grows, r_eff, 1), np.inf
    )
    mstar = np.where(grows, r_eff / np.where(diag > 0, diag, 1), 0.0)
    order = np.argsort(t_on, kind="stable")
    order = order[np.isfinite(t_on[order])]
    times = t_on[order]
    jump_times, plateaus = [], [np.zeros(p)]
    m = np.zeros(p)
    i = 0
    while i < order.size:
        j = i
        while j < order.size and times[j] <= times[i] * (1 + 1e-12) + 1e-300:
            j += 1
        m = m.copy()
        m[order[i:j]] = mstar[order[i:j]]
        jump_times.append(float(times[i]))
        plateaus.append(m)
        i = j
    return _Trace(
        times.tolist(),
        order.tolist(),
        [True] * order.size,
        jump_times,
        plateaus,
        t_on,
    )


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
    _concrete("log_inv_eps", log_inv_eps, "singular_limit")
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


def _check_m0(m0, p: int, function: str) -> np.ndarray:
    _concrete("m0", m0, function)
    m0 = np.asarray(m0, np.float64)  # numpy: jnp would be staged inside a jit
    if m0.ndim == 0:
        m0 = np.full(p, m0)
    check_shape("m0", m0, (p,))
    if not np.all(np.isfinite(m0) & (m0 > 0)):
        bad = m0[~(np.isfinite(m0) & (m0 > 0))][0]
        raise ValueError(f"`m0` must be strictly positive and finite; got {bad:.3g}.")
    return m0


def _max_events(max_events, p: int) -> int:
    if max_events is None:
        return 10 * p + 10
    return static_int("max_events", max_events)


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
    sys = _lv_numpy(lv, "singular_limit")
    p = lv.p
    log_inv_eps = _check_log_inv_eps(log_inv_eps)
    level0 = -log_inv_eps if m0 is None else np.log(_check_m0(m0, p, "singular_limit"))
    level0 = np.minimum(np.broadcast_to(level0, (p,)), 0.0)
    max_events = _max_events(max_events, p)
    if sys.diagonal:
        trace = _diagonal_trace(sys.diag, sys.r_eff, level0, np.zeros(p))
    else:
        trace = _event_loop(
            sys.B, sys.r_eff, level0, corrected=False, max_events=max_events
        )
    return _staircase(lv, trace, log_inv_eps, sys)


def _staircase(lv, trace: _Trace, log_inv_eps: float, sys: _LVNumpy) -> Staircase:
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
