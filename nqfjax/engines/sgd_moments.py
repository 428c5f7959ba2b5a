r"""The mean loss of discrete-step minibatch SGD on the quadratic network
(`sgd_moments`): a moment equation on the Lotka-Volterra modes, differentiable
in the per-step learning rates and batch sizes.

The network is $f(x) = x^\top M x$, $M = W W^\top$, on Gaussian inputs
$x \sim N(0, S)$ with teacher $y = x^\top M_\star x + \xi$, label noise
$\xi \sim N(0, \sigma^2)$, and $S$, $M_\star$ diagonal in one basis (the task
reduces to Lotka-Volterra modes). One SGD step on a minibatch of $b$ samples is

$$W \leftarrow (I - 2\eta \hat G) W, \qquad
M \leftarrow (I - 2\eta \hat G)\, M\, (I - 2\eta \hat G), \qquad
\hat G = \frac1b \sum_{s} e_s\, x_s x_s^\top,\quad e_s = x_s^\top M x_s - y_s,$$

unbiased, $\mathbb E \hat G = G = K[M - M_\star]$. Write $M = \bar M + \delta M$
with $\bar M = \mathrm{diag}(\bar m)$ the mean over the minibatch noise (it stays
diagonal: the law is symmetric under $x_k \to -x_k$) and close the moments at
second order (Gaussian closure, the linear-noise approximation): the state is
$\bar m$, the covariance $C_{kl} = \mathrm{Cov}(M_{kk}, M_{ll})$ and the
variances $V_{kl} = \mathbb E\,\delta M_{kl}^2$ ($k \ne l$; the sign symmetry
makes all other second moments vanish). With $u_k = x_k^2 / s_k$ iid
$\chi^2_1$, the Gaussian (Wick) moments $\mathbb E[u_i u_j u_k u_l]$ (products
of $1, 3, 15, 105$ over repeated indices) give every expectation in closed form:

- the mean residual $\bar e = \sum_i a_i u_i$ with $a = s \odot (\bar m - \mu)$,
  $g_k = G_{kk} = 2 s_k^2 \bar\delta_k + s_k \sum_l s_l \bar\delta_l$;
- $E2_{kl} = \mathbb E[e^2 u_k u_l] = \sum_{ij}\Omega_{ij}\,\mathbb E[u_i u_j u_k
  u_l] + \sigma^2 \mathbb E[u_k u_l]$ with
  $\Omega = a a^\top + (s s^\top)\odot(C + 2V)$: the minibatch noise grows with
  the loss, the fluctuations' part included (that feedback sets the
  batch-size-dependent divergence);
- mean: $\bar m_k' = A_k^2 \bar m_k - 4\eta s_k\big(2 (X s)_k + (C s)_k\big)
  + 4\eta^2 c_b\big(s_k (E2\,(\bar m\odot s))_k - g_k^2 \bar m_k\big)$, with
  $A = 1 - 2\eta g$ (the discrete map: a mode grows by $A^2 = (1 + r/2)^2$ per
  step, not $e^r$), $X_{kl} = \mathbb E\,\delta M_{kl}^2$ and
  $c_b = \frac{n - b}{b(n - 1)}$ (draws without replacement from $n$ samples;
  $1/b$ for $n = \infty$);
- fluctuations: $C' = J C J^\top + Q$ with the Jacobian of the full-batch map
  $J = \mathrm{diag}(A^2) - 4\eta\,\mathrm{diag}(\bar m \odot A)\,(2\,\mathrm{diag}(s^2)
  + s s^\top)$ and $Q_{kl} = 16\eta^2 c_b\, \bar m_k \bar m_l s_k s_l\,(E2_{kl} -
  \bar u_k \bar u_l)$, $\bar u = \mathbb E[e u]$; and
  $V_{kl}' = \lambda_{kl}^2 V_{kl} + 4\eta^2 c_b (\bar m_k + \bar m_l)^2 s_k s_l
  E2_{kl}$ with $\lambda_{kl} = A_k A_l - 4\eta s_k s_l(A_k \bar m_k + A_l \bar m_l)$;
- mean loss: $\mathbb E L = \tfrac12\langle\bar\Delta, K[\bar\Delta]\rangle
  + \sum_{kl} s_k s_l X_{kl} + \tfrac12 \sum_{kl} s_k s_l C_{kl} + \sigma^2/2$.

A step is a divergence once the mean loss is non-finite or above
`divergence_factor` times the larger of its initial value and its value at
$M = 0$; the state is then frozen, so gradients stay finite. Neglected: third
cumulants, the fluctuations' corrections to the $O(\eta^2)$ terms and the noise
multiplying $\delta M$ itself (all of higher order in $\eta$ or in the
fluctuations). See the documentation's theory page on training methods.
"""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Bool, Float, Int

