import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.linalg

import nqfjax
import nqfjax.cli
from nqfjax.analysis.spectrum import spectrum_log_loss


def _logistic_power_law_loss(ts, p, alpha, beta, eps, eta=0.25):
    """The exact loss of `power_law_task(p, alpha, beta)` from `m0 = eps`: each
    isolated mode is logistic (docs/theory/switch-on-times.md), summed in closed
    form."""
    k = np.arange(1, p + 1, dtype=np.float64)
    lam, mstar = k**-alpha, k**-beta
    r = 4 * eta * lam * mstar
    m = mstar / (1 + (mstar / eps - 1) * np.exp(-np.outer(ts, r)))
    return 0.5 * np.sum(lam * (mstar - m) ** 2, axis=1), np.log(mstar / eps) / r


GAMMA, C, T0, L_INF = 0.6, 2.0, 10.0, 1e-4
TS = np.logspace(0, 5, 200)


def _noisy_power_law(rng, noise=0.03):
    clean = L_INF + C * (TS + T0) ** -GAMMA
    return clean * np.exp(noise * rng.standard_normal(TS.size))


@pytest.mark.slow  # a long physics check (the slow tier)
def test_fit_power_law_synthetic():
    loss = _noisy_power_law(np.random.default_rng(0))
    fit = nqfjax.fit_power_law(TS, loss)
    # 200 points with 3% multiplicative noise over 5 decades: the exponent is
    # determined to ~1% (its standard error is ~0.5%), so 2% is a real bound.
    assert abs(fit.gamma / GAMMA - 1) < 0.02
    assert 0 < fit.gamma_err < 0.02 * GAMMA
    # the window is reported and lies inside the data, spanning >= 2 decades
    lo, hi = fit.window
    assert TS[0] <= lo < hi <= TS[-1] and hi / lo > 100
    assert fit.n_points == np.sum((TS >= lo) & (TS <= hi))
    # residual scatter equals the injected noise (log units) to within 20%
    assert 0.8 * 0.03 < fit.rms < 1.2 * 0.03
    # the fitted curve goes through the clean one to within the noise
    clean = L_INF + C * (TS + T0) ** -GAMMA
    inside = (TS >= lo) & (TS <= hi)
    np.testing.assert_allclose(fit(TS[inside]), clean[inside], rtol=0.03)

    # noiseless, full window: every parameter recovered (Huber + Levenberg-
    # Marquardt converge to the exact minimum, limited by float64 round-off).
    exact = nqfjax.fit_power_law(TS, L_INF + C * (TS + T0) ** -GAMMA, window=(1, 1e5))
    np.testing.assert_allclose(
        [exact.gamma, exact.c, exact.t0, exact.L_inf], [GAMMA, C, T0, L_INF], rtol=1e-4
    )
    assert exact.window == (1.0, 1e5)


@pytest.mark.slow
def test_fit_power_law_uncertainty_covers_truth():
    rng = np.random.default_rng(1)
    zs = []
    for _ in range(20):
        fit = nqfjax.fit_power_law(TS, _noisy_power_law(rng))
        zs.append((float(fit.gamma) - GAMMA) / float(fit.gamma_err))
    zs = np.abs(np.array(zs))
    # A 2-sigma interval covers the truth with probability ~95%: at least 16 of
    # 20 (P(fewer) < 2% under the nominal rate); and the errors are not inflated
    # (some z-scores exceed 0.5).
    assert np.sum(zs < 2) >= 16, zs
    assert np.sum(zs > 0.5) >= 5, zs


def test_fit_power_law_bootstrap():
    loss = _noisy_power_law(np.random.default_rng(2))
    laplace = nqfjax.fit_power_law(TS, loss, uncertainty="laplace")
    boot = nqfjax.fit_power_law(TS, loss, uncertainty="bootstrap", n_bootstrap=48)
    assert boot.uncertainty == "bootstrap" and float(boot.gamma) == float(laplace.gamma)
    # both estimate the same standard error; 48 bootstrap replicates estimate it
    # to ~10%, the Laplace value is asymptotic: agree within a factor 1.6
    ratio = float(boot.gamma_err / laplace.gamma_err)
    assert 1 / 1.6 < ratio < 1.6


