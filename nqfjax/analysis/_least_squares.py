"""Robust least squares in log loss shared by the curve fits (private)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import Array

from .._checks import check_ndim, check_shape, finite, increasing


# --------------------------------------------------------------------------------
# helpers shared by both fits


def _host_curve(ts, loss) -> tuple[np.ndarray, np.ndarray]:
    """Validate an observed loss curve (concrete arrays) and return it as float64
    NumPy arrays."""
    t = np.asarray(ts, dtype=np.float64)
    y = np.asarray(loss, dtype=np.float64)
    check_ndim("ts", t, 1, "a 1-D array of times")
    check_shape("loss", y, t.shape)
    increasing("ts", t)
    finite("loss", y)
    if np.any(t < 0):
        raise ValueError("`ts` must be >= 0 (time counts training steps).")
    return t, y


def _huber(x, delta):
    ax = jnp.abs(x)
    return jnp.where(ax <= delta, 0.5 * x**2, delta * (ax - 0.5 * delta))


def _value_and_jacfwd(f, x):
    """`f(x)` and its Jacobian `(len(f(x)), len(x))` in forward mode, sharing the
    primal computation (one tangent per parameter, batched)."""
    basis = jnp.eye(x.shape[0], dtype=x.dtype)
    push = lambda v: jax.jvp(f, (x,), (v,))
    y, J = jax.vmap(push, out_axes=(None, -1))(basis)
    return y, J


class _Best(eqx.Module):
    theta: Array
    value: Array
    res: Array
    J: Array


def _least_squares(residual_fn, weights, delta, theta, adam_steps, lm_steps, lr):
    r"""Minimise the weighted mean Huber loss of `residual_fn(theta)`:
    `adam_steps` of Adam (optax, cosine decay) to find the basin, then `lm_steps`
    of Levenberg-Marquardt (iteratively reweighted Gauss-Newton) to converge it
    (first-order steps crawl along flat valleys, e.g. `L_inf -> 0`).

    One scan; every iteration evaluates the residuals and their Jacobian once, in
    forward mode (`jax.jvp`, one tangent per parameter), at the current candidate:
    Adam's gradient is $J^\top w \psi(\rho)$ ($\psi$ the Huber influence), and
    Levenberg-Marquardt decides to accept or reject the candidate at the next
    evaluation, so a diffrax solve appears once in the compiled program. A
    candidate with non-finite residuals (a failed solve) is never accepted.

    Returns the best point seen, with its objective, residuals and Jacobian."""
    wsum = jnp.sum(weights)

    def evaluate(th):
        res, J = _value_and_jacfwd(residual_fn, th)
        value = jnp.sum(weights * _huber(res, delta)) / wsum
        ok = jnp.isfinite(value) & jnp.all(jnp.isfinite(J))
        return res, J, jnp.where(ok, value, jnp.inf)

    schedule = optax.cosine_decay_schedule(lr, max(adam_steps, 1), alpha=1e-2)
    opt = optax.adam(schedule)

    def lm_candidate(best, mu):
        influence = weights * jnp.clip(best.res, -delta, delta)  # w * psi(res)
        irls = weights * jnp.where(
            jnp.abs(best.res) <= delta, 1.0, delta / jnp.abs(best.res)
        )
        H = best.J.T @ (irls[:, None] * best.J)
        g = best.J.T @ influence
        scale = jnp.diag(H) + 1e-12 * jnp.trace(H) + jnp.finfo(H.dtype).tiny
        return best.theta - jnp.linalg.solve(H + mu * jnp.diag(scale), g)

    def step(carry, i):
        cand, best, mu, state = carry
        res, J, value = evaluate(cand)
        improved = value < best.value
        best = jax.tree.map(
            lambda new, old: jnp.where(improved, new, old),
            _Best(cand, value, res, J),
            best,
        )
        # Adam phase: a step from the candidate (from the best point if the
        # candidate failed).
        grad = J.T @ (weights * jnp.clip(res, -delta, delta)) / wsum
        finite = jnp.isfinite(value)
        updates, new_state = opt.update(jnp.where(finite, grad, 0.0), state, cand)
        adam_next = jnp.where(finite, optax.apply_updates(cand, updates), best.theta)
        # Levenberg-Marquardt phase: damping down after an accepted candidate, up
        # after a rejected one; the next candidate always starts from the best.
        in_lm = i >= adam_steps
        mu = jnp.where(
            in_lm & (i > adam_steps), jnp.where(improved, mu / 3, mu * 4), mu
        )
        lm_next = lm_candidate(best, mu)
        nxt = jnp.where(in_lm, lm_next, adam_next)
        state = jax.tree.map(lambda a, b: jnp.where(in_lm, b, a), new_state, state)
        return (nxt, best, mu, state), None

    res0 = residual_fn(theta)
    inf = jnp.asarray(jnp.inf, theta.dtype)
    best = _Best(theta, inf, jnp.zeros_like(res0), jnp.zeros(res0.shape + theta.shape))
    carry = (theta, best, jnp.asarray(1e-3, theta.dtype), opt.init(theta))
    total = adam_steps + lm_steps + 1  # the last evaluation only scores
    (_, best, _, _), _ = jax.lax.scan(step, carry, jnp.arange(total))
    return best


def _laplace_cov(best: _Best, weights):
    r"""Gauss-Newton covariance $s^2 (J^\top W J)^{+}$ at the optimum, with
    $s^2 = \sum w \rho^2 / (n - k)$ (pseudo-inverse: an unidentifiable
    direction, such as `L_inf` at zero, does not inflate the others)."""
    n = jnp.sum(weights)
    s2 = jnp.sum(weights * best.res**2) / jnp.maximum(n - best.theta.shape[0], 1)
    H = best.J.T @ (weights[:, None] * best.J)
    evals, evecs = jnp.linalg.eigh(H)
    keep = evals > 1e-12 * jnp.max(evals)
    inv = jnp.where(keep, 1.0 / jnp.where(keep, evals, 1.0), 0.0)
    return s2 * (evecs * inv[None, :]) @ evecs.T
