"""Calibration of the curve analyses on simulated curves with known truth:
staircases of 2-6 logistic modes, power laws with a floor, and staircases
turning into power laws, with 0-10% noise, logged at log-spaced or at linearly
spaced steps (the way most training scripts log). Every curve is generated
here from seeded parameters (NumPy, vectorised over the modes)."""

import numpy as np
import pytest

import nqfjax


def _staircase(rng, K):
    r"""`K` isolated logistic modes (each one's loss `h_k gap_k^2`, with
    `gap_k = 1 / (1 + e^{r_k (t - t_k)})`, the exact gap of a mode switching on
    at `t_k` with `r_k t_k = ln(m*/eps)` in [10, 25]), at switch-on times `2.2`
    to `4` times apart, each drop lowering the level by a factor 1.8 to 6.3.
    Returns the clean curve, its end and its truth."""
    t1 = 10 ** rng.uniform(1.3, 2.0)
    tk = t1 * np.cumprod(np.concatenate([[1.0], 10 ** rng.uniform(0.35, 0.6, K - 1)]))
    rk = rng.uniform(10, 25) / tk
    levels = np.concatenate([[1.0], 10 ** -np.cumsum(rng.uniform(0.25, 0.8, K))])
    h = levels[:-1] - levels[1:]

    def curve(t):
        z = np.clip(rk * (t[:, None] - tk), -350, 350)  # (1 + e^z)^2 stays finite
        return levels[-1] + np.sum(h / (1 + np.exp(z)) ** 2, axis=1)

    t_end = tk[-1] * 10 ** rng.uniform(0.5, 1.0)
    return curve, t_end, dict(K=K, tk=tk, rk=rk, levels=levels, first=t1)


def _power_law(rng):
    """`L_inf + (t + t0)^-gamma`, `gamma` in [0.3, 1.2], a floor up to 0.3 of
    the last value (so it bends the end of the curve without a final
    plateau)."""
    gamma, t_end, t0 = (
        rng.uniform(0.3, 1.2),
        10 ** rng.uniform(4, 5),
        rng.uniform(0, 0.2),
    )
    floor = rng.uniform(0, 0.3) * t_end**-gamma
    return lambda t: floor + (t + t0) ** -gamma, t_end, dict(gamma=gamma, first=1.0)


def _mixed(rng):
    """A staircase of 2-3 modes whose last plateau turns into a power law
    `(1 + t / t0)^-gamma` at `t0` 1-3 times the last switch-on, followed for
    1.5-2.5 decades, with a floor up to 0.3 of its last value."""
    stairs, _, truth = _staircase(rng, rng.integers(2, 4))
    last = truth["levels"][-1]
    gamma, t0 = rng.uniform(0.3, 1.2), truth["tk"][-1] * rng.uniform(1, 3)
    t_end = t0 * 10 ** rng.uniform(1.5, 2.5)
    floor = rng.uniform(0, 0.3) * last * (1 + t_end / t0) ** -gamma
    curve = lambda t: stairs(t) - last + floor + last * (1 + t / t0) ** -gamma
    return curve, t_end, dict(truth, gamma=gamma)


def _sample(rng, curve, t_end, sampling, noise, first):
    """400 log-spaced times from 1, or every `k` steps with `k` a tenth of the
    first plateau's length (at most 20000 records); multiplicative log-normal
    noise."""
    if sampling == "log":
        ts = np.geomspace(1.0, t_end, 400)
    else:
        step = max(1.0, np.floor(first / 10))
        ts = np.arange(step, t_end + step, step)
        ts = ts[:: int(np.ceil(ts.size / 20000))]
    return ts, curve(ts) * np.exp(noise * rng.standard_normal(ts.size))


def _curves(kind, n, seed):
    """`n` seeded curves of one kind, alternating log and linear sampling, the
    noise uniform in [0, 10%]."""
    rng = np.random.default_rng(seed)
    make = {
        "staircase": lambda: _staircase(rng, rng.integers(2, 7)),
        "power_law": lambda: _power_law(rng),
        "mixed": lambda: _mixed(rng),
    }[kind]
    out = []
    for i in range(n):
        curve, t_end, truth = make()
        noise = rng.uniform(0, 0.1)
        sampling = ("log", "linear")[i % 2]
        ts, loss = _sample(rng, curve, t_end, sampling, noise, truth["first"])
        out.append((ts, loss, dict(truth, noise=noise, sampling=sampling)))
    return out


@pytest.mark.slow
def test_plateaus_and_claims_on_simulated_curves():
    """100 staircases and 60 power laws: the plateau count is right on at least
    95% (a staircase of K modes has K + 1 plateaus, a power law none); each
    drop of a correctly counted staircase lies within its transition's width
    of the switch-on time; no power law is claimed on any staircase."""
    right, total, offsets = 0, 0, []
    for ts, loss, truth in _curves("staircase", 100, seed=0):
        found = nqfjax.detect_plateaus(ts, loss)
        total += 1
        if len(found) == truth["K"] + 1:
            right += 1
            # the drop's mid-level time against the mode's t_k, in units of
            # the transition's width: gap^2 goes from 0.9 to 0.1 over 3.7 / r_k
            width = 3.7 / truth["rk"]
            offsets.append(np.abs(np.asarray(found.drop_times) - truth["tk"]) / width)
        fit = nqfjax.fit_power_law(ts, loss, uncertainty="laplace")
        assert not fit.found, (truth, fit)
    for ts, loss, truth in _curves("power_law", 60, seed=1):
        total += 1
        right += len(nqfjax.detect_plateaus(ts, loss)) == 0
    # measured 153/160 (95.6%; the slope detector, the default before the
    # staircase model: 156/160); the bar is the issue's
    assert right >= 0.95 * total, (right, total)
    offsets = np.concatenate(offsets)
    print(f"plateau count right: {right}/{total}; drop offsets max {offsets.max():.2f}")
    # measured max 0.95 (with 120 Levenberg-Marquardt steps 0.75; the slope
    # detector 0.54)
    assert np.all(offsets < 1), np.sort(offsets)[-5:]


@pytest.mark.slow
def test_gamma_interval_is_calibrated():
    """60 power laws and 60 staircases turning into power laws: the default
    (`"systematic"`) 1-sigma interval for gamma covers the truth on 60-75% of
    them, the 2-sigma one on at least 90% (the issue's bar; a Gaussian gives 68%
    and 95%). With 120 curves the coverage is known to about 4%."""
    z, missed = [], 0
    for kind, seed in (("power_law", 2), ("mixed", 3)):
        for ts, loss, truth in _curves(kind, 60, seed):
            fit = nqfjax.fit_power_law(ts, loss)
            if not fit.found:  # measured: one, a mixed curve with 10% noise
                missed += 1
                continue
            z.append((float(fit.gamma) - truth["gamma"]) / float(fit.gamma_err))
    assert missed <= 0.05 * 120
    z = np.abs(np.array(z))
    one, two = np.mean(z < 1), np.mean(z < 2)
    print(f"gamma: 1-sigma {one:.2f}, 2-sigma {two:.2f} of {z.size}; {missed} missed")
    # measured 0.68 and 0.95 of 119 (the Laplace error alone: 0.64 and 0.90, with
    # curves 5 errors off where the window bends)
    assert 0.60 <= one <= 0.75 and two >= 0.90, (one, two)
