"""`solve_lv_batch`: the fused loop over a batch of Lotka-Volterra systems,
against `solve_lv` member by member and against scipy."""

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optimistix as optx
import pytest
from helpers import lv_interactions
from scipy.integrate import solve_ivp

import nqfjax
from nqfjax import (
    DiagonalInteractions,
    LotkaVolterra,
    LowRankInteractions,
    solve_lv,
    solve_lv_batch,
)
from nqfjax.engines import _lv_batch_adjoint, _lv_batch_loop, _lv_common
from nqfjax.engines._rosenbrock import RODAS4


P = 5
TS = np.geomspace(1e-2, 1e3, 30)
ATOL = 1e-8  # on log m: the relative error of m per step


def _pid(atol, rtol=None, dtype=jnp.float64):
    """The controller of the default tolerances at `atol` on `log m` (`None`:
    the dtype's default) and, unless given, `rtol = atol / |log floor|`, as
    `solve_lv_batch` builds it."""
    if atol is None:
        atol = 1e-9 if dtype == jnp.float64 else 1e-5
    if rtol is None:
        rtol = atol / abs(np.log(np.finfo(dtype).tiny))
    return diffrax.PIDController(rtol=rtol, atol=atol)


def _interactions(p=P):
    return lv_interactions(p)


def _m0(n=4, p=P, seed=0):
    """Initial values from 1e-30 to 1e-3: the modes switch on at times spread
    over three decades, differently in every member."""
    rng = np.random.default_rng(seed)
    return 10.0 ** rng.uniform(-30, -3, size=(n, p))


def _scipy_log(r, B, m0, ts, decay=0.0):
    """Reference: scipy's LSODA in log space with the analytic Jacobian, rtol =
    atol = 1e-12 on log m."""
    sol = solve_ivp(
        lambda t, y: r - B @ np.exp(np.minimum(y, 50.0)) - decay,
        (0.0, ts[-1]),
        np.log(m0),
        method="LSODA",
        t_eval=ts,
        rtol=1e-12,
        atol=1e-12,
        jac=lambda t, y: -B * np.exp(np.minimum(y, 50.0))[None, :],
    )
    assert sol.success
    return np.exp(sol.y.T)


def _rel(a, b):
    return float(np.max(np.abs(np.asarray(a) / np.asarray(b) - 1)))


@pytest.fixture(scope="module")
def structured():
    """One structured system for a batch of four: the system, `r`, `B`, `m0`,
    `solve_lv_batch` and `vmap(solve_lv)` at `ATOL`, and scipy."""
    r, B, d, U = _interactions()
    lv = LotkaVolterra(jnp.asarray(r), B_diag=jnp.asarray(d), B_factor=jnp.asarray(U))
    m0 = _m0()
    sol = solve_lv_batch(lv, m0, TS, stepsize_controller=_pid(ATOL))
    control = nqfjax.lv_stepsize_controller(ATOL, dtype=lv.r.dtype)
    alone = jax.vmap(lambda m: solve_lv(lv, m, TS, stepsize_controller=control))(
        jnp.asarray(m0)
    )
    ref = np.stack([_scipy_log(r, B, m, TS) for m in m0])
    return lv, m0, sol, alone, ref


@pytest.fixture(scope="module")
def batched_dense():
    """Four dense systems whose rates differ by up to 30x (so their members need
    very different step sizes at the same time), each with a decay that kills
    its weakest modes; `m0`, `solve_lv_batch` at `ATOL`, scipy."""
    r, B, _, _ = _interactions()
    scales = np.array([1.0, 3.0, 10.0, 30.0])
    rs, Bs = scales[:, None] * r, scales[:, None, None] * B
    decays = scales * (0.5 * np.min(r) + 0.5 * np.median(r))
    lv = jax.vmap(LotkaVolterra)(jnp.asarray(rs), jnp.asarray(Bs), jnp.asarray(decays))
    m0 = _m0(seed=1)
    sol = solve_lv_batch(lv, m0, TS, stepsize_controller=_pid(ATOL))
    ref = np.stack([_scipy_log(*a, TS, c) for *a, c in zip(rs, Bs, m0, decays)])
    return lv, m0, sol, ref


