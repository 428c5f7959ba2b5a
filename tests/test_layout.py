"""How the package is laid out: what `import nqfjax` loads, where the drivers
live, and the import layering (read from the source, nothing imported)."""

import ast
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


# --------------------------------------------------------------------------------
# The import layering, read from the source with `ast` (nothing is imported).

PACKAGE = ROOT / "nqfjax"

#: The layers, low to high; a module may import its own layer and those below
#: (cycles are refused separately). The order is the one `docs/architecture.md`
#: draws, adjusted to what the code does:
#:
#: - the helpers every layer may use are at the bottom: `_checks`, `_linalg`,
#:   `_curves`, `_interrupts` (SIGINT held to safe points), `io` (the one
#:   writer) and `data` (the bundled data sets) import nothing of nqfjax;
#:   `_checkpoint` builds on `io`; `progress` (the meters) only on tqdm;
#: - structures < tasks (a task is built from a structure's `A(x)`) < engines
#:   (which solve a task) < theory (closed forms of a task's flow) < analysis
#:   (fits to loss curves, which use the LV engine and the theory's exponents);
#: - `sweep` (compiled grids) and `plots` (figures from plain arrays) need only
#:   the helpers, and are below `experiments`, whose drivers run sweeps and draw
#:   figures -- not above it, as an earlier draft of the layering had them;
#: - the package's `__init__` re-exports everything, and the command line
#:   (`cli`) is the only module that imports the package as a whole.
LAYERS = [
    {"_checks", "_linalg", "_curves", "_interrupts", "io", "data"},
    {"_checkpoint", "progress"},
    {"structures"},
    {"tasks"},
    {"engines"},
    {"theory"},
    {"analysis"},
    {"sweep", "plots"},
    {"experiments"},
    {""},  # nqfjax/__init__.py
    {"cli"},
]

#: Imports inside nqfjax of a private name (`_x`) of another nqfjax module. They
#: were 83; shared helpers now have public names in private modules (`_linalg`,
#: `_checks`, `analysis/_least_squares`, `plots/_common`, `structures/_blocks`,
#: `theory/_psd_solvers`, `theory/_sharp_switch`, `engines/_lv_common`). What is
#: left: the fused LV loop's `_combine` of `engines/_rosenbrock` and
#: `tasks/lotka_volterra`'s checks from `tasks/interactions`. This is a ratchet:
#: lower it when you remove one, never raise it.
MAX_PRIVATE_IMPORTS = 3


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")
    )


def _imports(path: Path) -> list[tuple[str, list[str]]]:
    """`(module, names)` for every import of an nqfjax module in `path`, at any
    depth (in functions too) except under `if TYPE_CHECKING:`. For `from x import
    a, b` the module is `x`, or `x.a` and `x.b` where those are modules."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []

    def visit(node):
        for child in ast.iter_child_nodes(node):
            if _is_type_checking(child):
                continue
            if isinstance(child, ast.Import):
                found.extend((a.name, []) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package.split(".")[: package.count(".") + 2 - child.level]
                    module = ".".join(base + [child.module] * bool(child.module))
                else:
                    module = child.module or ""
                names = [a.name for a in child.names]
                for a in names:
                    if _is_module(f"{module}.{a}"):
                        found.append((f"{module}.{a}", []))
                        names = [n for n in names if n != a]
                if names or child.module:
                    found.append((module, names))
            visit(child)

    visit(ast.parse(path.read_text(encoding="utf-8")))
    return [(m, names) for m, names in found if m.split(".")[0] == "nqfjax"]


def _is_module(dotted: str) -> bool:
    path = ROOT.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _graph() -> dict[str, list[tuple[str, list[str]]]]:
    return {_module_name(p): _imports(p) for p in sorted(PACKAGE.rglob("*.py"))}


def _layer(module: str) -> int:
    top = module.split(".")[1] if "." in module else ""
    for i, layer in enumerate(LAYERS):
        if top in layer:
            return i
    raise AssertionError(f"{module} is in no layer: add it to LAYERS")


def test_modules_import_only_their_layer_and_below():
    upward = [
        f"{module} (layer {_layer(module)}) imports {target} (layer {_layer(target)})"
        for module, imports in _graph().items()
        for target, _ in imports
        if _layer(target) > _layer(module)
    ]
    assert not upward, "\n".join(upward)


def test_no_import_cycles():
    graph = {m: {t for t, _ in imports if t != m} for m, imports in _graph().items()}
    # a module that imports a submodule of a package runs the package's
    # `__init__` first: that edge is Python's, not the module's, so it is left
    # out, and a package's `__init__` importing its own submodules is allowed
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for t in sorted(graph.get(m, ())):
            if state.get(t) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack + [t]))
            if t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_private_cross_module_imports_are_few():
    private = [
        f"{module} imports {name} from {target}"
        for module, imports in _graph().items()
        for target, names in imports
        if target != module
        for name in names
        if name.startswith("_") and not name.startswith("__")
    ]
    assert len(private) <= MAX_PRIVATE_IMPORTS, "\n".join(private)


#: Sizes a reader can hold in mind: no module above `MAX_MODULE_LINES` lines, no
#: function above `MAX_FUNCTION_LINES` lines of code (its docstring, which for a
#: public entry point states the equation, the defaults and what it raises, is
#: not counted).
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 100


def _code_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    lines = node.end_lineno - node.lineno + 1
    first = node.body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
        if isinstance(first.value.value, str):
            lines -= first.end_lineno - first.lineno + 1
    return lines


def test_modules_and_functions_are_short():
    long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        name = path.relative_to(ROOT)
        if text.count("\n") > MAX_MODULE_LINES:
            long.append(f"{name}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = _code_lines(node)
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{name}:{node.lineno} {node.name}: {lines}")
    assert not long, "\n".join(long)
