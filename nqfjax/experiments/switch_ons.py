r"""When the modes of a run switch on, measured the same way on a prediction and on
a trained network (`switch_ons`, `SwitchOns`).

A switch-on is read off the eigenvalues of $M(t) = W(t) W(t)^\top$ *by rank*,
$\lambda_{(1)}(t) \ge \lambda_{(2)}(t) \ge \dots$ at each record: the `k`-th
switch-on is the first time that `k` eigenvalues are above one threshold
$\theta$ (by default half the smallest learned value), i.e. the first time
$\lambda_{(k)}(t) \ge \theta$. Eigenvalues by rank are what a user can compute
from any run -- no eigenvector has to be followed through time, which is
ill-conditioned where two modes cross or nearly coincide -- the times come in
time order by construction, and there are never more of them than the rank of
`M` (at most the number of units). One threshold for all ranks, rather than
half of each rank's own last value, keeps a switch-on from being lost when a
later, larger mode overtakes an earlier one.
"""

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Float, Int

from .._checks import static_int
from .._curves import first_crossing
from ..engines.train import TrainResult
from ._modes import learned_count


class SwitchOns(eqx.Module):
    r"""The switch-ons of the eigenvalues of $M(t)$ by rank (see `switch_ons`).

    **Attributes:**

    - `ts`: the record times, shape `(T,)`.
    - `curves`: the eigenvalues of `M` by rank at each record, largest first,
      shape `(T, q)`: $\lambda_{(k)}(t_i)$.
    - `threshold`: $\theta$, the level every rank's curve crosses (a scalar).
    - `times`: the `k`-th switch-on, the first time $\lambda_{(k)} \ge \theta$,
      shape `(q,)`, nondecreasing (log-linear interpolation between records; NaN
      where a rank never gets there, or already was at `ts[0]`).
    - `resolution`: the relative gap below which consecutive switch-ons form a
      group (`groups`).

    **Properties:** `groups` (a label per switch-on), `group_times` and
    `group_spreads`.
    """

    ts: Float[Array, " T"]
    curves: Float[Array, "T q"]
    threshold: Float[Array, ""]
    times: Float[Array, " q"]
    resolution: float = eqx.field(static=True)

    @property
    def groups(self) -> Int[np.ndarray, " q"]:
        """A group label for each switch-on (0, 1, ...): consecutive switch-ons
        less than `resolution` (relative) apart share a label, so that a
        near-degenerate group is reported once, with its spread. NaN times get a
        label each."""
        t = np.asarray(self.times, np.float64)
        labels = np.zeros(len(t), int)
        for i in range(1, len(t)):
            close = np.isfinite(t[i]) and t[i] <= t[i - 1] * (1.0 + self.resolution)
            labels[i] = labels[i - 1] + (0 if close else 1)
        return labels

    @property
    def group_times(self) -> Float[np.ndarray, " g"]:
        """The mean switch-on time of each group, shape `(g,)`."""
        t, g = np.asarray(self.times, np.float64), self.groups
        return np.array([np.mean(t[g == j]) for j in range(g.max(initial=-1) + 1)])

    @property
    def group_spreads(self) -> Float[np.ndarray, " g"]:
        """`(last - first) / mean` of each group's switch-ons, shape `(g,)` (0 for
        a group of one)."""
        t, g = np.asarray(self.times, np.float64), self.groups
        members = [t[g == j] for j in range(g.max(initial=-1) + 1)]
        return np.array([np.ptp(m) / np.mean(m) for m in members])


def _rank_curves(M: np.ndarray) -> np.ndarray:
    """The eigenvalues of each `M[i]` (shape `(T, p, p)`), largest first."""
    M = np.asarray(M, np.float64)
    return np.linalg.eigvalsh(0.5 * (M + np.swapaxes(M, 1, 2)))[:, ::-1]


def _source(measured, ts):
    """`(ts, curves by rank, number of modes allowed by the rank of M, M0's
    largest eigenvalue)` of a `TrainResult`, a `SwitchOns` or an array of
    `M(t)`."""
    if isinstance(measured, SwitchOns):
        curves = np.asarray(measured.curves, np.float64)
        return np.asarray(measured.ts, np.float64), curves, curves.shape[1], None
    if isinstance(measured, TrainResult):
        if measured.M is None:
            raise ValueError(
                "`measured` must carry snapshots of M (train with snapshots=True "
                "and no basis)."
            )
        if ts is not None:
            raise ValueError("`ts` is read from the TrainResult; do not pass it.")
        curves = _rank_curves(measured.M)
        t = np.asarray(measured.ts, np.float64)
        return t, curves, measured.W.shape[1], curves[0, 0]
    M = np.asarray(measured)
    if M.ndim != 3 or M.shape[1] != M.shape[2]:
        raise ValueError(
            "`measured` must be a TrainResult, a SwitchOns or an array of M(t) of "
            f"shape (T, p, p), got {type(measured).__name__} of shape "
            f"{getattr(M, 'shape', None)}."
        )
    if ts is None:
        raise ValueError("`ts` (shape (T,)) must be given with an array of M(t).")
    ts = np.asarray(ts, np.float64)
    if ts.shape != (M.shape[0],) or np.any(np.diff(ts) <= 0):
        raise ValueError(
            f"`ts` must be increasing with shape (T,) = ({M.shape[0]},), got "
            f"shape {ts.shape}."
        )
    curves = _rank_curves(M)
    return ts, curves, M.shape[1], curves[0, 0]