def test_shared_system_matches_solve_lv_and_scipy(structured):
    """Structured `B`, one system for the batch, float64 at atol = 1e-8: every
    member takes the steps its own `solve_lv` takes (same solver, controller and
    error order) and gives its numbers up to rounding (1e-10: ~1,400 steps of
    1e-16 each, grown by the switch-ons; measured 3e-13 on the benchmark's
    systems), and agrees with scipy's LSODA at 1e-12 to about atol over the run
    (measured 7.6e-9; 5e-8 leaves margin without hiding a wrong Jacobian, stage
    or interpolation, 1e-5 and beyond)."""
    lv, m0, sol, alone, ref = structured
    assert sol.ys.shape == (4, TS.size, P) and sol.ts.shape == (4, TS.size)
    assert sol.loss.shape == (4, TS.size) and sol.stats["moving"].shape == (4, P)
    assert bool(jnp.all(sol.succeeded))
    np.testing.assert_array_equal(sol.stats["num_steps"], alone.stats["num_steps"])
    np.testing.assert_array_equal(
        sol.stats["num_rejected_steps"], alone.stats["num_rejected_steps"]
    )
    assert _rel(sol.ys, alone.ys) < 1e-10
    assert _rel(sol.ys, ref) < 5e-8
    np.testing.assert_allclose(sol.loss, lv.loss(sol.ys), rtol=1e-12)
    # the modes switch on at different times in every member, so the members'
    # step counts differ
    assert len(set(np.asarray(sol.stats["num_steps"]).tolist())) > 1


def test_batched_dense_systems_with_dying_modes(batched_dense):
    """Dense `B`, a different system per member (rates 1x to 30x) with a decay:
    the weakest modes fall below the float64 floor and are reported as 0, the
    others match scipy at 1e-12 (tolerance as above), no mode is still moving,
    and the step counts grow with the rates, as they would one by one."""
    lv, m0, sol, ref = batched_dense
    dead = np.asarray(sol.ys[:, -1] == 0)
    assert dead.any() and not dead.all()
    alive, gone = ref > 1e-300, ref < 1e-320  # the float64 floor is 2.2e-308
    assert _rel(np.asarray(sol.ys)[alive], ref[alive]) < 5e-8
    assert gone.any()
    np.testing.assert_array_equal(np.asarray(sol.ys)[gone], 0.0)
    assert not bool(jnp.any(sol.stats["moving"]))
    loss = jax.vmap(lambda lv, m: lv.loss(m))(lv, sol.ys)
    np.testing.assert_allclose(sol.loss, loss, rtol=1e-12)
    steps = np.asarray(sol.stats["num_steps"])
    assert steps[-1] > steps[0]


def test_member_does_not_depend_on_its_companions(structured):
    """Each member keeps its own time and step size: in chunks of one member
    (each solved alone) it takes the same steps as in the whole batch and gives
    the same numbers up to the rounding of the batched products."""
    lv, m0, whole, _, _ = structured
    alone = solve_lv_batch(lv, m0, TS, stepsize_controller=_pid(ATOL), chunk_size=1)
    np.testing.assert_array_equal(alone.stats["num_steps"], whole.stats["num_steps"])
    np.testing.assert_allclose(alone.ys, whole.ys, rtol=1e-9)


