r"""The rest of a training curve, from its beginning (`forecast`): the power-law
mode spectrum of `fit_spectrum` with a floor, fitted to the observed prefix and
continued, weighed against simpler continuations (`continuations`) by their
errors on backtests inside the prefix, with a band from those errors, the
times at which the next modes switch on, and the level the loss ends at.

The model is `SpectrumFit`'s (modes $\lambda_k = k^{-\alpha}$, targets
$m^*_k = k^{-\beta}$, rates $r_k = \rho\,\lambda_k m^*_k$, all from
$\epsilon$, amplitude $A$; the modes beyond `p` as a continuum) plus a floor
$L_\infty$ (the loss no mode removes):
$L(t) = L_\infty + A \sum_k \tfrac12 \lambda_k (m^*_k - m_k(t))^2$. Mode `k`
switches on (is half learned) at $t_k = \ln(m^*_k / \epsilon - 1) / r_k$, the
switch-on time of `switch_on_times`. A prefix that
resolves a few switch-ons fixes the exponents (the heights and times of the
drops scale as $k^{-(\alpha + 2\beta)}$ and $k^{\alpha + \beta}$), and with
them every later switch-on and the power law the merged modes make."""

from statistics import NormalDist

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Float, PRNGKeyArray

from ._least_squares import (
    host_curve,
    laplace_cov,
    nothing_to_fit,
    robust_least_squares,
)
from .continuations import (
    anchored,
    backtest,
    backtest_band,
    flat_curve,
    power_law_curve,
    staircase_curve,
    tail_curve,
)
from .spectrum import check_n_modes, spectrum_log_loss, spectrum_starts


#: The model's own error in `log L` that the band always allows for: the
#: continuum of modes beyond `p` is accurate to about 1% (`fit_spectrum`).
_MODEL_ERROR = 0.02

#: The band at 90% spans this many times the rms backtest error (scaled to the
#: horizon): chosen on eight recorded training runs (benchmarks/forecast_runs.py)
#: for a pooled coverage near 90%.
_BAND_SCALE = 3.0

#: A candidate with this much of the weight takes all of it (the backtests are
#: decisive: a curve of the model's own kind).
_DECISIVE = 0.9

#: The continuations `forecast` chooses among (`model="auto"`).
MODELS = ("spectrum", "tail", "power law", "staircase", "flat")


class Forecast(eqx.Module):
    r"""A training curve's continuation (`forecast`).

    **Fields:**

    - `ts`: the times of the forecast, shape `(F,)`, log-spaced from the end of
      the observed prefix to `until`.
    - `loss`: the forecast loss at `ts`, shape `(F,)`: the candidate
      continuations (see `forecast`), each moved to pass through the last
      observed value, averaged in `L` with `weights` (the mixture's mean
      loss).
    - `lower`, `upper`: the band, shape `(F,)`: the forecast divided and
      multiplied by `e^w`, `w` three times the rms backtest error scaled to
      the horizon and 1.645 times the candidates' weighted rms spread, added
      in quadrature (see `forecast`), plus 2% (the model's own error), at
      `level = 0.9`; the spectrum alone reaches down to itself without its
      floor. For a prefix too short for a backtest, the spectrum's own band
      (the central `level` of parameter draws and of refits on shortened
      prefixes, the model moved in time by the modes' scattered initial
      sizes, down to the model without its floor, widened by twice the rms
      misfit).
    - `switch_on_times`: when the next modes switch on (those after the
      prefix, up to `until`): each one's half-way time
      $\ln(m^*_k/\epsilon - 1)/r_k$, as `switch_on_times` defines it, shape
      `(S,)` (at most 5); `switch_on_modes`: their
      indices `k` (1-based).
    - `final_level`, `final_lower`, `final_upper`: the loss at `until`, and its
      band.
    - `floor`: the fitted floor $L_\infty$.
    - `alpha`, `beta`, `eps`, `rate`, `amplitude`: the fitted spectrum (as in
      `SpectrumFit`).
    - `observed_until`: the last observed time; `rms`: the rms misfit of
      `log L` on the prefix.
    - `found`, `reason`: whether there was anything to forecast from (a flat,
      zero or rising prefix has nothing; the numbers are then NaN).
    - `model`: the continuation with the largest weight (`"spectrum"`,
      `"tail"`, `"power law"`, `"staircase"` or `"flat"`, the last value
      kept); `weights`:
      each candidate's weight, as `(name, weight)` pairs.
    """

    ts: Float[Array, " F"]
    loss: Float[Array, " F"]
    lower: Float[Array, " F"]
    upper: Float[Array, " F"]
    switch_on_times: Float[Array, " S"]
    switch_on_modes: Array
    final_level: Float[Array, ""]
    final_lower: Float[Array, ""]
    final_upper: Float[Array, ""]
    floor: Float[Array, ""]
    alpha: Float[Array, ""]
    beta: Float[Array, ""]
    eps: Float[Array, ""]
    rate: Float[Array, ""]
    amplitude: Float[Array, ""]
    observed_until: float = eqx.field(static=True)
    rms: Float[Array, ""]
    found: bool = eqx.field(static=True, default=True)
    reason: str = eqx.field(static=True, default="")
    model: str = eqx.field(static=True, default="spectrum")
    weights: tuple = eqx.field(static=True, default=())