def rank_switch_ons(ts, curves, threshold=None, resolution: float = 0.02) -> SwitchOns:
    """`SwitchOns` of curves already by rank (`(T, q)`, largest first), crossing
    `threshold` (default: half the smallest last value). The engines of
    `predict` build theirs with it."""
    ts = np.asarray(ts, np.float64)
    curves = np.asarray(curves, np.float64)
    if threshold is None:
        threshold = 0.5 * np.min(curves[-1]) if curves.shape[1] else np.nan
    threshold = float(threshold)
    times = first_crossing(
        ts, np.maximum(curves, 1e-300), threshold, rising=True, at_start="nan"
    )
    return SwitchOns(
        ts=jnp.asarray(ts),
        curves=jnp.asarray(curves),
        threshold=jnp.asarray(threshold),
        times=jnp.asarray(times),
        resolution=float(resolution),
    )


def switch_ons(
    measured: TrainResult | SwitchOns | Float[ArrayLike, "T p p"],
    ts: Float[ArrayLike, " T"] | None = None,
    *,
    threshold: float | None = None,
    num_modes: int | None = None,
    resolution: float = 0.02,
) -> SwitchOns:
    r"""When the eigenvalues of $M(t) = W W^\top$, by rank, switch on: the
    statistic `predict` reports (`Prediction.switch_ons`), measured on a run.

    The `k`-th switch-on is the first time $\lambda_{(k)}(t) \ge \theta$ (`k`
    eigenvalues above the threshold), interpolated log-linearly between
    records; the times are in time order by construction. To time a trained
    network against a prediction, use the prediction's threshold and number of
    modes:

    ```python
    pred = nqfjax.predict(structure, xs, ys, **hyper)
    run = nqfjax.train(structure, xs, ys, **hyper)   # snapshots of M
    ons = pred.switch_ons
    measured = nqfjax.switch_ons(
        run, threshold=ons.threshold, num_modes=len(ons.times)
    )
    measured.times / ons.times - 1
    ```

    (`agreement` does this). The modes counted are the learned ones: last
    eigenvalue above $\sqrt{\lambda_{\max}(M_0)\lambda_{(1)}}$, the geometric
    middle between the initial scale and the largest learned mode (or
    `num_modes`), never more than the rank of `M` allows (the number of units,
    for a `TrainResult`). The default threshold, half the smallest learned
    value, is that mode's half-way point; a larger mode crosses it earlier in
    its rise, by $\ln(m_k / 2\theta) / r_k$.

    **Arguments:**

    - `measured`: a `TrainResult` with snapshots of `M` (`train(...,
      snapshots=True)`, the default), an array of `M(t)`, shape `(T, p, p)`
      (then `ts` too), or a `SwitchOns` (timed again at another `threshold`).
    - `ts`: the record times, shape `(T,)`, increasing (only with an array).
    - `threshold`: $\theta > 0$ (default: half the smallest learned value).
    - `num_modes`: how many ranks (default: the learned ones, see above).
    - `resolution`: relative gap below which consecutive switch-ons form a group
      (default 0.02).

    **Returns:** a `SwitchOns`.

    **Raises:** `ValueError` for a `TrainResult` without snapshots, an array
    that is not `(T, p, p)` or without matching `ts`, a `num_modes` beyond the
    rank of `M`, `threshold <= 0` or `resolution < 0`.
    """
    t, curves, rank, lam0 = _source(measured, ts)
    if not (np.ndim(resolution) == 0 and float(resolution) >= 0):
        raise ValueError(f"`resolution` must be a number >= 0, got {resolution!r}.")
    if threshold is not None and not (
        np.ndim(threshold) == 0 and np.isfinite(threshold) and float(threshold) > 0
    ):
        raise ValueError(f"`threshold` must be a finite number > 0, got {threshold!r}.")
    if num_modes is not None:
        q = static_int("num_modes", num_modes, 0)
    elif lam0 is None:
        q = curves.shape[1]
    else:
        q = learned_count(curves[-1], max(lam0, 0.0))
    cap = min(rank, curves.shape[1])
    if q > cap:
        raise ValueError(
            f"`num_modes` must be at most {cap} here (the rank of M), got {q}."
        )
    return rank_switch_ons(t, curves[:, :q], threshold, float(resolution))
