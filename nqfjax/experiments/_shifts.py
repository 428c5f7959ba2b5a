r"""The expected shifts of the switch-ons (`validity.expected_shifts`), for all
switch-ons at once: float64 numpy batched over the modes, one pass over the
records for the directions that become the modes, and one XLA
eigendecomposition for both the weights' modes and the quadratic form's
flow.

For the `k`-th switch-on at $T_k$: $\psi_k(t) = \Phi(T_k, t)^\top u_k$ less its
parts along the larger modes (see `validity`), the pattern
$x_k = W^\top \psi_k$, the feed $s_k = -\eta\,\delta g^\top \psi_k$ less its
parts along the larger modes' patterns, and
$\epsilon_k = -\ln |e^{\phi_k} \hat x_k(T_k) + D_k|^2 / (r_k T_k) + r_k / 4$
($\phi_k$ the feed along the pattern, compounding; $D_k$ the feed across it).
"""

import jax
import jax.numpy as jnp
import numpy as np


_TINY = np.finfo(np.float64).tiny
_xla_eigh = jax.jit(jnp.linalg.eigh)
_BLOCK = 16


def eigh(A) -> tuple[np.ndarray, np.ndarray]:
    """`np.linalg.eigh` of a batch of small symmetric matrices, by XLA when it
    computes in float64: right after a JAX computation, LAPACK's threads wait
    on XLA's (measured: 0.7 s instead of 5 ms for 45 matrices of size 32 on
    two cores)."""
    A = np.asarray(A, np.float64)
    if not jax.config.jax_enable_x64:
        return np.linalg.eigh(A)
    # in blocks of _BLOCK matrices (the last padded with identities): compiled
    # once per size, whatever the number of records
    n, p = A.shape[0], A.shape[-1]
    A = np.concatenate([A, np.broadcast_to(np.eye(p), (-n % _BLOCK, p, p))])
    parts = [_xla_eigh(A[i : i + _BLOCK]) for i in range(0, A.shape[0], _BLOCK)]
    lam = np.concatenate([np.asarray(a) for a, _ in parts])[:n]
    U = np.concatenate([np.asarray(u) for _, u in parts])[:n]
    return lam, U


def modes_and_flow(ts, W, learning_rate, G):
    r"""The eigenvalues and eigenvectors of $W W^\top$ at the records (`W`
    of shape `(R, p, m)`; ascending, as `eigh`), and, with `G` (shape
    `(R, p, p)`), the quadratic form's flow of a small mode between
    consecutive records (`carry_back`; else `None`): one eigendecomposition
    for both."""
    M = W @ np.swapaxes(W, 1, 2)
    if G is None:
        return (*eigh(M), None)
    R = M.shape[0]
    lam, U = eigh(np.concatenate([M, 0.5 * (G[1:] + G[:-1])]))
    return lam[:R], U[:R], flow(ts, learning_rate, lam[R:], U[R:])


def carry_back(ts, learning_rate, G) -> np.ndarray:
    r"""The quadratic form's flow of a small mode between consecutive records,
    $\Phi_i = e^{-2\eta (t_{i+1} - t_i) \bar G_i}$ with $\bar G_i$ the mean of
    `G` (shape `(R, p, p)`, $\nabla_W L_{\rm quad} = 2 G W$) at the two
    records, shape `(R - 1, p, p)`, symmetric."""
    G = np.asarray(G, np.float64)
    return flow(ts, learning_rate, *eigh(0.5 * (G[1:] + G[:-1])))


def flow(ts, learning_rate, mu, V) -> np.ndarray:
    r"""$e^{-2\eta (t_{i+1} - t_i) \bar G_i}$ from the eigenvalues `mu` (shape
    `(R - 1, p)`) and eigenvectors `V` of the $\bar G_i$ (the exponent
    clipped at 600 so nothing overflows)."""
    step = -2.0 * learning_rate * np.diff(ts)[:, None] * mu
    return np.einsum("rpi,ri,rqi->rpq", V, np.exp(np.minimum(step, 600.0)), V)


def directions(U, last, flow) -> np.ndarray:
    r"""For each mode `k` (the `k`-th column of `U`, shape `(R, p, c)`, by
    rank): the direction at each record up to `last[k]` that becomes the
    mode at record `last[k]`, less its parts along the larger modes (columns
    `< k` of `U`) at each record, shape `(c, R, p)` (zero after `last[k]`, and
    for a mode whose `last[k] < 0`): carried back by the quadratic form's flow
    of a small mode (`flow`, the `carry_back` of the records),
    $\psi_k(t) = \Phi(t_{\rm last}, t)^\top u_k$; without `flow`, $u_k$
    itself. One pass over the records for all modes."""
    R, p, c = U.shape
    last = np.asarray(last, np.int64)
    out = np.zeros((c, R, p))
    larger = np.tril(np.ones((c, c)), -1)  # larger[k, l] = l < k
    psi = np.zeros((c, p))
    top = int(np.max(last, initial=-1))
    for i in range(top, -1, -1):
        start, on = last == i, last > i
        if flow is not None and i < top:
            psi = psi @ flow[i]  # flow[i] symmetric: each row Phi_i psi_k
        psi[start] = U[i, :, start].reshape(-1, p)
        psi = psi - ((psi @ U[i]) * larger) @ U[i].T
        psi = psi / np.maximum(np.linalg.norm(psi, axis=1, keepdims=True), 1e-300)
        psi[~(start | on)] = 0.0
        out[:, i] = psi
    return out


