"""`AbstractInteractions`: each form against its own dense `as_matrix()` (float64),
its checks, and that nothing builds the `p x p` matrix of a structured system:
no `None` switch on the form is left in the package, and the first step of
`solve_lv` at p = 10,000 holds no `(p, p)` array."""

import pathlib
import re

import diffrax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nqfjax
from nqfjax import (
    AbstractInteractions,
    DenseInteractions,
    DiagonalInteractions,
    LotkaVolterra,
    LowRankInteractions,
    solve_lv,
    solve_lv_batch,
)
from nqfjax.engines import lv as lv_engine
from nqfjax.engines._rosenbrock import LVRosenbrock


P = 6


def _forms(p=P, seed=0):
    """One of each form, with generic entries."""
    rng = np.random.default_rng(seed)
    d = rng.uniform(0.2, 1.5, p)
    U = rng.normal(size=(p, 2)) / np.sqrt(p)
    G = rng.normal(size=(p, p))
    return {
        "dense": DenseInteractions(G @ G.T / p + np.diag(d)),
        "diagonal": DiagonalInteractions(d),
        "low_rank": LowRankInteractions(d, U),
        "low_rank_q0": LowRankInteractions(d, np.zeros((p, 0))),
    }


@pytest.mark.parametrize("form", ["dense", "diagonal", "low_rank", "low_rank_q0"])
def test_against_the_dense_matrix(form):
    """`mv` (one vector and a batch), `__call__`, `diagonal`, `quadratic` and the
    Rosenbrock solve `b -> gh (I + g B diag(m))^{-1} b` (for both signs of `g`,
    as backward in time) against numpy on `as_matrix()`, to rounding."""
    inter = _forms()[form]
    assert isinstance(inter, AbstractInteractions) and inter.size == P
    B = np.asarray(inter.as_matrix())
    assert B.shape == (P, P) and B.dtype == np.float64
    np.testing.assert_allclose(B, B.T, rtol=0, atol=1e-15)
    assert np.min(np.linalg.eigvalsh(B)) >= -1e-12
    rng = np.random.default_rng(1)
    m = rng.uniform(0.0, 2.0, size=(3, 4, P))
    np.testing.assert_allclose(inter.mv(m), m @ B, rtol=1e-13)
    np.testing.assert_allclose(inter(m[0, 0]), B @ m[0, 0], rtol=1e-13)
    np.testing.assert_allclose(inter.diagonal(), np.diag(B), rtol=1e-14)
    np.testing.assert_allclose(
        inter.quadratic(m), np.einsum("...k,kl,...l->...", m, B, m), rtol=1e-13
    )
    assert inter.is_diagonal() == (form in ("diagonal", "low_rank_q0"))
    mk, b = m[0, 0], rng.normal(size=P)
    for g, gh in ((0.3, 0.3), (-0.05, 0.05), (40.0, 40.0)):
        W = np.eye(P) + g * B * mk[None, :]
        want = gh * np.linalg.solve(W, b)
        got = inter.rosenbrock_solver(jnp.asarray(mk), g, gh)(jnp.asarray(b))
        np.testing.assert_allclose(got, want, rtol=1e-11, atol=1e-14)


def test_float32_solve_in_the_dtype_of_m():
    """The solve is in the dtype of `m` (a float32 state with float64
    interactions stays float32)."""
    for inter in _forms().values():
        m = jnp.ones(P, jnp.float32)
        out = inter.rosenbrock_solver(m, jnp.float32(0.1), jnp.float32(0.1))(m)
        assert out.dtype == jnp.float32


def test_checks_name_the_argument():
    with pytest.raises(ValueError, match="`B` must be positive semi-definite"):
        DenseInteractions(np.diag([1.0, -1.0]))
    with pytest.raises(ValueError, match="`B` must be a square matrix"):
        DenseInteractions(np.ones((2, 3)))
    with pytest.raises(ValueError, match="`d` must be finite and non-negative"):
        DiagonalInteractions([1.0, -1.0])
    with pytest.raises(ValueError, match=r"`d` must have shape \(p,\)"):
        DiagonalInteractions(np.ones((2, 2)))
    with pytest.raises(ValueError, match="`d` must be finite and non-negative"):
        LowRankInteractions([1.0, np.nan], np.ones((2, 1)))
    with pytest.raises(ValueError, match="`U` must be finite"):
        LowRankInteractions([1.0, 1.0], [[1.0], [np.inf]])
    with pytest.raises(ValueError, match=r"`U` must have shape \(2, q\)"):
        LowRankInteractions([1.0, 1.0], np.ones((3, 1)))
    # under jit: a runtime error threaded into the field
    build = jax.jit(lambda d: DiagonalInteractions(d).diagonal())
    with pytest.raises(RuntimeError, match="`d` must be finite and non-negative"):
        build(jnp.array([1.0, -1.0]))


def test_a_pytree_under_vmap_and_grad():
    """A module of arrays: `vmap` over a batch of systems, `grad` through
    `quadratic` and through the Rosenbrock solve."""
    d = jnp.asarray(np.random.default_rng(2).uniform(0.5, 1.0, size=(3, P)))
    diag = jax.vmap(lambda d: LowRankInteractions(d, jnp.ones((P, 1))).diagonal())(d)
    np.testing.assert_allclose(diag, d + 1.0, rtol=1e-15)
    inter = _forms()["low_rank"]
    m = jnp.linspace(0.1, 1.0, P)
    grad = jax.grad(lambda i: i.quadratic(m))(inter)
    np.testing.assert_allclose(grad.d, m**2, rtol=1e-14)
    np.testing.assert_allclose(grad.U, 2 * np.outer(m, m @ inter.U), rtol=1e-14)

    def solved(inter):
        return jnp.sum(inter.rosenbrock_solver(m, 0.2, 0.2)(jnp.ones(P)))

    def dense(B):
        return jnp.sum(
            0.2 * jnp.linalg.solve(jnp.eye(P) + 0.2 * B * m[None, :], jnp.ones(P))
        )

    g = jax.grad(solved)(inter)
    g_dense = jax.grad(dense)(inter.as_matrix())
    # chain rule through B = diag(d) + U U^T
    np.testing.assert_allclose(g.d, np.diag(g_dense), rtol=1e-12)
    np.testing.assert_allclose(
        g.U, (g_dense + g_dense.T) @ np.asarray(inter.U), rtol=1e-12
    )


