"""How the package is laid out: what `import nqfjax` loads."""

import os
import subprocess
import sys
from pathlib import Path


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
