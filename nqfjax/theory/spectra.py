r"""Weight spectra during training (see the documentation's theory pages).

From an isotropic random start $W_0 = \sigma Z$ (`p x m`, standard normal `Z`)
the eigenvalues of $M_0 = W_0 W_0^\top = \sigma^2 Z Z^\top$ form a
Marchenko-Pastur bulk; every mode that switches on pulls one eigenvalue out of
the bulk, and it ends as an outlier at the mode's learned value.

- `marchenko_pastur_edges`, `marchenko_pastur_density`: the bulk at
  initialisation in closed form.
- `weight_spectrum`: eigenvalues of `M` (and singular values of `W`) along a
  run, the outliers that detach from the initial bulk, when, and which mode of
  a given basis (the Lotka-Volterra basis of `lv_reduce`) each one is.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Float, Int

from .._checks import check_shape, positive, static_int
from .._curves import crossing_time


def _check_sizes(p, m) -> tuple[int, int]:
    return static_int("p", p), static_int("m", m)


def marchenko_pastur_edges(
    p: int, m: int, init_scale: Float[ArrayLike, ""] = 1.0
) -> tuple[Float[Array, ""], Float[Array, ""]]:
    r"""The edges of the Marchenko-Pastur bulk of $M_0 = \sigma^2 Z Z^\top$.

    For `Z` of shape `(p, m)` with i.i.d. standard normal entries, the nonzero
    eigenvalues of $\sigma^2 Z Z^\top$ fill, as $p, m \to \infty$ at fixed ratio
    $c = p/m$, the interval

    $$\lambda_\pm = \sigma^2 m\,(1 \pm \sqrt{c})^2 = \sigma^2(\sqrt m \pm \sqrt p)^2$$

    (Marchenko and Pastur, 1967); for $p > m$ the other $p - m$ eigenvalues are
    exactly zero. At finite size the largest eigenvalue fluctuates around
    $\lambda_+$ by $O(\sigma^2 (\sqrt m + \sqrt p)(m^{-1/2} + p^{-1/2})^{1/3})$
    (Tracy-Widom), a relative $O(\min(p, m)^{-2/3})$.

    **Arguments:**

    - `p`: rows of `W` (parameters per unit), int >= 1.
    - `m`: columns of `W` (units, the width), int >= 1.
    - `init_scale`: $\sigma > 0$ (default 1).

    **Returns:** `(lower, upper)`, scalars.

    **Raises:** `ValueError` for non-positive sizes or `init_scale`.
    """
    p, m = _check_sizes(p, m)
    sigma = jnp.asarray(init_scale)
    sigma = sigma.astype(jnp.result_type(sigma, float))
    check_shape("init_scale", sigma, ())
    s2 = positive("init_scale", sigma) ** 2
    return s2 * (np.sqrt(m) - np.sqrt(p)) ** 2, s2 * (np.sqrt(m) + np.sqrt(p)) ** 2


def marchenko_pastur_density(
    x: Float[ArrayLike, "*N"], p: int, m: int, init_scale: Float[ArrayLike, ""] = 1.0
) -> Float[Array, "*N"]:
    r"""The density of the eigenvalues of $M_0 = \sigma^2 Z Z^\top$ (`Z` is `p x m`).

    With $c = p/m$ and $s = \sigma^2 m$,

    $$\rho(\lambda) = \frac{\sqrt{(\lambda_+ - \lambda)(\lambda - \lambda_-)}}
    {2\pi\, c\, s\, \lambda}\quad\text{on } [\lambda_-, \lambda_+],$$

    normalised over the `p` eigenvalues: it integrates to $\min(1, 1/c)$, the
    rest being an atom of mass $1 - 1/c$ at zero when $p > m$ (not included).
    Its mean is $s$ and its second moment $s^2 (1 + c)$ (with the atom).

    **Arguments:**

    - `x`: where to evaluate, any shape.
    - `p`, `m`, `init_scale`: as in `marchenko_pastur_edges`.

    **Returns:** the density at `x` (zero outside the bulk).
    """
    p, m = _check_sizes(p, m)
    lo, hi = marchenko_pastur_edges(p, m, init_scale)
    x = jnp.asarray(x, jnp.result_type(lo, float))
    c = p / m
    s = jnp.asarray(init_scale, x.dtype) ** 2 * m
    inside = (x > lo) & (x < hi)
    root = jnp.sqrt(jnp.where(inside, (hi - x) * (x - lo), 0.0))
    return jnp.where(
        inside, root / (2 * np.pi * c * s * jnp.where(inside, x, 1.0)), 0.0
    )


class WeightSpectrum(eqx.Module):
    r"""The spectrum of `M = W W^T` along a run (`weight_spectrum`).

    Outliers are numbered in the order they detach (`j = 0..J-1`).

    **Fields:**

    - `ts`: the recorded times, shape `(R,)`.
    - `eigenvalues`: the eigenvalues of `M` at each time, descending, shape
      `(R, p)`.
    - `singular_values`: the singular values of `W`, descending, shape
      `(R, min(p, m))` (square roots of the top `min(p, m)` eigenvalues; from
      `M` a singular value `s` carries an absolute error of about
      $\epsilon_{\rm mach} |M| / (2s)$, so the bulk next to large outliers is
      resolved only to ~1e-8 of the outliers' scale in float64).
    - `init_scale`: $\sigma$, given or estimated from $\mathrm{Tr}\,M_0 \approx
      \sigma^2 p m$.
    - `edges`: the Marchenko-Pastur edges $(\lambda_-, \lambda_+)$ at
      initialisation, shape `(2,)`.
    - `threshold`: $(1 + \text{margin})\lambda_+$; an eigenvalue above it is an
      outlier.
    - `values`: each outlier's eigenvalue at each time, shape `(J, R)`, NaN where
      it is not (yet, or no longer) an outlier.
    - `t_detach`: when each outlier first crosses `threshold` (log-linear
      interpolation between records), shape `(J,)`.
    - `t_half`: when it first reaches `level` (default half) of its peak value:
      the half-way time of its rise, comparable with `switch_on_times`, shape
      `(J,)`.
    - `t_return`: when it falls back below `threshold` (NaN if it stays out),
      shape `(J,)`.
    - `peak`: its largest value, shape `(J,)`.
    - `vectors`: its unit eigenvector at the peak (the last well-separated one
      if the peak falls in a near-degeneracy), shape `(J, p)`.
    - `modes`: the basis vector it overlaps most (the Lotka-Volterra mode it
      is), shape `(J,)`; -1 when no basis was given.
    - `overlaps`: the squared overlap $(u_{\rm mode}^\top v)^2$ of that match,
      in `[0, 1]`, shape `(J,)`; NaN without a basis.
    """

    ts: Float[Array, " R"]
    eigenvalues: Float[Array, "R p"]
    singular_values: Float[Array, "R q"]
    init_scale: Float[Array, ""]
    edges: Float[Array, " 2"]
    threshold: Float[Array, ""]
    values: Float[Array, "J R"]
    t_detach: Float[Array, " J"]
    t_half: Float[Array, " J"]
    t_return: Float[Array, " J"]
    peak: Float[Array, " J"]
    vectors: Float[Array, "J p"]
    modes: Int[Array, " J"]
    overlaps: Float[Array, " J"]

    @property
    def n_outliers(self) -> int:
        """How many eigenvalues detached from the bulk."""
        return int(self.t_detach.shape[0])


def weight_spectrum(
    ts: Float[ArrayLike, " R"],
    Ms: Float[ArrayLike, "R p p"],
    *,
    width: int,
    init_scale: float | None = None,
    basis: Float[ArrayLike, "p q"] | None = None,
    margin: float = 0.5,
    level: float = 0.5,
    min_overlap: float = 0.5,
    gap_tol: float = 0.1,
) -> WeightSpectrum:
    r"""Track the eigenvalues of `M = W W^T` along a run and find the outliers.

    At initialisation $W_0 = \sigma Z$ the spectrum is the Marchenko-Pastur bulk
    with edges $\lambda_\pm = \sigma^2(\sqrt m \pm \sqrt p)^2$
    (`marchenko_pastur_edges`). A mode that switches on grows $M$ along its
    direction $u_k$ like $e^{r_k t}$ until it saturates at its learned value, so
    one eigenvalue leaves the bulk and ends near $m^*_k$;
    directions that are not learned stay in the bulk or shrink (weight decay,
    negative rates).

    **The outliers.** An eigenvalue above `threshold` $= (1 + \text{margin})
    \lambda_+$ is an outlier (the margin keeps the finite-size fluctuation of
    the top of the bulk, a relative $O(\min(p,m)^{-2/3})$, from counting).
    Outliers are followed through time by their eigenvectors: each outlier keeps
    a reference vector, its eigenvector at the last record where it was well
    separated from the other outliers (relative gap at least `gap_tol`); at
    each record the eigenpairs above the threshold are matched greedily,
    largest squared overlap with a reference first, to the outliers of the
    previous record, accepted when the reference lies at least `min_overlap`
    (squared) in the eigenvector's cluster of nearly degenerate outliers; an
    unmatched eigenpair is a new outlier, an outlier left unmatched has
    returned to the bulk. Following vectors, not ranks, keeps an outlier's
    identity when two outlier eigenvalues cross, and freezing the reference
    while they are nearly degenerate keeps it through an avoided crossing
    (where the eigenvectors of a finely recorded run rotate into each other).
    For each outlier:

    - `t_detach`: when it crosses the threshold. In the exponential phase this
      comes a time $\approx \ln(m^*_k/\lambda_+)/r_k$ *before* the switch-on: an
      outlier appears as soon as its mode has grown by an O(1) factor (the
      BBP transition of a spiked covariance), long before it is learned.
    - `t_half`: when it reaches `level` times its peak: the half-way time of
      the mode's logistic rise, which is what `switch_on_times` predicts, to
      within the width $\approx \ln 81 / r_k$ of the transition (10% to 90%).
    - `modes`, `overlaps`: the column of `basis` with the largest squared
      overlap with its eigenvector at the peak (for a basis from `lv_reduce`,
      the Lotka-Volterra mode that switched on).

    Two outliers that are nearly degenerate for a long time (equal learned
    values and equal times) have no well-defined individual eigenvectors; they
    may then swap or split into extra tracks. Runs eagerly (NumPy `eigh` per
    record), not under `jit`.

    Typical use, with snapshots from `train`:

    ```python
    res = nqfjax.train(structure, xs, ys, num_steps=N, learning_rate=eta,
                       key=key, init_scale=sigma, width=m, record_at=steps)
    lv, basis = nqfjax.lv_reduce(nqfjax.task_from_samples(structure, xs, ys))
    spec = nqfjax.weight_spectrum(res.ts, res.M, width=m, init_scale=sigma,
                                  basis=basis)
    ```

    **Arguments:**

    - `ts`: the recorded times, shape `(R,)`, strictly increasing; `ts[0]` is
      the initialisation.
    - `Ms`: `M = W W^T` at those times, shape `(R, p, p)`, symmetric.
    - `width`: the number of units `m` (columns of `W`).
    - `init_scale`: $\sigma$; default estimated from $\mathrm{Tr}\,M_0 / (p m)$
      (relative error $\approx \sqrt{2/(p m)}$).
    - `basis`: optional `(p, q)` matrix with orthonormal columns (the modes).
    - `margin`: relative margin above $\lambda_+$ (default 0.5).
    - `level`: fraction of the peak that defines `t_half` (default 0.5).
    - `min_overlap`: squared overlap that continues an outlier between records
      (default 0.5).
    - `gap_tol`: relative gap below which outliers count as nearly degenerate
      (default 0.1).

    **Returns:** a `WeightSpectrum`.

    **Raises:** `ValueError` for bad shapes, non-increasing or non-finite times,
    non-finite `M`, `margin <= 0`, `level` or `min_overlap` outside `(0, 1)`, a
    zero initial `M` or a non-positive `init_scale`.
    """
    ts, Ms, dtype, m, sigma, basis = _check_spectrum_args(
        ts, Ms, width, init_scale, basis, margin, level, min_overlap, gap_tol
    )
    p = Ms.shape[1]
    lo = sigma**2 * (np.sqrt(m) - np.sqrt(p)) ** 2
    hi = sigma**2 * (np.sqrt(m) + np.sqrt(p)) ** 2
    threshold = (1.0 + margin) * hi

    w, V = np.linalg.eigh(0.5 * (Ms + np.swapaxes(Ms, 1, 2)))
    w, V = w[:, ::-1], V[:, :, ::-1]  # descending
    tracks = _track_outliers(w, V, threshold, min_overlap, gap_tol)
    out = _outlier_summary(tracks, ts, w, V, threshold, level, basis)

    order = np.argsort(out["t_detach"], kind="stable")
    q = min(p, m)
    as_array = lambda a: jnp.asarray(a, dtype)
    return WeightSpectrum(
        ts=as_array(ts),
        eigenvalues=as_array(w),
        singular_values=as_array(np.sqrt(np.maximum(w[:, :q], 0.0))),
        init_scale=as_array(sigma),
        edges=as_array([lo, hi]),
        threshold=as_array(threshold),
        values=as_array(out["values"][order]),
        t_detach=as_array(out["t_detach"][order]),
        t_half=as_array(out["t_half"][order]),
        t_return=as_array(out["t_return"][order]),
        peak=as_array(out["peak"][order]),
        vectors=as_array(out["vectors"][order]),
        modes=jnp.asarray(out["modes"][order], jnp.int32),
        overlaps=as_array(out["overlaps"][order]),
    )


def _check_spectrum_args(
    ts, Ms, width, init_scale, basis, margin, level, min_overlap, gap_tol
):
    """The checked arguments of `weight_spectrum` as float64 NumPy arrays:
    `(ts, Ms, the dtype to return, width, sigma, basis)`."""
    ts = np.asarray(ts, np.float64)
    Ms = np.asarray(Ms)
    dtype = jax.dtypes.canonicalize_dtype(
        Ms.dtype if np.issubdtype(Ms.dtype, np.floating) else np.float64
    )
    Ms = Ms.astype(np.float64)
    if ts.ndim != 1 or ts.shape[0] < 1:
        raise ValueError(f"`ts` must be a non-empty 1-D array, got shape {ts.shape}.")
    R = ts.shape[0]
    if Ms.ndim != 3 or Ms.shape[0] != R or Ms.shape[1] != Ms.shape[2]:
        raise ValueError(
            f"`Ms` must have shape (R, p, p) = ({R}, p, p), got {Ms.shape}."
        )
    if not (np.all(np.isfinite(ts)) and np.all(np.diff(ts) > 0)):
        raise ValueError("`ts` must be finite and strictly increasing.")
    if not np.all(np.isfinite(Ms)):
        raise ValueError("`Ms` contains NaN or inf (did training diverge?).")
    p = Ms.shape[1]
    _, m = _check_sizes(p, width)
    if not (np.isfinite(margin) and margin > 0):
        raise ValueError(f"`margin` must be > 0, got {margin}.")
    for name, value in (
        ("level", level),
        ("min_overlap", min_overlap),
        ("gap_tol", gap_tol),
    ):
        if not 0 < value < 1:
            raise ValueError(f"`{name}` must be in (0, 1), got {value}.")
    if init_scale is None:
        trace0 = float(np.trace(Ms[0]))
        if not trace0 > 0:
            raise ValueError("`Ms[0]` has zero trace: cannot estimate `init_scale`.")
        sigma = np.sqrt(trace0 / (p * m))
    else:
        sigma = float(init_scale)
        if not (np.isfinite(sigma) and sigma > 0):
            raise ValueError(f"`init_scale` must be > 0, got {init_scale}.")
    if basis is not None:
        basis = np.asarray(basis, np.float64)
        if basis.ndim != 2 or basis.shape[0] != p:
            raise ValueError(
                f"`basis` must have shape (p, q) = ({p}, q), got {basis.shape}."
            )
    return ts, Ms, dtype, m, sigma, basis


def _clusters(values, above, gap_tol) -> dict[int, list[int]]:
    """Index -> its cluster of nearly degenerate outliers (relative gap below
    `gap_tol`), for the descending eigenvalue indices `above`."""
    cluster: dict[int, list[int]] = {}
    group: list[int] = []
    for b in above:
        if group and values[group[-1]] - values[b] >= gap_tol * values[group[-1]]:
            group = []
        group.append(b)
        cluster[b] = group
    return cluster


def _track_outliers(w, V, threshold, min_overlap, gap_tol) -> list[dict]:
    """Follow the eigenpairs above `threshold` through the records by their
    eigenvectors (see `weight_spectrum`): one dict per outlier with its values
    `vals` (NaN off the track), reference and peak vectors, birth and end."""
    R = w.shape[0]
    tracks: list[dict] = []
    live: list[int] = []
    for i in range(R):
        above = np.flatnonzero(w[i] > threshold)  # descending
        cluster = _clusters(w[i], above, gap_tol)
        pairs = []
        for a, j in enumerate(live):
            proj = (V[i][:, above].T @ tracks[j]["ref"]) ** 2
            for ov, b in zip(proj, above):
                span = float(sum(proj[list(above).index(c)] for c in cluster[b]))
                pairs.append((float(ov), span, a, b))
        pairs.sort(key=lambda x: x[0], reverse=True)
        taken_tracks, taken_eigs = set(), set()
        for ov, span, a, b in pairs:
            if span < min_overlap or a in taken_tracks or b in taken_eigs:
                continue
            taken_tracks.add(a)
            taken_eigs.add(b)
            tr = tracks[live[a]]
            tr["vals"][i] = w[i, b]
            tr["vec"] = V[i][:, b]
            if len(cluster[b]) == 1:  # well separated: the reference may turn
                tr["ref"] = V[i][:, b]
            if w[i, b] > tr["peak"]:
                tr["peak"], tr["peak_vec"] = w[i, b], tr["ref"]
        new_live = [live[a] for a in range(len(live)) if a in taken_tracks]
        for a in range(len(live)):
            if a not in taken_tracks:
                tracks[live[a]]["end"] = i
        for b in above:
            if b in taken_eigs:
                continue
            vals = np.full(R, np.nan)
            vals[i] = w[i, b]
            # the value before birth: the eigenvalue whose vector is closest
            before = np.nan
            if i > 0:
                before = w[i - 1, int(np.argmax((V[i - 1].T @ V[i][:, b]) ** 2))]
            tracks.append(
                dict(
                    vals=vals,
                    vec=V[i][:, b],
                    ref=V[i][:, b],
                    peak=w[i, b],
                    peak_vec=V[i][:, b],
                    birth=i,
                    before=before,
                    end=None,
                )
            )
            new_live.append(len(tracks) - 1)
        live = new_live
    return tracks


def _outlier_summary(tracks, ts, w, V, threshold, level, basis) -> dict:
    """Per outlier (in track order): its values, detach, half-way and return
    times, peak, peak vector and the basis mode it is."""
    J, (R, p) = len(tracks), w.shape
    out = dict(
        values=np.full((J, R), np.nan),
        t_detach=np.full(J, np.nan),
        t_half=np.full(J, np.nan),
        t_return=np.full(J, np.nan),
        peak=np.zeros(J),
        vectors=np.zeros((J, p)),
        modes=np.full(J, -1),
        overlaps=np.full(J, np.nan),
    )
    for j, tr in enumerate(tracks):
        i0, vals, prev = tr["birth"], tr["vals"], tr["before"]
        out["values"][j] = vals
        out["t_detach"][j] = (
            ts[i0]
            if i0 == 0
            else crossing_time(ts[i0 - 1], ts[i0], prev, vals[i0], threshold)
        )
        target = level * tr["peak"]
        i = i0 + int(np.argmax(vals[i0:] >= target))  # the peak qualifies
        if i == i0:
            out["t_half"][j] = (
                ts[i0]
                if i0 == 0 or not prev < target
                else crossing_time(ts[i0 - 1], ts[i0], prev, vals[i0], target)
            )
        else:
            out["t_half"][j] = crossing_time(
                ts[i - 1], ts[i], vals[i - 1], vals[i], target
            )
        if tr["end"] is not None:
            e = tr["end"]
            below = w[e, int(np.argmax((V[e].T @ tr["vec"]) ** 2))]
            out["t_return"][j] = crossing_time(
                ts[e - 1], ts[e], vals[e - 1], below, threshold
            )
        out["peak"][j] = tr["peak"]
        out["vectors"][j] = tr["peak_vec"]
        if basis is not None:
            ov = (basis.T @ tr["peak_vec"]) ** 2
            out["modes"][j] = int(np.argmax(ov))
            out["overlaps"][j] = float(ov[out["modes"][j]])
    return out
