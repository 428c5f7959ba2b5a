r"""Power laws fitted to loss curves (`fit_power_law`):
$L(t) = L_\infty + c\,(t + t_0)^{-\gamma}$ on an automatically chosen window,
with an uncertainty for $\gamma$."""

from functools import partial
from typing import Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Float, PRNGKeyArray

from .._checks import eager_only
from .._curves import loglog_slope
from ._least_squares import (
    host_curve,
    laplace_cov,
    nothing_to_fit,
    robust_least_squares,
)
from .plateaus import detect_plateaus
from .window import window_after_staircase


# --------------------------------------------------------------------------------
# power laws


class PowerLawFit(eqx.Module):
    r"""The result of `fit_power_law`: $L(t) = L_\infty + c\,(t + t_0)^{-\gamma}$.

    **Fields:**

    - `gamma`, `gamma_err`: the exponent and its 1-sigma error (by default
      systematic: bootstrap plus window drift; see `uncertainty`).
    - `L_inf`, `c`, `t0`: the other parameters (`c`, `t0` positive; `L_inf`
      may come out slightly negative where the data cannot tell it from 0).
    - `window`: `(t_lo, t_hi)`, the time range fitted (given or auto-chosen).
    - `n_points`: number of points inside the window.
    - `rms`: root-mean-square residual of $\log L$ in the window.
    - `uncertainty`: how `gamma_err` was obtained (`"systematic"`, `"laplace"`
      or `"bootstrap"`).
    - `found`: whether the curve has a power law; if not, `reason` says why (the
      loss is zero, flat or rising, no range of it falls as a power law, or the
      fitted exponent is not distinguishable from 0), and the numbers are NaN.
    """

    gamma: Float[Array, ""]
    gamma_err: Float[Array, ""]
    L_inf: Float[Array, ""]
    c: Float[Array, ""]
    t0: Float[Array, ""]
    window: tuple[float, float] = eqx.field(static=True)
    n_points: int = eqx.field(static=True)
    rms: Float[Array, ""]
    uncertainty: str = eqx.field(static=True)
    found: bool = eqx.field(static=True, default=True)
    reason: str = eqx.field(static=True, default="")

    def __call__(self, ts: Float[ArrayLike, "*T"]) -> Float[Array, "*T"]:
        """The fitted curve at times `ts`."""
        return _power_law_curve(self, jnp.asarray(ts, self.gamma.dtype))


@eqx.filter_jit
def _power_law_curve(fit, ts):
    return fit.L_inf + fit.c * (ts + fit.t0) ** (-fit.gamma)


def _log_model(theta, u):
    """`log(L_inf + c (u + u0)^-gamma)` with `theta = (L_inf, log c, log u0, log
    gamma)`; NaN where the sum is not positive (a rejected step).

    `L_inf` enters linearly, not through its log: a floor that the data cannot
    tell from 0 then has a finite curvature and a symmetric error, where
    `log L_inf -> -inf` would pin it at the boundary and hide its correlation
    with `gamma` (measured: exponents 5 standard errors low on noisy curves
    whose floor was a fifth of their last value)."""
    floor, b, d, e = theta[0], theta[1], theta[2], theta[3]
    total = floor + jnp.exp(b - jnp.exp(e) * jnp.log(u + jnp.exp(d)))
    ok = total > 0
    return jnp.where(ok, jnp.log(jnp.where(ok, total, 1.0)), jnp.nan)


_log_model_jit = jax.jit(_log_model)


@eqx.filter_jit
def _fit_power_law_core(u, y, weights, theta0, delta, lr, steps, polish):
    """Fit from every start in `theta0` (shape `(S, 4)`) and keep the best; its
    Laplace standard error of `gamma` and RMS log-residual in the window. The
    shapes never depend on the window (zero weights outside it), so one
    compilation serves every window and replicate of a given length."""

    def residual(theta):
        return _log_model(theta, u) - y

    # `lax.map`, not `vmap`: batching the solvers' while loops costs 1 s more to
    # trace and lower in every process (measured: 2.0 s against 0.9 s), and a
    # batched loop runs every member to the slowest one's iteration count, so
    # one after another is about as fast (measured: 64 fits of one curve 151 ms
    # against 210 ms batched; the demo's 192 refits 0.49 s against 0.27 s)
    fits = jax.lax.map(
        lambda th: robust_least_squares(
            residual, weights, delta, th, steps, polish, lr
        ),
        theta0,
    )
    best = jax.tree.map(lambda x: x[jnp.argmin(fits.value)], fits)
    cov = laplace_cov(best, weights)
    gamma_err = jnp.exp(best.theta[3]) * jnp.sqrt(cov[3, 3])
    rms = jnp.sqrt(jnp.sum(weights * best.res**2) / jnp.sum(weights))
    return best.theta, gamma_err, rms


