r"""Power laws fitted to loss curves (`fit_power_law`):
$L(t) = L_\infty + c\,(t + t_0)^{-\gamma}$ on an automatically chosen window,
with an uncertainty for $\gamma$."""

from typing import Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Float, PRNGKeyArray

from .._curves import loglog_slope
from ._least_squares import (
    _host_curve,
    _laplace_cov,
    _least_squares,
    _nothing_to_fit,
)


# --------------------------------------------------------------------------------
# power laws


class PowerLawFit(eqx.Module):
    r"""The result of `fit_power_law`: $L(t) = L_\infty + c\,(t + t_0)^{-\gamma}$.

    **Fields:**

    - `gamma`, `gamma_err`: the exponent and its standard error (1 sigma).
    - `L_inf`, `c`, `t0`: the other parameters (all positive).
    - `window`: `(t_lo, t_hi)`, the time range fitted (given or auto-chosen).
    - `n_points`: number of points inside the window.
    - `rms`: root-mean-square residual of $\log L$ in the window.
    - `uncertainty`: how `gamma_err` was obtained (`"laplace"` or `"bootstrap"`).
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
        ts = jnp.asarray(ts, self.gamma.dtype)
        return self.L_inf + self.c * (ts + self.t0) ** (-self.gamma)


def _auto_window(
    t: np.ndarray,
    y: np.ndarray,
    *,
    half_width: float = 0.25,
    tol: float = 0.05,
    n_grid: int = 48,
) -> tuple[float, float] | None:
    """The longest range of `log10 t` over which the local slope of the log-log
    curve stays constant: the power-law regime, excluding an initial plateau or
    staircase and a final floor or finite-size cutoff.

    At each of `n_grid` centres, a least-squares line of `log L` against `log t`
    over the points within `half_width` decades gives the local slope, its
    standard error `se` and the residual scatter `rough`. A range qualifies when

    - every centre is smooth: `rough <= 2 * q + 1e-4` (decades), with `q` the
      lower quartile of `rough` over the decreasing part of the curve; white noise
      has the same scatter everywhere and passes, a resolved staircase of
      switch-ons is far rougher than the merged part and does not;
    - every local slope is within `tol * median + 2 se` of the median slope
      (so noise alone does not end it).

    `None` where the local slope is nowhere above 0.05 (nothing falls)."""
    keep = (t > 0) & (y > 0)
    lt, ly = np.log10(t[keep]), np.log10(y[keep])
    full = (float(t[keep][0]), float(t[keep][-1]))
    if lt.size < 8 or lt[-1] - lt[0] < 4 * half_width:
        return full
    grid = np.linspace(lt[0] + half_width, lt[-1] - half_width, n_grid)
    near = np.abs(lt[None, :] - grid[:, None]) <= half_width  # (n_grid, T)
    local = loglog_slope(lt, ly, near, take_logs=False)
    enough = near.sum(1) >= 4
    slopes = np.where(enough, -local.slope, np.nan)
    errs = np.where(enough, local.slope_err, np.nan)
    rough = np.where(enough, local.rms, np.nan)
    falling = slopes > 0.05
    if not np.any(falling):
        return None
    smooth = rough <= 2 * np.quantile(rough[falling], 0.25) + 1e-4
    best, best_len = None, 2 * half_width  # at least one smoothing window wide
    for i in range(n_grid):
        for j in range(n_grid - 1, i, -1):
            if grid[j] - grid[i] <= best_len:
                break
            seg, err = slopes[i : j + 1], errs[i : j + 1]
            if not (np.all(np.isfinite(seg)) and np.all(smooth[i : j + 1])):
                continue
            med = np.median(seg)
            if med > 0 and np.all(np.abs(seg - med) <= tol * med + 2 * err):
                best, best_len = (i, j), grid[j] - grid[i]
                break
    if best is None:
        return full
    lo, hi = grid[best[0]] - half_width, grid[best[1]] + half_width
    inside = (lt >= lo - 1e-12) & (lt <= hi + 1e-12)
    tw = t[keep][inside]
    return float(tw[0]), float(tw[-1])


def _log_model(theta, u):
    """`log(L_inf + c (u + u0)^-gamma)` with `theta = log(L_inf, c, u0, gamma)`."""
    a, b, d, e = theta[0], theta[1], theta[2], theta[3]
    return jnp.logaddexp(a, b - jnp.exp(e) * jnp.log(u + jnp.exp(d)))


@eqx.filter_jit
def _fit_power_law_core(u, y, weights, theta0, delta, lr, steps, polish):
    """Fit from every start in `theta0` (shape `(S, 4)`) and keep the best; its
    Laplace standard error of `gamma` and RMS log-residual in the window. The
    shapes never depend on the window (zero weights outside it), so one
    compilation serves every window and replicate of a given length."""

    def residual(theta):
        return _log_model(theta, u) - y

    fits = jax.vmap(
        lambda th: _least_squares(residual, weights, delta, th, steps, polish, lr)
    )(theta0)
    best = jax.tree.map(lambda x: x[jnp.argmin(fits.value)], fits)
    cov = _laplace_cov(best, weights)
    gamma_err = jnp.exp(best.theta[3]) * jnp.sqrt(cov[3, 3])
    rms = jnp.sqrt(jnp.sum(weights * best.res**2) / jnp.sum(weights))
    return best.theta, gamma_err, rms


@eqx.filter_jit
def _bootstrap_gamma(u, y, counts, theta, delta, polish):
    """`gamma` refitted (Levenberg-Marquardt from `theta`) for each row of
    `counts` (bootstrap multiplicities)."""

    def residual(th):
        return _log_model(th, u) - y

    def one(w):
        return jnp.exp(
            _least_squares(residual, w, delta, theta, 0, polish, 0.0).theta[3]
        )

    return jax.vmap(one)(counts)


def fit_power_law(
    ts: Float[ArrayLike, " T"],
    loss: Float[ArrayLike, " T"],
    *,
    window: tuple[float, float] | None = None,
    n_starts: int = 8,
    steps: int = 300,
    learning_rate: float = 0.1,
    huber_delta: float = 0.1,
    uncertainty: Literal["laplace", "bootstrap"] = "laplace",
    n_bootstrap: int = 64,
    key: PRNGKeyArray | None = None,
) -> PowerLawFit:
    r"""Fit $L(t) = L_\infty + c\,(t + t_0)^{-\gamma}$ to a loss curve.

    The parameters are kept positive by fitting their logarithms; time and loss are
    rescaled to order one inside the window. The objective is the mean Huber loss
    (threshold `huber_delta`) of the residuals of $\log L$, so multiplicative noise
    is weighted evenly across decades and a few outliers (a step of a staircase)
    do not dominate. `n_starts` starts (the first from a log-log linear regression,
    the others random perturbations of it drawn with `key`) each run `steps` of
    Adam (optax, cosine decay) to find a basin, then 30 Levenberg-Marquardt steps
    to converge it (the objective is flat along `L_inf -> 0`, where first-order
    steps crawl), vmapped over starts; the best start wins.

    **Window.** With `window=None` it is chosen automatically: the longest range of
    $\log t$ over which the local log-log slope (a least-squares slope over half a
    decade) stays within 5% of its median, plus twice its standard error (so
    noise alone does not end the window), and over which the curve is as smooth
    on that scale as its smoothest quarter (white noise passes, a resolved
    staircase of switch-ons does not). This drops an initial plateau or
    staircase and a final floor or finite-size cutoff; the window used is reported
    in the result. Give `window=(t_lo, t_hi)` to fix it (e.g. from the switch-on
    times of the theory).

    **Uncertainty of gamma.** `"laplace"` (default): the Gauss-Newton curvature of
    the squared log-residuals at the optimum, $\Sigma = s^2 (J^\top J)^{+}$ with
    $s^2 = \sum_i \rho_i^2/(n - 4)$; valid for independent noise, and an
    underestimate for a smooth deterministic curve whose residuals are correlated
    misfit (then it measures only the misfit). `"bootstrap"`: the standard
    deviation of `gamma` over `n_bootstrap` refits on resampled points (pairs
    bootstrap, as multinomial weights, vmapped).

    Not differentiable or jit-able as a whole (the window is chosen on the host);
    the fits themselves are one jit-compiled vmapped call.

    **Arguments:**

    - `ts`: times, shape `(T,)`, strictly increasing, `>= 0`.
    - `loss`: the loss at `ts`, shape `(T,)`; points with `loss <= 0` are dropped.
    - `window`: optional `(t_lo, t_hi)`; default automatic (see above).
    - `n_starts`: number of starts (default 8).
    - `steps`, `learning_rate`: Adam steps and peak learning rate.
    - `huber_delta`: Huber threshold on the log-residual (default 0.1).
    - `uncertainty`: `"laplace"` or `"bootstrap"`.
    - `n_bootstrap`: bootstrap replicates.
    - `key`: PRNG key for the starts and the bootstrap (default `key(0)`).

    **Nothing to fit.** A loss that is zero, flat within its noise or rising
    (`found=False`, NaN numbers, and the `reason`), an automatic window search
    that finds no falling range, or a fitted exponent below twice its error
    or a fitted curve that falls by less than 5% over its window gives no power
    law.

    **Returns:** a `PowerLawFit` (callable: the fitted curve).

    **Raises:** `ValueError` for bad shapes, non-finite values, non-increasing or
    negative `ts`, bad options, or fewer than 6 positive points in a given
    window.
    """
    t, y = _host_curve(ts, loss)
    if uncertainty not in ("laplace", "bootstrap"):
        raise ValueError(
            f"`uncertainty` must be 'laplace' or 'bootstrap', got {uncertainty!r}."
        )
    if n_starts < 1:
        raise ValueError(f"`n_starts` must be >= 1, got {n_starts}.")
    if window is not None:
        window = (float(window[0]), float(window[1]))
        if not window[0] < window[1]:
            raise ValueError(
                f"`window` must be (t_lo, t_hi) with t_lo < t_hi, got {window}."
            )
    nothing = _nothing_to_fit(t, y)
    if nothing:
        return _no_power_law(nothing, uncertainty)
    if window is None:
        window = _auto_window(t, y)
        if window is None:
            return _no_power_law(
                "no power law: the local log-log slope is nowhere above 0.05",
                uncertainty,
            )
    sel = (t >= window[0]) & (t <= window[1]) & (y > 0)
    n = int(sel.sum())
    if n < 6:
        raise ValueError(
            f"need at least 6 points with positive loss in the window {window}, got "
            f"{n}."
        )
    window = (float(t[sel][0]), float(t[sel][-1]))
    # Rescale to order one inside the window; points outside get weight 0 (the
    # arrays keep the length of `ts`, so every window shares one compilation).
    t_ref = t[sel][-1]
    l_ref = np.exp(np.mean(np.log(y[sel])))
    u = t / t_ref
    ly = np.where(sel, np.log(np.where(sel, y, 1.0) / l_ref), 0.0)
    key = jax.random.key(0) if key is None else key
    key_starts, key_boot = jax.random.split(key)
    dtype = jnp.result_type(float)
    u_j, y_j, w_j = (jnp.asarray(a, dtype) for a in (u, ly, sel))
    theta0 = _starts(u, ly, sel, n_starts, key_starts)
    theta, gamma_err, rms = _fit_power_law_core(
        u_j, y_j, w_j, jnp.asarray(theta0, dtype), huber_delta, learning_rate, steps, 30
    )
    if uncertainty == "bootstrap":
        idx = jax.random.choice(key_boot, np.flatnonzero(sel), (n_bootstrap, n))
        counts = jax.vmap(lambda i: jnp.zeros_like(u_j).at[i].add(1.0))(idx)
        boot = _bootstrap_gamma(u_j, y_j, counts, theta, huber_delta, 30)
        gamma_err = jnp.std(boot, ddof=1)
    fit = PowerLawFit(
        gamma=jnp.exp(theta[3]),
        gamma_err=gamma_err,
        L_inf=jnp.exp(theta[0]) * l_ref,
        c=jnp.exp(theta[1]) * l_ref * t_ref ** jnp.exp(theta[3]),
        t0=jnp.exp(theta[2]) * t_ref,
        window=window,
        n_points=n,
        rms=rms,
        uncertainty=uncertainty,
    )
    reason = _insignificant(fit)
    return _no_power_law(reason, uncertainty) if reason else fit


def _starts(u, ly, sel, n_starts: int, key) -> np.ndarray:
    """`n_starts` starting points, shape `(n_starts, 4)`: the first from a
    log-log regression on the window (positive times), the others random
    perturbations of it."""
    pos = sel & (u > 0)
    slope, intercept, _, _ = loglog_slope(np.log(u[pos]), ly[pos], take_logs=False)
    theta_reg = np.array(
        [
            np.min(ly[sel]) - 5.0,
            intercept,
            np.log(u[pos][0]) - 3.0,
            np.log(max(-slope, 0.05)),
        ]
    )
    noise = np.asarray(jax.random.normal(key, (n_starts, 4)))
    theta0 = theta_reg + noise * np.array([2.0, 0.5, 2.0, 0.4])
    theta0[0] = theta_reg
    return theta0


def _insignificant(fit: PowerLawFit) -> str:
    """Why a converged fit is no power law ("" if it is one): an exponent below
    twice its standard error, or a fitted curve falling by less than 5% (0.05 in
    `log L`) over its window."""
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
