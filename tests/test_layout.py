"""How the package is laid out: what `import nqfjax` loads."""

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[1]


def _run(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT), *filter(None, [env.get("PYTHONPATH")])]
    )
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True
    )


def test_import_nqfjax_does_not_import_matplotlib():
    # nor do the drivers or the command until a figure is drawn
    code = (
        "import sys, nqfjax, nqfjax.experiments, nqfjax.plots, nqfjax.cli\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] == 'matplotlib')\n"
        "assert not loaded, loaded[:5]\n"
    )
    result = _run(code)
    assert result.returncode == 0, result.stderr


def test_drivers_live_in_experiments_and_old_names_warn():
    import nqfjax
    import nqfjax.experiments

    for name in nqfjax.experiments.__all__:
        new = getattr(nqfjax.experiments, name)
        with pytest.warns(DeprecationWarning, match=f"nqfjax.experiments.{name}"):
            old = getattr(nqfjax, name)
        assert old is new
    # the building blocks stay where they were, without a warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert nqfjax.predict is nqfjax.experiments.predict.predict
    with pytest.raises(AttributeError, match="no_such_name"):
        getattr(nqfjax, "no_such_name")
