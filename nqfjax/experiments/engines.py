r"""The engine of a prediction as an object: which flow `predict` integrates (and
`compare_methods` compares against), with the diffrax objects that configure
its solve.

- `MFlowEngine`: the M-space flow $\dot M = -2\eta(GM + MG) - 2\eta\lambda M$
  (`solve_mflow`), exact for any data and any $M_0$.
- `FactoredMFlowEngine`: the same flow integrated for a `(p, r)` factor of
  $M$ (`solve_mflow_factored`): no `(p, p)` matrix, cheaper when `r < p`.
- `LVEngine`: the exact Lotka-Volterra reduction (`lv_reduce`, `solve_lv`);
  `NotReducibleError` where the data do not reduce.
- `ApproximateLVEngine`: the Lotka-Volterra system in the eigenbasis of `C`
  whatever the violation of commutation (reported).
- `AutoEngine`: its `lv` engine where the data reduce, else its `factored`
  engine when the rank of $M_0$ is below `p`, else its `mflow` engine.

Each holds `solver`, `stepsize_controller`, `adjoint` and `max_steps`, passed
to its engine function; `None` leaves that function's default. `AbstractEngine.run`
is the one method `predict` calls; it passes the initial weights as the keyword
`factor` to an engine whose `run` takes one (`FactoredMFlowEngine`,
`AutoEngine`).
"""

import abc
import dataclasses
import inspect

import diffrax
import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jaxtyping import ArrayLike, Float

from ..engines._integrate import Solution
from ..engines.lv import NotReducibleError, solve_lv
from ..engines.mflow import solve_mflow
from ..engines.mflow_factored import solve_mflow_factored
from ..engines.reduction import Reduction, measure_reduction
from ..tasks.base import Task
from ..tasks.lotka_volterra import LotkaVolterra
from ._modes import learned_count, learned_modes
from .validity import factors_of, polar_factor, record_index


class EngineRun(eqx.Module):
    r"""What an engine gives `predict` (`AbstractEngine.run`): the loss along the
    times and the learned modes, as float64 numpy arrays.

    **Fields:**

    - `engine`: the engine used, `"lv"`, `"mflow"` or `"approximate_lv"`.
    - `reason`: one line saying why (with the measured violation).
    - `violation`: the relative violation of commutation (0 for an exact
      reduction measured at roundoff; NaN when not measured).
    - `loss`: the loss at the times, shape `(T,)`.
    - `mode_curves`: the eigenvalues of `M` by rank along the times (largest
      first at each time), the first `q`, shape `(T, q)`.
    - `modes`: the learned modes (eigenvectors of the last `M`), shape `(p, q)`,
      by decreasing last value.
    - `mode_values`: their last values, shape `(q,)`.
    - `factors`: the weights $W(t)$ (`W W^T = M(t)`) at the records
      `factor_index` (`record_index`), shape `(R, p, m)`, for the departure of
      the real layer from its quadratic form (`leading_order_validity`); `None`
      when the engine gives none.
    - `factor_index`: those records' indices into the times, shape `(R,)`.
    """

    engine: str = eqx.field(static=True)
    reason: str = eqx.field(static=True)
    violation: float
    loss: Float[np.ndarray, " T"]
    mode_curves: Float[np.ndarray, "T q"]
    modes: Float[np.ndarray, "p q"]
    mode_values: Float[np.ndarray, " q"]
    factors: Float[np.ndarray, "R p m"] | None = None
    factor_index: np.ndarray | None = None