def test_max_steps_is_reported_not_capped(batched_dense):
    """With a step limit between the slowest and the fastest member's needs, the
    slow members succeed and the fast ones report `max_steps_reached` with NaN
    results (never a truncated solve) and their moving modes; with
    `throw=True` it raises naming `max_steps`."""
    lv, m0, full, _ = batched_dense
    steps = np.asarray(full.stats["num_steps"])
    limit = int(steps.min() + steps.max()) // 2
    sol = solve_lv_batch(
        lv, m0, TS, stepsize_controller=_pid(ATOL), max_steps=limit, throw=False
    )
    ran_out = steps > limit
    assert ran_out.any() and not ran_out.all()
    reported = np.asarray(sol.result == diffrax.RESULTS.max_steps_reached)
    np.testing.assert_array_equal(reported, ran_out)
    np.testing.assert_array_equal(np.asarray(sol.succeeded), ~ran_out)
    assert bool(jnp.all(jnp.isnan(sol.ys[ran_out])))
    assert bool(jnp.all(jnp.isnan(sol.loss[ran_out])))
    np.testing.assert_array_equal(sol.ys[~ran_out], full.ys[~ran_out])
    np.testing.assert_array_equal(np.asarray(sol.stats["num_steps"])[ran_out], limit)
    assert bool(jnp.all(jnp.any(sol.stats["moving"][ran_out], axis=-1)))
    with pytest.raises(RuntimeError, match="max_steps"):
        solve_lv_batch(lv, m0, TS, stepsize_controller=_pid(ATOL), max_steps=limit)


def test_under_jit_equals_eager_and_checks_at_run_time(structured):
    """Traced `m0`, `ts` and `atol` give the eager numbers; a bad traced `m0`
    raises at run time with the eager message."""
    lv, m0, eager, _, _ = structured
    f = jax.jit(lambda m, ts, a: solve_lv_batch(lv, m, ts, stepsize_controller=_pid(a)))
    jitted = f(jnp.asarray(m0), jnp.asarray(TS), ATOL)
    np.testing.assert_allclose(jitted.ys, eager.ys, rtol=1e-12)
    np.testing.assert_array_equal(jitted.stats["num_steps"], eager.stats["num_steps"])
    # equinox's runtime error reaches the caller as jax's JaxRuntimeError, or as
    # a ValueError wrapping the failed callback when it surfaces at a block
    with pytest.raises((RuntimeError, ValueError), match="`m0` must be strictly"):
        f(-jnp.asarray(m0), jnp.asarray(TS), ATOL).ys.block_until_ready()


def test_float32(structured):
    """The float32 path (default tolerances, atol 1e-5 on log m): from m0 down to
    1e-30 it stays within 2e-4 of the float64 reference (measured 4.3e-5;
    `solve_lv` 2.5e-5 on the same systems: float32 resolves log m ~ -69 to
    ~4e-6, and the error grows with the length of the run)."""
    lv, m0, _, _, ref = structured
    lv32 = jax.tree.map(lambda x: x.astype(jnp.float32), lv)
    sol = solve_lv_batch(lv32, jnp.asarray(m0, jnp.float32), TS)
    assert sol.ys.dtype == jnp.float32
    assert _rel(sol.ys, ref) < 2e-4


def test_deprecated_tolerances_warn_and_give_the_same_solve(structured):
    """`rtol=`/`atol=` still work for one release, warning with the
    replacement, and give the numbers of the controller they stand for (the
    same steps, bit for bit); `atol` alone keeps `rtol = atol / |log floor|`."""
    lv, m0, sol, _, _ = structured
    match = r"stepsize_controller=nqfjax.lv_stepsize_controller\(atol=..., rtol=...\)"
    with pytest.warns(DeprecationWarning, match=match):
        old = solve_lv_batch(lv, m0, TS, atol=ATOL)
    np.testing.assert_array_equal(old.ys, sol.ys)
    np.testing.assert_array_equal(old.stats["num_steps"], sol.stats["num_steps"])
    with pytest.warns(DeprecationWarning, match=match):
        old = solve_lv_batch(lv, m0, TS, rtol=0.0, atol=1e-7)
    new = solve_lv_batch(lv, m0, TS, stepsize_controller=_pid(1e-7, 0.0))
    np.testing.assert_array_equal(old.ys, new.ys)
    with pytest.raises(ValueError, match="not also as `rtol`/`atol`"):
        solve_lv_batch(lv, m0, TS, stepsize_controller=_pid(ATOL), atol=ATOL)
    # the default is `lv_stepsize_controller(dtype=...)`, whose max norm a
    # plain PIDController's default norm is read as
    default = solve_lv_batch(lv, m0, TS_GRAD)
    control = nqfjax.lv_stepsize_controller(dtype=jnp.float64)
    for pid in (control, _pid(None)):
        same = solve_lv_batch(lv, m0, TS_GRAD, stepsize_controller=pid)
        np.testing.assert_array_equal(same.ys, default.ys)


