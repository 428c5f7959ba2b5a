"""Reading the modes of a predicted flow (private): which modes are learned, and
each one's curve followed through time. Shared by the engines of a prediction
(`experiments/engines.py`) and `agreement` (`experiments/predict.py`)."""

import numpy as np
from jaxtyping import ArrayLike, Float


def track_modes(
    M: Float[np.ndarray, "T p p"], V: Float[np.ndarray, "p q"]
) -> Float[np.ndarray, "T q"]:
    """The eigenvalues of `M(t)` (shape `(T, p, p)`) that continue the
    eigenvectors `V` (shape `(p, q)`) of the last `M`, followed backwards in time
    by the largest overlap between consecutive records (each record's
    eigenvectors assigned greedily, the largest tracked mode first), so that a
    mode keeps its identity when a later mode overtakes it. Shape `(T, q)`."""
    lam, U = np.linalg.eigh(0.5 * (M + np.swapaxes(M, 1, 2)))
    return _follow(lam, U, V)


def track_factor_modes(
    W: Float[np.ndarray, "T p r"], V: Float[np.ndarray, "p q"]
) -> Float[np.ndarray, "T q"]:
    """`track_modes` for `M(t) = W(t) W(t)^T` given by its factors (shape
    `(T, p, r)`, `q <= r`): the eigenvectors of `M` with nonzero eigenvalues are
    the left singular vectors of `W`, the eigenvalues its squared singular
    values (`O(T p r^2)`, no `(p, p)` matrix)."""
    U, sv, _ = np.linalg.svd(W, full_matrices=False)
    return _follow(sv**2, U, V)


def _follow(lam, U, V):
    """The values `lam` (`(T, m)`) of the vectors `U` (`(T, p, m)`) that continue
    `V` (`(p, q)`, `q <= m`) backwards in time (see `track_modes`)."""
    T, q = lam.shape[0], V.shape[1]
    out = np.zeros((T, q))
    current = V
    for t in range(T - 1, -1, -1):
        overlap = (current.T @ U[t]) ** 2  # (q, m)
        chosen = np.full(q, -1)
        for j in np.argsort(-out[t + 1] if t + 1 < T else -np.arange(q)):
            row = np.where(np.isin(np.arange(U.shape[2]), chosen), -1.0, overlap[j])
            chosen[j] = int(np.argmax(row))
        out[t] = lam[t, chosen]
        current = U[t][:, chosen]
    return out


def learned_modes(last: Float[np.ndarray, " p"], M0: Float[ArrayLike, "p p"]) -> int:
    r"""How many of the decreasing last values `last` are learned: above
    $\sqrt{\lambda_{\max}(M_0)\,\lambda_1}$, the geometric middle between the
    initial scale and the largest learned mode (none if the largest did not
    grow)."""
    lam0 = float(np.max(np.linalg.eigvalsh(np.asarray(M0, np.float64))))
    return learned_count(last, lam0)


def learned_count(last: Float[np.ndarray, " p"], lam0: float) -> int:
    r"""`learned_modes` given $\lambda_{\max}(M_0)$ = `lam0` instead of `M0`."""
    top = max(float(last[0]), lam0)
    floor = np.sqrt(max(lam0, np.finfo(np.float64).tiny) * top)
    return int(np.sum(last > floor)) if last[0] > lam0 else 0
