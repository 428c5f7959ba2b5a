"""The engine of a prediction and the reference of a comparison are objects
(`nqfjax.AutoEngine`, `LVEngine`, `MFlowEngine`, `ApproximateLVEngine`, each
holding its diffrax options): the engines against each other and a closed form,
and the deprecated words and keywords giving the same numbers.

Small problems (a perceptron with `d = 3`, `k = 2`, `p = 5`; a few hundred
steps); still, each engine compiles for 10-30 s, so the solves are the slow
tier, and the fast tier checks `predict`'s reading of an engine's curves and
which engine each old spelling names with a stand-in engine that solves nothing.
"""

import dataclasses

import diffrax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from helpers import logistic_crossings

import nqfjax
from nqfjax.cli import main


STRUCTURE = nqfjax.Perceptron(d=3, k=2)
COMMON = dict(
    init_scale=1e-3, learning_rate=0.02, width=512, key=jr.key(0), num_records=40
)
NUM_STEPS = 800
TSIT5 = nqfjax.MFlowEngine(solver=diffrax.Tsit5())


@pytest.fixture(scope="module")
def whitened():
    """An orthogonal design (`E[x x^T] = I` exactly) and a linear teacher: the
    task reduces exactly, two modes (r = 4 eta s^2 with s = 3, 1.5)."""
    rng = np.random.default_rng(0)
    xs = 4.0 * np.linalg.qr(rng.normal(size=(16, 16)))[0][:, :3]
    ys = xs @ np.diag([3.0, 1.5, 0.5])[:, :2]
    return xs, ys


@pytest.fixture(scope="module")
def raw():
    """Gaussian inputs and a tanh teacher: does not reduce."""
    rng = np.random.default_rng(0)
    xs = rng.normal(size=(40, 3))
    return xs, np.tanh(xs @ rng.normal(size=(3, 2)))


def _predict(data, **kw):
    return nqfjax.predict(STRUCTURE, *data, num_steps=NUM_STEPS, **COMMON, **kw)


def _same(a, b):
    for field in ("ts", "loss", "switch_times", "mode_values", "modes", "violation"):
        np.testing.assert_array_equal(getattr(a, field), getattr(b, field))
    assert (a.engine, a.reason) == (b.engine, b.reason)


@pytest.mark.slow  # each engine compiles for 10-30 s
def test_engines_agree_where_the_data_reduce(whitened):
    lv = _predict(whitened, engine=nqfjax.LVEngine())
    flow = _predict(whitened, engine=TSIT5)
    assert (lv.engine, flow.engine) == ("lv", "mflow")
    assert float(lv.violation) < 1e-12 and np.isnan(float(flow.violation))
    # the two engines: LV drops the off-diagonal part of M0 in the modes' basis
    # (relative size ~1/sqrt(width)), which moves the loss a little mid-drop
    np.testing.assert_allclose(lv.loss, flow.loss, rtol=5e-3, atol=1e-10)
    np.testing.assert_allclose(lv.switch_times, flow.switch_times, rtol=1e-3)
    # the closed form: independent logistic modes m* / (1 + (m*/m0 - 1) e^{-rt})
    # crossing the threshold theta = half the smaller m*
    task = nqfjax.task_from_samples(STRUCTURE, *whitened)
    system, basis = nqfjax.lv_reduce(task)  # in flow time: steps are t / eta
    m0 = jnp.einsum("ik,ij,jk->k", basis, lv.M0, basis)
    closed = logistic_crossings(system, m0) / COMMON["learning_rate"]
    np.testing.assert_allclose(lv.switch_times, closed, rtol=0.03)
    # the automatic choice is the exact reduction here, and so is the
    # approximate engine (it says so)
    _same(_predict(whitened), lv)
    _same(_predict(whitened, engine=nqfjax.ApproximateLVEngine()), lv)


@pytest.mark.slow  # each engine compiles for 10-30 s
def test_engines_where_the_data_do_not_reduce(raw):
    auto = _predict(raw)
    flow = _predict(raw, engine=TSIT5)
    assert auto.engine == "mflow" and "lv_reduce refused the data" in auto.reason
    np.testing.assert_array_equal(auto.loss, flow.loss)
    np.testing.assert_array_equal(auto.switch_times, flow.switch_times)
    approx = _predict(raw, engine=nqfjax.ApproximateLVEngine())
    assert approx.engine == "approximate_lv"
    # auto stops at the first step of the basis search: a lower bound of the
    # violation the approximate engine measures with the whole search
    assert 0.1 < float(auto.violation) <= float(approx.violation)
    # the C-eigenbasis system is not the flow, but close on this small problem
    agree = nqfjax.agreement(flow, approx, num_switches=1)
    assert np.all(np.abs(np.asarray(agree.time_errors)) < 0.3)
    with pytest.raises(nqfjax.NotReducibleError):
        _predict(raw, engine=nqfjax.LVEngine())
    # an engine's tolerance decides: at tol = 1 the data "reduce"
    loose = _predict(raw, engine=nqfjax.AutoEngine(lv=nqfjax.LVEngine(tol=1.0)))
    np.testing.assert_array_equal(loose.loss, approx.loss)


