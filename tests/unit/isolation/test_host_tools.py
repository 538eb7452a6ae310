"""The host programs a scaffold runs beside its own in a container (Terminus-2's tmux;
capture/isolation/containers.py ``host_tools``): shown last on the container's PATH, each
dynamic one through the host's loader, one mount per path inside."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from capture.isolation import hostprog
from capture.isolation.containers import (
    HOST_USR,
    TOOLS_AT,
    Bind,
    ContainerPlan,
    host_tools,
    unique_targets,
)
from capture.rollouts.agents import container_tools


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGENTTAP_IMAGE_CACHE", str(tmp_path / "cache"))


def test_a_dynamic_host_tool_is_shown_as_its_loader_edited_copy() -> None:
    tmux = shutil.which("tmux")
    assert tmux is not None, "tmux is not installed: run scripts/setup.sh"
    binds = {bind.target: bind for bind in host_tools(("tmux",), "/usr/bin:/bin")}
    shown = binds[f"{TOOLS_AT}/tmux"]
    assert shown.read_only and shown.source != Path(tmux)
    with open(shown.source, "rb") as fh:
        offset, size = hostprog._interp_slot(fh) or (0, 0)
        fh.seek(offset)
        assert fh.read(size).rstrip(b"\x00") == hostprog.LOADER_AT.encode()
    # Its loader and the host's libraries are shown with it.
    assert {hostprog.LOADER_AT, hostprog.CACHE_AT, str(HOST_USR)} <= set(binds)


def test_a_missing_host_tool_names_what_to_install(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="'tmux'.*install it"):
        host_tools(("tmux",), str(tmp_path))


def test_the_images_own_program_comes_first_on_path() -> None:
    plan = ContainerPlan("img", path="/usr/bin:/bin")
    assert plan.path_inside() == "/usr/bin:/bin"
    with_tools = ContainerPlan("img", path="/usr/bin:/bin", tools=("tmux",))
    assert with_tools.path_inside() == f"/usr/bin:/bin:{TOOLS_AT}"


def test_a_bind_given_twice_is_mounted_once() -> None:
    loader = Bind(Path("/a/ld.so"), hostprog.LOADER_AT)
    work = Bind(Path("/run/work"), "/testbed", read_only=False)
    kept = unique_targets((loader, work, Bind(Path("/a/ld.so"), hostprog.LOADER_AT)))
    assert kept == (loader, work)
    # Two different binds at one path are not chosen between here: the engine refuses them.
    other = Bind(Path("/b/ld.so"), hostprog.LOADER_AT)
    assert unique_targets((loader, other)) == (loader, other)


def test_terminus_2_asks_for_tmux_and_a_command_agent_for_nothing() -> None:
    assert container_tools("terminus-2") == ("tmux",)
    assert container_tools("claude-code") == ()
    assert container_tools({"command": ["sh", "-c", "true"]}) == ()
