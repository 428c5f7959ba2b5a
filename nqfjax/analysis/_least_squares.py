"""Robust least squares in log loss shared by the curve fits (a private module
whose names the fits import)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import optimistix as optx
from jaxtyping import Array

from .._checks import check_ndim, check_shape, finite, increasing


# --------------------------------------------------------------------------------
# helpers shared by both fits


def host_curve(ts, loss) -> tuple[np.ndarray, np.ndarray]:
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


def robust_sd(x: np.ndarray) -> float:
    r"""The standard deviation of `x` from its median absolute deviation,
    $1.4826\,\mathrm{median}|x - \mathrm{median}\,x|$ (a few outliers,
    such as the jumps at sharp drops, do not move it)."""
    return float(1.4826 * np.median(np.abs(x - np.median(x))))


def log_noise(ly: np.ndarray) -> float:
    r"""The scatter of `log L` about a smooth curve: $1.4826\,\mathrm{MAD}$ of the
    second differences over $\sqrt 6$ (white noise of standard deviation
    $\sigma$ has second differences of variance $6\sigma^2$; the median ignores
    the few large ones at sharp drops)."""
    if ly.size < 3:
        return 0.0
    d2 = ly[2:] - 2 * ly[1:-1] + ly[:-2]
    return robust_sd(d2) / float(np.sqrt(6))


def _block_levels(t: np.ndarray, ly: np.ndarray, n_blocks: int = 10):
    """Medians of `ly` over blocks of consecutive points, the blocks equally
    spaced in `log t` and merged until each holds at least 3 points (linear
    logging leaves the first decades sparse); and the number of points in each."""
    tpos = np.where(t > 0, t, np.min(t[t > 0]) if np.any(t > 0) else 1.0)
    edges = np.linspace(np.log(tpos[0]), np.log(tpos[-1]), n_blocks + 1)[1:-1]
    block = np.searchsorted(edges, np.log(tpos), side="right")
    levels, counts, start = [], [], 0
    for b in range(n_blocks):
        end = int(np.searchsorted(block, b, side="right"))
        if end - start >= 3 or (b == n_blocks - 1 and end > start):
            levels.append(np.median(ly[start:end]))
            counts.append(end - start)
            start = end
    return np.array(levels), np.array(counts)


def nothing_to_fit(t: np.ndarray, y: np.ndarray) -> str:
    """Why a curve has nothing to fit, or "" if it has something: fewer than 6
    positive values (an all-zero loss), or a loss that does not fall: the median
    of `log L` over its first block (of `_block_levels`) is not above the lowest
    block median by more than `max(0.05, 4 se)` (`se`: the standard error of
    the difference of two medians under the curve's noise)."""
    pos = y > 0
    if pos.sum() < 6:
        what = "0 everywhere" if not pos.any() else f"positive at {pos.sum()} points"
        return f"nothing to fit: the loss is {what} (a log-scale fit needs 6)"
    ly = np.log(y[pos])
    levels, counts = _block_levels(t[pos], ly)
    noise = log_noise(ly)
    se = 1.2533 * noise * np.sqrt(1 / counts[0] + 1 / counts)
    threshold = np.maximum(0.05, 4 * se)
    if np.any(levels[0] - levels > threshold):
        return ""
    if np.any(levels - levels[0] > threshold):
        return "nothing to fit: the loss rises, it never falls"
    return (
        f"nothing to fit: the loss is flat (changes by less than "
        f"{max(float(np.max(threshold)), 0.05):.2g} in log L, its noise "
        f"{noise:.2g})"
    )


def _huber(x, delta):
    ax = jnp.abs(x)
    return jnp.where(ax <= delta, 0.5 * x**2, delta * (ax - 0.5 * delta))


def huber_numpy(r, delta=3.0):
    """Residuals `r` (numpy, any shape) whose half squares are Huber's loss
    (`_robust_residual`, in numpy for the staircase fit) and their
    derivatives."""
    ar = np.abs(r)
    far = ar > delta
    rho = np.where(
        far, np.sign(r) * np.sqrt(delta * (2 * np.maximum(ar, delta) - delta)), r
    )
    drho = np.where(far, delta / np.maximum(np.abs(rho), 1e-300), 1.0)
    return rho, drho


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


def _robust_residual(res, delta):
    r"""Residuals whose half sum of squares is the Huber loss:
    $\rho = r$ for $|r| \le \delta$, else
    $\operatorname{sign}(r) \sqrt{\delta (2|r| - \delta)}$, so that
    $\rho^2 / 2 = \operatorname{huber}(r)$ and $\rho\,\rho' = \psi(r)$ (the
    Huber influence): Gauss-Newton on $\rho$ has the robust objective's gradient
    (robustified least squares, as in Triggs et al., "Bundle adjustment -- a
    modern synthesis", 2000)."""
    a = jnp.abs(res)
    far = jnp.sign(res) * jnp.sqrt(delta * (2 * jnp.maximum(a, delta) - delta))
    return jnp.where(a <= delta, res, far)


def _adam(evaluate, theta, steps, lr):
    """`steps` of Adam (optax, cosine decay) on `evaluate(theta) -> (value,
    grad, aux)`; the best point seen and its `aux`. A step from a point whose
    value is not finite (a failed solve) restarts from the best point. One
    scan of `steps + 1` evaluations (the last only scores), so the model
    appears once in the compiled program."""
    opt = optax.adam(optax.cosine_decay_schedule(lr, max(steps, 1), alpha=1e-2))

    def step(carry, _):
        cand, best, best_value, best_aux, state = carry
        value, grad, aux = evaluate(cand)
        improved = value < best_value
        best, best_value, best_aux = jax.tree.map(
            lambda new, old: jnp.where(improved, new, old),
            (cand, value, aux),
            (best, best_value, best_aux),
        )
        ok = jnp.isfinite(value)
        updates, new_state = opt.update(jnp.where(ok, grad, 0.0), state, cand)
        nxt = jnp.where(ok, optax.apply_updates(cand, updates), best)
        return (nxt, best, best_value, best_aux, new_state), None

    inf = jnp.asarray(jnp.inf, theta.dtype)
    aux0 = jax.tree.map(jnp.zeros_like, jax.eval_shape(evaluate, theta)[2])
    carry = (theta, theta, inf, aux0, opt.init(theta))
    (_, best, _, best_aux, _), _ = jax.lax.scan(step, carry, None, length=steps + 1)
    return best, best_aux


def _levenberg_marquardt(residual_fn, weights, delta, theta, J, steps):
    """At most `steps` of `optimistix.LevenbergMarquardt` (in
    `optimistix.BestSoFarLeastSquares`) on the robustified residuals, from
    `theta` where the Jacobian of `residual_fn` is `J`.

    In coordinates scaled by the curvature at the start, `z = D (theta -
    theta_0)` with `D = sqrt(diag J^T W J)`: optimistix damps with `lambda I`,
    and the scaling makes that Marquardt's `lambda diag(J^T W J)`, so that a
    nearly flat direction (e.g. `L_inf -> 0`) is not frozen by a damping set by
    the steep ones."""
    wsum = jnp.sum(weights)
    sqrt_w = jnp.sqrt(weights / wsum)
    d = jnp.sqrt(jnp.sum(weights[:, None] * J**2, axis=0) / wsum)
    d = jnp.where(jnp.isfinite(d) & (d > 0), d, 1.0)
    d = jnp.maximum(d, 1e-6 * jnp.max(d))

    def scaled(z, theta0):
        return sqrt_w * _robust_residual(residual_fn(theta0 + z / d), delta)

    solver = optx.BestSoFarLeastSquares(optx.LevenbergMarquardt(rtol=1e-10, atol=1e-10))
    z = optx.least_squares(
        scaled, solver, jnp.zeros_like(theta), theta, max_steps=steps, throw=False
    ).value
    return theta + z / d


def robust_least_squares(residual_fn, weights, delta, theta, adam_steps, lm_steps, lr):
    r"""Minimise the weighted mean Huber loss of `residual_fn(theta)`:
    `adam_steps` of Adam (optax, cosine decay) to find the basin, then at most
    `lm_steps` of Levenberg-Marquardt (`optimistix.LevenbergMarquardt` inside
    `optimistix.BestSoFarLeastSquares`, on the robustified residuals of
    `_robust_residual`) to converge it (first-order steps crawl along flat
    valleys, e.g. `L_inf -> 0`). Derivatives are forward mode (a few parameters
    against many residuals). A candidate with non-finite residuals (a failed
    solve) is never accepted: Adam restarts from its best point, and
    Levenberg-Marquardt's trust region rejects it.

    Returns the best point, with its objective (`inf` where the residuals are
    not finite), residuals and Jacobian."""
    wsum = jnp.sum(weights)

    def evaluate(th):
        res, J = _value_and_jacfwd(residual_fn, th)
        value = jnp.sum(weights * _huber(res, delta)) / wsum
        grad = J.T @ (weights * jnp.clip(res, -delta, delta)) / wsum
        ok = jnp.isfinite(value) & jnp.all(jnp.isfinite(J))
        return jnp.where(ok, value, jnp.inf), grad, (res, J)

    if adam_steps > 0:
        theta, (res, J) = _adam(evaluate, theta, adam_steps, lr)
    else:
        res, J = _value_and_jacfwd(residual_fn, theta)
    if lm_steps > 0:
        theta = _levenberg_marquardt(residual_fn, weights, delta, theta, J, lm_steps)
        res, J = _value_and_jacfwd(residual_fn, theta)
    value = jnp.sum(weights * _huber(res, delta)) / wsum
    ok = jnp.isfinite(value) & jnp.all(jnp.isfinite(J))
    return _Best(theta, jnp.where(ok, value, jnp.inf), res, J)


def laplace_cov(best: _Best, weights):
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
