r"""`lv_reduce`: the Lotka-Volterra reduction of a task (or `NotReducibleError`).

Eager numerical linear algebra (numpy, float64) on top of the task's matrix-free
`K` and its `mode_couplings`; `nqfjax.engines.lv` re-exports both names.
"""

import warnings
from typing import NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from .._checks import is_concrete, renamed_keywords, static_int
from ..tasks.base import Task
from ..tasks.lotka_volterra import LotkaVolterra


class NotReducibleError(ValueError):
    """Raised by `lv_reduce` when the task's data matrices do not share an
    eigenbasis, so the M-space flow does not reduce to a Lotka-Volterra system.

    **Attributes:**

    - `violation`: the measured relative violation (see `lv_reduce`), a float.
    - `tol`: the tolerance it exceeded.
    """

    def __init__(self, message: str, violation: float, tol: float):
        super().__init__(message)
        self.violation = float(violation)
        self.tol = float(tol)


# -- lv_reduce: eager numerical linear algebra on top of the task's matrix-free K --


@eqx.filter_jit
def _K_batch(task, Xs):
    return jax.vmap(task.K)(Xs)


@eqx.filter_jit
def _K_images(task, U, cols):
    """For the basis vectors `U[:, cols]`: the diagonal of `U^T K[u u^T] U` and
    the squared Frobenius norm of its off-diagonal part."""

    def one(u):
        Z = U.T @ task.K(jnp.outer(u, u)) @ U
        d = jnp.diag(Z)
        off = Z - jnp.diag(d)  # directly, not |Z|^2 - |d|^2 (cancellation)
        return d, jnp.sum(off**2)

    return jax.vmap(one)(U[:, cols].T)


@jax.jit
def _times(Z, U):
    return Z @ U


def _couplings_and_violation(task, U, Uj, num_probes: int, seed: int):
    """`D[k, l] = <u_k u_k^T, K[u_l u_l^T]>` (float64) and
    `sum_l |off(U^T K[u_l u_l^T] U)|_F^2`: exactly, from the `K`-image of every
    mode, when `p <= num_probes` (no dearer than the probes); else estimated from
    `num_probes` Rademacher probes `g`, each `|off(U^T K[U diag(g) U^T] U)|_F^2`
    (unbiased: the cross terms have mean zero), with `D` from
    `task.mode_couplings`. Returns `(D, off_sq, estimated)`."""
    p = U.shape[0]
    if p <= num_probes:
        diag, off = [], []
        for cols in _chunks(p, p * p):
            d, o = _K_images(task, Uj, jnp.asarray(cols))
            diag.append(np.asarray(d, np.float64))
            off.append(np.asarray(o, np.float64))
        D = np.concatenate(diag).T
        return 0.5 * (D + D.T), float(np.sum(np.concatenate(off))), False
    rng = np.random.default_rng([seed, 27])  # apart from the basis search's draws
    G = rng.choice(np.array([-1.0, 1.0]), size=(p, num_probes))
    D, Z = task.mode_couplings(Uj, G)
    D = np.asarray(D, np.float64)
    off = []
    for Zi in Z:
        # off(U^T Z U) = U^T R with R = Z U - U diag(u_k^T Z u_k), and U is
        # orthogonal: |off|_F = |R|_F, in float64 on the task-dtype product Z U
        # (one O(p^3) product per probe; no cancellation, unlike |ZU|^2 - |d|^2)
        ZU = np.asarray(_times(Zi, Uj), np.float64)
        R = ZU - U * np.einsum("ik,ik->k", U, ZU)
        off.append(np.sum(R**2))
    return 0.5 * (D + D.T), float(np.mean(off)), True


