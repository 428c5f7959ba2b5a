r"""Rosenbrock solvers for the log-space Lotka-Volterra system (private module).

`solve_lv` integrates $y = \log m$,

$$\frac{dy}{dt} = f(y) = r - B\, e^{y} - \delta ,$$

whose Jacobian is known in closed form, $J = \partial f / \partial y = -B\,
\mathrm{diag}(e^{y})$. The system is stiff once modes switch on, and the implicit
Runge-Kutta solvers of diffrax (`Kvaerno5`) pay for Newton iterations with a
dense `jacfwd` Jacobian at every step. A Rosenbrock (linearly implicit) method
instead solves a fixed number of linear systems with the one matrix

$$W = I - \gamma h J = I + \gamma h\, B\, \mathrm{diag}(m)$$

per step, and needs no Newton iteration. The solve is the interactions' own
(`AbstractInteractions.rosenbrock_solver`): with `B` dense, `W` is LU-factorised
once per step ($O(p^3)$); with `B = diag(d) + U U^T` (for example the quadratic
network with Gaussian inputs, where `U` is one column) the Woodbury identity
solves it in $O(pq)$ with a `q x q` capacitance matrix.
"""

import dataclasses
import warnings
from typing import ClassVar

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from .._linalg import lu_solver
from ..tasks.interactions import (
    AbstractInteractions,
    DenseInteractions,
    DiagonalInteractions,
    LowRankInteractions,
)


@dataclasses.dataclass(frozen=True)
class RosenbrockTableau:
    r"""The coefficients of a Rosenbrock method in the transformed form of Hairer
    and Wanner (RODAS), with `s` stages: each stage solves

    $$(I/(h\gamma) - J)\, k_i = f\big(t_0 + c_i h,\,
      y_0 + \textstyle\sum_{j<i} a_{ij} k_j\big)
      + \textstyle\sum_{j<i} (C_{ij}/h)\, k_j + h\, d_i\, f_t ,$$

    then $y_1 = y_0 + \sum_i m_i k_i$. The methods are stiffly accurate, so the
    error estimate ($y_1$ minus the embedded solution) is the last stage `k_s`.
    The dense output on a step is $y(\theta) = (1-\theta) y_0 + \theta\,(y_1 +
    (1-\theta)(H_1 + \theta(H_2 + \dots)))$ with $H_r = \sum_i h_{ri} k_i$.

    A frozen (hashable) dataclass of tuples, as diffrax's `RosenbrockTableau`, so
    that it can be a static field of the solver.

    **Fields:**

    - `name`: for messages; `order`: the order of `y1`.
    - `gamma`: the diagonal $\gamma$ of the method (one matrix per step).
    - `a`, `C`: the strictly lower triangles, row `i` of length `i`.
    - `c`, `d`, `m`: length `s`.
    - `H`: the dense-output rows, each of length `s`.

    **Raises:** `ValueError` if the lengths do not fit together.
    """

    name: str
    order: int
    gamma: float
    a: tuple[tuple[float, ...], ...]
    C: tuple[tuple[float, ...], ...]
    c: tuple[float, ...]
    d: tuple[float, ...]
    m: tuple[float, ...]
    H: tuple[tuple[float, ...], ...]

    def __post_init__(self):
        s = len(self.c)
        rows_ok = all(
            len(rows) == s and all(len(row) == i for i, row in enumerate(rows))
            for rows in (self.a, self.C)
        )
        if not (
            s >= 1
            and rows_ok
            and len(self.d) == len(self.m) == s
            and all(len(row) == s for row in self.H)
            and self.order >= 1
            and self.gamma > 0
        ):
            raise ValueError(
                f"Tableau {self.name!r}: `a` and `C` must be strictly lower "
                f"triangles of {s} rows, `c`, `d`, `m` and each row of `H` of "
                f"length {s}, `order >= 1` and `gamma > 0`."
            )

    @property
    def num_stages(self) -> int:
        return len(self.c)


