r"""Where the leading order holds: how far a real layer is from its quadratic form
along a trajectory of weights.

Every prediction of nqfjax is the leading order of the layer near small weights,
$f(x; W) \approx f(x; 0) + \mathrm{Tr}[W W^\top A(x)]$. Along a trajectory
$W(t)$ (predicted, with $W W^\top = M(t)$, or trained), the *departure* at a
record is the relative size, over the inputs, of what the real layer
adds beyond that form,

$$\varepsilon(t) = \frac{\big\|f(x; W) - f(x; 0) - \mathrm{Tr}[W W^\top A(x)]
\big\|}{\big\|\mathrm{Tr}[W W^\top A(x)]\big\|},$$

norms over the samples and the outputs. The departure rises with the learned
modes (for a tanh unit, $\tanh u = u - u^3/3 + \dots$: about a third of the
mean squared pre-activation). It is measured, not bounded: what it does to a
prediction depends on how long the layer stays there; see `Validity` for the
verdict and the docs page "Where the leading order holds" for the measured
relation with the prediction's error.

What moves a prediction is accumulated, not instantaneous: once a mode is
learned, the real layer's higher orders *feed* the modes still waiting to
switch on. Along the trajectory, let $u_k$ be the $k$-th eigenvector of $M$
at the $k$-th switch-on $T_k$ and $\psi_k(t) = \Phi(T_k, t)^\top u_k$ the
direction that the quadratic form's flow of a small mode,
$\dot W = -2\eta\,G(t) W$ ($\nabla_W L_{\rm quad} = 2 G W$), carries into it,
less its parts along the larger modes $u_j(t)$, $j < k$ (before $T_k$ the
$k$-th eigenvector by rank still mixes in modes that switch on later); let
$x_k = W^\top \psi_k$ be its pattern over the units, $a_k = |x_k|^2$ its
amplitude, and $\delta g = \nabla_W L_{\rm real} - \nabla_W L_{\rm quad}$ the
difference of the loss gradients at $W(t)$ (the real layer's with the learned
levels settled where it holds them, `_settle`). The leading order lets $x_k$
grow by its own factor while the real layer adds $s_k = -\eta\,\delta g^\top \psi_k$
per step, less its parts along the larger modes' $v_j = W^\top u_j$ ($j < k$:
those turn a learned mode toward $\psi_k$, and it turns back). Carried to the
switch-on at the predicted growth, the higher orders change the mode's
amplitude by the factor $\rho_k = |e^{\phi_k} \hat x_k(T_k) + D_k|^2$: the
feed along the pattern itself changes the mode's own growth rate and
compounds, $\phi_k = \int_0^{T_k} w_k\, s_k \cdot \hat x_k / \sqrt{a_k}\,dt$;
the feed across it, $s_k^\perp$, adds a part that grows with the mode,
$D_k = \int_0^{T_k} w_k\, s_k^\perp / \sqrt{a_k}\,dt$. That moves the
switch-on by $-\ln \rho_k / r_k$ at the mode's linear growth rate $r_k$; the
weight $w_k = r_k / r_k(t)$ (at most 4) after the previous switch-on, while the
mode's rate $r_k(t)$ falls as it saturates, 1 before. The *expected shift* is
$\epsilon_k = -\ln\rho_k/(r_k T_k) + r_k/4$ (the last term the lag of gradient
descent behind the flow), a relative error of the switch-on time.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Float

from .._checks import eager_only
from ..engines.train import TrainResult
from ..structures.base import AbstractStructure, check_batch
from ._gap import gradient_gap
from ._modes import learned_count
from ._shifts import modes_and_flow, shifts
from .switch_ons import rank_switch_ons


#: The default tolerance of the departure: the departure above which the
#: leading order is said to break when no expected shift is measured.
DEFAULT_TOLERANCE = 0.1

#: The default tolerance of the expected shift of a switch-on (a relative
#: error of its time): between the 2% a row should keep and the 5% it misses by
#: (docs: "Where the leading order holds").
DEFAULT_SHIFT_TOLERANCE = 0.03

#: The expected shifts read the records from where the weights' squared norm
#: reaches this fraction of its largest (`estimated_records`): a feed at least
#: second order in the weights adds below a thousandth of the switch-on's.
EARLY_CUT = 1e-6

#: The expected shifts read the records from the last one before which the
#: weights carry this share of $\int |W| dt$ up to the last switch-on
#: (`estimated_records`; see there).
EARLY_SHARE = 1e-3

#: The inputs the departure and the shifts are averaged over (`None`: all, as
#: the training's gradient; a subset's gap differs by up to its own size).
DEFAULT_NUM_INPUTS = None


class Validity(eqx.Module):
    r"""How far the real layer is from its quadratic form along a trajectory
    (`leading_order_validity`; `Prediction.validity`).

    **Attributes:**

    - `ts`: the records where the departure was measured, shape `(R,)`: with
      expected shifts, those they read (`estimated_records`: from where the
      weights have grown to the last switch-on estimated), else all.
    - `departure`: $\varepsilon$ at those records (see the module), shape
      `(R,)`; NaN where the quadratic part is zero.
    - `tolerance`: the departure above which the leading order is said to break.
    - `breaks_at`: the first record whose departure exceeds `tolerance`; `inf`
      when none does (NaN when nothing was measured).
    - `discretisation_lag`: $r/4$, the relative lag of gradient descent behind
      the flow per switch-on at the fastest growth rate $r$ per step (NaN when
      unknown).
    - `verdict`: one line in plain words.
    - `switch_times`: the switch-ons whose shift was estimated (the predicted
      `k`-th switch-on times, in time order), shape `(c,)`; empty when the
      targets were not given.
    - `expected_shift`: $\epsilon_k$ (see the module), the expected relative
      error of those switch-on times, signed (> 0: the real network later),
      shape `(c,)`; NaN for a rank that does not switch on. A first-order
      estimate: at tens of percent only its order of magnitude holds, and
      past the switch-on where the leading order breaks (`breaks_at`) the
      later ones can be far beyond 100% (`Conv1D` at init `1e-6`, fourth
      switch-on: -2000%): those switch-ons are not predicted at all.

    With expected shifts, `tolerance` bounds $|\epsilon_k|$ and `breaks_at` is
    the first switch-on whose $|\epsilon_k|$ exceeds it; without, it bounds the
    departure.

    **Properties:** `expected_error`, the largest $|\epsilon_k|$ (NaN when none
    was estimated); `holds`.
    """

    ts: Float[Array, " R"]
    departure: Float[Array, " R"]
    tolerance: float = eqx.field(static=True)
    breaks_at: float = eqx.field(static=True)
    discretisation_lag: float = eqx.field(static=True)
    verdict: str = eqx.field(static=True)
    switch_times: Float[Array, " c"] = eqx.field(
        default_factory=lambda: jnp.zeros(0), converter=jnp.asarray
    )
    expected_shift: Float[Array, " c"] = eqx.field(
        default_factory=lambda: jnp.zeros(0), converter=jnp.asarray
    )

    @property
    def expected_error(self) -> float:
        r"""The largest expected relative error of a switch-on time,
        $\max_k |\epsilon_k|$ (NaN when none was estimated)."""
        shift = np.abs(np.asarray(self.expected_shift, np.float64))
        return float(np.nanmax(shift)) if np.any(np.isfinite(shift)) else np.nan

    @property
    def holds(self) -> bool:
        """Whether the leading order holds within `tolerance` up to the last
        record (and the lag within it too)."""
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


#: Records measured are padded to a multiple of this (`_departures_by_blocks`).
_BLOCK = 8

#: The trajectory whose records the expected shifts read is padded to a
#: multiple of this (`_gap.gradient_gap` runs only on the records read).
_RECORDS = 32


def _departures_by_blocks(structure, xs, Ws) -> tuple[np.ndarray, np.ndarray]:
    """`_departures` at the records of `Ws` (shape `(R, p, m)`) padded with
    the last one to a multiple of `_BLOCK`, float64 numpy: one compilation
    per layer, inputs and multiple of `_BLOCK` (blocks of 8 records, each a
    call, took 1.25 to 1.5 times as long; the padding 1.2 times at 25)."""
    R = Ws.shape[0]
    if R:
        Ws = np.concatenate([Ws, np.repeat(Ws[-1:], -R % _BLOCK, 0)])
    delta, quad = _departures(structure, xs, Ws)
    return np.asarray(delta, np.float64)[:R], np.asarray(quad, np.float64)[:R]


def _verdict(ts, departure, tolerance, lag) -> tuple[float, str]:
    measured = np.isfinite(departure)
    if not np.any(measured):
        return float("nan"), "leading order not measured"
    over = np.nonzero(measured & (departure > tolerance))[0]
    lag_note = _lag_note(lag, tolerance)
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


def _lag_note(lag, tolerance) -> str:
    return (
        f"; gradient descent lags the flow by about {100 * lag:.2g}% per "
        "switch-on (lower the learning rate)"
        if lag > tolerance
        else ""
    )


def _shift_verdict(ts, times, shift, tolerance, lag) -> tuple[float, str]:
    """The verdict on the expected shifts of the switch-ons `times`."""
    size = np.abs(shift)
    known = np.isfinite(size)
    if not np.any(known):
        return float("inf"), (
            f"the leading order holds up to step {float(ts[-1]):.4g} (no "
            f"switch-on to time){_lag_note(lag, tolerance)}"
        )
    over = np.nonzero(known & (size > tolerance))[0]
    if over.size == 0:
        return float("inf"), (
            f"the leading order holds: switch-ons expected within about "
            f"{100 * float(np.nanmax(size)):.2g}% of the real network's up to step "
            f"{float(ts[-1]):.4g}{_lag_note(lag, tolerance)}"
        )
    k = int(over[0])
    before = size[:k][known[:k]]
    held = f"to about {100 * float(np.max(before)):.2g}% " if before.size else ""
    return float(times[k]), (
        f"the leading order holds {held}until step {float(times[k]):.4g}; "
        f"beyond it the real layer's higher orders move switch-on {k + 1} by "
        f"about {100 * float(shift[k]):+.2g}%{_lag_note(lag, tolerance)}"
    )


def expected_shifts(
    ts: Float[ArrayLike, " R"],
    factors: Float[ArrayLike, "R p m"],
    gap: Float[ArrayLike, "R p m"],
    grad_quad: Float[ArrayLike, "R p m"],
    learning_rate: float,
    switch_times: Float[ArrayLike, " c"],
    generator: Float[ArrayLike, "R p p"] | None = None,
) -> Float[np.ndarray, " c"]:
    r"""$\epsilon_k$ of the module (the expected relative error of the `k`-th
    switch-on time) from the weights `factors`, the gradient gap $\delta g$
    and the quadratic form's gradient at the records `ts`, for the switch-ons
    `switch_times` (by rank, in time order); with `generator` (shape
    `(R, p, p)`, $G$ with $\nabla_W L_{\rm quad} = 2 G W$ at the records) the
    feed is counted on the direction that the quadratic form's flow carries
    into the mode at its switch-on, without it on that mode's eigenvector
    itself. Float64 numpy, shape `(c,)`; NaN for a rank that does not switch
    on within the records."""
    ts = np.asarray(ts, np.float64)
    W = np.asarray(factors, np.float64)
    times = np.asarray(switch_times, np.float64).reshape(-1)
    G = None if generator is None else np.asarray(generator, np.float64)
    lam, U, flow = modes_and_flow(ts, W, float(learning_rate), G)
    return shifts(
        ts,
        W,
        np.asarray(gap, np.float64),
        np.asarray(grad_quad, np.float64),
        float(learning_rate),
        times,
        lam,
        U,
        flow,
    )


def leading_order_validity(
    structure: AbstractStructure,
    xs: Float[ArrayLike, "n ..."],
    factors: Float[ArrayLike, "R p m"],
    ts: Float[ArrayLike, " R"],
    *,
    growth_rate: float | None = None,
    tolerance: float | None = None,
    num_inputs: int | None = DEFAULT_NUM_INPUTS,
    ys: Float[ArrayLike, "n k"] | None = None,
    learning_rate: float | None = None,
    switch_times: Float[ArrayLike, " c"] | None = None,
    settled: bool = True,
    carry_frame: bool = False,
) -> Validity:
    r"""The departure of the real layer from its quadratic form along the
    weights `factors` (one `(p, m)` matrix per record), over the inputs `xs`
    (the first `num_inputs` of them); with the targets `ys`, the expected shift of each
    switch-on (see the module), measured at the records they read
    (`estimated_records`); and the verdict at `tolerance`.

    **Arguments:**

    - `structure`: the layer.
    - `xs`: inputs, shape `(n, *structure.input_shape)`.
    - `factors`: the weights $W(t)$ at the records, shape `(R, p, m)`.
    - `ts`: the records' times (steps), shape `(R,)`, increasing.
    - `growth_rate`: the fastest linear growth rate $r$ per step (for the
      discretisation lag $r/4$); `None` leaves it unknown.
    - `tolerance`: the expected shift (default 0.03) or, without `ys`, the
      departure (default 0.1) above which the leading order breaks, > 0.
    - `num_inputs`: how many inputs to average over, >= 1 (default `None`:
      all of them, as the training does; fewer cost less, but the gradient
      gap of a subset differs from the whole's by up to its own size).
    - `ys`: the targets, shape `(n, k)`: with them (and `learning_rate`), the
      expected shifts of the switch-ons.
    - `learning_rate`: $\eta > 0$, the time unit of `ts` (steps).
    - `switch_times`: the switch-on times to estimate, by rank in time order,
      shape `(c,)` (default: where the eigenvalues of $W W^\top$ by rank cross
      half the smallest learned one, from the records).
    - `settled`: read the feed with the learned modes' levels settled where
      the real layer holds them (`_settle`: weights of the quadratic form's
      flow); `False` for weights the real layer trained, whose levels are its
      own (`validity_of_run`).
    - `carry_frame`: with `ys`, first turn the weights, record by record from
      the first, into the frame of units that the quadratic form's flow
      carries (`_gap.carried_factors`; for the weights $M^{1/2} O$ of an
      engine that integrates $M$: `predict`).

    **Returns:** a `Validity`.
    """
    eager_only("leading_order_validity", "it reads the verdict on the host", xs=xs)
    # on the host: sliced and cut into blocks without a compilation per shape
    factors = np.asarray(factors)
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
    if tolerance is None:
        tolerance = DEFAULT_TOLERANCE if ys is None else DEFAULT_SHIFT_TOLERANCE
    if not (np.isfinite(tolerance) and tolerance > 0):
        raise ValueError(f"`tolerance` must be a finite number > 0, got {tolerance}.")
    if ys is not None and not (
        learning_rate is not None and np.isfinite(learning_rate) and learning_rate > 0
    ):
        raise ValueError(
            f"`learning_rate` must be a finite number > 0 with `ys`, got "
            f"{learning_rate!r}."
        )
    if num_inputs is not None and not (
        isinstance(num_inputs, int | np.integer) and num_inputs >= 1
    ):
        raise ValueError(
            f"`num_inputs` must be None or an int >= 1, got {num_inputs!r}."
        )
    xs = np.asarray(check_batch(structure, np.asarray(xs)[:num_inputs]))
    xs = xs.astype(jnp.result_type(xs.dtype, factors.dtype))
    with_ys = ys is not None and ts.shape[0] > 0
    lag = float("nan") if growth_rate is None else float(growth_rate) / 4.0
    if with_ys:
        ys = np.asarray(ys, xs.dtype)[: xs.shape[0]]
        if ys.shape != (xs.shape[0], structure.k):
            raise ValueError(
                f"`ys` must have shape (n, k) with k = {structure.k}, got {ys.shape}."
            )
        W = np.asarray(factors, np.float64)
        times = (
            _rank_times(ts, W)
            if switch_times is None
            else np.asarray(switch_times, np.float64).reshape(-1)
        )
        kept = estimated_records(ts, W, times)
        with_ys = kept.stop > kept.start
    shift = None
    if with_ys:
        ts, delta, quad, shift = _read_records(
            structure,
            xs,
            ys,
            W,
            ts,
            kept,
            float(learning_rate),
            times,
            settled,
            carry_frame,
        )
    else:
        delta, quad = _departures_by_blocks(structure, xs, factors)
    with np.errstate(invalid="ignore", divide="ignore"):
        departure = np.where(quad > 0, delta / quad, np.nan)
    if ys is None or ts.shape[0] == 0:
        times, shift = np.zeros(0), np.zeros(0)
        breaks_at, verdict = _verdict(ts, departure, tolerance, lag)
    else:
        shift = np.full(times.shape, np.nan) if shift is None else shift
        breaks_at, verdict = _shift_verdict(ts, times, shift, tolerance, lag)
    # one transfer for the four arrays
    ts, departure, times, shift = jax.device_put((ts, departure, times, shift))
    return Validity(
        ts=ts,
        departure=departure,
        tolerance=float(tolerance),
        breaks_at=breaks_at,
        discretisation_lag=lag,
        verdict=verdict,
        switch_times=times,
        expected_shift=shift,
    )


def _read_records(structure, xs, ys, W, ts, kept, learning_rate, times, settled, carry):
    """`(ts, ||delta||, ||quadratic||, expected shifts)` at the records `kept`
    (`estimated_records`) of the weights `W` (float64, shape `(R, p, m)`) at
    `ts`, turned into the carried frame with `carry`."""
    # the whole trajectory padded with zeros to a multiple of _RECORDS, the
    # range traced: compiled once per layer, inputs and multiple of _RECORDS,
    # whatever the records read
    padded = np.zeros((-(-ts.shape[0] // _RECORDS) * _RECORDS, *W.shape[1:]))
    padded[: ts.shape[0]] = W
    # how many switch-ons have passed at each record: those modes' levels
    # settle where the real layer holds them (`_settle`)
    on = np.sort(times[np.isfinite(times) & (times > 0)])
    learned = np.zeros(padded.shape[0], np.int32)
    learned[: ts.shape[0]] = np.searchsorted(on, ts, side="right")
    modes = int(min(on.size, *W.shape[1:])) if settled else 0
    span = (np.int64(kept.start), np.int64(kept.stop))
    padded = padded.astype(xs.dtype)
    times_padded = np.zeros(padded.shape[0], xs.dtype)
    times_padded[: ts.shape[0]] = ts
    measured = gradient_gap(
        structure,
        xs,
        ys,
        padded,
        times_padded,
        np.asarray(learning_rate, xs.dtype),
        *span,
        learned,
        modes,
        carry,
    )
    delta, quad, gap, grad, _, lam, U, flows, W = (
        np.asarray(a, np.float64)[kept] for a in measured
    )
    ts = ts[kept]
    shift = shifts(ts, W, gap, grad, learning_rate, times, lam, U, flows[1:])
    return ts, delta, quad, shift


def estimated_records(
    ts: Float[ArrayLike, " R"],
    W: Float[ArrayLike, "R p m"],
    times: Float[ArrayLike, " c"],
) -> slice:
    r"""The records the expected shifts of the switch-ons `times` read: up to
    the last one estimated (the records after it feed none), from the first
    where $|W|^2$ reaches `EARLY_CUT` of its largest there (before it the real
    layer's higher orders are smaller still: the feed is at least second order
    in $W$, so what it adds to $D_k$ is below $\sqrt{\kappa}$ of it) and from
    the last before which $\int |W| dt$ is `EARLY_SHARE` of its whole (the
    feed relative to the waiting mode grows at least as $|W|$: at least third
    order in $W$, the waiting mode growing no faster than $W$; so what those
    records add to $D_k$ is at most about that share: the initial weights,
    waiting, at larger inits), with
    at least 4 records before the first switch-on. Empty when no switch-on is
    estimated."""
    ts = np.asarray(ts, np.float64)
    times = np.asarray(times, np.float64)
    on = times[np.isfinite(times) & (times > 0)]
    last = int(np.searchsorted(ts, np.max(on), side="right")) if on.size else 0
    if last < 2:
        return slice(0, 0)
    size = np.sum(np.asarray(W, np.float64)[:last] ** 2, axis=(1, 2))
    first = int(np.argmax(size >= EARLY_CUT * np.max(size)))
    # the records before the one where int |W| dt passes EARLY_SHARE of it
    norm = np.sqrt(size)
    span = np.concatenate(
        [[0.0], np.cumsum(0.5 * (norm[1:] + norm[:-1]) * np.diff(ts[:last]))]
    )
    first = max(first, int(np.argmax(span > EARLY_SHARE * span[-1])) - 1)
    first_on = int(np.searchsorted(ts, np.min(on), side="right"))
    return slice(min(first, max(first_on - 4, 0)), last)


def _rank_times(ts, W) -> np.ndarray:
    """The switch-ons of the eigenvalues of `W W^T` by rank at the records
    (`rank_switch_ons` of the learned ranks), shape `(c,)`."""
    curves = np.linalg.eigvalsh(W @ np.swapaxes(W, 1, 2))[:, ::-1]
    q = learned_count(curves[-1], float(curves[0, 0]))
    return np.asarray(rank_switch_ons(ts, curves[:, :q]).times, np.float64)


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


def record_index(ts: Float[ArrayLike, " T"], num: int = 24) -> np.ndarray:
    """Indices of about `2 num` of the times `ts` (increasing): the nearest to
    `num` log-spaced times from the first positive one to the last and to `num`
    evenly spaced ones (the switch-ons, late, need the resolution in `t`), with
    the first and the last: where the departure is measured along a
    prediction."""
    ts = np.asarray(ts, np.float64)
    T = ts.shape[0]
    positive = ts[ts > 0]
    if T <= 2 * num or positive.size < 2:
        return np.arange(T)
    targets = np.concatenate(
        [np.geomspace(positive[0], ts[-1], num), np.linspace(ts[0], ts[-1], num)]
    )
    idx = np.clip(np.searchsorted(ts, targets), 0, T - 1)
    return np.union1d(idx, [0, T - 1])


def validity_of_run(
    structure: AbstractStructure,
    xs: Float[ArrayLike, "n ..."],
    result: TrainResult,
    *,
    tolerance: float | None = None,
    num_inputs: int | None = DEFAULT_NUM_INPUTS,
    num_records: int = 24,
    ys: Float[ArrayLike, "n k"] | None = None,
    learning_rate: float | None = None,
) -> Validity:
    r"""The departure of a trained run from the quadratic form of its layer:
    `leading_order_validity` at about twice `num_records` of its records
    (`record_index`), with
    $W(t) = M(t)^{1/2} O$ (`factors_of`) from its `M` snapshots and the polar
    factor $O$ of its final weights (the run records `M`, not `W`); with the
    targets `ys` and the run's `learning_rate`, the expected shifts of its
    switch-ons (`leading_order_validity`; the levels not settled: they are
    the real layer's own).

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
        ys=ys,
        learning_rate=learning_rate,
        settled=False,
    )
