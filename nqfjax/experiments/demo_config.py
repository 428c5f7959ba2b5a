"""The configuration of the headline experiment (`nqfjax demo`): `DemoConfig`,
its sizes, solvers and tolerances (`run_demo` is in `demo.py`)."""

import dataclasses
import warnings

import diffrax


@dataclasses.dataclass(frozen=True)
class DemoConfig:
    """The demo's built-in defaults (all of them end up in `report.json`).

    The network is a two-layer tanh perceptron on exactly whitened inputs (an
    orthogonal design, `(1/n) X^T X = I`), with a linear teacher of singular values
    `singular_values`: each singular value is one logistic mode. The learning
    rate keeps `r_k = 2 learning_rate s_k <= 0.01` per step, so gradient descent
    follows the flow to ~0.3% in time. Small singular values keep the learned
    weights small, so that tanh's cubic term stays negligible: it couples the
    modes, and once the first modes are learned it seeds the later ones at an
    amplitude independent of the init scale. With these values that seeding
    overtakes the init below `sigma ~ 1e-9`, so the init-scale sweep stays above
    it (measured: the slowest mode's slope 19% low over 1e-4..1e-10, and with 8x
    larger singular values 7% low over 1e-3..1e-7).

    The solves are chosen by diffrax solvers. `mflow_solver` integrates the
    M-space flow (default `diffrax.Kvaerno5()`, `solve_mflow`'s; `None` leaves
    the flow out). `lv_solver` integrates the Lotka-Volterra systems: `None`
    (the default) is `solve_lv`'s Rosenbrock solver, run by `solve_lv_batch`
    (the same steps and numbers, in one loop whose compiled program JAX's
    persistent cache can keep across runs); a diffrax solver (e.g.
    `diffrax.Tsit5()`) runs `solve_lv` with it. `closed_form_power_law` takes
    the power-law curve from the exact logistic solution of its independent
    modes instead of integrating them (no solver at all). `DemoConfig.quick()`
    sets it, and leaves the M-space flow out (`mflow_solver=None`): its diffrax
    program holds runtime checks (host callbacks), which JAX's persistent cache
    does not keep, so it compiles again in every process (~3 s, a fifth of a
    quick run); `diffrax.Tsit5()` (enough for this small, mildly stiff problem
    and much quicker to compile) is the solver to draw it with there.

    The booleans `mflow`, `explicit_mflow` and `explicit_lv` are deprecated
    (one release): `mflow=False` is `mflow_solver=None`, `explicit_mflow=True`
    is `mflow_solver=diffrax.Tsit5()`, `explicit_lv=True` is
    `lv_solver=diffrax.Tsit5()`.
    """

    d: int = 6
    k: int = 3
    n: int = 32
    singular_values: tuple[float, ...] = (0.005, 0.0025, 0.00125)
    learning_rate: float = 1.0
    width: int = 128
    init_scale: float = 1e-4
    steps: int = 8000
    num_records: int = 400
    sweep_scales: tuple[float, ...] = (1e-4, 1e-5, 1e-6, 1e-7, 1e-8)
    sweep_steps: int = 14000
    power_law_modes: int = 2000
    alpha: float = 1.0
    beta: float = 0.5
    power_law_eps: float = 1e-16
    seed: int = 0
    mflow_solver: diffrax.AbstractSolver | None = dataclasses.field(
        default_factory=diffrax.Kvaerno5
    )
    lv_solver: diffrax.AbstractSolver | None = None
    closed_form_power_law: bool = False
    # tolerances of the agreement checks (those of the library's tests)
    tol_switch_on: float = 0.02
    tol_plateau: float = 0.01
    tol_slope: float = 0.03
    tol_gamma_sharp: float = 0.01
    tol_gamma_rich: float = 0.05
    # deprecated (one release): the solver booleans, mapped on construction
    mflow: bool | None = None
    explicit_mflow: bool | None = None
    explicit_lv: bool | None = None

    def __post_init__(self):
        old = {"mflow": self.mflow, "explicit_mflow": self.explicit_mflow}
        old["explicit_lv"] = self.explicit_lv
        given = [name for name, value in old.items() if value is not None]
        if not given:
            return
        warnings.warn(
            f"DemoConfig's {', '.join(given)} are deprecated: give the solvers, "
            "`mflow_solver` (None: no M-space flow; explicit_mflow: "
            "diffrax.Tsit5()) and `lv_solver` (explicit_lv: diffrax.Tsit5()).",
            DeprecationWarning,
            stacklevel=3,
        )
        mflow_solver, lv_solver = self.mflow_solver, self.lv_solver
        if self.mflow and mflow_solver is None:
            mflow_solver = diffrax.Kvaerno5()
        if self.explicit_mflow:
            mflow_solver = diffrax.Tsit5()
        if self.mflow is False:
            mflow_solver = None
        if self.explicit_lv:
            lv_solver = diffrax.Tsit5()
        for name, value in (("mflow_solver", mflow_solver), ("lv_solver", lv_solver)):
            object.__setattr__(self, name, value)
        for name in old:  # mapped: `dataclasses.replace` does not warn again
            object.__setattr__(self, name, None)

    def as_dict(self) -> dict:
        """The configuration as JSON-able values (`report.json`'s `config`): a
        solver as its class name."""
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in ("mflow", "explicit_mflow", "explicit_lv"):
                continue  # deprecated, mapped to the solvers
            if isinstance(value, diffrax.AbstractSolver):
                value = type(value).__name__
            out[f.name] = list(value) if isinstance(value, tuple) else value
        return out

    @classmethod
    def quick(cls) -> "DemoConfig":
        """A smaller problem for tests and a first look: two modes instead of
        three (so half the steps), a quarter of the records, three init scales, a
        half the power-law modes (at eps = 1e-8, where 1000 modes still give
        a fit window of 1.4 decades, as 2000 do at eps = 1e-16; `fit_power_law`
        calls less than a decade a single drop); no M-space flow (the staircase
        figure shows the real network and the Lotka-Volterra reduction) and the
        closed-form power law. The same checks at the same tolerances (the checked
        numbers agree with those of the default solvers to the digits printed).
        Most of its time is tracing and compiling: `nqfjax demo` caches the
        programs JAX can cache (README)."""
        return cls(
            d=4,
            k=2,
            n=16,
            singular_values=(0.005, 0.0025),
            width=32,
            steps=4000,
            num_records=100,
            sweep_scales=(1e-4, 1e-6, 1e-8),
            sweep_steps=8000,
            power_law_modes=1000,
            power_law_eps=1e-8,
            mflow_solver=None,
            closed_form_power_law=True,
        )
