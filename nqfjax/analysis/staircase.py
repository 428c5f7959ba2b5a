r"""A staircase fitted to a loss curve (`fit_staircase`, internal): `K` drops,
each with its own height, position, steepness and asymmetry, plus a floor,
`K` chosen by an information criterion with the noise measured from the data.

In scaled time $u = t / t_\mathrm{ref}$,

$$L(u) = F + \sum_{k \le K} H_k \big(1 + e^{z_k}\big)^{-p_k},\qquad
z_k = a_k\,\frac{(u/\tau_k)^\lambda - 1}{\lambda},$$

a Box-Cox interpolation between a sigmoid in $\log t$ ($\lambda \to 0$,
$p = 1$: $H/(1 + (t/\tau)^a)$) and an isolated logistic mode in $t$
($\lambda = 1$, $p = 2$: $H/(1 + e^{s(t/\tau - 1)})^2$, $s = \ln(m^*/m_0)$);
$p_k$ makes a drop asymmetric. $\lambda$ is shared by the modes.

Every `K` from 1 to `_MAX_MODES`, from three starts each, is fitted at once
by a batched Levenberg-Marquardt in numpy with the model's closed-form
Jacobian (no compilation: a jitted JAX version compiled for 17 s, then ran no
faster on CPU) on the curve's log-binned medians (at most `_BINS` bins equally
spaced in $\log t$: every-step and log-spaced records weigh alike, and the
median ignores spikes), each weighted by $1/(\mathrm{se}_b^2 + \sigma_m^2)$:
$\mathrm{se}_b = 1.2533\,\sigma/\sqrt{n_b}$ the standard error of its median
under the noise $\sigma$ (`log_noise`), $\sigma_m = 0.01$ the shape's own
misfit. The count minimises $\mathrm{BIC} = \chi^2 + (2 + 4K) \ln n$ ($n$ bins)
on Huber-robustified residuals (threshold 3 standard errors)."""

from functools import partial
from typing import NamedTuple

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from .._curves import loglog_slope
from ._least_squares import huber_numpy, log_noise


#: The most drops a staircase has (one compilation for every curve).
_MAX_MODES = 6
#: Log-time bins of the fit (one compilation for every curve).
_BINS = 160
#: The shape's own misfit in `ln L` (a floor on the bins' errors).
_SIGMA_MODEL = 0.01
_STARTS = 3
_ITERATIONS = 60
#: A drop spans from `_EDGE` to `1 - _EDGE` of its fall in `ln L`.
_EDGE = 0.2


class Staircase(eqx.Module):
    r"""A staircase fitted to a loss curve (`fit_staircase`).

    **Fields** (`K` drops in time order, `P = K + 1` plateaus):

    - `n_modes`: `K`, chosen by BIC (0 where nothing was fitted).
    - `levels`: the plateau losses, $F + \sum_{j > i} H_j$, shape `(P,)`.
    - `drop_times`: where each mode is half done, $g_k = 1/2$, shape `(K,)`.
    - `widths`: each drop's 10%-90% span in decades, shape `(K,)`.
    - `edges`: `(K, 2)`, the times where each drop is 10% and 90% done (of
      its fall in `ln L`, on the fitted curve).
    - `floor`: `F`, the loss the curve falls to.
    - `resolved`: `(K - 1,)`, whether the plateau between drops `k` and `k+1`
      is seen (drop `k` 90% done before drop `k+1` is 10% done).
    - `bic`: the criterion for each `K = 1 .. 6`, shape `(6,)`.
    - `noise`: the scatter of `ln L` about a smooth curve, `rms`: the fit's
      rms residual of the log-binned `ln L`.
    - `theta`, `mask`, `t_ref`, `l_ref`: the fitted parameters (`curve`).
    - `reason`: why nothing was fitted (`""` otherwise).
    """

    n_modes: int = eqx.field(static=True)
    levels: Float[Array, " P"]
    drop_times: Float[Array, " K"]
    widths: Float[Array, " K"]
    edges: Float[Array, "K 2"]
    floor: float = eqx.field(static=True)
    resolved: Float[Array, " K-1"]
    bic: Float[Array, " 6"]
    noise: float = eqx.field(static=True)
    rms: float = eqx.field(static=True)
    theta: Float[Array, " Q"]
    mask: Float[Array, " 6"]
    t_ref: float = eqx.field(static=True, default=1.0)
    l_ref: float = eqx.field(static=True, default=1.0)
    reason: str = eqx.field(static=True, default="")

    def curve(self, ts) -> Float[Array, " T"]:
        """The fitted loss at `ts > 0`, shape `(T,)` (NaN where nothing was
        fitted)."""
        ts = np.asarray(ts, float)
        if self.n_modes == 0:
            return jnp.full(ts.shape, jnp.nan)
        theta, mask = np.asarray(self.theta, float), np.asarray(self.mask, float)
        with np.errstate(divide="ignore"):  # t = 0: the first plateau
            lu = np.log(ts / self.t_ref)
        return jnp.asarray(self.l_ref * np.exp(_log_model(theta, lu, mask)))