# Rodas4: Hairer and Wanner, Solving ODEs II, section IV.7 (the RODAS code's
# coefficients). Order 4(3), 6 stages, dense output of order 3.
_a5 = (1.221224509226641, 6.019134481288629, 12.53708332932087, -0.687886036105895)
RODAS4 = RosenbrockTableau(
    name="Rodas4",
    order=4,
    gamma=0.25,
    a=(
        (),
        (1.544,),
        (0.9466785280815826, 0.2557011698983284),
        (3.314825187068521, 2.896124015972201, 0.9986419139977817),
        _a5,
        (*_a5, 1.0),
    ),
    C=(
        (),
        (-5.6688,),
        (-2.430093356833875, -0.2063599157091915),
        (-0.1073529058151375, -9.594562251023355, -20.47028614809616),
        (7.496443313967647, -10.24680431464352, -33.99990352819905, 11.7089089320616),
        (
            8.083246795921522,
            -7.981132988064893,
            -31.52159432874371,
            16.31930543123136,
            -6.058818238834054,
        ),
    ),
    c=(0.0, 0.386, 0.21, 0.63, 1.0, 1.0),
    d=(0.25, -0.1043, 0.1035, -0.0362, 0.0, 0.0),
    m=(*_a5, 1.0, 1.0),
    H=(
        (
            10.12623508344586,
            -7.487995877610167,
            -34.80091861555747,
            -7.992771707568823,
            1.025137723295662,
            0.0,
        ),
        (
            -0.6762803392801253,
            6.087714651680015,
            16.43084320892478,
            24.76722511418386,
            -6.594389125716872,
            0.0,
        ),
    ),
)

# Rodas5P: G. Steinebach, "Construction of Rosenbrock-Wanner method Rodas5P and
# numerical benchmarks within the Julia Differential Equations package", BIT
# Numerical Mathematics 63 (2023). Order 5(4), 8 stages, L-stable, stiffly
# accurate, dense output of order 4.
_a6 = (
    -7.502846399306121,
    2.561846144803919,
    -11.627539656261098,
    -0.18268767659942256,
    0.030198172008377946,
)
RODAS5P = RosenbrockTableau(
    name="Rodas5P",
    order=5,
    gamma=0.21193756319429014,
    a=(
        (),
        (3.0,),
        (2.849394379747939, 0.45842242204463923),
        (-6.954028509809101, 2.489845061869568, -10.358996098473584),
        (
            2.8029986275628964,
            0.5072464736228206,
            -0.3988312541770524,
            -0.04721187230404641,
        ),
        _a6,
        (*_a6, 1.0),
        (*_a6, 1.0, 1.0),
    ),
    C=(
        (),
        (-14.155112264123755,),
        (-17.97296035885952, -2.859693295451294),
        (147.12150275711716, -1.41221402718213, 71.68940251302358),
        (
            165.43517024871676,
            -0.4592823456491126,
            42.90938336958603,
            -5.961986721573306,
        ),
        (
            24.854864614690072,
            -3.0009227002832186,
            47.4931110020768,
            5.5814197821558125,
            -0.6610691825249471,
        ),
        (
            30.91273214028599,
            -3.1208243349937974,
            77.79954646070892,
            34.28646028294783,
            -19.097331116725623,
            -28.087943162872662,
        ),
        (
            37.80277123390563,
            -3.2571969029072276,
            112.26918849496327,
            66.9347231244047,
            -40.06618937091002,
            -54.66780262877968,
            -9.48861652309627,
        ),
    ),
    c=(
        0.0,
        0.6358126895828704,
        0.4095798393397535,
        0.9769306725060716,
        0.4288403609558664,
        1.0,
        1.0,
        1.0,
    ),
    d=(
        0.21193756319429014,
        -0.42387512638858027,
        -0.3384627126235924,
        1.8046452872882734,
        2.325825639765069,
        0.0,
        0.0,
        0.0,
    ),
    m=(*_a6, 1.0, 1.0, 1.0),
    H=(
        (
            25.948786856663858,
            -2.5579724845846235,
            10.433815404888879,
            -2.3679251022685204,
            0.524948541321073,
            1.1241088310450404,
            0.4272876194431874,
            -0.17202221070155493,
        ),
        (
            -9.91568850695171,
            -0.9689944594115154,
            3.0438037242978453,
            -24.495224566215796,
            20.176138334709044,
            15.98066361424651,
            -6.789040303419874,
            -6.710236069923372,
        ),
        (
            11.419903575922262,
            2.8879645146136994,
            72.92137995996029,
            80.12511834622643,
            -52.072871366152654,
            -59.78993625266729,
            -0.15582684282751913,
            4.883087185713722,
        ),
    ),
)
# the caller of `LVRosenbrock(...)` seen from its `__init__`: equinox's module
# metaclass calls `__init__` through two frames of its own
_INIT_STACKLEVEL = 4
# the strings of the deprecated `LVRosenbrock(method=...)`
_TABLEAUS_BY_NAME = {"rodas4": RODAS4, "rodas5p": RODAS5P}


