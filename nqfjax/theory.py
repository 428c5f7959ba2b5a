r"""Predictions from the Lotka-Volterra reduction (THEORY.md sections 4-5).

- `switch_on_times`: when each mode switches on (exact logistic half-way times
  for independent modes; the event-driven sharp-switch limit with a first-order
  correction for interacting ones).
- `singular_limit`: the staircase the loss curve becomes as the initial scale
  `eps -> 0`, in rescaled time `tau = t / ln(1/eps)`, with no ODE solve.
- `nnqp`: the non-negative quadratic program that fixes each plateau.
- `power_law_exponent`, `sharp_switch_loss`: the scaling law of many unresolved
  modes and its refined sharp-switch prediction.
- `detect_plateaus`: plateaus and drops of a measured loss curve.
"""

from __future__ import annotations

import math
from typing import Literal, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Bool, Float, Int

from ._checks import check_ndim, check_shape, is_concrete, positive, symmetric_psd
from .lv import LotkaVolterra


# ---------------------------------------------------------------------------
# The non-negative quadratic program
# ---------------------------------------------------------------------------


class NNQPSolution(eqx.Module):
    """The result of `nnqp`.

    - `m`: the minimiser, shape `(p,)` (zero outside the mask).
    - `iterations`: outer (variable-adding) iterations used.
    - `converged`: whether the KKT conditions hold to tolerance within
      `max_iter` iterations and the result is finite (false for an unbounded
      program, where some `d >= 0` has `B d = 0` and `r . d > 0`).
    """

    m: Float[Array, " p"]
    iterations: Int[Array, ""]
    converged: Bool[Array, ""]


def _passive_step(B, r, P, tol):
    """On the passive set `P`: the minimiser `z` of the program restricted to `P`
    (min-norm, through an eigendecomposition of `B_PP`), and `d`, the part of
    `r_P` in the null space of `B_PP`. When `|d| > tol` the restricted program
    is unbounded along `d` (zero curvature, slope `-|d|^2`), so `z` is not used."""
    p = r.shape[0]
    dtype = B.dtype
    PP = P[:, None] & P[None, :]
    Bp = jnp.where(PP, B, 0)
    rp = jnp.where(P, r, 0)
    evals, evecs = jnp.linalg.eigh(Bp)
    eps = jnp.finfo(dtype).eps
    null = evals <= 1e3 * p * eps * jnp.max(jnp.abs(evals)) + jnp.finfo(dtype).tiny
    coef = evecs.T @ rp
    z = evecs @ jnp.where(null, 0, coef / jnp.where(null, 1, evals))
    d = evecs @ jnp.where(null, coef, 0)
    z = jnp.where(P, z, 0)
    d = jnp.where(P, d, 0)
    return z, d, jnp.linalg.norm(d) > tol


def _kkt_tol(B, r, x):
    eps = jnp.finfo(B.dtype).eps
    p = r.shape[0]
    scale = jnp.max(jnp.abs(r)) + jnp.max(jnp.abs(B)) * jnp.max(jnp.abs(x))
    return 10 * p * eps * scale + jnp.finfo(B.dtype).tiny


@jax.jit
def _nnqp_impl(B, r, mask, max_iter):
    """Lawson-Hanson active-set method for `min 1/2 m^T B m - r^T m, m >= 0`,
    with zero-curvature steps for a singular (PSD) `B`."""
    p = r.shape[0]
    dtype = B.dtype
    index = jnp.arange(p)

    def outer_cond(state):
        x, P, it = state
        w = r - B @ x
        more = jnp.any(mask & ~P & (w > _kkt_tol(B, r, x)))
        return more & (it < max_iter) & jnp.all(jnp.isfinite(x))

    def inner_cond(s):
        x, P, done, k = s
        return ~done & (k <= 2 * p + 2)

    def inner_body(s):
        x, P, _, k = s
        tol = 100 * _kkt_tol(B, r, x)
        z, d, singular = _passive_step(B, r, P, tol)
        # the direction to move in: towards z, or along d (zero curvature)
        step = jnp.where(singular, d, z - x)
        blocking = P & jnp.where(singular, d < 0, z <= 0)
        gap = jnp.where(blocking & (-step > 0), -step, 1)
        ratio = jnp.where(blocking, jnp.where(-step > 0, x / gap, 0), jnp.inf)
        i = jnp.argmin(ratio)
        alpha = jnp.where(singular, ratio[i], jnp.minimum(ratio[i], 1))
        unbounded = singular & ~jnp.any(blocking)
        done = unbounded | (~singular & ~jnp.any(blocking))
        x_new = jnp.where(done & ~unbounded, z, x + alpha * step)
        hit = jnp.any(blocking) & ~done
        P_new = P & ((x_new > 0) | done) & ~(hit & (index == i))
        x_new = jnp.where(P_new, x_new, 0)
        x_new = jnp.where(unbounded, jnp.nan, x_new)
        return x_new, P_new, done, k + 1

    def outer_body(state):
        x, P, it = state
        w = r - B @ x
        j = jnp.argmax(jnp.where(mask & ~P, w, -jnp.inf))
        P = P.at[j].set(True)
        x, P, _, _ = jax.lax.while_loop(
            inner_cond, inner_body, (x, P, jnp.asarray(False), jnp.asarray(0))
        )
        return x, P, it + 1

    x0 = jnp.zeros(p, dtype)
    P0 = jnp.zeros(p, bool)
    x, P, it = jax.lax.while_loop(outer_cond, outer_body, (x0, P0, jnp.asarray(0)))
    w = r - B @ x
    kkt = ~jnp.any(mask & ~P & (w > _kkt_tol(B, r, x)))
    ok = kkt & jnp.all(jnp.isfinite(x)) & jnp.all(x >= 0)
    return NNQPSolution(m=x, iterations=it, converged=ok)