@pytest.mark.parametrize("alpha,beta", [(2.0, 0.5), (1.5, 1.0)])
def test_fit_power_law_lv_curve(alpha, beta):
    p, eps = 2000, 1e-16
    _, t_on = _logistic_power_law_loss(np.zeros(1), p, alpha, beta, eps)
    ts = np.logspace(0, np.log10(t_on[-1]) + 0.5, 300)
    loss, _ = _logistic_power_law_loss(ts, p, alpha, beta, eps)
    fit = nqfjax.fit_power_law(ts, loss)
    gamma = nqfjax.power_law_exponent(alpha, beta, "rich")
    # docs/theory/power-laws.md: the fitted exponent sits a few percent above gamma
    # (logarithmic corrections, finite p); measured +1.4% and +1.6% here.
    assert abs(fit.gamma / gamma - 1) < 0.05
    assert fit.gamma > gamma
    # The automatic window skips the resolved staircase and the finite-p cutoff:
    # it starts after the first 10 switch-ons and ends before the last 2/3.
    k_lo, k_hi = np.searchsorted(t_on, fit.window)
    assert 10 <= k_lo and k_hi <= p // 3 and fit.window[1] / fit.window[0] > 100


def test_fit_power_law_errors():
    with pytest.raises(ValueError, match="shape"):
        nqfjax.fit_power_law(TS, TS[:-1])
    with pytest.raises(ValueError, match="NaN"):
        nqfjax.fit_power_law(TS, np.where(TS > 10, np.nan, 1.0))
    with pytest.raises(ValueError, match="increasing"):
        nqfjax.fit_power_law(TS[::-1], TS)
    with pytest.raises(ValueError, match="at least 6"):
        nqfjax.fit_power_law(TS, 1 / TS, window=(1.0, 1.1))
    with pytest.raises(ValueError, match="uncertainty"):
        nqfjax.fit_power_law(TS, 1 / TS, uncertainty="magic")


# --------------------------------------------------------------------------------
# fit_spectrum


ALPHA, BETA, D = 1.2, 0.6, 8


@pytest.fixture(scope="module")
def wspace_curve():
    """W-space gradient descent on a linear two-layer perceptron (`d = 8` inputs,
    `k = 8` outputs, width 16, small isotropic init) whose task has power-law
    spectra: 16 inputs with empirical covariance exactly `diag(k^-alpha)` (scaled
    Hadamard columns) and the diagonal teacher `y_k = k^-beta x_k`. The LV
    reduction (docs/theory/lotka-volterra.md) then has independent modes with
    `B_kk = eta k^-alpha` and `m*_k = 2 k^-beta`, i.e. the model of `fit_spectrum`
    with these exponents, up to the random init (each mode starts at its own
    `eps_k`, with small couplings) and GD's discretisation."""
    k = np.arange(1, D + 1)
    xs = scipy.linalg.hadamard(16)[:, :D] * k[None, :] ** (-ALPHA / 2)
    ys = xs * k[None, :] ** -BETA
    result = nqfjax.train(
        nqfjax.Perceptron(d=D, k=D, activation=lambda z: z),
        jnp.asarray(xs),
        jnp.asarray(ys),
        num_steps=30_000,
        learning_rate=0.02,  # r_1 = 2 eta = 0.04: GD within 2% of the flow
        key=jax.random.key(0),
        init_scale=3.5e-4,
        width=16,
        num_records=150,
        snapshots=False,
    )
    return np.asarray(result.ts), np.asarray(result.loss)


@pytest.mark.slow  # a long physics check (the slow tier)
def test_fit_spectrum_recovers_wspace_spectra(wspace_curve):
    ts, loss = wspace_curve
    fit = nqfjax.fit_spectrum(ts, loss, p=D, method="solve_lv")
    assert fit.method == "solve_lv"
    # Both exponents within 10% (measured: +3% and -1.5%; the residual bias is the
    # random init, which gives every mode its own eps_k).
    assert abs(fit.alpha / ALPHA - 1) < 0.1
    assert abs(fit.beta / BETA - 1) < 0.1
    gamma = nqfjax.power_law_exponent(ALPHA, BETA, "rich")
    assert abs(fit.gamma / gamma - 1) < 0.1
    # the amplitude is 1 in the task's units (m* in units of m*_1, see fixture)
    assert abs(fit.amplitude - 1) < 0.1
    # the model reproduces the curve to a few percent (log residuals)
    assert fit.rms < 0.05
    # the closed-form logistic path reaches the same optimum (same model)
    closed = nqfjax.fit_spectrum(ts, loss, p=D, method="logistic")
    np.testing.assert_allclose(
        [closed.alpha, closed.beta, closed.rate],
        [fit.alpha, fit.beta, fit.rate],
        rtol=1e-3,
    )


