r"""What a schedule is designed and tuned on (the criteria of `schedules.py`):
the mean loss over the minibatch noise (`MeanLoss`, the moment equation
`sgd_moments`) or the typical run's loss (`TypicalLoss`, simulated SGD paths,
`sgd_paths`), and the stability edge each implies
(`stability_edge`).

The mean loss is dominated by rare runs: with small batches it blows up at a
learning rate several times below the one at which a typical run diverges, so
a design on it stays far from the real edge. The typical run's loss,
$\exp \mathbb E \ln L_T$ over the paths with a diverged path counted at the
divergence threshold, respects the edge where half of the runs diverge.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Float, PRNGKeyArray

from .._checks import check_key, static_int
from ..engines.sgd_divergence import check_minibatch, sgd_paths
from ..engines.sgd_moments import sgd_moments
from ..tasks.gaussian import GaussianQuadraticTask


class MeanLoss(eqx.Module):
    r"""Criterion: the mean final loss over the minibatch noise,
    $\mathbb E L_T$, from the moment equation (`sgd_moments`); infinite once
    the mean diverges. Cheap (one path, `O(T d^4)`) but pessimistic about the
    stability edge at small batches (the mean's heavy tails)."""

    def curve(self, task, learning_rates, batch_sizes, m0, model):
        """`(predicted loss (T + 1,), final (scalar), diverged fraction)`."""
        out = sgd_moments(task, learning_rates, batch_sizes, m0, **model)
        final = jnp.where(out.diverged, jnp.inf, out.final_loss)
        return out.loss, final, out.diverged.astype(out.loss.dtype)

    def objective(self, task, learning_rates, batch_sizes, m0, model):
        r"""$\ln \mathbb E L_T$ (differentiable; a diverged mean is frozen)."""
        out = sgd_moments(task, learning_rates, batch_sizes, m0, **model)
        return jnp.log(out.final_loss)


class TypicalLoss(eqx.Module):
    r"""Criterion: the typical run's final loss, $\exp \mathbb E \ln L_T$ over
    the runs that converge among `paths` simulated runs of the stochastic map
    (`sgd_paths`), under the constraint that at most `max_diverged` of them
    diverge (else the final loss is `inf`). The same noise, from `key`, for
    every schedule (common random numbers: comparisons between schedules are
    sharper than the paths' spread).

    **Attributes:**

    - `paths`: simulated runs (static int, default 256; the criterion's
      statistical error is about the paths' spread in $\ln L_T$ over
      $\sqrt{\rm paths}$, and a diverged fraction is resolved to
      $1/\text{paths}$).
    - `key`: the PRNG key of the noise (default `jax.random.key(0)`).
    - `max_diverged`: the largest acceptable fraction of diverged runs
      (default 0.05).
    - `minibatch`: the paths' minibatch gradient, `"sampled"` (default: real
      minibatches, SGD itself) or `"gaussian"` (its first two moments; its
      edge is 35-45% low at batches of 1-4), as in `sgd_paths`.
    - `max_samples`: the most samples a sampled step draws (default 64;
      larger batches take the Gaussian step).
    """

    paths: int = eqx.field(static=True, default=256)
    key: PRNGKeyArray | None = None
    max_diverged: float = eqx.field(static=True, default=0.05)
    minibatch: str = eqx.field(static=True, default="sampled")
    max_samples: int = eqx.field(static=True, default=64)

    def __check_init__(self):
        static_int("paths", self.paths)
        if self.key is not None:
            check_key(self.key)
        if not 0 <= self.max_diverged < 1:
            raise ValueError(
                f"`max_diverged` must be in [0, 1), got {self.max_diverged}."
            )
        check_minibatch(self.minibatch)
        static_int("max_samples", self.max_samples)

    def _run(self, task, learning_rates, batch_sizes, m0, model):
        out = sgd_paths(
            task,
            learning_rates,
            batch_sizes,
            m0,
            paths=self.paths,
            key=self.key,
            minibatch=self.minibatch,
            max_samples=self.max_samples,
            **model,
        )
        kept = ~out.diverged
        # the geometric mean over the runs that converge (all of them diverged:
        # the threshold)
        weight = kept / jnp.maximum(jnp.sum(kept), 1)
        log_loss = jnp.where(kept[:, None], jnp.log(out.loss), 0.0)
        mean_log = jnp.where(jnp.any(kept), weight @ log_loss, jnp.log(out.threshold))
        return mean_log, out.diverged_fraction

    def curve(self, task, learning_rates, batch_sizes, m0, model):
        """`(typical loss (T + 1,), final (scalar), diverged fraction)`."""
        mean_log, frac = self._run(task, learning_rates, batch_sizes, m0, model)
        typical = jnp.exp(mean_log)
        final = jnp.where(frac <= self.max_diverged, typical[-1], jnp.inf)
        return typical, final, frac

    def objective(self, task, learning_rates, batch_sizes, m0, model):
        r"""$\mathbb E \ln L_T$ over the converged paths, plus
        $10\,(f - f_{\max})$ where the diverged fraction $f$ exceeds
        `max_diverged` (a value, not a gradient: the constraint)."""
        mean_log, frac = self._run(task, learning_rates, batch_sizes, m0, model)
        excess = jax.lax.stop_gradient(jnp.maximum(frac - self.max_diverged, 0.0))
        return mean_log[-1] + 10 * excess


Criterion = MeanLoss | TypicalLoss


def check_criterion(criterion) -> Criterion:
    """`criterion`, default `TypicalLoss()`; `ValueError` for anything else."""
    if criterion is None:
        return TypicalLoss()
    if not isinstance(criterion, MeanLoss | TypicalLoss):
        raise ValueError(
            "`criterion` must be MeanLoss() or TypicalLoss(...), got "
            f"{type(criterion).__name__}."
        )
    return criterion


def stability_edge(
    task: GaussianQuadraticTask,
    batch_size: float,
    m0: Float[ArrayLike, " d"],
    *,
    num_steps: int,
    criterion: Criterion | None = None,
    learning_rate_bounds: tuple[float, float] = (1e-3, 10.0),
    iterations: int = 12,
    **model,
) -> Float[Array, ""]:
    r"""The constant learning rate at which `criterion`'s runs diverge within
    `num_steps` steps: half of the paths for `TypicalLoss` (default), the
    mean for `MeanLoss`; the edge a design on that criterion respects.

    Bisection in $\log\eta$ (`iterations` steps from `learning_rate_bounds`,
    a relative resolution $(\eta_{\rm hi}/\eta_{\rm lo})^{2^{-\rm iterations}}$,
    0.3% by default), each step one evaluation of the criterion at constant
    batches `batch_size` (the same noise every time). `**model`: as for
    `sgd_moments` (`noise_variance`, `samples`, `num_samples`).

    **Returns:** the edge, a scalar.

    **Raises:** `ValueError` for bad arguments (as `sgd_moments`), or when
    `learning_rate_bounds` does not bracket the edge.
    """
    T = static_int("num_steps", num_steps)
    criterion = check_criterion(criterion)
    iterations = static_int("iterations", iterations, minimum=0)
    lo, hi = (float(v) for v in learning_rate_bounds)
    if not 0 < lo < hi:
        raise ValueError(
            f"`learning_rate_bounds` must be 0 < lo < hi, got {learning_rate_bounds}."
        )
    b = jnp.full(T, float(batch_size))

    def unstable(eta):
        _, _, frac = criterion.curve(task, jnp.full(T, eta), b, m0, model)
        return float(frac) >= 0.5

    if unstable(lo) or not unstable(hi):
        raise ValueError(
            "`learning_rate_bounds` must bracket the edge: stable at the lower "
            f"bound and unstable at the upper one, got {learning_rate_bounds}."
        )
    for _ in range(iterations):
        mid = float(np.sqrt(lo * hi))
        lo, hi = (lo, mid) if unstable(mid) else (mid, hi)
    return jnp.asarray(np.sqrt(lo * hi))
