"""The jit-sensitive public functions give the same numbers with and without
`jax.jit` (chex variants), each checked against a float64 reference,
and reject one bad input each with the argument's name: a `ValueError` eagerly,
the same text as a runtime error (`eqx.error_if`) under `jit` and `vmap`.

The references: `A(x)` is the compiled closed form the other test modules share
(`helpers.jit_A`, checked against half the Hessian of the unit in
`test_structures`), so the eager variant is the jit-vs-eager comparison; the
quadratic form, the sampled task's loss and gradient, the power-law reduction,
the LV loss and the sharp-switch loss are their defining formulas in numpy;
`solve_lv` on independent modes is the logistic closed form. Every reference is
exact up to float64 round-off, so the tolerances are round-off ones (1e-12
relative unless a comment says otherwise): both variants meeting them means jit
and no-jit agree to 2e-12.
"""

import warnings

import chex
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl.testing import parameterized
from helpers import (
    all_structures,
    count_compiles,
    jit_A,
    jit_layer,
    n_units,
    random_input,
    structure_id,
    values,
)

import nqfjax


RTOL = 1e-12

STRUCTURES = [(structure_id(s), s) for s in all_structures()]


def _error_type(variant) -> type[Exception]:
    """Eagerly a bad value is a ValueError; under `jit` the check is an
    `eqx.error_if`, which raises a RuntimeError (jax's JaxRuntimeError)."""
    if variant.type == chex.ChexVariantType.WITHOUT_JIT:
        return ValueError
    return RuntimeError


def _sampled_reference(structure, xs, ys, M):
    """The sampled task's loss and gradient from their definitions,
    `L = mean_s |Tr[M A(x_s)] + f(x_s; 0) - y_s|^2 / 2` and
    `G = mean_s sum_j (Tr[M A_j(x_s)] + f_j(x_s; 0) - y_sj) A_j(x_s)`."""
    A = np.stack([np.asarray(jit_A(structure, x)) for x in xs])  # (n, k, p, p)
    zero = jnp.zeros((structure.p, 1))
    offsets = np.stack([np.asarray(jit_layer(structure, zero, x)) for x in xs])
    residual = np.einsum("skij,ij->sk", A, np.asarray(M)) + offsets - np.asarray(ys)
    loss = 0.5 * np.mean(np.sum(residual**2, axis=1))
    gradient = np.einsum("sk,skij->ij", residual, A) / len(xs)
    return loss, gradient


