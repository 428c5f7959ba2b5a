"""`LotkaVolterra`: its checks (eagerly, under `jit` and under `vmap`), the
structured form `B = diag(d) + U U^T` held in O(p q), and its O(p q) methods
against the dense matrix."""

import jax
import numpy as np
import pytest
from scipy.integrate import solve_ivp

from nqfjax import (
    DenseInteractions,
    DiagonalInteractions,
    LotkaVolterra,
    LowRankInteractions,
    solve_lv,
)


R = np.array([1.0, 0.6, 0.3])
B_GOOD = np.array([[1.0, 0.2, 0.1], [0.2, 0.8, 0.3], [0.1, 0.3, 0.5]])  # PD
M0 = np.full(3, 1e-3)
TS = np.array([2.0, 20.0])
# each is refused with a message naming the argument
B_BAD = {
    "indefinite": np.diag([1.0, -0.5, 1.0]) + 0.1,  # eigenvalue ~ -0.5
    "negative": -B_GOOD,
    "non-symmetric": B_GOOD + np.triu(np.full((3, 3), 0.3), 1),
    "non-finite": np.where(np.eye(3) > 0, np.nan, B_GOOD),
}
B_MESSAGE = {
    "indefinite": "`B` must be positive semi-definite",
    "negative": "`B` must be positive semi-definite",
    "non-symmetric": "`B` must be symmetric",
    "non-finite": "`B` contains NaN or inf",
}


def _scipy(r, B, decay, m0, ts):
    """Reference in log space (Radau, tight tolerances)."""
    sol = solve_ivp(
        lambda t, y: r - B @ np.exp(y) - decay,
        (0.0, ts[-1]),
        np.log(m0),
        method="Radau",
        t_eval=ts,
        rtol=1e-12,
        atol=1e-12,
    )
    return np.exp(sol.y.T)


@pytest.fixture(scope="module")
def solve_dense():
    """`solve_lv` of a system built from traced `(B, decay)`: one compilation."""
    return jax.jit(lambda B, decay: solve_lv(LotkaVolterra(R, B, decay), M0, TS).ys)


def test_eager_checks_name_the_argument():
    for case, B in B_BAD.items():
        with pytest.raises(ValueError, match=B_MESSAGE[case]):
            LotkaVolterra(R, B)
    # a negative entry of an exactly diagonal B: its eigenvalue
    with pytest.raises(ValueError, match="`B` must be.*positive semi-definite"):
        LotkaVolterra(R, np.diag([1.0, -0.5, 1.0]))
    for decay in (-0.5, np.nan, np.inf):
        with pytest.raises(ValueError, match="`decay` must be finite and >= 0"):
            LotkaVolterra(R, B_GOOD, decay)
    with pytest.raises(ValueError, match="`r` must be finite"):
        LotkaVolterra(np.array([1.0, np.inf, 0.3]), B_GOOD)
    with pytest.raises(ValueError, match="`B_diag` must be finite and non-negative"):
        LotkaVolterra(R, B_diag=[1.0, -1e-3, 1.0])
    with pytest.raises(ValueError, match="`B_factor` must be finite"):
        LotkaVolterra(R, B_diag=np.ones(3), B_factor=np.full((3, 1), np.nan))
    # shapes and combinations
    with pytest.raises(ValueError, match=r"`B` must have shape \(3, 3\)"):
        LotkaVolterra(R, np.ones((2, 2)))
    with pytest.raises(ValueError, match=r"`B_factor` must have shape \(3, q\)"):
        LotkaVolterra(R, B_diag=np.ones(3), B_factor=np.ones((2, 1)))
    with pytest.raises(ValueError, match=r"`B_diag` must have shape \(3,\)"):
        LotkaVolterra(R, B_diag=np.ones(2))
    with pytest.raises(ValueError, match="either `B` or `B_diag`"):
        LotkaVolterra(R, B_GOOD, B_diag=np.ones(3))
    with pytest.raises(ValueError, match="`B_factor` goes with `B_diag`"):
        LotkaVolterra(R, B_GOOD, B_factor=np.ones((3, 1)))
    with pytest.raises(ValueError, match=r"`decay` must have shape \(\)"):
        LotkaVolterra(R, B_GOOD, np.zeros(3))


