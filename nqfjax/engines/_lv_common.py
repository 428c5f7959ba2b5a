r"""What `solve_lv` and `solve_lv_batch` share (private module, public names):
the log-space rates, the floor below which a mode is off, the default
tolerances and first step, the step-size controller's constants, the check of
`m0` and the `moving` statistic.

$$\frac{d \log m_k}{dt} = r_k - (B m)_k - \delta .$$
"""

import diffrax
import equinox as eqx
import jax.numpy as jnp
import numpy as np
import optimistix as optx
from jaxtyping import Array, Bool, Float

from .._checks import error_if, is_concrete, positive


def rates(y, args):
    """`d log m / dt` at `y = log m`, `args = (r, interactions, decay, y_max)`
    (the exponent clipped at `y_max` before `exp`)."""
    r, interactions, decay, y_max = args
    m = jnp.exp(jnp.minimum(y, y_max))
    return r - interactions.mv(m) - decay


def log_floor(dtype) -> float:
    """The log of the smallest normal number of `dtype` (-87.3 in float32, -708.4
    in float64): below it a mode is reported as off."""
    return float(np.log(np.finfo(np.dtype(dtype)).tiny))


def default_tolerances(dtype, atol=None) -> tuple[float, float]:
    """`(rtol, atol)` on `y = log m`. `atol` is a relative error of `m` for large
    and tiny modes alike; `rtol = atol / |log floor|` keeps the control of every
    mode above the floor within a factor 2 of `atol`, and lets a mode that dies
    (its log falling linearly below the floor) take steps that grow with its
    depth: with `rtol = 0` its roundoff, `eps |d log m|` per step, would cap the
    steps at `atol / eps` in log units (84 in float32) to the end of `ts`."""
    if atol is None:
        # float32: measured 3e-5..4e-5 relative error of m from m0 = 1e-30
        atol = 1e-9 if jnp.dtype(dtype) == jnp.float64 else 1e-5
    return atol / abs(log_floor(dtype)), atol


def max_norm(x):
    """The max norm over modes, in which both LV solvers control the error."""
    return jnp.max(jnp.abs(x))


def check_m0(m0, dtype):
    """`m0` in `dtype`: positive, finite and not below the smallest normal number
    of `dtype` (checked before the cast, which would flush it to zero)."""
    m0 = positive("m0", m0)
    tiny = float(jnp.finfo(dtype).tiny)
    msg = (
        f"`m0` must be >= {tiny:.4g}, the smallest normal {jnp.dtype(dtype).name} "
        "number: below it a value is flushed to zero, and `solve_lv` reports a "
        "mode there as off. Start the modes higher, or use float64 (smallest "
        "normal ~2.2e-308)."
    )
    if is_concrete(m0):
        low = np.min(np.asarray(m0, np.float64), initial=np.inf)
        if low < tiny:
            raise ValueError(msg + f" Got min(m0) = {low:.4g}.")
        return m0.astype(dtype)
    return error_if(m0, jnp.any(m0 < tiny), msg).astype(dtype)


def first_step(r, interactions, m0) -> Float[Array, ""]:
    """The default first step of one system: `1e-2 / (max|r| + max|B| max(m0))`
    (`max|B|` is the largest diagonal entry: `B` is PSD)."""
    B_max = jnp.max(interactions.diagonal())
    scale = jnp.max(jnp.abs(r)) + B_max * jnp.max(m0)
    return 1e-2 / jnp.maximum(scale, jnp.finfo(m0.dtype).tiny)


def moving(y_stop, rate, t_left) -> Bool[Array, "... p"]:
    """The modes still moving where the solver stopped: not dying below the floor
    (`log m <= log floor` and falling), and their log would still change by more
    than 1 in the time `t_left` to the last output at the `rate` it had there."""
    dying = (y_stop <= log_floor(y_stop.dtype)) & (rate < 0)
    return ~dying & (jnp.abs(rate) * t_left > 1)


def modes(y) -> Float[Array, "... p"]:
    """`m = exp(y)`, with `0` for a mode at or below the floor (off)."""
    return jnp.where(y <= log_floor(y.dtype), jnp.zeros_like(y), jnp.exp(y))


# --------------------------------------------------------------------------------
# the step-size controller of a fused loop

# the options of `diffrax.PIDController` that `PIDConstants` reads; any other
# left away from diffrax's default is refused by `pid_constants`
_READ = ("rtol", "atol", "icoeff", "dtmax", "factormin", "factormax", "safety")
_READ += ("error_order", "norm")
_DEFAULT_PID = diffrax.PIDController(rtol=0.0, atol=0.0)


class PIDConstants(eqx.Module):
    r"""The constants of an integral step-size controller, read from a
    `diffrax.PIDController` (its defaults are diffrax's): after a step with
    error $e$ (the max norm over modes of `err / (atol + rtol max(|y0|, |y1|))`)
    the next step is `h * clip(safety * e ** (-icoeff / error_order), lo, hi)`,
    `[lo, hi] = [1, factormax]` after an accepted step (`e < 1`) and
    `[factormin, safety]` after a rejected one, then at most `dtmax`."""

    rtol: Float[Array, ""]
    atol: Float[Array, ""]
    exponent: float = eqx.field(static=True)  # icoeff / error_order
    safety: float = eqx.field(static=True)
    factormin: float = eqx.field(static=True)
    factormax: float = eqx.field(static=True)
    dtmax: Float[Array, ""] | None


def pid_constants(
    controller: diffrax.PIDController, error_order: float, dtype
) -> PIDConstants:
    """The constants of `controller` for a loop in `dtype`, `error_order` the
    solver's unless the controller sets one. Refuses, naming them, the options of
    a proportional or derivative part, `dtmin`, and a `norm` other than diffrax's
    default (read as the max norm over modes) or `max_norm`."""
    if not isinstance(controller, diffrax.PIDController):
        raise ValueError(
            "`stepsize_controller` must be a diffrax.PIDController (without "
            f"`step_ts`/`jump_ts`), got {type(controller).__name__}."
        )
    unsupported = [
        name
        for name in ("pcoeff", "dcoeff", "dtmin")
        if not _same(getattr(controller, name), getattr(_DEFAULT_PID, name))
    ]
    if controller.norm not in (_DEFAULT_PID.norm, max_norm, optx.max_norm):
        unsupported.append("norm")
    if unsupported:
        raise ValueError(
            "The fused loop of `solve_lv_batch` runs an integral controller in "
            f"the max norm over modes: it reads {', '.join(_READ)} of "
            "`stepsize_controller` and cannot honour "
            f"{', '.join(f'`{n}`' for n in unsupported)} (leave them at "
            "diffrax's defaults, or use `solve_lv`)."
        )
    order = error_order if controller.error_order is None else controller.error_order
    static = {}
    for name in ("icoeff", "error_order", "safety", "factormin", "factormax"):
        x = order if name == "error_order" else getattr(controller, name)
        if not is_concrete(x):
            raise ValueError(f"`stepsize_controller.{name}` must be concrete.")
        static[name] = float(np.asarray(x))
    dtmax = controller.dtmax
    return PIDConstants(
        rtol=jnp.asarray(controller.rtol, dtype),
        atol=jnp.asarray(controller.atol, dtype),
        exponent=static["icoeff"] / static["error_order"],
        safety=static["safety"],
        factormin=static["factormin"],
        factormax=static["factormax"],
        dtmax=None if dtmax is None else jnp.asarray(dtmax, dtype),
    )


def _same(a, b) -> bool:
    return a is b or (is_concrete(a) and is_concrete(b) and bool(np.all(a == b)))