def nnqp(
    B: Float[ArrayLike, "p p"],
    r: Float[ArrayLike, " p"],
    mask: Bool[ArrayLike, " p"] | None = None,
    *,
    max_iter: int | None = None,
) -> NNQPSolution:
    r"""Solve the non-negative quadratic program of a plateau (THEORY.md section 4):

    $$\min_{m \ge 0,\ m_i = 0\ (i \notin \text{mask})}
      \tfrac12 m^\top B m - r^\top m .$$

    For symmetric PSD `B` this is the stable (saturated) equilibrium of the
    Lotka-Volterra system restricted to `mask`: the KKT conditions
    `(r - B m)_k = 0` where `m_k > 0` and `(r - B m)_k <= 0` where `m_k = 0` say
    that the modes held are at rest and no other mode can invade.

    **Algorithm.** The Lawson-Hanson active-set method (Lawson & Hanson, *Solving
    Least Squares Problems*, 1974, ch. 23), written for the quadratic program: it
    touches only `B = A^T A` and `r = A^T b`, never `A`. Start from `m = 0` with an
    empty passive (free) set; repeatedly free the variable with the largest
    negative gradient `(r - B m)_j > 0`, solve the equality-constrained problem
    `B_PP z_P = r_P` on the passive set, and if some `z_i <= 0` step from `m`
    towards `z` until the first variable hits zero, drop it from the passive set
    and re-solve. It stops when the KKT conditions hold to a tolerance of
    `10 p eps (|r| + |B| |m|)`. In exact arithmetic the passive block `B_PP` stays
    nonsingular for PSD `B` (a dependent direction has zero gradient and is never
    freed), and the number of steps is finite; it is typically `~ p`. Fixed
    shapes (`jax.lax.while_loop` with masked solves), so it works under `jit` and
    `vmap`; one compilation per `(p, dtype)`.

    **Arguments:**

    - `B`: symmetric PSD matrix, shape `(p, p)`.
    - `r`: linear term, shape `(p,)`.
    - `mask`: which variables may be nonzero, shape `(p,)` (default all).
    - `max_iter`: cap on outer iterations (default `3 p + 10`); reaching it sets
      `converged = False`.

    **Returns:** an `NNQPSolution` (`m`, `iterations`, `converged`).

    **Raises:** `ValueError` for shapes, or for a non-symmetric or non-PSD `B`
    (through `eqx.error_if` under `jit`).
    """
    B = jnp.asarray(B)
    r = jnp.asarray(r)
    check_ndim("r", r, 1, "a vector")
    p = r.shape[0]
    check_shape("B", B, (p, p))
    dtype = jnp.result_type(B, r, float)
    B = symmetric_psd("B", B.astype(dtype))
    r = r.astype(dtype)
    if mask is None:
        mask = jnp.ones(p, bool)
    mask = jnp.asarray(mask)
    check_shape("mask", mask, (p,))
    if mask.dtype != jnp.bool_:
        raise ValueError(f"`mask` must be boolean, got dtype {mask.dtype}.")
    max_iter = 3 * p + 10 if max_iter is None else int(max_iter)
    return _nnqp_impl(0.5 * (B + B.T), r, mask, jnp.asarray(max_iter))


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


def _lv_numpy(lv: LotkaVolterra):
    if not is_concrete(lv):
        raise ValueError(
            "The staircase is computed eagerly (an event loop in numpy); call it "
            "outside `jax.jit` with concrete arrays."
        )
    B = np.asarray(lv.B, np.float64)
    r_eff = np.asarray(lv.r, np.float64) - float(lv.decay)
    return 0.5 * (B + B.T), r_eff


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