@eqx.filter_jit
def _refit_gamma(u, ys, weights, theta, delta, polish):
    """`gamma` refitted (Levenberg-Marquardt from `theta`) for each row of `ys`
    and `weights` (shape `(B, T)`: bootstrap replicates), one after another."""

    def one(y, w):
        def residual(th):
            return _log_model(th, u) - y

        return jnp.exp(
            robust_least_squares(residual, w, delta, theta, 0, polish, 0.0).theta[3]
        )

    return jax.lax.map(lambda yw: one(*yw), (ys, weights))  # see above: not vmap


#: Every fit runs on arrays of this length (the window's points, log-binned
#: where there are more, padded with zero weights), so that one compilation
#: serves every curve, window and replicate.
_LENGTH = 512


def log_bins(t, ly):
    """The window's points as at most `_LENGTH` bins equally spaced in `log t`
    (a point at `t = 0` on its own): the mean of `log L` in each, weighted by its
    count (the same least-squares problem for a model smooth within a bin),
    and the scatter within the bins (their summed squares), for the noise.
    Fewer points are kept as they are (weights 1)."""
    if t.size <= _LENGTH:
        return t, ly, np.ones_like(t), 0.0
    pos = t > 0
    lt = np.log(t[pos])
    edges = np.linspace(lt[0], lt[-1], _LENGTH - int((~pos).any()))[1:-1]
    which = np.searchsorted(edges, lt, side="right") + int((~pos).any())
    which = np.concatenate([np.zeros(int((~pos).sum()), int), which])
    count = np.bincount(which)
    full = count > 0
    mean_ly = np.bincount(which, ly)[full] / count[full]
    mean_t = np.exp(
        np.bincount(which, np.log(np.where(t > 0, t, 1.0)))[full] / count[full]
    )
    mean_t[0] = 0.0 if not pos[0] else mean_t[0]
    within = float(
        np.sum((ly - (np.bincount(which, ly) / np.maximum(count, 1))[which]) ** 2)
    )
    return mean_t, mean_ly, count[full].astype(float), within


def pad_bins(*arrays):
    """`arrays` padded to `_LENGTH` with their last value (weights: pass zeros
    separately)."""
    return [np.concatenate([a, np.full(_LENGTH - a.size, a[-1])]) for a in arrays]


