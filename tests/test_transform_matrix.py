"""The transformation matrix: every public function that takes arrays, called
eagerly, under `jax.jit`, `jax.vmap`, `jax.grad` or `jax.jacfwd`, and inside
`jax.shard_map` over two host devices, in float64 and float32, on small problems.

One table (`CASES`) and one parametrised test (`test_matrix`) over
case x transformation x dtype. Each case builds `(fn, x, x2)`: `fn` of one array
argument (the others closed over) returning a pytree of arrays, and two values of
it. The columns:

- `eager`: `fn(x)` runs, is finite and comes back in the requested dtype;
- `jit`: `jax.jit(fn)(x)` equals `fn(x)`;
- `vmap`: `jax.vmap(fn)` over `[x, x2]` equals the loop of eager calls;
- `grad`: the derivative of a fixed weighted sum `S(fn(x))` by `jax.grad` (reverse
  mode) or `jax.jacfwd` (forward mode), whichever the case names: in float64
  along a random direction against a central finite difference, in float32
  finite and close to the float64 derivative;
- `shard_map`: `jax.shard_map(jax.vmap(fn), ...)` over `[x, x2]` on a mesh of two
  host devices (one member each) equals the loop of eager calls. `XLA_FLAGS`
  must be set before jax starts, so one subprocess per dtype runs this column
  for every case (it imports this module: the same table) and prints JSON.

An eager-only function raises a `ValueError` naming itself and saying that it
runs eagerly in every column but `eager`. The table is also in the docs
(docs/how-to/sweeps.md, "What runs under which transformation");
`test_docs_table_matches` keeps the two equal.

Tolerances across transformations: the same XLA CPU kernels on the same numbers,
fused or batched differently, so they agree to round-off; relative to each
output's largest entry (entries near 0 have no relative accuracy of their own),
1e-10 in float64 and 1e-5 in float32 unless a case says why it needs more.
"""

import dataclasses
import functools
import json
import os
import pathlib
import re
import subprocess
import sys
import textwrap
from collections.abc import Callable
from typing import Any

import diffrax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nqfjax


pytestmark = pytest.mark.slow

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
TRANSFORMS = ("eager", "jit", "vmap", "grad", "shard_map")
DTYPES = ("float64", "float32")


def precision(dtype: str):
    """float64 as the suite has it (`conftest.py`), or float32 as a user without
    `jax_enable_x64` has it."""
    return jax.enable_x64(dtype == "float64")


@dataclasses.dataclass(frozen=True)
class Case:
    """One row of the matrix.

    - `name`: the function as the docs table writes it.
    - `build(dtype) -> (fn, x, x2)`: see the module docstring.
    - `grad`: `"grad"` or `"jacfwd"` (the mode checked), or `"-"` where there is no
      derivative to check (`note` says why).
    - `eager_only`: the function runs eagerly and raises when traced.
    - `rtol`: across transformations, `(float64, float32)`.
    - `fd_rtol`: the float64 derivative against the finite difference.
    - `grad32_rtol`: the float32 derivative against the float64 one.
    - `symmetric`: `x` is a symmetric matrix (the finite difference steps along a
      symmetric direction).
    - `note`: for the docs.
    """

    name: str
    build: Callable[[str], tuple[Callable, Any, Any]]
    grad: str = "grad"
    eager_only: bool = False
    rtol: tuple[float, float] = (1e-10, 1e-5)
    fd_rtol: float = 1e-7
    grad32_rtol: float = 1e-4
    symmetric: bool = False
    note: str = ""

    @property
    def id(self) -> str:
        return re.sub(r"\W+", "_", self.name).strip("_")

    def expected(self, transform: str) -> str:
        """What the docs table says: `runs`, `raises`, `grad`, `jacfwd` or `-`."""
        if transform == "eager":
            return "runs"
        if self.eager_only:
            return "raises"
        return self.grad if transform == "grad" else "runs"


# -- the problems: small (p <= 6), a few steps, fixed seeds; numpy float64 values
# cast to the dtype, so the float32 inputs are the float64 ones rounded


def _rng(seed):
    return np.random.default_rng(seed)


def _arr(x, dtype):
    return jnp.asarray(np.asarray(x, np.float64), dtype)


NET = nqfjax.Perceptron(d=3, k=2)
TS_CURVE = np.geomspace(1.0, 1e4, 80)


