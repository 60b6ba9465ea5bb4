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


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, pathlib.Path]:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _top_level_imports(tree: ast.Module) -> list[ast.stmt]:
    """Imports that run when the module is imported: not inside a function or class body."""
    found, todo = [], list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        elif not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            todo.extend(child for child in ast.iter_child_nodes(node) if isinstance(child, ast.stmt))
    return found


def _all_imports(tree: ast.Module) -> list[ast.stmt]:
    """Every import of the module, also those inside functions (they run later, but would cycle if moved up)."""
    return [node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))]


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