#: Bounds of the parameters `(ln F, logit lambda, (ln H, ln tau, ln a, ln p))`.
_LOWER = np.array([-60.0, -6.0] + [-60.0, -60.0, np.log(0.5), np.log(0.2)] * _MAX_MODES)
_UPPER = np.array([60.0, 6.0] + [60.0, 60.0, np.log(300.0), np.log(10.0)] * _MAX_MODES)


def _unpack(theta):
    """`(F, lambda, H, ln tau, a, p)` of parameter vectors `theta = (ln F,
    logit lambda, (ln H, ln tau, ln a, ln p) per mode)`, shape `(..., Q)`:
    `F`, `lambda` of shape `(...)`, the others `(..., 6)`."""
    modes = theta[..., 2:].reshape(theta.shape[:-1] + (_MAX_MODES, 4))
    lam = 1 / (1 + np.exp(-theta[..., 1]))
    return (
        np.exp(theta[..., 0]),
        lam,
        np.exp(modes[..., 0]),
        modes[..., 1],
        np.exp(modes[..., 2]),
        np.exp(modes[..., 3]),
    )


def _log_model(theta, lu, mask, jacobian=False):
    """`ln L` at log scaled times `lu` (shape `(T,)`) for parameter vectors
    `theta` (shape `(..., Q)`) with `mask` (`(..., 6)`, 0/1 per mode): shape
    `(..., T)`, and with `jacobian`, its derivatives, shape `(..., T, Q)`."""
    floor, lam, h, ltau, a, p = _unpack(np.asarray(theta, float))
    lam_ = lam[..., None, None]
    x = np.clip(lu - ltau[..., None], -60.0, 60.0)  # (..., 6, T)
    e = np.exp(lam_ * x)
    bc = np.expm1(lam_ * x) / lam_
    z = np.clip(a[..., None] * bc, -60.0, 60.0)
    soft = np.logaddexp(0.0, z)
    g = np.exp(-p[..., None] * soft)
    hm = (mask * h)[..., None]
    total = floor[..., None] + np.sum(hm * g, axis=-2)
    out = np.log(total)
    if not jacobian:
        return out
    sig = 1 / (1 + np.exp(-z))
    dg_dz = -p[..., None] * sig * g * hm  # (..., 6, T), times H
    d_ltau = dg_dz * (-a[..., None] * e)
    d_a = dg_dz * z
    d_p = -p[..., None] * soft * g * hm
    d_h = hm * g
    dbc = (x * e * lam_ - np.expm1(lam_ * x)) / lam_**2
    d_lam = np.sum(dg_dz * a[..., None] * dbc, axis=-2) * (lam * (1 - lam))[..., None]
    per_mode = np.stack([d_h, d_ltau, d_a, d_p], axis=-1)  # (..., 6, T, 4)
    per_mode = np.moveaxis(per_mode, -3, -2)  # (..., T, 6, 4)
    J = np.concatenate(
        [
            np.broadcast_to(floor[..., None, None], out.shape + (1,)),
            d_lam[..., None],
            per_mode.reshape(out.shape + (4 * _MAX_MODES,)),
        ],
        axis=-1,
    )
    return out, J / total[..., None]


def _g_inverse(frac, lam, ltau, a, p):
    """`ln u` where a mode's `g = frac` (closed form), any shapes."""
    z = np.log(frac ** (-1 / p) - 1)
    with np.errstate(invalid="ignore"):  # NaN: never reached (lambda z < -a)
        return ltau + np.log1p(lam * z / a) / lam


