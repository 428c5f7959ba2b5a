"""The notebooks in `notebooks/` run top to bottom (issue 6).

Each notebook ends its sections with `assert`s that compare a number with the
theory (switch-on times of the real network against the Lotka-Volterra
prediction, the staircase limit, power-law exponents, gradients against finite
differences), so executing it is a test of the physics, not only of the code.
They are committed executed, with their outputs, so that a reader of the
repository or of the documentation site (which shows them as committed, see
`mkdocs.yml`) sees the figures; a test checks that every code cell has outputs
and none is an error. The suite still executes each notebook afresh, so the
committed outputs cannot rot unnoticed.

The kernel is the Python running pytest: a `python3` kernel spec pointing at
`sys.executable` is written to a temporary directory that `JUPYTER_PATH` puts
first, so a `python3` kernel installed elsewhere on the machine (another
environment's) can never be picked up.
"""

import ast
import json
import sys
from pathlib import Path

import pytest


nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOKS_DIR = Path(__file__).resolve().parent.parent / "notebooks"
NOTEBOOKS = sorted(NOTEBOOKS_DIR.glob("*.ipynb"))
# Each notebook runs in well under a minute on two CPU cores; the timeout only
# catches a hung kernel.
CELL_TIMEOUT_S = 600


def _names(paths):
    return [p.name for p in paths]


@pytest.fixture(scope="module")
def kernel_env(tmp_path_factory):
    """Environment for the kernels: this interpreter as `python3`, CPU only,
    non-interactive matplotlib."""
    spec_dir = tmp_path_factory.mktemp("jupyter") / "kernels" / "python3"
    spec_dir.mkdir(parents=True)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python 3 (nqfjax tests)",
        "language": "python",
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    with pytest.MonkeyPatch.context() as mp:
        # JUPYTER_PATH comes before the user's and the environment's data dirs
        mp.setenv("JUPYTER_PATH", str(spec_dir.parent.parent))
        mp.setenv("MPLBACKEND", "Agg")
        mp.setenv("JAX_PLATFORMS", "cpu")
        # silence debugpy's frozen-modules warning (Python >= 3.11)
        mp.setenv("PYDEVD_DISABLE_FILE_VALIDATION", "1")
        yield


def test_the_theory_notebooks_are_there():
    # the four of issue 6; the parametrised tests below run every notebook found
    assert {
        "01_sudden_learning.ipynb",
        "02_singular_limit.ipynb",
        "03_power_laws.ipynb",
        "04_gradients_and_fitting.ipynb",
    } <= set(_names(NOTEBOOKS))


def _code(nb) -> list[ast.Module]:
    """The parsed code cells of a notebook (IPython magics, none today, would make
    `ast.parse` fail loudly rather than be skipped)."""
    return [
        ast.parse(c.source, filename=f"cell {i}")
        for i, c in enumerate(nb.cells)
        if c.cell_type == "code"
    ]


def _checks(tree: ast.Module) -> int:
    """The number of real checks in a cell: `assert` statements and calls of an
    `assert_*` function (`np.testing.assert_allclose`, `chex.assert_*`). Comments
    and strings that mention "assert" do not count."""
    n = 0
    for node in ast.walk(tree):
        if isinstance(node, ast.Assert):
            n += 1
        elif isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
            n += name.startswith("assert_")
    return n


def _enables_x64(tree: ast.Module) -> bool:
    """Whether a cell calls `jax.config.update("jax_enable_x64", True)`."""
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "update"
            and len(node.args) == 2
            and all(isinstance(a, ast.Constant) for a in node.args)
            and [a.value for a in node.args] == ["jax_enable_x64", True]
        ):
            return True
    return False


# The probe cell appended to every executed notebook: which interpreter ran the
# kernel, and whether the notebook's float64 switch took effect (its physics
# asserts are written at float64 tolerances).
PROBE = (
    "import json, sys, jax\n"
    "print(json.dumps([sys.executable, jax.config.jax_enable_x64]))"
)


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=_names(NOTEBOOKS))
def test_notebook_runs(path, kernel_env):
    nb = nbformat.read(path, as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell(PROBE))
    client = nbclient.NotebookClient(
        nb,
        kernel_name="python3",
        timeout=CELL_TIMEOUT_S,
        resources={"metadata": {"path": str(NOTEBOOKS_DIR)}},
    )
    # The test: `execute` raises CellExecutionError (with the traceback of the
    # failing cell, e.g. a failed physics assert) if any cell fails.
    client.execute()
    stdout = [o for o in nb.cells[-1].outputs if o.get("name") == "stdout"]
    assert json.loads("".join(o["text"] for o in stdout)) == [sys.executable, True]


# A committed notebook's outputs stay small: no progress-bar spam, figures as
# PNGs at the inline backend's resolution (the largest today is ~0.3 MB).
MAX_NOTEBOOK_BYTES = 1_000_000


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_names(NOTEBOOKS))
def test_notebook_committed_with_outputs(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    code = [(i, c) for i, c in enumerate(nb.cells) if c.cell_type == "code"]
    counts = [c.execution_count for _, c in code]
    # executed top to bottom in one kernel: 1, 2, 3, ...
    assert counts == list(range(1, len(code) + 1)), f"{path.name}: {counts}"
    # a cell that only defines or imports prints nothing: outputs are asked of
    # the notebook (its figures), an execution count of every cell
    for i, cell in code:
        errors = [o for o in cell.outputs if o.output_type == "error"]
        assert not errors, f"cell {i} of {path.name} failed: {errors[0].ename}"
        stderr = "".join(
            o.get("text", "") for o in cell.outputs if o.get("name") == "stderr"
        )
        assert "Traceback" not in stderr, f"cell {i} of {path.name}"
        # a notebook is read as the way to use the library: no deprecated call
        assert "DeprecationWarning" not in stderr, f"cell {i} of {path.name}"
    figures = sum("image/png" in o.get("data", {}) for _, c in code for o in c.outputs)
    assert figures >= 1, f"{path.name} shows no figure"
    assert path.stat().st_size < MAX_NOTEBOOK_BYTES, path.name


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_names(NOTEBOOKS))
def test_notebook_checks_the_theory_in_float64(path):
    # Executing a notebook tests the physics only if its code holds real checks,
    # and their tolerances are float64 ones: both read from the parsed code.
    code = _code(nbformat.read(path, as_version=4))
    assert sum(map(_checks, code)) >= 1, f"{path.name} checks nothing"
    switches = [i for i, tree in enumerate(code) if _enables_x64(tree)]
    assert switches, f"{path.name} does not enable float64"
    first = switches[0]
    # before any check runs (a later switch would leave earlier arrays float32)
    assert all(_checks(tree) == 0 for tree in code[:first]), path.name


def test_the_static_checks_see_through_comments():
    # the parsers above, on code that only *mentions* what they look for
    fake = ast.parse(
        '# assert x\ns = "assert"\n# jax.config.update("jax_enable_x64", True)'
    )
    assert _checks(fake) == 0 and not _enables_x64(fake)
    real = ast.parse(
        'jax.config.update("jax_enable_x64", True)\n'
        "assert x\n"
        "np.testing.assert_allclose(a, b)"
    )
    assert _checks(real) == 2 and _enables_x64(real)