def _check_options(engine) -> None:
    """The diffrax options of an engine: `None` or the right diffrax type, and
    `max_steps` an int >= 1."""
    kinds = (
        ("solver", diffrax.AbstractSolver),
        ("stepsize_controller", diffrax.AbstractStepSizeController),
        ("adjoint", diffrax.AbstractAdjoint),
    )
    name = type(engine).__name__
    for field, kind in kinds:
        value = getattr(engine, field)
        if value is not None and not isinstance(value, kind):
            raise ValueError(
                f"`{field}` of {name} must be a diffrax.{kind.__name__} or None, "
                f"got {value!r}."
            )
    steps = engine.max_steps
    integer = isinstance(steps, int | np.integer) and not isinstance(steps, bool)
    if steps is not None and not (integer and steps >= 1):
        raise ValueError(
            f"`max_steps` of {name} must be an int >= 1 or None, got {steps!r}."
        )


def _check_tol(engine) -> None:
    tol = engine.tol
    ok = isinstance(tol, int | float | np.number) and not isinstance(tol, bool)
    if tol is not None and not (ok and float(tol) >= 0):
        raise ValueError(
            f"`tol` of {type(engine).__name__} must be a number >= 0 or None, "
            f"got {tol!r}."
        )


def _options(engine) -> dict:
    """The engine's diffrax options that are set (`None` leaves the engine
    function's default)."""
    names = ("solver", "stepsize_controller", "adjoint", "max_steps")
    return {n: getattr(engine, n) for n in names if getattr(engine, n) is not None}


class AbstractEngine(eqx.Module):
    """The engine of a prediction: what `predict(engine=...)` integrates.

    A concrete engine implements `run`; `predict` builds the task and `M0`, calls
    `run`, and reads the switch-on times and plateaus off its `EngineRun`.
    """

    @abc.abstractmethod
    def run(
        self,
        task: Task,
        M0: Float[ArrayLike, "p p"],
        ts: Float[ArrayLike, " T"],
        learning_rate: float,
        weight_decay: float = 0.0,
    ) -> EngineRun:
        r"""Integrate the flow of `task` from `M0` at the times `ts` (gradient
        steps of rate `learning_rate`, weight decay `weight_decay`) and read its
        learned modes.

        **Returns:** an `EngineRun` (`nqfjax.experiments.engines.EngineRun`:
        the engine's name and reason, the loss, the learned modes and their
        curves).
        """


class MFlowEngine(AbstractEngine):
    r"""The M-space flow $\dot M = -2\eta(GM + MG) - 2\eta\lambda M$ from $M_0$
    (`solve_mflow`): exact for any data and any $M_0$; `O(p^3)` per step.

    **Arguments:** `solver`, `stepsize_controller`, `adjoint`, `max_steps`:
    passed to `solve_mflow`; `None` (default) leaves its default (the implicit
    `diffrax.Kvaerno5`, a PID controller at 1e-9 in float64). `predict`'s
    automatic choice uses `MFlowEngine(solver=diffrax.Tsit5())`: before the
    modes switch on the flow is not stiff, and on wine (`p = 16`) it matched
    `Kvaerno5` to 2e-7 in the loss at a fraction of the cost.
    """

    solver: diffrax.AbstractSolver | None = None
    stepsize_controller: diffrax.AbstractStepSizeController | None = None
    adjoint: diffrax.AbstractAdjoint | None = None
    max_steps: int | None = eqx.field(default=None, static=True)

    def __check_init__(self):
        _check_options(self)

    def solve(
        self,
        task: Task,
        M0: Float[ArrayLike, "p p"],
        ts: Float[ArrayLike, " T"],
        learning_rate,
        weight_decay=0.0,
        **kwargs,
    ) -> Solution:
        """`solve_mflow(task, M0, ts, learning_rate, weight_decay, **kwargs)`
        with this engine's solver options (`kwargs`: its others, e.g.
        `momentum`)."""
        return solve_mflow(
            task, M0, ts, learning_rate, weight_decay, **_options(self), **kwargs
        )

    def run(
        self, task, M0, ts, learning_rate, weight_decay=0.0, *, W0=None
    ) -> EngineRun:
        """The flow's `M(ts)`; its eigenvalues by rank, and the modes, the
        eigenvectors of the last `M`; the weights at the records
        `factors_of(M, W0)` (`W0`: the initial weights, `W0 @ W0.T = M0`, if
        known; else the factor of `M0`)."""
        sol = self.solve(task, M0, ts, learning_rate, weight_decay)
        M = np.asarray(sol.ys, np.float64)
        idx = record_index(ts)
        factors = factors_of(M[idx], factor_of(M0) if W0 is None else W0)
        curves = np.linalg.eigvalsh(0.5 * (M + np.swapaxes(M, 1, 2)))[:, ::-1]
        _, vecs = np.linalg.eigh(0.5 * (M[-1] + M[-1].T))
        vecs, last = vecs[:, ::-1], curves[-1]
        q = learned_modes(last, M0)
        return EngineRun(
            engine="mflow",
            reason="M-space flow: the M-space flow was asked for",
            violation=float("nan"),
            loss=np.asarray(sol.loss, np.float64),
            mode_curves=curves[:, :q],
            modes=vecs[:, :q],
            mode_values=last[:q],
            factors=factors,
            factor_index=idx,
        )