def _log_model(theta, ts, p: int, n_modes):
    """`log L(ts)` at `theta = (alpha, beta, log eps, log rate, log A, log
    L_inf)`: the spectrum (closed-form logistic modes) plus the floor."""
    spectrum = spectrum_log_loss(theta[:5], ts, p, "logistic", None, n_modes)
    return jnp.logaddexp(theta[5], spectrum)


_log_model_at = eqx.filter_jit(_log_model)


@eqx.filter_jit
def _fit(ts, y, weights, starts, p: int, n_modes, steps: int):
    """Fit from every start (vmapped) and keep the best: `(theta, cov, rms)`."""

    def residual(theta):
        return _log_model(theta, ts, p, n_modes) - y

    fits = jax.vmap(
        lambda th: robust_least_squares(residual, weights, 0.1, th, steps, 30, 0.03)
    )(starts)
    best = jax.tree.map(lambda x: x[jnp.argmin(fits.value)], fits)
    rms = jnp.sqrt(jnp.sum(weights * best.res**2) / jnp.sum(weights))
    return best.theta, laplace_cov(best, weights), rms


@eqx.filter_jit
def _draws(theta, cov, key, ts, p: int, n_modes, n_draws: int):
    """`log L(ts)` of `n_draws` parameter vectors drawn from `N(theta, cov)`,
    shape `(n_draws, F)`."""
    evals, evecs = jnp.linalg.eigh(cov)
    root = evecs * jnp.sqrt(jnp.maximum(evals, 0.0))[None, :]
    z = jax.random.normal(key, (n_draws, theta.shape[0]), theta.dtype)
    thetas = theta[None, :] + z @ root.T
    return jax.vmap(lambda th: _log_model(th, ts, p, n_modes))(thetas)


@eqx.filter_jit
def _refits(ts, y, weights, theta, at, p: int, n_modes):
    """The fit redone (Levenberg-Marquardt from `theta`) for each row of
    `weights` (shape `(W, T)`: shortened prefixes), vmapped; `log L(at)` of
    each, shape `(W, F)` (NaN where a refit failed)."""

    def one(w):
        def residual(th):
            return _log_model(th, ts, p, n_modes) - y

        best = robust_least_squares(residual, w, 0.1, theta, 0, 30, 0.03)
        curve = _log_model(best.theta, at, p, n_modes)
        return jnp.where(jnp.isfinite(best.value), curve, jnp.nan)

    return jax.vmap(one)(weights)


def _shortened(t, use, n_windows, shrink, rng):
    """`n_windows` weight rows: the prefix with its end cut by a uniform fraction
    in `[0, shrink)` of its span in `log t` (and its start by a tenth of that),
    each keeping at least 8 points."""
    lt = np.log(np.maximum(t, t[t > 0][0] if np.any(t > 0) else 1.0))
    span = lt[-1] - lt[0]
    hi = lt[-1] - rng.uniform(0, shrink, (n_windows, 1)) * span
    lo = lt[0] + rng.uniform(0, 0.1 * shrink, (n_windows, 1)) * span
    rows = (lt >= lo) & (lt <= hi) & use
    rows[rows.sum(1) < 8] = use
    return rows.astype(float)


