"""Imports run in one direction: no cycle among safe_zero's imports, module-level or inside a function.

``import safe_zero`` must not depend on the order of the lines in ``__init__.py``. Importing
``a.b.c`` first runs ``a/__init__`` and ``a/b/__init__`` (unless the importer is inside them, where
they are already running), so those count as edges too. An import inside a function must not hide a
cycle either: moved to the top of its module, it must still import (only optional dependencies, which
are not safe_zero modules and so not in the graph, stay inside functions).
"""

import ast
import pathlib
from typing import Callable

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "safe_zero"
REPOSITORY = PACKAGE.parent
#: What is not the library: the tests and the code beside them (the rank rig, the bench, scripts, examples).
BESIDE = ("tests", "rig", "benchmarks", "scripts", "examples")
def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules(*roots: pathlib.Path) -> dict[str, pathlib.Path]:
    return {_module_name(p): p for root in roots or (PACKAGE,) for p in root.rglob("*.py")}


def _type_checking_only(node: ast.AST) -> bool:
    """``if TYPE_CHECKING:``: imports for annotations only, which never run (a type may name a module above)."""
    return isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"


def _top_level_imports(tree: ast.Module) -> list[ast.stmt]:
    """Imports that run when the module is imported: not inside a function or class body."""
    found, todo = [], [node for node in tree.body if not _type_checking_only(node)]
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        elif not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            todo.extend(child for child in ast.iter_child_nodes(node) if isinstance(child, ast.stmt))
    return found


def _all_imports(tree: ast.Module) -> list[ast.stmt]:
    """Every import of the module that runs, also those inside functions (they run later, but would cycle if moved
    up)."""
    skipped = {id(n) for top in tree.body if _type_checking_only(top) for n in ast.walk(top)}
    return [node for node in ast.walk(tree)
            if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in skipped]


def _edges(name: str, path: pathlib.Path, modules: dict[str, pathlib.Path],
           imports: Callable[[ast.Module], list[ast.stmt]] = _top_level_imports) -> set[str]:
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets = set()
    for node in imports(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        else:
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets.add(base)
            targets.update(f"{base}.{alias.name}" for alias in node.names)
    edges = set()
    for target in targets:
        parts = target.split(".")
        for i in range(1, len(parts) + 1):
            prefix = ".".join(parts[:i])
            # A package the importer lives in is already running its __init__: no edge to it.
            if prefix in modules and not (name == prefix or name.startswith(prefix + ".")):
                edges.add(prefix)
    return edges


def _graph(imports: Callable[[ast.Module], list[ast.stmt]] = _top_level_imports) -> dict[str, set[str]]:
    modules = _modules()
    return {name: _edges(name, path, modules, imports) for name, path in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_graph_sees_package_inits_and_cycles():
    """The checker itself: a fix importing the session that imports the fixes package is a cycle."""
    graph = {"safe_zero.session": {"safe_zero.fixes"}, "safe_zero.fixes": {"safe_zero.fixes.a"},
             "safe_zero.fixes.a": {"safe_zero.session"}}
    assert _cycle(graph) == ["safe_zero.fixes", "safe_zero.fixes.a", "safe_zero.session", "safe_zero.fixes"]
    modules = _modules()
    assert "safe_zero.fixes" in _edges("safe_zero.wrappers", modules["safe_zero.wrappers"], modules)


def test_module_level_imports_have_no_cycle():
    cycle = _cycle(_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_imports_inside_functions_hide_no_cycle():
    graph = _graph(_all_imports)
    cycle = _cycle(graph)
    assert cycle is None, "import cycle once every import is at the top of its module: " + " -> ".join(cycle)


def test_function_level_imports_are_seen():
    """The checker itself: an import inside a function is in the full graph, not in the module-level one."""
    tree = ast.parse("import a\n\ndef f():\n    from b import c\n")
    assert [node.module for node in _all_imports(tree) if isinstance(node, ast.ImportFrom)] == ["b"]
    assert not any(isinstance(node, ast.ImportFrom) for node in _top_level_imports(tree))


def test_no_module_imports_another_modules_private_names():
    """``_LOCK``, ``_STOCK_INITIALIZE`` and the like stay inside their module; what others need is public."""
    offenders = []
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("safe_zero"):
                offenders += [f"{name}: {alias.name} from {node.module}" for alias in node.names
                              if alias.name.startswith("_") and not alias.name.startswith("__")]
    assert not offenders, offenders


def _test_modules_imported(modules: dict[str, pathlib.Path]) -> dict[str, set[str]]:
    """By importer, the test modules (``test_*``) among ``modules`` it imports, inside functions too."""
    found = {name: {target for target in _edges(name, path, modules, _all_imports)
                    if target.rpartition(".")[2].startswith("test_")} for name, path in modules.items()}
    return {name: targets for name, targets in found.items() if targets}


def _tests_imported_beside(modules: dict[str, pathlib.Path]) -> dict[str, set[str]]:
    """By importer outside ``tests``, what of ``tests`` it imports."""
    found = {name: {target for target in _edges(name, path, modules, _all_imports) if target.split(".")[0] == "tests"}
             for name, path in modules.items() if name.split(".")[0] != "tests"}
    return {name: targets for name, targets in found.items() if targets}


def test_no_module_imports_a_test_module():
    """What several test modules share lives in support modules (``tests/support/``, or an area's own non-test
    modules such as ``tests/lightning/cases.py``): a test module changes its private helpers without breaking
    another, and a reader finds what is shared in one place."""
    found = _test_modules_imported(_modules(*(REPOSITORY / root for root in BESIDE)))
    found = {name: targets for name, targets in found.items() if targets}
    assert not found, f"test modules imported by other modules: {found}; move what they share to tests/support/"


def test_nothing_beside_the_tests_imports_them():
    """The bench, the rig, scripts and examples run without the test package: what they share with the tests
    lives outside it (the rig is a top-level package for that)."""
    found = _tests_imported_beside(_modules(*(REPOSITORY / root for root in BESIDE)))
    assert not found, found


def test_the_checkers_see_a_test_module_imported_and_tests_imported_beside_them(tmp_path):
    """The checkers themselves: an absolute import, a relative one inside a function, and a support module imported
    by the bench, each seen; a test module importing a support module is fine."""
    sources = {"tests/__init__.py": "", "tests/fixes/__init__.py": "", "tests/support/__init__.py": "",
               "tests/lightning/__init__.py": "", "tests/support/models.py": "",
               "tests/fixes/test_a.py": "from tests.fixes.test_b import helper\n",
               "tests/fixes/test_b.py": "from tests.support import models\n",
               "tests/lightning/cases.py": "def f():\n    from ..fixes import test_b\n",
               "benchmarks/run.py": "import tests.support.models\n"}
    modules = {}
    for relative, text in sources.items():
        path = tmp_path / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        parts = pathlib.Path(relative).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    assert _test_modules_imported(modules) == {"tests.fixes.test_a": {"tests.fixes.test_b"},
                                               "tests.lightning.cases": {"tests.fixes.test_b"}}
    assert _tests_imported_beside(modules) == {"benchmarks.run": {"tests", "tests.support", "tests.support.models"}}