class TestJitAndEager(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.named_parameters(*STRUCTURES)
    def test_structure_matrix_and_quadratic_form(self, structure):
        keys = jax.random.split(jax.random.key(0), 2)
        x = random_input(structure, keys[0])
        W = jax.random.normal(keys[1], (structure.p, n_units(structure)))

        def forms(W, x):  # a closure: jax.jit cannot hash the module's arrays
            return structure.A(x), nqfjax.nqf_apply(structure, W, x)

        A, f = self.variant(forms)(W, x)
        chex.assert_shape(
            [A, f], [(structure.k, structure.p, structure.p), (structure.k,)]
        )
        # entries are O(1); atol covers the entries that vanish
        A_ref = np.asarray(jit_A(structure, x))
        f_ref = np.einsum("im,kij,jm->k", np.asarray(W), A_ref, np.asarray(W))
        chex.assert_trees_all_close((A, f), (A_ref, f_ref), rtol=RTOL, atol=1e-13)

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.named_parameters(
        ("perceptron", nqfjax.Perceptron(d=3, k=2)),
        # a structure with an offset f(x; 0) != 0 (the mean under a uniform softmax)
        ("qk_softmax", nqfjax.QKAttention(T=4, d=3, k=2, softmax=True)),
    )
    def test_sampled_task_loss_and_gradient(self, structure):
        keys = jax.random.split(jax.random.key(1), 3)
        xs = jax.random.normal(keys[0], (6, *structure.input_shape))
        ys = jax.random.normal(keys[1], (6, structure.k))
        task = nqfjax.task_from_samples(structure, xs, ys)
        X = jax.random.normal(keys[2], (structure.p, structure.p))
        M = 0.3 * (X @ X.T)

        def pieces(M):  # a closure: jax.jit cannot hash the task's arrays
            return task.loss(M), task.gradient(M)

        loss, gradient = self.variant(pieces)(M)
        loss_ref, gradient_ref = _sampled_reference(structure, xs, ys, M)
        chex.assert_trees_all_close(loss, loss_ref, rtol=RTOL)
        chex.assert_trees_all_close(gradient, gradient_ref, rtol=RTOL, atol=1e-13)

    @chex.variants(with_jit=True, without_jit=True)
    def test_power_law_reduction(self):
        # alpha and beta traced under jit (the reduction promises to trace); the
        # system is in flow time (the learning rate is the solver's argument)
        def reduce(alpha, beta):
            lv = nqfjax.power_law_task(8, alpha, beta).lotka_volterra()
            return lv.r, lv.interactions.diagonal(), lv.loss_scale, lv.loss_offset

        alpha, beta = 1.3, 0.4
        k = np.arange(1.0, 9.0)
        expected = (
            4 * k ** -(alpha + beta),  # r_k = 4 lam_k m*_k
            4 * k**-alpha,  # B_kk = 4 lam_k
            1 / 4,
            0.5 * np.sum(k**-alpha * k ** (-2 * beta)),  # E|y|^2 / 2
        )
        got = self.variant(reduce)(alpha, beta)
        chex.assert_trees_all_close(got, expected, rtol=RTOL)

    @chex.variants(with_jit=True, without_jit=True)
    def test_lotka_volterra_loss(self):
        rng = np.random.default_rng(2)
        U = rng.normal(size=(4, 2))
        d = rng.uniform(0.5, 1.5, 4)
        r = rng.uniform(0.1, 1.0, 4)
        m = rng.uniform(0.0, 1.0, (3, 4))  # a batch of states
        B = np.diag(d) + U @ U.T
        expected = 0.7 * (0.5 * np.einsum("bk,kl,bl->b", m, B, m) - m @ r) + 0.2

        def dense(r, B, m):
            return nqfjax.LotkaVolterra(r, B, loss_scale=0.7, loss_offset=0.2).loss(m)

        def structured(r, d, U, m):
            lv = nqfjax.LotkaVolterra(
                r, B_diag=d, B_factor=U, loss_scale=0.7, loss_offset=0.2
            )
            return lv.loss(m)

        chex.assert_trees_all_close(self.variant(dense)(r, B, m), expected, rtol=RTOL)
        chex.assert_trees_all_close(
            self.variant(structured)(r, d, U, m), expected, rtol=RTOL
        )

    @chex.variants(with_jit=True, without_jit=True)
    def test_sharp_switch_loss(self):
        alpha, beta, p = 1.0, 0.5, 6
        lv = nqfjax.power_law_task(p, alpha, beta).lotka_volterra()  # flow time
        m0 = jnp.full(p, 1e-8)
        ts = jnp.geomspace(1.0, 1e5, 40)
        got = self.variant(lambda m0, ts: nqfjax.sharp_switch_loss(lv, m0, ts))(m0, ts)
        # mode k jumps to m*_k = k^-beta at t_k = ln(m*_k / m0) / r_k; the loss is
        # what the modes still off leave: (1/2) sum_{t_k > t} lam_k m*_k^2
        k = np.arange(1.0, p + 1)
        lam, mstar = k**-alpha, k**-beta
        t_on = np.log(mstar / 1e-8) / (4 * lam * mstar)
        off = t_on[None, :] > np.asarray(ts)[:, None]
        expected = 0.5 * np.sum(off * lam * mstar**2, axis=1)
        assert 0 < off.sum() < off.size  # the times span the switch-ons
        chex.assert_trees_all_close(got, expected, rtol=RTOL)

    @chex.variants(with_jit=True, without_jit=True)
    def test_solve_lv_logistic_modes(self):
        # independent modes: each is the logistic m*/(1 + (m*/m0 - 1) e^{-r t})
        r = jnp.array([1.0, 0.4])
        B = jnp.array([2.0, 0.5])
        lv = nqfjax.LotkaVolterra(r, B_diag=B)
        m0 = jnp.array([1e-6, 1e-9])
        ts = jnp.linspace(1.0, 80.0, 17)
        m = values(self.variant(lambda m0: nqfjax.solve_lv(lv, m0, ts))(m0))
        chex.assert_shape(m, (17, 2))
        mstar = np.asarray(r / B)
        t = np.asarray(ts)[:, None]
        expected = mstar / (
            1 + (mstar / np.asarray(m0) - 1) * np.exp(-np.asarray(r) * t)
        )
        # the default float64 tolerance is atol 1e-9 on log m, i.e. a relative
        # error of m; measured 5e-10 over both switch-ons (jit and eager equal
        # bit for bit): 1e-8 leaves a 20x margin
        chex.assert_trees_all_close(m, expected, rtol=1e-8, atol=0)

    # -- one bad input each: the same message eagerly, under jit and under vmap

    @chex.variants(with_jit=True, without_jit=True)
    def test_nqf_apply_rejects_nan_weights(self):
        s = nqfjax.Perceptron(d=3, k=2)
        x = jnp.ones(3)
        bad = jnp.ones((5, 2)).at[1, 1].set(jnp.nan)
        apply = self.variant(lambda W: nqfjax.nqf_apply(s, W, x))
        with self.assertRaisesRegex(_error_type(self.variant), "`W` contains NaN"):
            apply(bad)
        batched = self.variant(jax.vmap(lambda W: nqfjax.nqf_apply(s, W, x)))
        with self.assertRaisesRegex(RuntimeError, "`W` contains NaN"):
            batched(jnp.stack([jnp.ones((5, 2)), bad]))

    @chex.variants(with_jit=True, without_jit=True)
    def test_power_law_reduction_rejects_bad_eta(self):
        # the deprecated learning-rate argument (one release) keeps its checks,
        # eagerly and traced; its DeprecationWarning is tested in test_lv.py
        def deprecated(eta):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                return nqfjax.power_law_task(4, 1.0, 0.5).lotka_volterra(eta)

        reduce = self.variant(lambda eta: deprecated(eta).r)
        with self.assertRaisesRegex(
            _error_type(self.variant), "`learning_rate` must be strictly"
        ):
            reduce(-0.1)
        batched = self.variant(jax.vmap(reduce))
        with self.assertRaisesRegex(RuntimeError, "`learning_rate` must be strictly"):
            batched(jnp.array([0.1, 0.0]))
        # and good values pass through the same programs
        chex.assert_trees_all_close(
            batched(jnp.array([0.1, 0.2])),
            4 * np.array([[0.1], [0.2]]) * np.arange(1.0, 5.0) ** -1.5,
            rtol=RTOL,
        )

    @chex.variants(with_jit=True, without_jit=True)
    def test_sharp_switch_loss_rejects_nonpositive_m0(self):
        lv = nqfjax.power_law_task(4, 1.0, 0.5).lotka_volterra()
        ts = jnp.geomspace(1.0, 1e3, 5)
        loss = self.variant(lambda m0: nqfjax.sharp_switch_loss(lv, m0, ts))
        bad = jnp.array([1e-6, 0.0, 1e-6, 1e-6])
        with self.assertRaisesRegex(_error_type(self.variant), "`m0` must be strictly"):
            loss(bad)
        batched = self.variant(jax.vmap(loss))
        with self.assertRaisesRegex(RuntimeError, "`m0` must be strictly"):
            batched(jnp.stack([jnp.full(4, 1e-6), bad]))


# -- "compiles once": a second call with new values of the same shapes traces and
# compiles nothing, where a docstring promises it. The inputs of each call are
# built before `count_compiles`, since an eager op on them may compile too.


def test_train_compiles_once_per_static_configuration():
    # `train`: "jitted once per static configuration; optimizer factories are
    # static and compared by identity". The factory runs once per trace.
    structure = nqfjax.Perceptron(d=3, k=2)
    rng = np.random.default_rng(3)
    xs, ys = rng.normal(size=(2, 8, 3)), rng.normal(size=(2, 8, 2))
    factory = eqx.debug.assert_max_traces(optax.sgd, max_traces=1)

    def run(i, init_scale, learning_rate, weight_decay):
        return nqfjax.train(
            structure,
            xs[i],
            ys[i],
            num_steps=20,
            learning_rate=learning_rate,
            optimizer=factory,
            init_scale=init_scale,
            weight_decay=weight_decay,
            width=4,
            key=jax.random.key(i),
        ).loss

    first = run(0, 0.1, 0.05, 0.0)
    with count_compiles() as compiles:
        second = run(1, 0.3, 0.02, 0.01)  # new data, key, scale, rate, decay
    assert compiles == []
    assert not np.allclose(first, second)  # really another computation


def test_sweep_second_call_compiles_nothing():
    # `sweep`: "fn is traced and compiled once ... a second call compiles nothing"
    @eqx.debug.assert_max_traces(max_traces=1)
    def fn(scale, rate):
        r = jnp.stack([rate, 0.5 * rate])
        lv = nqfjax.LotkaVolterra(r, B_diag=jnp.ones(2))
        return lv.loss(scale * jnp.ones(2))

    grids = [
        {"scale": np.linspace(0.1, 1.0, n), "rate": np.linspace(1.0, 2.0, n)}
        for n in (7, 7)
    ]
    grids[1] = {k: v[::-1] + 0.5 for k, v in grids[1].items()}
    first = nqfjax.sweep(fn, grids[0], chunk=3, progress=False)  # 3 chunks, 1 trace
    with count_compiles() as compiles:
        second = nqfjax.sweep(fn, grids[1], chunk=3, progress=False)
    assert compiles == []
    for result, grid in ((first, grids[0]), (second, grids[1])):
        s, r = grid["scale"], grid["rate"]
        # loss(m) = m^T m / 2 - r^T m with m = s (1, 1), r = rate (1, 1/2)
        np.testing.assert_allclose(result.outputs, s**2 - 1.5 * r * s, rtol=RTOL)


def test_solve_lv_second_call_compiles_nothing():
    # `solve_lv` keeps its vector field at module level so that diffrax's jit
    # cache is hit: a new system, new initial values and new times of the same
    # shapes (those of test_solve_lv_logistic_modes) reuse the compiled solve
    systems = [
        (nqfjax.LotkaVolterra(jnp.array(r), B_diag=jnp.array(B)), jnp.array(m0))
        for r, B, m0 in (
            ([1.0, 0.4], [2.0, 0.5], [1e-6, 1e-9]),
            ([0.7, 0.2], [1.0, 3.0], [1e-4, 1e-12]),
        )
    ]
    ts = [jnp.linspace(1.0, 80.0, 17), jnp.linspace(0.5, 200.0, 17)]
    values(nqfjax.solve_lv(systems[0][0], systems[0][1], ts[0]))
    with count_compiles() as compiles:
        m = values(nqfjax.solve_lv(systems[1][0], systems[1][1], ts[1]))
    assert compiles == []
    # and it solved the new system: the slow mode (r = 0.2) ends near m* = 0.2/3
    np.testing.assert_allclose(m[-1, 1], 0.2 / 3, rtol=1e-3)


def test_task_from_samples_second_task_compiles_nothing():
    # `task_from_samples` keeps its kernels at module level: "the cache is hit
    # across calls and tasks"
    structure = nqfjax.QKAttention(T=4, d=3, k=2, softmax=True)
    rng = np.random.default_rng(4)
    xs = jnp.asarray(rng.normal(size=(2, 10, 4, 3)))
    ys = jnp.asarray(rng.normal(size=(2, 10, 2)))
    X = jnp.asarray(rng.normal(size=(structure.p, structure.p)))
    X = X + X.T
    nqfjax.task_from_samples(structure, xs[0], ys[0]).K(X)
    with count_compiles() as compiles:
        task = nqfjax.task_from_samples(structure, xs[1], ys[1])
        KX = task.K(X)
    assert compiles == []
    A = np.stack([np.asarray(jit_A(structure, x)) for x in xs[1]])
    np.testing.assert_allclose(
        KX, np.einsum("skij,skab,ab->ij", A, A, X) / 10, rtol=1e-12, atol=1e-13
    )


def test_nnqp_compiles_once_per_size():
    # `nnqp`: "one compilation per (p, dtype)"
    rng = np.random.default_rng(5)
    F = rng.normal(size=(2, 6, 6))
    Bs, rs = jnp.asarray(F @ np.swapaxes(F, 1, 2)), jnp.asarray(rng.normal(size=(2, 6)))
    nqfjax.nnqp(Bs[0], rs[0])
    with count_compiles() as compiles:
        sol = nqfjax.nnqp(Bs[1], rs[1])
    assert compiles == []
    # the new problem's KKT conditions: m >= 0, (r - B m) = 0 where m > 0 and
    # <= 0 where m = 0 (round-off: entries of B are O(10))
    m, B, r = np.asarray(sol.m), np.asarray(Bs[1]), np.asarray(rs[1])
    slack = r - B @ m
    assert bool(sol.converged) and np.all(m >= 0) and np.any(m > 0)
    np.testing.assert_allclose(slack[m > 0], 0, atol=1e-10)
    assert np.all(slack[m == 0] <= 1e-10)