def _diagonal_trace(B, r_eff, level0, threshold) -> _Trace:
    """Independent modes: every mode grows at `r_k` from `level0_k` to `threshold_k`."""
    p = r_eff.shape[0]
    diag = np.diag(B)
    grows = r_eff > 0
    if np.any(grows & (diag <= 0)):
        k = int(np.flatnonzero(grows & (diag <= 0))[0])
        raise ValueError(
            f"Mode {k} has r_k - decay > 0 and B_kk = 0: it grows without bound "
            "(no bounded equilibrium)."
        )
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

    - `log_eps`: `ln(1/eps)`, the rescaling.
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

    log_eps: Float[Array, ""]
    event_tau: Float[Array, " E"]
    event_mode: Int[Array, " E"]
    event_on: Bool[Array, " E"]
    jump_times_tau: Float[Array, " J"]
    plateau_values: Float[Array, "J+1 p"]
    plateau_losses: Float[Array, " J+1"]
    active_sets: Bool[Array, "J+1 p"]
    switch_on_tau: Float[Array, " p"]

    @property
    def jump_times(self) -> Float[Array, " J"]:
        """The distinct event times in `t` (`tau * ln(1/eps)`)."""
        return self.jump_times_tau * self.log_eps

    @property
    def switch_on_t(self) -> Float[Array, " p"]:
        """Each mode's first switch-on time in `t`."""
        return self.switch_on_tau * self.log_eps

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
        taus = jnp.asarray(taus)
        idx = jnp.searchsorted(self.jump_times_tau, taus, side="right")
        return self.plateau_losses[idx]

    def loss(self, ts: Float[ArrayLike, "*T"]) -> Float[Array, "*T"]:
        """The staircase loss at times `ts` (in `t`)."""
        return self.loss_tau(jnp.asarray(ts) / self.log_eps)


def _check_log_eps(log_eps) -> float:
    if jnp.ndim(log_eps) != 0:
        raise ValueError(
            f"`log_eps` must be a scalar ln(1/eps), got shape {jnp.shape(log_eps)}."
        )
    value = float(log_eps)
    if not (np.isfinite(value) and value > 0):
        raise ValueError(
            f"`log_eps` = ln(1/eps) must be finite and > 0 (eps < 1), got {value}."
        )
    return value


def _check_m0(m0, p) -> np.ndarray:
    m0 = jnp.asarray(m0)
    if m0.ndim == 0:
        m0 = jnp.full((p,), m0)
    check_shape("m0", m0, (p,))
    return np.asarray(positive("m0", m0), np.float64)


def singular_limit(
    lv: LotkaVolterra,
    log_eps: float,
    *,
    m0: Float[ArrayLike, " p"] | None = None,
    max_events: int | None = None,
) -> Staircase:
    r"""The staircase the loss becomes as the initial scale `eps -> 0`.

    In rescaled time $\tau = t / \ln(1/\epsilon)$ with exponents
    $q_k = \ln m_k / \ln(1/\epsilon)$ (THEORY.md section 4):

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
    most a few events per mode) and calls the jitted `nnqp`. Independent modes
    (diagonal `B`) take a vectorised closed form. Finite-`eps` solutions approach
    the staircase with errors of order `1 / ln(1/eps)`.

    **Arguments:**

    - `lv`: the system (`B` symmetric PSD, checked by `LotkaVolterra`).
    - `log_eps`: $\ln(1/\epsilon) > 0$; every mode starts at $q_k = -1$.
    - `m0`: optional per-mode initial values, shape `(p,)` (or a scalar); then
      $q_k(0) = \ln m_{0,k} / \ln(1/\epsilon)$. Modes with $q_k(0) \ge 0$ that can
      grow switch on at `tau = 0`.
    - `max_events`: cap on events (default `10 p + 10`).

    **Returns:** a `Staircase`.

    **Raises:** `ValueError` for `log_eps <= 0`, bad `m0`, a system without a
    bounded equilibrium, or a traced `lv` (call it outside `jit`).
    """
    B, r_eff = _lv_numpy(lv)
    p = lv.p
    log_eps = _check_log_eps(log_eps)
    if m0 is None:
        level0 = np.full(p, -log_eps)
    else:
        level0 = np.log(_check_m0(m0, p))
    level0 = np.minimum(level0, 0.0)
    diagonal = _is_diagonal(B)
    if diagonal:
        trace = _diagonal_trace(B, r_eff, level0, np.zeros(p))
    else:
        max_events = 10 * p + 10 if max_events is None else int(max_events)
        trace = _event_loop(B, r_eff, level0, corrected=False, max_events=max_events)
    return _staircase(lv, trace, log_eps, diagonal)


def _staircase(lv, trace: _Trace, log_eps: float, diagonal: bool) -> Staircase:
    dtype = lv.r.dtype
    plateaus = np.stack(trace.plateaus)
    if diagonal:  # lv.loss without the (J + 1) p^2 work
        diag, r = np.diag(np.asarray(lv.B, np.float64)), np.asarray(lv.r, np.float64)
        raw = 0.5 * plateaus**2 @ diag - plateaus @ r
        losses = jnp.asarray(float(lv.loss_scale) * raw + float(lv.loss_offset), dtype)
    else:
        losses = lv.loss(jnp.asarray(plateaus, dtype))
    return Staircase(
        log_eps=jnp.asarray(log_eps, dtype),
        event_tau=jnp.asarray(np.asarray(trace.times, np.float64) / log_eps, dtype),
        event_mode=jnp.asarray(np.asarray(trace.modes, np.int32)),
        event_on=jnp.asarray(np.asarray(trace.ons, bool)),
        jump_times_tau=jnp.asarray(
            np.asarray(trace.jump_times, np.float64) / log_eps, dtype
        ),
        plateau_values=jnp.asarray(plateaus, dtype),
        plateau_losses=losses,
        active_sets=jnp.asarray(plateaus > 0),
        switch_on_tau=jnp.asarray(trace.first_on / log_eps, dtype),
    )


