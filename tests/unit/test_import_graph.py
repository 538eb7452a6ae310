"""The production modules' imports run one way: no circle (imports under ``TYPE_CHECKING`` and
inside functions count too), and the declared directions hold: the gateway knows nothing of
the control plane, rollouts or the viewer (they meet it through ``capture.ports``), the
rewriter nothing of capture or the addon, capture nothing of the addon."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("addons", "capture", "rewriter")

# module -> modules it must never import (directly or through others).
FORBIDDEN: dict[str, tuple[str, ...]] = {
    "capture.gateway": (
        "capture.control.api",
        "capture.rollouts.runner",
        "capture.rollouts.routes",
        "capture.viewer.http",
        "capture.viewer.data",
        "capture.client.launcher",
        "capture.client.ray_pool",
    ),
    "capture.ports": ("capture.gateway", "capture.control.api"),
    "capture.pipeline.turn": ("capture.gateway", "capture.control.api"),
}


def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            parts = path.relative_to(REPO).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


def import_graph() -> dict[str, set[str]]:
    """module -> the production modules it imports, wherever the import statement stands."""
    known = modules()

    def owner(name: str) -> str | None:
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, path in known.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*parts, *([base] if base else [])])
                # `from capture import viewer` imports the module capture.viewer.data.
                targets = [f"{base}.{a.name}" for a in node.names]
            for target in targets:
                found = owner(target)
                if found is not None and found != name:
                    deps.add(found)
        graph[name] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for dep in sorted(graph.get(node, ())):
            if dep not in index:
                visit(dep)
                low[node] = min(low[node], low[dep])
            elif dep in on_stack:
                low[node] = min(low[node], index[dep])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen: set[str] = set()
    todo = [start]
    while todo:
        for dep in graph.get(todo.pop(), ()):
            if dep not in seen:
                seen.add(dep)
                todo.append(dep)
    return seen


def test_no_import_circles() -> None:
    assert cycles(import_graph()) == []


def test_the_finder_sees_circles_and_type_checking_imports() -> None:
    """The check itself: a two-way dependency, one side under TYPE_CHECKING, is a circle."""
    graph = {"a": {"b"}, "b": {"a"}, "c": {"a"}}
    assert cycles(graph) == [["a", "b"]]
    assert "capture.ports" in import_graph()["capture.control.api"]


def test_dependencies_run_the_declared_way() -> None:
    graph = import_graph()
    for module, never in FORBIDDEN.items():
        bad = sorted(reachable(graph, module) & set(never))
        assert not bad, f"{module} depends on {bad}"
    for name, deps in graph.items():
        if name.startswith("rewriter"):
            assert not {d for d in deps if d.startswith(("capture", "addons"))}, name
        if name.startswith("capture"):
            assert not {d for d in deps if d.startswith("addons")}, name
