r"""Which shape a loss curve has (`select_model`): a staircase of a few logistic
modes, a power law with a floor, or a staircase turning into a power law,
chosen by the Bayesian information criterion on the residuals of $\log L$.

The three candidates are one family (fitted in one vmapped, compiled call):

$$L(t) = L_\infty + \sum_{k \le K} \frac{h_k}{\big(1 + e^{s_k (t / t_k - 1)}\big)^2}
+ c\,(t + t_0)^{-\gamma}$$

- staircase: `fit_staircase`'s model (`staircase.py`: `K` drops each with its
  own height, position, steepness and asymmetry, between a sigmoid in
  `log t` and an isolated mode's logistic in `t`, `K` chosen by BIC), scored
  here on the same bins as the others with `k = 2 + 4K`, and `n_modes` the
  drops it sees (`read_plateaus`: within the data, overlapping ones counted
  once, those within the noise not counted); a candidate only where the fit
  ends on a plateau (a last drop still falling at the end is a tail);
- power law: `K = 0` (`fit_power_law`'s model on the whole curve);
- staircase turning into a power law: the drops before `fit_power_law`'s
  window (of `model_plateaus`: the staircase refitted before the window
  where the whole curve's fit ends falling), and the power law.

$\mathrm{BIC} = n \ln(\mathrm{RSS}/n) + k \ln n$, with `RSS` the sum of squared
residuals of $\log L$ over the `n` points and `k` the number of parameters
(`2 + 4K`, `4`, `4 + 3K`): a lower value is better; a difference above 10 is
"very strong" evidence (Kass and Raftery, 1995)."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Float

from .._curves import first_crossing
from ._least_squares import host_curve, log_noise, nothing_to_fit, robust_least_squares
from .plateaus import as_plateaus, model_plateaus
from .power_law import fit_power_law, log_bins, pad_bins, power_law_starts
from .staircase import Staircase


#: The most modes a staircase candidate has (one compilation for every curve).
_MAX_MODES = 8
_NAMES = ("staircase", "power law", "staircase turning into a power law")


class ModelSelection(eqx.Module):
    """The shape of a loss curve (`select_model`).

    **Fields:**

    - `best`: `"staircase"`, `"power law"` or `"staircase turning into a power
      law"`; `""` where none could be fitted (see `reason`).
    - `runner_up`: the second best, and `why`: why it lost (its BIC difference
      and rms).
    - `criterion`: `"BIC"`.
    - `scores`: the BIC of each candidate fitted (a dict; a candidate missing
      needs what the curve lacks: drops for a staircase, a power-law range for
      the mixed one).
    - `rms`: the rms residual of `log L` of each candidate.
    - `n_modes`: the number of logistic modes of the best model.
    - `reason`: why nothing was selected (`""` otherwise): nothing to fit, or
      no candidate fitting the 95% of points closest to it to within
      `max(3 noise, 0.1)` in `log L` (`scores` and `rms` are then kept).
    - `theta`: the best model's fitted parameters in the family's scaled
      coordinates (see `curve`; empty where nothing was selected or the
      staircase won: its parameters are `staircase`'s).
    - `staircase`: the staircase fitted (a `Staircase`: its plateau `levels`,
      `drop_times`, `widths`, `floor`; `None` where the curve had nothing to
      fit), whichever shape won; and `ambiguous`: what the data cannot tell
      about its drops (`""` when nothing).

    **Methods:** `curve(ts)`, the best model's loss at any times, shape `(T,)`.
    """

    best: str = eqx.field(static=True)
    runner_up: str = eqx.field(static=True)
    why: str = eqx.field(static=True)
    criterion: str = eqx.field(static=True)
    scores: dict
    rms: dict
    n_modes: int = eqx.field(static=True)
    reason: str = eqx.field(static=True, default="")
    theta: Float[Array, " P"] = eqx.field(default_factory=lambda: jnp.zeros((0,)))
    mask: Float[Array, " K"] = eqx.field(default_factory=lambda: jnp.zeros((0,)))
    power: float = eqx.field(static=True, default=0.0)
    t_ref: float = eqx.field(static=True, default=1.0)
    l_ref: float = eqx.field(static=True, default=1.0)
    staircase: Staircase | None = None
    ambiguous: str = eqx.field(static=True, default="")

    def curve(self, ts: Float[ArrayLike, " T"]) -> Float[Array, " T"]:
        """The best model's loss at `ts` (shape `(T,)`, the default float; NaN
        where nothing was selected)."""
        if self.best == "staircase" and self.staircase is not None:
            with np.errstate(divide="ignore"):  # t = 0: ln t = -inf
                return self.staircase.curve(np.asarray(ts))
        with np.errstate(under="ignore"):
            loss = np.exp(self.log_curve(ts))
        return jnp.asarray(loss, jnp.result_type(float))

    def log_curve(self, ts: Float[ArrayLike, " T"]) -> np.ndarray:
        """The best model's `ln L` at `ts` in numpy float64, shape `(T,)`
        (NaN where nothing was selected): a curve far below float32's range,
        or one compared in `ln L` to a few 1e-7, keeps its shape."""
        ts = np.asarray(ts, np.float64)
        if self.best == "staircase" and self.staircase is not None:
            with np.errstate(divide="ignore"):  # t = 0: ln t = -inf
                return self.staircase.log_curve(ts)
        if self.theta.size == 0:
            return np.full(ts.shape, np.nan)
        with jax.enable_x64(True):
            f64 = (np.asarray(a, np.float64) for a in (self.theta, self.mask))
            theta, mask = (jnp.asarray(a) for a in f64)
            ly = _log_model(theta, jnp.asarray(ts / self.t_ref), mask, self.power)
            return np.log(self.l_ref) + np.asarray(ly, np.float64)


def _log_model(theta, u, modes, power):
    """`log L` of the family at `theta = (L_inf, log c, log u0, log gamma, (log
    h_k, log t_k, log s_k) for k < _MAX_MODES)`, with `modes` (0/1 per mode)
    and `power` (0/1) switching the terms; NaN where `L <= 0`."""
    h, tk, s = (jnp.exp(theta[4 + i :: 3]) for i in range(3))
    z = jnp.clip(s[:, None] * (u[None, :] / tk[:, None] - 1), -350.0, 350.0)
    stairs = jnp.sum(modes[:, None] * h[:, None] / (1 + jnp.exp(z)) ** 2, axis=0)
    law = power * jnp.exp(theta[1] - jnp.exp(theta[3]) * jnp.log(u + jnp.exp(theta[2])))
    total = theta[0] + stairs + law
    ok = total > 0
    return jnp.where(ok, jnp.log(jnp.where(ok, total, 1.0)), jnp.nan)


@eqx.filter_jit
def _fit_candidates(u, y, weights, thetas, modes, power):
    """Fit every candidate (rows of `thetas`, `modes`, `power`), vmapped: their
    parameters and weighted residual sums of squares."""

    def one(theta, m, p):
        def residual(th):
            return _log_model(th, u, m, p) - y

        best = robust_least_squares(residual, weights, 0.1, theta, 400, 100, 0.03)
        return best.theta, jnp.sum(weights * best.res**2)

    return jax.vmap(one)(thetas, modes, power)


def _stairs_start(levels, drop_times, t_ref, l_ref):
    """Mode parameters `(log h, log t_k, log s)` for the drops of a staircase,
    padded to `_MAX_MODES` (unused modes: switched off by the mask)."""
    rows = np.zeros((_MAX_MODES, 3))
    rows[:, 2] = np.log(15.0)
    n = min(len(drop_times), _MAX_MODES)
    h = np.maximum(levels[:-1] - levels[1:], 1e-12)[:n] / l_ref
    rows[:n] = np.column_stack(
        [np.log(h), np.log(drop_times[:n] / t_ref), np.full(n, np.log(15.0))]
    )
    return rows.ravel(), n


def select_model(
    ts: Float[ArrayLike, " T"], loss: Float[ArrayLike, " T"]
) -> ModelSelection:
    r"""Choose the shape of a loss curve: a staircase of logistic modes, a power
    law with a floor, or a staircase turning into a power law, by the BIC of
    each fitted to the whole curve (see the module notes), reported with the
    runner-up and why it lost.

    The staircase's modes start at the drops of `detect_plateaus` (at most 8),
    the power law at `fit_power_law`'s fit; each candidate is then fitted to
    all points (log-binned for long records) by Adam and Levenberg-Marquardt.

    **Arguments:**

    - `ts`, `loss`: the curve, shape `(T,)`, times increasing `>= 0`.

    **Returns:** a `ModelSelection` (`best=""` with a `reason` for a curve with
    nothing to fit, or where even the best candidate misses the 95% of the
    points closest to it by an rms in $\log L$ above `max(3 noise, 0.1)`,
    `noise` the scatter of $\log L$ about a smooth curve: `fit_spectrum`'s
    bar, robust to spikes). The staircase is a candidate only where its fit
    ends on a plateau (`read_plateaus`: a last drop still falling at the end
    is a power law's tail); its plateaus are `model_plateaus`'.

    **Raises:** `ValueError` for a malformed curve.
    """
    t, y = host_curve(ts, loss)
    nothing = nothing_to_fit(t, y)
    if nothing:
        return ModelSelection("", "", "", "BIC", {}, {}, 0, reason=nothing)
    pos = y > 0
    t, y = t[pos], y[pos]
    t_ref, l_ref = t[-1], np.exp(np.mean(np.log(y)))
    stairs, plateaus, n_drops = None, None, 0
    if np.sum(t > 0) >= 8:
        stairs, read = model_plateaus(t[t > 0], y[t > 0])
        plateaus = as_plateaus(read)
        # a staircase ends on a plateau: one whose last drop still falls at
        # the end of the data is a tail (a power law's), no candidate
        n_drops = 0 if read.ends_falling else read.n_drops
    # in float64 whatever the default: in float32 the mixed candidate's fit
    # stalls (the example curve came out a power law, rms 0.11 against 0.05)
    with jax.enable_x64(True):
        cands = _candidates(t, y, t_ref, l_ref, plateaus)
    chosen = _score(t, y, t_ref, l_ref, *cands, stairs, n_drops)
    # a winner that misses the curve far beyond its noise is no answer
    # (judged on the 95% of the points closest to it: spikes are no regime)
    noise = log_noise(np.log(y))
    chosen = dataclasses.replace(chosen, staircase=stairs)
    miss = _core_rms(chosen, t, y) if chosen.best else 0.0
    if chosen.best and miss > max(3 * noise, 0.1):
        reason = (
            f"no shape fits: the best, {chosen.best}, misses by an rms of "
            f"{miss:.2g} in log L (on the 95% of points closest to it), above "
            f"max(3 x its noise {noise:.2g}, 0.1) (a cutoff or a regime the "
            "three shapes lack)"
        )
        return ModelSelection(
            "",
            "",
            "",
            "BIC",
            chosen.scores,
            chosen.rms,
            0,
            reason=reason,
            staircase=stairs,
        )
    ambiguous = "" if plateaus is None else plateaus.ambiguous
    return dataclasses.replace(chosen, staircase=stairs, ambiguous=ambiguous)


def _candidates(t, y, t_ref, l_ref, plateaus):
    """The candidates' starts `(thetas, modes, power, names)`: the staircase's
    placeholder, the power law from a log-log regression, and the mixed one
    from `plateaus` (a `Plateaus` or `None`) and `fit_power_law`'s fit."""
    law = fit_power_law(t, y, uncertainty="laplace")
    thetas, modes, power, names = [], [], [], []
    # a placeholder row (the staircase is fitted by `fit_staircase`; the
    # batch keeps its shape, one compilation for every curve)
    stairs_row, n = _stairs_start(
        np.array([np.max(y), np.min(y)]),
        np.array([np.sqrt(max(t[0], t[t > 0][0]) * t[-1])]),
        t_ref,
        l_ref,
    )
    thetas.append(np.concatenate([[np.min(y) / l_ref, 0.0, 0.0, 0.0], stairs_row]))
    modes.append(np.arange(_MAX_MODES) < n)
    power.append(0.0)
    names.append(_NAMES[0])
    # the power law on the whole curve, from a log-log regression
    u, ly = t / t_ref, np.log(y / l_ref)
    start = power_law_starts(u, ly, np.ones(t.size, bool), 1, jax.random.key(0))[0]
    thetas.append(np.concatenate([start, np.zeros(3 * _MAX_MODES)]))
    modes.append(np.zeros(_MAX_MODES, bool))
    power.append(1.0)
    names.append(_NAMES[1])
    if law.found and plateaus is not None and len(plateaus) >= 1:
        # the drops before the power law's window, and the one after the last
        # plateau where that plateau ends before the window (a drop straight
        # into the power law, with no plateau after it for `detect_plateaus`)
        levels = list(np.asarray(plateaus.level))
        drops = list(np.asarray(plateaus.drop_times))
        last_end = float(plateaus.end[-1])
        if last_end < law.window[0]:
            onset = float(law(np.array(2 * last_end))[()])
            drops.append(
                first_crossing(t, y, 0.5 * (levels[-1] + onset), interpolate="linear")
            )
            levels.append(onset)
        before = np.flatnonzero(np.array(drops) < law.window[0])
        if before.size and np.all(np.isfinite(drops)):
            n_before = before.size
            mixed_modes, n = _stairs_start(
                np.array(levels[: n_before + 1]),
                np.array(drops[:n_before]),
                t_ref,
                l_ref,
            )
            start = _law_start(law, t_ref, l_ref)
            thetas.append(np.concatenate([start, mixed_modes]))
            modes.append(np.arange(_MAX_MODES) < n)
            power.append(1.0)
            names.append(_NAMES[2])
    return thetas, modes, power, names


def _core_rms(chosen, t, y):
    """The rms residual of `log L` about the chosen model on the 95% of the
    points (`t > 0`) closest to it."""
    pos = t > 0
    with np.errstate(divide="ignore", invalid="ignore"):
        res = chosen.log_curve(t[pos]) - np.log(y[pos])  # float64
    res = np.sort(np.abs(np.where(np.isfinite(res), res, np.inf)))
    keep = res[: max(int(np.ceil(0.95 * res.size)), 1)]
    return float(np.sqrt(np.mean(keep**2)))


def _law_start(fit, t_ref, l_ref):
    """`fit_power_law`'s parameters in the family's scaled coordinates."""
    gamma = float(fit.gamma)
    return np.array(
        [
            float(fit.L_inf) / l_ref,
            np.log(float(fit.c) / l_ref * t_ref**-gamma),
            np.log(max(float(fit.t0), 1e-12) / t_ref),
            np.log(gamma),
        ]
    )


def _score(
    t, y, t_ref, l_ref, thetas, modes, power, names, stairs, n_drops
) -> ModelSelection:
    """Fit the candidates and rank them by BIC (the staircase already fitted:
    `stairs`, scored on the same bins, or left out where `None` or without
    a drop seen)."""
    tb, lyb, wb, within = log_bins(t / t_ref, np.log(y / l_ref))
    m = tb.size
    u, ly = pad_bins(tb, lyb)
    w = np.concatenate([wb, np.zeros(u.size - m)])
    dtype = jnp.result_type(float)
    k = len(names)
    # the batch padded to 3 candidates (one compilation for every curve)
    rows = np.stack(thetas + [thetas[0]] * (3 - k))
    mask = np.stack(modes + [modes[0]] * (3 - k)).astype(float)
    on = np.array(power + [power[0]] * (3 - k))
    with jax.enable_x64(True):  # (see `select_model`)
        fitted, rss = _fit_candidates(
            *(jnp.asarray(a, jnp.float64) for a in (u, ly, w, rows, mask, on))
        )
        fitted, rss = np.asarray(fitted), np.asarray(rss)
    n = float(np.sum(wb))
    scores, rms, sizes = {}, {}, {}
    for i, name in enumerate(names):
        total = float(rss[i]) + within
        params = 4 * int(on[i]) + 3 * int(mask[i].sum()) + (1 - int(on[i]))
        if name == _NAMES[0]:
            if stairs is None or n_drops == 0:
                continue
            fitted_ly = stairs.log_curve(tb * t_ref) - np.log(l_ref)  # float64
            total = float(np.sum(wb * (fitted_ly - lyb) ** 2)) + within
            params = 2 + 4 * stairs.n_modes
        if np.isfinite(total):
            scores[name] = n * np.log(max(total, 1e-300) / n) + params * np.log(n)
            rms[name] = float(np.sqrt(total / n))
            sizes[name] = n_drops if name == _NAMES[0] else int(mask[i].sum())
    if not scores:
        return ModelSelection("", "", "", "BIC", {}, {}, 0, reason="every fit failed")
    ranked = sorted(scores, key=scores.get)
    best = ranked[0]
    runner = ranked[1] if len(ranked) > 1 else ""
    why = ""
    if runner:
        why = (
            f"BIC {scores[runner] - scores[best]:.3g} higher (rms of log L "
            f"{rms[runner]:.3g} against {rms[best]:.3g})"
        )
    i = names.index(best)
    if best == _NAMES[0]:  # fitted by `fit_staircase`: its row is a placeholder
        fitted, mask = np.zeros((len(names), 0)), np.zeros((len(names), 0))
    return ModelSelection(
        best,
        runner,
        why,
        "BIC",
        scores,
        rms,
        sizes[best],
        theta=jnp.asarray(fitted[i], dtype),
        mask=jnp.asarray(mask[i], dtype),
        power=float(on[i]),
        t_ref=float(t_ref),
        l_ref=float(l_ref),
    )
