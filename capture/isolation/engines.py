"""The engines a sandboxed run can start in, registered by name (``ENGINES``): ``bwrap`` (a
bubblewrap sandbox from an allowlist, capture/isolation/sandbox.py) and ``none`` (the command
itself, with every right of this user). A second kind of sandbox (a container engine) is one
more ``Engine`` subclass and one more entry here.

An engine starts a command (after the limits' ``prefix``) with the pipes the caller asks for,
and says what its sandbox changes for the caller: whether the run's files must be handed to
the sandbox's user (``hand_over``), and how the proxy's and the API's URLs read from inside
(``url``). ``BoxStarter`` is what an engine may ask of the ``Box`` that holds it: a network
bridge for the run, the staging folder, the paths always hidden and always shown.
"""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path
from typing import Any, Protocol

from capture.isolation.netbridge import INSIDE, NetBridge, inside_url, interpreter
from capture.isolation.processes import Child
from capture.isolation.sandbox import (
    SANDBOX_UID,
    Jail,
    SandboxSpec,
    find_bwrap,
    program_paths,
    read_info,
    sandbox_argv,
)
from capture.isolation.workdir import give_to

logger = logging.getLogger(__name__)


def sandbox_user() -> int | None:
    """The uid (and gid) sandboxes run under: ``SANDBOX_UID`` when agenttap runs as root (a
    user that owns nothing on the host), else None (this user's own, the kernel allowing no
    other)."""
    return SANDBOX_UID if os.geteuid() == 0 else None


class BoxStarter(Protocol):
    """What an engine uses of the ``Box`` that runs it (capture/isolation/box.py)."""

    hide: tuple[Path, ...]
    expose: tuple[Path, ...]

    async def bridge(self, session_id: str) -> NetBridge: ...

    def stage(self) -> Path: ...


class Engine:
    """How a run's command is started: the base runs it as it is (the ``none`` engine)."""

    name = "none"

    def __init__(self, box: BoxStarter) -> None:
        self.box = box

    def url(self, url: str) -> str:
        """``url`` (the proxy's, the API's) as the run reaches it."""
        return url

    def hand_over(self, *folders: Path) -> None:
        """Give the run's folders to whoever the command runs as (blocking: in a thread)."""

    async def spawn(
        self,
        label: str,
        command: list[str],
        folders: tuple[Path, Path, Path],
        network: str | None,
        prefix: list[str],
        extra_expose: tuple[Path, ...],
        pipes: dict[str, Any],
    ) -> Child:
        """Start ``command`` in ``folders[0]`` (work), after ``prefix``; ``network``: the
        session whose bridge it reaches the proxy through (None: no network where the engine
        can take it away)."""
        work = folders[0]
        return Child(await asyncio.create_subprocess_exec(*prefix, *command, cwd=work, **pipes))


class BwrapEngine(Engine):
    """A bubblewrap sandbox: only ``work``, ``home`` and ``tmp`` writable; with a network, the
    proxy's and the API's ports handed in by the forwarder, else no network at all. As root,
    it runs as ``SANDBOX_UID`` (started by capture/isolation/launch.py)."""

    name = "bwrap"

    def __init__(self, box: BoxStarter) -> None:
        super().__init__(box)
        # SandboxUnavailable (a ValueError) when bwrap is not installed: the request is refused.
        self.bwrap = find_bwrap()

    def url(self, url: str) -> str:
        return inside_url(url)

    def hand_over(self, *folders: Path) -> None:
        give_to(sandbox_user(), *folders)

    async def spawn(
        self,
        label: str,
        command: list[str],
        folders: tuple[Path, Path, Path],
        network: str | None,
        prefix: list[str],
        extra_expose: tuple[Path, ...],
        pipes: dict[str, Any],
    ) -> Child:
        work, home, tmp = folders
        path_env = pipes["env"].get("PATH", "")
        bridge = await self.box.bridge(network) if network is not None else None
        inner, python = command, interpreter()
        if bridge is not None:
            inner = [python, "-I", "-S", str(INSIDE / "bridge.py"), *bridge.forwards(), "--"]
            inner += command
        spec = SandboxSpec(
            work, home, tmp, hide=self.box.hide,
            expose=(
                *program_paths(command, path_env),
                *(program_paths([python], path_env) if bridge is not None else ()),
                *self.box.expose,
                *extra_expose,
            ),
            bridge=bridge.folder if bridge is not None else None,
        )  # fmt: skip
        info_r, info_w = os.pipe()
        try:
            user = sandbox_user()
            stage = self.box.stage() if user is not None else None
            argv = sandbox_argv(spec, inner, self.bwrap, info_fd=info_w, uid=user, stage=stage)
            proc = await asyncio.create_subprocess_exec(
                *prefix, *argv, pass_fds=(info_w,), cwd="/", **pipes
            )
        except BaseException:
            os.close(info_r)
            raise
        finally:
            os.close(info_w)
        child = Child(proc)
        try:
            child.jail = Jail.from_info(await read_info(info_r))
        except TimeoutError:  # never set up: it is killed as a process group
            logger.error("agenttap: %s: bwrap did not report its sandbox", label)
        return child


# Every engine by the name a request or an option gives ("sandbox": "bwrap" | "none").
ENGINES: dict[str, type[Engine]] = {"bwrap": BwrapEngine, "none": Engine}