def _combine(coeffs, ks):
    """`sum_j coeffs[j] * ks[j]`, skipping zeros (unrolled at trace time)."""
    out = None
    for c, k in zip(coeffs, ks):
        if c == 0.0:
            continue
        term = k if c == 1.0 else c * k
        out = term if out is None else out + term
    return out


def rosenbrock_stages(tableau, f, solve, t0, y0, h, ft=None):
    r"""One Rosenbrock step of `tableau` from `(t0, y0)` over `h`: the stages
    $k_i$ (see `RosenbrockTableau`), each `solve(rhs)` of a right-hand side built
    from `f(t, y)`; `ft` is $\partial f / \partial t$ (None: autonomous).

    **Returns:** `(y1, err, H)`: the new state, the error estimate (the last
    stage) and the dense-output rows, shape `(r, *y0.shape)`.
    """
    ks = []
    for i in range(len(tableau.c)):
        y_stage = y0 if i == 0 else y0 + _combine(tableau.a[i], ks)
        rhs = f(t0 + tableau.c[i] * h, y_stage)
        if i > 0:
            rhs = rhs + _combine(tableau.C[i], ks) / h
        if ft is not None and tableau.d[i] != 0.0:
            rhs = rhs + (tableau.d[i] * h) * ft
        ks.append(solve(rhs))
    y1 = y0 + _combine(tableau.m, ks)
    return y1, ks[-1], jnp.stack([_combine(r, ks) for r in tableau.H])


def dense_output(y0, y1, H, theta):
    r"""The dense output $(1-\theta) y_0 + \theta (y_1 + (1-\theta)(H_1 + \theta
    (H_2 + \dots)))$ at the fraction `theta` of the step (broadcasting)."""
    inner = H[-1]
    for H_r in H[-2::-1]:
        inner = H_r + theta * inner
    return (1 - theta) * y0 + theta * (y1 + (1 - theta) * inner)


def exponent_clip(dtype) -> float:
    """The largest exponent let through `exp`: a quarter of the log of the largest
    float (177 in float64, 22 in float32), as in `solve_lv`, so that a rejected
    trial step cannot overflow."""
    return 0.25 * float(np.log(np.finfo(np.dtype(dtype)).max))