def switch_on_times(
    lv: LotkaVolterra,
    m0: Float[ArrayLike, " p"],
    *,
    corrected: bool = True,
    max_events: int | None = None,
) -> Float[Array, " p"]:
    r"""When each mode switches on, starting from `m(0) = m0`.

    **Independent modes** (diagonal `B`): the exact half-way time of the logistic
    solution $m_k(t) = m^*_k / (1 + (m^*_k/m_{0,k} - 1) e^{-\tilde r_k t})$,

    $$t_k = \frac{\ln(m^*_k / m_{0,k} - 1)}{\tilde r_k},\qquad
    \tilde r_k = r_k - \delta,\quad m^*_k = \tilde r_k / B_{kk}$$

    (THEORY.md section 4); `inf` for modes with $\tilde r_k \le 0$, NaN where
    $m_{0,k} \ge m^*_k$ (no half-way point); negative where the mode starts past
    half-way.

    **Interacting modes:** the sharp-switch dynamics of `singular_limit`, run in
    `t` from $\ln m_{0,k}$ (its leading order is $t_k = \tau_k \ln(1/\epsilon)$;
    the result is the first switch-on of each mode, `inf` if it never switches
    on). With `corrected=True` (default) a mode switches on when its log-value
    reaches $\ln m_k^{\rm new}$, its value on the plateau it switches on into,
    instead of 0. This is the first-order correction: (i) for a single mode it
    is exactly the logistic half-way point up to $O(\epsilon/m^*)$ (the
    exponential phase $\epsilon e^{\tilde r t}$ reaches $m^*$ when the logistic is
    at $m^*/2$); (ii) it places every step of the piecewise-constant
    approximation at the transition's half-way point, where for a symmetric
    sigmoid transition the integrated error $\int (m_j(t) - m_j^{\rm eq}
    H(t - t_j))\,dt$ it makes in the other modes' growth exponents vanishes. The
    remaining error is $O(1)$ in `t` (asymmetric transitions, modes off by
    a finite amount), against $O(1)$ plus the offset $\ln m^{\rm new}_k / r_k$
    without it; in rescaled time both vanish like $1/\ln(1/\epsilon)$.

    Runs eagerly (not under `jit`).

    **Arguments:**

    - `lv`: the system.
    - `m0`: initial values, shape `(p,)` or a scalar, strictly positive.
    - `corrected`: use the first-order correction (interacting modes only).
    - `max_events`: cap on events (default `10 p + 10`).

    **Returns:** times in `t`, shape `(p,)`.

    **Raises:** `ValueError` for bad `m0` or a system without a bounded
    equilibrium.
    """
    B, r_eff = _lv_numpy(lv)
    p = lv.p
    m0 = _check_m0(m0, p)
    dtype = lv.r.dtype
    if _is_diagonal(B):
        diag = np.diag(B)
        grows = r_eff > 0
        if np.any(grows & (diag <= 0)):
            k = int(np.flatnonzero(grows & (diag <= 0))[0])
            raise ValueError(
                f"Mode {k} has r_k - decay > 0 and B_kk = 0: it grows without bound."
            )
        with np.errstate(divide="ignore", invalid="ignore"):
            mstar = r_eff / np.where(diag > 0, diag, 1)
            t = np.log(mstar / m0 - 1) / r_eff
        return jnp.asarray(np.where(grows, t, np.inf), dtype)
    max_events = 10 * p + 10 if max_events is None else int(max_events)
    trace = _event_loop(
        B, r_eff, np.log(m0), corrected=corrected, max_events=max_events
    )
    return jnp.asarray(trace.first_on, dtype)


# ---------------------------------------------------------------------------
# Power laws (THEORY.md section 5)
# ---------------------------------------------------------------------------