def test_controller_steps_as_diffrax_s():
    """The loop's controller (`control`, with the constants read from a
    `diffrax.PIDController` by `pid_constants`) against diffrax's own
    `adapt_step_size` of the same controller in the max norm, on random
    errors around the tolerance (accepted and rejected steps, a clip by
    `dtmax`): the same decisions and next step sizes (to the rounding of
    diffrax's `t1 - t0`, 1e-12)."""
    pid = diffrax.PIDController(
        rtol=1e-3,
        atol=1e-6,
        norm=optx.max_norm,
        icoeff=0.7,
        safety=0.8,
        factormin=0.3,
        factormax=4.0,
        dtmax=0.5,
    )
    constants = _lv_common.pid_constants(pid, RODAS4.order, jnp.float64)
    rng = np.random.default_rng(0)
    n, p = 64, P
    y0, y1 = rng.normal(size=(2, n, p))
    err = 1e-3 * 10 ** rng.uniform(-3, 0.5, size=(n, p))
    h = 10 ** rng.uniform(-3, 0, size=n)
    active = jnp.ones(n, bool)
    accept, dt = _lv_batch_loop.control(constants, y0, y1, err, h, active)
    state = (jnp.asarray(1.0), jnp.asarray(1.0), False)
    for i in range(n):
        keep, t0, t1, _, _, _ = pid.adapt_step_size(
            0.0, h[i], y0[i], y1[i], None, err[i], RODAS4.order, state
        )
        assert bool(keep) == bool(accept[i])
        np.testing.assert_allclose(dt[i], t1 - t0, rtol=1e-12)
    assert 0 < int(jnp.sum(accept)) < n and bool(jnp.any(dt == 0.5))


@pytest.mark.slow  # 36 s; test_controller_steps_as_diffrax_s checks the same
def test_controller_options_are_diffrax_s(structured):
    """The options the fused loop reads from a `diffrax.PIDController`
    (`icoeff`, `safety`, `factormin`, `factormax`, `dtmax`, the tolerances)
    step as diffrax does with the same controller in `solve_lv`: the same step
    counts, and the same numbers to rounding (1e-10, as with the defaults). With
    the options changed the step counts differ from the defaults', so they
    were read."""
    lv, m0, default, _, _ = structured
    pid = diffrax.PIDController(
        rtol=1e-11,
        atol=ATOL,
        norm=optx.max_norm,
        icoeff=0.7,
        safety=0.8,
        factormin=0.3,
        factormax=4.0,
        dtmax=20.0,
    )
    sol = solve_lv_batch(lv, m0, TS, stepsize_controller=pid)
    alone = jax.vmap(lambda m: solve_lv(lv, m, TS, stepsize_controller=pid))(
        jnp.asarray(m0)
    )
    np.testing.assert_array_equal(sol.stats["num_steps"], alone.stats["num_steps"])
    assert _rel(sol.ys, alone.ys) < 1e-10
    assert np.all(sol.stats["num_steps"] != default.stats["num_steps"])


def test_controller_options_the_loop_cannot_honour_are_named(structured):
    lv, m0, _, _, _ = structured
    for option in (
        dict(pcoeff=0.3),
        dict(dcoeff=0.1),
        dict(dtmin=1e-6),
        dict(norm=optx.two_norm),
    ):
        pid = diffrax.PIDController(rtol=0.0, atol=ATOL, **option)
        with pytest.raises(ValueError, match=f"cannot honour `{next(iter(option))}`"):
            solve_lv_batch(lv, m0, TS, stepsize_controller=pid)
    clip = diffrax.PIDController(rtol=0.0, atol=ATOL, step_ts=TS)
    for controller in (clip, diffrax.ConstantStepSize()):
        with pytest.raises(ValueError, match="must be a diffrax.PIDController"):
            solve_lv_batch(lv, m0, TS, stepsize_controller=controller)
    with pytest.raises(ValueError, match="dtmax"):
        pid = diffrax.PIDController(rtol=0.0, atol=ATOL, dtmax=-1.0)
        solve_lv_batch(lv, m0, TS, stepsize_controller=pid)