class RosenbrockInterpolation(diffrax.AbstractLocalInterpolation):
    r"""The dense output of a Rodas method on one step,
    $y(\theta) = (1-\theta)\, y_0 + \theta\,\big(y_1 + (1-\theta)(H_1 + \theta(H_2
    + \dots))\big)$, with $H_r$ combinations of the stage vectors."""

    t0: Float[Array, ""]
    t1: Float[Array, ""]
    y0: Float[Array, " p"]
    y1: Float[Array, " p"]
    H: Float[Array, "r p"]

    def evaluate(self, t0, t1=None, left: bool = True):
        del left
        if t1 is not None:
            return self.evaluate(t1) - self.evaluate(t0)
        # a step of length 0 (a finished member under `vmap`) has theta = 0
        h = self.t1 - self.t0
        theta = ((t0 - self.t0) / jnp.where(h == 0, 1, h)).astype(self.y0.dtype)
        return dense_output(self.y0, self.y1, self.H, theta)


class LVRosenbrock(diffrax.AbstractAdaptiveSolver):
    r"""A Rodas (Rosenbrock) solver using the analytic Jacobian of the log-space
    Lotka-Volterra field.

    Each stage is one evaluation of the vector field and one linear solve with
    $W = I - \gamma h J$ (Hairer and Wanner, *Solving Ordinary Differential
    Equations II*, section IV.7); there is no Newton iteration. For the field
    $f(y) = r - B e^{y} - \delta$ that `solve_lv` integrates,
    $J = -B\,\mathrm{diag}(e^y)$ and

    $$W = I + \gamma h\, B\, \mathrm{diag}(m), \qquad m = e^{\min(y,\, y_{max})}.$$

    How `W` is solved is the interactions' own
    (`AbstractInteractions.rosenbrock_solver`):

    - `LVRosenbrock(DenseInteractions(B))`: `W` is LU-factorised once per step,
      $O(p^3)$.
    - `LVRosenbrock(LowRankInteractions(d, U))`: `B = diag(d) + U U^T` with
      `U` of shape `(p, q)`; Woodbury with a `q x q` capacitance matrix,
      $O(pq^2 + q^3)$ per step. `DiagonalInteractions(d)`: $O(p)$.
    - `LVRosenbrock()`: a generic Rosenbrock solver for any ODE with a 1-D state:
      `J` by `jax.jacfwd` of the vector field, $\partial f / \partial t$ by
      `jax.jvp`, dense LU.

    With interactions, the solver assumes the term is the log-space LV field with
    this `B` (as `solve_lv` builds it): only the linear algebra uses `B`, the
    stages evaluate the term. With a `B` that does not match the term the method
    loses its order: it takes many more steps and its error estimate is less
    reliable. Usage: `solve_lv(lv, m0, ts, solver=LVRosenbrock(lv.interactions,
    tableau=RODAS5P))`; under `jax.vmap` over systems, build the solver inside
    the vmapped function (it is a pytree).

    Tableaus (`tableau=`), both L-stable and stiffly accurate, with the last stage
    as error estimate and a dense output built from the (damped) stage vectors,
    which stays accurate on steps much longer than the fast time scales:

    - `RODAS4` (default): order 4(3), 6 stages, dense output of order 3
      (Hairer and Wanner's RODAS).
    - `RODAS5P`: order 5(4), 8 stages, dense output of order 4 (Steinebach,
      BIT Numer. Math. 63, 2023). On the 64-mode benchmark of
      `benchmarks/lv_vs_scipy.py` its error estimate let the error during the
      first switch-ons reach 30x the tolerance, so it needed more steps than
      `RODAS4` for the same accuracy.

    With `rtol = 0`, `atol` bounds the local error of $\log m$, i.e. the relative
    error of `m`, for large and tiny modes alike.

    Gradients go through `diffrax.RecursiveCheckpointAdjoint`
    (discretise-then-differentiate: exact for the numerical solution) and forward
    mode (`diffrax.ForwardMode()`).

    **Arguments:**

    - `interactions`: the `AbstractInteractions` of the system (`lv.interactions`),
      or None (default) for the generic solver.
    - `tableau`: a `RosenbrockTableau`, `RODAS4` (default) or `RODAS5P`.
    - `y_max`: the exponent clip; default that of `solve_lv`
      (`0.25 * log(finfo(dtype).max)`).
    - `B`, `diag`, `factor`: deprecated (accepted with a `DeprecationWarning` for
      one release): `B=B` for `DenseInteractions(B)`, `diag=d, factor=U` for
      `LowRankInteractions(d, U)`.
    - `method`: deprecated, `"rodas4"` or `"rodas5p"` for `tableau` (accepted
      with a `DeprecationWarning` for one release).

    **Raises:** `ValueError` if the arguments mix forms or have the wrong shapes,
    or (at trace time) if the state is not a 1-D array of the size of `B`.
    """

    interactions: AbstractInteractions | None
    tableau: RosenbrockTableau = eqx.field(static=True)
    y_max: float | None = eqx.field(static=True)

    term_structure: ClassVar = diffrax.AbstractTerm
    interpolation_cls: ClassVar = RosenbrockInterpolation

    def __init__(
        self,
        interactions: AbstractInteractions | None = None,
        tableau: RosenbrockTableau = RODAS4,
        y_max: float | None = None,
        *,
        B=None,
        diag=None,
        factor=None,
        method: str | None = None,
    ):
        if method is not None:
            warnings.warn(
                "`LVRosenbrock(method=...)` is deprecated; pass the tableau object, "
                "e.g. `tableau=RODAS5P`.",
                DeprecationWarning,
                stacklevel=_INIT_STACKLEVEL,
            )
            if method not in _TABLEAUS_BY_NAME:
                raise ValueError(
                    f"`method` must be one of {sorted(_TABLEAUS_BY_NAME)}, got "
                    f"{method!r}."
                )
            tableau = _TABLEAUS_BY_NAME[method]
        if not isinstance(tableau, RosenbrockTableau):
            raise ValueError(
                f"`tableau` must be a RosenbrockTableau (e.g. RODAS4), got {tableau!r}."
            )
        legacy = _legacy_interactions(B, diag, factor)
        if legacy is not None:
            if interactions is not None:
                raise ValueError(
                    "Give either `interactions` or the deprecated `B`/(`diag`, "
                    "`factor`), not both."
                )
            interactions = legacy
        if interactions is not None and not isinstance(
            interactions, AbstractInteractions
        ):
            raise ValueError(
                "`interactions` must be an AbstractInteractions (e.g. "
                f"`lv.interactions`), got {type(interactions).__name__}."
            )
        self.interactions = interactions
        self.tableau = tableau
        self.y_max = y_max

    @property
    def mode(self) -> str:
        """Deprecated: `"dense"`, `"diag_low_rank"` or `"generic"`; the form is
        the type of `interactions`."""
        warnings.warn(
            "`LVRosenbrock.mode` is deprecated; the form of the interactions is "
            "the type of `LVRosenbrock.interactions`.",
            DeprecationWarning,
            stacklevel=2,
        )
        if self.interactions is None:
            return "generic"
        if isinstance(self.interactions, DenseInteractions):
            return "dense"
        return "diag_low_rank"

    def order(self, terms) -> int:
        return self.tableau.order

    def init(self, terms, t0, t1, y0, args):
        self._check_state(y0)
        return None

    def func(self, terms, t0, y0, args):
        return terms.vf(t0, y0, args)

    def _check_state(self, y0):
        if not isinstance(y0, jax.Array) or y0.ndim != 1:
            raise ValueError(
                "`LVRosenbrock` needs the state `y0` to be a 1-D array, got shapes "
                f"{[jnp.shape(x) for x in jax.tree.leaves(y0)]}."
            )
        if self.interactions is None:
            return
        p = self.interactions.size
        if p != y0.shape[0]:
            raise ValueError(
                f"The interactions have size {p} but the state has shape {y0.shape}."
            )

    def _linear_solve(self, f, t0, y0, gh, sign):
        """`solve(b) = (I/(gh) - J)^{-1} b` for the Jacobian `J` of `f` (which is
        `sign` times the LV field in the LV modes), and `f_t` (None if autonomous)."""
        dtype = y0.dtype
        if self.interactions is None:  # the generic solver
            eye = jnp.eye(y0.shape[0], dtype=dtype)
            jac = jax.jacfwd(lambda y: f(t0, y))(y0).astype(dtype)
            _, ft = jax.jvp(lambda t: f(t, y0), (t0,), (jnp.ones_like(t0),))
            solve = lu_solver(eye - gh * jac)
            return (lambda b: solve(gh * b)), ft.astype(dtype)
        y_max = exponent_clip(dtype) if self.y_max is None else self.y_max
        m = jnp.exp(jnp.minimum(y0, y_max))
        # W = I - gh J = I + g B diag(m), with g = sign * gh.
        g = sign * gh
        return self.interactions.rosenbrock_solver(m, g, gh), None

    def step(self, terms, t0, t1, y0, args, solver_state, made_jump):
        del solver_state, made_jump
        self._check_state(y0)
        tab = self.tableau
        dtype = y0.dtype
        t0 = jnp.asarray(t0)
        h = jnp.asarray(t1 - t0, dtype)
        # `diffeqsolve` integrates in increasing time and wraps the term (in a
        # `WrapTerm`) so that `vf` sees the true time; its `direction` (+1 or -1)
        # multiplies the field.
        sign = jnp.asarray(getattr(terms, "direction", 1), dtype)

        def f(t, y):
            return sign * terms.vf(t, y, args).astype(dtype)

        # A step of length 0 is what a finished member of a `vmap`ped solve
        # takes: its stages divide by `h`, so they are computed on a unit step
        # and discarded; without this, their infinities reach the cotangents of
        # the other members through `vmap`'s selects (0 * inf = NaN).
        idle = h == 0
        h = jnp.where(idle, jnp.ones_like(h), h)
        solve, ft = self._linear_solve(f, t0, y0, tab.gamma * h, sign)
        y1, err, H = rosenbrock_stages(tab, f, solve, t0, y0, h, ft)
        y1 = jnp.where(idle, y0, y1)
        err = jnp.where(idle, jnp.zeros_like(err), err)
        H = jnp.where(idle, jnp.zeros_like(H), H)
        dense_info = dict(y0=y0, y1=y1, H=H)
        return y1, err, dense_info, None, diffrax.RESULTS.successful


