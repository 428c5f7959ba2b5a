r"""The two measurements every analysis of a curve repeats (private): when a curve
first reaches a level (`first_crossing`, built on `crossing_time`), and the
least-squares slope of $\log y$ on $\log t$ with its standard error
(`loglog_slope`).

`first_crossing` and `crossing_time` run on NumPy arrays eagerly (float64 stays
float64) and on JAX arrays under `jit`/`vmap` (the same code, with `jnp`);
`loglog_slope` is eager NumPy (no caller traces it)."""

from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


def _namespace(*xs):
    """`jax.numpy` if any of `xs` is a JAX array (or a tracer), else `numpy`."""
    return jnp if any(isinstance(x, jax.Array) for x in xs) else np


# --------------------------------------------------------------------------------
# level crossings


def crossing_time(t0, t1, v0, v1, level, *, log_values=True, log_time=False):
    r"""The time at which the interpolant from `(t0, v0)` to `(t1, v1)` reaches
    `level` (elementwise, broadcasting).

    The values are interpolated linearly in $\log v$ where `v0`, `v1` and `level`
    are all positive and `log_values` (else linearly in $v$); the time linearly
    in $\log t$ where `t0 > 0` and `log_time` (else linearly in $t$). The
    fraction of the interval is clipped to `[0, 1]`; a flat interval
    (`v0 == v1`) gives `t1`."""
    xp = _namespace(t0, t1, v0, v1, level)
    t0, t1, v0, v1, level = (xp.asarray(a) for a in (t0, t1, v0, v1, level))
    if log_values:
        pos = (v0 > 0) & (v1 > 0) & (level > 0)
        log = lambda v: xp.where(pos, xp.log(xp.where(pos, v, 1.0)), v)
        a, b, c = log(v0), log(v1), log(level)
    else:
        a, b, c = v0, v1, level
    d = b - a
    flat = d == 0
    frac = xp.where(flat, 1.0, (c - a) / xp.where(flat, 1.0, d))
    frac = xp.clip(frac, 0.0, 1.0)
    linear = t0 + frac * (t1 - t0)
    if not log_time:
        return linear
    ok = t0 > 0
    lt0 = xp.log(xp.where(ok, t0, 1.0))
    lt1 = xp.log(xp.where(ok, t1, 1.0))
    return xp.where(ok, xp.exp(lt0 + frac * (lt1 - lt0)), linear)


def first_crossing(
    ts,
    values,
    level,
    *,
    rising: bool = False,
    interpolate: Literal["log", "linear", "step"] = "log",
    log_time: bool = False,
    at_start: Literal["first", "nan"] = "first",
):
    r"""When each curve first reaches `level`.

    A curve reaches the level at the first record where `values <= level`
    (`values >= level` with `rising=True`); the time is interpolated between
    that record and the one before it by `crossing_time` (`interpolate="log"`:
    in $\log v$, `"linear"`: in $v$; `log_time`: in $\log t$), or is the time of
    that record (`"step"`).

    **Arguments:**

    - `ts`: times, shape `(T,)`, increasing.
    - `values`: the curves along axis 0, shape `(T, *S)`.
    - `level`: the level, broadcastable to `S`.
    - `rising`: look for a rise through the level instead of a fall.
    - `interpolate`: `"log"`, `"linear"` or `"step"` (see above).
    - `log_time`: interpolate in $\log t$ (where `t > 0`).
    - `at_start`: what a curve already at the level at `ts[0]` gives: `ts[0]`
      (`"first"`) or NaN (`"nan"`).

    **Returns:** the crossing times, shape `S`; NaN where a curve never reaches
    the level. NumPy in, NumPy out; JAX arrays in (also traced), JAX out.
    """
    if interpolate not in ("log", "linear", "step"):
        raise ValueError(
            f"`interpolate` must be 'log', 'linear' or 'step', got {interpolate!r}."
        )
    if at_start not in ("first", "nan"):
        raise ValueError(f"`at_start` must be 'first' or 'nan', got {at_start!r}.")
    xp = _namespace(ts, values, level)
    ts, values = xp.asarray(ts), xp.asarray(values)
    level = xp.broadcast_to(xp.asarray(level), values.shape[1:])
    reached = values >= level[None] if rising else values <= level[None]
    i = xp.argmax(reached, axis=0)
    i0 = xp.maximum(i - 1, 0)
    if interpolate == "step":
        t = ts[i]
    else:
        v0 = xp.take_along_axis(values, i0[None], axis=0)[0]
        v1 = xp.take_along_axis(values, i[None], axis=0)[0]
        t = crossing_time(
            ts[i0],
            ts[i],
            v0,
            v1,
            level,
            log_values=interpolate == "log",
            log_time=log_time,
        )
    start = ts[0] if at_start == "first" else xp.nan
    t = xp.where(i == 0, start, t)
    return xp.where(xp.any(reached, axis=0), t, xp.nan)