def _staircase_curve(t1, t2):
    """A loss curve with switch-ons at `t1` and `t2` and a power-law tail (the
    analysis cases)."""
    t = TS_CURVE
    drops = 0.6 / (1 + (t / t1) ** -6) + 0.3 / (1 + (t / t2) ** -6)
    return 1.0 - drops + 0.1 * (1 + t) ** -0.5


def _structure_A(dtype):
    s = NET
    rng = _rng(0)
    return s.A, _arr(rng.normal(size=3), dtype), _arr(rng.normal(size=3), dtype)


def _structure_layer(dtype):
    s, rng = NET, _rng(1)
    x = _arr(rng.normal(size=3), dtype)
    W, W2 = (_arr(rng.normal(size=(s.p, 4)), dtype) for _ in range(2))
    return (lambda W: s.layer(W, x)), W, W2


def _structure_unit(dtype):
    s, rng = NET, _rng(2)
    x = _arr(rng.normal(size=3), dtype)
    w, w2 = (_arr(rng.normal(size=s.p), dtype) for _ in range(2))
    return (lambda w: s.unit(w, x)), w, w2


def _nqf_apply(dtype):
    s, rng = nqfjax.QKAttention(T=4, d=3, k=2, softmax=True), _rng(3)
    x = _arr(rng.normal(size=s.input_shape), dtype)
    W, W2 = (_arr(rng.normal(size=(s.p, 3)), dtype) for _ in range(2))
    return (lambda W: nqfjax.nqf_apply(s, W, x)), W, W2


def _task_from_samples(dtype):
    rng = _rng(4)
    xs, xs2 = (_arr(rng.normal(size=(8, 3)), dtype) for _ in range(2))
    ys = _arr(rng.normal(size=(8, 2)), dtype)
    X = rng.normal(size=(NET.p, NET.p))
    M = _arr(0.3 * X @ X.T, dtype)

    def fn(xs):
        task = nqfjax.task_from_samples(NET, xs, ys)
        return task.loss(M), task.gradient(M)

    return fn, xs, xs2


def _power_law_lv(dtype):
    def fn(alpha):
        lv = nqfjax.power_law_task(5, alpha, 0.4).lotka_volterra()
        return lv.r, lv.interactions.diagonal(), lv.loss_offset

    return fn, _arr(1.2, dtype), _arr(1.0, dtype)


def _train(dtype):
    rng = _rng(5)
    xs = rng.normal(size=(8, 3))
    ys = _arr(xs @ (0.5 * rng.normal(size=(2, 3))).T, dtype)
    W0, W02 = (_arr(0.3 * rng.normal(size=(NET.p, 4)), dtype) for _ in range(2))
    xs = _arr(xs, dtype)

    def fn(W0):
        res = nqfjax.train(
            NET, xs, ys, num_steps=20, learning_rate=0.1, W0=W0, num_records=5
        )
        return res.loss, res.M[-1]

    return fn, W0, W02


_TS = np.linspace(1.0, 40.0, 5)


def _lv_system(dtype):
    r = _arr([1.0, 0.6, 0.3], dtype)
    B = _arr([[1.0, 0.2, 0.1], [0.2, 1.0, 0.3], [0.1, 0.3, 0.8]], dtype)
    return nqfjax.LotkaVolterra(r, B)


# The float64 solves run at rtol = atol = 1e-10, so that the finite difference
# (step 1e-4 relative) sees the solution, not the solver's error: its
# variation between x +- h is at most ~1e-10 / 1e-4 = 1e-6 of the derivative
# (when a step is accepted on one side and rejected on the other), smooth
# (O(1e-10)) otherwise. float32 uses the library's defaults.
def _tol(dtype):
    if dtype != "float64":
        return {}
    return dict(stepsize_controller=nqfjax.lv_stepsize_controller(1e-10, rtol=1e-10))


def _tol_batch(dtype):
    # the same controller as `_tol`'s (solve_lv_batch takes solve_lv's)
    return _tol(dtype)


def _tol_mflow(dtype):
    if dtype != "float64":
        return {}
    return dict(stepsize_controller=diffrax.PIDController(rtol=1e-10, atol=1e-10))


def _solve_lv(dtype):
    lv, ts = _lv_system(dtype), _arr(_TS, dtype)

    def fn(m0):
        sol = nqfjax.solve_lv(lv, m0, ts, **_tol(dtype))
        return sol.ys, sol.loss

    return fn, _arr([1e-2, 2e-2, 3e-2], dtype), _arr([3e-2, 1e-2, 2e-2], dtype)


