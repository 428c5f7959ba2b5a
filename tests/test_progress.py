"""The one progress meter: a meter passed as `progress=` to `sweep` and
`analyse_curve` receives every step of their work, and a bad `progress` is
refused naming the argument."""

import numpy as np
import pytest

import nqfjax
import nqfjax.experiments
from nqfjax.progress import Bar, as_progress_meter


class _RecordingBar(Bar):
    def __init__(self, log, total, desc, unit):
        self.log = log
        log.append(("open", total, desc, unit))

    def update(self, n=1):
        self.log.append(("update", n))

    def status(self, text):
        self.log.append(("status", text))

    def close(self):
        self.log.append(("close",))


class _RecordingMeter(nqfjax.AbstractProgressMeter):
    log: list

    def bar(self, total, desc, unit="step"):
        return _RecordingBar(self.log, total, desc, unit)


def _done(log) -> int:
    return sum(entry[1] for entry in log if entry[0] == "update")


def test_sweep_reports_every_chunk_to_the_meter():
    log = []

    def fn(x):
        return {"y": 2 * x}

    out = nqfjax.sweep(
        fn, {"x": np.arange(7.0)}, chunk=3, progress=_RecordingMeter(log)
    )
    np.testing.assert_array_equal(out.outputs["y"], 2 * np.arange(7.0))
    assert log[0] == ("open", 3, "sweep", "chunk")  # 7 points, chunks of 3
    assert _done(log) == 3
    statuses = [entry[1] for entry in log if entry[0] == "status"]
    assert statuses[0] == "tracing" and "compiling" in statuses
    assert log[-1] == ("close",)


@pytest.mark.slow  # the model selection's fits: about a minute on two cores
def test_analyse_curve_reports_each_analysis_to_the_meter():
    log = []
    ts = np.geomspace(1.0, 1e4, 200)
    loss = 1.0 / (1.0 + np.exp(ts / 300.0 - 3.0)) + 0.01 * ts**-0.3
    found = nqfjax.experiments.analyse_curve(
        ts, loss, modes=None, progress=_RecordingMeter(log)
    )
    assert log[0][0] == "open" and log[0][2] == "fit"
    total = log[0][1]
    assert total == 3 and _done(log) == total  # model, plateaus, power law
    statuses = [entry[1] for entry in log if entry[0] == "status"]
    assert statuses == ["model", "plateaus", "power_law"]
    assert {"model", "plateaus", "power_law"} <= set(found.as_dict())


@pytest.mark.parametrize("bad", [1, "yes", None, object()])
def test_bad_progress_is_refused_naming_it(bad):
    with pytest.raises(ValueError, match="`progress` must be True, False or"):
        as_progress_meter(bad)
    if not isinstance(bad, str):  # a string is the sweep's label
        with pytest.raises(ValueError, match="`progress`"):
            nqfjax.sweep(lambda x: x, {"x": np.arange(2.0)}, progress=bad)


def test_true_and_false_are_the_default_meter_and_none():
    assert isinstance(as_progress_meter(True), nqfjax.TqdmProgressMeter)
    assert isinstance(as_progress_meter(False), nqfjax.NoProgressMeter)
    meter = nqfjax.TqdmProgressMeter(leave=False)
    assert as_progress_meter(meter) is meter