# --------------------------------------------------------------------------------
# log-log slopes


class LineFit(NamedTuple):
    """A least-squares line `y = intercept + slope x` (`loglog_slope`): its
    `slope`, `intercept`, the standard error of the slope `slope_err`, and the
    root-mean-square residual `rms` (weighted)."""

    slope: np.ndarray
    intercept: np.ndarray
    slope_err: np.ndarray
    rms: np.ndarray


def loglog_slope(x, y, weights=None, *, take_logs: bool = True) -> LineFit:
    r"""The weighted least-squares line of $\ln y$ on $\ln x$, along the last
    axis (batched over the leading axes of `y` and `weights`).

    $$\hat s = \frac{\sum w (x - \bar x)(y - \bar y)}{\sum w (x - \bar x)^2},
    \qquad \operatorname{se}(\hat s)^2 = \frac{\sum w \rho^2}{(n - 2)
    \sum w (x - \bar x)^2}$$

    with $\bar x, \bar y$ weighted means, $\rho$ the residuals and
    $n = \sum w$ ($n - 2$ floored at 1: two points give a zero error, the line
    passes through both). Points of weight 0 are ignored whatever their values
    (a NaN or a non-positive value there is harmless). NaN slope where all $x$
    coincide.

    **Arguments:**

    - `x`, `y`: shape `(..., N)` (broadcasting); positive where they count.
    - `weights`: optional, broadcastable to the same shape (e.g. a boolean mask
      of the points to use, or bootstrap multiplicities).
    - `take_logs`: `False` fits `y` on `x` as given (coordinates already in
      log, or a semi-log fit).

    **Returns:** a `LineFit` of arrays of the leading shape (NumPy scalars for
    a single line).
    """
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    w = np.ones(()) if weights is None else np.asarray(weights, np.float64)
    x, y, w = np.broadcast_arrays(x, y, w)
    use = w > 0
    with np.errstate(divide="ignore", invalid="ignore"):
        if take_logs:
            x = np.log(np.where(use, x, 1.0))
            y = np.log(np.where(use, y, 1.0))
        x, y = np.where(use, x, 0.0), np.where(use, y, 0.0)
        n = w.sum(-1)
        x_mean = (w * x).sum(-1) / n
        y_mean = (w * y).sum(-1) / n
        xc = x - x_mean[..., None]
        sxx = (w * xc**2).sum(-1)
        slope = (w * xc * (y - y_mean[..., None])).sum(-1) / sxx
        intercept = y_mean - slope * x_mean
        resid = np.where(use, y - intercept[..., None] - slope[..., None] * x, 0.0)
        ss = (w * resid**2).sum(-1)
        slope_err = np.sqrt(ss / np.maximum(n - 2, 1) / sxx)
        rms = np.sqrt(ss / n)
    return LineFit(slope[()], intercept[()], slope_err[()], rms[()])