def test_fit_spectrum_exact_model_curve(wspace_curve):
    # A noiseless curve of the model itself: the optimum is the truth, found to
    # round-off by Levenberg-Marquardt (closed-form path; the times and `p` of the
    # W-space test, so the compiled fit is shared).
    ts = wspace_curve[0]
    theta = np.array([1.5, 0.4, np.log(1e-8), np.log(0.02), np.log(0.3)])
    truth = nqfjax.SpectrumFit(
        alpha=jnp.asarray(theta[0]),
        beta=jnp.asarray(theta[1]),
        alpha_err=jnp.asarray(0.0),
        beta_err=jnp.asarray(0.0),
        eps=jnp.exp(theta[2]),
        rate=jnp.exp(theta[3]),
        amplitude=jnp.exp(theta[4]),
        gamma=0.0,
        rms=jnp.asarray(0.0),
        p=D,
        method="logistic",
    )
    loss = np.asarray(truth.loss(ts))
    fit = nqfjax.fit_spectrum(ts, loss, p=D, method="logistic")
    np.testing.assert_allclose(fit.theta, theta, rtol=1e-6, atol=1e-6)
    assert fit.gamma == pytest.approx(nqfjax.power_law_exponent(1.5, 0.4))
    assert fit.rms < 1e-8


def _spectrum(theta, p, method="logistic", n_modes=None):
    """A `SpectrumFit` at `theta = (alpha, beta, log eps, log rate, log A)`."""
    theta = jnp.asarray(theta, jnp.float64)
    zero = jnp.asarray(0.0)
    return nqfjax.SpectrumFit(
        alpha=theta[0],
        beta=theta[1],
        alpha_err=zero,
        beta_err=zero,
        eps=jnp.exp(theta[2]),
        rate=jnp.exp(theta[3]),
        amplitude=jnp.exp(theta[4]),
        gamma=0.0,
        rms=zero,
        p=p,
        method=method,
        n_modes=n_modes,
    )


LV_P, LV_ALPHA, LV_BETA, LV_EPS = 2000, 1.0, 0.5, 1e-16


@pytest.fixture(scope="module")
def long_spectrum_curve():
    """The loss of `power_law_task(2000, 1, 0.5)` at learning rate 1/4 (so
    `r_k = k^-1.5`, `B_kk = k^-1`, docs/theory/power-laws.md) from `m0 = 1e-16`,
    integrated by `solve_lv` (diagonal B: O(p) per step) up to t = 1e6, where
    modes up to k ~ 900 have switched on: far beyond a 200-mode model."""
    ts = np.geomspace(1.0, 1e6, 100)
    lv = nqfjax.power_law_task(LV_P, LV_ALPHA, LV_BETA).lotka_volterra()
    m0 = jnp.full(LV_P, LV_EPS)
    m = np.asarray(nqfjax.solve_lv(lv, m0, jnp.asarray(ts), 0.25).ys)
    k = np.arange(1, LV_P + 1, dtype=np.float64)
    # the loss as a sum of positive terms (lv.loss subtracts large numbers)
    loss = 0.5 * np.sum(k**-LV_ALPHA * (k**-LV_BETA - m) ** 2, axis=1)
    return ts, loss