from .._checks import check_shape, error_if, finite, is_concrete, positive
from ..tasks.gaussian import GaussianQuadraticTask


class SGDMoments(eqx.Module):
    r"""What `sgd_moments` returns: the predicted mean over minibatch noise of
    minibatch SGD on the quadratic network, step by step.

    **Attributes:**

    - `loss`: the mean full-data loss after `0, 1, ..., T` steps, shape `(T + 1,)`
      (frozen at its last value once `diverged`).
    - `m`: the mean mode amplitudes $\bar m_k = \mathbb E\, u_k^\top M u_k$,
      shape `(T + 1, d)`, in the task's mode basis (`basis`).
    - `fluctuation`: the part of `loss` due to the fluctuations of `M` around its
      mean, shape `(T + 1,)` (the minibatch noise floor).
    - `basis`: the orthonormal mode basis, shape `(d, d)` (columns).
    - `diverged`: whether the predicted loss diverged (boolean scalar).
    - `diverged_at`: the first step at which it did, -1 if it did not.
    """

    loss: Float[Array, " T1"]
    m: Float[Array, "T1 d"]
    fluctuation: Float[Array, " T1"]
    basis: Float[Array, "d d"]
    diverged: Bool[Array, ""]
    diverged_at: Int[Array, ""]

    @property
    def final_loss(self) -> Float[Array, ""]:
        """The predicted mean loss after the last step."""
        return self.loss[-1]


@functools.cache
def _wick4(d: int) -> np.ndarray:
    r"""$\mathbb E[u_i u_j u_k u_l]$ for iid $u = z^2$, $z \sim N(0, 1)$, shape
    `(d, d, d, d)`: the product over distinct indices of the raw moments
    $\mathbb E u^c = (2c - 1)!! = 1, 3, 15, 105$ of their multiplicities $c$."""
    idx = np.indices((d,) * 4).reshape(4, -1)
    counts = (idx[:, None, :] == idx[None, :, :]).sum(axis=1)  # (4, d^4)
    raw = np.array([1.0, 1.0, 3.0, 15.0, 105.0])
    # each index of multiplicity c contributes raw[c]^(1/c): the product over the
    # c copies is raw[c]; rounding restores the exact integers
    logs = np.log(raw[counts]) / counts
    return np.rint(np.exp(logs.sum(axis=0))).reshape((d,) * 4)


def task_modes(task: GaussianQuadraticTask, rtol: float = 1e-6):
    """`(basis, s, mu)`: a common eigenbasis of `S` and `M_star`, and their
    eigenvalues in it; `ValueError` when `task` is not a Gaussian quadratic
    task or its two matrices do not commute."""
    if not isinstance(task, GaussianQuadraticTask):
        raise ValueError(
            f"`task` must be a gaussian_quadratic_task, got {type(task).__name__}."
        )
    S, Ms = np.asarray(task.covariance), np.asarray(task.M_star)
    scale_s = max(np.abs(S).max(), 1e-300)
    scale_m = max(np.abs(Ms).max(), 1e-300)
    # a generic combination separates the eigenspaces of both when they commute
    _, U = np.linalg.eigh(S / scale_s + 0.6180339887 * Ms / scale_m)
    s_mat, m_mat = U.T @ S @ U, U.T @ Ms @ U
    off_s = np.abs(s_mat - np.diag(np.diag(s_mat))).max() / scale_s
    off_m = np.abs(m_mat - np.diag(np.diag(m_mat))).max() / scale_m
    if max(off_s, off_m) > rtol:
        raise ValueError(
            "`task`: the covariance and `M_star` must commute (share an "
            "eigenbasis) for the moment equation on the modes; relative "
            f"off-diagonal part {max(off_s, off_m):.2g}."
        )
    return U, np.diag(s_mat), np.diag(m_mat)


