"""mkdocs hooks for the nqfjax documentation (configured in `mkdocs.yml`).

1. The tutorials are the notebooks in `notebooks/` at the repository root. They
   are added to the site as `tutorials/<name>.ipynb` straight from there (no
   copies, no symlinks), before mkdocs-jupyter looks for notebooks, so a fresh
   clone builds with nothing to prepare.
2. Every name that `nqfjax/__init__.py` re-exports must have exactly one
   `::: nqfjax.NAME` block in `docs/api/*.md`, and every name that
   `nqfjax/experiments/__init__.py` re-exports one `::: nqfjax.experiments.NAME`
   block; anything else is a warning, which fails `mkdocs build --strict`.
3. `PublicNamesFirst`, a Griffe extension (configured under mkdocstrings'
   `extensions`), makes `nqfjax.NAME` the re-exported object even where a
   submodule has the same name (`nqfjax.train`, `nqfjax.sweep`,
   `nqfjax.experiments.predict_file`): Griffe gives the submodule precedence,
   Python the re-export.
"""

import ast
import logging
import re
from pathlib import Path

import griffe
from mkdocs.plugins import CombinedEvent, event_priority
from mkdocs.structure.files import File


log = logging.getLogger("mkdocs.hooks.nqfjax")

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
PACKAGE_INIT = ROOT / "nqfjax" / "__init__.py"
# the public namespaces: the package, and the command line's drivers
NAMESPACES = {
    "nqfjax": PACKAGE_INIT,
    "nqfjax.experiments": ROOT / "nqfjax" / "experiments" / "__init__.py",
}
API_DIR = Path(__file__).resolve().parent / "api"
_BLOCK = re.compile(r"^:::\s+(nqfjax\.(?:experiments\.)?\w+)\s*$", re.MULTILINE)


def _notebooks() -> list[Path]:
    return sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))


@event_priority(100)  # before mkdocs-jupyter's on_files (priority 0) wraps them
def _add_notebooks(files, config):
    for path in _notebooks():
        uri = f"tutorials/{path.name}"
        if files.get_file_from_path(uri) is None:
            files.append(File.generated(config, uri, abs_src_path=str(path)))
    return files


@event_priority(-100)  # after mkdocs-jupyter's on_files
def _keep_notebook_sources(files, config):
    # mkdocs-jupyter's wrapper recomputes `abs_src_path` from `src_dir`, which a
    # generated file does not have: point it at the notebook again.
    sources = {f"tutorials/{path.name}": str(path) for path in _notebooks()}
    for file in files:
        if file.src_uri in sources and file.abs_src_path is None:
            file.abs_src_path = sources[file.src_uri]
    return files


on_files = CombinedEvent(_add_notebooks, _keep_notebook_sources)


def _public_names() -> list[str]:
    """The names each public namespace re-exports (`from .x import y as y`), in
    full (`nqfjax.NAME`, `nqfjax.experiments.NAME`)."""
    names = []
    for namespace, init in NAMESPACES.items():
        tree = ast.parse(init.read_text(encoding="utf-8"))
        for node in tree.body:
            if isinstance(node, ast.ImportFrom) and node.level > 0:
                names += [
                    f"{namespace}.{a.asname}" for a in node.names if a.asname == a.name
                ]
    return names


def on_pre_build(config):
    counts: dict[str, list[str]] = {}
    for page in sorted(API_DIR.glob("*.md")):
        for name in _BLOCK.findall(page.read_text(encoding="utf-8")):
            counts.setdefault(name, []).append(page.name)
    public = _public_names()
    for name in public:
        where = counts.get(name, [])
        if len(where) != 1:
            log.warning(
                "%s has %d API blocks (%s); it needs exactly one in docs/api/.",
                name,
                len(where),
                ", ".join(where) or "none",
            )
    for name in sorted(set(counts) - set(public)):
        log.warning("docs/api documents %s, which is not public.", name)


def on_serve(server, config, builder):
    server.watch(str(NOTEBOOKS))
    server.watch(str(PACKAGE_INIT.parent))
    return server


def _aliases(obj):
    for member in list(obj.members.values()):
        if isinstance(member, griffe.Alias):
            yield member
        elif isinstance(member, griffe.Module | griffe.Class):
            yield from _aliases(member)


class PublicNamesFirst(griffe.Extension):
    """Point `nqfjax.NAME` at what `nqfjax/__init__.py` re-exports as NAME when a
    submodule of the same name has taken its place in Griffe's tree."""

    def on_package(self, *, pkg, loader, **kwargs):
        if pkg.name != "nqfjax":
            return
        namespaces = [pkg] + [
            pkg.members[path.removeprefix("nqfjax.")]
            for path in NAMESPACES
            if path != "nqfjax"
        ]
        shadowed = {
            (namespace, name): path
            for namespace in namespaces
            for name, path in namespace.imports.items()
            if isinstance(namespace.members.get(name), griffe.Module)
            and path != f"{namespace.path}.{name}"
        }
        if not shadowed:
            return
        # resolve every alias while the submodules can still be reached by path
        for alias in _aliases(pkg):
            try:
                alias.resolve_target()
            except (griffe.AliasResolutionError, griffe.CyclicAliasError):
                pass  # external or unresolvable: left to mkdocstrings, as before
        for (namespace, name), path in shadowed.items():
            target = loader.modules_collection[path]
            namespace.set_member(name, griffe.Alias(name, target, parent=namespace))