def _switch_ons(theta, after: float, until: float, p: int, n_next: int = 5):
    """The first `n_next` modes `k <= p` switching on in `(after, until]`:
    the half-way times `t_k = ln(m*_k / eps - 1) / r_k`; `(times, k)`."""
    alpha, beta, log_eps, log_rate = (float(x) for x in theta[:4])
    k = np.arange(1, p + 1, dtype=np.float64)
    growth = -beta * np.log(k) - log_eps  # ln(m*_k / eps)
    # a mode that starts above its target never switches on (-inf: not due)
    half = np.log(np.expm1(np.maximum(growth, 1e-300)))
    t_k = np.where(growth > 0, half, -np.inf) / (
        np.exp(log_rate) * k ** -(alpha + beta)
    )
    due = np.flatnonzero((t_k > after) & (t_k <= until))[:n_next]
    return t_k[due], (due + 1).astype(np.int32)


def forecast(
    ts: Float[ArrayLike, " T"],
    loss: Float[ArrayLike, " T"],
    until: float,
    *,
    p: int = 100,
    n_modes: int | float = float("inf"),
    n_points: int = 100,
    level: float = 0.95,
    n_draws: int = 256,
    steps: int = 100,
    n_windows: int = 32,
    shrink: float = 0.15,
    key: PRNGKeyArray | None = None,
    model: str = "auto",
) -> Forecast:
    r"""Forecast a training curve from its beginning.

    Fits the power-law mode spectrum with a floor (see the module notes) to the
    observed `(ts, loss)` by least squares in $\log L$ (`fit_spectrum`'s
    starts, each with a few floors, Adam and `optimistix.LevenbergMarquardt`),
    and weighs its continuation to `until` against simpler ones: a power law
    with a floor fitted to the prefix's last stretch (as many e-folds of `t` as
    the horizon `X = ln(until / ts[-1])`; a settled tail), a power law with a
    shift and a floor fitted to the later half of the prefix in $\log t$, the
    staircase of `fit_staircase` (drops and a floor) continued (a drop in
    progress completed, then the floor), and the last value kept. Each
    candidate is moved to pass through the last observed value.

    **The backtest.** Each candidate also forecasts the prefix itself from
    earlier origins $T e^{-fX}$ (`f` = 1/2, 0.35, 1/4; those with 8 points
    before them; none when `X` is longer than half the prefix's span in
    $\log t$: so long a horizon cannot be tried out inside the prefix),
    fitted to the points before the origin only, and its errors in $\log L$
    are measured at the same relative horizons. The forecast is the
    candidates' average in $L$ (the mean loss of their mixture: a candidate
    that plunges towards zero loss adds its weight's share of almost
    nothing, where in an average of $\log L$ it would drag the forecast down
    by its weight times the e-folds it falls) weighted by the inverse of
    their mean squared backtest error in $\log L$ (`Forecast.weights`;
    `Forecast.model` names the heaviest, and `model=` forces one; one with
    90% of the weight takes all of it: the backtests are decisive). The band
    is the rms over the origins of the candidates' weighted mean backtest
    error in $\log L$ at each relative horizon, scaled to the
    full horizon (divided by `f`), times 3 at `level = 0.9` (in proportion to
    the normal quantile otherwise; the factor chosen on recorded training
    runs, see the how-to on loss curves), added in quadrature to the
    candidates' spread about the average (their weighted rms difference from
    it in $\log L$: the between-model part of a model average's variance)
    times the normal quantile of `level` (1.645 at 90%), plus 2%; for the
    spectrum alone it
    reaches down to the spectrum without its floor (a floor below the
    observed losses is not seen by the prefix). Without a backtest (a prefix
    too short, or a horizon too long) the spectrum is kept with its own band:
    the central `level` of the model over `n_draws` parameter draws from the
    fit's Laplace covariance and of `n_windows` refits on the prefix with its
    end cut by up to `shrink` of its span in $\log t$, and the model at
    $t (1 \pm \delta)$, $\delta = 1/\ln(1/\epsilon)$, down to the model
    without its floor, widened by twice the rms misfit. The spectrum is
    differentiable in its parameters (closed-form logistic modes and the
    sharp-switch continuum), so it can be pushed through `jax.grad` by
    calling the model directly.

    **Arguments:**

    - `ts`, `loss`: the observed prefix, shape `(T,)`, times increasing `>= 0`.
    - `until`: the last time to forecast, `> ts[-1]`.
    - `p`, `n_modes`: explicit modes and the total number of modes of the model
      (as `fit_spectrum`; default 100 and an unbounded spectrum).
    - `n_points`: points of the forecast, log-spaced from `ts[-1]` to `until`.
    - `level`: the band's coverage, in `(0, 1)`.
    - `n_draws`: parameter draws for the band; `steps`: Adam steps per start.
    - `n_windows`, `shrink`: refits on shortened prefixes for the band, and
      the largest fraction of the prefix's span in $\log t$ cut from its end.
    - `key`: PRNG key for the draws (default `key(0)`).
    - `model`: `"auto"` (default: the backtest-weighted average) or one
      candidate: `"spectrum"`, `"tail"`, `"power law"`, `"staircase"` or
      `"flat"`.

    **Returns:** a `Forecast` (`found=False`, with the reason and NaN numbers,
    for a prefix that is zero, flat or rising).

    **Raises:** `ValueError` for a malformed curve, `until <= ts[-1]`, fewer than
    8 positive points, or bad options (an unknown `model` among them).
    """
    t, y = host_curve(ts, loss)
    until, n_modes = _check_forecast_options(
        t, until, p, n_modes, n_points, level, n_windows, shrink
    )
    if model != "auto" and model not in MODELS:
        raise ValueError(f"`model` must be 'auto' or one of {MODELS}, got {model!r}.")
    grid = np.geomspace(
        max(t[-1], t[t > 0][0] if np.any(t > 0) else 1.0), until, n_points
    )
    dtype = jnp.result_type(float)
    nothing = nothing_to_fit(t, y)
    if nothing:
        return _nothing(grid, t[-1], nothing, dtype)
    use = y > 0
    if use.sum() < 8:
        raise ValueError(f"need at least 8 positive points, got {int(use.sum())}.")
    ly = np.where(use, np.log(np.where(use, y, 1.0)), 0.0)
    theta, cov, rms = _fit_prefix(t, y, ly, use, int(p), n_modes, int(steps), dtype)
    key = jax.random.key(0) if key is None else key
    at = jnp.asarray(grid, dtype)
    raw = centre = np.asarray(_log_model(theta, at, int(p), n_modes))
    fit = (int(p), n_modes, int(steps), dtype, theta)
    weights, centre, half = _backtested(
        t, y, ly, use, until, grid, centre, fit, model, level
    )
    chosen = max(weights, key=lambda pair: pair[1])[0]
    if half is None and chosen != "spectrum":
        half = np.zeros(grid.shape)
    if half is None:  # no backtest: the fit's own band
        lower, upper = _band(
            theta,
            cov,
            rms,
            centre,
            t,
            ly,
            use,
            at,
            int(p),
            n_modes,
            level,
            int(n_draws),
            int(n_windows),
            float(shrink),
            key,
        )
    else:
        widen = max(float(rms) if chosen == "spectrum" else 0.0, _MODEL_ERROR)
        low = centre - half
        if dict(weights).get("spectrum") == 1.0:
            # the spectrum alone: down to itself without its floor
            low = np.minimum(low, _bare(theta, at, int(p), n_modes) + centre - raw)
        lower = np.exp(low - widen)
        upper = np.exp(centre + half + widen)
    return _result(
        grid, centre, lower, upper, theta, rms, t[-1], until, int(p), chosen, weights
    )