def factor_of(M0: Float[ArrayLike, "p p"]) -> Float[np.ndarray, "p r"]:
    """A factor `W` of the symmetric PSD `M0` with `W W^T = M0` and one column per
    eigenvalue above roundoff (`p eps` of the largest): `U sqrt(lambda)` from
    `eigh`, float64, shape `(p, r)` with `r` the numerical rank (at least 1)."""
    M0 = np.asarray(M0, np.float64)
    lam, U = np.linalg.eigh(0.5 * (M0 + M0.T))
    keep = lam > max(float(lam[-1]), 0.0) * M0.shape[0] * np.finfo(np.float64).eps
    keep[-1] = True
    return U[:, keep] * np.sqrt(np.maximum(lam[keep], 0.0))


def accepts_factor(engine: "AbstractEngine") -> bool:
    """Whether `engine.run` takes the keyword `W0` (the initial weights, a
    `(p, r)` factor of `M0`)."""
    try:
        return "W0" in inspect.signature(engine.run).parameters
    except (TypeError, ValueError):  # pragma: no cover
        return False


class FactoredMFlowEngine(AbstractEngine):
    r"""The M-space flow integrated for a `(p, r)` factor $W$ of $M = W W^\top$
    (`solve_mflow_factored`): the same $M(t)$ as `MFlowEngine`, with rank
    $M \le r$ kept by construction, `O(n k p r)` or less per step through a
    sampled task's structure (against `O(p^3)`), and no `(p, p)` matrix per
    record: the modes are the left singular vectors of the last factor, their
    values the squared singular values (`O(T p r^2)`). At most `r` modes are
    reported learned.

    **Arguments:** `solver`, `stepsize_controller`, `adjoint`, `max_steps`:
    passed to `solve_mflow_factored`; `None` (default) leaves its default
    (`diffrax.Tsit5()`, a PID controller at 1e-9 in float64).
    """

    solver: diffrax.AbstractSolver | None = None
    stepsize_controller: diffrax.AbstractStepSizeController | None = None
    adjoint: diffrax.AbstractAdjoint | None = None
    max_steps: int | None = eqx.field(default=None, static=True)

    def __check_init__(self):
        _check_options(self)

    def solve(
        self,
        task: Task,
        W0: Float[ArrayLike, "p r"],
        ts: Float[ArrayLike, " T"],
        learning_rate,
        weight_decay=0.0,
        **kwargs,
    ) -> Solution:
        """`solve_mflow_factored(task, W0, ts, learning_rate, weight_decay,
        **kwargs)` with this engine's solver options."""
        return solve_mflow_factored(
            task, W0, ts, learning_rate, weight_decay, **_options(self), **kwargs
        )

    def run(
        self, task, M0, ts, learning_rate, weight_decay=0.0, *, W0=None
    ) -> EngineRun:
        """The flow from `W0` (shape `(p, r)`, with `W0 @ W0.T =
        M0`; `predict` passes its initial weights), or from the factor of `M0`
        by `eigh` (`factor_of`) when `None`; `M0` is not read then."""
        W0 = factor_of(M0) if W0 is None else W0
        W0 = jnp.asarray(W0, jnp.result_type(task.dtype, jnp.asarray(W0).dtype))
        sol = self.solve(task, W0, ts, learning_rate, weight_decay)
        W = np.asarray(sol.ys, np.float64)
        # the eigenvalues of M = W W^T by rank: squared singular values
        curves = np.linalg.svd(W, compute_uv=False) ** 2
        vecs = np.linalg.svd(W[-1], full_matrices=False)[0]
        last = curves[-1]
        lam0 = float(np.linalg.norm(np.asarray(W0, np.float64), 2) ** 2)
        q = min(learned_count(last, lam0), W.shape[2])
        idx = record_index(ts)
        return EngineRun(
            engine="mflow",
            reason="M-space flow for a factor of rank "
            f"{W.shape[2]} (p = {W.shape[1]}): the factored flow was asked for",
            violation=float("nan"),
            loss=np.asarray(sol.loss, np.float64),
            mode_curves=curves[:, :q],
            modes=vecs[:, :q],
            mode_values=last[:q],
            factors=W[idx],
            factor_index=idx,
        )


