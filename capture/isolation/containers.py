"""One run in a container of a task's own image (podman): ``Container`` drives the engine's
CLI (create, init, start attached, stop, commit, copy out, remove), ``host_program`` brings an
agent's program in from the host, and ``remove_stale`` removes what a crashed instance left.

The image need not hold the agent's program, node or the host's Python. The agent's install is
shown read-only at its own path and the host's ``/usr`` at ``/.agenttap/host/usr``; its program
file is shown as a copy whose interpreter is the host's own loader, reading the host's
libraries (capture/isolation/hostprog.py), so it runs whatever C library the image has, and
``/proc/self/exe`` is the program itself. Every program it starts (the agent's tool calls) is
the image's own, with the image's loader and libraries.

The container has no network (``--network none``): its loopback only. The forwarder
(capture/isolation/bridge.py) runs as a host process that joined the container's network
namespace alone (``nsenter --net``), listening on its loopback at the proxy's and the API's
ports before the agent starts; the image needs nothing for it. The container's root is mapped
to an unprivileged range of host uids (``--uidmap``), with no new privileges. It runs under the
run's cgroup (``--cgroup-parent``): its memory, pids and CPU seconds are the run's limits, read
and watched as any run's (capture/isolation/cgroup.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from capture.isolation.host import _stale, instance_tag
from capture.isolation.hostprog import (
    CACHE_AT,
    LOADER_AT,
    edited_loader,
    edited_program,
    is_dynamic_elf,
    library_cache,
)
from capture.isolation.netbridge import interpreter
from capture.isolation.podman import LABEL, engine_command, engine_env, ulimits
from capture.isolation.sandbox import program_paths, shebang

logger = logging.getLogger(__name__)

# Where the host's /usr is shown in every container: its loader and libraries run the agent.
HOST_USR = Path("/.agenttap/host/usr")
# Where a run's HOME and TMPDIR are shown in its container.
CONTAINER_HOME = Path("/.agenttap/home")
CONTAINER_TMP = Path("/.agenttap/tmp")
# Where the host programs a scaffold runs beside its own (Terminus-2's tmux) are shown: last on
# the container's PATH, so the image's own program of that name comes first.
TOOLS_AT = "/.agenttap/bin"
# The container's uids and gids 0..65535 are these host ids: its root owns nothing on the host.
UID_BASE = 200000
ID_RANGE = 65536
# What an engine call may take (a create, a stop, a commit of a small change).
CALL_TIMEOUT_S = 120.0
# The host user the forwarder runs as: it owns nothing.
NOBODY = 65534
STOP_GRACE_S = 3
# The folders of a system install: served through HOST_USR, never mounted at their own path
# (they would hide the image's own).
SYSTEM = (Path("/usr"), Path("/bin"), Path("/sbin"), Path("/lib"), Path("/lib64"), Path("/etc"))
# This instance's label value: its PID namespace, pid and start time (a pid reused later is
# another owner; capture/isolation/host.py).
OWNER = instance_tag()


class EngineError(OSError):
    """An engine call failed: its words, for the run's error."""


@dataclass(frozen=True)
class Bind:
    """A host path shown in the container at ``target``."""

    source: Path
    target: str
    read_only: bool = True

    def flag(self) -> str:
        return f"{self.source}:{self.target}:{'ro' if self.read_only else 'rw'}"


@dataclass(frozen=True)
class ContainerPlan:
    """What a run in a container is: the ``image`` (or the state a run before it left,
    committed), the folder it starts in (None: the image's WORKDIR), the ``PATH`` inside (the
    image's), whether its command is a program of the host's (an agent brought in) or the
    image's own (a verifier, a ``{"command"}`` agent), more host paths shown, and whether the
    stopped container is kept for the caller (to commit its state) rather than removed."""

    image: str
    cwd: str | None = None
    path: str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    from_host: bool = False
    binds: tuple[Bind, ...] = ()
    keep: bool = False
    engine: str = "podman"
    # CPU cores it may use at once (a Harbor task's cpus); None: the host's.
    cpus: float | None = None
    # Host programs the agent's scaffold needs beside its own, shown at TOOLS_AT (``host_tools``).
    tools: tuple[str, ...] = ()

    def path_inside(self) -> str:
        """The container's PATH: the image's, then TOOLS_AT when host tools are shown."""
        return f"{self.path}:{TOOLS_AT}" if self.tools else self.path


def _in_container(path: Path) -> str:
    """Where a host path is seen in the container: under HOST_USR for the host's /usr, else at
    its own path (mounted there)."""
    if path.is_relative_to("/usr"):
        return str(HOST_USR / path.relative_to("/usr"))
    return str(path)