def power_law_exponent(
    alpha: float, beta: float, regime: Literal["rich", "lazy"] = "rich"
) -> float:
    r"""The exponent `gamma` of `L(t) ~ t^-gamma` for power-law spectra.

    With `lam_k = k^-alpha` (so `B_kk ~ k^-alpha`) and target scales
    `m*_k = k^-beta` (THEORY.md section 5):

    - `"rich"` (this theory: modes switch on one by one at
      `t_k ~ ln(1/eps) k^(alpha+beta)`):
      $\gamma = (\alpha + 2\beta - 1)/(\alpha + \beta)$;
    - `"lazy"` (a linear model with the same spectra, each mode relaxing at a rate
      `~ lam_k`): $\gamma = (\alpha + 2\beta - 1)/\alpha$.

    **Arguments:**

    - `alpha`: spectral decay of `lam_k`, finite, `> 0`.
    - `beta`: decay of the target scales, finite, with `alpha + beta > 0`.
    - `regime`: `"rich"` or `"lazy"`.

    **Returns:** `gamma` (a Python float).

    **Raises:** `ValueError` unless `alpha > 0`, `alpha + beta > 0` and
    `alpha + 2 beta > 1` (the total loss `sum lam_k m*_k^2` must converge), or
    for an unknown `regime`.
    """
    try:
        a, b = float(alpha), float(beta)
    except (TypeError, ValueError):
        raise ValueError(
            f"`alpha` and `beta` must be real scalars, got {alpha!r}, {beta!r}."
        ) from None
    if not (math.isfinite(a) and math.isfinite(b)):
        raise ValueError(f"`alpha` and `beta` must be finite, got {a}, {b}.")
    if a <= 0:
        raise ValueError(f"`alpha` must be > 0 (lam_k = k^-alpha decays), got {a}.")
    if a + b <= 0:
        raise ValueError(
            "`alpha + beta` must be > 0 (rates r_k ~ k^-(alpha+beta) decay), got "
            f"{a + b}."
        )
    if a + 2 * b <= 1:
        raise ValueError(
            "The power law needs alpha + 2 beta > 1 (a finite total loss "
            f"sum_k k^-(alpha + 2 beta)); got alpha + 2 beta = {a + 2 * b}."
        )
    if regime == "rich":
        return (a + 2 * b - 1) / (a + b)
    if regime == "lazy":
        return (a + 2 * b - 1) / a
    raise ValueError(f'`regime` must be "rich" or "lazy", got {regime!r}.')


def sharp_switch_loss(
    lv: LotkaVolterra,
    m0: Float[ArrayLike, " p"],
    ts: Float[ArrayLike, " T"],
) -> Float[Array, " T"]:
    r"""The refined sharp-switch loss of independent modes (THEORY.md section 5).

    Each mode jumps from 0 to $m^*_k = \tilde r_k / B_{kk}$ at
    $t_k = \ln(m^*_k / m_{0,k}) / \tilde r_k$ ($\tilde r_k = r_k - \delta$):

    $$L_{\rm sharp}(t) = \mathrm{lv.loss}\big(m^*\,\mathbb 1[t_k \le t]\big),$$

    which for the power-law task (`loss_offset` = $\tfrac12\sum_k \lambda_k
    m_k^{*2}$, no decay) is $\tfrac12 \sum_{k: t_k > t} \lambda_k m_k^{*2}$. It keeps
    the logarithmic corrections ($\ln(m^*_k/\epsilon) = \ln(1/\epsilon) - \beta \ln
    k$) that make a fitted exponent come out a few percent above
    `power_law_exponent(alpha, beta, "rich")`. Modes with $\tilde r_k \le 0$ never
    switch on. `jit`-able: sorts the `t_k` and looks the times up.

    **Arguments:**

    - `lv`: a system of independent modes (diagonal `B`).
    - `m0`: initial values `eps_k`, shape `(p,)` or a scalar.
    - `ts`: times, shape `(T,)`.

    **Returns:** `L_sharp(ts)`, shape `(T,)`.

    **Raises:** `ValueError` if `B` is not diagonal or `m0`/`ts` are malformed.
    """
    p = lv.p
    if is_concrete(lv.B) and not _is_diagonal(np.asarray(lv.B)):
        raise ValueError(
            "`sharp_switch_loss` is for independent modes: `lv.B` must be diagonal."
        )
    m0 = jnp.asarray(m0)
    if m0.ndim == 0:
        m0 = jnp.broadcast_to(m0, (p,))
    check_shape("m0", m0, (p,))
    m0 = positive("m0", m0)
    ts = jnp.asarray(ts)
    check_ndim("ts", ts, 1, "a 1-D array of times")
    diag = jnp.diag(lv.B)
    r_eff = lv.r - lv.decay
    grows = (r_eff > 0) & (diag > 0)
    mstar = jnp.where(grows, r_eff / jnp.where(grows, diag, 1), 0)
    t_on = jnp.where(
        grows,
        jnp.log(jnp.where(grows, mstar, 1) / m0) / jnp.where(grows, r_eff, 1),
        jnp.inf,
    )
    gain = lv.loss_scale * (0.5 * diag * mstar**2 - lv.r * mstar)
    order = jnp.argsort(t_on)
    cum = jnp.concatenate([jnp.zeros(1, gain.dtype), jnp.cumsum(gain[order])])
    idx = jnp.searchsorted(t_on[order], ts.astype(t_on.dtype), side="right")
    return lv.loss_offset + cum[idx]


# ---------------------------------------------------------------------------
# Plateau detection
# ---------------------------------------------------------------------------