def test_bad_inputs_are_named(structured, batched_dense):
    lv, m0, _, _, _ = structured
    with pytest.raises(ValueError, match=r"`m0` must have shape \(n, p\)"):
        solve_lv_batch(lv, m0[0], TS)
    with pytest.raises(ValueError, match="`m0` has 4 modes"):
        solve_lv_batch(lv, m0[:, :4], TS)
    dense = batched_dense[0]
    with pytest.raises(ValueError, match=r"`lv.r` must have shape"):
        solve_lv_batch(dense, m0[:3], TS)
    with pytest.raises(ValueError, match="strictly increasing"):
        solve_lv_batch(lv, m0, TS[::-1])
    with pytest.raises(ValueError, match="m0"):
        solve_lv_batch(lv, np.where(m0 > 1e-10, m0, 0.0), TS)
    with pytest.raises(ValueError, match="m0"):
        solve_lv_batch(lv, -m0, TS)
    with pytest.raises(ValueError, match="atol"):
        solve_lv_batch(lv, m0, TS, stepsize_controller=_pid(-1.0))
    with pytest.raises(ValueError, match="max_steps"):
        solve_lv_batch(lv, m0, TS, max_steps=0)
    with pytest.raises(ValueError, match="chunk_size"):
        solve_lv_batch(lv, m0, TS, chunk_size=0)
    with pytest.raises(ValueError, match="`learning_rate` must be > 0"):
        solve_lv_batch(lv, m0, TS, 0.0)
    with pytest.raises(ValueError, match="`learning_rate` must be a scalar"):
        solve_lv_batch(lv, m0, TS, jnp.ones(4))
    with pytest.raises(
        ValueError, match="`learning_rate` must be a constant.*solve_lv"
    ):
        solve_lv_batch(lv, m0, TS, lambda step: 0.1)
    with pytest.raises(ValueError, match="`weight_decay`"):
        solve_lv_batch(lv, m0, TS, 1.0, -0.1)
    with pytest.raises(ValueError, match=r"`weight_decay` must be a scalar or have"):
        solve_lv_batch(lv, m0, TS, 1.0, jnp.ones(3))


ETA, LAM = 0.3, 0.01


def test_learning_rate_and_weight_decay_are_the_flow_times_and_decay(structured):
    """At `learning_rate` eta and `weight_decay` lambda the numbers are exactly
    those of the unit-rate solve at the flow times `eta ts` with `2 lambda`
    added to the decay, and `Solution.ts` are the steps; a weight decay per
    member is each member's decay."""
    lv, m0, _, _, _ = structured
    ts, pid = jnp.asarray(TS_GRAD), _pid(ATOL)
    sol = solve_lv_batch(lv, m0, ts, ETA, LAM, stepsize_controller=pid)
    np.testing.assert_array_equal(sol.ts, jnp.broadcast_to(ts, sol.ts.shape))
    decayed = eqx.tree_at(lambda lv: lv.decay, lv, lv.decay + 2 * LAM)
    flow = solve_lv_batch(decayed, m0, ETA * ts, stepsize_controller=pid)
    np.testing.assert_array_equal(sol.ys, flow.ys)
    np.testing.assert_array_equal(sol.loss, flow.loss)
    lams = jnp.asarray([0.0, LAM, 0.1, 0.3])
    per = solve_lv_batch(lv, m0, ts, ETA, lams, stepsize_controller=pid)
    decayed = eqx.tree_at(lambda lv: lv.decay, lv, lv.decay + 2 * lams)
    flow = solve_lv_batch(decayed, m0, ETA * ts, stepsize_controller=pid)
    np.testing.assert_array_equal(per.ys, flow.ys)
    np.testing.assert_allclose(per.ys[1], sol.ys[1], rtol=1e-9)