def host_program(command: list[str], path_env: str) -> tuple[list[str], tuple[Bind, ...]]:
    """``command`` (a program on the host) as the container runs it: through the host's loader,
    its script interpreters resolved on the host (``#!/usr/bin/env node`` included), and the
    binds that show its install read-only. FileNotFoundError if the program is not there."""
    program = command[0] if "/" in command[0] else shutil.which(command[0], path=path_env)
    if program is None or not os.path.exists(program):
        raise FileNotFoundError(f"the agent's program {command[0]!r} is not on this host")
    argv = [program, *command[1:]]
    for _ in range(3):  # a script's interpreter may be a script too (env -> node)
        line = shebang(Path(os.path.realpath(argv[0])))
        if not line:
            break
        interpreter, *args = line
        if os.path.basename(interpreter) == "env":
            names = [a for a in args if not a.startswith("-")]
            found = shutil.which(names[0], path=path_env) if names else None
            if found is None:
                raise FileNotFoundError(f"{argv[0]}'s interpreter {' '.join(line)!r} is not here")
            interpreter, args = found, names[1:]
        argv = [interpreter, *args, argv[0], *argv[1:]]
    # The program runs as itself (capture/isolation/hostprog.py): its ELF file, copied with the
    # host's loader as its interpreter, shown over its own path. It is called by the name it was
    # called by, in its real folder (a venv's python finds its venv from it). Only real paths
    # are shown: a path through a linked folder is not there, so scripts are passed by their
    # real paths (node and Python resolve a script's links themselves anyway).
    real = Path(os.path.realpath(argv[0]))
    program_at = _in_container(real)
    called = Path(os.path.realpath(Path(argv[0]).parent)) / Path(argv[0]).name
    argv0 = str(called) if not called.is_relative_to("/usr") else program_at
    rest = [_in_container(Path(os.path.realpath(a))) if a.startswith("/") and os.path.exists(a)
            else a for a in argv[1:]]  # fmt: skip
    runner = [argv0, *rest]
    edited: list[Bind] = []
    if is_dynamic_elf(real):
        edited = [
            Bind(edited_program(real), program_at),
            Bind(edited_loader(), LOADER_AT),
            Bind(library_cache(str(HOST_USR)), CACHE_AT),
        ]
    shown = [Path(os.path.realpath(p)) for p in program_paths(command, path_env)]
    shown += [Path(os.path.realpath(a)) for a in argv if a.startswith("/") and os.path.exists(a)]
    binds = [Bind(Path("/usr"), str(HOST_USR))]
    for path in dict.fromkeys(shown):
        if not any(path == s or path.is_relative_to(s) for s in SYSTEM):
            binds.append(Bind(path, str(path)))
    binds += _linked_binds(argv)
    # The edited program over its own path, inside the binds that show its install.
    return runner, (*_outermost(binds), *edited)


def host_tools(names: tuple[str, ...], path_env: str) -> tuple[Bind, ...]:
    """The host programs ``names`` (found on ``path_env``) shown at ``TOOLS_AT/NAME``, each run
    as ``host_program`` runs an agent's: a dynamic ELF file copied with the host's loader as its
    interpreter, reading the host's libraries at HOST_USR. FileNotFoundError for a name that is
    not a program file on this host."""
    binds = [Bind(Path("/usr"), str(HOST_USR))]
    for name in names:
        found = shutil.which(name, path=path_env)
        if found is None:
            raise FileNotFoundError(
                f"{name!r}, which the agent's scaffold runs in its container, is not on this "
                f"host: install it (scripts/setup.sh does), or use an image that holds it"
            )
        real = Path(os.path.realpath(found))
        if is_dynamic_elf(real):
            binds.append(Bind(edited_program(real), f"{TOOLS_AT}/{name}"))
            binds.append(Bind(edited_loader(), LOADER_AT))
            binds.append(Bind(library_cache(str(HOST_USR)), CACHE_AT))
        else:  # a static program runs as it is
            binds.append(Bind(real, f"{TOOLS_AT}/{name}"))
    return tuple(binds)


def unique_targets(binds: tuple[Bind, ...]) -> tuple[Bind, ...]:
    """``binds`` with a bind given twice kept once (the agent's program and a host tool both
    show the loader and the host's libraries): an engine refuses two mounts at one path. Two
    different binds at one path are both kept, for the engine to refuse."""
    return tuple(dict.fromkeys(binds))


def _linked_binds(argv: list[str]) -> list[Bind]:
    """For each path of ``argv`` reached through a linked folder (a checkout at another path, a
    venv linked in): the folder the link leads to, shown at the link's own path, so the path
    the program is called by exists in the container too."""
    binds = []
    for arg in argv:
        if not arg.startswith("/") or not os.path.exists(arg):
            continue
        path = Path("/")
        for part in Path(arg).parts[1:]:
            path = path / part
            if any(path == s or path.is_relative_to(s) for s in SYSTEM):
                break
            if path.is_symlink():
                binds.append(Bind(Path(os.path.realpath(path)), str(path)))
                break
    return binds