def _fit_all(lu, y, w, thetas, masks):
    """Levenberg-Marquardt (Marquardt's diagonal damping, steps clipped to 2
    in each log-parameter, parameters kept within their bounds) from every
    row of `thetas` (shape `(S, Q)`) with its `masks` (`(S, 6)`), the rows
    batched in numpy (no compilation; a row stops once 4 steps in a row
    improved it by less than 1e-6 of its cost): the fitted parameters and
    chi-squares (of the Huber-robustified residuals)."""
    sw = np.sqrt(w)

    def cost(th, mk):
        with np.errstate(all="ignore"):
            rho, _ = huber_numpy(sw * (_log_model(th, lu, mk) - y))
        c = np.sum(rho**2, axis=-1)
        return np.where(np.isfinite(c), c, np.inf)

    theta = np.clip(np.asarray(thetas, float), _LOWER, _UPPER)
    masks = np.asarray(masks, float)
    mu = np.full(theta.shape[0], 1e-2)
    c = cost(theta, masks)
    calm = np.zeros(theta.shape[0], int)
    eye = np.eye(theta.shape[1])
    for _ in range(_ITERATIONS):
        on = np.flatnonzero(calm < 4)
        if on.size == 0:
            break
        th, mk = theta[on], masks[on]
        with np.errstate(all="ignore"):
            model, J = _log_model(th, lu, mk, jacobian=True)
            rho, drho = huber_numpy(sw * (model - y))
            J = (drho * sw)[..., None] * J
            Jt = np.swapaxes(J, 1, 2)
            A = Jt @ J
            grad = (Jt @ rho[..., None])[..., 0]
            d = np.diagonal(A, axis1=1, axis2=2)
            d = d + 1e-9 * np.max(d, axis=1, keepdims=True) + 1e-12
            lhs = A + (mu[on][:, None] * d)[:, :, None] * eye
            ok = np.all(np.isfinite(lhs), axis=(1, 2)) & np.all(np.isfinite(grad), 1)
            lhs = np.where(ok[:, None, None], lhs, eye)
            delta = np.linalg.solve(lhs, -np.where(ok[:, None], grad, 0.0)[..., None])
        new = np.clip(th + np.clip(delta[..., 0], -2.0, 2.0), _LOWER, _UPPER)
        c_new = cost(new, mk)
        better = c_new < c[on]
        small = ~better | (c[on] - c_new < 1e-6 * c[on])
        calm[on] = np.where(small, calm[on] + 1, 0)
        theta[on] = np.where(better[:, None], new, th)
        c[on] = np.where(better, c_new, c[on])
        mu[on] = np.where(better, mu[on] / 3, np.minimum(mu[on] * 4, 1e8))
    return theta, c


def _bins(t, ly):
    """Medians of `ln L` in `_BINS` bins equally spaced in `ln t`: their mean
    log-times, medians and counts (zero-padded)."""
    lt = np.log(t)
    edges = np.linspace(lt[0], lt[-1], _BINS + 1)[1:-1]
    which = np.searchsorted(edges, lt, side="right")
    order = np.argsort(which, kind="stable")
    bounds = np.searchsorted(which[order], np.arange(_BINS + 1))
    lu, y, n = np.zeros(_BINS), np.zeros(_BINS), np.zeros(_BINS)
    j = 0
    for b in range(_BINS):
        idx = order[bounds[b] : bounds[b + 1]]
        if idx.size:
            lu[j], y[j], n[j] = np.mean(lt[idx]), np.median(ly[idx]), idx.size
            j += 1
    lu[j:], y[j:] = lu[j - 1], y[j - 1]
    return lu, y, n, j