class Plateaus(eqx.Module):
    """The plateaus of a measured loss curve (`detect_plateaus`), in time order.

    - `start`, `end`: where each plateau begins and ends (in `t`), shape `(P,)`.
    - `level`: the median loss on each plateau, shape `(P,)`.
    - `drop`: `level[i] - level[i + 1]`, the size of the drop after plateau `i`,
      shape `(P - 1,)` (negative would mean a rise).
    - `drop_times`: when the smoothed loss crosses the middle of each drop,
      `(level[i] + level[i + 1]) / 2`, shape `(P - 1,)`.
    """

    start: Float[Array, " P"]
    end: Float[Array, " P"]
    level: Float[Array, " P"]
    drop: Float[Array, " P-1"]
    drop_times: Float[Array, " P-1"]

    def __len__(self) -> int:
        return int(self.level.shape[0])


def _gaussian_smooth(y: np.ndarray, sigma_pts: float) -> np.ndarray:
    """Gaussian smoothing with odd reflection at the ends (keeps end slopes)."""
    if sigma_pts < 0.5:
        return y
    half = min(int(np.ceil(4 * sigma_pts)), y.size - 1)
    x = np.arange(-half, half + 1)
    kernel = np.exp(-0.5 * (x / sigma_pts) ** 2)
    kernel /= kernel.sum()
    left = 2 * y[0] - y[half:0:-1]
    right = 2 * y[-1] - y[-2 : -half - 2 : -1]
    return np.convolve(np.concatenate([left, y, right]), kernel, mode="valid")


def _interp_linear_ends(x, xp, fp):
    """`np.interp`, but extrapolating linearly beyond the ends of `xp`."""
    if xp.size == 1:
        return np.full_like(x, fp[0])
    out = np.interp(x, xp, fp)
    before, after = x < xp[0], x > xp[-1]
    out[before] = fp[0] + (x[before] - xp[0]) * (fp[1] - fp[0]) / (xp[1] - xp[0])
    out[after] = fp[-1] + (x[after] - xp[-1]) * (fp[-1] - fp[-2]) / (xp[-1] - xp[-2])
    return out