class Moments(eqx.Module):
    """The input moments the step needs, in the mode basis (`x` in it):
    `F4[k, l] = E[x_k^2 x_l^2]`, `F8[i, j, k, l] = E[x_i^2 x_j^2 x_k^2 x_l^2]`,
    `cy[k] = E[y x_k^2]`, `Y6[i, k, l] = E[y x_i^2 x_k^2 x_l^2]`,
    `Y8[k, l] = E[y^2 x_k^2 x_l^2]`, `y2 = E[y^2]`; `m_star` the least-squares
    amplitudes (`F4 m_star = cy`) and `floor` the loss there, computed without
    the cancellation of `y2 - cy.m_star` (see `diagonal_loss`)."""

    F4: Array
    F8: Array
    cy: Array
    Y6: Array
    Y8: Array
    y2: Array
    m_star: Array
    floor: Array


def diagonal_loss(mom: Moments, m):
    """`(m^T F4 m - 2 cy.m + y2) / 2` as `(m - m*)^T F4 (m - m*) / 2 + floor`:
    the same in exact arithmetic, but the first form is a difference of O(1)
    terms that rounds to about `eps y2` (negative near a noiseless minimum in
    float32, where `log L` is then NaN); the second is >= 0 and exact to
    rounding relative to itself."""
    e = m - mom.m_star
    return 0.5 * e @ mom.F4 @ e + mom.floor


def residual_gradient(mom: Moments, m):
    """`F4 m - cy = E[e x_k^2]` at the mean, as `F4 (m - m*)` (no cancellation
    near the minimum), shape `(d,)`."""
    return mom.F4 @ (m - mom.m_star)


@eqx.filter_jit
def _gaussian_moments(s, mu, sigma2, dtype) -> Moments:
    """The moments for `x ~ N(0, diag(s))`, `y = sum_k mu_k x_k^2 + xi` in closed
    form (Wick): `E[x_i^2 ... ] = s_i ... E[u_i ...]` with the chi^2_1 moments."""
    d = s.shape[0]
    s = jnp.asarray(s, dtype)
    mu = jnp.asarray(mu, dtype)
    ss = jnp.outer(s, s)
    F4 = ss * jnp.asarray(1.0 + 2.0 * np.eye(d), dtype)
    F8 = jnp.einsum("i,j,k,l->ijkl", s, s, s, s) * jnp.asarray(_wick4(d), dtype)
    Y6 = jnp.einsum("j,jikl->ikl", mu, F8)
    Y8 = jnp.einsum("i,j,ijkl->kl", mu, mu, F8) + sigma2 * F4
    y2 = mu @ F4 @ mu + sigma2
    sigma2 = jnp.asarray(sigma2, dtype)
    return Moments(F4, F8, F4 @ mu, Y6, Y8, y2, mu, 0.5 * sigma2)


@eqx.filter_jit
def _sample_moments(xs, ys, dtype) -> Moments:
    """The empirical moments of samples `xs` (`(n, d)`, in the mode basis) and
    targets `ys` (`(n,)`)."""
    q = jnp.asarray(xs, dtype) ** 2
    y = jnp.asarray(ys, dtype)
    n = q.shape[0]
    F4 = q.T @ q / n
    F8 = jnp.einsum("ni,nj,nk,nl->ijkl", q, q, q, q) / n
    Y6 = jnp.einsum("n,ni,nk,nl->ikl", y, q, q, q) / n
    Y8 = jnp.einsum("n,nk,nl->kl", y**2, q, q) / n
    cy = q.T @ y / n
    m_star = jnp.linalg.lstsq(F4, cy)[0]
    floor = 0.5 * jnp.mean((y - q @ m_star) ** 2)
    return Moments(F4, F8, cy, Y6, Y8, jnp.mean(y**2), m_star, floor)