@pytest.mark.slow  # each engine compiles for 10-30 s
def test_engine_options_reach_the_solver(whitened):
    few = nqfjax.LVEngine(max_steps=2)
    with pytest.raises(Exception, match="max_steps"):
        _predict(whitened, engine=few)
    tight = nqfjax.MFlowEngine(
        solver=diffrax.Tsit5(),
        stepsize_controller=diffrax.PIDController(rtol=1e-11, atol=1e-11),
    )
    tight_flow, flow = (
        _predict(whitened, engine=tight),
        _predict(whitened, engine=TSIT5),
    )
    assert not np.array_equal(tight_flow.loss, flow.loss)
    np.testing.assert_allclose(tight_flow.loss, flow.loss, rtol=1e-6, atol=1e-10)


@pytest.mark.slow  # each engine compiles for 10-30 s
def test_old_words_and_keywords_warn_and_give_the_same_numbers(whitened, raw):
    cases = [
        (whitened, dict(engine="lv"), nqfjax.LVEngine()),
        (
            whitened,
            dict(engine="auto", tol=1e-3),
            nqfjax.AutoEngine(lv=nqfjax.LVEngine(tol=1e-3)),
        ),
        (
            raw,
            dict(engine="mflow", max_steps=5000),
            nqfjax.MFlowEngine(solver=diffrax.Tsit5(), max_steps=5000),
        ),
        (raw, dict(solver=diffrax.Tsit5()), nqfjax.AutoEngine()),
        (raw, dict(engine="approximate_lv"), nqfjax.ApproximateLVEngine()),
    ]
    for data, old, new in cases:
        with pytest.warns(DeprecationWarning, match="engine="):
            before = _predict(data, **old)
        _same(before, _predict(data, engine=new))


def test_bad_engines_name_the_argument(whitened):
    with pytest.raises(ValueError, match="`solver` of MFlowEngine must be a diffrax"):
        nqfjax.MFlowEngine(solver="tsit5")
    with pytest.raises(ValueError, match="`max_steps` of LVEngine must be an int >= 1"):
        nqfjax.LVEngine(max_steps=0)
    with pytest.raises(ValueError, match="`tol` of ApproximateLVEngine must be"):
        nqfjax.ApproximateLVEngine(tol=-1.0)
    with pytest.raises(ValueError, match="`stepsize_controller` of LVEngine"):
        nqfjax.LVEngine(stepsize_controller=diffrax.Tsit5())
    with pytest.raises(
        ValueError, match="`lv` of AutoEngine must be an nqfjax.LVEngine"
    ):
        nqfjax.AutoEngine(lv=nqfjax.MFlowEngine())
    with pytest.raises(ValueError, match="`engine` must be an nqfjax.AbstractEngine"):
        _predict(whitened, engine="lbfgs")
    with pytest.raises(ValueError, match="`engine` must be an nqfjax.AbstractEngine"):
        _predict(whitened, engine=3)
    with pytest.raises(ValueError, match="`tol` inside the engine"):
        _predict(whitened, engine=nqfjax.LVEngine(), tol=1e-3)


def test_the_command_line_maps_its_words_to_engines(monkeypatch):
    seen = {}

    def fake(out, **kwargs):
        seen.update(kwargs)
        raise ValueError("stop here")

    monkeypatch.setattr(nqfjax.experiments, "predict_file", fake)
    expected = {
        "auto": nqfjax.AutoEngine(),
        "lv": nqfjax.LVEngine(),
        "mflow": TSIT5,
        "approximate_lv": nqfjax.ApproximateLVEngine(),
    }
    for word, engine in expected.items():
        assert main(["predict", "d.npz", "--engine", word, "--quiet"]) == 2
        assert seen["engine"] == engine
    assert main(["predict", "d.npz", "--quiet"]) == 2
    assert seen["engine"] == nqfjax.AutoEngine()