def _solve_lv_run(
    options, lv, basis, M0, ts, eta, weight_decay, W0=None, **labels
) -> EngineRun:
    """`solve_lv` from $m_0 = \\mathrm{diag}(U^\\top M_0 U)$; the modes are the
    columns of the basis, by decreasing last value. The weights at the records:
    $W = U \\mathrm{diag}(\\sqrt m) U^\\top O$ (`factors_of` of
    $M = U \\mathrm{diag}(m) U^\\top$, without a `(p, p)` product per record)."""
    m0 = jnp.einsum("ik,ij,jk->k", basis, M0, basis)
    sol = solve_lv(lv, m0, ts, eta, weight_decay, **options)
    m = np.asarray(sol.ys, np.float64)
    idx = record_index(ts)
    U = np.asarray(basis, np.float64)
    UtO = U.T @ polar_factor(factor_of(M0) if W0 is None else W0)
    factors = np.stack([(U * np.sqrt(np.maximum(mi, 0.0))) @ UtO for mi in m[idx]])
    order = np.argsort(-m[-1], kind="stable")
    vecs, last = np.asarray(basis, np.float64)[:, order], m[-1][order]
    q = learned_modes(last, M0)
    return EngineRun(
        **labels,
        loss=np.asarray(sol.loss, np.float64),
        mode_curves=-np.sort(-m, axis=1)[:, :q],  # the eigenvalues of M by rank
        modes=vecs[:, :q],
        mode_values=last[:q],
        factors=factors,
        factor_index=idx,
    )


def _exact_lv_run(engine, M0, ts, eta, weight_decay, red: Reduction, W0) -> EngineRun:
    violation = red.violation
    return _solve_lv_run(
        _options(engine),
        red.lv,
        red.basis,
        M0,
        ts,
        eta,
        weight_decay,
        W0,
        engine="lv",
        reason=f"exact Lotka-Volterra reduction (violation {violation:.3g})",
        violation=violation,
    )