def residual_moment(mom: Moments, m, second):
    """`E[e^2 x_k^2 x_l^2]`, shape `(d, d)`, for a residual whose mode amplitudes
    have mean `m` and second moments `second[i, j] = E[M_ii M_jj] + 2 E[dM_ij^2]`:
    matrix products with F8 and Y6 flattened (d^2 x d^2, d x d^2)."""
    d = m.shape[0]
    return (
        (second.reshape(-1) @ mom.F8.reshape(d * d, d * d))
        - 2 * (m @ mom.Y6.reshape(d, d * d))
    ).reshape(d, d) + mom.Y8


def noise_factor(b, n):
    """`c_b = (n - b) / (b (n - 1))`: the variance of a minibatch mean of `b`
    draws without replacement from `n` samples, per unit of one sample's
    variance (`1 / b` for fresh samples, `n = None`)."""
    return 1.0 / b if n is None else (n - b) / (b * (n - 1))


def _step(mom: Moments, n, state, eta, b):
    """One step of the moment map: `(m, C, V) -> (m', C', V')`."""
    m, C, V = state
    d = m.shape[0]
    off = 1.0 - jnp.eye(d, dtype=m.dtype)
    g = residual_gradient(mom, m)  # E[e x_k^2] = G_kk at the mean
    E2 = residual_moment(mom, m, jnp.outer(m, m) + C + 2 * V)
    c = noise_factor(b, n)
    A = 1 - 2 * eta * g
    # -2 eta E[K[dM] dM + dM K[dM]]_kk: the fluctuations' share of the saturation
    saturation = 2 * jnp.sum(mom.F4 * V, axis=1) + jnp.sum(mom.F4 * C, axis=1)
    m_new = A**2 * m - 4 * eta * saturation + 4 * eta**2 * c * (E2 @ m - g**2 * m)
    J = jnp.diag(A**2) - 4 * eta * (m * A)[:, None] * mom.F4
    # the noise multiplies m: its covariance goes with the second moments
    # E[m_k m_l] = m_k m_l + C_kl, exact while the residual does not depend on m
    mm = jnp.outer(m, m) + C
    Q = 16 * eta**2 * c * mm * (E2 - jnp.outer(g, g))
    C_new = J @ C @ J.T + Q
    Am = A * m
    lam = jnp.outer(A, A) - 4 * eta * mom.F4 * (Am[:, None] + Am[None, :])
    Qoff = 4 * eta**2 * c * (m[:, None] + m[None, :]) ** 2 * E2
    V_new = (lam**2 * V + Qoff) * off
    return (m_new, C_new, V_new)


def _loss(mom: Moments, state):
    """`(mean loss, fluctuation part)` of a state:
    `E L = (m^T F4 m - 2 cy.m + y2) / 2 + sum (C + 2 V) * F4 / 2`."""
    m, C, V = state
    mean = diagonal_loss(mom, m)
    fluct = 0.5 * jnp.sum((C + 2 * V) * mom.F4)
    return mean + fluct, fluct