# --------------------------------------------------------------------------------
# the fast tier: a stand-in engine


class _Logistic(nqfjax.AbstractEngine):
    """Two logistic modes, half-way at t = 100 and 300, of last values 2 and 1;
    the loss falls by each mode's value. Records the engine that ran."""

    def run(self, task, M0, ts, learning_rate, weight_decay=0.0):
        t = np.asarray(ts, np.float64)[:, None]
        values, half = np.array([2.0, 1.0]), np.array([100.0, 300.0])
        curves = values / (1 + np.exp(-(t - half) / 10.0))
        _Logistic.ran = self
        return nqfjax.experiments.engines.EngineRun(
            engine="lv",
            reason="stand-in",
            violation=0.0,
            loss=3.0 - curves.sum(1),
            mode_curves=curves,
            modes=np.eye(task.p)[:, :2],
            mode_values=values,
        )


def test_predict_reads_an_engines_curves(whitened):
    ts = np.linspace(0.0, 600.0, 1201)
    pred = nqfjax.predict(
        STRUCTURE,
        *whitened,
        ts=ts,
        engine=_Logistic(),
        **{k: v for k, v in COMMON.items() if k != "num_records"},
    )
    # the threshold is half the smaller value, 0.5: the larger mode crosses it
    # before its half-way time, at 100 - 10 ln 3, the smaller one at 300 (up to
    # the log-linear interpolation of records every 0.5 steps)
    np.testing.assert_allclose(
        pred.switch_times, [100.0 - 10 * np.log(3), 300.0], rtol=1e-4
    )
    np.testing.assert_allclose(pred.switch_levels, [0.5, 0.5])
    # the loss at ts[0], at the geometric mean of the switch-ons, at ts[-1]
    at = np.array([0.0, np.sqrt((100.0 - 10 * np.log(3)) * 300.0), 600.0])[:, None]
    curves = np.array([2.0, 1.0]) / (1 + np.exp(-(at - [100.0, 300.0]) / 10.0))
    np.testing.assert_allclose(pred.plateaus, 3.0 - curves.sum(1), rtol=1e-5)
    assert (pred.engine, pred.reason) == ("lv", "stand-in")
    # the growth rate r = 4 eta lambda_max(C)
    C = nqfjax.task_from_samples(STRUCTURE, *whitened).C
    r = 4 * COMMON["learning_rate"] * np.max(np.linalg.eigvalsh(np.asarray(C)))
    np.testing.assert_allclose(pred.growth_rate, r, rtol=1e-12)


class _Flat(nqfjax.AbstractEngine):
    """No mode grows: a flat loss and no learned mode."""

    def run(self, task, M0, ts, learning_rate, weight_decay=0.0):
        T = len(np.asarray(ts))
        return nqfjax.experiments.engines.EngineRun(
            engine="lv",
            reason="stand-in",
            violation=0.0,
            loss=np.full(T, 3.0),
            mode_curves=np.zeros((T, 0)),
            modes=np.zeros((task.p, 0)),
            mode_values=np.zeros(0),
        )


def test_predict_without_a_switch_on(whitened):
    """Nothing switches on within the horizon: no switch-on time, one plateau
    (the loss at ts[0]), and an agreement with nothing to time."""
    pred = nqfjax.predict(
        STRUCTURE,
        *whitened,
        ts=np.linspace(0.0, 100.0, 11),
        engine=_Flat(),
        **{k: v for k, v in COMMON.items() if k != "num_records"},
    )
    assert pred.switch_times.shape == (0,) and pred.switch_ons.groups.shape == (0,)
    np.testing.assert_array_equal(pred.plateaus, [3.0])
    agree = nqfjax.agreement(pred, pred)
    assert agree.time_errors.shape == (0,)