def _solve_lv_batch(dtype):
    lv, ts = _lv_system(dtype), _arr(_TS, dtype)

    def fn(m0):
        return nqfjax.solve_lv_batch(lv, m0, ts, **_tol_batch(dtype)).loss

    m0 = _arr([[1e-2, 2e-2, 3e-2], [3e-2, 2e-2, 1e-2]], dtype)
    return fn, m0, 0.5 * m0


def _solve_mflow(dtype):
    rng = _rng(6)
    xs = rng.normal(size=(12, 3))
    ys = xs @ (0.5 * rng.normal(size=(2, 3))).T
    task = nqfjax.task_from_samples(NET, _arr(xs, dtype), _arr(ys, dtype))
    ts = _arr(np.linspace(1.0, 30.0, 4), dtype)
    # full rank (8 units > p = 5), so that M0 +- h v stays positive definite
    W, W2 = (0.1 * rng.normal(size=(NET.p, 8)) for _ in range(2))

    def fn(M0):
        sol = nqfjax.solve_mflow(
            task, M0, ts, 0.5, solver=diffrax.Tsit5(), **_tol_mflow(dtype)
        )
        return sol.ys[-1], sol.loss

    return fn, _arr(W @ W.T, dtype), _arr(W2 @ W2.T, dtype)


def _sharp_switch_loss(dtype):
    lv = nqfjax.power_law_task(6, 1.0, 0.5).lotka_volterra()
    ts = _arr(0.25 * np.geomspace(1.0, 1e5, 30), dtype)  # flow times at eta 1/4
    return (
        lambda m0: nqfjax.sharp_switch_loss(lv, m0, ts),
        _arr(np.full(6, 1e-8), dtype),
        _arr(np.full(6, 1e-5), dtype),
    )


def _sgd_moments(dtype):
    quad = nqfjax.gaussian_quadratic_task(
        _arr(np.diag([1.0, 0.5, 0.25]), dtype), _arr(np.diag([1.0, 0.6, 0.3]), dtype)
    )
    lr, bs = _arr(np.full(20, 0.05), dtype), _arr(np.full(20, 8.0), dtype)

    def fn(m0):
        res = nqfjax.sgd_moments(quad, lr, bs, m0)
        return res.loss, res.m

    return fn, _arr([1e-3, 2e-3, 3e-3], dtype), _arr([3e-3, 1e-3, 2e-3], dtype)


# -- eager only


def _lv_reduce(dtype):
    return (
        (lambda a: nqfjax.lv_reduce(nqfjax.power_law_task(4, a, 0.5))[0].r),
        _arr(1.0, dtype),
        _arr(1.2, dtype),
    )


def _switch_on_times(dtype):
    lv = _lv_system(dtype)
    return (
        lambda m0: nqfjax.switch_on_times(lv, m0),
        _arr([1e-6, 1e-7, 1e-8], dtype),
        _arr([1e-8, 1e-7, 1e-6], dtype),
    )


def _curve_pair(dtype):
    return _arr(_staircase_curve(30.0, 600.0), dtype), _arr(
        _staircase_curve(10.0, 1000.0), dtype
    )


def _detect_plateaus(dtype):
    ts = _arr(TS_CURVE, dtype)
    return (lambda loss: nqfjax.detect_plateaus(ts, loss).level), *_curve_pair(dtype)


def _fit_power_law(dtype):
    ts = _arr(TS_CURVE, dtype)
    t = np.asarray(TS_CURVE)

    def fn(loss):
        fit = nqfjax.fit_power_law(
            ts, loss, n_starts=2, steps=50, uncertainty="laplace"
        )
        return fit.gamma

    return fn, *(_arr(0.1 + 2.0 * (t + 3.0) ** -g, dtype) for g in (0.7, 0.9))


def _fit_spectrum(dtype):
    ts = _arr(TS_CURVE, dtype)

    def fn(loss):
        fit = nqfjax.fit_spectrum(ts, loss, p=2, method="logistic", steps=10, polish=5)
        return fit.alpha

    return fn, *_curve_pair(dtype)