def sgd_moments(
    task: GaussianQuadraticTask,
    learning_rates: Float[ArrayLike, " T"],
    batch_sizes: Float[ArrayLike, " T"],
    m0: Float[ArrayLike, " d"],
    *,
    noise_variance: Float[ArrayLike, ""] = 0.0,
    samples: tuple[ArrayLike, ArrayLike] | None = None,
    num_samples: int | None = None,
    divergence_factor: float = 1e4,
) -> SGDMoments:
    r"""Predict the mean loss of minibatch SGD on the quadratic network, step by
    step, from the moment equation of the module docstring.

    The training it predicts is `train(QuadraticNet(d), xs, ys, W0=W0,
    batch_size=b)` with $x \sim N(0, S)$, $y = x^\top M_\star x + \xi$,
    $\mathrm{Var}\,\xi = \sigma^2$, learning rate `learning_rates[t]` and batch
    size `batch_sizes[t]` at step `t`, from a start $W_0 W_0^\top$ diagonal in the
    mode basis with diagonal `m0` (e.g. `W0 = basis * sqrt(m0)`). The average is
    over the minibatches; the full-batch limit (`batch_sizes = num_samples`) is
    gradient descent exactly (the discrete map of the modes). Batch sizes are
    real numbers (a relaxation: only $c_b = \frac{n-b}{b(n-1)}$ enters), so the
    result is differentiable in both sequences: one `lax.scan` of `T` steps,
    `O(T d^4)` work.

    **Arguments:**

    - `task`: a `gaussian_quadratic_task` whose covariance commutes with
      `M_star`.
    - `learning_rates`: $\eta_t > 0$, shape `(T,)`.
    - `batch_sizes`: $b_t \ge 1$ (real), shape `(T,)`.
    - `m0`: the initial mode amplitudes $\mathrm{diag}(U^\top M_0 U) > 0$,
      shape `(d,)`, in the basis `SGDMoments.basis` (for a diagonal covariance
      with distinct entries, the standard basis up to order: pass `W0` built
      from the returned basis to be safe).
    - `noise_variance`: $\sigma^2 \ge 0$ of the label noise (default 0).
    - `samples`: `(xs, ys)`, shapes `(n, d)` and `(n,)` or `(n, 1)`: use the
      moments of this dataset (the one `train` draws minibatches from) instead of
      the Gaussian closed forms; exact for data whose law is symmetric under
      every $x_k \to -x_k$ (then `noise_variance` is ignored: the noise is in
      `ys`). `num_samples` defaults to `n`.
    - `num_samples`: the dataset size `n` minibatches are drawn from without
      replacement (static int, `>= max b`); `None` for fresh samples.
    - `divergence_factor`: the loss may reach this many times
      $\max(L_0, L(M = 0))$ before the run counts as diverged (default `1e4`,
      as in `train`).

    **Returns:** an `SGDMoments`.

    **Raises:** `ValueError` for a task that is not a
    `gaussian_quadratic_task` or whose covariance does not commute with
    `M_star` (eagerly: the basis is found with NumPy), mismatched shapes,
    non-positive learning rates, batch sizes below 1 or above `num_samples`, a
    non-positive `m0` or a negative noise variance (`eqx.error_if` under `jit`).
    """
    U, mom, num_samples, eta, bs, m0, factor = schedule_inputs(
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
    loss, m, fluct, diverged_at = _solve(mom, num_samples, eta, bs, m0, factor)
    return SGDMoments(
        loss=loss,
        m=m,
        fluctuation=fluct,
        basis=jnp.asarray(U, dtype),
        diverged=diverged_at >= 0,
        diverged_at=diverged_at,
    )


def schedule_inputs(
    task,
    learning_rates,
    batch_sizes,
    m0,
    noise_variance,
    samples,
    num_samples,
    divergence_factor,
):
    """The checked inputs of `sgd_moments` and `sgd_paths`: the mode basis `U`,
    the task's `Moments`, the number of samples, the learning rates and batch
    sizes `(T,)`, `m0` `(d,)` (in one floating dtype) and the divergence
    factor. Raises `ValueError` as `sgd_moments` documents."""
    U, s_np, mu_np = task_modes(task)
    d = s_np.shape[0]
    eta = jnp.asarray(learning_rates)
    bs = jnp.asarray(batch_sizes)
    m0 = jnp.asarray(m0)
    dtype = jnp.result_type(eta, bs, m0, task.covariance.dtype, float)
    if eta.ndim != 1 or eta.shape[0] < 1:
        raise ValueError(f"`learning_rates` must have shape (T,), got {eta.shape}.")
    check_shape("batch_sizes", bs, eta.shape)
    check_shape("m0", m0, (d,))
    eta = positive("learning_rates", eta.astype(dtype))
    bs = finite("batch_sizes", bs.astype(dtype))
    m0 = positive("m0", m0.astype(dtype))
    factor = check_divergence_factor(divergence_factor)
    mom, n = task_moments(U, s_np, mu_np, noise_variance, samples, num_samples, dtype)
    return U, mom, n, eta, check_batch_sizes(bs, n), m0, factor


def check_divergence_factor(divergence_factor) -> float:
    factor = float(divergence_factor)
    if not (np.isfinite(factor) and factor > 1):
        raise ValueError(f"`divergence_factor` must be > 1, got {divergence_factor}.")
    return factor


def task_moments(U, s_np, mu_np, noise_variance, samples, num_samples, dtype):
    """`(moments, n)`: the input moments in the mode basis `U`, in closed form
    (Gaussian inputs with label-noise variance `noise_variance`) or from
    `samples = (xs, ys)`, and the dataset size minibatches are drawn from (`None`
    for fresh samples); checks the arguments."""
    d = s_np.shape[0]
    sigma2 = jnp.asarray(noise_variance, dtype)
    check_shape("noise_variance", sigma2, ())
    sigma2 = _check_nonnegative("noise_variance", sigma2)
    if samples is None:
        mom = _gaussian_moments(s_np, mu_np, sigma2, dtype)
    else:
        xs, ys = samples
        xs, ys = jnp.asarray(xs), jnp.asarray(ys)
        if xs.ndim != 2 or xs.shape[1] != d:
            raise ValueError(f"`samples`: xs must have shape (n, {d}), got {xs.shape}.")
        ys = ys.reshape(-1) if ys.ndim == 2 and ys.shape[1] == 1 else ys
        check_shape("samples (ys)", ys, (xs.shape[0],))
        xs = finite("samples (xs)", xs.astype(dtype))
        ys = finite("samples (ys)", ys.astype(dtype))
        mom = _sample_moments(xs @ jnp.asarray(U, dtype), ys, dtype)
        if num_samples is None:
            num_samples = xs.shape[0]
    if num_samples is not None:
        num_samples = int(num_samples)
    return mom, num_samples


def check_batch_sizes(bs, n):
    msg = "`batch_sizes` must be >= 1" + ("" if n is None else f" and <= {n}") + "."
    high = np.inf if n is None else n
    if is_concrete(bs):
        b = np.asarray(bs)
        if not np.all((b >= 1) & (b <= high)):
            raise ValueError(msg + f" Got min {b.min()}, max {b.max()}.")
        return bs
    return error_if(bs, ~jnp.all((bs >= 1) & (bs <= high)), msg)


def _check_nonnegative(name, x):
    msg = f"`{name}` must be >= 0 and finite."
    if is_concrete(x):
        if not (np.isfinite(float(x)) and float(x) >= 0):
            raise ValueError(msg + f" Got {float(x)}.")
        return x
    return error_if(x, ~(jnp.isfinite(x) & (x >= 0)), msg)


@eqx.filter_jit
def _solve(mom, n, eta, bs, m0, factor):
    d = m0.shape[0]
    zero = jnp.zeros((d, d), m0.dtype)
    state0 = (m0, zero, zero)
    L0, f0 = _loss(mom, state0)
    Lzero, _ = _loss(mom, (jnp.zeros_like(m0), zero, zero))
    threshold = factor * jnp.maximum(L0, Lzero)

    def body(carry, inputs):
        state, L, f, first = carry
        t, eta_t, b_t = inputs
        new = _step(mom, n, state, eta_t, b_t)
        L_new, f_new = _loss(mom, new)
        bad = ~jnp.isfinite(L_new) | (L_new > threshold) | (first >= 0)
        first = jnp.where((first < 0) & bad, t + 1, first)
        # a diverged run is frozen: what follows stays finite, and so do gradients
        keep = lambda old, x: jnp.where(bad, old, x)  # noqa: E731
        state = jax.tree.map(keep, state, new)
        L, f = keep(L, L_new), keep(f, f_new)
        return (state, L, f, first), (L, state[0], f)

    ts = jnp.arange(eta.shape[0], dtype=jnp.int32)
    init = (state0, L0, f0, jnp.asarray(-1, jnp.int32))
    (_, _, _, first), (L, m, f) = jax.lax.scan(body, init, (ts, eta, bs))
    loss = jnp.concatenate([L0[None], L])
    m = jnp.concatenate([m0[None], m])
    fluct = jnp.concatenate([f0[None], f])
    return loss, m, fluct, first
