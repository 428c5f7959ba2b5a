"""Seeded staircase families with known truth, for the plateau-detection and
model-selection calibration (`test_staircase_calibration.py`).

Every family is a floor plus `K` drops, `L(t) = L_K + sum_k (L_{k-1} - L_k)
g_k(t)`, each `g_k` falling from 1 to 0 around `t_k`, with:

- each drop at least 0.3 in `ln L` (`ln(L_{k-1} / L_k)` in `[0.3, 1.2]`);
- each plateau at least 0.3 decades long: from where drop `k` is 90% done to
  where drop `k + 1` is 10% done (`gap` decades, drawn in `[0.3, 0.8]`);
- the curve starting on its first plateau and ending on its floor.

The drop time of the truth is where the noiseless curve crosses the middle of
the drop's levels, `(L_{k-1} + L_k) / 2`; its transition width is the time
from 10% to 90% of the drop, in decades.

Families (`g` of `x = t / t_k`):

- `logistic_t`: an isolated mode's loss, `g = 1 / (1 + e^{s (x - 1)})^2`,
  `s = ln(m*/m0)` in `[3, 30]` (the library's own shape);
- `sigmoid_logt`: `g = 1 / (1 + x^a)`, a sigmoid in `log t` of steepness `a`
  in `[4, 30]`;
- `asymmetric` (held out): a stretched exponential, `g = exp(-x^a)`, `a` in
  `[1.5, 6]`, slow below `t_k` and sharp above, mixed with its mirror image
  `g = 1 - exp(-x^-a)`.

New held-out families (added after the first held-out cells had been looked
at, written before any change made with them in view, measured once):

- `gompertz`: a Gompertz curve in `t`, `g = 1 - exp(-ln 2 e^{-c (x - 1)})`,
  `c` in `[3, 30]` (a slow start, then a sharp finish; half done at `x = 1`);
- `tanh_sqrt`: a tanh in `sqrt t`, `g = (1 - tanh(c (sqrt x - 1))) / 2`, `c`
  in `[2, 15]` (near `x = 1` a sigmoid in `log t` of steepness `c`, with
  heavier tails below than above);

recorded with AR(1)-correlated multiplicative noise (`sample`'s `rho`, as the
loss of minibatch SGD wanders) or a geometric-then-linear log (`"mixed"`).
"""

import numpy as np


FAMILIES = ("logistic_t", "sigmoid_logt", "asymmetric")
#: Held out after the first measurement (`NEW_HELD_OUT` in the test).
NEW_FAMILIES = ("gompertz", "tanh_sqrt")


def _shape(family, rng):
    """A drop shape `g(x)` of the family, with a random sharpness."""
    if family == "logistic_t":
        s = float(np.exp(rng.uniform(np.log(3), np.log(30))))
        return lambda x: 1 / (1 + np.exp(np.clip(s * (x - 1), -300, 300))) ** 2
    if family == "sigmoid_logt":
        a = float(np.exp(rng.uniform(np.log(4), np.log(30))))
        return lambda x: 1 / (1 + np.exp(np.clip(a * np.log(x), -300, 300)))
    if family == "asymmetric":
        a = float(np.exp(rng.uniform(np.log(1.5), np.log(6))))
        if rng.random() < 0.5:
            return lambda x: np.exp(-(x**a))
        return lambda x: -np.expm1(-(x ** -np.clip(a, 0, None)))
    if family == "gompertz":
        c = float(np.exp(rng.uniform(np.log(3), np.log(30))))
        return lambda x: (
            -np.expm1(-np.log(2) * np.exp(np.clip(-c * (x - 1), -300, 300)))
        )
    if family == "tanh_sqrt":
        c = float(np.exp(rng.uniform(np.log(2), np.log(15))))
        return lambda x: 0.5 * (1 - np.tanh(c * (np.sqrt(x) - 1)))
    raise ValueError(family)


def _crossing(g, frac):
    """`x` where the decreasing `g` equals `frac` (bisection in `ln x`)."""
    lo, hi = -20.0, 20.0
    for _ in range(80):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if g(np.exp(mid)) > frac else (lo, mid)
    return np.exp(0.5 * (lo + hi))


