r"""The sharp-switch dynamics of a Lotka-Volterra system, eagerly in numpy
(private): the event loop behind `singular_limit` and `switch_on_times`, the
closed form of independent modes, and their argument checks."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .._checks import check_shape, is_concrete, static_int
from ..tasks.lotka_volterra import LotkaVolterra
from .nnqp import nnqp_core


def is_diagonal(B: np.ndarray) -> bool:
    """Whether `B`'s off-diagonal part is round-off (100 eps of its largest entry)."""
    off = B - np.diag(np.diag(B))
    scale = np.max(np.abs(B)) if B.size else 0.0
    return bool(np.max(np.abs(off), initial=0.0) <= 100 * np.finfo(B.dtype).eps * scale)


def require_concrete(name: str, x, function: str):
    """Raise a `ValueError` naming `name` if `x` holds a tracer: `function` runs
    an event loop in numpy, eagerly."""
    if not is_concrete(x):
        raise ValueError(
            f"`{function}` runs eagerly (an event loop in numpy) and needs concrete "
            f"values, but `{name}` is traced; call it outside `jax.jit`, "
            "`jax.vmap` and `jax.grad`."
        )


class LVNumpy(NamedTuple):
    """The system in float64 numpy: `B` dense (None when diagonal), its diagonal,
    the effective rates `r - decay`, and whether the modes are independent."""

    B: np.ndarray | None
    diag: np.ndarray
    r_eff: np.ndarray
    diagonal: bool


def lv_numpy(lv: LotkaVolterra, function: str) -> LVNumpy:
    """`lv` in numpy; interactions diagonal by their structure are never
    densified (the event loop of coupled modes is dense numpy: `O(p^2)`)."""
    if not isinstance(lv, LotkaVolterra):
        raise ValueError(f"`lv` must be a LotkaVolterra system, got {type(lv)}.")
    require_concrete("lv", lv, function)
    # numpy from here: jnp operations would be staged (traced) inside a jit;
    # the interactions' own, on concrete values, run now
    r_eff = np.asarray(lv.r, np.float64) - float(lv.decay)
    inter = lv.interactions
    with jax.ensure_compile_time_eval():
        diag = np.array(inter.diagonal(), np.float64)
        if inter.is_diagonal():
            return LVNumpy(None, diag, r_eff, True)
        B = np.asarray(inter.as_matrix(), np.float64)
    B = 0.5 * (B + B.T)
    if is_diagonal(B):
        return LVNumpy(None, diag, r_eff, True)
    return LVNumpy(B, diag, r_eff, False)


class Trace(NamedTuple):
    times: list  # event times (in the units of the levels' time)
    modes: list
    ons: list
    jump_times: list  # distinct event times
    plateaus: list  # equilibrium m on each plateau (before the first event too)
    first_on: np.ndarray  # first switch-on time per mode (inf: never)


def event_loop(B, r_eff, level0, *, corrected: bool, max_events: int) -> Trace:
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
    solve_batch = jax.vmap(nnqp_core, in_axes=(None, None, 0, None))

    def solve(mask):
        sol = nnqp_core(Bj, rj, jnp.asarray(mask), max_iter)
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
    trace = Trace([], [], [], [], [m_eq.copy()], np.full(p, np.inf))
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


def check_bounded(diag, r_eff):
    """Independent modes: refuse one that grows (`r_k - decay > 0`) unopposed."""
    grows = r_eff > 0
    if np.any(grows & (diag <= 0)):
        k = int(np.flatnonzero(grows & (diag <= 0))[0])
        raise ValueError(
            f"Mode {k} has r_k - decay > 0 and B_kk = 0: it grows without bound "
            "(no bounded equilibrium)."
        )
    return grows


def diagonal_trace(diag, r_eff, level0, threshold) -> Trace:
    """Independent modes (`diag` = `B_kk`): every mode grows at `r_k` from
    `level0_k` to `threshold_k`."""
    p = r_eff.shape[0]
    grows = check_bounded(diag, r_eff)
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
    return Trace(
        times.tolist(),
        order.tolist(),
        [True] * order.size,
        jump_times,
        plateaus,
        t_on,
    )


def check_m0(m0, p: int, function: str) -> np.ndarray:
    """`m0` (shape `(p,)` or a scalar, finite, > 0) as float64 numpy, shape `(p,)`."""
    require_concrete("m0", m0, function)
    m0 = np.asarray(m0, np.float64)  # numpy: jnp would be staged inside a jit
    if m0.ndim == 0:
        m0 = np.full(p, m0)
    check_shape("m0", m0, (p,))
    if not np.all(np.isfinite(m0) & (m0 > 0)):
        bad = m0[~(np.isfinite(m0) & (m0 > 0))][0]
        raise ValueError(f"`m0` must be strictly positive and finite; got {bad:.3g}.")
    return m0


def check_max_events(max_events, p: int) -> int:
    """The cap on events: an int, default `10 p + 10`."""
    if max_events is None:
        return 10 * p + 10
    return static_int("max_events", max_events)
