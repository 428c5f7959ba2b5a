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
on Huber-robustified residuals (threshold 3 standard errors). Where the
residuals of that fit are correlated from one record to the next (lag-1
$\rho > 1/3$, as the loss of minibatch SGD wanders) and scatter more than
$\sigma$, the fit is repeated under their scatter with $n_b$ replaced by
$\max(1, n_b (1 - \rho)/(1 + \rho))$. The plateaus are read off the fitted
curve in `stair_reading.py`."""

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from ._least_squares import huber_numpy, log_noise, robust_sd


#: The most drops a staircase has (one compilation for every curve).
_MAX_MODES = 6
#: Log-time bins of the fit (one compilation for every curve).
_BINS = 160
#: The shape's own misfit in `ln L` (a floor on the bins' errors).
_SIGMA_MODEL = 0.01
_STARTS = 3
_ITERATIONS = 60
#: A drop spans from `EDGE` to `1 - EDGE` of its fall in `ln L`.
EDGE = 0.2


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
    - `noise`: the scatter of `ln L` about a smooth curve (about the fit
      where the records' noise is correlated), `rho` its lag-1 correlation
      (0 where it is not refitted under it), `rms`: the fit's
      rms residual of the log-binned `ln L`.
    - `theta`, `mask`, `t_ref`, `l_ref`: the fitted parameters (`curve`),
      numpy float64 whatever JAX's default (in float32 the crossings read
      off `log_curve` move by about 1e-7); `fits`: the best parameters for
      each `K = 1 .. 6` (`(6, Q)`, `with_modes`), `fit_rms` their rms
      residuals, `span` the data's scaled log-times `(ln u_0, ln u_end)`.
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
    theta: Float[np.ndarray, " Q"]
    mask: Float[np.ndarray, " 6"]
    t_ref: float = eqx.field(static=True, default=1.0)
    l_ref: float = eqx.field(static=True, default=1.0)
    reason: str = eqx.field(static=True, default="")
    rho: float = eqx.field(static=True, default=0.0)
    fits: Float[np.ndarray, "6 Q"] | None = None
    fit_rms: Float[np.ndarray, " 6"] | None = None
    span: tuple[float, float] = eqx.field(static=True, default=(0.0, 0.0))

    def with_modes(self, K: int) -> "Staircase":
        """The staircase of the best fit with `K` drops (`1 <= K <= 6`; the
        chosen one for `K = n_modes`), read as the chosen one is."""
        if self.fits is None or not 1 <= K <= _MAX_MODES:
            raise ValueError(f"`K` must be in [1, {_MAX_MODES}] of a fit, got {K}.")
        fitted = dict(
            bic=self.bic,
            noise=self.noise,
            rho=self.rho,
            fits=self.fits,
            fit_rms=self.fit_rms,
        )
        return _assemble(self.fits[K - 1], K, self.span, self.t_ref, self.l_ref, fitted)

    def curve(self, ts) -> Float[Array, " T"]:
        """The fitted loss at `ts > 0`, shape `(T,)` (NaN where nothing was
        fitted)."""
        return jnp.asarray(np.exp(self.log_curve(ts)))

    def se(self, n) -> float:
        r"""The standard error of a median of `n` records' `ln L`:
        $1.2533\,\sigma/\sqrt{n_\mathrm{eff}}$, $n_\mathrm{eff} = \max(1,
        n (1 - \rho)/(1 + \rho))$ under noise correlated with lag-1
        coefficient `rho`."""
        return 1.2533 * self.noise / np.sqrt(_n_eff(n, self.rho))

    def modes(self) -> tuple[np.ndarray, np.ndarray]:
        """Each fitted mode's time half done ($g_k = 1/2$) and height `H_k`
        (a loss), numpy, shape `(K,)` each, in the order fitted."""
        floor, lam, h, ltau, a, p = _unpack(np.asarray(self.theta, float))
        K = self.n_modes
        half = _g_inverse(0.5, lam, ltau[:K], a[:K], p[:K])
        return self.t_ref * np.exp(half), self.l_ref * h[:K]

    def log_curve(self, ts) -> np.ndarray:
        """The fitted `ln L` at `ts > 0` in numpy float64, shape `(T,)` (smooth
        enough to differentiate, as float32 is not)."""
        ts = np.asarray(ts, float)
        if self.n_modes == 0:
            return np.full(ts.shape, np.nan)
        theta, mask = np.asarray(self.theta, float), np.asarray(self.mask, float)
        with np.errstate(divide="ignore"):  # t = 0: the first plateau
            lu = np.log(ts / self.t_ref)
        return np.log(self.l_ref) + _log_model(theta, lu, mask)


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


def _n_eff(n, rho):
    """The number of independent records among `n` whose noise has lag-1
    correlation `rho`: `max(1, n (1 - rho)/(1 + rho))`."""
    return np.maximum(n * (1 - rho) / (1 + rho), 1.0)


def _fit_bins(lu, yb, n, m, sigma, rho):
    """Every `K` fitted to the `m` bins under the noise `sigma` with lag-1
    correlation `rho`: the chosen parameters, mask, `K`, the BICs and each
    `K`'s best parameters (`(6, Q)`)."""
    se2 = (1.2533 * sigma) ** 2 / _n_eff(n, rho)
    w = np.where(n > 0, 1 / (se2 + _SIGMA_MODEL**2), 0.0)
    thetas, masks = _starts(lu, yb, m)
    fitted, chi2 = _fit_all(lu[:m], yb[:m], w[:m], thetas, masks)
    chi2 = np.where(np.isfinite(chi2), chi2, np.inf).reshape(_MAX_MODES, _STARTS)
    best_start = np.argmin(chi2, axis=1)
    ks = np.arange(1, _MAX_MODES + 1)
    bic = chi2[ks - 1, best_start] + (2 + 4 * ks) * np.log(m)
    K = int(np.argmin(bic)) + 1
    rows = (ks - 1) * _STARTS + best_start
    return fitted[rows[K - 1]], masks[rows[K - 1]], K, bic, fitted[rows]


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
    sigma, rho = max(log_noise(ly_raw), 1e-4), 0.0
    l_ref = float(np.exp(np.median(ly_raw)))
    lu, yb, n, m = _bins(t / t_ref, ly_raw - np.log(l_ref))
    theta, mask, K, bic, fits = _fit_bins(lu, yb, n, m, sigma, rho)
    # the noise about the fit: correlated from one record to the next (the
    # loss of SGD wanders), the second differences see only a part of it
    resid = ly_raw - np.log(l_ref) - _log_model(theta, np.log(t / t_ref), mask)
    scale, step = robust_sd(resid), robust_sd(np.diff(resid))
    corr = float(np.clip(1 - step**2 / max(2 * scale**2, 1e-300), 0.0, 0.99))
    if corr > 1 / 3 and scale > max(sigma, _SIGMA_MODEL):  # refit under it
        sigma, rho = float(scale), corr
        theta, mask, K, bic, fits = _fit_bins(lu, yb, n, m, sigma, rho)
    masks = (np.arange(_MAX_MODES)[None] < np.arange(1, _MAX_MODES + 1)[:, None]) * 1.0
    model = _log_model(fits, lu[:m], masks)
    rms = np.sqrt(np.sum(n[:m] * (model - yb[:m]) ** 2, axis=-1) / np.sum(n[:m]))
    fitted = dict(bic=bic, noise=sigma, rho=rho, fits=fits, fit_rms=rms)
    span = (float(lu[0]), float(lu[m - 1]))
    return _assemble(theta, K, span, t_ref, l_ref, fitted)


