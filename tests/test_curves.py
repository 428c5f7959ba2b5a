"""The shared curve measurements (`nqfjax._curves`, internal): level crossings
against closed forms, eagerly and under jit/vmap, and log-log slopes against
scipy's linear regression."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats

from nqfjax._curves import crossing_time, first_crossing, loglog_slope


def test_first_crossing_is_exact_where_the_interpolant_is():
    # e^{-t} is linear in log v against t, t^-2 in log v against log t: the
    # interpolation is then exact, whatever the record spacing (to round-off)
    ts = np.array([0.3, 1.0, 2.5, 4.0, 7.0])
    level = 0.05  # e^{-t} crosses at t = ln 20 = 3.0, between records
    assert first_crossing(ts, np.exp(-ts), level) == pytest.approx(np.log(20), 1e-12)
    t = first_crossing(ts, ts**-2.0, level, log_time=True)
    assert t == pytest.approx(level**-0.5, rel=1e-12)
    # linear in t and v: a straight line is exact
    t = first_crossing(ts, 1 - 0.1 * ts, 0.5, interpolate="linear")
    assert t == pytest.approx(5.0, rel=1e-12)
    # the step variant: the first record at or below the level
    assert first_crossing(ts, np.exp(-ts), level, interpolate="step") == 4.0


def test_first_crossing_columns_rising_and_edges():
    ts = np.linspace(0.0, 10.0, 101)
    rates = np.array([0.5, 1.0, 2.0])
    rise = 1 - np.exp(-np.outer(ts, rates))  # (T, 3), rising to 1
    levels = np.array([0.5, 0.9, 0.2])
    expected = -np.log(1 - levels) / rates
    t = first_crossing(ts, rise, levels, rising=True, interpolate="linear")
    # linear interpolation on a grid of h = 0.1: the time is off by at most
    # h^2 |v''/v'| / 8 = h^2 rate / 8 <= 2.5e-3
    np.testing.assert_allclose(t, expected, rtol=0, atol=2.5e-3)
    assert np.max(np.abs(t - expected)) > 1e-4  # (the bound is not vacuous)
    # never reached: NaN; reached at ts[0]: ts[0] or NaN as asked
    assert np.isnan(first_crossing(ts, rise[:, 0], 2.0, rising=True))
    assert first_crossing(ts, rise[:, 0], 0.0, rising=True) == 0.0
    assert np.isnan(first_crossing(ts, rise[:, 0], 0.0, rising=True, at_start="nan"))
    with pytest.raises(ValueError, match="interpolate"):
        first_crossing(ts, rise, 0.5, interpolate="cubic")


def test_first_crossing_traced_equals_eager():
    ts = np.geomspace(1.0, 1e3, 40)
    ys = np.stack([ts**-0.5, 2 * ts**-1.0, ts**-2.0])  # (3, T)
    eager = np.array([first_crossing(ts, y, 0.1, log_time=True) for y in ys])
    np.testing.assert_allclose(eager, [100.0, 20.0, 10**0.5], rtol=1e-12)
    fn = jax.jit(
        jax.vmap(lambda y: first_crossing(jnp.asarray(ts), y, 0.1, log_time=True))
    )
    np.testing.assert_allclose(fn(jnp.asarray(ys)), eager, rtol=1e-12)
    # float32 in, float32 out (the level is cast to the curve's dtype)
    y32 = jnp.asarray(ys[0], jnp.float32)
    t32 = jax.jit(lambda y: first_crossing(jnp.asarray(ts, jnp.float32), y, 0.1))(y32)
    assert t32.dtype == jnp.float32


def test_crossing_time_falls_back_to_linear():
    # a non-positive value: linear interpolation in v
    assert float(crossing_time(0.0, 1.0, -1.0, 1.0, 0.5)) == pytest.approx(0.75)
    # a flat interval: its end
    assert float(crossing_time(2.0, 3.0, 1.0, 1.0, 1.0)) == 3.0
    # log time from t = 0 is linear in t
    assert float(crossing_time(0.0, 2.0, 1.0, 0.25, 0.5, log_time=True)) == 1.0


def test_loglog_slope_against_scipy():
    rng = np.random.default_rng(0)
    t = np.geomspace(1.0, 1e4, 50)
    y = 3 * t**-0.7 * np.exp(0.1 * rng.standard_normal(t.size))
    line = loglog_slope(t, y)
    ref = scipy.stats.linregress(np.log(t), np.log(y))
    np.testing.assert_allclose(
        [line.slope, line.intercept, line.slope_err],
        [ref.slope, ref.intercept, ref.stderr],
        rtol=1e-10,
    )
    # a mask leaves the other points out, whatever their values (NaN, 0)
    mask = t > 10
    y_bad = np.where(mask, y, np.nan)
    masked = loglog_slope(t, y_bad, mask)
    ref = scipy.stats.linregress(np.log(t[mask]), np.log(y[mask]))
    np.testing.assert_allclose(masked.slope, ref.slope, rtol=1e-10)
    # batched over windows: row k equals the fit of window k alone
    windows = np.stack([t < 100, (t > 10) & (t < 1e3), t > 100])
    batch = loglog_slope(t, y, windows)
    for k, w in enumerate(windows):
        np.testing.assert_allclose(batch.slope[k], loglog_slope(t[w], y[w]).slope)
    # two points: the line through them, error 0
    two = loglog_slope([1.0, 10.0], [1.0, 0.1])
    assert two.slope == pytest.approx(-1.0) and two.slope_err == 0.0
