"""The layers of the code, checked on its import statements (at any depth of a module, so a
function-level import cannot hide a loop): the Dagster side never imports the producer, the
shared ground imports neither side, and no module imports itself through others."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("siphon_core", "siphon_dagster", "producer_service", "siphon_stack")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_modules() -> dict[str, Path]:
    return {module_name(p): p for package in PACKAGES for p in (ROOT / package).rglob("*.py")}


def imports_of(path: Path, modules: dict[str, Path]) -> set[str]:
    """Project modules that `path` imports (`from a.b import c` counts `a.b.c` when that is a module)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{alias.name}" for alias in node.names] + [node.module]
        else:
            continue
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
    return found


def graph() -> dict[str, set[str]]:
    modules = project_modules()
    edges = {name: imports_of(path, modules) for name, path in modules.items()}
    # A package's __init__ importing its own modules is no loop of design.
    return {name: {t for t in targets if t != name and not name.startswith(t + ".")} for name, targets in edges.items()}


def test_the_dagster_side_never_imports_the_producer() -> None:
    offenders = {m: sorted(t for t in targets if t.startswith("producer_service"))
                 for m, targets in graph().items() if m.startswith("siphon_dagster")}
    assert {m: t for m, t in offenders.items() if t} == {}


def test_the_shared_ground_imports_neither_side() -> None:
    offenders = {m: sorted(t for t in targets if t.startswith(("producer_service", "siphon_dagster")))
                 for m, targets in graph().items() if m.startswith("siphon_core")}
    assert {m: t for m, t in offenders.items() if t} == {}


def test_no_module_imports_itself_through_others() -> None:
    edges = graph()
    cycles: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for target in sorted(edges.get(node, ())):
            if state.get(target) == 1:
                cycles.append(path[path.index(target):] + [target])
            elif target not in state:
                visit(target)
        path.pop()
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node)
    assert cycles == []
