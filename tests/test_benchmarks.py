"""Smoke tests of the benchmark scripts (issue 7): each script's `--quick` mode runs
to the end and its two sides compute the same numbers. Speed is never asserted
here (it lives in benchmarks/README.md); only agreement is.

Each script runs in a fresh process, as a user runs it (its own float32/float64
setting, no test configuration), and writes its results to a JSON file.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def run_quick(script: str, tmp_path: Path) -> dict:
    out = tmp_path / f"{Path(script).stem}.json"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), "--quick", "--json", str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return json.loads(out.read_text())


def test_sweep_vs_torch_quick(tmp_path):
    pytest.importorskip("torch")
    result = run_quick("sweep_vs_torch.py", tmp_path)
    assert result["finite"]
    # The compiled program is the one `sweep` builds: bit-identical output.
    assert result["same_as_sweep"]
    # Same float32 GD from the same W0: differences are summation-order roundoff
    # (measured ~2e-7 over 100 steps); 1e-3 still catches any wrong step or lr.
    for name, diff in result["max_rel_diff"].items():
        assert diff <= 1e-3, (name, diff)


def test_small_sweep_quick(tmp_path):
    result = run_quick("small_sweep.py", tmp_path)
    assert result["finite"]
    assert result["same_as_sweep"]
    # vmap vs single runs of the same float32 program: roundoff only (measured
    # ~3e-7); a different seed or init scale would differ by O(1).
    assert result["max_rel_diff"] <= 1e-4


def test_reduction_speedup_quick(tmp_path):
    result = run_quick("reduction_speedup.py", tmp_path)
    assert result["finite"]
    # W-space trains the real tanh layer with GD steps, the LV integrates the
    # reduced flow of its quadratic form: they differ by the tanh nonlinearity
    # and the (1 + r/2)^2-vs-e^r discretisation of a step (measured ~1% at the
    # end of the quick run); the target for the curves is 2%.
    assert result["max_rel_diff"]["LV vs W-space"] <= 2e-2


def test_gradients_quick(tmp_path):
    result = run_quick("gradients.py", tmp_path)
    # Reverse mode and central differences (each at the tolerance that reaches
    # 1e-5 against the tight reference) must agree to about that accuracy.
    assert result["agreement"] <= 1e-4
    # The reference itself (reverse mode at atol 1e-12) agrees with FD there.
    assert result["ref_check"] <= 1e-4
    for name, chosen in result["chosen"].items():
        assert chosen["error"] <= 1e-5, (name, chosen)
