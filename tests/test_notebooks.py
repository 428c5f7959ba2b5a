"""The notebooks in `notebooks/` run top to bottom (issue 6).

Each notebook ends its sections with `assert`s that compare a number with the
theory (switch-on times of the real network against the Lotka-Volterra
prediction, the staircase limit, power-law exponents, gradients against finite
differences), so executing it is a test of the physics, not only of the code.
They are committed with their outputs stripped; the last test checks that.

The kernel is the Python running pytest: a `python3` kernel spec pointing at
`sys.executable` is written to a temporary directory that `JUPYTER_PATH` puts
first, so a `python3` kernel installed elsewhere on the machine (another
environment's) can never be picked up.
"""

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


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=_names(NOTEBOOKS))
def test_notebook_runs(path, kernel_env):
    nb = nbformat.read(path, as_version=4)
    # one more cell: which interpreter did the kernel run?
    nb.cells.append(nbformat.v4.new_code_cell("import sys; print(sys.executable)"))
    client = nbclient.NotebookClient(
        nb,
        kernel_name="python3",
        timeout=CELL_TIMEOUT_S,
        resources={"metadata": {"path": str(NOTEBOOKS_DIR)}},
    )
    # raises CellExecutionError (with the traceback of the failing cell, e.g. a
    # failed physics assert) if any cell fails
    client.execute()
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.execution_count is not None for c in code)
    assert code[-1].outputs[0]["text"].strip() == sys.executable


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_names(NOTEBOOKS))
def test_notebook_committed_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        assert cell.outputs == [], f"cell {i} of {path.name} has outputs"
        assert cell.execution_count is None, f"cell {i} of {path.name} was executed"
    # every notebook checks something against the theory and enables float64
    source = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    assert "jax_enable_x64" in source
    assert "assert" in source