@pytest.mark.slow  # 20 s; the fast test above checks the flow times exactly
def test_learning_rate_and_weight_decay_are_solve_lv_s(structured):
    """Member by member `solve_lv(lv, m0, ts, 0.3, 0.01)`'s numbers: the same
    steps, and equal to rounding (1e-10, as at unit rate)."""
    lv, m0, _, _, _ = structured
    ts = jnp.asarray(TS_GRAD)
    sol = solve_lv_batch(lv, m0, ts, ETA, LAM, stepsize_controller=_pid(ATOL))
    control = nqfjax.lv_stepsize_controller(ATOL, dtype=jnp.float64)
    alone = jax.vmap(
        lambda m: solve_lv(lv, m, ts, ETA, LAM, stepsize_controller=control)
    )(jnp.asarray(m0))
    np.testing.assert_array_equal(sol.stats["num_steps"], alone.stats["num_steps"])
    assert _rel(sol.ys, alone.ys) < 1e-10
    np.testing.assert_allclose(sol.loss, alone.loss, rtol=1e-10)


@pytest.mark.parametrize("q", [0, 1, 3])
@pytest.mark.parametrize("batched", [False, True])
def test_structured_step_is_the_woodbury_rosenbrock_step(q, batched):
    """The batched step for `B = diag(d) + U U^T` (the products by `U` of the
    field and of the solve merged) is `LVRosenbrock`'s Rodas4 step member by
    member (`rosenbrock_stages` with `lv_woodbury_solver`), for a diagonal `B`,
    rank 1 and rank 3, with the system shared or given per member: equal to
    rounding (relative 1e-10: with a random `U` and steps up to h = 3 some
    stages reach 1e5, and the two orders of the products differ by ~1e-13)."""
    rng = np.random.default_rng(q + 10 * batched)
    n, p = 6, 7
    lead = (n,) if batched else ()
    ax = 0 if batched else None
    d = jnp.asarray(rng.uniform(0.1, 1.0, size=(*lead, p)))
    d_one = d.reshape(-1, p)[0]  # one system's, to build the module
    if q:
        interactions = LowRankInteractions(d_one, jnp.zeros((p, q)))
        interactions = eqx.tree_at(  # the leaves, batched or not
            lambda i: (i.d, i.U),
            interactions,
            (d, jnp.asarray(rng.normal(size=(*lead, p, q)))),
        )
    else:
        interactions = eqx.tree_at(lambda i: i.d, DiagonalInteractions(d_one), d)
    system = eqx.tree_at(  # the leaves of r, B and the decay, batched or not
        lambda lv: (lv.r, lv.interactions, lv.decay),
        LotkaVolterra(jnp.ones(p), DiagonalInteractions(jnp.ones(p))),
        (
            jnp.asarray(rng.normal(size=(*lead, p))),
            interactions,
            jnp.asarray(rng.uniform(0.0, 0.1, size=lead)),
        ),
    )
    # the loss's scale and offset are shared
    axes = (ax,) * (len(jax.tree.leaves(system)) - 2) + (None, None)
    y0 = jnp.asarray(rng.normal(size=(n, p)) - 2.0)
    h = jnp.asarray(rng.uniform(0.01, 3.0, size=n))
    y_max = jnp.asarray(177.0)
    fused = _lv_batch_loop.structured_step(system, y0, h, y_max, axes=axes)
    in_axes = _lv_batch_loop.in_axes(system, axes)
    member = jax.vmap(_lv_batch_loop.member_step, in_axes=(in_axes, 0, 0, None))
    for a, b in zip(fused, member(system, y0, h, y_max)):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)


# --- gradients: the discrete adjoint of the fused loop ---------------------------

TS_GRAD = np.geomspace(0.1, 300.0, 12)


def _grad_problem(n=3, seed=2):
    """`(params, weights)` for the gradient tests: a structured system with
    `U` of rank 2 (the Woodbury solve with a 2 x 2 capacitance) and `n` members
    with `log m0` from -18 to -7, so their modes switch on inside `TS_GRAD`."""
    r, _, d, U = _interactions()
    rng = np.random.default_rng(seed)
    log_m0 = rng.uniform(-18.0, -7.0, size=(n, P))
    weights = rng.normal(size=(n, TS_GRAD.size, P))
    params = tuple(map(jnp.asarray, (r, d, U, log_m0)))
    return params, jnp.asarray(weights)


