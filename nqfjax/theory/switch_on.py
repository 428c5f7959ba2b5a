"""When each mode switches on (`switch_on_times`): exact logistic half-way times
for independent modes, the event-driven sharp-switch limit with a first-order
correction for interacting ones."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Float

from .._checks import eager_only
from ..tasks.lotka_volterra import LotkaVolterra
from ._sharp_switch import (
    check_bounded,
    check_m0,
    check_max_events,
    event_loop,
    lv_numpy,
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

    (see the documentation's theory pages); `inf` for modes with
    $\tilde r_k \le 0$, NaN where $m_{0,k} \ge m^*_k$ (no half-way point);
    negative where the mode starts past half-way.

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

    Eager only: an event loop in numpy, on concrete arguments; under `jax.jit`,
    `vmap`, `grad` or `shard_map` it raises a `ValueError` saying so.

    **Arguments:**

    - `lv`: the system.
    - `m0`: initial values, shape `(p,)` or a scalar, strictly positive.
    - `corrected`: use the first-order correction (interacting modes only).
    - `max_events`: cap on events, an int (default `10 p + 10`).

    **Returns:** times in `t`, shape `(p,)`.

    **Raises:** `ValueError` for bad `m0`, a system without a bounded
    equilibrium, or a traced argument (it names the argument).
    """
    eager_only("switch_on_times", "the events are found on the host", m0=m0, lv=lv)
    sys = lv_numpy(lv, "switch_on_times")
    p = lv.p
    m0 = check_m0(m0, p, "switch_on_times")
    max_events = check_max_events(max_events, p)
    dtype = lv.r.dtype
    if sys.diagonal:
        grows = check_bounded(sys.diag, sys.r_eff)
        with np.errstate(divide="ignore", invalid="ignore"):
            mstar = sys.r_eff / np.where(sys.diag > 0, sys.diag, 1)
            t = np.log(mstar / m0 - 1) / sys.r_eff
        return jnp.asarray(np.where(grows, t, np.inf), dtype)
    trace = event_loop(
        sys.B, sys.r_eff, np.log(m0), corrected=corrected, max_events=max_events
    )
    return jnp.asarray(trace.first_on, dtype)