class LVEngine(AbstractEngine):
    r"""The exact Lotka-Volterra reduction: `lv_reduce` (refusing data whose
    violation of commutation exceeds `tol` with `NotReducibleError`), then
    `solve_lv` from $m_0 = \mathrm{diag}(U^\top M_0 U)$: exact when $M_0$ is
    diagonal in the basis `U`, and `O(p)` to `O(p^2)` per step.

    **Arguments:**

    - `tol`: the violation `lv_reduce` accepts (`None`: its default, 1e-6 in
      float64, 1e-3 in float32).
    - `solver`, `stepsize_controller`, `adjoint`, `max_steps`: passed to
      `solve_lv`; `None` (default) leaves its default (the Rosenbrock solver
      `LVRosenbrock`, a PID controller in the max norm on `log m`).
    """

    tol: float | None = eqx.field(default=None, static=True)
    solver: diffrax.AbstractSolver | None = None
    stepsize_controller: diffrax.AbstractStepSizeController | None = None
    adjoint: diffrax.AbstractAdjoint | None = None
    max_steps: int | None = eqx.field(default=None, static=True)

    def __check_init__(self):
        _check_tol(self)
        _check_options(self)

    def solve(
        self,
        lv: LotkaVolterra,
        m0: Float[ArrayLike, " p"],
        ts: Float[ArrayLike, " T"],
        learning_rate=1.0,
        weight_decay=0.0,
        **kwargs,
    ) -> Solution:
        """`solve_lv(lv, m0, ts, learning_rate, weight_decay, **kwargs)` with this
        engine's solver options (`kwargs`: its others, e.g. `momentum`)."""
        return solve_lv(
            lv, m0, ts, learning_rate, weight_decay, **_options(self), **kwargs
        )

    def run(
        self, task, M0, ts, learning_rate, weight_decay=0.0, *, W0=None
    ) -> EngineRun:
        """`W0`: the initial weights (`W0 @ W0.T = M0`), if known, for the
        weights at the records.

        **Raises:** `NotReducibleError` where the data do not reduce."""
        red = measure_reduction(task, self.tol)
        if not red.violation <= red.tol:
            raise NotReducibleError(red.message, red.violation, red.tol)
        return _exact_lv_run(self, M0, ts, learning_rate, weight_decay, red, W0)


class ApproximateLVEngine(AbstractEngine):
    r"""The Lotka-Volterra system in the eigenbasis of `C` whatever the violation
    of commutation (`lv_reduce(..., tol=inf)`), exact only when the violation is
    0. Its solve is 5-11x cheaper than the dense M-space flow at n = 256
    (p = 16 to 256; 2x at p = 512) and 17-56x at n = 4096 (`benchmarks/README.md`,
    `predict_cost.py`), but the reduction's whole basis search comes first
    (seconds, once per task). Where the data reduce
    within `tol` it is `LVEngine`'s exact reduction (and says so); otherwise the
    violation is reported, and its departure from the flow is measured by
    `agreement(predict(..., engine=MFlowEngine()), approximate)`.

    **Arguments:** as `LVEngine`.
    """

    tol: float | None = eqx.field(default=None, static=True)
    solver: diffrax.AbstractSolver | None = None
    stepsize_controller: diffrax.AbstractStepSizeController | None = None
    adjoint: diffrax.AbstractAdjoint | None = None
    max_steps: int | None = eqx.field(default=None, static=True)

    def __check_init__(self):
        _check_tol(self)
        _check_options(self)

    def run(
        self, task, M0, ts, learning_rate, weight_decay=0.0, *, W0=None
    ) -> EngineRun:
        # the whole search whatever the tolerance: the system of a refused task
        red = measure_reduction(task, self.tol, early=False)
        if red.violation <= red.tol:
            return _exact_lv_run(self, M0, ts, learning_rate, weight_decay, red, W0)
        return _solve_lv_run(
            _options(self),
            red.lv,
            red.basis,
            M0,
            ts,
            learning_rate,
            weight_decay,
            W0,
            engine="approximate_lv",
            reason="approximate Lotka-Volterra system in the eigenbasis of C "
            f"(violation of commutation {red.violation:.3g})",
            violation=red.violation,
        )