def _chunks(p: int, per: int):
    b = max(1, min(p, 2**22 // max(1, per)))
    return [np.arange(i, min(p, i + b)) for i in range(0, p, b)]


def _apply_K(task, Xs: np.ndarray, dtype) -> np.ndarray:
    p = Xs.shape[-1]
    out = [
        np.asarray(_K_batch(task, jnp.asarray(Xs[c], dtype)), np.float64)
        for c in _chunks(len(Xs), p * p)
    ]
    return np.concatenate(out) if out else np.zeros_like(Xs)


def _split(values: np.ndarray, tol: float) -> list[np.ndarray]:
    """Indices of sorted `values` grouped where consecutive gaps are <= tol."""
    order = np.argsort(values)
    groups, start = [], 0
    for i in range(1, len(order) + 1):
        if i == len(order) or values[order[i]] - values[order[i - 1]] > tol:
            groups.append(order[start:i])
            start = i
    return groups


def _eigh(A: np.ndarray, vectors: bool = True):
    """`np.linalg.eigh` of the symmetric `A` shifted by its Frobenius norm `s`
    (then `w - s`): the same eigenvectors and eigenvalues to roundoff of `|A|`,
    without the subnormal numbers that LAPACK's iterations meet on a matrix with
    a large null space (`C` of a perceptron: ten times slower at p = 1024)."""
    s = np.linalg.norm(A)
    shifted = A + s * np.eye(A.shape[0])
    if not vectors:
        return np.linalg.eigvalsh(shifted) - s
    w, V = np.linalg.eigh(shifted)
    return w - s, V


def _refine(U, clusters, H, rel):
    """Within each cluster of columns of `U`, rotate to diagonalise `H` restricted
    there and split the cluster by the eigenvalues of that restriction, at `rel`
    times the largest of them all (the eigenvalues of `H` itself when `H` is
    block-diagonal in the clusters, as it is where the task reduces)."""
    single = np.array([c[0] for c in clusters if len(c) == 1], int)
    blocks = []
    for idx in clusters:
        if len(idx) > 1:
            Q = U[:, idx]
            h = Q.T @ H @ Q
            blocks.append((idx, Q, *_eigh(0.5 * (h + h.T))))
    values = [np.sum(U[:, single] * (H @ U[:, single]), axis=0)]
    values += [w for _, _, w, _ in blocks]
    scale = max((np.max(np.abs(v)) for v in values if v.size), default=0.0)
    if scale == 0.0:
        return U, clusters, False
    split_any, new = False, [c for c in clusters if len(c) == 1]
    for idx, Q, w, R in blocks:
        U[:, idx] = Q @ R
        parts = _split(w, rel * scale)
        split_any |= len(parts) > 1
        new.extend(idx[part] for part in parts)
    return U, new, split_any


def _block_violation(U, clusters, H) -> float:
    """`|off-block(U^T H U)|_F / |H|_F`: the part of `H` that couples different
    clusters of columns of `U` (zero when `H` commutes with every projector onto
    a cluster)."""
    label = np.empty(U.shape[1], int)
    for i, c in enumerate(clusters):
        label[c] = i
    Ht = U.T @ H @ U
    h = np.linalg.norm(H)
    off = np.linalg.norm(Ht[label[:, None] != label[None, :]])
    return float(off / h) if h > 0 else 0.0


def _shared_basis(task, C, dtype, rel, seed, tol=np.inf):
    """An orthonormal basis diagonalising `C` in which, if the task reduces, `K`
    keeps the diagonal matrices diagonal, and the block violation of its first
    step. Degenerate eigenspaces of `C` are split by the K-images of the
    projectors onto the eigenspaces found so far (which are diagonal in every
    valid basis), and what remains degenerate is rotated to diagonalise the
    K-image of a random matrix block-diagonal in the clusters (one random draw
    shared by all clusters, so paired modes such as (a, b)/sqrt2 and
    (a, -b)/sqrt2 in the perceptron come out paired).

    The first step is also a test: if the task reduces, the K-image of any
    combination of the eigenprojectors of `C` is diagonal in the shared basis,
    so it commutes with `C` and has no part between two eigenspaces. When that
    part (`_block_violation`, relative) exceeds `tol` the search stops there:
    the task does not reduce, whatever the rest would find.

    **Returns:** `(U, block_violation, refused)`."""
    p = C.shape[0]
    w, U = _eigh(C)
    scale = max(np.max(np.abs(w)), np.finfo(np.float64).tiny)
    clusters = _split(w, rel * scale)
    rng = np.random.default_rng(seed)
    block = None
    for _ in range(2 * p):
        # invariant images: sum_V w_V K[P_V] over the clusters V, random weights,
        # as one application of K to sum_V w_V P_V = U diag(w) U^T (O(p^3))
        weights = np.empty(p)
        for c, w in zip(clusters, rng.standard_normal(len(clusters)), strict=True):
            weights[c] = w
        H = _apply_K(task, ((U * weights) @ U.T)[None], dtype)[0]
        H = 0.5 * (H + H.T)
        if block is None:
            block = _block_violation(U, clusters, H)
            if not block <= tol:
                return U, block, True
        if all(len(c) == 1 for c in clusters):
            break
        U, clusters, split = _refine(U, clusters, H, rel)
        if split:
            continue
        # still degenerate: the K-image of a random block-diagonal matrix
        R = np.zeros((p, p))
        for c in clusters:
            if len(c) > 1:
                G = rng.standard_normal((len(c), len(c)))
                R += U[:, c] @ (G + G.T) @ U[:, c].T
        H = _apply_K(task, R[None], dtype)[0]
        U, clusters, split = _refine(U, clusters, 0.5 * (H + H.T), rel)
        if not split:
            break
    return U, block, False


def _check_task(task, *args):
    if not isinstance(task, Task):
        raise ValueError(f"`task` must be a Task, got {type(task)}.")
    if not is_concrete(task, *args):
        raise ValueError(
            "`lv_reduce` runs eagerly (it searches for a basis with numpy); call it "
            "outside jax.jit/vmap/grad. For power-law tasks use "
            "`task.lotka_volterra()`, which traces."
        )


@renamed_keywords(eta="learning_rate")
def lv_reduce(
    task,
    learning_rate: float | None = None,
    weight_decay: float | None = None,
    *,
    tol: float | None = None,
    degeneracy_tol: float | None = None,
    seed: int = 0,
    num_probes: int = 8,
) -> tuple[LotkaVolterra, Float[Array, "p p"]]:
    r"""Reduce a task's M-space flow to a Lotka-Volterra system.

    Finds an orthonormal basis $u_1..u_p$ that diagonalises `C` and in which
    `K` maps every $u_l u_l^\top$ to a diagonal matrix; then
    $M(t) = \sum_k m_k(t) u_k u_k^\top$ solves the M-space flow when $M_0$ is
    diagonal in that basis, with

    $$r_k = 4\, u_k^\top C u_k, \qquad
    B_{kl} = 4\,\langle u_k u_k^\top, K[u_l u_l^\top]\rangle,$$

    no decay, `loss_scale = 1/4` and `loss_offset = E|y|^2/2`, so
    `lv.loss(m) == task.loss(basis @ diag(m) @ basis.T)`. The system is in flow
    time $s = \int \eta\, dt$: the learning rate and the weight decay are
    `solve_lv`'s arguments, as they are `solve_mflow`'s, so
    `solve_lv(lv, m0, ts, learning_rate, weight_decay)` is
    `solve_mflow(task, M0, ts, learning_rate, weight_decay)` in the modes.

    The basis: eigenvectors of `C`; eigenvalues closer than `degeneracy_tol`
    (relative to the largest) form degenerate eigenspaces, inside which the basis
    is chosen from the K-images of the eigenprojectors, then of a random matrix
    (for example the whitened perceptron, whose `C` has a large null space and
    whose modes are $(a_s, \pm b_s)/\sqrt2$ from the SVD of $E[y x^\top]$).
    Modes are ordered by decreasing `r`.

    The check: the relative violation is the largest of $\big(\sum_l
    \|\mathrm{off}(U^\top K[u_l u_l^\top] U)\|_F^2 / \sum_l \|K[u_l
    u_l^\top]\|_F^2\big)^{1/2}$, $\|\mathrm{off}(U^\top C U)\|_F / \|C\|_F$, where
    `off` drops the diagonal, and the first step's: $H = K[\sum_V w_V P_V]$ for the
    eigenprojectors $P_V$ of `C` and random weights $w_V$ must commute with `C` (it
    is diagonal in any shared basis), so its part between different eigenspaces of
    `C`, relative to $\|H\|_F$, must vanish. 0 means an exact reduction. When that
    first part alone exceeds `tol` the search stops there and `NotReducibleError`
    carries it (a lower bound of the full violation): real data are refused after
    one `eigh` of `C` and one application of `K`. The K part's denominator is
    $\|D\|_F^2$ plus its numerator. For `p <= num_probes` the numerator is exact
    (the `K`-image of every mode); above, it is estimated as the mean over
    `num_probes` random sign vectors $g$ (drawn from `seed`) of
    $\|\mathrm{off}(U^\top K[U \mathrm{diag}(g) U^\top] U)\|_F^2$, which is unbiased
    (the cross terms have mean zero) and exactly 0 when the task reduces, so exact
    reductions are still accepted at roundoff. Relative spread of the estimated
    violation about 20% at the default 8 probes (measured, ratio to the exact value
    over 20 seeds: standard deviation 0.06-0.18, extremes 0.54 and 1.36, on
    perceptrons on real data and rotated quadratic tasks); far below or above `tol`
    the decision does not depend on it.

    Cost: `eigh` of `C` and the basis search, `O(p^3)` with one application of
    `K` per refinement (a refusal stops after the first);
    `task.mode_couplings(U, probes)` for $D$ and the probes' images
    (`SampledTask`: one pass over the samples, `O(n d p + n p^2)` for the
    readout structures' closed-form `mode_gram`, `O(n k p^2)` otherwise, no `K`
    application); one `O(p^3)` product per probe. The previous implementation
    applied `K` to every mode (`O(p)` applications, `O(p^4)`).

    Eager only: `lv_reduce` runs numpy linear algebra (float64; `K` and the
    couplings in the task's dtype) on concrete arrays; under `jax.jit`, `vmap`,
    `grad` or `shard_map` it raises a `ValueError` saying so. For a
    `PowerLawTask` the standard basis is returned without any search, and
    `PowerLawTask.lotka_volterra()` gives the system without the `p x p` basis
    (and under `jit`).

    **Arguments:**

    - `task`: a `Task`.
    - `learning_rate`, `weight_decay`: deprecated (`DeprecationWarning`; `eta=`
      too): the system built at them, rates times $\eta$ and decay
      $2\eta\lambda$, in steps, as in earlier releases. Pass them to `solve_lv`
      instead.
    - `tol`: the largest accepted relative violation (default 1e-6 in float64,
      1e-3 in float32).
    - `degeneracy_tol`: relative gap below which eigenvalues count as degenerate
      (default: the square root of the machine epsilon).
    - `seed`: seed of the random matrix used inside degenerate eigenspaces and
      of the probes.
    - `num_probes`: an int `>= 1` (default 8), the random probes of the
      violation's estimate; the violation is exact when `p <= num_probes`
      (`num_probes=p` for the exact value, at `O(p)` applications of `K`).

    **Returns:** `(lv, basis)`: the `LotkaVolterra` system and the basis, shape
    `(p, p)`, modes as columns, so `m0 = diag(basis^T M0 basis)`.

    **Raises:** `NotReducibleError` (a `ValueError`) carrying `.violation` when
    the violation exceeds `tol`; `ValueError` for `num_probes < 1`, a deprecated
    `learning_rate <= 0` or `weight_decay < 0`, or traced arguments.
    """
    _check_task(task, learning_rate, weight_decay)
    if learning_rate is not None or weight_decay is not None:
        warnings.warn(
            "lv_reduce(task, learning_rate, weight_decay) is deprecated: "
            "lv_reduce(task) returns the system in flow time; pass the learning "
            "rate and the weight decay to solve_lv(lv, m0, ts, learning_rate, "
            "weight_decay).",
            DeprecationWarning,
            stacklevel=3,  # past renamed_keywords' wrapper
        )
    eta_f = 1.0 if learning_rate is None else float(np.asarray(learning_rate))
    lam_f = 0.0 if weight_decay is None else float(np.asarray(weight_decay))
    if not (np.isfinite(eta_f) and eta_f > 0):
        raise ValueError(f"`learning_rate` must be > 0 and finite, got {eta_f}.")
    if not (np.isfinite(lam_f) and lam_f >= 0):
        raise ValueError(f"`weight_decay` must be >= 0 and finite, got {lam_f}.")
    red = measure_reduction(
        task,
        tol,
        degeneracy_tol=degeneracy_tol,
        seed=seed,
        num_probes=num_probes,
        learning_rate=eta_f,
        weight_decay=lam_f,
    )
    if not red.violation <= red.tol:
        raise NotReducibleError(red.message, red.violation, red.tol)
    return red.lv, red.basis


class Reduction(NamedTuple):
    """What `measure_reduction` found (`lv_reduce` raises unless
    `violation <= tol`).

    - `lv`, `basis`: the system and its basis (the eigenbasis of `C`, completed
      by the search), or `None` when the search stopped at its first step.
    - `violation`: the relative violation of commutation (see `lv_reduce`); a
      lower bound of the full one when refused at the first step.
    - `tol`: the tolerance it was held to.
    - `message`: why the task does not reduce ("" when it does).
    - `first_step`, `k_part`, `c_part`: the three parts of the violation (`nan`
      where not measured: the last two after a refusal at the first step).
    """

    lv: LotkaVolterra | None
    basis: Array | None
    violation: float
    tol: float
    message: str
    first_step: float = float("nan")
    k_part: float = float("nan")
    c_part: float = float("nan")


def measure_reduction(
    task,
    tol: float | None = None,
    *,
    degeneracy_tol: float | None = None,
    seed: int = 0,
    num_probes: int = 8,
    early: bool = True,
    learning_rate: float = 1.0,
    weight_decay: float = 0.0,
) -> Reduction:
    """`lv_reduce` without raising: the system, its basis and the measured
    violation, in one search (the engines read the violation of an accepted
    reduction, and the approximate engine the system of a refused one). With
    `early`, a violation of the first step's necessary condition above `tol`
    stops the search there (`lv` and `basis` are `None`); without it, the whole
    search and every part of the violation are computed whatever `tol`.
    `task` must be a concrete `Task`; the other arguments are
    `lv_reduce`'s, checked there."""
    _check_task(task)
    num_probes = static_int("num_probes", num_probes, 1)
    dtype = jnp.dtype(task.dtype)
    if tol is None:
        tol = 1e-6 if dtype == jnp.float64 else 1e-3
    tol = float(tol)
    if degeneracy_tol is None:
        degeneracy_tol = float(np.sqrt(np.finfo(dtype).eps))
    eta_f, lam_f = float(learning_rate), float(weight_decay)

    known = task.known_reduction(eta_f, lam_f)
    if known is not None:
        return Reduction(*known, 0.0, tol, "", 0.0, 0.0, 0.0)

    C = np.asarray(task.C, np.float64)
    if not np.all(np.isfinite(C)):
        raise ValueError("`task.C` contains NaN or inf.")
    C = 0.5 * (C + C.T)
    p = C.shape[0]
    U, block, refused = _shared_basis(
        task, C, dtype, degeneracy_tol, seed, tol if early else np.inf
    )
    why = (
        "The data matrices do not share an eigenbasis; use solve_mflow, which "
        "applies to any task."
    )
    if refused:
        return Reduction(
            None,
            None,
            block,
            tol,
            "The task does not reduce to a Lotka-Volterra system: K maps the "
            "eigenprojectors of C to a matrix that does not commute with C "
            f"(relative violation {block:.3g} > tol {tol:.3g}, measured on the "
            f"first step of the basis search). {why}",
            first_step=block,
        )

    # Order by decreasing growth rate; fix signs (largest entry positive).
    c_diag = np.sum(U * (C @ U), axis=0)  # BLAS, not a three-operand einsum
    order = np.argsort(-c_diag, kind="stable")
    U, c_diag = U[:, order], c_diag[order]
    signs = np.sign(U[np.argmax(np.abs(U), axis=0), np.arange(p)])
    U = U * np.where(signs == 0, 1.0, signs)

    Uj = jnp.asarray(U, dtype)
    D, off_sq, estimated = _couplings_and_violation(task, U, Uj, num_probes, seed)
    tot_sq = float(np.sum(D**2)) + off_sq  # sum_l |K[u_l u_l^T]|_F^2
    viol_K = float(np.sqrt(off_sq / tot_sq)) if tot_sq > 0 else 0.0
    Ct = U.T @ C @ U
    c_norm = np.linalg.norm(C)
    viol_C = np.linalg.norm(Ct - np.diag(np.diag(Ct))) / c_norm if c_norm > 0 else 0.0
    viol_C = float(viol_C)
    violation = float(max(viol_K, viol_C, block))
    how = f" estimated from {num_probes} random probes" if estimated else ""
    message = (
        ""
        if violation <= tol
        else "The task does not reduce to a Lotka-Volterra system: K does not keep "
        "the diagonal matrices of the eigenbasis of C diagonal (relative "
        f"violation {violation:.3g} > tol {tol:.3g}; K part {viol_K:.3g}{how}, "
        f"C part {viol_C:.3g}, first step {block:.3g}). {why}"
    )
    B = 4.0 * eta_f * 0.5 * (D + D.T)
    y2 = float(np.asarray(task.y2))
    lv = LotkaVolterra(
        jnp.asarray(4.0 * eta_f * c_diag, dtype),
        jnp.asarray(B, dtype),
        jnp.asarray(2.0 * eta_f * lam_f, dtype),
        loss_scale=jnp.asarray(1.0 / (4.0 * eta_f), dtype),
        loss_offset=jnp.asarray(0.5 * y2, dtype),
    )
    return Reduction(lv, Uj, violation, tol, message, block, viol_K, viol_C)