def _legacy_interactions(B, diag, factor):
    """The interactions of the deprecated keywords of `LVRosenbrock`, `B=` or
    `diag=, factor=` (None when none is given)."""
    given = {
        k for k, v in (("B", B), ("diag", diag), ("factor", factor)) if v is not None
    }
    if not given:
        return None
    warnings.warn(
        "`LVRosenbrock(B=..., diag=..., factor=...)` is deprecated; pass the "
        "interactions, e.g. `LVRosenbrock(lv.interactions)`.",
        DeprecationWarning,
        stacklevel=_INIT_STACKLEVEL + 1,
    )
    if given == {"B"}:
        if jnp.ndim(B) != 2 or jnp.shape(B)[0] != jnp.shape(B)[1]:
            raise ValueError(f"`B` must have shape (p, p), got {jnp.shape(B)}.")
        return DenseInteractions(B)
    if "B" in given:
        raise ValueError("Give either `B` or (`diag`, `factor`), not both.")
    if given != {"diag", "factor"}:
        raise ValueError("`diag` and `factor` must be given together.")
    if jnp.ndim(diag) != 1:
        raise ValueError(f"`diag` must have shape (p,), got {jnp.shape(diag)}.")
    p = jnp.shape(diag)[0]
    if jnp.ndim(factor) != 2 or jnp.shape(factor)[0] != p:
        raise ValueError(f"`factor` must have shape ({p}, q), got {jnp.shape(factor)}.")
    if jnp.shape(factor)[1] == 0:
        return DiagonalInteractions(diag)
    return LowRankInteractions(diag, factor)
