"""The structures: real layers against their quadratic forms."""

import inspect

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    STRUCTURE_CASES,
    all_structures,
    jit_A,
    jit_layer,
    jit_nqf,
    jit_unit,
    n_units,
    random_input,
    structure_id,
)

import nqfjax


STRUCTURES = all_structures()
parametrize_structures = pytest.mark.parametrize(
    "structure", STRUCTURES, ids=structure_id
)


def _weights(structure, key, scale=1.0, m=None, dtype=jnp.float64):
    m = n_units(structure) if m is None else m
    return scale * jax.random.normal(key, (structure.p, m), dtype)


def _odd_like(activation) -> bool:
    """Whether sigma''(0) = 0, so that a * sigma(u.x) has no cubic term."""
    curvature = jax.grad(jax.grad(activation))(jnp.zeros(()))
    return abs(float(curvature)) < 1e-12


def expected_order(structure) -> int | None:
    """The order in `scale` of `layer(scale W) - layer(0) - scale^2 nqf(W)`.

    `None` means the quadratic form is exact. The orders, from the layers' Taylor
    series:

    - `a * sigma(u . x)` units (Perceptron, Conv1D, factor-gated experts
      `(r . x) sigma(u . x)`): 3 when sigma''(0) != 0 (silu), 4 for odd sigma
      (tanh, sin), whose cubic term vanishes.
    - QuadraticNet, linear QK attention and OV heads with uniform attention:
      exact (the unit is a polynomial of degree 2 in `w`).
    - Softmax QK attention and OV heads with their own QK circuit: 4 (the
      logits are O(scale^2) and the softmax's correction multiplies them, or an
      O(scale^2) OV product).
    - Softmax-routed experts: 3 (router logits are O(scale), g = 1/E + O(scale),
      times an O(scale^2) expert).
    """
    if isinstance(structure, nqfjax.QuadraticNet):
        return None
    if isinstance(structure, nqfjax.QKAttention):
        return 4 if structure.softmax else None
    if isinstance(structure, nqfjax.OVAttention):
        return 4 if structure.learn_qk else None
    if isinstance(structure, nqfjax.MixtureOfExperts) and structure.gate == "softmax":
        return 3
    return 4 if _odd_like(structure.activation) else 3


def test_defaults_alone():
    # Every class is usable with no arguments; the shapes agree with p, k and
    # input_shape, and A is finite.
    for cls in (
        nqfjax.Perceptron,
        nqfjax.QuadraticNet,
        nqfjax.QKAttention,
        nqfjax.OVAttention,
        nqfjax.MixtureOfExperts,
        nqfjax.Conv1D,
    ):
        s = cls()
        x = jnp.linspace(-1.0, 1.0, int(np.prod(s.input_shape)))
        x = x.reshape(s.input_shape)
        W = jnp.full((s.p, n_units(s)), 0.1)
        A = jit_A(s, x)
        assert A.shape == (s.k, s.p, s.p) and np.all(np.isfinite(A))
        assert jit_layer(s, W, x).shape == (s.k,)
        assert jit_unit(s, W[:, 0], x).shape == (s.k,)
    # The sizes the docstrings state.
    assert nqfjax.QKAttention().p == 6 and nqfjax.QKAttention().input_shape == (4, 3)
    assert nqfjax.OVAttention().p == 1 + 3
    assert nqfjax.OVAttention(learn_qk=True).p == 1 + 3 * 3
    assert nqfjax.MixtureOfExperts().p == 3 + 1 + 3
    assert nqfjax.MixtureOfExperts(gate="factor").p == 6
    assert nqfjax.Conv1D().p == 6 + 3  # P = 8 - 3 + 1 patches, s = 3
    assert nqfjax.Conv1D(stride=2).positions == 3
    assert nqfjax.Conv1D(pool=True).p == 1 + 3


@parametrize_structures
def test_A_symmetric(structure, getkey):
    for _ in range(3):
        A = jit_A(structure, random_input(structure, getkey()))
        assert A.shape == (structure.k, structure.p, structure.p)
        # Built symmetric by construction: equal up to round-off of one product.
        np.testing.assert_allclose(A, jnp.swapaxes(A, 1, 2), rtol=0, atol=1e-15)
        assert np.any(A != 0)


