"""The documentation's Python blocks, run as a reader would run them: each
page's blocks in order, in one fresh process, in an empty folder holding a
`CURVE.csv` (the loss curve a page's reader brings). A block right after a
`<!-- not run: why -->` comment is left out (a multi-process runtime, a GPU
node); every other block runs, so a snippet that crashes fails here."""

import os
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest


DOCS = pathlib.Path(__file__).resolve().parents[1] / "docs"
_BLOCK = re.compile(r"(<!-- not run:[^>]*-->\s*\n)?```python\n(.*?)```", re.S)


def _blocks(page: pathlib.Path) -> list[str]:
    return [code for skip, code in _BLOCK.findall(page.read_text()) if not skip]


PAGES = sorted(str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md") if _blocks(p))


def test_pages_with_code_are_found_and_parse():
    # the pages that teach code (today 11), and every block is valid Python
    assert len(PAGES) >= 10, PAGES
    for page in PAGES:
        for code in _blocks(DOCS / page):
            compile(code, page, "exec")


def _curve_csv(path: pathlib.Path) -> None:
    """A staircase of logistic drops in `t` with a floor, as a user's CSV."""
    ts = np.unique(np.round(np.geomspace(1, 1e4, 300)))
    drops = [(0.5, 0.02, 150.0), (0.3, 0.01, 800.0), (0.15, 0.004, 3000.0)]
    loss = 0.02 + sum(a / (1 + np.exp(r * (ts - t0))) for a, r, t0 in drops)
    rows = "\n".join(f"{t:g},{v:.8g}" for t, v in zip(ts, loss))
    path.write_text("# a loss curve\nt,loss\n" + rows + "\n")


@pytest.mark.slow  # every page's code, 1-20 s a page
@pytest.mark.parametrize("page", PAGES)
def test_page_code_runs(page, tmp_path):
    _curve_csv(tmp_path / "CURVE.csv")
    code = "\n\n".join(_blocks(DOCS / page))
    env = {**os.environ, "MPLBACKEND": "Agg", "JAX_PLATFORMS": "cpu"}
    run = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, f"{page}:\n{run.stderr[-3000:]}"


def test_supported_versions_are_the_declared_floors():
    """The table of 'Limits and scope' gives each JAX-stack floor that
    pyproject.toml declares (and CI installs), so it cannot go stale."""
    import tomllib

    project = tomllib.loads((DOCS.parent / "pyproject.toml").read_text())["project"]
    floors = dict(
        re.fullmatch(r"([A-Za-z_]+)>=([0-9.]+).*", dep).groups()
        for dep in project["dependencies"]
        if ">=" in dep
    )
    page = (DOCS / "limits.md").read_text()
    rows = {
        name.strip(): version.strip()
        for names, version in re.findall(r"^\| ([a-z, ]+) \| ([0-9.]+) \|$", page, re.M)
        for name in names.split(",")
    }
    assert rows, "no version table"
    for name, version in rows.items():
        assert floors[name] == version, (name, floors[name], version)
    assert project["requires-python"] == ">=3.11" and "Python 3.11" in page