@pytest.mark.parametrize(
    "old,new",
    [
        (dict(engine="lv"), nqfjax.LVEngine()),
        (dict(engine="mflow"), TSIT5),
        (dict(engine="approximate_lv", tol=0.5), nqfjax.ApproximateLVEngine(tol=0.5)),
        (dict(engine="auto"), nqfjax.AutoEngine()),
        (dict(tol=1e-3), nqfjax.AutoEngine(lv=nqfjax.LVEngine(tol=1e-3))),
        (
            dict(solver=diffrax.Heun(), max_steps=10),
            nqfjax.AutoEngine(
                lv=nqfjax.LVEngine(max_steps=10),
                mflow=nqfjax.MFlowEngine(solver=diffrax.Heun(), max_steps=10),
                factored=nqfjax.FactoredMFlowEngine(
                    solver=diffrax.Heun(), max_steps=10
                ),
            ),
        ),
    ],
    ids=["lv", "mflow", "approximate_lv", "auto", "tol", "solver-max_steps"],
)
def test_old_spellings_name_the_same_engine(monkeypatch, whitened, old, new):
    """Each old spelling warns and runs the engine object it names (so the same
    numbers: the slow tier checks them solved)."""
    ran = []
    for cls in (
        nqfjax.AutoEngine,
        nqfjax.LVEngine,
        nqfjax.MFlowEngine,
        nqfjax.ApproximateLVEngine,
    ):
        monkeypatch.setattr(cls, "run", _record_run(ran))
    kw = {k: v for k, v in COMMON.items() if k != "num_records"}
    with pytest.warns(DeprecationWarning, match="pass the engine as an object"):
        nqfjax.predict(STRUCTURE, *whitened, ts=[0.0, 1.0], **old, **kw)
    nqfjax.predict(STRUCTURE, *whitened, ts=[0.0, 1.0], engine=new, **kw)
    assert len(ran) == 2 and ran[0] == ran[1] and ran[1] is new


def _record_run(ran):
    def run(self, task, M0, ts, learning_rate, weight_decay=0.0):
        ran.append(self)
        return dataclasses.replace(_Logistic().run(task, M0, ts, learning_rate))

    return run


# --------------------------------------------------------------------------------
# the reference of compare_methods


def _compare(whitened, **kw):
    """Gradient descent from an init aligned with the modes (so that the LV
    reference is exact) against a reference; 2000 steps, all modes on."""
    xs, ys = whitened
    task = nqfjax.task_from_samples(STRUCTURE, xs, ys)
    _, basis = nqfjax.lv_reduce(task)
    W0 = np.asarray(basis) * 1e-3
    return nqfjax.compare_methods(
        {"gd": nqfjax.Method(0.02)},
        STRUCTURE,
        xs,
        ys,
        num_steps=2000,
        W0=W0,
        record_at=np.unique(np.geomspace(1, 2000, 60).astype(int)),
        **kw,
    )["gd"]


@pytest.mark.slow  # each reference compiles for 10-30 s
def test_compare_references_agree_and_old_spellings_warn(whitened):
    lv = _compare(whitened, reference=nqfjax.LVEngine())
    controller = diffrax.PIDController(rtol=1e-10, atol=1e-10)
    flow = _compare(
        whitened,
        reference=nqfjax.MFlowEngine(
            solver=diffrax.Tsit5(), stepsize_controller=controller
        ),
    )
    # aligned init: the reduction is exact, the two references agree (the
    # shrinking modes only absolutely in M-space, relative to the largest)
    scale = float(np.max(np.asarray(lv.flow_m)))
    np.testing.assert_allclose(lv.flow_m, flow.flow_m, rtol=1e-5, atol=1e-9 * scale)
    np.testing.assert_allclose(lv.flow_switch_times, flow.flow_switch_times, rtol=1e-5)
    # the old words and solve_options: a warning, the same numbers
    with pytest.warns(DeprecationWarning, match="reference='lv'"):
        old_lv = _compare(whitened, reference="lv")
    np.testing.assert_array_equal(old_lv.flow_m, lv.flow_m)
    with pytest.warns(DeprecationWarning, match="solve_options"):
        old_flow = _compare(
            whitened,
            reference="mflow",
            solve_options=dict(solver=diffrax.Tsit5(), rtol=1e-10, atol=1e-10),
        )
    np.testing.assert_array_equal(old_flow.flow_m, flow.flow_m)
    np.testing.assert_array_equal(old_flow.departure, flow.departure)


def test_compare_reference_must_be_an_engine(whitened):
    xs, ys = whitened
    args = ([nqfjax.Method(0.1)], STRUCTURE, xs, ys)
    kw = dict(num_steps=2, W0=np.eye(5))
    with pytest.raises(ValueError, match="`reference` must be an nqfjax.MFlowEngine"):
        nqfjax.compare_methods(*args, **kw, reference=nqfjax.AutoEngine())
    with pytest.raises(ValueError, match="`reference` must be an nqfjax.MFlowEngine"):
        nqfjax.compare_methods(*args, **kw, reference="exact")
    with pytest.raises(ValueError, match="omit `basis`"):
        nqfjax.compare_methods(
            *args, **kw, reference=nqfjax.LVEngine(), basis=np.eye(5)
        )
