"""`switch_ons`: switch-ons read off the eigenvalues of `M(t)` by rank, against
closed forms (logistic modes whose eigenvectors rotate and whose values
cross), on predictions (never more than the rank of `M`, in time order) and
on real training (the same statistic on a trained network, slow tier)."""

import jax.random as jr
import numpy as np
import pytest

import nqfjax
from nqfjax.experiments.predict_file import default_hyperparameters


def _rotating_modes(ts, values, halves, width=5.0, p=4):
    """`M(t) = sum_k m_k(t) v_k(t) v_k(t)^T` with logistic `m_k` (last value
    `values[k]`, half-way at `halves[k]`) and eigenvectors that rotate with `t`
    (so that following one through time is not defined where two values cross)."""
    out = np.zeros((len(ts), p, p))
    for i, t in enumerate(ts):
        angle = 0.01 * t
        R = np.eye(p)
        R[:2, :2] = [[np.cos(angle), -np.sin(angle)], [np.sin(angle), np.cos(angle)]]
        m = np.array(values) / (1 + np.exp(-(t - np.array(halves)) / width)) + 1e-8
        V = R[:, : len(values)]
        out[i] = (V * m) @ V.T
    return out


def _logistic_crossing(value, half, level, width=5.0):
    """When `value / (1 + exp(-(t - half) / width))` reaches `level`."""
    return half - width * np.log(value / level - 1.0)


def test_rank_curves_time_modes_that_cross_and_rotate():
    """Mode a (last value 2, half-way at t = 100) and mode b (1.5, at 103),
    whose eigenvectors rotate: the threshold is half the smaller value, 0.75;
    the largest eigenvalue crosses it when a does, the second when b does (at
    its half-way point), whatever the eigenvectors do."""
    ts = np.linspace(0.0, 300.0, 3001)
    M = _rotating_modes(ts, [2.0, 1.5], [100.0, 103.0])
    ons = nqfjax.switch_ons(M, ts)
    assert ons.curves.shape == (3001, 2)  # the learned ranks only
    np.testing.assert_allclose(ons.threshold, 0.75, rtol=1e-6)
    # log-linear interpolation between records 0.1 apart on a logistic of width
    # 5: the curvature of log m over one interval, ~1e-4 of the time at most
    expected = [_logistic_crossing(2.0, 100.0, 0.75), 103.0]
    np.testing.assert_allclose(ons.times, expected, rtol=1e-4)
    # 5.3% apart: two groups at the default resolution of 2%, one at 6%
    np.testing.assert_array_equal(ons.groups, [0, 1])
    wide = nqfjax.switch_ons(M, ts, resolution=0.06)
    np.testing.assert_array_equal(wide.groups, [0, 0])
    np.testing.assert_allclose(wide.group_times, [np.mean(expected)], rtol=1e-4)
    spread = (expected[1] - expected[0]) / np.mean(expected)
    np.testing.assert_allclose(wide.group_spreads, [spread], rtol=1e-3)
    # timed again at another threshold (e.g. a prediction's), from the SwitchOns
    other = nqfjax.switch_ons(ons, threshold=0.3)
    expected = [_logistic_crossing(2.0, 100.0, 0.3), _logistic_crossing(1.5, 103, 0.3)]
    np.testing.assert_allclose(other.times, expected, rtol=1e-4)


def test_a_larger_later_mode_does_not_hide_an_earlier_one():
    """Mode a (last value 1, half-way at t = 120) is overtaken by mode b (3, at
    250): both switch-ons are there, in time order (by rank with a level of
    half each rank's own last value, the largest eigenvalue would reach 1.5
    only through b and a's switch-on would be lost). A rank already above the
    threshold at `ts[0]` has no switch-on (NaN)."""
    ts = np.linspace(0.0, 400.0, 2001)
    M = _rotating_modes(ts, [1.0, 3.0], [120.0, 250.0])
    ons = nqfjax.switch_ons(M, ts)
    np.testing.assert_allclose(ons.threshold, 0.5)
    expected = [120.0, _logistic_crossing(3.0, 250.0, 0.5)]
    np.testing.assert_allclose(ons.times, expected, rtol=1e-4)
    late = nqfjax.switch_ons(M[1000:], ts[1000:], threshold=0.5, num_modes=2)
    assert np.isnan(late.times[0])
    np.testing.assert_allclose(late.times[1], expected[1], rtol=1e-4)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda M, ts: nqfjax.switch_ons(M[0], ts), r"\(T, p, p\)"),
        (lambda M, ts: nqfjax.switch_ons(M), r"`ts`"),
        (lambda M, ts: nqfjax.switch_ons(M, ts[:-1]), r"`ts` must be increasing"),
        (lambda M, ts: nqfjax.switch_ons(M, ts[::-1]), r"`ts` must be increasing"),
        (lambda M, ts: nqfjax.switch_ons(M, ts, num_modes=5), "at most 4"),
        (lambda M, ts: nqfjax.switch_ons(M, ts, threshold=0.0), "threshold"),
        (lambda M, ts: nqfjax.switch_ons(M, ts, num_modes=1.5), "num_modes"),
        (lambda M, ts: nqfjax.switch_ons(M, ts, resolution=-0.1), "resolution"),
        (lambda M, ts: nqfjax.switch_ons("M", ts), "TrainResult"),
    ],
)
def test_bad_input_is_named(call, message):
    ts = np.linspace(0.0, 10.0, 11)
    M = _rotating_modes(ts, [1.0], [5.0])
    with pytest.raises(ValueError, match=message):
        call(M, ts)