def _predict(dtype):
    rng = _rng(7)
    xs, xs2 = (_arr(rng.normal(size=(8, 3)), dtype) for _ in range(2))
    ys = _arr(rng.normal(size=(8, 2)), dtype)

    def fn(xs):
        pred = nqfjax.predict(
            NET,
            xs,
            ys,
            init_scale=1e-2,
            learning_rate=0.1,
            width=2,
            key=jax.random.key(0),
            num_steps=50,
            num_records=6,
            engine=nqfjax.ApproximateLVEngine(),
        )
        return pred.loss

    return fn, xs, xs2


CASES = (
    Case("Structure.A", _structure_A, grad="jacfwd"),
    Case("Structure.layer", _structure_layer),
    Case("Structure.unit", _structure_unit),
    Case("nqf_apply", _nqf_apply, grad="jacfwd"),
    Case("task_from_samples", _task_from_samples),
    Case("PowerLawTask.lotka_volterra", _power_law_lv, grad="jacfwd"),
    Case("train", _train),
    Case("solve_lv", _solve_lv, fd_rtol=1e-5),
    Case("solve_lv_batch", _solve_lv_batch, fd_rtol=1e-5),
    Case(
        "solve_mflow",
        _solve_mflow,
        fd_rtol=1e-5,
        # the float32 solve's default tolerances: measured 1.4e-4 of the largest
        # entry against float64
        grad32_rtol=1e-3,
        symmetric=True,
        note="inside `shard_map` with an explicit solver such as "
        "`diffrax.Tsit5()`: the default `Kvaerno5`'s linear solves (lineax) fail "
        "there; `nqfjax.sweep` runs it as a sharded `jit` instead",
    ),
    Case(
        "sharp_switch_loss",
        _sharp_switch_loss,
        grad="-",
        note="piecewise constant in `m0`: its derivative is 0 where it exists",
    ),
    Case("sgd_moments", _sgd_moments),
    Case(
        "lv_reduce",
        _lv_reduce,
        eager_only=True,
        note="for a power-law task, `task.lotka_volterra()` traces",
    ),
    Case(
        "switch_on_times",
        _switch_on_times,
        eager_only=True,
        note="an event loop in numpy",
    ),
    Case("detect_plateaus", _detect_plateaus, eager_only=True),
    Case(
        "fit_power_law",
        _fit_power_law,
        eager_only=True,
        note="the fits inside are one compiled call",
    ),
    Case(
        "fit_spectrum",
        _fit_spectrum,
        eager_only=True,
        note="the fits inside are one compiled call",
    ),
    Case(
        "predict",
        _predict,
        eager_only=True,
        note="trace `solve_lv` or `solve_mflow` instead",
    ),
)
CASE = {c.id: c for c in CASES}


# -- the pieces the columns share


def _leaves(tree) -> list[np.ndarray]:
    return [np.asarray(a) for a in jax.tree.leaves(tree)]


def _weighted_sum(tree):
    """The scalar `S` whose derivative the `grad` column checks: each output
    entry weighted by `1 + cos(i)/2` (never 0)."""
    total = 0.0
    for a in jax.tree.leaves(tree):
        if jnp.issubdtype(a.dtype, jnp.floating):
            w = 1 + 0.5 * jnp.cos(jnp.arange(a.size, dtype=a.dtype))
            total = total + jnp.sum(a.reshape(-1) * w)
    return total


def _derivative(case: Case, fn, x):
    S = lambda x: _weighted_sum(fn(x))  # noqa: E731
    return (jax.grad if case.grad == "grad" else jax.jacfwd)(S)(x)


@functools.cache
def _derivative64(case_id: str) -> np.ndarray:
    case = CASE[case_id]
    with precision("float64"):
        fn, x, _ = case.build("float64")
        return np.asarray(_derivative(case, fn, x))


@functools.cache
def _eager(case_id: str, dtype: str):
    """`fn(x)` and `fn(x2)` eagerly, as numpy leaves (shared by the columns)."""
    case = CASE[case_id]
    with precision(dtype):
        fn, x, x2 = case.build(dtype)
        return _leaves(fn(x)), _leaves(fn(x2))


def _close(got, want, rtol, what):
    assert len(got) == len(want), what
    for g, w in zip(got, want):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        assert g.shape == w.shape, what
        scale = np.max(np.abs(w)) if w.size else 0.0
        np.testing.assert_allclose(g, w, rtol=rtol, atol=rtol * scale, err_msg=what)