def test_jit_checks_refuse_instead_of_running(solve_dense):
    """Issue: a jitted `decay = -0.5` ran and returned a wrong curve; a jitted
    indefinite, negative or non-symmetric `B` ended in "maximum number of solver
    steps". Now each is refused at run time with the message naming it."""
    with pytest.raises(RuntimeError, match="`decay` must be finite and >= 0"):
        solve_dense(B_GOOD, -0.5)
    for case, B in B_BAD.items():
        with pytest.raises(RuntimeError, match=B_MESSAGE[case]):
            solve_dense(B, 0.0)
    # good values pass and give the right curve: against scipy (Radau at 1e-12)
    # in log space; solve_lv's float64 default atol is 1e-9 on log m
    m = solve_dense(B_GOOD, 0.05)
    ref = _scipy(R, B_GOOD, 0.05, M0, TS)
    np.testing.assert_allclose(m, ref, rtol=1e-7)


def test_vmap_checks():
    """Under `vmap` one bad member refuses the batch (`eqx.error_if` reduces over
    it); structured systems are checked the same way."""

    def solve(d, decay):
        return solve_lv(LotkaVolterra(R, B_diag=d, decay=decay), M0, TS).ys

    batched = jax.jit(jax.vmap(solve))
    d = np.array([[1.0, 0.5, 0.25], [2.0, 1.0, 0.5]])
    with pytest.raises(RuntimeError, match="`decay` must be finite and >= 0"):
        batched(d, np.array([0.1, -0.5]))
    with pytest.raises(RuntimeError, match="`B_diag` must be finite and non-negative"):
        batched(d * [[1, 1, 1], [1, 1, -1]], np.zeros(2))
    # a dense B, batched: the one indefinite member is named
    stack = np.stack([B_GOOD, B_BAD["indefinite"]])
    with pytest.raises(RuntimeError, match="`B` must be positive semi-definite"):
        jax.vmap(lambda B: LotkaVolterra(R, B).interactions.B)(stack)
    good = jax.vmap(lambda B: LotkaVolterra(R, B).interactions.B)(
        np.stack([B_GOOD] * 2)
    )
    np.testing.assert_array_equal(good, np.stack([B_GOOD] * 2))
    # a good batch: independent logistic modes, m(t) = m* / (1 + (m*/m0 - 1)
    # e^{-(r - decay) t}) with m* = (r - decay) / d
    decay = np.array([0.1, 0.2])
    m = batched(d, decay)
    r_eff = R[None, :] - decay[:, None]
    mstar = r_eff / d
    exact = mstar[:, None, :] / (
        1
        + (mstar[:, None, :] / M0 - 1) * np.exp(-r_eff[:, None, :] * TS[None, :, None])
    )
    # default float64 tolerance 1e-9 on log m
    np.testing.assert_allclose(m, exact, rtol=1e-7)


def test_structured_system_holds_o_pq_memory():
    """Issue: a diagonal system at p = 10,000 held a 2.6 GB dense `B`. The
    structured system holds `d` and `U` only (`LowRankInteractions`); its methods
    agree with
    the dense matrix (checked at a small p, where the matrix can be built)."""
    p, q = 10_000, 4
    rng = np.random.default_rng(0)
    d = rng.uniform(0.5, 1.5, p)
    U = rng.standard_normal((p, q)) / np.sqrt(p)
    lv = LotkaVolterra(rng.uniform(size=p), B_diag=d, B_factor=U)
    # no p x p matrix held; the parts are held as given
    assert isinstance(lv.interactions, LowRankInteractions)
    np.testing.assert_array_equal(lv.interactions.d, d)
    np.testing.assert_array_equal(lv.interactions.U, U)
    assert max(leaf.size for leaf in jax.tree.leaves(lv)) == p * q
    # a concrete, exactly diagonal dense B is stored as its diagonal
    small = LotkaVolterra(R, np.diag([1.0, 0.0, 2.0]))
    assert isinstance(small.interactions, DiagonalInteractions)
    np.testing.assert_array_equal(small.interactions.d, [1.0, 0.0, 2.0])

    # the O(p q) methods against the dense matrix, p = 50
    p = 50
    d, U = d[:p], U[:p] * np.sqrt(10_000 / p)
    r, m = rng.uniform(size=p), rng.uniform(size=(3, p))
    lv = LotkaVolterra(r, B_diag=d, B_factor=U, decay=0.1, loss_scale=2.0)
    B = np.diag(d) + U @ U.T
    dense = LotkaVolterra(r, B, 0.1, loss_scale=2.0)
    # the dense system holds the matrix it was given (symmetric to roundoff)
    np.testing.assert_allclose(dense.interactions.B, B, rtol=1e-15, atol=0)
    # rounding of sums of q + 1 terms against a p-term product: 1e-13
    np.testing.assert_allclose(lv.interactions.as_matrix(), B, rtol=1e-14)
    np.testing.assert_allclose(lv.self_interactions(), np.diag(B), rtol=1e-14)
    np.testing.assert_allclose(dense.self_interactions(), np.diag(B), rtol=1e-14)
    np.testing.assert_allclose(lv.interactions(m), m @ B, rtol=1e-13)
    np.testing.assert_allclose(lv.loss(m), dense.loss(m), rtol=1e-13)
    np.testing.assert_allclose(
        lv.vector_field(m[0]), m[0] * (r - B @ m[0] - 0.1), rtol=1e-13
    )
    np.testing.assert_allclose(
        lv.fixed_point_isolated(), (r - 0.1) / np.diag(B), rtol=1e-14
    )


