r"""The typical minibatch SGD run on the quadratic network: where it diverges
(`sgd_divergence_boundary`, the largest learning rate at which at most half of
the runs diverge, from a stochastic map of the Lotka-Volterra modes), and its
loss under a schedule (`sgd_paths`, simulated SGD paths of the whole of $M$
with real minibatches, or a Gaussian minibatch gradient,
`nqfjax/engines/_sgd_paths.py`).

The mean-loss moment equation (`sgd_moments`) says where the *mean* loss over
the minibatches blows up; that mean is dominated by rare runs, and it blows up at
a learning rate well below the one at which a typical run does (30-45% below at
batch sizes 16-64). Nor is the typical run's divergence the loss of linear
stability of the minimum: full-batch gradient descent past
$\eta_{\rm flip} = 1/(2\lambda_{\max})$, $\lambda_{\max}$ the top eigenvalue of
$\mathrm{diag}(\hat m)\,F_4$ at the minimum $\hat m$, settles on a bounded
period-2 orbit and then a bounded chaotic one; it diverges only once that orbit
reaches the far, unstable fixed point of the map (a boundary crisis; for one
mode at exactly $2\eta_{\rm flip}$). Minibatch noise kicks the orbit across
that point earlier. So the model keeps the nonlinear map and its noise, and
counts runs:

$$m \leftarrow (1 - 2\eta\,\hat g)^2 \odot m,\qquad
\hat g = g(m) + \sqrt{c_b}\;\Sigma(m)^{1/2} z,\quad z \sim N(0, I_d),$$

with $g_k = \mathbb E[e\,x_k^2]$ and $\Sigma_{kl} = \mathbb E[e^2 x_k^2 x_l^2]
- g_k g_l$ the covariance of one sample's gradient at $M = \mathrm{diag}(m)$,
$c_b = \frac{n-b}{b(n-1)}$ (draws without replacement from $n$ samples; $1/b$
for $n = \infty$). The modes are those of the task (a common eigenbasis of the
input covariance and the teacher); the minibatch gradient's off-diagonal part
and the fluctuations it causes off the diagonal are left out (the map stays on
diagonal $M$), and its law is replaced by a Gaussian with the right mean and
covariance. A run diverges, as in `train`, once its loss is non-finite or above
`divergence_factor` times $\max(L_0, L(M = 0))$. The fraction $f(\eta)$ of
`paths` simulated runs that diverge within `num_steps` steps rises from 0 to 1
with $\eta$; the boundary is where it crosses 1/2, found by bisection in
$\log\eta$ with the same noise at every $\eta$ (common random numbers), so that
$f$ is a step function of $\eta$ alone. Full batch ($c_b = 0$) is gradient
descent on the modes, exactly. See the documentation's theory page on training
methods.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Bool, Float, Int, PRNGKeyArray

from .._checks import (
    check_key,
    check_shape,
    error_if,
    is_concrete,
    positive,
    static_int,
)
from ..tasks.gaussian import GaussianQuadraticTask
from ._sgd_paths import (
    dataset_draw,
    gaussian_step,
    path_loss,
    population_draw,
    sampler,
    simulate_paths,
)
from .sgd_moments import (
    Moments,
    check_batch_sizes,
    check_divergence_factor,
    diagonal_loss,
    noise_factor,
    residual_gradient,
    residual_moment,
    schedule_inputs,
    task_modes,
    task_moments,
)


def sgd_divergence_boundary(
    task: GaussianQuadraticTask,
    batch_size: Float[ArrayLike, ""],
    m0: Float[ArrayLike, " d"],
    *,
    num_steps: int,
    noise_variance: Float[ArrayLike, ""] = 0.0,
    samples: tuple[ArrayLike, ArrayLike] | None = None,
    num_samples: int | None = None,
    paths: int = 512,
    key: PRNGKeyArray | None = None,
    learning_rate_bounds: tuple[float, float] | None = None,
    iterations: int = 20,
    divergence_factor: float = 1e4,
) -> Float[Array, ""]:
    r"""Predict the largest constant learning rate at which at most half of the
    minibatch SGD runs on the quadratic network diverge within `num_steps` steps
    (the typical run's divergence boundary), from the stochastic mode map of the
    module docstring.

    The training it predicts is the one `sgd_moments` predicts the mean of:
    `train(QuadraticNet(d), xs, ys, W0=W0, learning_rate=eta,
    batch_size=batch_size, num_steps=num_steps)` from $W_0 W_0^\top$ diagonal in
    the task's mode basis with diagonal `m0`; a run counts as diverged as in
    `train`. With the full batch (`batch_size = num_samples`) the map is
    gradient descent on the modes and the boundary is gradient descent's.

    The boundary is $\eta_\star$ with $f(\eta_\star) = 1/2$, $f(\eta)$ the
    fraction of `paths` simulated runs that diverge, by `iterations` bisection
    steps in $\log\eta$ from `learning_rate_bounds` (to a relative resolution
    $(\eta_{\rm hi}/\eta_{\rm lo})^{2^{-\rm iterations}}$); its statistical error
    is about $0.5 / (\sqrt{\rm paths}\; f'(\eta_\star))$. One jitted program of
    `iterations * num_steps` steps of `paths` runs, `O(d^4)` work each.

    **Arguments:**

    - `task`: a `gaussian_quadratic_task` whose covariance commutes with
      `M_star`.
    - `batch_size`: $b \ge 1$ (a real number: only $c_b$ enters; `<= num_samples`).
    - `m0`: the initial mode amplitudes, shape `(d,)`, positive, in the basis
      `sgd_moments` returns (`SGDMoments.basis`).
    - `num_steps`: the number of steps a run has to diverge in (static int).
    - `noise_variance`: $\sigma^2 \ge 0$ of the label noise (default 0).
    - `samples`: `(xs, ys)`, shapes `(n, d)` and `(n,)` or `(n, 1)`: the moments
      of this dataset instead of the Gaussian closed forms, as in
      `sgd_moments` (`noise_variance` is then ignored; `num_samples` defaults
      to `n`).
    - `num_samples`: the dataset size minibatches are drawn from without
      replacement (static int); `None` for fresh samples.
    - `paths`: how many runs to simulate (static int, default 512).
    - `key`: the PRNG key of the simulated noise (default `jax.random.key(0)`).
    - `learning_rate_bounds`: `(lo, hi)`, a learning rate at which fewer than
      half of the runs diverge and one at which at least half do. Default
      $(\eta_{\rm flip}/8,\; 4\eta_{\rm flip})$ with
      $\eta_{\rm flip} = 1/(2\lambda_{\max})$ gradient descent's stability limit
      at the minimum (the boundary of gradient descent lies between
      $\eta_{\rm flip}$ and about $2\eta_{\rm flip}$; noise lowers it).
    - `iterations`: bisection steps (static int, default 20).
    - `divergence_factor`: as in `train` (default `1e4`).

    **Returns:** the predicted boundary $\eta_\star$, a scalar.

    **Raises:** `ValueError` for a task that `sgd_moments` rejects, bad shapes,
    a non-positive `m0`, `batch_size` outside $[1, n]$, non-integer `paths`,
    `num_steps` or `iterations`, and (also under `jit`, through
    `eqx.error_if`) when `learning_rate_bounds` does not bracket the boundary.
    """
    U, s_np, mu_np = task_modes(task)
    d = s_np.shape[0]
    m0 = jnp.asarray(m0)
    b = jnp.asarray(batch_size)
    dtype = jnp.result_type(m0, b, task.covariance.dtype, float)
    check_shape("m0", m0, (d,))
    check_shape("batch_size", b, ())
    m0 = positive("m0", m0.astype(dtype))
    num_steps = static_int("num_steps", num_steps)
    paths = static_int("paths", paths)
    iterations = static_int("iterations", iterations, minimum=0)
    factor = check_divergence_factor(divergence_factor)
    mom, n = task_moments(U, s_np, mu_np, noise_variance, samples, num_samples, dtype)
    b = check_batch_sizes(b.astype(dtype), n)
    if learning_rate_bounds is not None:
        bounds = jnp.asarray(learning_rate_bounds, dtype)
        check_shape("learning_rate_bounds", bounds, (2,))
        bounds = positive("learning_rate_bounds", bounds)
    else:
        bounds = None
    key = jax.random.key(0) if key is None else key
    return _boundary(mom, n, b, m0, key, bounds, paths, num_steps, iterations, factor)


@eqx.filter_jit
def _boundary(mom, n, b, m0, key, bounds, paths, num_steps, iterations, factor):
    c = noise_factor(b, n)
    if bounds is None:
        flip = _flip_learning_rate(mom)
        bounds = jnp.stack([flip / 8, 4 * flip])
    noise = jax.random.normal(key, (paths, num_steps, m0.shape[0]), m0.dtype)
    return _bisect(mom, c, m0, noise, bounds, iterations, factor)


def _flip_learning_rate(mom: Moments):
    """$1/(2\\lambda_{\\max})$, $\\lambda_{\\max}$ the top eigenvalue of
    $\\mathrm{diag}(\\hat m) F_4$ at the least-squares minimum $F_4 \\hat m =
    c_y$ (modes with $\\hat m_k < 0$, which the network cannot reach, set to 0):
    where the full-batch map's minimum turns unstable."""
    m_hat = jnp.maximum(jnp.linalg.solve(mom.F4, mom.cy), 0.0)
    r = jnp.sqrt(m_hat)
    return 1.0 / (2 * jnp.linalg.eigvalsh(r[:, None] * mom.F4 * r[None, :])[-1])


def _diverged_fraction(mom, c, m0, noise, eta, factor):
    """The fraction of the runs (one per row of `noise`, `(paths, T, d)`) whose
    loss leaves `factor * max(L(m0), L(0))` within `T` steps."""
    threshold = factor * jnp.maximum(
        diagonal_loss(mom, m0), diagonal_loss(mom, jnp.zeros_like(m0))
    )

    d = m0.shape[0]
    F8_trace = jnp.einsum("ijkk->ij", mom.F8)

    def run(z):
        def step(carry, z_t):
            m, out = carry
            g = residual_gradient(mom, m)
            mm = jnp.outer(m, m)
            cov = residual_moment(mom, m, mm) - jnp.outer(g, g)
            # the covariance is PSD, but singular at a noiseless minimum, and it
            # is a difference of O(1) terms that rounds: factor it (Cholesky, ten
            # times cheaper than eigh here) with a jitter at the rounding level
            # of those terms, tr(Y8) + tr(E[(x^T M x)^2 x x^T]) (they bound the
            # cross term)
            scale = jnp.trace(mom.Y8) + jnp.sum(mm * F8_trace)
            jitter = 100 * jnp.finfo(m.dtype).eps * scale
            chol = jnp.linalg.cholesky(cov + jitter * jnp.eye(d, dtype=m.dtype))
            g_hat = g + jnp.sqrt(c) * (chol @ z_t)
            new = (1 - 2 * eta * g_hat) ** 2 * m
            L = diagonal_loss(mom, new)
            out = out | ~jnp.isfinite(L) | (L > threshold)
            # a diverged run is frozen, so nothing overflows
            return (jnp.where(out, m, new), out), None

        (_, out), _ = jax.lax.scan(step, (m0, jnp.asarray(False)), z)
        return out

    return jnp.mean(jax.vmap(run)(noise))


def _bisect(mom, c, m0, noise, bounds, iterations, factor):
    # one loop, one call of the simulation (compiled once): passes 0 and 1
    # evaluate the bounds, the rest bisect in log eta
    def body(i, state):
        lo, hi, ok = state
        log_eta = jnp.where(i == 0, lo, jnp.where(i == 1, hi, (lo + hi) / 2))
        up = _diverged_fraction(mom, c, m0, noise, jnp.exp(log_eta), factor) >= 0.5
        ok = ok & jnp.where(i == 0, ~up, jnp.where(i == 1, up, True))
        bisect = i >= 2
        lo = jnp.where(bisect & ~up, log_eta, lo)
        hi = jnp.where(bisect & up, log_eta, hi)
        return lo, hi, ok

    state = (jnp.log(bounds[0]), jnp.log(bounds[1]), jnp.asarray(True))
    lo, hi, ok = jax.lax.fori_loop(0, iterations + 2, body, state)
    eta = jnp.exp((lo + hi) / 2)
    return error_if(
        eta,
        ~ok,
        "`learning_rate_bounds` must bracket the boundary: fewer than half of the "
        "runs diverge at the lower bound and at least half at the upper one.",
    )


class SGDPaths(eqx.Module):
    r"""What `sgd_paths` returns: simulated minibatch SGD runs on the quadratic
    network under a schedule.

    **Attributes:**

    - `loss`: each path's full-data loss after `0, 1, ..., T` steps, shape
      `(paths, T + 1)` (frozen at its last value once the path diverged).
    - `diverged_at`: the step at which each path diverged, -1 if it did not,
      shape `(paths,)`.
    - `threshold`: the divergence threshold, `divergence_factor` times
      $\max(L_0, L(M = 0))$ (scalar).
    - `basis`: the orthonormal mode basis, shape `(d, d)` (columns).
    """

    loss: Float[Array, "P T1"]
    diverged_at: Int[Array, " P"]
    threshold: Float[Array, ""]
    basis: Float[Array, "d d"]

    @property
    def diverged(self) -> Bool[Array, " P"]:
        """Whether each path diverged."""
        return self.diverged_at >= 0

    @property
    def diverged_fraction(self) -> Float[Array, ""]:
        """The fraction of the paths that diverged."""
        return jnp.mean(self.diverged.astype(self.loss.dtype))

    @property
    def typical_loss(self) -> Float[Array, " T1"]:
        r"""The typical loss after each step, $\exp \mathbb E_{\rm paths} \ln L_t$,
        shape `(T + 1,)`, a diverged path counted at `threshold` from its
        divergence on."""
        steps = jnp.arange(self.loss.shape[1])
        gone = self.diverged[:, None] & (steps[None, :] >= self.diverged_at[:, None])
        log_loss = jnp.where(gone, jnp.log(self.threshold), jnp.log(self.loss))
        return jnp.exp(jnp.mean(log_loss, axis=0))


def sgd_paths(
    task: GaussianQuadraticTask,
    learning_rates: Float[ArrayLike, " T"],
    batch_sizes: Float[ArrayLike, " T"],
    m0: Float[ArrayLike, " d"],
    *,
    noise_variance: Float[ArrayLike, ""] = 0.0,
    samples: tuple[ArrayLike, ArrayLike] | None = None,
    num_samples: int | None = None,
    paths: int = 256,
    key: PRNGKeyArray | None = None,
    divergence_factor: float = 1e4,
    minibatch: str = "sampled",
    max_samples: int = 64,
) -> SGDPaths:
    r"""Simulate `paths` minibatch SGD runs on the quadratic network under the
    schedule $(\eta_t, b_t)$, each the exact step on the whole of $M$:

    $$M \leftarrow (I - 2\eta_t \hat G)\, M\, (I - 2\eta_t \hat G),\qquad
    \hat G = \frac1{b_t}\sum_s e_s x_s x_s^\top \ \text{(sampled)}\quad\text{or}\quad
    K[M - M_\star] + \sqrt{c_{b_t}}\, N \ \text{(Gaussian)},$$

    (the module `nqfjax/engines/_sgd_paths.py` gives both). `"sampled"`
    draws real minibatches: fresh Gaussian inputs and labels of the task
    (online SGD), or, with `samples`, distinct rows of that dataset as `train`
    draws them; at integer batch sizes up to `max_samples` this is SGD
    (real batch sizes keep the variance $c_b = \frac{n-b}{b(n-1)}$, so that
    the paths are differentiable in them; larger batches take the Gaussian
    step). `"gaussian"` matches the gradient's first two moments only, and
    diverges early at batches of a few samples. Unlike the mean loss
    (`sgd_moments`, which heavy-tailed rare runs dominate), the paths give the
    typical run: `SGDPaths.typical_loss`, `diverged_fraction`. One jitted
    program, `O(paths T (max_samples d^2 + d^3))` work sampled,
    `O(paths T d^4)` Gaussian, differentiable in both sequences (the same
    draws, from `key`, for every schedule: common random numbers).

    **Arguments:** as for `sgd_moments` (`task` a `gaussian_quadratic_task`
    whose covariance commutes with `M_star`; `learning_rates` and
    `batch_sizes` shape `(T,)`; `m0` shape `(d,)` in the mode basis), and

    - `paths`: how many runs to simulate (static int, default 256).
    - `key`: the PRNG key of the simulated noise (default `jax.random.key(0)`).
    - `minibatch`: `"sampled"` (default) or `"gaussian"`.
    - `max_samples`: the most samples a sampled step draws (static int,
      default 64); larger batches take the Gaussian step.

    **Returns:** an `SGDPaths`.

    **Raises:** `ValueError` as `sgd_moments` does, and for a bad `paths`,
    `key`, `minibatch` or `max_samples`.
    """
    U, mom, n, eta, bs, m0, factor = schedule_inputs(
        task,
        learning_rates,
        batch_sizes,
        m0,
        noise_variance,
        samples,
        num_samples,
        divergence_factor,
    )
    dtype = eta.dtype
    paths = static_int("paths", paths)
    minibatch = check_minibatch(minibatch)
    max_samples = static_int("max_samples", max_samples)
    key = jax.random.key(0) if key is None else check_key(key)
    if minibatch == "gaussian":
        data, draws = None, 0
    else:
        draws = max_samples if n is None else min(max_samples, n)
        if is_concrete(bs):  # draw no more than the largest batch needs
            draws = min(draws, max(1, int(np.floor(float(jnp.max(bs))))))
        if samples is None:
            _, s, mu = task_modes(task)
            sigma2 = jnp.asarray(noise_variance, dtype)
            data = ("population", jnp.asarray(s, dtype), jnp.asarray(mu, dtype), sigma2)
        else:
            xs, ys = samples
            xs = jnp.asarray(xs, dtype) @ jnp.asarray(U, dtype)
            draws = min(draws, xs.shape[0])
            data = ("dataset", xs, jnp.asarray(ys, dtype).reshape(-1))
    loss, first, threshold = _paths(
        mom, n, eta, bs, m0, key, paths, factor, data, draws
    )
    return SGDPaths(loss, first, threshold, jnp.asarray(U, dtype))


def check_minibatch(minibatch) -> str:
    """`minibatch` if it is `"sampled"` or `"gaussian"`; else `ValueError`."""
    if not (isinstance(minibatch, str) and minibatch in ("sampled", "gaussian")):
        raise ValueError(
            f"`minibatch` must be 'sampled' or 'gaussian', got {minibatch!r}."
        )
    return minibatch


@eqx.filter_jit
def _paths(mom, n, eta, bs, m0, key, paths, factor, data, draws):
    d = m0.shape[0]
    T = eta.shape[0]
    zero = jnp.zeros((d, d), m0.dtype)
    threshold = factor * jnp.maximum(path_loss(mom, jnp.diag(m0)), path_loss(mom, zero))
    if data is None:
        noise = jax.random.normal(key, (paths, T, d, d), m0.dtype)

        def step(M, eta_t, b_t, z):
            return gaussian_step(mom, M, eta_t, noise_factor(b_t, n), z)

        return (*simulate_paths(mom, step, eta, bs, m0, noise, threshold), threshold)
    if data[0] == "population":
        _, s, mu, sigma2 = data
        draw = lambda k, count: population_draw(k, count, s, mu, sigma2)  # noqa: E731
    else:
        _, xs, ys = data
        draw = lambda k, count: dataset_draw(k, count, xs, ys)  # noqa: E731
    step = sampler(mom, n, draw, draws, data[0] == "dataset")
    keys = jax.random.split(key, (paths, T))
    return (*simulate_paths(mom, step, eta, bs, m0, keys, threshold), threshold)