def _backtested(t, y, ly, use, until, grid, centre, fit, model, level):
    """The continuation: `model`, or with `"auto"` the mean loss of the
    candidates weighted by their inverse mean squared backtest error, and its band's
    half-width in `log L` (symmetric): its backtest error and the candidates'
    spread about it, added in quadrature (see `forecast`): `(weights,
    centre, half)` (`half = None` where the prefix is too short for a
    backtest and the spectrum is kept)."""
    p, n_modes, steps, dtype, fitted = fit

    def spectrum(t, ly, before, origin, horizon, at):
        theta = fitted
        if before.sum() < use.sum():  # a backtest: refitted from scratch
            theta, _, _ = _fit_prefix(t, y, ly, before, p, n_modes, steps, dtype)
        return np.asarray(_log_model_at(theta, jnp.asarray(at, dtype), p, n_modes))

    every = dict(
        zip(
            MODELS,
            (spectrum, tail_curve, power_law_curve, staircase_curve, flat_curve),
        )
    )
    names = MODELS if model == "auto" else (model,)
    horizon = float(np.log(until / t[use][-1]))
    errors, fractions = backtest(t, ly, use, horizon, {n: every[n] for n in names})
    if fractions.size == 0:
        names = ("spectrum",) if model == "auto" else names
        errors = {names[0]: np.zeros((0, 1))}
    mse = np.array([np.mean(errors[n] ** 2) if errors[n].size else 1.0 for n in names])
    weights = (1 / (mse + 1e-12)) / np.sum(1 / (mse + 1e-12))
    if np.max(weights) >= _DECISIVE:  # the backtests agree: that one alone
        weights = (weights == np.max(weights)).astype(float)
    curves = [anchored(every[n], t, ly, use, t[use][-1], horizon, grid) for n in names]
    blend = _mixture_mean(weights, np.asarray(curves))
    pairs = tuple((n, round(float(w), 4)) for n, w in zip(names, weights))
    if fractions.size == 0:
        return pairs, blend, None
    s = np.log(grid / t[use][-1]) / horizon
    err = np.tensordot(weights, np.asarray([errors[n] for n in names]), 1)
    within = backtest_band(err, fractions, s, _band_z(level))
    # model averaging: the candidates' spread about their average (the
    # weighted variance of their continuations) adds to the average's own
    # backtest error, at the normal quantile of `level`
    spread = np.sqrt(np.tensordot(weights, (np.asarray(curves) - blend) ** 2, 1))
    return pairs, blend, np.hypot(within, _normal_quantile(level) * spread)