class AutoEngine(AbstractEngine):
    """The automatic choice (`predict`'s default): `lv` where `lv_reduce` accepts
    the data, else the M-space flow (real data: the input covariance and the
    input-output correlation do not share an eigenbasis), saying why with the
    measured violation. The flow is the `factored` engine when the initial
    factor (`predict`'s weights, or the numerical rank of `M0`) has fewer
    columns than `p` (it then costs `O(n k p r)` per step against `O(p^3)`, and
    keeps rank `M <= r`), else the `mflow` engine.

    **Arguments:**

    - `lv`: the `LVEngine` tried first (its `tol` decides; default `LVEngine()`).
    - `mflow`: the `MFlowEngine` for a full-rank start (default
      `MFlowEngine(solver=diffrax.Tsit5())`).
    - `factored`: the `FactoredMFlowEngine` for a start of rank below `p`
      (default `FactoredMFlowEngine()`).
    """

    lv: LVEngine = LVEngine()
    mflow: MFlowEngine = MFlowEngine(solver=diffrax.Tsit5())
    factored: FactoredMFlowEngine = FactoredMFlowEngine()

    def __check_init__(self):
        for name, kind in (
            ("lv", LVEngine),
            ("mflow", MFlowEngine),
            ("factored", FactoredMFlowEngine),
        ):
            if not isinstance(getattr(self, name), kind):
                raise ValueError(
                    f"`{name}` of AutoEngine must be an nqfjax.{kind.__name__}, got "
                    f"{getattr(self, name)!r}."
                )

    def run(
        self, task, M0, ts, learning_rate, weight_decay=0.0, *, W0=None
    ) -> EngineRun:
        """`W0`: the initial weights (`W0 @ W0.T = M0`), if known."""
        try:
            return self.lv.run(task, M0, ts, learning_rate, weight_decay, W0=W0)
        except NotReducibleError as e:
            refused = (
                "lv_reduce refused the data (violation of commutation "
                f"{e.violation:.3g} > tol {e.tol:.3g})"
            )
            violation = e.violation
        W0 = factor_of(M0) if W0 is None else W0
        r, p = np.shape(W0)[1], task.p
        if r < p:
            run = self.factored.run(task, M0, ts, learning_rate, weight_decay, W0=W0)
            reason = (
                f"M-space flow for the (p, r) = ({p}, {r}) factor of M0 "
                f"(rank {r} < p): {refused}"
            )
        else:
            run = self.mflow.run(task, M0, ts, learning_rate, weight_decay, W0=W0)
            reason = f"M-space flow: {refused}"
        return dataclasses.replace(run, reason=reason, violation=violation)


#: The words of `nqfjax predict --engine` (and of `predict`'s deprecated strings).
ENGINE_WORDS = ("auto", "lv", "mflow", "approximate_lv")


def engine_from_word(
    word: str,
    *,
    tol: float | None = None,
    solver: diffrax.AbstractSolver | None = None,
    max_steps: int | None = None,
) -> AbstractEngine:
    """The engine a word of the command line names (`nqfjax predict --engine`):
    `"auto"` (`AutoEngine()`), `"lv"` (`LVEngine()`), `"mflow"`
    (`MFlowEngine(solver=diffrax.Tsit5())`, as the automatic choice's) or
    `"approximate_lv"` (`ApproximateLVEngine()`). `tol` goes to the
    Lotka-Volterra engines, `solver` (default `diffrax.Tsit5()`) to the M-space
    flow, `max_steps` to every solve (the meaning of `predict`'s deprecated
    keywords).

    **Raises:** `ValueError` for another word.
    """
    if word not in ENGINE_WORDS:
        raise ValueError(
            f"`engine` must be an nqfjax.AbstractEngine or one of {ENGINE_WORDS}, "
            f"got {word!r}."
        )
    lv = LVEngine(tol=tol, max_steps=max_steps)
    mflow = MFlowEngine(
        solver=diffrax.Tsit5() if solver is None else solver, max_steps=max_steps
    )
    if word == "auto":
        factored = FactoredMFlowEngine(solver=solver, max_steps=max_steps)
        return AutoEngine(lv=lv, mflow=mflow, factored=factored)
    if word == "approximate_lv":
        return ApproximateLVEngine(tol=tol, max_steps=max_steps)
    return lv if word == "lv" else mflow