def _outermost(binds: list[Bind]) -> tuple[Bind, ...]:
    """Drop binds inside another bind of the list (it shows them already)."""
    kept: list[Bind] = []
    for bind in sorted(binds, key=lambda b: len(b.target)):
        if not any(Path(bind.target).is_relative_to(k.target) for k in kept):
            kept.append(bind)
    return tuple(kept)


async def engine_call(argv: list[str], engine: str, timeout_s: float = CALL_TIMEOUT_S) -> str:
    """Run one engine call; its stdout, or EngineError with its stderr's last lines."""
    proc = await asyncio.create_subprocess_exec(
        *engine_command(engine), *argv,
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE, env=engine_env(engine),
    )  # fmt: skip
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout_s)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
        raise EngineError(f"{engine} {argv[0]} did not answer in {timeout_s:g} s") from None
    if proc.returncode != 0:
        words = " ".join(err.decode("utf-8", "replace").strip().splitlines()[-3:])
        raise EngineError(f"{engine} {argv[0]} failed: {words or f'exit {proc.returncode}'}")
    return out.decode("utf-8", "replace")


async def image_config(image: str, engine: str = "podman") -> dict[str, Any]:
    """The image's config (WorkingDir, User, Env); EngineError if it is not here."""
    out = await engine_call(["image", "inspect", "--format", "{{json .Config}}", image], engine)
    config = json.loads(out or "{}") or {}
    return config if isinstance(config, dict) else {}


def limit_flags(cpus: float | None, fsize_bytes: int | None = None) -> list[str]:
    """The engine's own caps beside the run's cgroup (memory, pids and CPU seconds are the
    cgroup's, its container's made below it): CPU cores, where given; the largest file a
    process may write (RLIMIT_FSIZE, the disk cap per file, as in the bwrap sandbox), where
    given."""
    flags = [f"--cpus={cpus:g}"] if cpus else []
    if fsize_bytes:
        # One --ulimit drops the configuration's default ones, which keep nofile and nproc
        # below this process's own (runc may not raise them): all three are given.
        nofile, nproc = ulimits()
        flags += ["--ulimit", f"fsize={fsize_bytes}:{fsize_bytes}"]
        flags += ["--ulimit", f"nofile={nofile}:{nofile}", "--ulimit", f"nproc={nproc}:{nproc}"]
    return flags


