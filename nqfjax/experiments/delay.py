"""Delayed generalisation: a quadratic network trained on few samples with weight
decay fits the training data long before its test loss drops
(`delayed_generalisation`, `generalisation_delay`, `delay_scaling`)."""

from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import Array, ArrayLike, Float, PRNGKeyArray

from .._checks import check_shape
from .._curves import first_crossing, loglog_slope
from ..engines.train import train
from ..structures.base import AbstractStructure
from ..structures.models import QuadraticForm
from ..tasks.base import Task


# --------------------------------------------------------------------------------
# delayed generalisation


def generalisation_delay(
    ts: Float[ArrayLike, " R"],
    train_loss: Float[ArrayLike, " R"],
    test_loss: Float[ArrayLike, " R"],
    fit_level: Float[ArrayLike, ""],
    test_level: Float[ArrayLike, ""],
) -> tuple[Float[Array, ""], Float[Array, ""], Float[Array, ""]]:
    r"""When a run fits its training data, when it generalises, and the delay.

    `t_fit` is the first time `train_loss < fit_level` and `t_generalise` the
    first time `test_loss < test_level` (interpolating $\log L$ linearly in
    $\log t$ between records); `delay = t_generalise - t_fit`. NaN when a level
    is never reached. Traceable (`jit`/`vmap`).

    This only measures two curves you already have, from any source;
    `delayed_generalisation` is the experiment that trains a network to produce
    them and then calls this.

    **Arguments:**

    - `ts`: record times, shape `(R,)`, increasing, `>= 0`.
    - `train_loss`, `test_loss`: the curves, shape `(R,)`.
    - `fit_level`, `test_level`: the two thresholds.

    **Returns:** `(t_fit, t_generalise, delay)`, scalars.
    """
    ts, train_loss, test_loss = (jnp.asarray(a) for a in (ts, train_loss, test_loss))
    check_shape("train_loss", train_loss, ts.shape)
    check_shape("test_loss", test_loss, ts.shape)
    t_fit, t_gen = (
        first_crossing(ts, y, jnp.asarray(level, y.dtype), log_time=True)
        for y, level in ((train_loss, fit_level), (test_loss, test_level))
    )
    return t_fit, t_gen, t_gen - t_fit


class DelayResult(eqx.Module):
    r"""A delayed-generalisation run (`delayed_generalisation`).

    **Fields:**

    - `ts`: recorded steps, shape `(R,)`.
    - `train_loss`: the training loss (without the penalty), shape `(R,)`.
    - `test_loss`: the test loss, `test_task.loss(M)` at the recorded `M`,
      shape `(R,)`.
    - `fit_level`, `test_level`: the absolute thresholds used.
    - `t_fit`: first time `train_loss < fit_level`.
    - `t_generalise`: first time `test_loss < test_level`.
    - `delay`: `t_generalise - t_fit` (NaN if either is never reached).
    """

    ts: Float[Array, " R"]
    train_loss: Float[Array, " R"]
    test_loss: Float[Array, " R"]
    fit_level: Float[Array, ""]
    test_level: Float[Array, ""]
    t_fit: Float[Array, ""]
    t_generalise: Float[Array, ""]
    delay: Float[Array, ""]