def _assemble(theta, K, span, t_ref, l_ref, fitted) -> Staircase:
    """The `Staircase` of the `K`-mode parameters `theta` fitted to data
    spanning `span` (`ln u`, scaled), with `fitted`'s other fields."""
    mask = (np.arange(_MAX_MODES) < K) * 1.0
    floor, lam, h, ltau, a, p = _unpack(theta)
    mid = _g_inverse(0.5, lam, ltau[:K], a[:K], p[:K])
    h = h[:K][np.argsort(mid)]
    levels = floor + np.concatenate([np.cumsum(h[::-1])[::-1], [0.0]])
    # the fitted curve's crossings of 10%, 50% and 90% of each drop
    grid = np.linspace(span[0] - np.log(10), span[1] + np.log(10), 4000)
    curve = np.exp(_log_model(theta, grid, mask))
    cross = np.empty((K, 3))
    for k in range(K):
        for j, frac in enumerate((EDGE, 0.5, 1 - EDGE)):
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
        bic=jnp.asarray(fitted["bic"]),
        noise=fitted["noise"],
        rho=fitted["rho"],
        rms=float(fitted["fit_rms"][K - 1]),
        theta=np.asarray(theta, float),
        mask=mask,
        t_ref=t_ref,
        l_ref=l_ref,
        fits=np.asarray(fitted["fits"], float),
        fit_rms=np.asarray(fitted["fit_rms"], float),
        span=span,
    )