def _stacked(a, b):
    return [np.stack([x, y]) for x, y in zip(a, b)]


def _eagerly_refused(case: Case):
    return pytest.raises(ValueError, match=rf"`{case.name}` runs eagerly")


# -- the shard_map column: a subprocess per dtype with two host devices


def shard_map_column(dtype: str) -> dict:
    """Run every case inside `shard_map` over two host devices (called in the
    subprocess): the two members' outputs as lists, or the error raised."""
    from jax.sharding import Mesh, PartitionSpec as P

    assert jax.device_count() >= 2, jax.devices()
    mesh = Mesh(np.array(jax.devices()[:2]), ("i",))
    out = {}
    for case in CASES:
        with precision(dtype):
            fn, x, x2 = case.build(dtype)
            sharded = jax.shard_map(
                jax.vmap(fn),
                mesh=mesh,
                in_specs=P("i"),
                out_specs=P("i"),
                check_vma=False,
            )
            try:
                leaves = _leaves(sharded(jnp.stack([x, x2])))
            except Exception as e:  # recorded; the test says which is expected
                out[case.id] = {"error": type(e).__name__, "message": str(e)}
            else:
                out[case.id] = {
                    "leaves": [a.tolist() for a in leaves],
                    "dtypes": [str(a.dtype) for a in leaves],
                }
    return out


_SHARD_MAP = textwrap.dedent(
    """
    import json, sys
    import jax
    jax.config.update("jax_enable_x64", True)
    jax.config.update("jax_numpy_rank_promotion", "raise")
    sys.path.insert(0, sys.argv[1])
    import test_transform_matrix as matrix
    print(json.dumps({d: matrix.shard_map_column(d) for d in matrix.DTYPES}))
    """
)
_BACKGROUND: dict[str, subprocess.Popen] = {}