def test_float32_system():
    """float32 inputs (the default without x64) give a float32 system, checked the
    same way eagerly and under jit."""
    r32, B32 = R.astype(np.float32), B_GOOD.astype(np.float32)
    lv = LotkaVolterra(r32, B32, np.float32(0.1))
    assert lv.r.dtype == lv.interactions.B.dtype == lv.decay.dtype == np.float32
    structured = LotkaVolterra(r32, B_diag=np.ones(3, np.float32))
    assert structured.self_interactions().dtype == np.float32
    with pytest.raises(ValueError, match="`B` must be positive semi-definite"):
        LotkaVolterra(r32, B_BAD["indefinite"].astype(np.float32))
    # (a check guards the field it is threaded into: return the whole system)
    build = jax.jit(lambda B, decay: LotkaVolterra(r32, B, decay))
    with pytest.raises(RuntimeError, match="`decay` must be finite and >= 0"):
        build(B32, np.float32(-0.5))
    with pytest.raises(RuntimeError, match="`B` must be symmetric"):
        build(B_BAD["non-symmetric"].astype(np.float32), np.float32(0.0))
    assert build(B32, np.float32(0.1)).interactions.B.dtype == np.float32


def test_from_interactions_and_deprecated_aliases():
    """`LotkaVolterra(r, interactions)` holds the module as given (cast to the
    common dtype); a wrong size is refused. The fields of earlier releases, `B`,
    `B_dense`, `B_diag` and `B_factor`, are read with a `DeprecationWarning` at
    the caller, for every form."""
    d, U = np.array([1.0, 0.5, 0.25]), np.array([[0.1], [0.2], [0.3]])
    low_rank = LotkaVolterra(R.astype(np.float32), LowRankInteractions(d, U))
    assert isinstance(low_rank.interactions, LowRankInteractions)
    assert low_rank.interactions.U.dtype == np.float64  # the common dtype
    with pytest.raises(ValueError, match="size 2"):
        LotkaVolterra(R, DiagonalInteractions(np.ones(2)))
    B = np.diag(d) + U @ U.T
    dense = LotkaVolterra(R, DenseInteractions(B))
    diagonal = LotkaVolterra(R, B_diag=d)
    with pytest.warns(DeprecationWarning, match="interactions.as_matrix") as record:
        np.testing.assert_allclose(low_rank.B, B, rtol=1e-15)
    assert record[0].filename == __file__
    with pytest.warns(DeprecationWarning):
        assert low_rank.B_dense is None and diagonal.B_dense is None
        np.testing.assert_array_equal(dense.B_dense, B)
        np.testing.assert_array_equal(dense.B, B)
        assert dense.B_diag is None and dense.B_factor is None
        np.testing.assert_array_equal(low_rank.B_diag, d)
        np.testing.assert_array_equal(low_rank.B_factor, U)
        np.testing.assert_array_equal(diagonal.B_diag, d)
        assert diagonal.B_factor.shape == (3, 0)
        np.testing.assert_array_equal(diagonal.B, np.diag(d))