def _grad_loss(params, weights, atol, dtype=jnp.float64, **kw):
    """A weighted sum of `log m` at every output (outputs inside steps: the
    dense output) and of the loss: `(value, solution)`. `params`: `(r, d, U,
    log m0)`, and optionally the learning rate and the weight decay."""
    r, d, U, log_m0, *clock = (x.astype(dtype) for x in params)
    lv = LotkaVolterra(r, B_diag=d, B_factor=U)
    pid = _pid(atol, 0.0, dtype)
    sol = solve_lv_batch(
        lv, jnp.exp(log_m0), TS_GRAD, *clock, stepsize_controller=pid, **kw
    )
    value = jnp.sum(weights * jnp.log(sol.ys)) + jnp.sum(sol.loss) / 10
    return value, sol


@pytest.mark.slow
def test_gradient_against_finite_differences():
    """`jax.grad` through `solve_lv_batch` (the discrete adjoint: the accepted
    steps held fixed) against central differences along three random directions
    of `(r, d, U, log m0)`, the learning rate and the weight decay (one per
    member), from `t0 = 0.05`, float64 at atol 1e-9 on `log m`. (The
    derivative in the learning rate is `(t - t0) f(y)` at the outputs, the
    exact solution's, which differs from the numerical one's at atol level.)
    Both differentiate the same solution up to the solver's error: a
    perturbation of 1e-5 moves the steps, which changes the value by
    atol-level amounts, up to ~1e-5 relative in the quotient (measured 1.5e-8
    to 1.5e-7); 1e-5 leaves that margin yet fails a missing stage, output or
    field term (order one)."""
    params, weights = _grad_problem()
    params += (jnp.asarray(ETA), jnp.asarray([LAM, 0.02, 0.05]))
    loss = jax.jit(lambda p: _grad_loss(p, weights, 1e-9, t0=0.05)[0])
    grads = jax.jit(jax.grad(lambda p: _grad_loss(p, weights, 1e-9, t0=0.05)[0]))(
        params
    )
    rng = np.random.default_rng(3)
    eps = 1e-5
    for _ in range(3):
        v = tuple(jnp.asarray(rng.normal(size=x.shape)) for x in params)
        plus = tuple(x + eps * dx for x, dx in zip(params, v))
        minus = tuple(x - eps * dx for x, dx in zip(params, v))
        fd = (loss(plus) - loss(minus)) / (2 * eps)
        ad = sum(jnp.sum(g * dx) for g, dx in zip(grads, v))
        assert abs(float(ad - fd)) <= 1e-5 * abs(float(fd)), (float(ad), float(fd))


def test_gradient_refuses_the_times_and_tolerances():
    """The steps are held fixed, so a derivative through `ts`, `atol` or `dt0`
    is refused at trace time, naming the argument."""
    params, weights = _grad_problem(n=1)
    lv = LotkaVolterra(params[0], B_diag=params[1], B_factor=params[2])
    m0 = jnp.exp(params[3])

    def through(**kw):
        def f(x):
            args = dict(ts=jnp.asarray(TS_GRAD), atol=1e-8, dt0=1e-3)
            args.update({k: v(x) for k, v in kw.items()})
            ts, atol = args.pop("ts"), args.pop("atol")
            pid = diffrax.PIDController(rtol=0.0, atol=atol)
            return jnp.sum(
                solve_lv_batch(lv, m0, ts, stepsize_controller=pid, **args).ys
            )

        return jax.grad(f)

    for name, fn in (
        ("ts", lambda x: x * jnp.asarray(TS_GRAD)),
        ("atol", lambda x: x * 1e-8),
        ("dt0", lambda x: x * 1e-3),
    ):
        with pytest.raises(
            ValueError, match=f"not differentiable with respect to `{name}`"
        ):
            through(**{name: fn})(1.0)