@pytest.mark.slow  # a long physics check (the slow tier)
def test_fit_spectrum_tail_recovers_long_spectrum(long_spectrum_curve):
    ts, loss = long_spectrum_curve
    truth = np.array([LV_ALPHA, LV_BETA, np.log(LV_EPS), 0.0, 0.0])  # r_1 = A = 1
    # The model at the truth: 200 explicit modes plus the continuum tail of the
    # other 1800 reproduces the 2000-mode solve_lv curve; the sharp-switch tail
    # is first-order accurate in the switch-on width (measured max 1.0% of log L,
    # where the front crosses k = p; 9% without the shift of the switch-on time).
    model = np.asarray(_spectrum(truth, 200, n_modes=LV_P).loss(ts))
    np.testing.assert_allclose(np.log(model), np.log(loss), rtol=0, atol=0.015)

    fit = nqfjax.fit_spectrum(ts, loss, p=200, n_modes=LV_P, method="logistic")
    assert fit.n_modes == LV_P
    # Both exponents within 2% (measured: 3e-5 and 3e-4 relative; without the
    # tail, p = 200 gave alpha ~ 1.9-2.6, beta ~ 0.04-0.2); rate and amplitude
    # (both 1) likewise (measured 0.3% and 0.01%).
    np.testing.assert_allclose(
        [fit.alpha, fit.beta, fit.rate, fit.amplitude],
        [LV_ALPHA, LV_BETA, 1.0, 1.0],
        rtol=0.02,
    )
    assert fit.rms < 3e-3  # measured 1.0e-3, the tail's approximation error
    # The solve_lv path carries the same tail: the fitted model evaluated through
    # solve_lv (200 vmapped solves, atol 1e-9 on log m) equals the closed form.
    through_lv = np.asarray(dataclasses.replace(fit, method="solve_lv").loss(ts))
    np.testing.assert_allclose(through_lv, np.asarray(fit.loss(ts)), rtol=1e-7)


def test_fit_spectrum_logistic_log_loss_does_not_underflow():
    # Four modes with r_k = k^-1.5, all learned by t = 1e4: each gap is
    # ~ e^{-r_k t} <= e^{-1250}, so the loss (~ e^{-2500}) underflows to 0 in
    # float64 and its log used to be -inf (a failed start). The log-sum-exp
    # form stays finite and exact: the slowest mode (k = 4) dominates the
    # others by e^{-2 (r_3 - r_4) t} < e^{-1300}, so log L is its log term,
    # log(lam/2) + 2 (log m* + log(m*/eps - 1) - r t), up to e^{-1250}.
    p, eps, ts = 4, 1e-8, np.array([1e4, 3e4, 1e5])
    theta = jnp.array([LV_ALPHA, LV_BETA, np.log(eps), 0.0, 0.0])
    direct, _ = _logistic_power_law_loss(ts, p, LV_ALPHA, LV_BETA, eps)
    assert np.all(direct == 0)  # the direct sum underflows
    log_loss = jax.jit(
        lambda th: spectrum_log_loss(th, jnp.asarray(ts), p, "logistic", None, p)
    )
    lam, mstar, r = p**-LV_ALPHA, p**-LV_BETA, p ** -(LV_ALPHA + LV_BETA)
    expected = np.log(lam / 2) + 2 * (np.log(mstar) + np.log(mstar / eps - 1) - r * ts)
    np.testing.assert_allclose(log_loss(theta), expected, rtol=1e-12)
    # and its Jacobian (what Adam and Levenberg-Marquardt use) is finite, with
    # d log L / d log rate = -2 r t from the dominant mode
    J = jax.jacfwd(log_loss)(theta)
    assert np.all(np.isfinite(J))
    np.testing.assert_allclose(J[:, 3], -2 * r * ts, rtol=1e-9)


def test_fit_spectrum_errors():
    ts = np.geomspace(1.0, 1e4, 50)
    with pytest.raises(ValueError, match="`p`"):
        nqfjax.fit_spectrum(ts, 1 / ts, p=0)
    with pytest.raises(ValueError, match="method"):
        nqfjax.fit_spectrum(ts, 1 / ts, p=4, method="euler")
    with pytest.raises(ValueError, match="at least 8"):
        nqfjax.fit_spectrum(ts[:5], 1 / ts[:5], p=4)
    with pytest.raises(ValueError, match="starts"):
        nqfjax.fit_spectrum(ts, 1 / ts, p=4, starts=np.ones((2, 4)))
    with pytest.raises(ValueError, match="n_modes"):
        nqfjax.fit_spectrum(ts, 1 / ts, p=4, n_modes=3)
    with pytest.raises(ValueError, match="n_modes"):
        nqfjax.fit_spectrum(ts, 1 / ts, p=4, n_modes=10.5)


# --------------------------------------------------------------------------------
# nothing to fit: an all-zero, a flat and a rising curve


