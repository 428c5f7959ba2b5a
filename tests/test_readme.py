"""The README's tour runs as written, and its numbers are the theory's."""

import pathlib
import re

import numpy as np


README = pathlib.Path(__file__).parents[1] / "README.md"


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
    L_m = float(namespace["task"].loss(namespace["M"][-1]))
    L_lv = float(namespace["lv"].loss(namespace["m"][-1]))
    assert abs(L_m - L_lv) < 1e-6 * L0
    assert abs(L_w - L_lv) < 1e-2 * L0
    # the power law's fitted exponent is within 10% of (alpha+2beta-1)/(alpha+beta)
    # (without the modes beyond p=2000 the late curve steepens a little)
    np.testing.assert_allclose(float(namespace["fit"].gamma), 2 / 3, rtol=0.1)
    assert np.isfinite(float(namespace["dloss"]))
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