def _mixture_mean(weights, curves):
    """`log` of the weighted mean of the candidates' losses (`curves` in `log
    L`, shape `(C, F)`): the mixture's mean loss. A candidate that plunges
    towards zero loss adds its weight's share of almost nothing, where in an
    average of `log L` it would pull the forecast down by its weight times
    the many e-folds it falls."""
    top = np.max(curves, axis=0)
    return top + np.log(np.tensordot(weights, np.exp(curves - top), 1))


def _normal_quantile(level: float) -> float:
    """The normal quantile of a central `level` interval (1.645 at 90%)."""
    return NormalDist().inv_cdf((1 + level) / 2)


def _band_z(level: float) -> float:
    """How many times the rms scaled backtest error the band spans:
    `_BAND_SCALE` at 90%, in proportion to the normal quantile of `level`
    otherwise."""
    return _BAND_SCALE * _normal_quantile(level) / _normal_quantile(0.9)


def _result(
    grid, centre, lower, upper, theta, rms, last, until, p, model, weights
) -> Forecast:
    """The `Forecast` of the fitted `theta`: its `centre` (log loss) and band on
    `grid`, and the modes switching on between `last` and `until`."""
    times, modes = _switch_ons(np.asarray(theta), last, until, p)
    dtype = theta.dtype
    as_array = lambda a: jnp.asarray(a, dtype)
    return Forecast(
        ts=as_array(grid),
        loss=as_array(np.exp(centre)),
        lower=as_array(lower),
        upper=as_array(upper),
        switch_on_times=as_array(times),
        switch_on_modes=jnp.asarray(modes),
        final_level=as_array(np.exp(centre[-1])),
        final_lower=as_array(lower[-1]),
        final_upper=as_array(upper[-1]),
        floor=jnp.exp(theta[5]),
        alpha=theta[0],
        beta=theta[1],
        eps=jnp.exp(theta[2]),
        rate=jnp.exp(theta[3]),
        amplitude=jnp.exp(theta[4]),
        observed_until=float(last),
        rms=rms,
        model=model,
        weights=weights,
    )


def _check_forecast_options(t, until, p, n_modes, n_points, level, n_windows, shrink):
    """`forecast`'s options checked (a `ValueError` naming the bad one):
    `(until, n_modes)` as a float and the total number of modes."""
    until = float(until)
    if not (np.isfinite(until) and until > t[-1]):
        raise ValueError(f"`until` must be after the last time {t[-1]:g}, got {until}.")
    if not 0 < level < 1:
        raise ValueError(f"`level` must be in (0, 1), got {level}.")
    if isinstance(p, bool) or not isinstance(p, (int, np.integer)) or p < 1:
        raise ValueError(f"`p` must be a positive int, got {p!r}.")
    n_modes = check_n_modes(n_modes, int(p))
    if int(n_windows) < 1 or not 0 <= shrink < 1:
        raise ValueError(
            f"`n_windows` must be >= 1 and `shrink` in [0, 1), got {n_windows}, "
            f"{shrink}."
        )
    if int(n_points) < 2:
        raise ValueError(f"`n_points` must be >= 2, got {n_points}.")
    return until, n_modes


