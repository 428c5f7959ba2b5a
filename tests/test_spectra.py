"""Weight spectra (issue 8 item 3; docs/theory/weight-spectra.md): the Marchenko-Pastur
bulk of M0 = sigma^2 Z Z^T and the outliers that learned modes pull out of it.

The task with four modes is the whitened two-layer linear network (the
perceptron's quadratic form, A_j = (e_j x^T + x e_j^T)/2): an orthogonal design
makes (1/n) xs^T xs = I exactly, so the sampled task reduces exactly and each
singular value s of the teacher is one independent logistic mode with
r = 2 eta s and learned value m* = 2 s (docs/theory/lotka-volterra.md), along
(a_s, b_s)/sqrt2; the (a_s, -b_s)/sqrt2 directions have r = -2 eta s and shrink.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import integrate

import nqfjax


K = D = 4
N_SAMPLES = 16
SIG = np.array([4.0, 2.0, 1.0, 0.5])  # teacher singular values: 4 modes
ETA = 0.0025  # r_1 = 2 eta s_1 = 0.02 per step
WIDTH = 32
SIGMA = 1e-4
STEPS = 8000  # the weakest mode switches on at ~6000
RECORD = np.linspace(0, STEPS, 401).astype(int)


def _mp_cdf(p, m, sigma, x):
    """CDF of the MP law (with its atom at 0 when p > m) by quadrature."""
    lo, hi = (float(e) for e in nqfjax.marchenko_pastur_edges(p, m, sigma))
    atom = max(0.0, 1 - m / p)
    grid = np.linspace(lo, hi, 20001)
    dens = np.asarray(nqfjax.marchenko_pastur_density(grid, p, m, sigma))
    cdf = atom + integrate.cumulative_trapezoid(dens, grid, initial=0.0)
    return np.interp(x, grid, cdf, left=atom, right=1.0)


@pytest.mark.parametrize("p, m", [(100, 400), (200, 100)])
def test_marchenko_pastur_density_moments(p, m):
    """The closed-form density integrates to min(1, m/p) (the rest is the atom
    at 0), and with the atom has mean s = sigma^2 m and second moment
    s^2 (1 + p/m): the first two moments of (1/p) Tr M0^j, exact in
    expectation (E Tr ZZ^T = pm; E Tr (ZZ^T)^2 = pm(p + m + 1))."""
    sigma = 0.3
    lo, hi = (float(e) for e in nqfjax.marchenko_pastur_edges(p, m, sigma))
    np.testing.assert_allclose(
        [lo, hi], sigma**2 * (np.sqrt(m) + np.array([-1, 1]) * np.sqrt(p)) ** 2
    )
    # x = centre - half cos(theta) removes the square-root edges: the integrand
    # becomes smooth and periodic, and the trapezoid rule converges fast
    theta = np.linspace(0, np.pi, 4001)
    x = 0.5 * (lo + hi) - 0.5 * (hi - lo) * np.cos(theta)
    dens = np.asarray(nqfjax.marchenko_pastur_density(x, p, m, sigma))
    weight = dens * 0.5 * (hi - lo) * np.sin(theta)
    mass, mean, second = (np.trapezoid(weight * x**j, theta) for j in range(3))
    s, c = sigma**2 * m, p / m
    np.testing.assert_allclose(mass, min(1.0, 1 / c), rtol=1e-6)
    np.testing.assert_allclose(mean, s, rtol=1e-6)
    np.testing.assert_allclose(second, s**2 * (1 + c), rtol=1e-6)


@pytest.mark.parametrize("p, m", [(300, 1200), (400, 200)])
def test_marchenko_pastur_matches_large_random_init(p, m):
    sigma = 0.05
    Z = np.random.default_rng(0).normal(size=(p, m))
    ev = np.linalg.eigvalsh(sigma**2 * Z @ Z.T)
    lo, hi = (float(e) for e in nqfjax.marchenko_pastur_edges(p, m, sigma))
    # the extreme eigenvalues sit at the edges up to Tracy-Widom fluctuations,
    # ~1% (top) and ~2% (bottom) here, plus an O(min(p,m)^-2/3) bias
    nonzero = ev[-min(p, m) :]
    np.testing.assert_allclose(nonzero[-1], hi, rtol=0.03)
    np.testing.assert_allclose(nonzero[0], lo, rtol=0.08)
    if p > m:
        assert np.all(np.abs(ev[: p - m]) < 1e-10 * hi)  # the atom at zero
    # the whole spectrum: eigenvalues of a Wishart matrix are rigid (their
    # empirical CDF deviates by O(log p / p), far below sqrt(1/p) of iid draws)
    q = min(p, m)
    emp = 1 - q / p + (np.arange(1, q + 1) - 0.5) / p
    ks = np.max(np.abs(_mp_cdf(p, m, sigma, nonzero) - emp))
    assert ks < 0.02, ks


# ---------------------------------------------------------------------------
# training: four modes, and no signal


def _whitened_data(signal: bool):
    rng = np.random.default_rng(0)
    xs = np.sqrt(N_SAMPLES) * np.linalg.qr(rng.normal(size=(N_SAMPLES, N_SAMPLES)))[0]
    xs, rest = xs[:, :D], xs[:, D:]
    if signal:
        U = np.linalg.qr(rng.normal(size=(K, K)))[0]
        V = np.linalg.qr(rng.normal(size=(D, D)))[0]
        ys = xs @ (U @ np.diag(SIG) @ V.T).T
    else:
        # labels of the same size but orthogonal to every input feature:
        # E[y x^T] = 0 exactly, so C = 0 and nothing can be learned
        ys = rest @ rng.normal(size=(N_SAMPLES - D, K))
    return xs, ys


@pytest.fixture(scope="module")
def runs():
    structure = nqfjax.Perceptron(d=D, k=K)
    out = {}
    for signal in (True, False):
        xs, ys = _whitened_data(signal)
        res = nqfjax.train(
            structure,
            xs,
            ys,
            num_steps=STEPS,
            learning_rate=ETA,
            key=jax.random.key(1),
            init_scale=SIGMA,
            width=WIDTH,
            model=nqfjax.QuadraticForm(),
            record_at=RECORD,
        )
        out[signal] = (structure, xs, ys, res)
    return out


def test_four_modes_detach_at_their_switch_on_times(runs):
    structure, xs, ys, res = runs[True]
    task = nqfjax.task_from_samples(structure, xs, ys)
    lv, basis = nqfjax.lv_reduce(task)  # in flow time
    np.testing.assert_allclose(lv.r[:4], 2 * SIG, rtol=1e-10)
    spec = nqfjax.weight_spectrum(res.ts, res.M, width=WIDTH, basis=basis)

    # the bulk at init: sigma estimated from Tr M0 (error ~sqrt(2/(p m)) = 9%),
    # top eigenvalue within the Tracy-Widom range (~10% for p = 8) of the edge
    np.testing.assert_allclose(spec.init_scale, SIGMA, rtol=0.1)
    ev0 = np.asarray(spec.eigenvalues[0])
    lo, hi = np.asarray(spec.edges)
    assert 0.6 * hi < ev0[0] < float(spec.threshold)
    assert ev0[-1] > 0.5 * lo

    # four outliers, one per mode, in the order the modes switch on
    assert spec.n_outliers == 4
    np.testing.assert_array_equal(spec.modes, [0, 1, 2, 3])
    assert np.all(np.asarray(spec.overlaps) > 0.99)
    # each ends at its learned value m* = 2 s (the weakest is still ~1% short)
    np.testing.assert_allclose(spec.peak, 2 * SIG, rtol=0.02)
    assert np.all(np.isnan(np.asarray(spec.t_return)))

    # times: the half-way time matches the LV switch-on time from the diagonal
    # of the same M0 within the width of a transition, ln(81)/r_k (10% to 90%
    # of a logistic); measured within ~0.1 widths
    m0 = np.diag(np.asarray(basis).T @ np.asarray(res.M[0]) @ np.asarray(basis))
    t_on = np.asarray(nqfjax.switch_on_times(lv, m0))[:4] / ETA  # steps
    r = ETA * np.asarray(lv.r)[:4]  # per step
    width = np.log(81) / r
    assert np.all(np.abs(np.asarray(spec.t_half) - t_on) < width)
    # the outlier leaves the bulk when its mode has grown past the threshold:
    # m0 e^{rt} = threshold, up to the O(1) shift of a spiked eigenvalue
    t_exp = np.log(float(spec.threshold) / m0[:4]) / r
    assert np.all(np.abs(np.asarray(spec.t_detach) - t_exp) < width)
    assert np.all(np.asarray(spec.t_detach) < np.asarray(spec.t_half))

    # singular values of W are the square roots of the eigenvalues of M; from M
    # a small one s carries the absolute eigenvalue error ~eps |M| / (2 s),
    # ~1e-8 for the bulk (s ~ 3e-7) next to outliers of size 8
    sv = np.linalg.svd(np.asarray(res.W), compute_uv=False)
    np.testing.assert_allclose(spec.singular_values[-1], sv, rtol=1e-8, atol=3e-8)


def test_no_outliers_without_signal(runs):
    structure, xs, ys, res = runs[False]
    task = nqfjax.task_from_samples(structure, xs, ys)
    assert float(jnp.max(jnp.abs(task.C))) < 1e-12  # no signal at all
    assert float(task.y2) > 1.0  # but the labels are not zero
    spec = nqfjax.weight_spectrum(res.ts, res.M, width=WIDTH, init_scale=SIGMA)
    assert spec.n_outliers == 0
    # the spectrum stays in the bulk all along (it can only shrink here)
    assert float(np.max(np.asarray(spec.eigenvalues))) < float(spec.threshold)
    np.testing.assert_allclose(
        spec.eigenvalues[-1], spec.eigenvalues[0], rtol=1e-3
    )  # G = K[M] = O(sigma^4): the bulk barely moves


def test_tracking_follows_vectors_through_a_crossing():
    """Synthetic spectra with closed-form logistic outliers: a mode that switches
    on late but ends larger overtakes an earlier one; tracked by eigenvector,
    each outlier keeps its mode, its peak and its exact half-way time."""
    p, m, sigma = 12, 48, 0.05
    rng = np.random.default_rng(3)
    Z = rng.normal(size=(p, m))
    M0 = sigma**2 * Z @ Z.T
    Q = np.linalg.qr(rng.normal(size=(p, p)))[0]
    ts = np.linspace(0, 100, 2001)
    mstar = np.array([1.0, 3.0])  # mode 0 early and small, mode 1 late and large
    t_half = np.array([30.0, 60.0])
    rate = np.array([0.4, 0.3])
    logistic = mstar / (1 + np.exp(-rate * (ts[:, None] - t_half)))
    Ms = M0 + np.einsum("tk,ik,jk->tij", logistic, Q[:, :2], Q[:, :2])
    spec = nqfjax.weight_spectrum(ts, Ms, width=m, basis=Q)
    assert spec.n_outliers == 2
    np.testing.assert_array_equal(spec.modes, [0, 1])
    # peak: m* plus, to first order, the bulk's component along the mode,
    # u^T M0 u ~ sigma^2 m = 0.12 (second order: ~|M0 u|^2 / m* ~ 1%)
    bulk = np.diag(Q.T @ M0 @ Q)[:2]
    np.testing.assert_allclose(spec.peak, mstar + bulk, rtol=0.03)
    # the half-way time of logistic + bulk, reaching (m* + bulk)/2 when the
    # logistic is at (m* - bulk)/2: earlier by ln((m* + b)/(m* - b))/rate
    # (0.6 and 0.2 here); second-order terms and the records (every 0.05)
    # leave ~0.05
    shift = np.log((mstar + bulk) / (mstar - bulk)) / rate
    np.testing.assert_allclose(spec.t_half, t_half - shift, atol=0.1)
    # the values do cross: after t ~ 60 the second outlier is the largest
    vals = np.asarray(spec.values)
    assert vals[1, -1] > vals[0, -1] and vals[1, 1100] < vals[0, 1100]
    # float32 snapshots: the same outliers (eigenvalues to ~1e-7 relative)
    spec32 = nqfjax.weight_spectrum(ts, Ms.astype(np.float32), width=m, basis=Q)
    assert spec32.t_half.dtype == np.float32
    np.testing.assert_array_equal(spec32.modes, [0, 1])
    np.testing.assert_allclose(spec32.t_half, spec.t_half, atol=1e-3)


def test_bad_input():
    ts = np.arange(3.0)
    Ms = np.stack([np.eye(3)] * 3)
    with pytest.raises(ValueError, match="Ms"):
        nqfjax.weight_spectrum(ts, Ms[:, :2], width=4)
    with pytest.raises(ValueError, match="ts"):
        nqfjax.weight_spectrum(ts[::-1], Ms, width=4)
    with pytest.raises(ValueError, match="margin"):
        nqfjax.weight_spectrum(ts, Ms, width=4, margin=0.0)
    with pytest.raises(ValueError, match="basis"):
        nqfjax.weight_spectrum(ts, Ms, width=4, basis=np.eye(2))
    with pytest.raises(ValueError, match="init_scale"):
        nqfjax.weight_spectrum(ts, Ms, width=4, init_scale=-1.0)
    with pytest.raises(ValueError, match="m"):
        nqfjax.marchenko_pastur_edges(3, 0)
    with pytest.raises(ValueError, match="init_scale"):
        nqfjax.marchenko_pastur_edges(3, 4, 0.0)