@pytest.mark.slow
@pytest.mark.parametrize("system", ["structured", "batched_dense"])
def test_gradient_equals_solve_lv_at_the_last_time(system, request):
    """At the last output time (which ends a step, so the dense output plays no
    part) the discrete adjoint agrees with the derivative that diffrax's
    `RecursiveCheckpointAdjoint` takes through `vmap(solve_lv)` (the same steps),
    for the whole system, `m0`, the learning rate and the weight decay (at
    `ETA`, `LAM`), to the accuracy of the solve: diffrax also
    differentiates its choice of the steps, an atol-level difference (measured
    1.5e-6 relative with `m0` down to 1e-30, where `d log m / d m0` is 1e18;
    1e-5). Also checks that the `vmap`ped `solve_lv` gradient is finite: a
    finished member idles on steps of length zero, whose infinities once reached
    the others' cotangents."""
    lv, m0 = request.getfixturevalue(system)[:2]
    ts = jnp.asarray(TS)
    w = jnp.asarray(np.random.default_rng(4).normal(size=(len(m0), P)))

    def batch(lv, m0, eta, lam):
        pid = _pid(ATOL)
        sol = solve_lv_batch(lv, m0, ts, eta, lam, stepsize_controller=pid)
        return jnp.sum(w * jnp.log(sol.ys[:, -1])) + jnp.sum(sol.loss[:, -1])

    in_axes = 0 if system == "batched_dense" else None

    def alone(lv, m0, eta, lam):
        def one(lv, m):
            control = nqfjax.lv_stepsize_controller(ATOL, dtype=m.dtype)
            sol = solve_lv(lv, m, ts, eta, lam, stepsize_controller=control)
            return jnp.log(sol.ys[-1]), sol.loss[-1]

        logs, losses = jax.vmap(one, in_axes=(in_axes, 0))(lv, m0)
        return jnp.sum(w * logs) + jnp.sum(losses)

    args = (lv, jnp.asarray(m0), jnp.asarray(ETA), jnp.asarray(LAM))
    got = jax.jit(jax.grad(batch, argnums=(0, 1, 2, 3)))(*args)
    want = jax.jit(jax.grad(alone, argnums=(0, 1, 2, 3)))(*args)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert bool(jnp.all(jnp.isfinite(b)))
        scale = float(jnp.max(jnp.abs(b)))
        assert float(jnp.max(jnp.abs(a - b))) <= 1e-5 * scale


@pytest.mark.slow
def test_gradient_with_recomputed_segments_and_float32():
    """With `max_steps` just above the steps taken, the segments between
    checkpoints are shorter than the solve and the backward pass re-runs them:
    the gradient is the one of a solve held in one segment (to rounding, 1e-12);
    with the members in chunks of one, to the rounding of the batched products
    (1e-9, as the solution itself).
    The float32 path (default tolerances) is within 1e-2 of float64 (the loss is
    a sum over 180 logs, each resolved to ~1e-5 relative; measured 1e-3)."""
    params, weights = _grad_problem()
    f = lambda p, **kw: _grad_loss(p, weights, 1e-8, **kw)
    (_, sol), g = jax.value_and_grad(f, has_aux=True)(params)
    steps = int(jnp.max(sol.stats["num_steps"]))
    assert _lv_batch_adjoint.segment_length(steps + 10) < int(
        jnp.min(sol.stats["num_accepted_steps"])
    )
    g_seg = jax.grad(lambda p: f(p, max_steps=steps + 10)[0])(params)
    # chunks of one member, each its own loop (and its own backward pass): the
    # same steps, the batched products rounded differently (as the solution)
    g_chunk = jax.grad(lambda p: f(p, chunk_size=1)[0])(params)
    for got, rtol in ((g_seg, 1e-12), (g_chunk, 1e-9)):
        for a, b in zip(got, g):
            scale = float(jnp.max(jnp.abs(b)))
            np.testing.assert_allclose(a, b, rtol=rtol, atol=rtol * scale)
    params32 = tuple(x.astype(jnp.float32) for x in params)
    g32 = jax.grad(lambda p: _grad_loss(p, weights, None, dtype=jnp.float32)[0])(
        params32
    )
    for a, b in zip(g32, g):
        assert a.dtype == jnp.float32
        assert float(jnp.max(jnp.abs(a - b))) <= 1e-2 * float(jnp.max(jnp.abs(b)))