@eqx.filter_jit
def _hooks_and_generic(structure, xs, X, c):
    """The structure's batch hooks, and the generic path through the stacked
    `A(x_s)` (the base class's defaults, and the einsum they stand for)."""
    A = jax.vmap(structure.A)(xs)
    base = nqfjax.AbstractStructure
    return dict(
        contract=(
            structure.contract(xs, X),
            base.contract(structure, xs, X),
            jnp.einsum("bkij,ij->bk", A, X),
        ),
        weighted_sum=(
            structure.weighted_sum(xs, c),
            base.weighted_sum(structure, xs, c),
            jnp.einsum("bk,bkij->ij", c, A),
        ),
    )


@parametrize_structures
def test_batch_hooks_match_A(structure, getkey):
    """The closed-form batch hooks that sampled tasks, the M-space flow and the
    quadratic model use instead of `A`:
    `contract(xs, X)_sj = Tr[A_j(x_s) X]` and
    `weighted_sum(xs, c) = sum_sj c_sj A_j(x_s)`, against the generic path (the
    defaults through `A`), for a symmetric `X` and for a general one (the hooks
    read both triangles, as `Tr[A X]` does)."""
    b = 5
    xs = jnp.stack([random_input(structure, getkey()) for _ in range(b)])
    G = jax.random.normal(getkey(), (structure.p, structure.p))
    c = jax.random.normal(getkey(), (b, structure.k))
    for X in (G + G.T, G):
        for name, (hook, default, dense) in _hooks_and_generic(
            structure, xs, X, c
        ).items():
            # the same sums in another order: float64 round-off only
            np.testing.assert_allclose(
                hook, dense, rtol=1e-12, atol=1e-12, err_msg=name
            )
            np.testing.assert_allclose(
                default, dense, rtol=1e-12, atol=1e-12, err_msg=name
            )
    with pytest.raises(ValueError, match=r"`xs` must have shape \(b, \*input_shape\)"):
        structure.contract(xs[0], G)


@eqx.filter_jit
def _factored_hooks(structure, xs, W, c):
    base = nqfjax.AbstractStructure
    # the modes' outputs F[(s, j), l] = Tr[A_j(x_s) w_l w_l^T], through `contract`
    F = jax.vmap(lambda w: structure.contract(xs, jnp.outer(w, w)))(W.T)
    F = F.reshape(W.shape[1], -1)
    return dict(
        mode_gram=(structure.mode_gram(xs, W), F @ F.T),
        contract_factor=(
            structure.contract_factor(xs, W),
            base.contract_factor(structure, xs, W),
        ),
        weighted_apply=(
            structure.weighted_apply(xs, c, W),
            base.weighted_apply(structure, xs, c, W),
        ),
    )


@parametrize_structures
@pytest.mark.parametrize("r", [1, 3])
def test_factored_hooks_match_the_defaults(structure, r, getkey):
    """The closed-form factored hooks of the factored M-space flow,
    `contract_factor(xs, W)_sj = Tr[A_j(x_s) W W^T]` and
    `weighted_apply(xs, c, W) = sum_sj c_sj A_j(x_s) W`, against the defaults
    (through `contract(xs, W W^T)` and `weighted_sum(xs, c) @ W`), and
    `mode_gram(xs, W)` against F^T F with the columns' outputs from `contract`,
    float64."""
    b = 5
    xs = jnp.stack([random_input(structure, getkey()) for _ in range(b)])
    W = jax.random.normal(getkey(), (structure.p, r), jnp.float64)
    c = jax.random.normal(getkey(), (b, structure.k), jnp.float64)
    for name, (hook, default) in _factored_hooks(structure, xs, W, c).items():
        assert hook.shape == default.shape and hook.dtype == W.dtype, name
        np.testing.assert_allclose(hook, default, rtol=1e-12, atol=1e-12, err_msg=name)
    with pytest.raises(ValueError, match=r"`xs` must have shape \(b, \*input_shape\)"):
        structure.contract_factor(xs[0], W)


