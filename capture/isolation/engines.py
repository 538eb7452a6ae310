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
import re
import secrets
from pathlib import Path
from typing import Any, Protocol

from capture.isolation.cgroup import RolloutCgroup
from capture.isolation.containers import (
    CONTAINER_HOME,
    CONTAINER_TMP,
    UID_BASE,
    Bind,
    Container,
    ContainerPlan,
    host_program,
    host_tools,
    unique_targets,
)
from capture.isolation.limits import MIB
from capture.isolation.netbridge import INSIDE, NetBridge, inside_url, interpreter
from capture.isolation.places import FIXED_PLACES, fixed_layout, moved_value
from capture.isolation.podman import engine_command
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


class RunSpec(Protocol):
    """What an engine reads of a run (capture/isolation/box.py ``BoxSpec``)."""

    @property
    def name(self) -> str: ...
    @property
    def command(self) -> list[str]: ...
    @property
    def folders(self) -> tuple[Path, Path, Path]: ...
    @property
    def session_id(self) -> str | None: ...
    @property
    def expose(self) -> tuple[Path, ...]: ...
    @property
    def container(self) -> ContainerPlan | None: ...


class BoxStarter(Protocol):
    """What an engine uses of the ``Box`` that runs it (capture/isolation/box.py)."""

    hide: tuple[Path, ...]
    expose: tuple[Path, ...]
    # "fixed": a bwrap run's folders at ``FIXED_PLACES``; "host": at their host paths
    # (agenttap_sandbox_paths).
    paths: str

    async def bridge(self, session_id: str) -> NetBridge: ...

    def stage(self) -> Path: ...