def _fit_prefix(t, y, ly, use, p, n_modes, steps, dtype):
    """The model fitted to the prefix: `(theta, cov, rms)`, from
    `fit_spectrum`'s starts, each with two floors."""
    starts = spectrum_starts(t, y, use, p, n_modes)
    floors = np.log(np.min(y[use])) + np.log([1e-8, 0.3])
    starts = np.concatenate(
        [np.column_stack([starts, np.full(len(starts), f)]) for f in floors]
    )
    return _fit(
        jnp.asarray(t, dtype),
        jnp.asarray(ly, dtype),
        jnp.asarray(use, dtype),
        jnp.asarray(starts, dtype),
        p,
        n_modes,
        steps,
    )


def _band(
    theta,
    cov,
    rms,
    centre,
    t,
    ly,
    use,
    at,
    p,
    n_modes,
    level,
    n_draws,
    n_windows,
    shrink,
    key,
):
    """The band's `(lower, upper)` at `at`: the central `level` of parameter
    draws and of refits on shortened prefixes, the model moved in time by the
    initial sizes' scatter, down to the model without its floor, widened by
    twice the rms misfit (see `forecast`)."""
    dtype = at.dtype
    draws = np.asarray(_draws(theta, cov, key, at, p, n_modes, n_draws))
    # the window: the fit redone on prefixes cut short at their end, their
    # forecasts' spread joins the draws (a model that is not quite the run's
    # extrapolates differently from less data; this is what shows it)
    rng = np.random.default_rng(np.asarray(jax.random.key_data(key)).ravel())
    rows = _shortened(t, use, n_windows, shrink, rng)
    windows = np.asarray(
        _refits(
            jnp.asarray(t, dtype),
            jnp.asarray(ly, dtype),
            jnp.asarray(rows, dtype),
            theta,
            at,
            p,
            n_modes,
        )
    )
    tail = (1 - level) / 2
    lo, hi = np.nanquantile(draws, [tail, 1 - tail], axis=0)
    if np.any(np.isfinite(windows)):
        w_lo, w_hi = np.nanquantile(windows, [tail, 1 - tail], axis=0)
        lo, hi = np.fmin(lo, w_lo), np.fmax(hi, w_hi)
    # each mode's own initial size: random initial weights scatter ln eps_k
    # by about one e-fold, which moves mode k's switch-on by 1 / ln(m*_k /
    # eps) of its time; the band holds the model moved by that in time
    delta = float(np.clip(1.0 / max(-float(theta[2]), 1.0), 0.01, 0.5))
    for factor in (1 - delta, 1 + delta):
        moved = np.asarray(_log_model_at(theta, at * factor, p, n_modes))
        lo, hi = np.fmin(lo, moved), np.fmax(hi, moved)
    bare = _bare(theta, at, p, n_modes)
    widen = max(2 * float(rms), _MODEL_ERROR)
    lower = np.exp(np.minimum(np.minimum(lo, centre), bare) - widen)
    upper = np.exp(np.maximum(hi, centre) + widen)
    return lower, upper


def _bare(theta, at, p, n_modes):
    """`log L` at `at` of the spectrum without its floor: a floor below the
    observed losses is not seen by the prefix, so a band of the spectrum
    reaches down to it."""
    return np.asarray(_log_model(theta.at[5].set(-np.inf), at, p, n_modes))


def _nothing(grid, last, reason, dtype) -> Forecast:
    nan = jnp.asarray(jnp.nan, dtype)
    empty = jnp.full(grid.shape, jnp.nan, dtype)
    return Forecast(
        ts=jnp.asarray(grid, dtype),
        loss=empty,
        lower=empty,
        upper=empty,
        switch_on_times=jnp.zeros((0,), dtype),
        switch_on_modes=jnp.zeros((0,), jnp.int32),
        final_level=nan,
        final_lower=nan,
        final_upper=nan,
        floor=nan,
        alpha=nan,
        beta=nan,
        eps=nan,
        rate=nan,
        amplitude=nan,
        observed_until=float(last),
        rms=nan,
        found=False,
        reason=reason,
    )