DEGENERATE = {
    "zero": (np.zeros_like(TS), "0 everywhere"),
    "constant": (np.full_like(TS, 0.3), "flat"),
    "noisy constant": (
        0.3 * np.exp(0.05 * np.random.default_rng(3).standard_normal(TS.size)),
        "flat",
    ),
    "rising": (0.1 + 0.01 * TS**0.3, "rises"),
}


@pytest.mark.parametrize("name", DEGENERATE)
def test_nothing_to_fit(name):
    loss, why = DEGENERATE[name]
    fit = nqfjax.fit_power_law(TS, loss)
    # no exponent and no error bar (they were gamma = 6e-13 +- 4e-39 on the
    # constant curve, and an IndexError on the zero one)
    assert not fit.found and why in fit.reason, fit.reason
    assert np.isnan(fit.gamma) and np.isnan(fit.gamma_err) and fit.n_points == 0
    spec = nqfjax.fit_spectrum(TS, loss, p=4, method="logistic")
    assert not spec.found and why in spec.reason
    assert np.isnan(spec.alpha) and np.isnan(spec.alpha_err)


def test_no_power_law_inside_a_flat_window():
    # the curve falls (a drop at t ~ 30), but the window asked for is its flat
    # end: the exponent fitted there is not distinguishable from 0
    loss = 0.1 + 1 / (1 + (TS / 30) ** 4)
    fit = nqfjax.fit_power_law(TS, loss, window=(1e3, 1e5))
    assert not fit.found and "no power law" in fit.reason, fit.reason


def test_plateaus_of_an_all_zero_curve():
    found = nqfjax.detect_plateaus(TS, np.zeros_like(TS))
    assert len(found) == 0 and "0 everywhere" in found.reason
    # with a floor given, zero is the floor: one plateau there
    found = nqfjax.detect_plateaus(TS, np.zeros_like(TS), floor=1e-3)
    assert len(found) == 1 and float(found.level[0]) == pytest.approx(1e-3)


def _write_csv(path, ts, loss):
    rows = "".join(f"{t!r},{v!r}\n" for t, v in zip(ts.tolist(), loss.tolist()))
    path.write_text("step,loss\n" + rows)


