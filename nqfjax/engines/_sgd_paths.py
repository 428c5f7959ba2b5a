r"""Simulated paths of minibatch SGD on the quadratic network, for a schedule
$(\eta_t, b_t)$: the typical run, not the mean one.

Each path carries the whole of $M$ in the mode basis and takes the exact SGD
step $M' = (I - 2\eta\hat G)\,M\,(I - 2\eta\hat G)$ (it closes on $M$: SGD on
$W$ with $M = W W^\top$). Two minibatch gradients $\hat G$:

- sampled (`sampled_step`, the default of `sgd_paths`): a real minibatch of
  $k = \lfloor b \rfloor$ inputs $x_s$ in the mode basis with labels $y_s$,
  fresh Gaussian samples $x_s \sim N(0, \mathrm{diag}\,s)$,
  $y_s = \sum_k \mu_k x_{sk}^2 + \xi_s$ (`population_draw`, online SGD) or $k$
  distinct rows of the dataset as `train` draws them (`dataset_draw`), and
  $$\hat G = G + r_b\,(\hat G_k - G),\qquad
  \hat G_k = \frac1k \sum_s e_s\, x_s x_s^\top,\quad e_s = x_s^\top M x_s - y_s,
  \quad r_b = \sqrt{c_b / c_k},$$
  $G$ the mean gradient below: at an integer $b$ (and draws from the data the
  run draws from) $r_b = 1$ and $\hat G = \hat G_k$, SGD exactly; a real $b$
  keeps the variance $c_b$ and makes the map differentiable in $b$; without a
  dataset but with a finite `num_samples`, $r_b$ is the finite-population
  factor. Past `max_samples` (of `sgd_paths`) a step takes the Gaussian
  gradient (at large batches the minibatch mean is Gaussian to
  $O(1/\sqrt b)$).
- Gaussian (`gaussian_step`): the first two moments only,
  $$\hat G = G + \sqrt{c_b}\,N,\qquad G = \mathrm{diag}(F_4 m - c_y) + 2 F_4 \circ X,$$
  $m$ the diagonal of $M$, $X$ its off-diagonal part, $N$ symmetric: its
  diagonal $N(0, E2 - g g^\top)$ (correlated), its off-diagonal entries
  independent, $N_{kl} \sim N(0, E2_{kl} - G_{kl}^2)$, with
  $E2_{kl} = \mathbb E[e^2 x_k^2 x_l^2]$ at second moments $m m^\top + 2 X \circ X$.
  At small batches the real gradient is heavy-tailed with a smaller typical
  kick, and this map diverges early (35-45% low edges at $b \le 4$).

$c_b = \frac{n-b}{b(n-1)}$ ($1/b$ for fresh samples). The loss of a path is
$L = \tfrac12(m^\top F_4 m - 2 c_y^\top m + \mathbb E y^2) + \sum_{k \ne l}
(F_4)_{kl} X_{kl}^2$ (exact for data symmetric under every $x_k \to -x_k$, as
the moment equation). A path diverges once its loss is non-finite or above the
threshold; it is then frozen (so gradients stay finite).
"""

import jax
import jax.numpy as jnp

from ._train_loop import sample_without_replacement
from .sgd_moments import (
    Moments,
    diagonal_loss,
    noise_factor,
    residual_gradient,
    residual_moment,
)


def path_loss(mom: Moments, M):
    """The full-data loss of one path's `M` (in the mode basis):
    `(m^T F4 m - 2 cy.m + y2) / 2 + sum_{k != l} F4_kl M_kl^2`."""
    m = jnp.diagonal(M)
    off = M - jnp.diag(m)
    return diagonal_loss(mom, m) + jnp.sum(mom.F4 * off**2)


def mean_gradient(mom: Moments, M):
    """`G = diag(F4 m - cy) + 2 F4 * X`, shape `(d, d)`: the mean minibatch
    gradient at `M` (`m` its diagonal, `X` the rest)."""
    m = jnp.diagonal(M)
    return jnp.diag(residual_gradient(mom, m)) + 2 * mom.F4 * (M - jnp.diag(m))


def gaussian_step(mom: Moments, M, eta, c, z):
    """One step `M -> (I - 2 eta G_hat) M (I - 2 eta G_hat)` with the Gaussian
    gradient of variance factor `c = c_b`; `z` shape `(d, d)` standard normal."""
    d = M.shape[0]
    eye = jnp.eye(d, dtype=M.dtype)
    m = jnp.diagonal(M)
    off = M - jnp.diag(m)
    g = residual_gradient(mom, m)
    G = jnp.diag(g) + 2 * mom.F4 * off
    E2 = residual_moment(mom, m, jnp.outer(m, m) + 2 * off**2)
    # the diagonal's covariance is PSD but singular at a noiseless minimum and a
    # difference of O(1) terms that rounds: a jitter at their rounding level
    scale = jnp.trace(mom.Y8) + jnp.abs(jnp.trace(E2))
    jitter = 100 * jnp.finfo(M.dtype).eps * scale
    chol = jnp.linalg.cholesky(E2 - jnp.outer(g, g) + jitter * eye)
    noise_diag = chol @ jnp.diagonal(z)
    sd_off = jnp.sqrt(jnp.maximum(E2 - G**2, 0.0))
    upper = jnp.triu(z, 1) * sd_off
    noise = jnp.diag(noise_diag) + upper + upper.T
    P = eye - 2 * eta * (G + jnp.sqrt(c) * noise)
    return P @ M @ P


