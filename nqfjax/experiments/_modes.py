"""Reading the modes of a predicted flow (private): which modes are learned.
Shared by the engines of a prediction (`experiments/engines.py`) and
`switch_ons` (`experiments/switch_ons.py`)."""

import numpy as np
from jaxtyping import ArrayLike, Float


def learned_modes(last: Float[np.ndarray, " p"], M0: Float[ArrayLike, "p p"]) -> int:
    r"""How many of the decreasing last values `last` are learned: above
    $\sqrt{\lambda_{\max}(M_0)\,\lambda_1}$, the geometric middle between the
    initial scale and the largest learned mode (none if the largest did not
    grow)."""
    lam0 = float(np.max(np.linalg.eigvalsh(np.asarray(M0, np.float64))))
    return learned_count(last, lam0)


def learned_count(last: Float[np.ndarray, " p"], lam0: float) -> int:
    r"""`learned_modes` given $\lambda_{\max}(M_0)$ = `lam0` instead of `M0`."""
    top = max(float(last[0]), lam0)
    floor = np.sqrt(max(lam0, np.finfo(np.float64).tiny) * top)
    return int(np.sum(last > floor)) if last[0] > lam0 else 0