class Engine:
    """How a run's command is started: the base runs it as it is (the ``none`` engine)."""

    name = "none"
    # Whether its runs' cgroups must sit at one path in every hierarchy (a container engine's
    # --cgroup-parent).
    aligned_cgroup = False

    def __init__(self, box: BoxStarter) -> None:
        self.box = box

    def url(self, url: str) -> str:
        """``url`` (the proxy's, the API's) as the run reaches it."""
        return url

    def hand_over(self, *folders: Path) -> None:
        """Give the run's folders to whoever the command runs as (blocking: in a thread)."""

    async def spawn(
        self, label: str, spec: RunSpec, cgroup: RolloutCgroup, pipes: dict[str, Any]
    ) -> Child:
        """Start ``spec.command`` in ``spec.folders[0]`` (work) in ``cgroup`` under its limits;
        ``spec.session_id``: the session whose bridge it reaches the proxy through (None: no
        network where the engine can take it away)."""
        work, prefix = spec.folders[0], cgroup.launch_prefix()
        command = spec.command
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
        self, label: str, spec: RunSpec, cgroup: RolloutCgroup, pipes: dict[str, Any]
    ) -> Child:
        work, home, tmp = spec.folders
        prefix = cgroup.launch_prefix()
        command, network, extra_expose = spec.command, spec.session_id, spec.expose
        path_env = pipes["env"].get("PATH", "")
        bridge = await self.box.bridge(network) if network is not None else None
        python = interpreter()
        expose = (
            *program_paths(command, path_env),
            *(program_paths([python], path_env) if bridge is not None else ()),
            *self.box.expose,
            *extra_expose,
        )
        env, places = pipes["env"], None
        layout = fixed_layout(spec.folders, expose) if self.box.paths == "fixed" else None
        if layout is not None:
            moved, expose = layout
            places = FIXED_PLACES
            # The run's folders as the sandbox shows them, wherever the command and its
            # environment name them (HOME, TMPDIR, a configuration folder, the reward file).
            command = [moved_value(arg, moved) for arg in command]
            env = {key: moved_value(value, moved) for key, value in env.items()}
        elif self.box.paths == "fixed":
            logger.warning(
                "agenttap: a path this sandbox shows lies at or under %s: run %s sees its "
                "folders at their host paths, so its prompts name them",
                " or ".join(FIXED_PLACES), label,
            )  # fmt: skip
        inner = command
        if bridge is not None:
            inner = [python, "-I", "-S", str(INSIDE / "bridge.py"), *bridge.forwards(), "--"]
            inner += command
        sandbox = SandboxSpec(
            work, home, tmp, hide=self.box.hide, expose=expose,
            bridge=bridge.folder if bridge is not None else None, places=places,
        )  # fmt: skip
        info_r, info_w = os.pipe()
        try:
            user = sandbox_user()
            stage = self.box.stage() if user is not None else None
            argv = sandbox_argv(sandbox, inner, self.bwrap, info_fd=info_w, uid=user, stage=stage)
            proc = await asyncio.create_subprocess_exec(
                *prefix, *argv, pass_fds=(info_w,), cwd="/", **{**pipes, "env": env}
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


class PodmanEngine(Engine):
    """A container of the run's image (capture/isolation/containers.py): no network but the
    proxy's and the API's ports handed in by the forwarder, its root an unprivileged host uid,
    the run's cgroup its parent (its limits, read and watched as any run's). Its HOME and
    TMPDIR are the run's folders, shown at /.agenttap/home and /.agenttap/tmp; its working
    folder is the run's copy of the image's (capture/rollouts/images.py)."""

    name = "podman"
    aligned_cgroup = True

    def __init__(self, box: BoxStarter, engine: str = "podman") -> None:
        super().__init__(box)
        self.engine = engine
        # EngineMissing (a ValueError) when it is not installed: the request is refused.
        engine_command(engine)

    def url(self, url: str) -> str:
        return inside_url(url)

    def hand_over(self, *folders: Path) -> None:
        # The container's root is UID_BASE on the host; an image's own user may be another
        # uid of its range: the top folders are open to it too (nothing else can reach them).
        give_to(UID_BASE, *folders)
        for folder in folders:
            folder.chmod(0o777)

    async def spawn(
        self, label: str, spec: RunSpec, cgroup: RolloutCgroup, pipes: dict[str, Any]
    ) -> Child:
        plan = spec.container
        if plan is None:
            raise ValueError("the podman engine runs a container: the run names no image")
        _, home, tmp = spec.folders
        env = dict(pipes["env"])
        if plan.from_host:
            command, binds = host_program(spec.command, env.get("PATH", os.defpath))
        else:
            command, binds = list(spec.command), ()
        binds += host_tools(plan.tools, env.get("PATH", os.defpath)) if plan.tools else ()
        shown = tuple(Bind(p, str(p)) for p in (*self.box.expose, *spec.expose) if p.exists())
        # HOME and TMPDIR at fixed paths: a host path's parents, made in the image's tree for
        # the mount, would stay in the state a verifier starts from (and may not be made there).
        inside = {str(home): str(CONTAINER_HOME), str(tmp): str(CONTAINER_TMP)}
        binds = (*binds, *shown, Bind(home, inside[str(home)], False))
        binds += (Bind(tmp, inside[str(tmp)], False),)
        env = {key: moved_value(value, inside) for key, value in env.items()}
        env["PATH"] = plan.path_inside()
        container = await Container.create(
            container_name(spec.name), plan.image, command, env,
            unique_targets((*binds, *plan.binds)),
            plan.cwd, cgroup.relative, plan.engine, plan.cpus, cgroup.limits.disk_mb * MIB,
        )  # fmt: skip
        try:
            pid = await container.init()
            if spec.session_id is not None:
                bridge = await self.box.bridge(spec.session_id)
                assert bridge.folder is not None
                await container.join_network(pid, bridge.forwards(bridge.folder), bridge.folder)
            argv, engine_env = container.start_argv()
            proc = await asyncio.create_subprocess_exec(*argv, **{**pipes, "env": engine_env})
        except BaseException:
            await container.remove()
            raise
        return Child(proc, container=container)


def container_name(run: str) -> str:
    """A container's name: the run's (made safe), unique."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", run)[:48].strip("._-") or "run"
    return f"agenttap-{safe}-{secrets.token_hex(3)}"


# Every engine by the name a request or an option gives ("sandbox": "bwrap" | "none").
ENGINES: dict[str, type[Engine]] = {"bwrap": BwrapEngine, "none": Engine, "podman": PodmanEngine}