@pytest.fixture(scope="module")
def digits():
    """Digits (200 images, 12 principal components): 10 classes, 9 modes to
    learn, `p = 22`."""
    xs, ys = nqfjax.load_dataset("digits", n=200, pca=12, dtype=np.float64)
    return nqfjax.Perceptron(d=12, k=10), xs, ys


@pytest.mark.slow
@pytest.mark.parametrize("width", [2])
def test_never_more_switch_ons_than_units(digits, width):
    """Nine modes are there to learn; `M = W W^T` of `width` units has rank at
    most `width`: that many switch-ons at most, in time order, and the trained
    network timed the same way has as many."""
    structure, xs, ys = digits
    eta, num_steps = default_hyperparameters(structure, xs, ys, 1e-4)
    common = dict(init_scale=1e-4, learning_rate=eta, width=width, key=jr.key(0))
    pred = nqfjax.predict(
        structure, xs, ys, num_steps=num_steps, num_records=40, **common
    )
    times = np.asarray(pred.switch_times)
    assert 1 <= len(times) <= width
    assert pred.mode_curves.shape[1] == pred.modes.shape[1] == len(times)
    assert np.all(np.diff(times[np.isfinite(times)]) > 0)
    run = nqfjax.train(structure, xs, ys, num_steps=int(pred.ts[-1]), **common)
    ons = nqfjax.switch_ons(run, threshold=float(pred.switch_ons.threshold))
    assert len(ons.times) <= width
    with pytest.raises(ValueError, match=f"at most {width}"):
        nqfjax.switch_ons(run, num_modes=width + 1)


def _real_run(name, width, sigma=1e-4, model=nqfjax.Layer()):
    if name == "digits":
        xs, ys = nqfjax.load_dataset("digits", n=500, pca=16, dtype=np.float64)
    else:
        xs, ys = nqfjax.load_dataset(name, dtype=np.float64)
    structure = nqfjax.Perceptron(d=xs.shape[1], k=ys.shape[1])
    eta, num_steps = default_hyperparameters(structure, xs, ys, sigma)
    common = dict(init_scale=sigma, learning_rate=eta, width=width, key=jr.key(0))
    pred = nqfjax.predict(structure, xs, ys, num_steps=num_steps, **common)
    steps = [int(t) for t in np.asarray(pred.ts)]
    runs = {
        type(m).__name__: nqfjax.train(
            structure, xs, ys, num_steps=steps[-1], record_at=steps, model=m, **common
        )
        for m in (nqfjax.Layer(), nqfjax.QuadraticForm())
    }
    return pred, runs


def _errors(pred, run):
    ons = pred.switch_ons
    q = len(ons.times)
    measured = nqfjax.switch_ons(run, threshold=float(ons.threshold), num_modes=q)
    return np.asarray(measured.times) / np.asarray(ons.times) - 1


@pytest.mark.slow  # digits and wine: a prediction and two trained networks each
@pytest.mark.parametrize("name, width", [("digits", 32), ("wine", 16)])
def test_switch_times_against_the_same_statistic_on_training(name, width):
    """The prediction's switch-ons against networks trained from its initial
    weights (init 1e-4), timed by `switch_ons` at the prediction's threshold.
    The quadratic model: every switch-on within 2% (full-batch GD lags the flow
    by about r/4 = 0.25% at the growth rate r = 0.01 of
    `default_hyperparameters`). The real tanh perceptron: the first three (what
    `agreement` compares) within 2%, where the issue's digits case had two modes
    0.5% apart reported 5% off each way when modes were followed by eigenvector
    overlap. Measured on digits at width 32: +0.29%, +0.31%, +0.35%, +0.57%,
    +1.3%, -0.53%, +0.61%, then -3.1% and -30% for the last two, which switch on
    after the real layer has left its quadratic form (its cubic term)."""
    pred, runs = _real_run(name, width)
    ons = pred.switch_ons
    assert len(ons.times) >= 2 and np.all(np.isfinite(ons.times))
    assert len(ons.times) <= width and np.all(np.diff(ons.times) >= 0)
    quadratic = _errors(pred, runs["QuadraticForm"])
    assert np.all(np.abs(quadratic) < 0.02), quadratic
    real = _errors(pred, runs["Layer"])
    assert np.all(np.abs(real[:3]) < 0.02), real
    # agreement compares the same statistic
    agree = nqfjax.agreement(pred, runs["Layer"], num_switches=len(ons.times))
    np.testing.assert_allclose(agree.time_errors, real, rtol=1e-6, atol=1e-12)