def delayed_generalisation(
    structure: AbstractStructure,
    xs: Float[ArrayLike, "n ..."],
    ys: Float[ArrayLike, "n k"],
    test_task: Task,
    *,
    weight_decay: Float[ArrayLike, ""],
    learning_rate: Float[ArrayLike, ""],
    num_steps: int,
    key: PRNGKeyArray,
    init_scale: Float[ArrayLike, ""],
    width: int,
    optimizer: Callable | None = optax.adam,
    fit_threshold: float = 1e-3,
    test_threshold: float = 1e-2,
    num_records: int = 200,
) -> DelayResult:
    r"""Train on few samples with weight decay and measure how long after fitting
    the training data the network generalises.

    The network (the quadratic form of `structure`, `model=QuadraticForm()`) is
    trained from $W_0 = \sigma Z$ with `optimizer(learning_rate)` (Adam by
    default) on the L2-penalised objective
    $\frac1{2n}\sum_s |f(x_s) - y_s|^2 + \frac\lambda2 |W|^2$ (`nqfjax.train`).
    With fewer samples than parameters many `M` fit the data; the first one
    reached fits but does not generalise, and the penalty ($|W|^2 = \mathrm{Tr}
    M$) then moves the network slowly along the set of fits towards small trace
    (see the documentation's theory pages), so the test loss drops long after
    the training loss did, later the smaller $\lambda$ is. The test loss is the
    population loss `test_task.loss(M)` (for Gaussian inputs the closed form
    `gaussian_quadratic_task(cov, M_star)`). Thresholds are relative to the
    loss at `M = 0`: fitted when the training loss is below `fit_threshold`
    times $\tfrac1{2n}\sum_s |y_s|^2$, generalised when the test loss is below
    `test_threshold` times `test_task.y2 / 2`.

    This is the whole experiment (training, then the measurement); to measure
    the delay on curves you already have, call `generalisation_delay` on them.

    Traceable in `weight_decay`, `learning_rate`, `init_scale` and `key`, so
    `jax.vmap` and `nqfjax.sweep` map it over grids (the number of samples
    fixes shapes: one sweep per `n`).

    **Arguments:**

    - `structure`: the architecture (e.g. `QuadraticNet(d)`).
    - `xs`, `ys`: the training samples, shapes `(n, *input_shape)`, `(n, k)`.
    - `test_task`: a `Task` whose `loss(M)` is the test error.
    - `weight_decay`: $\lambda \ge 0$.
    - `learning_rate`: the optimizer's learning rate.
    - `num_steps`: steps (static).
    - `key`, `init_scale`, `width`: the random start $\sigma Z$, `Z` of shape
      `(p, width)`.
    - `optimizer`: an optax factory `lr -> GradientTransformation` (default
      `optax.adam`), or `None` for gradient descent.
    - `fit_threshold`, `test_threshold`: relative thresholds (defaults 1e-3, 1e-2).
    - `num_records`: about how many log-spaced records (default 200).

    **Returns:** a `DelayResult`.

    **Raises:** `ValueError` if `test_task.p != structure.p` (and as `train`).
    """
    if not isinstance(test_task, Task):
        raise ValueError(f"`test_task` must be a Task, got {type(test_task)}.")
    if test_task.p != structure.p:
        raise ValueError(
            f"`test_task.p` ({test_task.p}) must equal `structure.p` ({structure.p})."
        )
    res = train(
        structure,
        xs,
        ys,
        num_steps=num_steps,
        learning_rate=learning_rate,
        optimizer=optimizer,
        key=key,
        init_scale=init_scale,
        width=width,
        weight_decay=weight_decay,
        model=QuadraticForm(),
        num_records=num_records,
    )
    ys = jnp.asarray(ys, res.loss.dtype)
    test_loss = jax.vmap(test_task.loss)(res.M.astype(test_task.dtype))
    fit_level = fit_threshold * 0.5 * jnp.mean(jnp.sum(ys**2, axis=-1))
    test_level = test_threshold * 0.5 * test_task.y2
    t_fit, t_gen, delay = generalisation_delay(
        res.ts, res.loss, test_loss, fit_level, test_level
    )
    return DelayResult(
        ts=res.ts,
        train_loss=res.loss,
        test_loss=test_loss,
        fit_level=fit_level,
        test_level=test_level,
        t_fit=t_fit,
        t_generalise=t_gen,
        delay=delay,
    )


class DelayScaling(eqx.Module):
    r"""A power law `delay ~ c x^slope` fitted in log-log (`delay_scaling`).

    **Fields:** `slope` and its standard error `slope_err`, the prefactor `c`,
    and `n_points` used (finite, positive delays).
    """

    slope: Float[Array, ""]
    slope_err: Float[Array, ""]
    c: Float[Array, ""]
    n_points: int = eqx.field(static=True)

    def __call__(self, x: Float[ArrayLike, "*N"]) -> Float[Array, "*N"]:
        return self.c * jnp.asarray(x) ** self.slope


def delay_scaling(
    x: Float[ArrayLike, " N"], delay: Float[ArrayLike, " N"]
) -> DelayScaling:
    r"""Least-squares line through $(\ln x, \ln \text{delay})$: the exponent of
    `delay ~ c x^slope` with its standard error (from the residual scatter; 0
    with two points). Points with a non-finite or non-positive delay are left
    out. For the fit of a full curve with an offset and a floor, use
    `fit_power_law(x, delay)` (which fits `L_inf + c (x + x0)^-gamma`, so
    `gamma ~ -slope`). Runs eagerly.

    **Arguments:**

    - `x`: the hyperparameter values, shape `(N,)`, positive.
    - `delay`: the delays, shape `(N,)`.

    **Returns:** a `DelayScaling`.

    **Raises:** `ValueError` for fewer than two usable points or bad shapes.
    """
    x = np.asarray(x, np.float64)
    y = np.asarray(delay, np.float64)
    if x.ndim != 1 or y.shape != x.shape:
        raise ValueError(
            f"`x` and `delay` must be 1-D of equal length, got {x.shape}, {y.shape}."
        )
    ok = np.isfinite(x) & (x > 0) & np.isfinite(y) & (y > 0)
    if ok.sum() < 2:
        raise ValueError("Need at least two points with x > 0 and a finite delay > 0.")
    line = loglog_slope(x, y, ok)
    return DelayScaling(
        slope=jnp.asarray(line.slope),
        slope_err=jnp.asarray(line.slope_err),
        c=jnp.asarray(np.exp(line.intercept)),
        n_points=int(ok.sum()),
    )