def population_draw(key, k: int, s, mu, sigma2):
    """`k` fresh samples in the mode basis: `x ~ N(0, diag s)` shape `(k, d)`,
    `y = x^2 . mu + xi`, `xi ~ N(0, sigma2)`, shape `(k,)`."""
    k1, k2 = jax.random.split(key)
    x = jax.random.normal(k1, (k, s.shape[0]), s.dtype) * jnp.sqrt(s)[None, :]
    y = x**2 @ mu + jnp.sqrt(sigma2) * jax.random.normal(k2, (k,), s.dtype)
    return x, y


def dataset_draw(key, k: int, xs, ys):
    """`k` distinct rows of the dataset `xs` `(n, d)` (mode basis), `ys` `(n,)`,
    uniformly, as `train` draws a minibatch."""
    idx = sample_without_replacement(key, xs.shape[0], k)
    return xs[idx], ys[idx]


def sampled_step(mom: Moments, M, eta, x, y, count, ratio):
    r"""One step `M -> (I - 2 eta G_hat) M (I - 2 eta G_hat)` with
    `G_hat = G + ratio (G_k - G)`, `G_k` the mean of `e_s x_s x_s^T` over the
    first `count` rows of `x` `(K, d)`, `y` `(K,)` (`count <= K`, traced)."""
    e = jnp.einsum("si,ij,sj->s", x, M, x) - y
    w = (jnp.arange(x.shape[0]) < count) / count
    G_k = (x * (w * e)[:, None]).T @ x
    G = mean_gradient(mom, M)
    G_hat = G + ratio * (G_k - G)
    P = jnp.eye(M.shape[0], dtype=M.dtype) - 2 * eta * G_hat
    return P @ M @ P


def sampler(mom: Moments, n, draw, max_draws: int, dataset: bool):
    """The step `(M, eta_t, b_t, key) -> M'` of the sampled map: `draw(key, K)`
    gives `K = max_draws` samples, the first `floor(b_t)` of them used; past
    `max_draws` the Gaussian step (`n`: the dataset size, `None` for fresh
    samples; `dataset`: whether `draw` takes rows of that dataset)."""

    def step(M, eta, b, key):
        def small(M):
            x, y = draw(key, max_draws)
            count = jnp.floor(b)
            c_k = noise_factor(count, n if dataset else None)
            # r_b = 1 where c_k = 0 (the full dataset, c_b = 0 too); safe sqrt
            ok = c_k > 0
            c_b = jnp.where(ok, noise_factor(b, n), 1.0)
            ratio = jnp.where(ok, jnp.sqrt(c_b / jnp.where(ok, c_k, 1.0)), 1.0)
            return sampled_step(mom, M, eta, x, y, count, ratio)

        def large(M):
            z = jax.random.normal(jax.random.fold_in(key, 1), M.shape, M.dtype)
            return gaussian_step(mom, M, eta, noise_factor(b, n), z)

        return jax.lax.cond(b < max_draws + 1, small, large, M)

    return jax.checkpoint(step)


def simulate_paths(mom: Moments, step, eta, bs, m0, inputs, threshold):
    """Run the paths: `eta`, `bs` shape `(T,)`; `inputs` (a pytree, leaves of
    shape `(P, T, ...)`) gives one path's step its randomness:
    `step(M, eta_t, b_t, input_t) -> M'`. Returns `(loss (P, T + 1),
    diverged_at (P,))`, -1 where a path did not diverge (its loss frozen from
    then on)."""
    M0 = jnp.diag(m0)
    L0 = path_loss(mom, M0)

    def run(path_inputs):
        def body(carry, xs):
            M, L, first = carry
            t, eta_t, b_t, input_t = xs
            M_new = step(M, eta_t, b_t, input_t)
            L_new = path_loss(mom, M_new)
            bad = ~jnp.isfinite(L_new) | (L_new > threshold) | (first >= 0)
            first = jnp.where((first < 0) & bad, t + 1, first)
            M = jnp.where(bad, M, M_new)
            L = jnp.where(bad, L, L_new)
            return (M, L, first), L

        ts = jnp.arange(eta.shape[0], dtype=jnp.int32)
        init = (M0, L0, jnp.asarray(-1, jnp.int32))
        (_, _, first), L = jax.lax.scan(body, init, (ts, eta, bs, path_inputs))
        return jnp.concatenate([L0[None], L]), first

    return jax.vmap(run)(inputs)