@parametrize_structures
def test_additive_sum_of_units(structure, getkey):
    x = random_input(structure, getkey())
    W = _weights(structure, getkey(), scale=0.7)
    zero = jnp.zeros_like(W)

    def gap(W):
        lhs = jit_layer(structure, W, x) - jit_layer(structure, zero, x)
        rhs = sum(jit_unit(structure, W[:, i], x) for i in range(W.shape[1]))
        return float(jnp.max(jnp.abs(lhs - rhs))), float(jnp.max(jnp.abs(lhs)))

    if structure.additive:
        # Exact identity; the difference is round-off of O(1) sums in float64.
        assert gap(W)[0] < 1e-13
    else:
        # The flag is honest: at O(1) weights the units do interact ...
        assert gap(W)[0] > 1e-6
        # ... but only beyond leading order: at scale 1e-3 the interaction is
        # O(scale^3) (router) or O(scale^4) (softmax logits) against an O(scale^2)
        # signal, so the relative gap is at most ~ scale.
        small_gap, signal = gap(1e-3 * W)
        assert small_gap < 1e-2 * signal


@eqx.filter_jit
def _layer_hessian(structure, x, W):
    return jax.hessian(lambda W: structure.layer(W, x))(W)


@parametrize_structures
def test_hessian_block_diagonal(structure, getkey):
    # The Hessian of the real layer at W = 0 is block-diagonal over units with
    # blocks 2 A(x): for the additive and the softmax cases.
    x = random_input(structure, getkey())
    m = n_units(structure)
    H = _layer_hessian(structure, x, jnp.zeros((structure.p, m)))
    A = jit_A(structure, x)
    expected = jnp.einsum("kab,ij->kaibj", 2 * A, jnp.eye(m))
    # Autodiff of the layer vs closed form in float64: agreement to round-off.
    np.testing.assert_allclose(H, expected, rtol=0, atol=1e-12)


@eqx.filter_jit
def _residuals(structure, W, x, scales):
    f0 = structure.layer(jnp.zeros_like(W), x)
    quad = nqfjax.nqf_apply(structure, W, x)

    def one(s):
        return jnp.linalg.norm(structure.layer(s * W, x) - f0 - s**2 * quad)

    return jax.vmap(one)(scales), jnp.linalg.norm(f0), jnp.linalg.norm(quad)


@parametrize_structures
def test_quadratic_order(structure, getkey):
    # layer(s W) - layer(0) - s^2 nqf(W) = O(s^order); fit the log-log slope.
    x = random_input(structure, getkey())
    W = _weights(structure, getkey())
    scales = np.logspace(-1, -4, 7)
    residual, f0, quad = map(np.asarray, _residuals(structure, W, x, scales))
    order = expected_order(structure)
    if order is None:
        # Exact quadratic form: only float64 round-off relative to the signal.
        assert np.all(residual <= 1e-12 * scales**2 * quad)
        return
    # layer(s W) carries round-off eps |layer(0)| (softmax attention's offset is
    # the mean value): points within 30x of that floor measure round-off, not the
    # expansion, and are left out of the fit. At least 5 of the 7 must remain.
    keep = residual > 30 * np.finfo(np.float64).eps * (f0 + scales**2 * quad)
    assert keep.sum() >= 5, residual
    slope = np.polyfit(np.log(scales[keep]), np.log(residual[keep]), 1)[0]
    # Points over >= 2 decades; the next-order term bends the first point by a
    # few percent, so 0.15 separates order 3 from order 4 with margin.
    assert abs(slope - order) < 0.15, (slope, order)


@parametrize_structures
def test_layer_permutation_invariance(structure, getkey):
    x = random_input(structure, getkey())
    W = _weights(structure, getkey(), scale=0.5)
    perm = jax.random.permutation(getkey(), W.shape[1])
    # Units are interchangeable: the same sums in another order (round-off only).
    np.testing.assert_allclose(
        jit_layer(structure, W[:, perm], x),
        jit_layer(structure, W, x),
        rtol=1e-13,
        atol=1e-14,
    )


@eqx.filter_jit
def _batched(structure, W, xs):
    return (
        jax.vmap(structure.A)(xs),
        jax.vmap(structure.layer, in_axes=(None, 0))(W, xs),
        jax.vmap(structure.unit, in_axes=(None, 0))(W[:, 0], xs),
    )