@pytest.mark.slow  # three solves compiled per form: ~20 s on two cores
def test_solve_lv_same_for_every_form():
    """The same system in each form gives the same `solve_lv` and
    `solve_lv_batch` solution (to the solver's rounding)."""
    forms = _forms(seed=3)
    low = forms["low_rank"]
    r = np.asarray(low.mv(jnp.ones(P)))  # m* = 1: every mode switches on
    m0, ts = np.full(P, 1e-8), np.geomspace(0.1, 200.0, 12)
    ref = solve_lv(LotkaVolterra(r, DenseInteractions(low.as_matrix())), m0, ts).ys
    got = solve_lv(LotkaVolterra(r, low), m0, ts).ys
    np.testing.assert_allclose(got, ref, rtol=1e-7)
    batch = solve_lv_batch(LotkaVolterra(r, low), np.stack([m0, m0]), ts).ys
    np.testing.assert_allclose(batch[1], ref, rtol=1e-7)
    diag = forms["diagonal"]
    r_d = np.asarray(diag.diagonal())
    dense_d = LotkaVolterra(r_d, DenseInteractions(diag.as_matrix()))
    np.testing.assert_allclose(
        solve_lv(LotkaVolterra(r_d, diag), m0, ts).ys,
        solve_lv(dense_d, m0, ts).ys,
        rtol=1e-7,
    )


# --- nothing densifies a structured system ----------------------------------------

_PACKAGE = pathlib.Path(nqfjax.__file__).parent
_SWITCHES = re.compile(
    r"B_factor is None|B_diag is None|B_dense is None|\bfactor is None|"
    r"\bdiag is None|mode ==|B_dense is not None|B_diag is not None"
)


def test_no_none_switch_on_the_form():
    """The form of the interactions is a type: the package source has no switch
    on which of its fields is None, and no `mode` string."""
    hits = [
        f"{path.relative_to(_PACKAGE)}:{i}: {line.strip()}"
        for path in sorted(_PACKAGE.rglob("*.py"))
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if _SWITCHES.search(line)
    ]
    assert hits == []


def _avals(jaxpr):
    """Every abstract value of a closed jaxpr and of the jaxprs inside it."""
    out = []
    for eqn in jaxpr.eqns:
        out += [v.aval for v in (*eqn.invars, *eqn.outvars) if hasattr(v, "aval")]
        for param in eqn.params.values():
            subs = param if isinstance(param, (tuple, list)) else (param,)
            for sub in subs:
                inner = getattr(sub, "jaxpr", None)
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    out += _avals(sub.jaxpr)
                elif isinstance(sub, jax.extend.core.Jaxpr):
                    out += _avals(sub)
                elif inner is not None and hasattr(inner, "eqns"):
                    out += _avals(inner)
    out += [v.aval for v in jaxpr.constvars]
    return out


@pytest.mark.slow  # p = 10,000: ~13 s of tracing and a short solve per form
@pytest.mark.parametrize("form", ["diagonal", "low_rank"])
def test_p_10000_first_step_holds_no_p_by_p_array(form, monkeypatch):
    """At p = 10,000 (a dense `B` would be 800 MB) the default solver's first
    step of `solve_lv` and the vector field hold no `(p, p)` array anywhere in
    their jaxpr, and a short `solve_lv` runs with `as_matrix` made to raise."""
    p, q = 10_000, 3
    rng = np.random.default_rng(4)
    d = rng.uniform(0.5, 1.5, p)
    inter = {
        "diagonal": DiagonalInteractions(d),
        "low_rank": LowRankInteractions(d, rng.normal(size=(p, q)) / np.sqrt(p)),
    }[form]
    lv = LotkaVolterra(rng.uniform(0.5, 1.0, p), inter)
    y0 = jnp.full(p, np.log(1e-6))
    y_max = jnp.asarray(177.0)
    args = (lv.r, lv.interactions, lv.decay, y_max)
    solver = LVRosenbrock(lv.interactions)
    term = diffrax.ODETerm(lv_engine._log_field)

    def first_step(y0):
        state = solver.init(term, 0.0, 0.1, y0, args)
        return solver.step(term, 0.0, 0.1, y0, args, state, False)[0]

    for f in (first_step, lambda y: lv_engine._rates(y, args)):
        shapes = {tuple(a.shape) for a in _avals(jax.make_jaxpr(f)(y0).jaxpr)}
        assert (p, p) not in shapes and (p,) in shapes

    def refuse(self):
        raise AssertionError("as_matrix called on a structured system")

    monkeypatch.setattr(type(inter), "as_matrix", refuse)
    sol = solve_lv(lv, np.full(p, 1e-6), [0.5, 1.0], max_steps=200)
    assert sol.ys.shape == (2, p) and bool(jnp.all(jnp.isfinite(sol.ys)))
    assert bool(jnp.all(sol.ys[-1] > 1e-6))  # the modes grow
