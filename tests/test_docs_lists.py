"""The lists in the documentation cannot go stale: every notebook is listed in
`notebooks/README.md`, the tutorials page and the site's nav, and every public
name is in the README's API table (fast: files are read, nothing is run)."""

import re
import types
from pathlib import Path

import pytest

import nqfjax
import nqfjax.experiments


ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted(p.name for p in (ROOT / "notebooks").glob("*.ipynb"))
#: where the notebooks are listed, and how a listed notebook is spelled there
LISTS = {
    "notebooks/README.md": "`{}`",
    "docs/tutorials/index.md": "({})",
    "mkdocs.yml": "tutorials/{}",
}


def test_there_are_notebooks():
    assert len(NOTEBOOKS) >= 12


@pytest.mark.parametrize("where", sorted(LISTS))
def test_every_notebook_is_listed(where):
    text = (ROOT / where).read_text(encoding="utf-8")
    missing = [nb for nb in NOTEBOOKS if LISTS[where].format(nb) not in text]
    assert not missing, f"{where} does not list {missing}"
    listed = set(re.findall(r"\b\d\d_\w+\.ipynb", text))
    assert listed <= set(NOTEBOOKS), f"{where} lists {listed - set(NOTEBOOKS)}"


def _public_names() -> list[str]:
    """What `nqfjax/__init__.py` re-exports (its submodules aside), and the
    drivers of `nqfjax.experiments`."""
    names = [
        name
        for name in dir(nqfjax)
        if not name.startswith("_")
        and not isinstance(getattr(nqfjax, name), types.ModuleType)
    ]
    return names + list(nqfjax.experiments.__all__)


def test_readme_api_table_has_every_public_name():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    start = text.index("| area | names |")
    table = text[start : text.index("\n\n", start)]
    cited = set(re.findall(r"`([\w.]+)`", table))
    names = _public_names()
    assert len(names) > 100  # the enumeration found the API
    missing = sorted(set(names) - cited)
    assert not missing, f"README.md's API table lacks {missing}"