def _robust_slope(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """Least-squares slope of `y` on `x` and its standard error, refitted once
    without the points more than 3 robust standard deviations off (spikes)."""
    keep = np.ones(x.size, bool)
    for _ in range(2):
        if np.count_nonzero(keep) < 3:
            return np.inf, np.inf
        xk, yk = x[keep], y[keep]
        xc = xk - xk.mean()
        sxx = np.sum(xc**2)
        if sxx <= 0:
            return np.inf, np.inf
        fit = np.sum(xc * (yk - yk.mean())) / sxx
        resid = y - yk.mean() - fit * (x - xk.mean())
        scale = 1.4826 * np.median(np.abs(resid[keep]))
        keep = np.abs(resid) <= 3 * scale + 1e-300
    err = np.sqrt(np.sum(resid[keep] ** 2) / max(np.count_nonzero(keep) - 2, 1) / sxx)
    return float(fit), float(err)


def detect_plateaus(
    ts: Float[ArrayLike, " T"],
    loss: Float[ArrayLike, " T"],
    *,
    drop_slope: float = 1.0,
    slope_tol: float = 0.15,
    min_length: float = 0.05,
    min_drop: float = 0.1,
    smooth: float = 0.02,
    floor: float | None = None,
    n_grid: int = 1024,
    min_samples: int = 9,
) -> Plateaus:
    r"""Find the plateaus and drops of a measured loss curve.

    Works in log-log coordinates, where the plateaus of a staircase are flat and
    equally resolved at every time scale:

    1. a robust local level $y = \ln\max(L, \text{floor})$: around each of
       `n_grid` points in $\log_{10} t$, the median of the samples within
       `smooth` decades, or of the `min_samples` nearest where the samples are
       sparser (any spacing works: log-spaced, or every SGD step, which is
       sparse in log-time at early times), placed at the median log-time of
       its samples; the median removes spikes, the spread of the samples gives
       each level a standard error. The analysis grid spans these centres;
    2. a Gaussian of standard deviation `smooth` decades averages the noise;
    3. the log-slope $s = d\ln L / d\ln t$ by finite differences. Drops are
       where $|s| >$ `drop_slope` (a switch-on is steep in log-log: the loss
       falls by O(1) within a fraction of its time), with calm gaps shorter
       than `min_length` inside a drop closed, and a steep run that changes
       the level by less than `min_drop` or than 4 standard errors dropped as
       a wiggle of the noise. The stretches between drops lasting at least
       `min_length` decades are the candidates;
    4. a candidate is a plateau if it has a flat core: where the slope
       averaged over `min_length` decades is below `2 slope_tol`, and where the
       spike-robust least-squares slope of the raw samples (from the first to
       the last core point) is below `slope_tol` to within one standard error
       and known to better than `slope_tol / 2`. Its level is the median of
       those samples. A curve without any drop is one plateau if its fitted
       log-log slope is below `slope_tol`, else it has none (a power law
       $t^{-\gamma}$ with `slope_tol` $< \gamma$);
    5. neighbouring plateaus whose levels differ by less than a fraction
       `min_drop` are merged.

    A plateau's `start` and `end` are the ends of its stretch between drops.
    Runs eagerly in numpy (the number of plateaus depends on the data).

    **Arguments:**

    - `ts`: times, shape `(T,)`, strictly increasing and `> 0`.
    - `loss`: the loss at `ts`, shape `(T,)`, finite.
    - `drop_slope`: `|d ln L / d ln t|` above which the curve is dropping
      (default 1).
    - `slope_tol`: `|d ln L / d ln t|` below which it is flat (default 0.15).
    - `min_length`: shortest stretch between drops, in decades (default 0.05).
    - `min_drop`: smallest relative change between plateau levels (default 0.1).
    - `smooth`: smoothing width in decades (default 0.02).
    - `floor`: losses below it are raised to it, so that a curve falling to 0
      ends on a plateau at `floor` (default `1e-6 max(loss)`); must be `> 0`.
    - `n_grid`: points of the log-time grid (default 1024).
    - `min_samples`: fewest samples behind each local median (default 9).

    **Returns:** a `Plateaus`.

    **Raises:** `ValueError` for malformed input (shapes, non-positive or
    non-increasing times, non-finite losses, a non-positive maximum or `floor`,
    bad options).
    """
    ts = np.asarray(ts, np.float64)
    loss = np.asarray(loss, np.float64)
    if ts.ndim != 1 or ts.shape[0] < 8:
        raise ValueError(f"`ts` must be 1-D with at least 8 samples, got {ts.shape}.")
    if loss.shape != ts.shape:
        raise ValueError(f"`loss` must have shape {ts.shape}, got {loss.shape}.")
    if not (np.all(np.isfinite(ts)) and np.all(ts > 0) and np.all(np.diff(ts) > 0)):
        raise ValueError("`ts` must be finite, > 0 and strictly increasing.")
    if not np.all(np.isfinite(loss)):
        raise ValueError("`loss` contains NaN or inf.")
    options = dict(
        drop_slope=drop_slope, slope_tol=slope_tol, min_length=min_length, smooth=smooth
    )
    for name, value in options.items():
        if not (np.isfinite(value) and value > 0):
            raise ValueError(f"`{name}` must be > 0, got {value}.")
    if not slope_tol < drop_slope:
        raise ValueError(
            f"`slope_tol` ({slope_tol}) must be below `drop_slope` ({drop_slope})."
        )
    if not (0 < min_drop < 1):
        raise ValueError(f"`min_drop` must be in (0, 1), got {min_drop}.")
    top = float(np.max(loss))
    if top <= 0:
        raise ValueError("`loss` must have a positive maximum (log-scale detection).")
    floor = 1e-6 * top if floor is None else float(floor)
    if not (np.isfinite(floor) and floor > 0):
        raise ValueError(f"`floor` must be > 0, got {floor}.")
    n_grid, min_samples = int(n_grid), int(min_samples)
    if n_grid < 16:
        raise ValueError(f"`n_grid` must be >= 16, got {n_grid}.")
    if min_samples < 1:
        raise ValueError(f"`min_samples` must be >= 1, got {min_samples}.")

    u = np.log10(ts)
    y_raw = np.log(np.maximum(loss, floor))
    # 1-2. a robust local level: around each point of a grid in log-time, the
    # median of the raw samples within `smooth` decades, widened to the
    # `min_samples` nearest where the samples are sparser (early times of an
    # every-step record), placed at the window's median log-time. The analysis
    # grid spans these centres (no extrapolation at the ends, where windows are
    # one-sided); then a Gaussian of `smooth` decades with odd-reflected ends
    probe = np.linspace(u[0], u[-1], n_grid)
    lo = np.searchsorted(u, probe - smooth, "left")
    hi = np.searchsorted(u, probe + smooth, "right")
    few = hi - lo < min_samples
    centre = np.searchsorted(u, probe[few])
    lo_few = np.clip(centre - min_samples // 2, 0, max(u.size - min_samples, 0))
    lo[few], hi[few] = lo_few, np.minimum(lo_few + min_samples, u.size)
    pairs = sorted({(int(a), int(b)) for a, b in zip(lo, hi)})
    u_c = np.array([np.median(u[a:b]) for a, b in pairs])
    y_c = np.array([np.median(y_raw[a:b]) for a, b in pairs])
    # standard error of each local median, from the spread of its samples
    # (1.4826 MAD estimates a standard deviation, a median's error is 1.2533
    # sd / sqrt(n) for Gaussian noise)
    se_c = np.array(
        [
            1.2533 * 1.4826 * np.median(np.abs(y_raw[a:b] - m)) / np.sqrt(b - a)
            for (a, b), m in zip(pairs, y_c)
        ]
    )
    u_c, keep = np.unique(u_c, return_index=True)
    y_c, se_c = y_c[keep], se_c[keep]
    if u_c.size < 2:
        raise ValueError(
            "Too few samples for the smoothing: give more samples than "
            f"`min_samples` ({min_samples}) spread over time."
        )
    grid = np.linspace(u_c[0], u_c[-1], n_grid)
    du = grid[1] - grid[0]
    y = _gaussian_smooth(np.interp(grid, u_c, y_c), smooth / du)
    se = np.interp(grid, u_c, se_c)
    # 3. the log-slope; stretches between drops
    slope = np.gradient(y, grid) / np.log(10)
    calm = np.abs(slope) <= drop_slope
    # noise can split one drop into several steep runs: a calm gap shorter than
    # `min_length` between two steep runs is part of the drop
    edges = np.diff(np.concatenate([[0], calm.astype(np.int8), [0]]))
    for a, b in zip(np.flatnonzero(edges == 1), np.flatnonzero(edges == -1) - 1):
        if a > 0 and b < n_grid - 1 and grid[b] - grid[a] < min_length:
            calm[a : b + 1] = False
    # a steep run that changes the level by less than `min_drop`, or by less
    # than 4 standard errors of the local levels, is a wiggle of the noise
    edges = np.diff(np.concatenate([[0], (~calm).astype(np.int8), [0]]))
    for a, b in zip(np.flatnonzero(edges == 1), np.flatnonzero(edges == -1) - 1):
        before, after = max(a - 1, 0), min(b + 1, n_grid - 1)
        change = abs(y[after] - y[before])
        noise = 4 * np.hypot(se[before], se[after])
        if change < max(-np.log1p(-min_drop), noise):
            calm[a : b + 1] = True
    edges = np.diff(np.concatenate([[0], calm.astype(np.int8), [0]]))
    stretches = list(zip(np.flatnonzero(edges == 1), np.flatnonzero(edges == -1) - 1))
    # the slope averaged over `min_length` decades: what "flat" is tested on
    half = max(1, int(round(0.5 * min_length / du)))
    ahead = np.minimum(np.arange(n_grid) + half, n_grid - 1)
    behind = np.maximum(np.arange(n_grid) - half, 0)
    span = (grid[ahead] - grid[behind]) * np.log(10)
    mean_slope = (y[ahead] - y[behind]) / span
    # 4. plateaus: stretches with a flat core. Without any drop there is no
    # staircase: the whole curve is one plateau if its fitted log-log slope is
    # flat, else there is none (a power law)
    if calm.all():
        fitted = np.polyfit(u, y_raw, 1)[0] / np.log(10)
        stretches = [(0, n_grid - 1)] if abs(fitted) < slope_tol else []
    found: list[list] = []
    for a, b in stretches:
        if grid[b] - grid[a] < min_length:
            continue
        core = np.flatnonzero(np.abs(mean_slope[a : b + 1]) < 2 * slope_tol)
        if core.size == 0:
            continue
        # certify the core on the raw samples from its first to its last
        # point: their (spike-robust) least-squares log-log slope must be below
        # `slope_tol` to within one standard error, and measured well enough
        # to tell (two standard errors below `slope_tol`); a noise dip of a
        # power law fails this
        # (a stretch at an end of the grid reaches the end of the data)
        lo = grid[a + core[0]] - du / 2 if a > 0 else u[0]
        hi = grid[a + core[-1]] + du / 2 if b < n_grid - 1 else u[-1]
        inside = (u >= lo) & (u <= hi)
        fit, fit_err = _robust_slope(u[inside] * np.log(10), y_raw[inside])
        if not (abs(fit) < slope_tol + fit_err and 2 * fit_err < slope_tol):
            continue
        level = float(np.median(np.maximum(loss[inside], floor)))
        # 5. merge with the previous plateau at the same level
        if found and abs(np.log(level / found[-1][2])) < -np.log1p(-min_drop):
            found[-1][1] = b
        else:
            found.append([a, b, level])

    starts = np.array([10 ** grid[a] for a, _, _ in found])
    ends = np.array([10 ** grid[b] for _, b, _ in found])
    if found:  # a plateau at an end of the grid extends to the end of the data
        if found[0][0] == 0:
            starts[0] = ts[0]
        if found[-1][1] == n_grid - 1:
            ends[-1] = ts[-1]
    levels = np.array([lvl for _, _, lvl in found])
    drops = levels[:-1] - levels[1:]
    drop_times = []
    smooth_loss = np.exp(y)
    for (_, b0, l0), (a1, _, l1) in zip(found[:-1], found[1:]):
        seg = np.arange(b0, a1 + 1)
        vals = smooth_loss[seg] - 0.5 * (l0 + l1)
        cross = np.flatnonzero(np.sign(vals[:-1]) != np.sign(vals[1:]))
        if cross.size:
            i = cross[0]
            frac = vals[i] / (vals[i] - vals[i + 1])
            drop_times.append(10 ** (grid[seg[i]] + frac * du))
        else:
            drop_times.append(10 ** (0.5 * (grid[b0] + grid[a1])))
    return Plateaus(
        start=jnp.asarray(starts),
        end=jnp.asarray(ends),
        level=jnp.asarray(levels),
        drop=jnp.asarray(drops),
        drop_times=jnp.asarray(np.asarray(drop_times)),
    )