@eqx.filter_jit
def _value_and_grad(structure, W, x, c):
    return jax.value_and_grad(lambda W: jnp.dot(c, structure.layer(W, x)))(W)


@parametrize_structures
def test_jit_vmap_grad(structure, getkey):
    xs = jnp.stack([random_input(structure, getkey()) for _ in range(3)])
    W = _weights(structure, getkey(), scale=0.5)
    A, f, u = _batched(structure, W, xs)
    for i in range(3):
        # jit + vmap against unbatched compiled calls: same float64 arithmetic.
        np.testing.assert_allclose(
            A[i], jit_A(structure, xs[i]), rtol=1e-13, atol=1e-14
        )
        np.testing.assert_allclose(
            f[i], jit_layer(structure, W, xs[i]), rtol=1e-12, atol=1e-14
        )
        np.testing.assert_allclose(
            u[i], jit_unit(structure, W[:, 0], xs[i]), rtol=1e-12, atol=1e-14
        )
    # grad of the layer against a central finite difference along a random
    # direction: truncation h^2 |third derivative| ~ 1e-10, round-off eps/h ~ 1e-11.
    c = jnp.arange(1.0, structure.k + 1.0)
    _, g = _value_and_grad(structure, W, xs[0], c)
    V = jax.random.normal(getkey(), W.shape)
    h = 1e-5
    fp, _ = _value_and_grad(structure, W + h * V, xs[0], c)
    fm, _ = _value_and_grad(structure, W - h * V, xs[0], c)
    np.testing.assert_allclose(
        jnp.sum(g * V), (fp - fm) / (2 * h), rtol=1e-7, atol=1e-9
    )