def _start_shard_map():
    """Start the subprocess of the `shard_map` column (both dtypes): it compiles
    on the second core while this process runs the other columns."""
    if "proc" in _BACKGROUND:
        return
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(
        JAX_PLATFORMS="cpu",
        PYTHONPATH=os.pathsep.join([str(ROOT), str(HERE)]),
        XLA_FLAGS="--xla_force_host_platform_device_count=2",
    )
    _BACKGROUND["proc"] = subprocess.Popen(
        [sys.executable, "-c", _SHARD_MAP, str(HERE)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.fixture(scope="module", autouse=True)
def _shard_map_in_background(request):
    mine = [i for i in request.session.items if i.module is request.module]
    if any("shard_map" in i.name for i in mine):
        _start_shard_map()
    yield
    proc = _BACKGROUND.pop("proc", None)
    if proc is not None and proc.poll() is None:
        proc.kill()
        proc.communicate()


@functools.cache
def _shard_map() -> dict:
    _start_shard_map()
    stdout, stderr = _BACKGROUND["proc"].communicate(timeout=600)
    assert _BACKGROUND["proc"].returncode == 0, stderr[-3000:]
    return json.loads(stdout.strip().splitlines()[-1])


# -- the matrix


# case x transformation x dtype, the shard_map column last (it waits for the
# subprocess, which runs meanwhile)
def _checked(case: Case, transform: str, dtype: str) -> bool:
    """Which cells run: all, but in float32 neither the eager-only fits' eager
    call (their float32 path is `test_float32`'s; each compiles for 15-25 s) nor
    the adaptive solves' derivatives (checked against finite differences in
    float64; a float32 grad of a solve compiles for another 15-25 s), so the
    module stays within its slow-tier budget."""
    if dtype != "float32":
        return True
    if transform == "eager" and case.eager_only:
        return False
    solves = ("solve_lv", "solve_lv_batch", "solve_mflow", "train")
    return not (transform == "grad" and case.name in solves)


PARAMS = [
    pytest.param(c, t, d, id=f"{c.id}-{t}-{d}")
    for t in TRANSFORMS
    for c in CASES
    for d in DTYPES
    if _checked(c, t, d)
]


@pytest.mark.parametrize("case,transform,dtype", PARAMS)
def test_matrix(case: Case, transform: str, dtype: str):
    expected = case.expected(transform)
    rtol = case.rtol[DTYPES.index(dtype)]
    what = f"{case.name} under {transform} in {dtype}"
    if transform == "shard_map":
        got = _shard_map()[dtype][case.id]
        if expected == "raises":
            assert got.get("error") == "ValueError", got
            assert f"`{case.name}` runs eagerly" in got["message"], got
        else:
            assert "error" not in got, got
            assert set(got["dtypes"]) <= {dtype, "bool", "int32", "int64"}, got
            _close(got["leaves"], _stacked(*_eager(case.id, dtype)), rtol, what)
        return
    with precision(dtype):
        fn, x, x2 = case.build(dtype)
        if expected == "raises":
            call = {
                "jit": lambda: jax.jit(fn)(x),
                "vmap": lambda: jax.vmap(fn)(jnp.stack([x, x2])),
                "grad": lambda: jax.grad(lambda x: _weighted_sum(fn(x)))(x),
            }[transform]
            with _eagerly_refused(case):
                call()
            return
        if transform == "eager":
            out = fn(x)
            for a in jax.tree.leaves(out):
                if jnp.issubdtype(a.dtype, jnp.floating):
                    assert a.dtype == jnp.dtype(dtype), what
                    assert np.all(np.isfinite(np.asarray(a))), what
            # and the two inputs give different numbers (the comparisons mean
            # something); a fixed point in both would make vmap's check trivial
            first, second = _eager(case.id, dtype)
            assert any(not np.allclose(a, b) for a, b in zip(first, second)), what
        elif transform == "jit":
            _close(_leaves(jax.jit(fn)(x)), _eager(case.id, dtype)[0], rtol, what)
        elif transform == "vmap":
            got = _leaves(jax.vmap(fn)(jnp.stack([x, x2])))
            _close(got, _stacked(*_eager(case.id, dtype)), rtol, what)
        elif transform == "grad":
            if expected == "-":
                pytest.skip(case.note)
            _check_derivative(case, fn, x, dtype, what)


def _check_derivative(case, fn, x, dtype, what):
    # the float64 one is kept for the float32 comparison (a grad of a solve
    # compiles for many seconds)
    g = _derivative(case, fn, x) if dtype == "float32" else _derivative64(case.id)
    assert g.shape == x.shape and g.dtype == x.dtype, what
    if dtype == "float32":
        assert np.all(np.isfinite(np.asarray(g))), what
        g64 = _derivative64(case.id)
        # float32 round-off (6e-8) amplified by the problem's condition and, for
        # the solves, the float32 solver tolerance: `grad32_rtol` relative to
        # the largest entry
        _close([g], [g64], case.grad32_rtol, what)
        return
    # Central difference along a random direction `v` scaled entrywise by
    # |x| (relative steps, so small initial values stay positive), h = 1e-4:
    # truncation ~ h^2 |S'''| / 6 ~ 1e-9 of the derivative for these O(1)
    # nonlinearities, round-off ~ eps / h ~ 1e-12; `fd_rtol` = 1e-7 covers both
    # with 100x margin for the closed forms, 1e-5 for the solves (module
    # comment above `_tol`: their error moves by up to 1e-6 between x +- h).
    u = np.random.default_rng(11).normal(size=x.shape)
    if case.symmetric:
        u = u + u.T
    v = jnp.asarray(u * np.maximum(np.abs(np.asarray(x)), 1e-3 * np.max(np.abs(x))))
    h = 1e-4
    S = lambda x: float(_weighted_sum(fn(x)))  # noqa: E731
    fd = (S(x + h * v) - S(x - h * v)) / (2 * h)
    ad = float(jnp.vdot(g, v))
    assert np.isfinite(ad), what
    np.testing.assert_allclose(ad, fd, rtol=case.fd_rtol, err_msg=what)


# -- the docs table


DOCS = ROOT / "docs" / "how-to" / "sweeps.md"
HEADING = "## What runs under which transformation"


def docs_rows() -> list[list[str]]:
    """The table's rows as the docs write them: the name, the five columns, the
    note."""
    return [
        [f"`{c.name}`", *(c.expected(t) for t in TRANSFORMS), c.note] for c in CASES
    ]


def test_docs_table_matches():
    text = DOCS.read_text()
    assert HEADING in text
    section = text.split(HEADING, 1)[1].split("\n## ", 1)[0]
    lines = [ln for ln in section.splitlines() if ln.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert header == ["function", *TRANSFORMS, "notes"], header
    rows = [[c.strip() for c in ln.strip()[1:-1].split("|")] for ln in lines[2:]]
    assert rows == docs_rows()
