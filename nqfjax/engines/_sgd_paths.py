r"""Simulated paths of the stochastic mode map of minibatch SGD on the quadratic
network, for a schedule $(\eta_t, b_t)$: the typical run, not the mean one.

Each path carries the whole of $M$ in the mode basis (diagonal $m$,
off-diagonal part $X$) and takes the exact SGD step with a Gaussian minibatch
gradient of the right mean and covariance:

$$M' = (I - 2\eta\hat G)\,M\,(I - 2\eta\hat G),\qquad
\hat G = G + \sqrt{c_b}\,N,\qquad G = \mathrm{diag}(F_4 m - c_y) + 2 F_4 \circ X,$$

$N$ symmetric: its diagonal $N(0, E2 - g g^\top)$ (correlated), its
off-diagonal entries independent, $N_{kl} \sim N(0, E2_{kl} - G_{kl}^2)$, with
$E2_{kl} = \mathbb E[e^2 x_k^2 x_l^2]$ at second moments $m m^\top + 2 X \circ X$
and $c_b = \frac{n-b}{b(n-1)}$. The loss of a path is
$L = \tfrac12(m^\top F_4 m - 2 c_y^\top m + \mathbb E y^2) + \sum_{k \ne l}
(F_4)_{kl} X_{kl}^2$. A path diverges once its loss is non-finite or above the
threshold; it is then frozen (so gradients stay finite). Left out: the
minibatch gradient's law beyond its first two moments (at small batches its
tails are heavier and its typical kick smaller than the Gaussian's, so the
map diverges early at `b` of a few samples) and the correlations between the
off-diagonal entries of the noise.
"""

import jax
import jax.numpy as jnp

from .sgd_moments import Moments, noise_factor, residual_moment


def path_loss(mom: Moments, M):
    """The full-data loss of one path's `M` (in the mode basis):
    `(m^T F4 m - 2 cy.m + y2) / 2 + sum_{k != l} F4_kl M_kl^2`."""
    m = jnp.diagonal(M)
    off = M - jnp.diag(m)
    return 0.5 * (m @ mom.F4 @ m - 2 * mom.cy @ m + mom.y2) + jnp.sum(mom.F4 * off**2)


def _path_step(mom: Moments, M, eta, c, z):
    """One step `M -> (I - 2 eta G_hat) M (I - 2 eta G_hat)`, `z` shape `(d, d)`."""
    d = M.shape[0]
    eye = jnp.eye(d, dtype=M.dtype)
    m = jnp.diagonal(M)
    off = M - jnp.diag(m)
    g = mom.F4 @ m - mom.cy
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


def simulate_paths(mom: Moments, n, eta, bs, m0, noise, threshold):
    """Run the paths: `eta`, `bs` shape `(T,)`, `noise` shape `(P, T, d, d)`.
    Returns `(loss (P, T + 1), diverged_at (P,))`, -1 where a path did not
    diverge (its loss frozen from then on)."""
    c = noise_factor(bs, n)
    M0 = jnp.diag(m0)
    L0 = path_loss(mom, M0)

    def run(z):
        def step(carry, inputs):
            M, L, first = carry
            t, eta_t, c_t, z_t = inputs
            M_new = _path_step(mom, M, eta_t, c_t, z_t)
            L_new = path_loss(mom, M_new)
            bad = ~jnp.isfinite(L_new) | (L_new > threshold) | (first >= 0)
            first = jnp.where((first < 0) & bad, t + 1, first)
            M = jnp.where(bad, M, M_new)
            L = jnp.where(bad, L, L_new)
            return (M, L, first), L

        ts = jnp.arange(eta.shape[0], dtype=jnp.int32)
        init = (M0, L0, jnp.asarray(-1, jnp.int32))
        (_, _, first), L = jax.lax.scan(step, init, (ts, eta, c, z))
        return jnp.concatenate([L0[None], L]), first

    return jax.vmap(run)(noise)
