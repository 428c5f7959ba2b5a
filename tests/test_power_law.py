"""Power laws from many unresolved modes (docs/theory/power-laws.md): thousands of
independent Lotka-Volterra modes integrated with `solve_lv`, the refined
sharp-switch sum, `power_law_exponent` in the rich and lazy regimes."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.special

import nqfjax


P = 2000  # modes
ETA = 0.25  # so that 4 eta = 1: r_k = k^-(alpha+beta), B_kk = k^-alpha
EPS = 1e-16
PAIRS = [(1.0, 0.5), (1.5, 0.75)]


def _fit_exponent(ts, loss):
    """Least-squares slope of ln L against ln t, and the largest residual."""
    x, y = np.log(ts), np.log(loss)
    coef = np.polyfit(x, y, 1)
    return -coef[0], np.max(np.abs(y - np.polyval(coef, x)))


def _power_law_lv(alpha, beta):
    """`power_law_task(P, alpha, beta)` reduced at `ETA`, with the modes beyond
    `P` kept as a constant in the loss: `sum_{k > P} lam_k m*_k^2 / 2` (Hurwitz
    zeta). They are unlearned until mode `P` switches on, which is after the
    fitting window, so inside it this is the infinite spectrum exactly (without
    it, the missing tail would bend the curve near the end of the window)."""
    task = nqfjax.power_law_task(P, alpha, beta)
    # B is diagonal, held as its diagonal (O(P)): no P x P matrix is built or
    # checked
    lv = task.lotka_volterra()  # in flow time: solved at ETA below
    assert isinstance(lv.interactions, nqfjax.DiagonalInteractions)
    tail = 0.5 * scipy.special.zeta(alpha + 2 * beta, P + 1)
    return eqx.tree_at(lambda s: s.loss_offset, lv, lv.loss_offset + tail)


@jax.jit
def _solve_independent(r, Bdiag, eps, ts):
    """`solve_lv` of every mode on its own (p = 1 each), vmapped: the default
    implicit solver would form a dense P x P Jacobian for the coupled call,
    although B is diagonal. Under vmap every mode takes the largest step count,
    fine here since all modes are logistic curves of similar shape."""

    def one(r_k, B_k):
        lv = nqfjax.LotkaVolterra(r_k[None], B_diag=B_k[None])
        return nqfjax.solve_lv(lv, jnp.full((1,), eps), ts).ys[:, 0]

    return jax.vmap(one, out_axes=1)(r, Bdiag)


@pytest.mark.parametrize("alpha, beta", PAIRS)
def test_rich_power_law(alpha, beta):
    lv = _power_law_lv(alpha, beta)
    log_eps = np.log(1 / EPS)

    def t_on(k):  # sharp switch-on time of mode k: ln(m*_k / eps) / r_k
        return (log_eps - beta * np.log(k)) * k ** (alpha + beta) / (4 * ETA)

    # The window. Below: mode k's step is separated from the next by
    # t_k (alpha + beta) / k, wider than its own transition (~ t_k / ln(1/eps))
    # while k < (alpha + beta) ln(1/eps); there the curve is a staircase, not a
    # power law, so start at twice that. Above: only P modes are resolved, and
    # the last ones carry finite-P effects; stop where mode P/2 switches on.
    k_lo, k_hi = 2 * (alpha + beta) * log_eps, P / 2
    t_lo, t_hi = t_on(k_lo), t_on(k_hi)
    assert np.log10(t_hi / t_lo) >= 1.4  # at least one decade (1.4-1.7 here)
    ts = np.geomspace(t_lo, t_hi, 160)
    # per step at ETA (exact: 4 ETA = 1)
    m = _solve_independent(
        ETA * lv.r, ETA * lv.self_interactions(), EPS, jnp.asarray(ts)
    )
    loss = np.asarray(lv.loss(m))

    gamma_fit, worst = _fit_exponent(ts, loss)
    # a power law over the whole window: residuals of the log-log line are a
    # few 1e-3 (the log corrections bend it slightly), a staircase or a curved
    # decay would leave ~0.1
    assert worst < 0.02, worst
    # the two halves of the window give the same exponent (to the log
    # corrections, ~1%)
    half = len(ts) // 2
    g1, _ = _fit_exponent(ts[:half], loss[:half])
    g2, _ = _fit_exponent(ts[half:], loss[half:])
    np.testing.assert_allclose(g1, g2, rtol=0.03)

    # the refined sharp-switch sum keeps the log corrections: its slope matches
    # the simulation to < 1% (docs/theory/power-laws.md: 0.1-0.3%)
    sharp = np.asarray(nqfjax.sharp_switch_loss(lv, EPS, ETA * ts))  # flow times
    gamma_sharp, _ = _fit_exponent(ts, sharp)
    np.testing.assert_allclose(gamma_fit, gamma_sharp, rtol=0.01)
    # the asymptotic exponent: the log corrections make the fit come out a few
    # percent above it (docs/theory/power-laws.md: +2% to +5% at eps =
    # 1e-16..1e-30)
    gamma = nqfjax.power_law_exponent(alpha, beta, "rich")
    np.testing.assert_allclose(gamma_fit, gamma, rtol=0.05)
    assert gamma_fit > gamma


@pytest.mark.parametrize("alpha, beta", PAIRS)
def test_lazy_power_law(alpha, beta):
    """The lazy/linear regime with the same spectra: gradient descent on a linear
    model `f = sum_k theta_k phi_k` with feature variances `lam_k` and target
    coefficients `m*_k`, simulated step by step. Mode k relaxes at rate
    `~ 2 eta lam_k`, so it is learned at `t ~ k^alpha / (2 eta)`."""
    p, eta = 10_000, 0.5
    k = jnp.arange(1, p + 1, dtype=jnp.float64)
    lam, mstar = k**-alpha, k**-beta
    # modes beyond p: constant (they relax by < 3% of a negligible tail here)
    tail = 0.5 * scipy.special.zeta(alpha + 2 * beta, p + 1)
    # window: the learned front k_c = (2 eta t)^(1/alpha) from 10 modes (the
    # discreteness of the first modes) to 300 (far below p)
    t_lo, t_hi = 10**alpha / (2 * eta), 300**alpha / (2 * eta)
    steps = int(np.ceil(t_hi))

    def step(theta, _):
        theta = theta - eta * lam * (theta - mstar)
        return theta, 0.5 * jnp.sum(lam * (theta - mstar) ** 2) + tail

    _, loss = jax.jit(lambda: jax.lax.scan(step, jnp.zeros(p), None, length=steps))()
    loss = np.asarray(loss)  # loss[s - 1] is after s steps
    ts = np.unique(np.geomspace(t_lo, t_hi, 200).astype(int))
    assert np.log10(ts[-1] / ts[0]) >= 1.4
    gamma_fit, worst = _fit_exponent(ts, loss[ts - 1])
    assert worst < 0.03, worst
    gamma = nqfjax.power_law_exponent(alpha, beta, "lazy")
    # the sum over modes is a Riemann sum of a pure power law: measured within
    # 1%, 3% leaves room for the discreteness at the lower end
    np.testing.assert_allclose(gamma_fit, gamma, rtol=0.03)
    # and it is not the rich exponent
    assert abs(gamma_fit - nqfjax.power_law_exponent(alpha, beta, "rich")) > 0.2


def test_sharp_switch_loss_is_the_sum():
    """`sharp_switch_loss` against the brute-force sum of docs/theory/power-laws.md,
    `(1/2) sum_{k: t_k > t} lam_k m*_k^2`, with decay and per-mode eps too."""
    alpha, beta, p = 1.2, 0.4, 300
    k = np.arange(1, p + 1.0)
    lam, mstar = k**-alpha, k**-beta
    lv = nqfjax.LotkaVolterra(
        4 * ETA * lam * mstar,
        np.diag(4 * ETA * lam),
        loss_scale=1 / (4 * ETA),
        loss_offset=0.5 * np.sum(lam * mstar**2),
    )
    eps = np.geomspace(1e-12, 1e-8, p)
    t_k = np.log(mstar / eps) / (4 * ETA * lam * mstar)
    ts = np.geomspace(t_k.min() / 2, t_k.max() * 2, 400)
    brute = 0.5 * np.sum(lam * mstar**2 * (t_k[None, :] > ts[:, None]), axis=1)
    sharp = jax.jit(nqfjax.sharp_switch_loss)  # one compilation for both calls
    # rounding of ~300 terms of the cumulative sum: 1e-10
    np.testing.assert_allclose(sharp(lv, eps, ts), brute, rtol=1e-10, atol=1e-14)
    # with weight decay: rates r - decay, levels m* = (r - decay) / B_kk, and
    # the loss of the switched-on modes, sum_k (B_kk m_k^2 / 2 - r_k m_k) / (4 eta)
    r, Bd = np.asarray(lv.r), 4 * ETA * lam
    decay = 0.5 * r[50]
    lvd = nqfjax.LotkaVolterra(r, np.diag(Bd), decay, loss_offset=2.0)
    r_eff = r - decay
    grows = r_eff > 0
    ms = np.where(grows, r_eff / Bd, 0)
    with np.errstate(divide="ignore", invalid="ignore"):
        t_d = np.where(grows, np.log(ms / eps) / r_eff, np.inf)
    m = (t_d[None, :] <= ts[:, None]) * ms[None, :]
    expected = 2.0 + (0.5 * m**2 @ Bd - m @ r)
    np.testing.assert_allclose(sharp(lvd, eps, ts), expected, rtol=1e-10)
    # modes with r_k <= decay never switch on: the last plateau is theirs
    assert not grows.all()
    final = sharp(lvd, eps, np.full(400, 1e300))[0]
    np.testing.assert_allclose(
        final, 2.0 + np.sum(0.5 * Bd * ms**2 - r * ms), rtol=1e-10
    )


def test_power_law_exponent_values_and_errors():
    assert nqfjax.power_law_exponent(1.0, 0.5) == pytest.approx(1 / 1.5)
    assert nqfjax.power_law_exponent(1.0, 0.5, "lazy") == pytest.approx(1.0)
    assert nqfjax.power_law_exponent(2.0, 1.0, "rich") == pytest.approx(3 / 3)
    assert nqfjax.power_law_exponent(2.0, 1.0, "lazy") == pytest.approx(3 / 2)
    # alpha + 2 beta <= 1: the total loss diverges
    with pytest.raises(ValueError, match="alpha \\+ 2 beta > 1"):
        nqfjax.power_law_exponent(0.5, 0.25)
    with pytest.raises(ValueError, match="alpha \\+ 2 beta > 1"):
        nqfjax.power_law_exponent(1.0, 0.0, "lazy")
    with pytest.raises(ValueError, match="alpha"):
        nqfjax.power_law_exponent(-1.0, 2.0)
    with pytest.raises(ValueError, match="alpha"):
        nqfjax.power_law_exponent(0.0, 1.0)
    with pytest.raises(ValueError, match="finite"):
        nqfjax.power_law_exponent(np.nan, 1.0)
    with pytest.raises(ValueError, match="regime"):
        nqfjax.power_law_exponent(1.0, 0.5, "medium")
    coupled = np.array([[1.0, 0.5], [0.5, 1.0]])
    lv = nqfjax.LotkaVolterra(np.ones(2), coupled)
    with pytest.raises(ValueError, match="diagonal"):
        nqfjax.sharp_switch_loss(lv, 1e-8, np.ones(3))
    # the same coupling as diag + rank one, and as a traced dense B under jit
    lv = nqfjax.LotkaVolterra(
        np.ones(2), B_diag=[0.5, 0.5], B_factor=np.sqrt(0.5) * np.ones((2, 1))
    )
    with pytest.raises(ValueError, match="diagonal.*rank-1"):
        nqfjax.sharp_switch_loss(lv, 1e-8, np.ones(3))
    ts = np.array([1.0, 100.0])  # both modes switch on at ln(1/1e-8) = 18.4

    @jax.jit
    def sharp(B):
        return nqfjax.sharp_switch_loss(nqfjax.LotkaVolterra(np.ones(2), B), 1e-8, ts)

    with pytest.raises(RuntimeError, match="must be diagonal"):
        sharp(coupled)
    # a traced diagonal B passes: m* = 1, loss 2 (1/2 - 1) once both are on
    np.testing.assert_allclose(sharp(np.eye(2)), [0.0, -1.0], rtol=1e-14)