class Container:
    """One container of a run: made by ``create`` (not started), its network joined by the
    forwarder before ``start``, stopped, committed (the verifier's starting state), removed."""

    def __init__(self, name: str, engine: str = "podman") -> None:
        self.name = name
        self.engine = engine
        self.created = False
        # The forwarder in its network namespace (a host process), ended with it.
        self.bridge: asyncio.subprocess.Process | None = None
        # Where the engine keeps what its processes write outside the binds (its writable
        # layer, overlay's upper folder), once it is made (``init``); None if not read.
        self.layer: Path | None = None

    @classmethod
    async def create(
        cls,
        name: str,
        image: str,
        command: list[str],
        env: dict[str, str],
        binds: tuple[Bind, ...],
        cwd: str | None,
        cgroup_parent: str,
        engine: str = "podman",
        cpus: float | None = None,
        fsize_bytes: int | None = None,
    ) -> Container:
        """A container of ``image`` that will run ``command`` (not started yet); its
        environment goes through a file only this user reads, never the command line."""
        container = cls(name, engine)
        for key, value in env.items():
            if "\n" in value or "\n" in key:
                raise ValueError(f"the environment variable {key!r} holds a newline")
        env_file = Path(tempfile.gettempdir()) / f"agenttap-env-{secrets.token_hex(8)}"
        fd = os.open(env_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.writelines(f"{key}={value}\n" for key, value in env.items())
        argv = [
            "create", "--name", name, "--label", f"{LABEL}={OWNER}",
            "--network", "none", "--security-opt", "no-new-privileges",
            "--uidmap", f"0:{UID_BASE}:{ID_RANGE}", "--gidmap", f"0:{UID_BASE}:{ID_RANGE}",
            "--env-file", str(env_file), "--init", *limit_flags(cpus, fsize_bytes),
            *(("--cgroup-parent", cgroup_parent) if cgroup_parent else ()),
            *(f"--volume={b.flag()}" for b in binds),
            *(("--workdir", cwd) if cwd else ()),
            "--entrypoint", "[]", image, *command,
        ]  # fmt: skip
        try:
            await engine_call(argv, engine)
            container.created = True
        finally:
            env_file.unlink(missing_ok=True)
        return container

    async def init(self) -> int:
        """Its namespaces made, its command not yet run; the host pid of its first process.
        Its writable layer's folder is read then too (``layer``)."""
        await engine_call(["init", self.name], self.engine)
        out = await engine_call(
            ["inspect", "--format", "{{.State.Pid}} {{.GraphDriver.Data.UpperDir}}", self.name],
            self.engine,
        )
        pid, _, upper = out.strip().partition(" ")
        # Another storage driver than overlay names no upper folder ("<no value>").
        self.layer = Path(upper) if upper.startswith("/") and os.path.isdir(upper) else None
        return int(pid)

    def start_argv(self) -> tuple[list[str], dict[str, str]]:
        """The attached start: its output is the command's, its exit status the command's."""
        return [*engine_command(self.engine), "start", "--attach", self.name], engine_env(
            self.engine
        )

    async def join_network(self, pid: int, forwards: list[str], folder: Path) -> None:
        """The forwarder (bridge.py, by the host's Python) in the container's network
        namespace only, as a user that owns nothing: listening on its loopback before this
        returns, so the agent's first call never races it."""
        self.bridge = await asyncio.create_subprocess_exec(
            "nsenter", f"--net=/proc/{pid}/ns/net", f"--setuid={NOBODY}", f"--setgid={NOBODY}",
            "--", interpreter(), "-I", "-S", str(folder / "bridge.py"), *forwards,
            "--", "/bin/sh", "-c", "echo ready; exec sleep infinity",
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, start_new_session=True,
        )  # fmt: skip
        assert self.bridge.stdout is not None
        try:
            line = await asyncio.wait_for(self.bridge.stdout.readline(), CALL_TIMEOUT_S)
        except TimeoutError:
            line = b""
        if line.strip() != b"ready":
            err = b""
            if self.bridge.stderr is not None:
                with contextlib.suppress(TimeoutError):
                    err = await asyncio.wait_for(self.bridge.stderr.read(2000), 1)
            await self._end_bridge()
            raise EngineError(
                f"the container's network bridge did not start: {err.decode(errors='replace')}"
            )

    async def _end_bridge(self) -> None:
        bridge, self.bridge = self.bridge, None
        if bridge is not None and bridge.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(bridge.pid, signal.SIGKILL)
            await bridge.wait()

    async def stop(self, grace_s: int = STOP_GRACE_S) -> None:
        """Every process of it ended (SIGTERM, then SIGKILL after ``grace_s``), and its
        forwarder."""
        with contextlib.suppress(EngineError):
            await engine_call(["stop", "--time", str(grace_s), self.name], self.engine)
        await self._end_bridge()

    async def running(self) -> bool:
        try:
            out = await engine_call(
                ["inspect", "--format", "{{.State.Running}}", self.name], self.engine
            )
        except EngineError:
            return False
        return out.strip() == "true"

    async def commit(self, tag: str) -> str:
        """Its files as an image (the verifier's starting state); the image's reference."""
        await engine_call(["commit", "--quiet", self.name, tag], self.engine)
        return tag

    async def copy_out(self, path: str, dest: Path) -> None:
        """``path`` in the container copied to the host's ``dest`` (a folder made for it)."""
        await engine_call(["cp", f"{self.name}:{path.rstrip('/')}/.", str(dest)], self.engine)

    async def remove(self) -> None:
        await self._end_bridge()
        if self.created:
            with contextlib.suppress(EngineError):
                await engine_call(["rm", "--force", "--time", "0", self.name], self.engine)
            self.created = False


async def remove_image(tag: str, engine: str = "podman") -> None:
    with contextlib.suppress(EngineError):
        await engine_call(["rmi", "--force", tag], engine)


def remove_stale(engine: str = "podman") -> list[str]:
    """What an earlier instance of agenttap left (its label names an owner that is gone):
    its containers and the agents' states it committed (a commit carries its container's
    labels), removed; their names. Nothing when the engine is not installed."""
    try:
        prefix = engine_command(engine)
    except ValueError:
        return []
    env = engine_env(engine)
    owner = '{{index .Labels "' + LABEL + '"}}'
    removed = []
    for listing, name, remove in (
        (["ps", "--all"], "{{.Names}}", ["rm", "--force", "--time", "0"]),
        (["images"], "{{.Repository}}:{{.Tag}}", ["rmi", "--force"]),
    ):
        listed = subprocess.run(
            [*prefix, *listing, "--filter", f"label={LABEL}", "--format", f"{name} {owner}"],
            capture_output=True, text=True, env=env, timeout=CALL_TIMEOUT_S, check=False,
        )  # fmt: skip
        stale = [
            ref
            for ref, _, tag in (line.partition(" ") for line in listed.stdout.splitlines())
            if ref and tag != OWNER and _stale(tag)
        ]
        if stale:
            subprocess.run(
                [*prefix, *remove, *stale],
                capture_output=True, env=env, timeout=CALL_TIMEOUT_S, check=False,
            )  # fmt: skip
        removed += stale
    return removed