@parametrize_structures
def test_float32(structure, getkey):
    x = random_input(structure, getkey())
    W = _weights(structure, getkey(), scale=0.5)
    x32, W32 = x.astype(jnp.float32), W.astype(jnp.float32)
    A32 = jit_A(structure, x32)
    f32 = jit_layer(structure, W32, x32)
    assert A32.dtype == jnp.float32 and f32.dtype == jnp.float32
    assert jit_unit(structure, W32[:, 0], x32).dtype == jnp.float32
    assert jit_nqf(structure, W32, x32).dtype == jnp.float32
    # float32 round-off (eps 1.2e-7) over a handful of O(1) operations.
    np.testing.assert_allclose(A32, jit_A(structure, x), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(f32, jit_layer(structure, W, x), rtol=1e-5, atol=1e-5)


@parametrize_structures
def test_bad_inputs(structure, getkey):
    x = random_input(structure, getkey())
    W = _weights(structure, getkey())
    bad_x = jnp.zeros((*structure.input_shape, 2))
    with pytest.raises(ValueError, match="`x` must have shape"):
        structure.A(bad_x)
    with pytest.raises(ValueError, match="`x` must have shape"):
        structure.layer(W, bad_x)
    with pytest.raises(ValueError, match=r"`W` must have shape \(p, m\)"):
        structure.layer(jnp.zeros((structure.p + 1, 2)), x)
    with pytest.raises(ValueError, match=r"`W` must have shape \(p, m\)"):
        structure.layer(jnp.zeros(structure.p), x)
    with pytest.raises(ValueError, match="`w` must have shape"):
        structure.unit(jnp.zeros(structure.p + 1), x)
    # Values are checked by the entry points (`nqf_apply`, `task_from_samples`,
    # `train`), not by these per-input methods, which run inside their loops:
    # a NaN input propagates, it is never replaced by a finite number.
    nan_x = x.at[(0,) * x.ndim].set(jnp.nan)
    assert np.any(np.isnan(jit_A(structure, nan_x)))
    assert np.all(np.isnan(jit_layer(structure, W, nan_x)))
    with pytest.raises(ValueError, match="`x` contains NaN"):
        nqfjax.nqf_apply(structure, W, nan_x)
    # Under jit the same message arrives through eqx.error_if at run time.
    with pytest.raises(eqx.EquinoxRuntimeError, match="`x` contains NaN"):
        jit_nqf(structure, W, nan_x)


@pytest.mark.parametrize(
    "make",
    [
        lambda act: nqfjax.Perceptron(activation=act),
        lambda act: nqfjax.Conv1D(activation=act),
        lambda act: nqfjax.MixtureOfExperts(activation=act),
        lambda act: nqfjax.MixtureOfExperts(gate="factor", activation=act),
    ],
    ids=["Perceptron", "Conv1D", "MoE-softmax", "MoE-factor"],
)
def test_bad_activation(make):
    with pytest.raises(ValueError, match=r"`activation` must satisfy sigma\(0\) = 0"):
        make(jax.nn.sigmoid)
    with pytest.raises(ValueError, match=r"`activation` must have a finite nonzero"):
        make(lambda z: z**2)


def test_constructor_errors():
    with pytest.raises(ValueError, match="`query`"):
        nqfjax.QKAttention(T=4, query=4)
    with pytest.raises(ValueError, match="`query`"):
        nqfjax.OVAttention(T=4, query=-5)
    with pytest.raises(ValueError, match="`temperature`"):
        nqfjax.QKAttention(temperature=0.0)
    with pytest.raises(ValueError, match="`temperature`"):
        nqfjax.OVAttention(temperature=-1.0)
    with pytest.raises(
        ValueError, match=r"`values` must have shape \(T, k\) = \(5, k\)"
    ):
        nqfjax.QKAttention(T=5, values=jnp.ones((4, 2)))
    with pytest.raises(
        ValueError, match=r"`values` must have shape \(T, k\) = \(T, 3\)"
    ):
        nqfjax.QKAttention(k=3, values=jnp.ones((4, 2)))
    with pytest.raises(ValueError, match="`values` contains NaN"):
        nqfjax.QKAttention(values=jnp.array([0.0, jnp.nan, 1.0]))
    with pytest.raises(ValueError, match="`gate`"):
        nqfjax.MixtureOfExperts(gate="top1")  # pyright: ignore
    with pytest.raises(ValueError, match="`k` must be 1"):
        nqfjax.MixtureOfExperts(gate="factor", k=2)
    with pytest.raises(ValueError, match="`length` must be >= `kernel_size`"):
        nqfjax.Conv1D(length=2, kernel_size=3)
    with pytest.raises(ValueError, match="`stride` must be >= 1, got 0"):
        nqfjax.Conv1D(stride=0)
    moe = nqfjax.MixtureOfExperts(experts=3)
    with pytest.raises(ValueError, match="`W` must have at most 3 columns"):
        moe.layer(jnp.zeros((moe.p, 4)), jnp.ones(3))
    # A 1-D `values` means one output.
    s = nqfjax.QKAttention(values=jnp.arange(5.0))
    assert (s.T, s.k, s.input_shape) == (5, 1, (5, 3))


_STATIC_INT = "must be a static Python int"


@pytest.mark.parametrize(
    "make, name, message",
    [
        (lambda: nqfjax.Perceptron(d=2.5), "d", _STATIC_INT),
        (lambda: nqfjax.Perceptron(k=np.float64(2)), "k", _STATIC_INT),
        (lambda: nqfjax.Perceptron(d=True), "d", _STATIC_INT),
        (lambda: nqfjax.Perceptron(k=0), "k", "must be >= 1"),
        (lambda: nqfjax.QuadraticNet(d=4.0), "d", _STATIC_INT),
        (lambda: nqfjax.QKAttention(T=4.5), "T", _STATIC_INT),
        (lambda: nqfjax.QKAttention(d=1.5), "d", _STATIC_INT),
        (lambda: nqfjax.QKAttention(k=2.0), "k", _STATIC_INT),
        (lambda: nqfjax.QKAttention(query=1.0), "query", _STATIC_INT),
        (lambda: nqfjax.QKAttention(query=True), "query", _STATIC_INT),
        (lambda: nqfjax.QKAttention(softmax=1), "softmax", "must be a bool"),
        (
            lambda: nqfjax.QKAttention(temperature="hot"),
            "temperature",
            "must be finite",
        ),
        (lambda: nqfjax.OVAttention(T=2.5), "T", _STATIC_INT),
        (lambda: nqfjax.OVAttention(d=0), "d", "must be >= 1"),
        (lambda: nqfjax.OVAttention(k=1.5), "k", _STATIC_INT),
        (lambda: nqfjax.OVAttention(query=-1.0), "query", _STATIC_INT),
        (lambda: nqfjax.OVAttention(learn_qk="yes"), "learn_qk", "must be a bool"),
        (lambda: nqfjax.MixtureOfExperts(experts=2.5), "experts", _STATIC_INT),
        (lambda: nqfjax.MixtureOfExperts(d=3.0), "d", _STATIC_INT),
        (lambda: nqfjax.MixtureOfExperts(k=-1), "k", "must be >= 1"),
        (lambda: nqfjax.Conv1D(length=8.5), "length", _STATIC_INT),
        (lambda: nqfjax.Conv1D(kernel_size=3.0), "kernel_size", _STATIC_INT),
        (lambda: nqfjax.Conv1D(stride=1.5), "stride", _STATIC_INT),
        (lambda: nqfjax.Conv1D(pool="False"), "pool", "must be a bool"),
    ],
)
def test_integer_and_flag_arguments(make, name, message):
    """Sizes, indices and flags fix shapes and branches: a float, a bool for an
    int or a string for a bool is refused, naming the argument (a float such as
    2.5 would otherwise surface as a shape error far away, "False" would count as
    true). They are static, so the same holds when built inside `jit`."""
    with pytest.raises(ValueError, match=f"`{name}` {message}"):
        make()
    with pytest.raises(ValueError, match=f"`{name}` {message}"):
        jax.jit(lambda x: (make(), x)[1])(0.0)


def test_integer_arguments_are_normalised():
    # numpy integers are accepted and stored as Python ints (hashable statics)
    s = nqfjax.Conv1D(length=np.int64(9), kernel_size=np.int32(3), pool=np.bool_(1))
    assert (type(s.length), type(s.kernel_size), type(s.pool)) == (int, int, bool)
    assert s == nqfjax.Conv1D(length=9, kernel_size=3, pool=True)
    assert nqfjax.QKAttention(query=np.int64(-2)).query == -2


def test_closed_forms_follow_the_table():
    # The theory's table of A(x), written out in numpy independently of the library's
    # block code. Tolerances: float64 round-off of a few products.
    rng = np.random.default_rng(0)
    T, d = 4, 3
    x = rng.standard_normal((T, d))
    v = rng.standard_normal((T, 2))

    def pair(left, right, c=1.0):
        n, m = len(left), len(right)
        out = np.zeros((n + m, n + m))
        out[:n, n:] = 0.5 * c * np.outer(left, right)
        out[n:, :n] = out[:n, n:].T
        return out

    lin = nqfjax.QKAttention(values=v, softmax=False, query=2)
    for j in range(2):
        np.testing.assert_allclose(
            jit_A(lin, x)[j], pair(x[2], v[:, j] @ x), atol=1e-14
        )
    soft = nqfjax.QKAttention(values=v, temperature=0.5)
    for j in range(2):
        z = (v[:, j] - v[:, j].mean()) @ x / T
        np.testing.assert_allclose(jit_A(soft, x)[j], pair(x[-1], z) / 0.5, atol=1e-14)

    # OV: (o, v) block with e_j and the mean token.
    ov = nqfjax.OVAttention(T=T, d=d, k=1)
    np.testing.assert_allclose(jit_A(ov, x)[0], pair([1.0], x.mean(0)), atol=1e-15)
    ov_qk = nqfjax.OVAttention(T=T, d=d, k=1, learn_qk=True)
    expected = np.zeros((10, 10))
    expected[:4, :4] = pair([1.0], x.mean(0))  # zero on the query-key block
    np.testing.assert_allclose(jit_A(ov_qk, x)[0], expected, atol=1e-15)

    # Experts: factor gate (c = 2 here) and softmax routing over E = 5 (1/E).
    y = x[0]
    gated = nqfjax.MixtureOfExperts(d=d, gate="factor", activation=lambda z: 2 * z)
    xx = np.outer(y, y)
    expected = np.block([[np.zeros((d, d)), xx], [xx, np.zeros((d, d))]])
    np.testing.assert_allclose(jit_A(gated, y)[0], expected, atol=1e-14)
    routed = nqfjax.MixtureOfExperts(d=d, k=1, experts=5)
    expected = np.zeros((7, 7))
    expected[3:, 3:] = pair([1.0], y) / 5  # router block (first d rows) is zero
    np.testing.assert_allclose(jit_A(routed, y)[0], expected, atol=1e-15)

    # Convolution: P x s patch matrix (stride 2), and its mean with pooling.
    signal = np.arange(1.0, 8.0)
    X = np.array([[1.0, 2, 3], [3, 4, 5], [5, 6, 7]])
    conv = nqfjax.Conv1D(length=7, kernel_size=3, stride=2)
    expected = 0.5 * np.block([[np.zeros((3, 3)), X], [X.T, np.zeros((3, 3))]])
    np.testing.assert_allclose(jit_A(conv, signal)[0], expected, atol=1e-15)
    pooled = nqfjax.Conv1D(length=7, kernel_size=3, stride=2, pool=True)
    np.testing.assert_allclose(
        jit_A(pooled, signal)[0], pair([1.0], X.mean(0)), atol=1e-15
    )


# --------------------------------------------------------------------------------
# AbstractStructure: the abstract/final pattern and a user's own structure

BUILTIN_CLASSES = (
    nqfjax.Perceptron,
    nqfjax.QuadraticNet,
    nqfjax.QKAttention,
    nqfjax.OVAttention,
    nqfjax.MixtureOfExperts,
    nqfjax.Conv1D,
)


def test_abstract_and_final():
    with pytest.warns(DeprecationWarning, match="use `nqfjax.AbstractStructure`"):
        assert nqfjax.Structure is nqfjax.AbstractStructure
    with pytest.warns(DeprecationWarning, match="use `AbstractStructure`"):
        assert nqfjax.structures.Structure is nqfjax.AbstractStructure
    with pytest.raises(TypeError):
        nqfjax.AbstractStructure()  # pyright: ignore
    for cls in BUILTIN_CLASSES:
        assert issubclass(cls, nqfjax.AbstractStructure)
        with pytest.raises(TypeError, match=f"`{cls.__name__}` is final"):
            type("Sub", (cls,), {})


def _docstring_example():
    """The `Bilinear` structure written out in `nqfjax.structures.base`'s
    docstring, executed as a user would paste it."""
    import nqfjax.structures.base as base_module

    code = base_module.__doc__.split("```python\n")[1].split("```")[0]
    namespace = {}
    exec(code, namespace)
    return namespace["Bilinear"](d=3)


def test_user_structure_from_the_docs(getkey):
    """The documented recipe gives a working structure: `A` equals half the
    Hessian of its unit (autodiff), the units add up exactly, the inherited
    batch hooks equal the stacked `A`, and a sampled task through it equals the
    dense reference (all float64 round-off)."""
    s = _docstring_example()
    assert (s.p, s.k, s.input_shape, s.additive) == (6, 1, (3,), True)
    xs = jax.random.normal(getkey(), (5, 3))
    x = xs[0]
    auto = nqfjax.structure_from_layer(s.unit, s.p)
    np.testing.assert_allclose(s.A(x), auto(x), rtol=0, atol=1e-12)
    W = jax.random.normal(getkey(), (6, 4))
    units = sum(s.unit(W[:, i], x) for i in range(4))
    np.testing.assert_allclose(s.layer(W, x), units, rtol=1e-13)
    # the quadratic form is exact here: Tr[W W^T A(x)] = layer
    np.testing.assert_allclose(
        nqfjax.nqf_apply(s, W, x), s.layer(W, x), rtol=1e-12, atol=1e-13
    )
    A = jax.vmap(s.A)(xs)
    X = jax.random.normal(getkey(), (6, 6))
    X = X + X.T
    c = jax.random.normal(getkey(), (5, 1))
    np.testing.assert_allclose(
        s.contract(xs, X), jnp.einsum("bkij,ij->bk", A, X), rtol=1e-12, atol=1e-12
    )
    np.testing.assert_allclose(
        s.weighted_sum(xs, c), jnp.einsum("bk,bkij->ij", c, A), rtol=1e-12
    )
    ys = jax.random.normal(getkey(), (5, 1))
    task = nqfjax.task_from_samples(s, xs, ys, batch_size=2)
    K4 = jnp.einsum("skij,skab->ijab", A, A) / 5
    np.testing.assert_allclose(
        task.K(X), jnp.einsum("ijab,ab->ij", K4, X), rtol=1e-12, atol=1e-12
    )


def test_legacy_private_spellings(getkey):
    """A subclass written against the previous release (`_A`, `_unit`, `_layer`,
    here wrapping a `QuadraticNet`) still works, with a `DeprecationWarning`
    naming the new method; so do the old private hook names on a built-in."""
    base = nqfjax.QuadraticNet(d=3)
    with pytest.warns(DeprecationWarning, match="implement `A`, `unit`, `layer`"):

        class Old(nqfjax.AbstractStructure):
            inner: nqfjax.QuadraticNet
            k = 1
            additive = True
            p = property(lambda self: self.inner.p)
            input_shape = property(lambda self: self.inner.input_shape)

            def _A(self, x):
                return 2.0 * self.inner.A(x)

            def _unit(self, w, x):
                return 2.0 * self.inner.unit(w, x)

            def _layer(self, W, x):
                return 2.0 * self.inner.layer(W, x)

    old = Old(base)
    x = jax.random.normal(getkey(), (3,))
    W = jax.random.normal(getkey(), (3, 2))
    # the public names forward to the old implementations (exact: one product)
    np.testing.assert_array_equal(old.A(x), 2.0 * base.A(x))
    np.testing.assert_array_equal(old.layer(W, x), 2.0 * base.layer(W, x))
    np.testing.assert_array_equal(old.unit(W[:, 0], x), 2.0 * base.unit(W[:, 0], x))
    xs = jax.random.normal(getkey(), (4, 3))
    M = W @ W.T
    with pytest.warns(DeprecationWarning, match="use `contract`"):
        got = base._contract(xs, M)
    np.testing.assert_array_equal(got, base.contract(xs, M))
    with pytest.warns(DeprecationWarning, match="use `layer`"):
        got = base._layer(W, x)
    np.testing.assert_array_equal(got, base.layer(W, x))


# --------------------------------------------------------------------------------
# The registry


def test_registry_covers_the_tests_and_the_constructors():
    """Every registered structure is in the list the tests parametrise over, every
    argument it lists is a keyword of its constructor, and `make_structure` with
    no arguments is the default instance."""
    names = nqfjax.structure_names()
    assert set(names) == {n for n, _ in STRUCTURE_CASES}
    assert {nqfjax.structure_class(n) for n in names} == set(BUILTIN_CLASSES)
    for name in names:
        cls = nqfjax.structure_class(name)
        params = inspect.signature(cls).parameters
        for arg, kind in nqfjax.structure_arguments(name).items():
            assert arg in params, (name, arg)
            assert kind in (int, float, bool, str)
        assert nqfjax.make_structure(name) == cls()
    s = nqfjax.make_structure("conv1d", length=9, stride=2, pool=True)
    assert s == nqfjax.Conv1D(length=9, stride=2, pool=True)
    # an int where a float is expected
    assert nqfjax.make_structure("qk_attention", temperature=2).temperature == 2.0
    with pytest.raises(TypeError):
        nqfjax.structure_arguments("perceptron")["d"] = float  # read-only


def test_registry_errors():
    with pytest.raises(ValueError, match="did you mean 'perceptron'"):
        nqfjax.make_structure("perceptrn")
    with pytest.raises(ValueError, match="`name` must be one of"):
        nqfjax.structure_class(3)  # pyright: ignore
    with pytest.raises(ValueError, match="`activation` is not an argument"):
        nqfjax.make_structure("perceptron", activation=jnp.sin)
    with pytest.raises(ValueError, match="`d` of 'perceptron' must be of type int"):
        nqfjax.make_structure("perceptron", d=True)
    with pytest.raises(ValueError, match="`pool` of 'conv1d' must be of type bool"):
        nqfjax.make_structure("conv1d", pool=1)
    with pytest.raises(ValueError, match="`temperature` .* must be of type float"):
        nqfjax.make_structure("qk_attention", temperature="hot")
    with pytest.raises(ValueError, match="`gate`"):  # the constructor's own check
        nqfjax.make_structure("moe", gate="top1")
