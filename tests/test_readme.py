"""The README's tour runs as written, and its numbers are the theory's."""

import pathlib
import re

import numpy as np
import pytest
from helpers import values


README = pathlib.Path(__file__).parents[1] / "README.md"


@pytest.mark.slow  # a long physics check (the slow tier)
def test_readme_tour_runs_and_agrees():
    text = README.read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert len(blocks) == 1
    namespace: dict = {}
    exec(compile(blocks[0], str(README), "exec"), namespace)
    # the three engines agree at the end of training (W-space differs from the
    # quadratic form by tanh's O(W^4) terms and GD's O(eta r) lag: ~1e-3 of L0)
    L0 = float(namespace["res"].loss[0])
    L_w = float(namespace["res"].loss[-1])
    L_m = float(namespace["task"].loss(values(namespace["M"])[-1]))
    L_lv = float(namespace["lv"].loss(values(namespace["m"])[-1]))
    assert abs(L_m - L_lv) < 1e-6 * L0
    assert abs(L_w - L_lv) < 1e-2 * L0
    # mid-curve the engines agree: the recorded step at which each loss first falls
    # below half its start is the same (the records are ~4% apart in log time)
    half = namespace["half"]
    assert half(namespace["res"].loss) == half(namespace["M"].loss)
    assert half(namespace["M"].loss) == half(namespace["m"].loss)
    # the refined sharp-switch sum explains the fitted exponent on the same window
    # (measured 0.6771 against 0.6739 in float32, 0.5%: both fits' floors come
    # out slightly negative where the 2000 modes run out; 0.75% leaves room for
    # the optimiser, and stays below the fit's 1.1% distance to 2/3)
    np.testing.assert_allclose(
        float(namespace["sharp"].gamma), float(namespace["fit"].gamma), rtol=7.5e-3
    )
    # the power law's fitted exponent is within 10% of (alpha+2beta-1)/(alpha+beta)
    # (without the modes beyond p=2000 the late curve steepens a little)
    np.testing.assert_allclose(float(namespace["fit"].gamma), 2 / 3, rtol=0.1)
    # d loss / d init_scale (reverse mode through 2000 GD steps) against a central
    # difference of the same `final_loss` with step h = 1e-4 * init_scale: its
    # truncation error, measured at 5e-6, 5e-8 and 6e-9 relative for h/s = 1e-3,
    # 1e-4, 1e-5 (the (h/s)^2 law down to the roundoff floor, ~1e-8), is 5e-8
    # here; 1e-6 leaves a 20x margin and is far below any wrong-gradient error.
    s, h = 1e-4, 1e-8
    final_loss = namespace["final_loss"]
    fd = (float(final_loss(s + h)) - float(final_loss(s - h))) / (2 * h)
    np.testing.assert_allclose(float(namespace["dloss"]), fd, rtol=1e-6)
    # and it is not trivially small: d ln L / d ln s was measured at -0.68
    assert fd * s / float(final_loss(s)) < -0.3
    # with whitened inputs the converged M soft-thresholds the teacher's spectrum:
    # m_k = max(mu_k - theta, 0) with 2 theta + sum_k min(mu_k, theta) = lam / 2,
    # here theta = (1 - 0.1) / 5 = 0.18 (mu = 0.1 is below it); FISTA's tolerance
    # is 1e-11 relative
    theta = 0.18
    eig = np.sort(np.linalg.eigvalsh(np.asarray(namespace["sol"].M)))[::-1]
    np.testing.assert_allclose(
        eig, [1 - theta, 0.5 - theta, 0.25 - theta, 0], atol=1e-9
    )
    assert namespace["width"] == 3 and namespace["prof"].widths == (1, 2, 3)
    excess = np.asarray(namespace["prof"].excess)
    assert excess[-1] == 0 and np.all(np.diff(excess) < 0)