def staircase(family, rng, K=None, gap=None, drops=(0.3, 1.2)):
    """A clean staircase of the family: `(curve, t_end, truth)`, `curve(t)` the
    loss; `truth` has `K`, `levels`, `mid` (the drop times), `width` (the
    10-90% widths, decades), `edges` (`(K, 2)`: where each drop is 10% and
    90% done), `t_first` (where the first drop is 10% done). `gap` fixes
    every plateau's length in decades (negative: drops overlapping),
    `drops` the range of the drops in `ln L`."""
    K = int(rng.integers(2, 5)) if K is None else K
    shapes = [_shape(family, rng) for _ in range(K)]
    levels = np.exp(-np.cumsum(np.concatenate([[0.0], rng.uniform(*drops, K)])))
    tk, mids, widths, edges = [], [], [], []
    t = 10 ** rng.uniform(1.5, 2.5)
    for k, g in enumerate(shapes):
        x10, x90 = _crossing(g, 0.9), _crossing(g, 0.1)
        if k == 0:
            t_k = t / x10
        else:
            plateau = rng.uniform(0.3, 0.8) if gap is None else gap
            t_k = t * 10**plateau / x10
        tk.append(t_k)
        edges.append((t_k * x10, t_k * x90))
        t = t_k * x90  # where this drop is 90% done
        widths.append(np.log10(x90 / x10))
    t_end = t * 10 ** rng.uniform(0.5, 1.0)

    def curve(ts):
        ts = np.asarray(ts, float)
        out = np.full(ts.shape, levels[-1])
        for g, t_k, hi, lo in zip(shapes, tk, levels[:-1], levels[1:]):
            out = out + (hi - lo) * g(ts / t_k)
        return out

    # the drop times: where the clean curve crosses each drop's middle level
    grid = np.geomspace(1e-3 * tk[0], 10 * t_end, 200_001)
    clean = curve(grid)
    for hi, lo in zip(levels[:-1], levels[1:]):
        mids.append(grid[np.argmax(clean < 0.5 * (hi + lo))])
    truth = dict(
        K=K,
        levels=levels,
        mid=np.array(mids),
        width=np.array(widths),
        edges=np.array(edges),
        t_first=tk[0] * _crossing(shapes[0], 0.9),
        family=family,
    )
    return curve, t_end, truth


def sample(rng, curve, t_end, sampling, noise, spikes=0.0, t_first=10.0, rho=0.0):
    """The curve recorded `sampling` = `"log"` (400 log-spaced times from
    `t_first / 30`), `"linear"` (every `k` steps, `k` a 20th of `t_first`,
    or more for at most 20000 records: the first plateau may then be
    unseen) or `"every_step"` (every step to `t_end`, at most 50000, steps
    thinned evenly beyond) or `"mixed"` (200 log-spaced times from
    `t_first / 30` to a tenth of `t_end`, then every `t_end / 2000`);
    multiplicative log-normal noise of relative size `noise`, AR(1)-correlated
    from one record to the next with coefficient `rho` (its variance
    `noise^2` whatever `rho`), and a fraction `spikes` of the records multiplied
    by a heavy-tailed factor (`e^{|z|}`, `z` Cauchy with scale 0.5, capped at
    a factor `e^3`)."""
    if sampling == "log":
        ts = np.geomspace(t_first / 30, t_end, 400)
    elif sampling == "linear":
        step = max(1.0, np.floor(t_first / 20), np.ceil(t_end / 20_000))
        ts = np.arange(step, t_end + step, step)
    elif sampling == "every_step":
        ts = np.arange(1.0, np.ceil(t_end) + 1)
        ts = ts[:: int(np.ceil(ts.size / 50_000))]
    elif sampling == "mixed":
        early = np.geomspace(t_first / 30, t_end / 10, 200)
        step = t_end / 2000
        ts = np.concatenate([early, np.arange(early[-1] + step, t_end + step, step)])
    else:
        raise ValueError(sampling)
    z = rng.standard_normal(ts.size)
    if rho:  # stationary AR(1): z_i = rho z_{i-1} + sqrt(1 - rho^2) e_i
        from scipy.signal import lfilter

        z[1:] *= np.sqrt(1 - rho**2)
        z = lfilter([1.0], [1.0, -rho], z)
    loss = curve(ts) * np.exp(noise * z)
    hit = rng.random(ts.size) < spikes
    factor = np.exp(np.minimum(np.abs(0.5 * rng.standard_cauchy(ts.size)), 3.0))
    return ts, np.where(hit, loss * factor, loss)


def seen_plateaus(ts, truth):
    """How many of the staircase's plateaus the record `ts` sees, and whether
    that is clear: a plateau (before the first drop is 10% done, between one
    drop 90% done and the next 10% done, after the last is 90% done) is seen
    with at least 6 records, unseen with at most 1; with 2-5 the count is
    marginal (where a stretch ends is a convention: 10% or 20% of a drop)."""
    bounds = np.concatenate([[0.0], truth["edges"].ravel(), [np.inf]])
    n = np.array(
        [
            np.count_nonzero((ts > lo) & (ts < hi))
            for lo, hi in zip(bounds[0::2], bounds[1::2])
        ]
    )
    return int(np.sum(n >= 6)), bool(np.all((n >= 6) | (n <= 1)))