def _starts(lu, y, m):
    """Starting parameters, shape `(_MAX_MODES * _STARTS, Q)`, and masks: for
    each `K`, the drops at the `K` steepest points of the smoothed curve, at
    equal shares of its fall, and the first with gentle drops."""
    x, yy = lu[:m], y[:m]
    width = max(3, m // 40)
    kernel = np.exp(-0.5 * (np.arange(-3 * width, 3 * width + 1) / width) ** 2)
    kernel /= kernel.sum()
    pad = np.concatenate([np.full(3 * width, yy[0]), yy, np.full(3 * width, yy[-1])])
    smooth = np.convolve(pad, kernel, "valid")
    steep = -np.gradient(smooth, x) if m > 2 else np.zeros(m)
    peaks = [
        i
        for i in range(1, m - 1)
        if steep[i] >= steep[i - 1] and steep[i] > steep[i + 1] and steep[i] > 0
    ]
    peaks = sorted(peaks, key=lambda i: -steep[i])
    top, bottom = np.max(smooth), np.min(smooth)
    floor = np.exp(bottom)
    cum = (top - smooth) / max(top - bottom, 1e-12)
    rows, masks = [], []
    for K in range(1, _MAX_MODES + 1):
        chosen = sorted(peaks[:K])
        while len(chosen) < K:  # fewer peaks than modes: equal shares
            chosen.append(int(np.searchsorted(cum, (len(chosen) + 0.5) / K)))
        chosen = np.clip(sorted(chosen), 0, m - 1)
        shares = [
            np.clip(np.searchsorted(cum, (k + 0.5) / K), 0, m - 1) for k in range(K)
        ]
        for s, (where, gentle) in enumerate(
            ((chosen, False), (shares, False), (chosen, True))
        ):
            theta = np.zeros(2 + 4 * _MAX_MODES)
            theta[0] = np.log(floor * 0.98)
            theta[1] = 0.0  # lambda = 1/2
            where = np.asarray(where)
            # each drop's height: the smoothed level's fall between the
            # midpoints to its neighbours
            cut = np.concatenate([[0], (where[:-1] + where[1:]) // 2, [m - 1]])
            lvl = np.exp(smooth[cut])
            h = np.maximum(lvl[:-1] - lvl[1:], 1e-3 * np.exp(top))
            mode = np.zeros((_MAX_MODES, 4))
            mode[:, 0] = np.log(1e-3 * np.exp(top))
            mode[:, 1] = x[-1]
            mode[:, 2] = np.log(4.0)
            mode[:K, 0] = np.log(h)
            mode[:K, 1] = x[where]
            if gentle:
                mode[:K, 2] = np.log(3.0)
            else:
                mid = np.exp(smooth[where])
                mode[:K, 2] = np.log(np.clip(4 * steep[where] * mid / h, 1.0, 100.0))
            theta[2:] = mode.ravel()
            rows.append(theta)
            masks.append(np.arange(_MAX_MODES) < K)
    return np.array(rows), np.array(masks, float)


def fit_staircase(t: np.ndarray, y: np.ndarray) -> Staircase:
    """Fit the staircase model to a curve (`t > 0` increasing, `y > 0`, numpy
    float64, at least 8 points) and choose its number of drops by BIC.

    The drops' times (the middle of the levels), 10%-90% edges (of the fall
    in `ln L`) and widths are read off the fitted curve (on a grid of 4000
    points in `log t` spanning the data and a decade
    beyond each end) against its plateau levels, as one reads them off data.

    **Returns:** a `Staircase` (see the module notes)."""
    t_ref = float(t[-1])
    ly_raw = np.log(y)
    sigma = max(log_noise(ly_raw), 1e-4)
    l_ref = float(np.exp(np.median(ly_raw)))
    lu, yb, n, m = _bins(t / t_ref, ly_raw - np.log(l_ref))
    se2 = (1.2533 * sigma) ** 2 / np.maximum(n, 1)
    w = np.where(n > 0, 1 / (se2 + _SIGMA_MODEL**2), 0.0)
    thetas, masks = _starts(lu, yb, m)
    fitted, chi2 = _fit_all(lu[:m], yb[:m], w[:m], thetas, masks)
    chi2 = np.where(np.isfinite(chi2), chi2, np.inf).reshape(_MAX_MODES, _STARTS)
    best_start = np.argmin(chi2, axis=1)
    ks = np.arange(1, _MAX_MODES + 1)
    bic = chi2[ks - 1, best_start] + (2 + 4 * ks) * np.log(m)
    K = int(np.argmin(bic)) + 1
    row = (K - 1) * _STARTS + best_start[K - 1]
    theta, mask = fitted[row], masks[row]
    model = _log_model(theta, lu[:m], mask)
    rms = float(np.sqrt(np.sum(n[:m] * (model - yb[:m]) ** 2) / np.sum(n[:m])))
    floor, lam, h, ltau, a, p = _unpack(theta)
    mid = _g_inverse(0.5, lam, ltau[:K], a[:K], p[:K])
    h = h[:K][np.argsort(mid)]
    levels = floor + np.concatenate([np.cumsum(h[::-1])[::-1], [0.0]])
    # the fitted curve's crossings of 10%, 50% and 90% of each drop
    grid = np.linspace(lu[0] - np.log(10), lu[m - 1] + np.log(10), 4000)
    curve = np.exp(_log_model(theta, grid, mask))
    cross = np.empty((K, 3))
    for k in range(K):
        for j, frac in enumerate((_EDGE, 0.5, 1 - _EDGE)):
            level = levels[k] ** (1 - frac) * levels[k + 1] ** frac
            if frac == 0.5:  # the arithmetic middle of the levels
                level = 0.5 * (levels[k] + levels[k + 1])
            below = np.flatnonzero(curve <= level)
            cross[k, j] = grid[below[0]] if below.size else grid[-1]
    times = np.exp(cross) * t_ref
    return Staircase(
        n_modes=K,
        levels=jnp.asarray(levels * l_ref),
        drop_times=jnp.asarray(times[:, 1]),
        widths=jnp.asarray((cross[:, 2] - cross[:, 0]) / np.log(10)),
        edges=jnp.asarray(times[:, [0, 2]]),
        floor=float(floor) * l_ref,
        resolved=jnp.asarray(cross[:-1, 2] < cross[1:, 0]),
        bic=jnp.asarray(bic),
        noise=sigma,
        rms=rms,
        theta=jnp.asarray(theta),
        mask=jnp.asarray(mask),
        t_ref=t_ref,
        l_ref=l_ref,
    )


class StaircasePlateaus(NamedTuple):
    """The plateaus read off a fitted staircase (`read_plateaus`), numpy
    arrays of shape `(P,)` (`start`, `end`, `level`, `level_err`) and `(P -
    1,)` (`drop_times`, `drop_times_err`); `n_drops` counted, `reason` (no
    plateau), `ambiguous` (what the data cannot tell), `ends_falling` (no
    plateau after the last drop: a tail)."""

    start: np.ndarray
    end: np.ndarray
    level: np.ndarray
    level_err: np.ndarray
    drop_times: np.ndarray
    drop_times_err: np.ndarray
    n_drops: int
    reason: str = ""
    ambiguous: str = ""
    ends_falling: bool = False


def _none(reason, ambiguous, n_drops=0, ends_falling=False) -> StaircasePlateaus:
    empty = [np.zeros(0)] * 6
    return StaircasePlateaus(*empty, n_drops, reason, ambiguous, ends_falling)


def _count(lt, lo, hi):
    return int(np.count_nonzero((lt >= lo) & (lt <= hi)))


def _kept_drops(stairs: Staircase, lt, min_drop):
    """The drops of a fitted staircase that the data at log-times `lt` see,
    as `(first level, last level + 1, ln t at 20%, ln t at 80%)`, and the
    notes on what the data cannot tell (see `read_plateaus`)."""
    K = stairs.n_modes
    levels = np.asarray(stairs.levels)
    edges = np.log(np.asarray(stairs.edges))
    mids = np.log(np.asarray(stairs.drop_times))
    sigma = stairs.noise
    notes = []
    count = partial(_count, lt)
    # drops: groups of overlapping modes, of those half done within the data
    seen = [k for k in range(K) if lt[0] < mids[k] < lt[-1]]
    for k in set(range(K)) - set(seen):  # half done outside, overlapping them
        fall, over = np.log(levels[k] / levels[k + 1]), edges[k, 0] < lt[-1]
        if fall >= -np.log1p(-min_drop) and over and edges[k, 1] > lt[0]:
            notes.append(
                f"a drop of {fall:.2g} in log L half done outside the data (t = "
                f"{np.exp(mids[k]):.3g}) overlaps them: the count may be short"
            )
    groups = []
    for k in seen:
        if groups and edges[groups[-1][-1], 1] >= edges[k, 0]:
            groups[-1].append(k)
            notes.append(
                f"drops at t = {np.exp(mids[groups[-1][-2]]):.3g} and "
                f"{np.exp(mids[k]):.3g} "
                "are closer than their widths (counted as one)"
            )
        else:
            groups.append([k])
    drops = []  # (first level index, last level index + 1, lo edge, hi edge)
    for g in groups:
        drops.append([g[0], g[-1] + 1, edges[g[0], 0], edges[g[-1], 1]])
    # small or insignificant drops are not drops
    kept = []
    for i, (a, b, lo, hi) in enumerate(drops):
        fall = np.log(levels[a] / levels[b])
        before = count(drops[i - 1][3] if i else -np.inf, lo)
        after = count(hi, drops[i + 1][2] if i + 1 < len(drops) else np.inf)
        se = 1.2533 * sigma * np.sqrt(1 / max(before, 1) + 1 / max(after, 1))
        if fall < -np.log1p(-min_drop):
            continue
        if fall < 4 * se:
            notes.append(
                f"a drop of {fall:.2g} in log L at t = {np.exp(lo):.3g} is within "
                f"4 standard errors ({4 * se:.2g}) of the noise (not counted)"
            )
            continue
        kept.append((a, b, lo, hi))
    for a, b, lo, hi in kept:  # wider than any one drop of the families
        if hi - lo > np.log(10):
            w, mid = (hi - lo) / np.log(10), np.exp(0.5 * (lo + hi))
            notes.append(f"the drop at t = {mid:.3g} spans {w:.2g} decades: several?")
    bic = np.asarray(stairs.bic)
    close = [k + 1 for k in np.flatnonzero(bic - bic[K - 1] < 10) if k + 1 != K]
    if close:
        notes.append(
            f"the data cannot tell {K} fitted drops from "
            f"{' or '.join(map(str, close))} (BIC within 10)"
        )
    return kept, notes


def read_plateaus(
    stairs: Staircase, ts, loss, slope_tol=0.15, min_length=0.05, min_drop=0.1
) -> StaircasePlateaus:
    """The plateaus of a fitted staircase, checked against the data (`ts`,
    `loss > 0`):

    - drops half done outside the data are not seen;
    - two neighbouring drops whose 10%-90% spans overlap (drop `k` is not
      90% done before drop `k + 1` is 10% done, of their falls in `ln L`) are
      one drop, said in `ambiguous`;
    - a drop smaller than a fraction `min_drop`, or than 4 standard errors of
      the two levels it separates, is not counted (the latter said in
      `ambiguous`);
    - where another number of drops has a BIC within 10 of the chosen one
      (not "very strong" evidence), `ambiguous` says so;
    - the plateaus are the stretches before the first drop is 10% done,
      between drops and after the last is 90% done: each needs at least 3
      samples over `min_length` decades, and a log-log slope of the data there
      below `max(slope_tol, steepness / 2)` to within two standard errors,
      `steepness` the smaller of its neighbouring drops' (the fall from 10%
      to 90% in `ln L` over its log-time): a power law, which the model fits
      as drops with heavy tails, falls between them as steeply as during
      them. Without a drop, the curve is one plateau if its log-log slope is
      below `slope_tol`, else none.

    `ends_falling` where the stretch after the last drop is no plateau (a
    tail, such as a power law's, not a step of a staircase).

    Levels are the medians of the samples where the fitted curve is within
    2% of an asymptotic level of the stretch (`F + sum_{j > i} H_j`; the one
    held longest, several across uncounted drops), or the level after the
    drop before it where it never is (fewer than 3 such samples), with the
    standard error of a median of those samples; drop times where the
    fitted curve crosses the middle of the levels, with the standard error of
    a local level over the drop's steepness."""
    levels = np.asarray(stairs.levels)
    lt, ly = np.log(ts), np.log(loss)
    sigma = stairs.noise
    kept, notes = _kept_drops(stairs, lt, min_drop)
    count = partial(_count, lt)
    ambiguous = "; ".join(notes)
    if not kept:
        # no drop: one plateau if the curve is flat, none if it falls (a
        # power law)
        line = loglog_slope(lt, ly, take_logs=False)
        if abs(line.slope) < slope_tol:
            level = float(np.exp(np.median(ly)))
            err = level * 1.2533 * sigma / np.sqrt(ly.size)
            return StaircasePlateaus(
                np.array([ts[0]]),
                np.array([ts[-1]]),
                np.array([level]),
                np.array([err]),
                np.zeros(0),
                np.zeros(0),
                0,
                ambiguous=ambiguous,
            )
        reason = "no plateau: no drop stands out of the noise, and the curve falls"
        return _none(reason, ambiguous, ends_falling=True)
    # stretches: before the first drop, between drops, after the last
    bounds = [lt[0]] + [x for a, b, lo, hi in kept for x in (lo, hi)] + [lt[-1]]
    stretches = list(zip(bounds[0::2], bounds[1::2]))
    keep = _flat(stretches, kept, levels, lt, ly, slope_tol, min_length)
    found = []
    level_idx = [kept[0][0]] + [b for a, b, lo, hi in kept]
    # the fitted levels of each stretch (several across uncounted drops)
    first = [0] + [b for a, b, lo, hi in kept]
    last = [a for a, b, lo, hi in kept] + [len(levels) - 1]
    for j, ((lo, hi), ok) in enumerate(zip(stretches, keep)):
        if ok:
            level = levels[level_idx[j]]
            # where the fitted curve is within 2% of a level of the stretch
            # (the one it stays at longest): the median of the samples there
            # (exact on a flat plateau); else the fitted asymptote (a plateau
            # tilted by its drops' tails)
            inside = (lt >= lo) & (lt <= hi)
            fitted = np.asarray(stairs.curve(ts[inside]))
            near = np.abs(np.log(fitted[None] / levels[first[j] : last[j] + 1, None]))
            core = inside.copy()
            core[inside] = max(near < 0.02, key=np.sum)
            if core.sum() >= 3:
                level = float(np.exp(np.median(ly[core])))
            n = max(int(core.sum()) if core.sum() >= 3 else count(lo, hi), 1)
            found.append((lo, hi, level, 1.2533 * sigma / np.sqrt(n), j))
    if not found:
        reason = "no plateau: no flat stretch between the fitted drops"
        return _none(reason, ambiguous, len(kept), ends_falling=not keep[-1])
    starts = np.exp([f[0] for f in found])
    ends = np.exp([f[1] for f in found])
    # a plateau at an end of the data extends to it (exactly)
    starts[0] = ts[0] if found[0][4] == 0 else starts[0]
    ends[-1] = ts[-1] if found[-1][4] == len(stretches) - 1 else ends[-1]
    lev = np.array([f[2] for f in found])
    lev_err = lev * np.array([f[3] for f in found])
    times, t_err = [], []
    for (_, _, _, _, j0), (_, _, _, _, j1) in zip(found[:-1], found[1:]):
        # the drops between plateaus j0 and j1 (one where both exist)
        a, b, lo, hi = kept[j0]
        b = kept[j1 - 1][1]
        hi = kept[j1 - 1][3]
        mid = _crossing(stairs, 0.5 * (levels[a] + levels[b]), lo, hi)
        steep = np.log(levels[a] / levels[b]) / max(hi - lo, 1e-12) * (1 - 2 * _EDGE)
        n = max(count(lo, hi), 1)
        times.append(np.exp(mid))
        t_err.append(np.exp(mid) * 1.2533 * sigma / np.sqrt(n) / max(steep, 1e-12))
    return StaircasePlateaus(
        starts,
        ends,
        lev,
        lev_err,
        np.array(times),
        np.array(t_err),
        len(kept),
        ambiguous=ambiguous,
        ends_falling=not keep[-1],
    )


def _flat(stretches, kept, levels, lt, ly, slope_tol, min_length):
    """Which `stretches` (`(lo, hi)` in `ln t`) between the `kept` drops are
    plateaus (see `read_plateaus`)."""
    keep = []
    for j, (lo, hi) in enumerate(stretches):
        # flat against its neighbouring drops: a power law, which the model
        # fits as drops with heavy tails, falls between them as steeply
        steep = min(
            (1 - 2 * _EDGE) * np.log(levels[a] / levels[b]) / max(dhi - dlo, 1e-12)
            for a, b, dlo, dhi in kept[max(j - 1, 0) : j + 1]
        )
        inside = (lt >= lo) & (lt <= hi)
        enough = inside.sum() >= 3 and hi - lo >= min_length * np.log(10)
        slope = np.inf
        if enough:  # the slope, less twice its standard error
            line = loglog_slope(lt, ly, inside, take_logs=False)
            slope = abs(line.slope) - 2 * line.slope_err
        keep.append(bool(enough and slope < max(slope_tol, 0.5 * steep)))
    return keep


def _crossing(stairs: Staircase, level, lo, hi):
    """`ln t` where the fitted curve crosses `level` between `ln t = lo` and
    `hi` (widened by half their span; log-linear between grid points)."""
    pad = 0.5 * (hi - lo) + 1e-6
    grid = np.linspace(lo - pad, hi + pad, 2001)
    curve = np.asarray(stairs.curve(np.exp(grid)))
    below = np.flatnonzero(curve <= level)
    if below.size == 0:
        return 0.5 * (lo + hi)
    i = below[0]
    if i == 0:
        return grid[0]
    c0, c1 = np.log(curve[i - 1]), np.log(curve[i])
    return grid[i - 1] + (grid[i] - grid[i - 1]) * (c0 - np.log(level)) / (c0 - c1)
