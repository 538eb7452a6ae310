"""The production modules' imports, checked by machine (scripts/house.py reads them from the
source): no circle (imports under ``TYPE_CHECKING`` and inside functions count too); every
module keeps its package's contract (``MAY_IMPORT`` in the package's ``__init__.py``); and the
gateway, the ports and the turn reach none of the control plane, rollouts or the viewer through
any chain (they meet through ``capture.ports``)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _load_house():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("house", REPO / "scripts" / "house.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["house"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


house = _load_house()

# module -> modules it must never reach, directly or through others.
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


@pytest.fixture(scope="module")
def known():  # type: ignore[no-untyped-def]
    return house.modules(REPO)


@pytest.fixture(scope="module")
def graph(known):  # type: ignore[no-untyped-def]
    return house.import_graph(known)


def test_no_import_circles(graph: dict[str, set[str]]) -> None:
    assert house.cycles(graph) == []


def test_the_finder_sees_circles_and_type_checking_imports(graph: dict[str, set[str]]) -> None:
    """The check itself: a two-way dependency, one side under TYPE_CHECKING, is a circle."""
    assert house.cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    assert "capture.ports" in graph["capture.control.api"]


def test_dependencies_run_the_declared_way(graph: dict[str, set[str]]) -> None:
    for module, never in FORBIDDEN.items():
        bad = sorted(house.reachable(graph, module) & set(never))
        assert not bad, f"{module} depends on {bad}"


def test_every_module_is_under_a_contract(known) -> None:  # type: ignore[no-untyped-def]
    """Each top-level package and each folder of capture/ declares its own ``MAY_IMPORT``."""
    contracts, governed_by = house.contracts_of(known)
    folders = [
        n
        for n, m in known.items()
        if m.is_package and n.count(".") <= (1 if n.startswith("capture") else 0)
    ]
    assert sorted(set(folders) - set(contracts)) == []
    assert sorted(set(known) - set(governed_by)) == []


def test_every_import_keeps_its_contract(known, graph) -> None:  # type: ignore[no-untyped-def]
    contracts, governed_by = house.contracts_of(known)
    assert [str(b) for b in house.breaches(graph, contracts, governed_by)] == []


def test_a_forbidden_import_breaks_its_contract(known, graph) -> None:  # type: ignore[no-untyped-def]
    """The check itself, on the real contracts: storage reaching up into the control API's
    routes, or rewriter into capture, is named; the same import the contract allows is not."""
    contracts, governed_by = house.contracts_of(known)
    bent = {name: set(deps) for name, deps in graph.items()}
    bent["capture.storage.sessions"].add("capture.control.api")
    bent["rewriter.template"].add("capture.storage.reader")
    found = [(b.module, b.imports, b.package) for b in house.breaches(bent, contracts, governed_by)]
    assert found == [
        ("capture.storage.sessions", "capture.control.api", "capture.storage"),
        ("rewriter.template", "capture.storage.reader", "rewriter"),
    ]
    assert "capture.storage.sessions" in str(house.breaches(bent, contracts, governed_by)[0])


def test_the_architecture_maps_are_generated_from_the_code_now() -> None:
    assert house.rendered(REPO) == (REPO / "docs" / "ARCHITECTURE.md").read_text(), (
        "docs/ARCHITECTURE.md's maps are stale: run .venv/bin/python scripts/house.py --write"
    )


def test_what_trainers_and_vllm_import_parses_as_python_3_11(known, graph) -> None:  # type: ignore[no-untyped-def]
    """``.venv-train`` and ``.venv-vllm`` run Python 3.11: the trainer's side
    (``capture.client``, ``capture.train``), the vLLM side (``policy_server``) and every
    module they reach must parse there (a 3.12-only ``def f[T]`` once reached the client
    through the OpenAPI module and broke every trainer example)."""
    import ast

    roots = [n for n in known if n.startswith(("capture.client", "capture.train", "policy_server"))]
    reached = set(roots).union(*(house.reachable(graph, n) for n in roots))
    bad = []
    for name in sorted(reached):
        try:
            ast.parse(known[name].path.read_text(), feature_version=(3, 11))
        except SyntaxError as exc:
            bad.append(f"{name}: {exc}")
    assert bad == []
    assert "capture.storage.reader" in reached  # the check reaches past the roots
