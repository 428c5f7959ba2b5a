"""The declared dependency floors, tested: CI installs the lowest versions that
pyproject.toml allows for the JAX stack and runs a smoke selection of the tests.

    python .ci/floors.py constraints   # pip constraints: each package == its floor
    python .ci/floors.py tests         # the smoke selection, one pytest id a line
    python .ci/floors.py check         # the installed versions; fails off the floors

The floors are read from `[project] dependencies` in pyproject.toml (the `>=`
bound of each package below), so what CI tests cannot drift from what is
declared. Every other dependency resolves as usual.
"""

import re
import sys
import tomllib
from importlib import metadata
from pathlib import Path


ROOT = Path(__file__).resolve().parent.parent

# The packages whose lowest declared version CI installs.
FLOORED = (
    "jax",
    "jaxlib",
    "equinox",
    "diffrax",
    "optax",
    "optimistix",
    "lineax",
    "chex",
    "jaxtyping",
    "numpy",
)

# The smoke selection (pytest ids), a few minutes on two cores: each engine and
# the API around it once, with the parts that lean on the newer APIs of the
# stack (`jax.shard_map`, `jax.enable_x64`, `jax.monitoring`, equinox's runtime
# errors, diffrax's adjoints, the custom_vjp of solve_lv_batch, optax's
# transformations, optimistix's and lineax's fits, chex's variants). Run with
# `-m ""`: the sharded sweep named here belongs to the slow tier.
TESTS = (
    # structures: closed forms under jit, vmap and grad; the abstract classes
    "tests/test_structures.py::test_jit_vmap_grad[Perceptron]",
    "tests/test_structures.py::test_jit_vmap_grad[QKAttention-softmax]",
    "tests/test_structures.py::test_jit_vmap_grad[Conv1D-pool]",
    "tests/test_structures.py::test_abstract_and_final",
    # tasks: closed-form hooks against the generic task, the power-law task
    "tests/test_tasks.py::test_closed_form_hooks_match_the_generic_task[Perceptron]",
    "tests/test_tasks.py::test_power_law_task",
    # train (W-space): plain GD against numpy, optax's schedules and momentum,
    # gradients through training, divergence caught by eqx.error_if
    "tests/test_train.py::test_gd_quadratic_form_matches_numpy[perceptron]",
    "tests/test_train.py::test_schedule_and_momentum_match_numpy",
    "tests/test_train.py::test_grad_through_training",
    "tests/test_train.py::test_divergence_is_flagged_with_its_step",
    # solve_mflow against the LV reduction, and in float32
    "tests/test_mflow.py::test_mflow_matches_lv_aligned[0.0-1e-06]",
    "tests/test_mflow.py::test_mflow_float32",
    # solve_lv against scipy, its adjoint against finite differences, vmap
    "tests/test_lv.py::test_solve_lv_matches_scipy_lsoda",
    "tests/test_lv.py::test_solve_lv_grad_matches_finite_differences",
    "tests/test_lv.py::test_solve_lv_vmap_and_failure",
    # solve_lv_batch against solve_lv and scipy, its discrete adjoint
    "tests/test_lv_batch.py::test_shared_system_matches_solve_lv_and_scipy",
    "tests/test_lv_batch.py::test_gradient_equals_solve_lv_at_the_last_time[structured]",
    # sweep: checkpoints, the compile cache, and sharded sweeps of train and
    # solve_lv over two forced host devices (float32), in a subprocess
    "tests/test_sweep.py::test_bad_grids_and_mesh",
    "tests/test_sweep.py::test_checkpoint_from_other_sweep",
    "tests/test_sweep.py::test_damaged_chunk_is_named_and_recomputed[flip]",
    "tests/test_sweep.py::test_second_call_compiles_nothing",
    "tests/test_sweep.py::test_sharded_sweep_of_the_engines_on_2_host_devices[float32]",
    # the command line: help, usage errors, the demo's engines
    "tests/test_cli.py::test_help_is_complete",
    "tests/test_cli.py::test_usage_errors_exit_2",
    "tests/test_cli.py::test_demo_mflow_agrees_with_lotka_volterra",
    # the analysis fits: power laws and spectra (optimistix, lineax)
    "tests/test_fit.py::test_fit_power_law_lv_curve",
    "tests/test_fit.py::test_fit_power_law_errors",
    "tests/test_fit.py::test_fit_spectrum_exact_model_curve",
    # float32 end to end (jax.enable_x64(False)); chex's jit and eager variants
    "tests/test_float32.py::test_solve_lv_logistic_from_1e_30",
    "tests/test_transforms.py::TestJitAndEager::test_lotka_volterra_loss__with_jit",
    "tests/test_transforms.py::TestJitAndEager::test_lotka_volterra_loss__without_jit",
    "tests/test_transforms.py::TestJitAndEager::test_nqf_apply_rejects_nan_weights__with_jit",
)

_REQ = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[[^\]]*\])?\s*([^;]*)")


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def floors(pyproject: Path = ROOT / "pyproject.toml") -> dict[str, str]:
    """The `>=` bound declared for each package of `FLOORED`."""
    with open(pyproject, "rb") as f:
        deps = tomllib.load(f)["project"]["dependencies"]
    found: dict[str, str] = {}
    for dep in deps:
        m = _REQ.match(dep)
        if m is None or _norm(m.group(1)) not in FLOORED:
            continue
        specs = [s.strip() for s in m.group(2).split(",")]
        lows = [s[2:].strip() for s in specs if s.startswith(">=")]
        if len(lows) != 1:
            raise SystemExit(f"{dep!r}: expected one `>=` bound in pyproject.toml")
        found[_norm(m.group(1))] = lows[0]
    missing = [p for p in FLOORED if p not in found]
    if missing:
        raise SystemExit(f"no dependency declared for {missing} in pyproject.toml")
    return {p: found[p] for p in FLOORED}


def _same(installed: str, floor: str) -> bool:
    """`installed` is the release `floor` names (`0.1` names `0.1.0`)."""

    def parts(v: str) -> list[str]:
        p = v.split(".")
        while len(p) > 1 and p[-1] == "0":
            p.pop()
        return p

    return parts(installed) == parts(floor)


def main(argv: list[str]) -> int:
    cmd = argv[0] if argv else "constraints"
    if cmd == "constraints":
        for name, low in floors().items():
            print(f"{name}=={low}")
    elif cmd == "tests":
        print("\n".join(TESTS))
    elif cmd == "check":
        bad = []
        for name, low in floors().items():
            have = metadata.version(name)
            ok = _same(have, low)
            note = "" if ok else "  <- not the floor"
            print(f"{name:<11} {have:<10} floor {low}{note}")
            bad += [] if ok else [name]
        if bad:
            print(f"installed off their floors: {', '.join(bad)}", file=sys.stderr)
            return 1
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