def shifts(ts, W, gap, grad_quad, learning_rate, times, lam, U, flow):
    r"""$\epsilon_k$ of `validity` for the switch-ons `times` (by rank, in
    time order, shape `(c0,)`), from the records `ts` (shape `(R,)`), the
    weights `W`, the gradient gap and the quadratic form's gradient there
    (shapes `(R, p, m)`), the eigenvalues and eigenvectors of $W W^\top$
    (`modes_and_flow`: ascending) and the flow between records (or `None`).
    Float64, shape `(c0,)`; NaN for a rank that does not switch on within the
    records."""
    out = np.full(times.shape[0], np.nan)
    c = min(times.shape[0], W.shape[1], W.shape[2])
    R = ts.shape[0]
    if c == 0 or R < 2:
        return out
    lam = np.maximum(lam[:, ::-1][:, :c], _TINY)
    U = U[:, :, ::-1][:, :, :c]
    T = times[:c]
    j = np.searchsorted(ts, np.where(np.isfinite(T), T, -np.inf), side="right")
    ok = np.isfinite(T) & (T > 0) & (j >= 2)
    last = np.where(ok, j - 1, -1)
    e = directions(U, last, flow)  # (c, R, p)
    rows = np.arange(R)
    valid = rows[None, :] <= last[:, None]  # (c, R)
    v = np.einsum("rpm,rpk->rkm", W, U)  # |v_k|^2 = lambda_k
    x = np.einsum("rpm,krp->krm", W, e)  # patterns, |x|^2 the amplitudes
    a2 = np.maximum(np.sum(x * x, -1), _TINY)
    s = -learning_rate * np.einsum("rpm,krp->krm", gap, e)
    g = np.einsum("rpm,krp->krm", grad_quad, e)
    rate = -2.0 * learning_rate * np.sum(g * x, -1) / a2  # d ln(a2)/dt
    # the feed along a larger mode's pattern only turns that learned mode
    along = np.einsum("krm,rim->kri", s, v) / lam[None]
    along = along * np.tril(np.ones((c, c)), -1)[:, None, :]
    s = s - np.einsum("kri,rim->krm", along, v)
    prev = np.concatenate([[np.nan], T[:-1]])
    start = np.where(np.isfinite(prev), prev, ts[0])
    after = ts[None, :] >= start[:, None]
    at_last = rows[None, :] == last[:, None]
    r = np.max(np.where(valid & (after | at_last), rate, -np.inf), axis=1)
    ok &= r > 0
    r_safe = np.where(ok, r, 1.0)[:, None]
    # a feed while the mode saturates moves the switch-on by r / rate(t) more
    gain = np.where(after, r_safe / np.clip(rate, r_safe / 4.0, r_safe), 1.0)
    fed = s * np.where(valid, gain / np.sqrt(a2), 0.0)[..., None]
    # the feed along the mode's own pattern changes its growth rate: it
    # compounds; the feed across it adds a part that grows with the mode
    unit = x / np.sqrt(a2)[..., None]
    own = np.sum(fed * unit, -1)  # (c, R): added to d ln|x_k|/dt
    fed = fed - own[..., None] * unit
    seg = rows[None, 1:] <= last[:, None]  # segments ending in range
    k = np.arange(c)
    lk = np.maximum(last, 0)
    dt = np.diff(ts)
    to_on = T - ts[lk]  # the last piece, to the switch-on

    def integral(f):
        # trapezoid over the records read, then the last piece: axis 1 of f
        mid = 0.5 * (f[:, 1:] + f[:, :-1]) * dt[None, :, None]
        return np.sum(np.where(seg[..., None], mid, 0.0), 1) + f[k, lk] * to_on[:, None]

    D = integral(fed)
    phi = integral(own[..., None])[:, 0]
    grown = np.exp(np.minimum(phi, 300.0))[:, None] * unit[k, lk]
    rho = np.sum((grown + D) ** 2, -1)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        est = -np.log(np.maximum(rho, 1e-300)) / (r_safe[:, 0] * T) + r_safe[:, 0] / 4
    out[:c] = np.where(ok, est, np.nan)
    return out
