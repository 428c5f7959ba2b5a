r"""Power laws from many unresolved modes: the exponent
$\gamma = (\alpha + 2\beta - 1)/(\alpha + \beta)$ (rich) or
$(\alpha + 2\beta - 1)/\alpha$ (lazy), and the refined sharp-switch sum."""

from __future__ import annotations

import math
from typing import Literal

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Float

from .._checks import check_ndim, check_shape, error_if, is_concrete, positive
from ..tasks.interactions import LowRankInteractions
from ..tasks.lotka_volterra import LotkaVolterra
from ._sharp_switch import is_diagonal


# ---------------------------------------------------------------------------
# Power laws
# ---------------------------------------------------------------------------


def power_law_exponent(
    alpha: float, beta: float, regime: Literal["rich", "lazy"] = "rich"
) -> float:
    r"""The exponent `gamma` of `L(t) ~ t^-gamma` for power-law spectra.

    With `lam_k = k^-alpha` (so `B_kk ~ k^-alpha`) and target scales
    `m*_k = k^-beta` (see the documentation's theory pages):

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
    r"""The refined sharp-switch loss of independent modes (see the
    documentation's theory pages).

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

    **Raises:** `ValueError` if `B` is not diagonal (under `jit`, for a traced
    dense `B`, a runtime error with the same message) or `m0`/`ts` are malformed.
    """
    if not isinstance(lv, LotkaVolterra):
        raise ValueError(f"`lv` must be a LotkaVolterra system, got {type(lv)}.")
    p = lv.p
    diag = _independent_modes(lv)
    m0 = jnp.asarray(m0)
    if m0.ndim == 0:
        m0 = jnp.broadcast_to(m0, (p,))
    check_shape("m0", m0, (p,))
    m0 = positive("m0", m0)
    ts = jnp.asarray(ts)
    check_ndim("ts", ts, 1, "a 1-D array of times")
    return _sharp_switch_sum(lv, diag, m0, ts)


@eqx.filter_jit
def _sharp_switch_sum(lv, diag, m0, ts):
    # one compiled call (not ~25 small ones when called eagerly)
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


def _independent_modes(lv: LotkaVolterra) -> Float[Array, " p"]:
    """The diagonal of `B`, checked to be all of `B`: interactions diagonal by
    their structure need no check (`O(p)`); a dense `B` is checked to round-off,
    eagerly or with `eqx.error_if` when traced; a diagonal plus a low-rank part
    is refused (never densified)."""
    msg = "`sharp_switch_loss` is for independent modes: `lv.B` must be diagonal."
    inter = lv.interactions
    if inter.is_diagonal():
        return inter.diagonal()
    if isinstance(inter, LowRankInteractions):
        raise ValueError(msg + f" It has a rank-{inter.rank} part.")
    B = inter.as_matrix()  # dense: checked entry by entry
    if is_concrete(B):
        if not is_diagonal(np.asarray(B)):
            raise ValueError(msg)
        return jnp.diag(B)
    off = jnp.max(jnp.abs(B - jnp.diag(jnp.diag(B))))
    tol = 100 * jnp.finfo(B.dtype).eps * jnp.max(jnp.abs(B))
    return jnp.diag(error_if(B, off > tol, msg))