def _systematic_error(u, ly, w, theta, laplace, delta, n_bootstrap, rng, shrink=0.15):
    r"""The uncertainty of `gamma` with its systematic part, from three sets of
    `n_bootstrap` refits (Levenberg-Marquardt from `theta`, one compiled call):

    - noise: the fitted curve plus the residuals with random signs, one sign
      per block of about `n^(1/3)` neighbouring points (a wild block
      bootstrap: it keeps each point's noise level and the residuals'
      correlation), refitted on the whole window: `gamma_b`;
    - the same replicates on a window shrunk at both ends by a uniform fraction
      in `[0, shrink)` of its span in `log t`: `gamma_b'`;
    - the data themselves on those shrunk windows: `gamma_w`.

    $\sigma^2 = \max(\operatorname{var}(\gamma_b), \sigma_L^2) + \max(0,\
    \overline{(\gamma_w - \hat\gamma)^2} - 2\,\overline{(\gamma_b' -
    \gamma_b)^2})$: the statistical error (not below `laplace`, the Laplace
    error $\sigma_L$: refits from the optimum can underexplore a weakly
    identified direction, such as a floor against the exponent), plus the
    drift of the exponent with the window where it exceeds twice what the
    noise alone makes it move (zero on a curve that is a power law throughout
    the window, the whole error where it bends; the
    factor 2 keeps the noise of this estimate, which comes from one data set,
    from inflating the error of a true power law: with 1 it did by 15-20%).
    Floored at 0.01% of `gamma` (a noiseless curve of the model itself has
    replicates equal to round-off, and no exponent is meant to that digit)."""
    n = int(np.count_nonzero(w))
    fitted = np.asarray(_log_model_jit(theta, jnp.asarray(u)))
    lu = np.log(np.maximum(u[:n], u[:n][u[:n] > 0].min() / 2))
    span = lu[-1] - lu[0]
    lo = lu[0] + rng.uniform(0, shrink, (n_bootstrap, 1)) * span
    hi = lu[-1] - rng.uniform(0, shrink, (n_bootstrap, 1)) * span
    inside = (lu >= lo) & (lu <= hi)
    inside[inside.sum(1) < 6] = True
    block = max(1, round(n ** (1 / 3)))
    signs = rng.choice([-1.0, 1.0], (n_bootstrap, -(-n // block)))
    signs = np.repeat(signs, block, axis=1)[:, :n]
    noisy = np.tile(ly, (n_bootstrap, 1))
    noisy[:, :n] = fitted[:n] + signs * (ly - fitted)[:n]
    full = np.broadcast_to(w, noisy.shape)
    shrunk = np.zeros_like(noisy)
    shrunk[:, :n] = inside * w[:n]
    ys = np.concatenate([noisy, noisy, np.broadcast_to(ly, noisy.shape)])
    ws = np.concatenate([full, shrunk, shrunk])
    dtype = theta.dtype
    gammas = np.asarray(
        _refit_gamma(
            jnp.asarray(u, dtype),
            jnp.asarray(ys, dtype),
            jnp.asarray(ws, dtype),
            theta,
            delta,
            30,
        )
    ).reshape(3, n_bootstrap)
    boot, boot_shrunk, data_shrunk = gammas
    gamma = float(np.exp(theta[3]))
    moved = np.mean((data_shrunk - gamma) ** 2)
    drift = moved - 2 * np.mean((boot_shrunk - boot) ** 2)
    noise = max(np.var(boot, ddof=1), laplace**2)
    spread = np.sqrt(noise + max(drift, 0.0))
    return max(float(spread), 1e-4 * gamma)


def fit_power_law(
    ts: Float[ArrayLike, " T"],
    loss: Float[ArrayLike, " T"],
    *,
    window: tuple[float, float] | None = None,
    n_starts: int = 8,
    steps: int = 300,
    learning_rate: float = 0.1,
    huber_delta: float = 0.1,
    uncertainty: Literal["systematic", "laplace", "bootstrap"] = "systematic",
    n_bootstrap: int = 64,
    key: PRNGKeyArray | None = None,
) -> PowerLawFit:
    r"""Fit $L(t) = L_\infty + c\,(t + t_0)^{-\gamma}$ to a loss curve.

    `c`, `t0` and `gamma` are fitted by their logarithms, `L_inf` linearly (a
    floor the data cannot tell from 0 keeps a finite error), on time and loss
    rescaled to order one in the window. The objective is the mean Huber loss
    (threshold `huber_delta`) of the residuals of $\log L$: multiplicative noise
    weighs evenly across decades, and an outlier (a step) does not dominate.
    `n_starts` starts (a log-log regression and random perturbations of it)
    each run `steps` of Adam, then at most 30 steps of
    `optimistix.LevenbergMarquardt`; the best wins.

    **Window.** `window=None` chooses it: the longest range of $\log t$ where
    the local log-log slope (over half a decade) stays within 5% of its median,
    plus twice its standard error, with a median above 0.05, and the curve is
    as smooth as its smoothest quarter (white noise passes, a resolved
    staircase does not); where `detect_plateaus` finds a drop inside it, the
    search starts again after the last one. This drops an initial plateau or
    staircase and a final floor or cutoff. Or give `window=(t_lo, t_hi)`.

    **Uncertainty of gamma** (see the how-to on loss curves). `"systematic"`
    (default): a wild block bootstrap of the residuals (`n_bootstrap` refits;
    not below the Laplace error) plus the exponent's drift when the window is
    shrunk at both ends by up to 15% of its span in $\log t$, beyond twice what
    the noise explains; floored at 0.01% of `gamma`. `"laplace"`: the
    Gauss-Newton curvature at the optimum, $\Sigma = s^2 (J^\top J)^{+}$, $s^2 =
    \sum_i \rho_i^2/(n - 4)$ (an underestimate off the model). `"bootstrap"`:
    the spread of `gamma` over `n_bootstrap` refits on resampled points.

    A window of more than 512 points is log-binned first (511 bins equally
    spaced in $\log t$, weighted by their counts: the same least-squares
    problem, one compilation for every curve). Eager only (the window is
    chosen in numpy): under a JAX transformation it raises a `ValueError`.

    **Arguments:**

    - `ts`: times, shape `(T,)`, strictly increasing, `>= 0`.
    - `loss`: the loss at `ts`, shape `(T,)`; points with `loss <= 0` are dropped.
    - `window`: optional `(t_lo, t_hi)`; default automatic (see above).
    - `n_starts`: number of starts (default 8).
    - `steps`, `learning_rate`: Adam steps and peak learning rate.
    - `huber_delta`: Huber threshold on the log-residual (default 0.1).
    - `uncertainty`: `"systematic"`, `"laplace"` or `"bootstrap"`.
    - `n_bootstrap`: bootstrap replicates.
    - `key`: PRNG key for the starts and the bootstrap (default `key(0)`).

    **Nothing to fit** (`found=False`, NaN numbers, the `reason`): a loss that
    is zero, flat or rising, no falling range (or only a staircase), an
    exponent below twice its error, a fitted curve falling by less than 5% over
    its window or a power law (`t > t0`) over less than a decade of it.

    **Returns:** a `PowerLawFit` (callable: the fitted curve).

    **Raises:** `ValueError` for bad shapes, non-finite values, non-increasing or
    negative `ts`, bad options, fewer than 6 positive points in a given
    window, or traced arguments.
    """
    eager_only("fit_power_law", "the window is chosen on the host", ts=ts, loss=loss)
    t, y = host_curve(ts, loss)
    window = _check_fit_options(uncertainty, n_starts, window)
    nothing = nothing_to_fit(t, y)
    if nothing:
        return _no_power_law(nothing, uncertainty)
    if window is None:
        window, reason = window_after_staircase(
            t, y, partial(detect_plateaus, method="slope")
        )
        if window is None:
            return _no_power_law(reason, uncertainty)
    sel = _window_points(t, y, window)
    fit = _fit_in_window(
        t[sel],
        y[sel],
        n_starts=n_starts,
        steps=steps,
        learning_rate=learning_rate,
        huber_delta=huber_delta,
        uncertainty=uncertainty,
        n_bootstrap=n_bootstrap,
        key=jax.random.key(0) if key is None else key,
    )
    reason = _insignificant(fit)
    return _no_power_law(reason, uncertainty) if reason else fit


def _check_fit_options(uncertainty, n_starts, window) -> tuple[float, float] | None:
    """`fit_power_law`'s options checked (a `ValueError` naming the bad one), and
    the `window` as floats."""
    if uncertainty not in ("systematic", "laplace", "bootstrap"):
        raise ValueError(
            "`uncertainty` must be 'systematic', 'laplace' or 'bootstrap', got "
            f"{uncertainty!r}."
        )
    if n_starts < 1:
        raise ValueError(f"`n_starts` must be >= 1, got {n_starts}.")
    if window is not None:
        window = (float(window[0]), float(window[1]))
        if not window[0] < window[1]:
            raise ValueError(
                f"`window` must be (t_lo, t_hi) with t_lo < t_hi, got {window}."
            )
    return window


def _window_points(t, y, window) -> np.ndarray:
    """Which points are in `window` with a positive loss (at least 6)."""
    sel = (t >= window[0]) & (t <= window[1]) & (y > 0)
    n = int(sel.sum())
    if n < 6:
        raise ValueError(
            f"need at least 6 points with positive loss in the window {window}, got "
            f"{n}."
        )
    return sel


def _fit_in_window(
    tw,
    yw,
    *,
    n_starts,
    steps,
    learning_rate,
    huber_delta,
    uncertainty,
    n_bootstrap,
    key,
) -> PowerLawFit:
    """The fit to the window's points `(tw, yw)` (positive losses), on time and
    loss rescaled to order one; long records log-binned, every curve padded to
    `_LENGTH` with zero weights (one compilation for every curve), the rms and
    the Laplace error counting the scatter within the bins."""
    n = tw.size
    t_ref, l_ref = tw[-1], np.exp(np.mean(np.log(yw)))
    tb, lyb, wb, within = log_bins(tw / t_ref, np.log(yw / l_ref))
    u, ly = pad_bins(tb, lyb)
    w = np.concatenate([wb, np.zeros(_LENGTH - tb.size)])
    key_starts, key_boot = jax.random.split(key)
    dtype = jnp.result_type(float)
    u_j, y_j, w_j = (jnp.asarray(a, dtype) for a in (u, ly, w))
    theta0 = power_law_starts(u, ly, w > 0, n_starts, key_starts)
    theta, gamma_err, rms = _fit_power_law_core(
        u_j, y_j, w_j, jnp.asarray(theta0, dtype), huber_delta, learning_rate, steps, 30
    )
    # binned: the residual scatter of the means, plus the scatter within bins
    between = float(rms) ** 2 * n
    rms = jnp.asarray(np.sqrt((between + within) / n), dtype)
    if within > 0 and between > 0:
        gamma_err = gamma_err * np.sqrt((between + within) / between)
    if uncertainty != "laplace":
        gamma_err = _resampled_error(
            uncertainty,
            u,
            ly,
            w,
            wb,
            n,
            theta,
            gamma_err,
            huber_delta,
            n_bootstrap,
            key_boot,
        )
    return PowerLawFit(
        gamma=jnp.exp(theta[3]),
        gamma_err=gamma_err,
        L_inf=theta[0] * l_ref,
        c=jnp.exp(theta[1]) * l_ref * t_ref ** jnp.exp(theta[3]),
        t0=jnp.exp(theta[2]) * t_ref,
        window=(float(tw[0]), float(tw[-1])),
        n_points=n,
        rms=rms,
        uncertainty=uncertainty,
    )


def _resampled_error(
    uncertainty, u, ly, w, wb, n, theta, laplace, delta, n_bootstrap, key
):
    """`gamma`'s error by `"bootstrap"` (pairs: the points resampled, as bin
    counts) or `"systematic"` (`_systematic_error`)."""
    dtype = theta.dtype
    if uncertainty == "systematic":
        rng = np.random.default_rng(np.asarray(jax.random.key_data(key)).ravel())
        err = _systematic_error(
            u, ly, w, theta, float(laplace), delta, n_bootstrap, rng
        )
        return jnp.asarray(err, dtype)
    bins = np.repeat(np.arange(wb.size), wb.astype(int))
    pick = np.asarray(jax.random.choice(key, bins, (n_bootstrap, n)))
    counts = np.stack([np.bincount(p, minlength=_LENGTH) for p in pick])
    ys = np.broadcast_to(ly, counts.shape)
    boot = _refit_gamma(
        *(jnp.asarray(a, dtype) for a in (u, ys, counts)), theta, delta, 30
    )
    return jnp.std(boot, ddof=1)


def power_law_starts(u, ly, sel, n_starts: int, key) -> np.ndarray:
    """`n_starts` starting points, shape `(n_starts, 4)`: the first from a
    log-log regression on the window (positive times), the others random
    perturbations of it."""
    pos = sel & (u > 0)
    slope, intercept, _, _ = loglog_slope(np.log(u[pos]), ly[pos], take_logs=False)
    theta_reg = np.array(
        [0.0, intercept, np.log(u[pos][0]) - 3.0, np.log(max(-slope, 0.05))]
    )
    noise = np.asarray(jax.random.normal(key, (n_starts, 4)))
    theta0 = theta_reg + noise * np.array([0.0, 0.5, 2.0, 0.4])
    # floors from 0 up to about half the smallest loss of the window
    theta0[:, 0] = 0.3 * np.abs(noise[:, 0]) * np.exp(np.min(ly[sel]))
    theta0[0] = theta_reg
    return theta0


def _insignificant(fit: PowerLawFit) -> str:
    """Why a converged fit is no power law ("" if it is one): a fitted curve
    falling by less than 5% (0.05 in `log L`) over its window, in its power-law
    regime `t > t0` over less than a decade of it, or an exponent below twice
    its standard error."""
    gamma, err = float(fit.gamma), float(fit.gamma_err)
    lo, hi = fit.window
    fall = float(jnp.log(fit(lo) / fit(hi)))
    if not (np.isfinite(gamma) and np.isfinite(err)):
        return "no power law: the fit did not converge"
    if fall < 0.05:
        return (
            f"no power law: the fitted curve falls by {fall:.2g} in log L over its "
            "window, less than 0.05"
        )
    decades = float(np.log10(hi / max(lo, float(fit.t0))))
    if decades < 1:
        return (
            f"no power law: the fitted curve is a power law (t > t0 = "
            f"{float(fit.t0):.3g}) over {decades:.2g} decades of its window, "
            "less than 1 (a single drop, not a power law)"
        )
    if gamma < 2 * err:
        return f"no power law: gamma = {gamma:.2g} is below twice its error {err:.2g}"
    return ""


def _no_power_law(reason: str, uncertainty: str) -> PowerLawFit:
    nan = jnp.asarray(jnp.nan, jnp.result_type(float))
    return PowerLawFit(
        gamma=nan,
        gamma_err=nan,
        L_inf=nan,
        c=nan,
        t0=nan,
        window=(float("nan"), float("nan")),
        n_points=0,
        rms=nan,
        uncertainty=uncertainty,
        found=False,
        reason=reason,
    )
