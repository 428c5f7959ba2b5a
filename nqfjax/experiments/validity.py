r"""Where the leading order holds: how far a real layer is from its quadratic form
along a trajectory of weights.

Every prediction of nqfjax is the leading order of the layer near small weights,
$f(x; W) \approx f(x; 0) + \mathrm{Tr}[W W^\top A(x)]$. Along a trajectory
$W(t)$ (predicted, with $W W^\top = M(t)$, or trained), the *departure* at a
record is the relative size, over a sample of inputs, of what the real layer
adds beyond that form,

$$\varepsilon(t) = \frac{\big\|f(x; W) - f(x; 0) - \mathrm{Tr}[W W^\top A(x)]
\big\|}{\big\|\mathrm{Tr}[W W^\top A(x)]\big\|},$$

norms over the samples and the outputs. The departure rises with the learned
modes (for a tanh unit, $\tanh u = u - u^3/3 + \dots$: about a third of the
mean squared pre-activation). It is measured, not bounded: what it does to a
prediction depends on how long the layer stays there; see `Validity` for the
verdict and the docs page "Where the leading order holds" for the measured
relation with the prediction's error.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Float

from .._checks import eager_only
from ..engines.train import TrainResult
from ..structures.base import AbstractStructure, check_batch


#: The default tolerance of the verdict: the departure above which the
#: leading order is said to break.
DEFAULT_TOLERANCE = 0.1

#: The inputs the departure is averaged over (the first ones of the data).
DEFAULT_NUM_INPUTS = 512


class Validity(eqx.Module):
    r"""How far the real layer is from its quadratic form along a trajectory
    (`leading_order_validity`; `Prediction.validity`).

    **Attributes:**

    - `ts`: the records where the departure was measured, shape `(R,)`.
    - `departure`: $\varepsilon$ at those records (see the module), shape
      `(R,)`; NaN where the quadratic part is zero.
    - `tolerance`: the departure above which the leading order is said to break.
    - `breaks_at`: the first record whose departure exceeds `tolerance`; `inf`
      when none does (NaN when nothing was measured).
    - `discretisation_lag`: $r/4$, the relative lag of gradient descent behind
      the flow per switch-on at the fastest growth rate $r$ per step (NaN when
      unknown).
    - `verdict`: one line in plain words.
    """

    ts: Float[Array, " R"]
    departure: Float[Array, " R"]
    tolerance: float = eqx.field(static=True)
    breaks_at: float = eqx.field(static=True)
    discretisation_lag: float = eqx.field(static=True)
    verdict: str = eqx.field(static=True)

    @property
    def holds(self) -> bool:
        """Whether the departure stays within `tolerance` up to the last record
        (and the lag within it too)."""
        lag_ok = not self.discretisation_lag > self.tolerance
        return bool(np.isinf(self.breaks_at)) and lag_ok


@eqx.filter_jit
def _departures(structure, xs, Ws):
    """`(||delta||, ||quadratic||)` per factor, `Ws` of shape `(R, p, m)`."""
    zero = jnp.zeros((structure.p, 1), Ws.dtype)
    f0 = jax.vmap(lambda x: structure.layer(zero, x))(xs)

    def one(W):
        f = jax.vmap(lambda x: structure.layer(W, x))(xs)
        quad = structure.contract_factor(xs, W)
        delta = f - f0 - quad
        return jnp.sqrt(jnp.sum(delta**2)), jnp.sqrt(jnp.sum(quad**2))

    return jax.lax.map(one, Ws)


def _verdict(ts, departure, tolerance, lag) -> tuple[float, str]:
    measured = np.isfinite(departure)
    if not np.any(measured):
        return float("nan"), "leading order not measured"
    over = np.nonzero(measured & (departure > tolerance))[0]
    lag_note = (
        f"; gradient descent lags the flow by about {100 * lag:.2g}% per "
        "switch-on (lower the learning rate)"
        if lag > tolerance
        else ""
    )
    if over.size == 0:
        top = float(np.nanmax(departure))
        return float("inf"), (
            f"the leading order holds to about {100 * top:.2g}% up to step "
            f"{float(ts[-1]):.4g}{lag_note}"
        )
    i = int(over[0])
    before = departure[:i][measured[:i]]
    held = float(np.max(before)) if before.size else float(departure[i])
    return float(ts[i]), (
        f"the leading order holds to about {100 * held:.2g}% until step "
        f"{float(ts[i]):.4g}; beyond it the real layer's higher orders exceed "
        f"{100 * tolerance:.2g}% of its quadratic form{lag_note}"
    )


def leading_order_validity(
    structure: AbstractStructure,
    xs: Float[ArrayLike, "n ..."],
    factors: Float[ArrayLike, "R p m"],
    ts: Float[ArrayLike, " R"],
    *,
    growth_rate: float | None = None,
    tolerance: float = DEFAULT_TOLERANCE,
    num_inputs: int = DEFAULT_NUM_INPUTS,
) -> Validity:
    r"""The departure of the real layer from its quadratic form along the
    weights `factors` (one `(p, m)` matrix per record), over the first
    `num_inputs` of `xs`, and the verdict at `tolerance`.

    **Arguments:**

    - `structure`: the layer.
    - `xs`: inputs, shape `(n, *structure.input_shape)`.
    - `factors`: the weights $W(t)$ at the records, shape `(R, p, m)`.
    - `ts`: the records' times (steps), shape `(R,)`, increasing.
    - `growth_rate`: the fastest linear growth rate $r$ per step (for the
      discretisation lag $r/4$); `None` leaves it unknown.
    - `tolerance`: the departure above which the leading order breaks
      (default 0.1), > 0.
    - `num_inputs`: how many inputs to average over (default 512), >= 1.

    **Returns:** a `Validity`.
    """
    eager_only("leading_order_validity", "it reads the verdict on the host", xs=xs)
    factors = jnp.asarray(factors)
    ts = np.asarray(ts, np.float64)
    if factors.ndim != 3 or factors.shape[1] != structure.p:
        raise ValueError(
            f"`factors` must have shape (R, p, m) with p = {structure.p}, got "
            f"{factors.shape}."
        )
    if ts.shape != (factors.shape[0],):
        raise ValueError(
            f"`ts` must have shape (R,) = ({factors.shape[0]},), got {ts.shape}."
        )
    if not (np.isfinite(tolerance) and tolerance > 0):
        raise ValueError(f"`tolerance` must be a finite number > 0, got {tolerance}.")
    if not (isinstance(num_inputs, int | np.integer) and num_inputs >= 1):
        raise ValueError(f"`num_inputs` must be an int >= 1, got {num_inputs!r}.")
    xs = check_batch(structure, jnp.asarray(xs)[:num_inputs])
    xs = xs.astype(jnp.result_type(xs.dtype, factors.dtype))
    delta, quad = (
        np.asarray(a, np.float64) for a in _departures(structure, xs, factors)
    )
    with np.errstate(invalid="ignore", divide="ignore"):
        departure = np.where(quad > 0, delta / quad, np.nan)
    lag = float("nan") if growth_rate is None else float(growth_rate) / 4.0
    breaks_at, verdict = _verdict(ts, departure, tolerance, lag)
    return Validity(
        ts=jnp.asarray(ts),
        departure=jnp.asarray(departure),
        tolerance=float(tolerance),
        breaks_at=breaks_at,
        discretisation_lag=lag,
        verdict=verdict,
    )


def polar_factor(W0: Float[ArrayLike, "p m"]) -> Float[np.ndarray, "p m"]:
    r"""The polar factor $O = U V^\top$ of $W_0 = U S V^\top$ (thin SVD), so
    that $W_0 = (W_0 W_0^\top)^{1/2} O$. Float64 numpy, shape `(p, m)`."""
    U, _, Vt = np.linalg.svd(np.asarray(W0, np.float64), full_matrices=False)
    return U @ Vt


def factors_of(
    Ms: Float[ArrayLike, "R p p"], W0: Float[ArrayLike, "p m"]
) -> Float[np.ndarray, "R p m"]:
    r"""Weights $W(t) = M(t)^{1/2} O$ with $W W^\top = M(t)$, from a trajectory
    of `M` and the initial weights: $O$ is the polar factor of $W_0$
    ($W_0 = (W_0 W_0^\top)^{1/2} O$), so $W(0) = W_0$ and each unit carries
    the learned modes in proportion to its initial overlap with them, as
    gradient descent from $W_0$ does to leading order. Exact ($W W^\top = M$)
    when `m >= p`. Float64 numpy, shape `(R, p, m)`."""
    Ms = np.asarray(Ms, np.float64)
    lam, Q = np.linalg.eigh(0.5 * (Ms + np.swapaxes(Ms, 1, 2)))
    root = (Q * np.sqrt(np.maximum(lam, 0.0))[:, None, :]) @ np.swapaxes(Q, 1, 2)
    return root @ polar_factor(W0)


def record_index(ts: Float[ArrayLike, " T"], num: int = 32) -> np.ndarray:
    """Indices of about `num` of the times `ts` (increasing), the nearest to
    log-spaced times from the first positive one to the last, with the first and
    the last: where the departure is measured along a prediction."""
    ts = np.asarray(ts, np.float64)
    T = ts.shape[0]
    positive = ts[ts > 0]
    if T <= num or positive.size < 2:
        return np.arange(T)
    targets = np.geomspace(positive[0], ts[-1], num)
    idx = np.clip(np.searchsorted(ts, targets), 0, T - 1)
    return np.union1d(idx, [0, T - 1])


def validity_of_run(
    structure: AbstractStructure,
    xs: Float[ArrayLike, "n ..."],
    result: TrainResult,
    *,
    tolerance: float = DEFAULT_TOLERANCE,
    num_inputs: int = DEFAULT_NUM_INPUTS,
    num_records: int = 32,
) -> Validity:
    r"""The departure of a trained run from the quadratic form of its layer:
    `leading_order_validity` at about `num_records` of its records, with
    $W(t) = M(t)^{1/2} O$ (`factors_of`) from its `M` snapshots and the polar
    factor $O$ of its final weights (the run records `M`, not `W`).

    **Raises:** `ValueError` when the run has no `M` snapshots
    (`train(..., snapshots=False)` or a `basis`).
    """
    if result.M is None:
        raise ValueError(
            "`result` has no M snapshots: train with snapshots=True and no basis."
        )
    idx = record_index(np.asarray(result.ts, np.float64), num_records)
    Ms = np.asarray(result.M, np.float64)[idx]
    W = factors_of(Ms, np.asarray(result.W, np.float64))
    return leading_order_validity(
        structure,
        xs,
        W,
        np.asarray(result.ts, np.float64)[idx],
        tolerance=tolerance,
        num_inputs=num_inputs,
    )
