"""shardkit's modules import each other without a circle, counting the imports inside functions: a circle hidden by an
import inside a function is still a circle (vocabulary belongs at the bottom of the graph)."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.helpers import ROOT

PACKAGE = ROOT / "shardkit"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, modules: set[str]) -> set[str]:
    """The shardkit modules `path` imports anywhere in its body (`from a import b` counts `a.b` when that is a
    module, else `a`)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found |= {f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names}
    return {module for module in found if module in modules and module != name}


def import_graph() -> dict[str, set[str]]:
    paths = sorted(PACKAGE.rglob("*.py"))
    modules = {module_name(path) for path in paths}
    return {module_name(path): imported_modules(path, modules) for path in paths}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as a list of modules (first == last), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node], path[len(path):] = 1, [node]
        for child in sorted(graph[node]):
            if state.get(child) == 1:
                return path[path.index(child):] + [child]
            if child not in state and (cycle := visit(child)):
                return cycle
        state[node] = 2
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_circle():
    """A package's `__init__` re-exporting its modules is not counted: importing `shardkit.x.y` runs `shardkit.x`
    first whatever `y` imports, so only module-to-module edges can form a circle that matters."""
    graph = {module: {dep for dep in deps if not module.startswith(dep + ".")}
             for module, deps in import_graph().items()}
    cycle = find_cycle(graph)
    assert cycle is None, "import circle: " + " -> ".join(cycle)