def test_cli_fit_says_nothing_to_fit(tmp_path, capsys):
    csv = tmp_path / "zero.csv"
    _write_csv(csv, np.arange(50.0), np.zeros(50))
    out = tmp_path / "out"
    assert nqfjax.cli.main(["fit", str(csv), "--out", str(out), "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "power law: nothing to fit: the loss is 0 everywhere" in printed, printed
    assert "spectrum:  nothing to fit" in printed and "plateaus:  no plateau" in printed
    assert "shape:     nothing to fit" in printed
    summary = json.loads((out / "fit.json").read_text())
    assert summary["power_law"]["found"] is False
    assert summary["spectrum"]["found"] is False
    assert summary["plateaus"]["count"] == 0


def test_curve_analysis_is_modules_and_its_old_dict_form_is_deprecated(tmp_path):
    """`analyse_curve` returns a `CurveAnalysis` of the library's modules (or
    `Skipped`/`Failed`); unpacking it as the old `(summary, figure)`, and reading
    `fit_curve_file`'s result as the old dict, still work for one release, with
    a `DeprecationWarning`, and give the numbers of the new fields and of
    `fit.json`. A staircase of two logistic modes, without the slow model
    selection: its plateau levels are the modes' unlearned losses."""
    ts = np.arange(0.0, 4000, 10)
    g1 = 1 / (1 + np.exp(0.02 * (ts - 800)))
    g2 = 1 / (1 + np.exp(0.01 * (ts - 2400)))
    loss = 0.01 + 0.4 * g1**2 + 0.1 * g2**2
    with pytest.MonkeyPatch.context() as mp:  # the model selection: ~1 min
        mp.setattr(
            nqfjax.experiments.curve, "select_model", lambda *_: _fail("refused")
        )
        found = nqfjax.experiments.analyse_curve(ts, loss, modes=None)
    assert found.model == nqfjax.experiments.Failed("refused")
    assert found.spectrum is None and found.forecast is None
    np.testing.assert_allclose(found.plateaus.level, [0.51, 0.11, 0.01], rtol=0.02)
    with pytest.warns(DeprecationWarning, match="CurveAnalysis"):
        summary, figure = found
    assert summary == found.as_dict() and "spectrum" not in summary
    assert summary["model"] == {"error": "refused"}
    np.testing.assert_array_equal(summary["plateaus"]["level"], found.plateaus.level)
    assert summary["plateaus"]["count"] == 3 and figure.axes

    csv = tmp_path / "zero.csv"
    _write_csv(csv, np.arange(50.0), np.zeros(50))
    out = nqfjax.experiments.fit_curve_file(csv, tmp_path / "out", progress=False)
    assert isinstance(out.analysis.power_law, nqfjax.experiments.Skipped)
    assert out.analysis.power_law.reason.startswith("nothing to fit")
    written = json.loads(out.files["summary"].read_text())
    with pytest.warns(DeprecationWarning, match="FitOutput"):
        assert (
            out["power_law"]
            == written["power_law"]
            == {
                "found": False,
                "reason": out.analysis.power_law.reason,
            }
        )
    with pytest.warns(DeprecationWarning):
        assert out["n_points"] == written["n_points"] == 50


def _fail(message):
    raise ValueError(message)


@pytest.mark.parametrize("value", ["-5", "0", "2.5", "nan"])
def test_cli_fit_rejects_bad_total_modes(tmp_path, capsys, value):
    csv = tmp_path / "c.csv"
    _write_csv(csv, TS[:50], 1 / TS[:50])
    out = tmp_path / "out"
    argv = ["fit", str(csv), "--out", str(out), "--modes", "4", "--total-modes", value]
    assert nqfjax.cli.main(argv) == 2  # was: silently treated as --modes (200)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--total-modes" in err[0] and value in err[0], err
    assert not out.exists()  # rejected before any work
    with pytest.raises(ValueError, match="total_modes"):
        nqfjax.experiments.analyse_curve(TS, 1 / TS, modes=4, total_modes=float(value))


# --------------------------------------------------------------------------------
# the cases: a power law logged every 50 steps; the shape of a curve


def test_linearly_logged_power_law_is_honest():
    """gamma = 0.5 with a floor of 0.01 and 5% noise, logged every 50 steps (as
    most training scripts log) and at 400 log-spaced steps: the estimates are
    within 2.5 of their (systematic) errors of the truth on every seed, and the
    two samplings agree within their errors. (Before: 0.423 +- 0.025 logged
    linearly, three standard errors low, against 0.497 +- 0.005 logged
    log-spaced.)"""
    samplings = {
        "every_50_steps": np.arange(50.0, 1e5 + 1, 50.0),
        "log_spaced": np.geomspace(50.0, 1e5, 400),
    }
    for seed in range(3):
        fits = {}
        for name, ts in samplings.items():
            rng = np.random.default_rng(seed)
            loss = (0.01 + ts**-0.5) * np.exp(0.05 * rng.standard_normal(ts.size))
            fits[name] = fit = nqfjax.fit_power_law(ts, loss)
            assert fit.found and fit.uncertainty == "systematic"
            assert abs(fit.gamma - 0.5) < 2.5 * fit.gamma_err, (name, seed, fit)
        a, b = fits.values()
        assert abs(a.gamma - b.gamma) < 2.5 * np.hypot(a.gamma_err, b.gamma_err)


@pytest.mark.slow  # a long physics check (the slow tier)
def test_select_model_names_the_shape_and_the_runner_up():
    ts = np.geomspace(1.0, 1e6, 400)
    rng = np.random.default_rng(0)
    noise = np.exp(0.03 * rng.standard_normal(ts.size))
    # two logistic modes (the plateaus test's two-mode curve, on a longer axis)
    g1 = 1 / (1 + np.exp(np.minimum(0.0276 * (ts - 500), 700)))
    g2 = 1 / (1 + np.exp(np.minimum(0.0106 * (ts - 1300), 700)))
    stairs = 0.01 + 0.38 * g1**2 + 0.11 * g2**2
    law = 1e-3 + (ts + 1) ** -0.6
    # the staircase's last plateau turning into a power law at t = 1e4
    mixed = stairs - 0.01 + 0.01 * (1 + ts / 1e4) ** -0.7
    for loss, shape in (
        (stairs, "staircase"),
        (law, "power law"),
        (mixed, "staircase turning into a power law"),
    ):
        chosen = nqfjax.select_model(ts, loss * noise)
        assert chosen.best == shape, (shape, chosen)
        assert chosen.criterion == "BIC" and chosen.runner_up not in ("", shape)
        # the runner-up lost by a BIC margin that is very strong evidence (> 10)
        assert chosen.scores[chosen.runner_up] - chosen.scores[shape] > 10
        assert "BIC" in chosen.why
        # the winner fits to the noise (3%, in log L)
        assert chosen.rms[shape] < 0.05, chosen.rms
        # its curve is the fitted model: within a few noise widths (3%) of the
        # noiseless curve everywhere
        gap = np.log(np.asarray(chosen.curve(ts))) - np.log(loss)
        assert np.max(np.abs(gap)) < 0.1, (shape, np.max(np.abs(gap)))
        # the staircase's parameters are its own (`staircase`), not those of
        # the batch's placeholder row
        assert (chosen.theta.size == 0) == (shape == "staircase"), chosen.theta
    assert not nqfjax.select_model(ts, np.full_like(ts, 0.2)).best
    # a power law cut off exponentially (no candidate has a cutoff): refused,
    # with the winner's rms, not named
    cut = nqfjax.select_model(ts, (ts + 1) ** -0.6 * np.exp(-ts / 1e5) * noise)
    assert not cut.best and cut.reason.startswith("no shape fits"), cut
    assert min(cut.rms.values()) > 0.1


def test_select_model_power_law_below_float32s_range():
    """Under float32 (JAX's default) a power law scaled by 1e-43, below
    float32's normal range (1.2e-38), is the same shape with the same fit: the
    fit runs on the scaled curve, and its model is read in `ln L` in float64
    (`log_curve`). Before, the model's loss was formed in float32, underflowed
    to NaN, and the curve was refused ("misses by an rms of inf"). Tolerances:
    the rms and the log-curve agree with the unscaled curve's to 1e-6 (the fit
    is the same up to the float32 round-off of its inputs, measured 1e-14)."""
    ts = np.geomspace(1.0, 1e5, 200)
    noise = np.exp(0.01 * np.random.default_rng(0).standard_normal(ts.size))
    loss = (0.01 + (ts + 10) ** -0.7) * noise
    with jax.enable_x64(False):
        ref = nqfjax.select_model(ts, loss)
        tiny = nqfjax.select_model(ts, loss * 1e-43)
    assert ref.best == tiny.best == "power law", (ref, tiny)
    np.testing.assert_allclose(tiny.rms["power law"], ref.rms["power law"], rtol=1e-6)
    np.testing.assert_allclose(
        tiny.log_curve(ts) - np.log(1e-43), ref.log_curve(ts), atol=1e-6
    )
    # the float64 log-curve is the fitted model: within the noise (1%, 5
    # widths) of the noiseless curve
    gap = ref.log_curve(ts) - np.log(loss / noise)
    assert np.max(np.abs(gap)) < 0.05, np.max(np.abs(gap))
    # `curve` is the default float, the same model
    with jax.enable_x64(False):
        curve = ref.curve(ts)
    assert curve.dtype == jnp.float32
    np.testing.assert_allclose(np.log(curve), ref.log_curve(ts), atol=1e-6)


@pytest.mark.slow  # a long physics check (the slow tier)
def test_two_mode_curve_is_a_staircase_without_power_law():
    """The issue's two-mode curve (logistic modes switching on at t = 500 and
    1300, 3% noise, logged every 10 steps): three plateaus, chosen as a
    staircase by BIC, no power law claimed on its flat first plateau (before:
    gamma = 0.090 +- 1.03), and a spectrum that is either refused with its
    reason or has beta >= 0 and fits to the noise (before: alpha = 17.8,
    beta = -2.6 with an rms of 0.41 in log L, printed without a word)."""
    ts = np.arange(10.0, 5001, 10)
    g1 = 1 / (1 + np.exp(0.0276 * (ts - 500)))
    g2 = 1 / (1 + np.exp(0.0106 * (ts - 1300)))
    rng = np.random.default_rng(0)
    loss = (0.01 + 0.38 * g1**2 + 0.11 * g2**2) * np.exp(
        0.03 * rng.standard_normal(ts.size)
    )
    found = nqfjax.experiments.analyse_curve(ts, loss, modes=4, total_modes=4)
    assert len(found.plateaus) == 3
    assert found.model.best == "staircase", found.model
    assert isinstance(found.power_law, nqfjax.experiments.Skipped)
    assert found.power_law.reason.startswith("no power law")
    spec = found.spectrum
    if isinstance(spec, nqfjax.experiments.Skipped):
        assert "beta" in spec.reason or "rms" in spec.reason, spec
    else:  # an accepted spectrum fits to within 3 times the 3% noise
        assert spec.beta >= 0 and spec.rms < 0.09, spec


@pytest.mark.slow  # compiles the solve_lv fit (forward mode through every mode)
def test_fit_spectrum_deprecated_tolerances_same_numbers():
    """`rtol`/`atol` (deprecated) warn naming the controller to pass and give
    exactly the fit of `stepsize_controller=lv_stepsize_controller(atol,
    rtol=rtol)`; on a noiseless curve of the model (closed-form logistic modes)
    started at the truth, the `solve_lv` fit stays at the truth."""
    ts = np.geomspace(1.0, 3e4, 40)
    theta = np.array([1.5, 0.4, np.log(1e-8), np.log(0.02), np.log(0.3)])
    loss = np.asarray(_spectrum(theta, 2).loss(ts))
    kw = dict(p=2, method="solve_lv", starts=theta[None], steps=1, polish=10)
    with pytest.warns(DeprecationWarning, match="lv_stepsize_controller"):
        old = nqfjax.fit_spectrum(ts, loss, rtol=1e-8, atol=1e-8, **kw)
    control = nqfjax.lv_stepsize_controller(1e-8, rtol=1e-8)
    new = nqfjax.fit_spectrum(ts, loss, stepsize_controller=control, **kw)
    np.testing.assert_array_equal(old.theta, new.theta)
    np.testing.assert_allclose(new.theta, theta, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="not both"):
        with pytest.warns(DeprecationWarning):
            nqfjax.fit_spectrum(ts, loss, stepsize_controller=control, atol=1e-8, **kw)


def test_one_default_spectrum_method():
    """`fit_spectrum`, `analyse_curve`, `fit_curve_file` and `nqfjax fit` share
    one default way of computing the spectrum model's modes, the closed form."""
    import inspect

    from nqfjax.analysis.spectrum import DEFAULT_SPECTRUM_METHOD

    assert DEFAULT_SPECTRUM_METHOD == "logistic"
    params = inspect.signature(nqfjax.fit_spectrum).parameters
    assert params["method"].default == DEFAULT_SPECTRUM_METHOD
    for fn in (nqfjax.experiments.analyse_curve, nqfjax.experiments.fit_curve_file):
        params = inspect.signature(fn).parameters
        assert params["spectrum_method"].default == DEFAULT_SPECTRUM_METHOD
    args = nqfjax.cli._parser().parse_args(["fit", "c.csv"])
    assert args.spectrum_method == DEFAULT_SPECTRUM_METHOD


@pytest.mark.slow  # a long physics check (the slow tier)
@pytest.mark.parametrize("x64", [True, False], ids=["float64", "float32"])
def test_the_example_curve_is_a_staircase_turning_into_a_power_law(x64):
    # examples/power_law_curve.csv: 2000 logistic modes with alpha = 1,
    # beta = 1/2 (the how-to's example): four resolved plateaus, then the
    # merged modes' power law. A staircase model flexible enough to fit the
    # tail as broad drops must not take it for a plain staircase. In float32
    # too (JAX's default): its candidates are fitted in float64 (before, the
    # mixed one stalled and the curve came out "no shape fits" or a power law)
    from pathlib import Path

    data = np.loadtxt(
        Path(__file__).resolve().parents[1] / "examples" / "power_law_curve.csv",
        delimiter=",",
        comments="#",
        skiprows=7,  # six comment lines and the header
    )
    ts, loss = data[:, 0], data[:, 1]
    with jax.enable_x64(x64):
        chosen = nqfjax.select_model(ts, loss)
        plateaus = nqfjax.detect_plateaus(ts[ts > 0], loss[ts > 0])
    assert chosen.best == "staircase turning into a power law", chosen
    assert chosen.runner_up == "power law", chosen
    assert chosen.theta.dtype == (jnp.float64 if x64 else jnp.float32)
    assert len(plateaus) == 4, plateaus
