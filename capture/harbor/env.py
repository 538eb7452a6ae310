"""A Harbor environment backed by agenttap's bubblewrap sandbox, for machines without Docker.

Harbor (PyPI ``harbor``) runs each trial's agent and verifier in an environment it loads by
import path::

    harbor run --path TASK --agent terminus-2 --model openai/gpt-4o \\
        --env capture.harbor.env:SandboxEnvironment

(with the repository on ``PYTHONPATH``; Harbor runs from its own venv, ``.venv-harbor``, built
by scripts/setup_harbor.sh). This module is imported there: it uses Harbor's classes, the
standard library and capture/isolation/sandbox.py (standard library only), nothing of the proxy.

One trial's environment is one long-lived sandbox (capture/isolation/sandbox.py ``bwrap_argv``:
the system's programs read-only, ``/etc`` without its secrets, its own user, PID and network
namespaces, no capabilities) whose first program is capture/harbor/execd.py: each
``exec`` is one command it runs with ``bash -c``, so what a command leaves running (Terminus-2's
tmux server) is there for the next one, until ``stop``. Inside it:

- the task's workdir (``[environment] workdir``, else ``/app``), ``/logs`` and ``/root`` (HOME)
  are folders of this trial on the host; the rest of the root (``/tests``, ``/solution``, ...)
  and ``/tmp`` are the sandbox's own tmpfs;
- the workdir starts with the files of the task's ``environment/`` folder (its Dockerfile and
  compose files left out: no image is built; commands run on this machine's system, read-only);
- there is no network at all: the agent's model calls are made by Harbor on the host (through
  ``HTTPS_PROXY`` to agenttap), never from inside, so a task's ``network_mode`` other than
  ``no-network`` gets a warning, not a network.

Files move in and out through a transfer folder bound into the sandbox, copied there by ``cp``
run inside it: a link the agent planted resolves in the sandbox's view, never the host's, and
a folder comes out without its links (on the host they would point at the host's files).
As root, the sandbox runs as ``SANDBOX_UID`` (nobody, who owns nothing on the host: a
root-owned 0600 file is unreadable even if shown), started by capture/isolation/launch.py as a
rollout's is; else as the calling user; either way in its own user namespace, without
capabilities. ``exec``'s ``user`` is not honoured (one user per sandbox).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import posixpath
import shlex
import shutil
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

from harbor.environments.base import BaseEnvironment, ExecResult
from harbor.environments.capabilities import EnvironmentCapabilities
from harbor.models.task.config import NetworkMode

from capture.isolation.sandbox import (
    SANDBOX_UID,
    SandboxSpec,
    bwrap_argv,
    find_bwrap,
    make_stage,
    program_paths,
    sandbox_argv,
)
from capture.isolation.workdir import give_to

EXECD = Path(__file__).with_name("execd.py")
# Where the control folder (the exec server's socket, the transfer folder) is inside.
CONTROL = "/.agenttap-harbor"
DEFAULT_WORKDIR = "/app"
# The task's environment/ files that describe an image rather than belong in the workdir.
IMAGE_FILES = {"Dockerfile", "docker-compose.yaml", "docker-compose.yml", ".dockerignore"}
# How long the sandbox may take to start its exec server.
START_TIMEOUT_S = 30.0
ENV_TYPE = "agenttap-sandbox"


class SandboxEnvironment(BaseEnvironment):  # type: ignore[misc]  # Harbor's class (its venv)
    """One trial's bubblewrap sandbox (see the module docstring)."""

    _proc: subprocess.Popen[bytes] | None = None
    _root: Path | None = None
    # The launcher's staging folder (as root; capture/isolation/sandbox.py make_stage).
    _stage: Path | None = None

    @staticmethod
    def type() -> str:
        return ENV_TYPE

    @property
    def capabilities(self) -> EnvironmentCapabilities:
        return EnvironmentCapabilities(disable_internet=True)

    def _validate_definition(self) -> None:
        """Nothing to check: no image is built from the task's environment/ folder."""

    @property
    def workdir(self) -> str:
        return posixpath.normpath(self.task_env_config.workdir or DEFAULT_WORKDIR)

    def _folder(self, name: str) -> Path:
        if self._root is None:
            raise RuntimeError("the agenttap sandbox environment is not started (call start)")
        return self._root / name

    def _python(self) -> str:
        """The Python the exec server runs on: the system's (shown in every sandbox), else
        this one (its install exposed)."""
        return shutil.which("python3", path="/usr/bin:/bin") or os.path.realpath(sys.executable)

    @staticmethod
    def sandbox_user() -> int | None:
        """Who the sandbox runs as: as root, ``SANDBOX_UID`` (who owns nothing on the host, as
        a rollout's sandbox); else this user."""
        return SANDBOX_UID if os.geteuid() == 0 else None

    def sandbox_command(self, stage: Path | None = None) -> list[str]:
        """The command that starts this trial's sandbox: bwrap itself, or as root (``stage``
        given) capture/isolation/launch.py, which stages the bound paths and becomes
        ``sandbox_user`` before it execs bwrap (as capture/isolation/sandbox.py ``sandbox_argv``,
        with this environment's own binds)."""
        fs, control = self._folder("fs"), self._folder("control")
        python = self._python()
        spec = SandboxSpec(
            work=fs / "work",
            home=fs / "root",
            tmp=fs / "tmp",
            expose=(*program_paths([python], "/usr/bin:/bin"), EXECD),
            binds=(
                (fs / "work", self.workdir),
                (fs / "logs", "/logs"),
                (fs / "root", "/root"),
                (control, CONTROL),
            ),
            chdir=self.workdir,
        )
        command = [python, "-I", "-S", str(EXECD), f"{CONTROL}/execd.sock"]
        if stage is None:
            return bwrap_argv(spec, command, find_bwrap())
        return sandbox_argv(spec, command, find_bwrap(), uid=self.sandbox_user(), stage=stage)

    async def start(self, force_build: bool) -> None:
        if self._network_policy.network_mode != NetworkMode.NO_NETWORK:
            self.logger.warning(
                "agenttap sandbox: the task asks for network_mode=%r, but this environment "
                "has no network (its commands reach nothing; the agent's model calls are "
                "made by Harbor on the host).",
                self._network_policy.network_mode.value,
            )
        asked = {
            "cpus": self._effective_cpus,
            "memory_mb": self._effective_memory_mb,
            "storage_mb": self._effective_storage_mb,
        }
        if any(value is not None for value in asked.values()):
            self.logger.warning(
                "agenttap sandbox: the task's resources (%s) are not enforced here: the "
                "sandbox shares this machine's CPUs, memory and disk.",
                ", ".join(f"{k}={v}" for k, v in asked.items() if v is not None),
            )
        self._root = Path(tempfile.mkdtemp(prefix="agenttap-harbor-"))
        for name in ("fs/work", "fs/logs/agent", "fs/logs/verifier", "fs/logs/artifacts"):
            self._folder(name).mkdir(parents=True)
        for name in ("fs/root", "fs/tmp", "control/xfer"):
            self._folder(name).mkdir(parents=True)
        self._seed_workdir()
        give_to(self.sandbox_user(), self._folder("fs"), self._folder("control"))
        if self.sandbox_user() is not None:
            self._stage = make_stage()
        socket = self._folder("control") / "execd.sock"
        self._proc = subprocess.Popen(
            self.sandbox_command(self._stage),
            # Nothing of Harbor's environment (its API keys, the proxy) reaches the sandbox.
            env={"AGENTTAP_HARBOR_WORKDIR": self.workdir},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=self._folder("sandbox.log").open("wb"),
        )
        loop = asyncio.get_running_loop()
        ready = await loop.run_in_executor(None, self._proc.stdout.readline)  # type: ignore[union-attr]
        if ready.strip() != b"ready" or not socket.exists():
            err = await loop.run_in_executor(None, self._stop_process)
            raise RuntimeError(
                "agenttap sandbox: the sandbox did not start (bwrap and the exec server): "
                f"{err.strip() or ready.decode(errors='replace')}"
            )
        self.logger.debug("agenttap sandbox started in %s", self._root)

    def _seed_workdir(self) -> None:
        source = Path(self.environment_dir)
        if not source.is_dir():
            return
        for entry in source.iterdir():
            if entry.name in IMAGE_FILES:
                continue
            target = self._folder("fs/work") / entry.name
            if entry.is_dir() and not entry.is_symlink():
                shutil.copytree(entry, target, symlinks=True)
            else:
                shutil.copy2(entry, target, follow_symlinks=False)

    def _stop_process(self) -> str:
        """Ends the sandbox (every process in it goes with bwrap); its stderr."""
        proc, self._proc = self._proc, None
        if proc is None:
            return ""
        if proc.poll() is None:
            proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
        log = self._folder("sandbox.log")
        return log.read_text(errors="replace")[-4000:] if log.exists() else ""

    async def stop(self, delete: bool) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self._stop_process)
        if self._stage is not None:
            shutil.rmtree(self._stage, ignore_errors=True)
            self._stage = None
        if delete and self._root is not None:
            shutil.rmtree(self._root, ignore_errors=True)
            self._root = None

    async def exec(
        self,
        command: str,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        timeout_sec: int | None = None,
        user: str | int | None = None,
    ) -> ExecResult:
        if self._proc is None or self._proc.poll() is not None:
            raise RuntimeError("agenttap sandbox: the sandbox is not running (start it first)")
        request = {
            "command": command,
            "cwd": cwd or self.workdir,
            "env": self._merge_env(env) or {},
            "timeout": timeout_sec,
        }
        reader, writer = await asyncio.open_unix_connection(
            str(self._folder("control") / "execd.sock")
        )
        try:
            writer.write(json.dumps(request).encode() + b"\n")
            await writer.drain()
            data = await reader.read()
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()
        if not data:
            raise RuntimeError(f"agenttap sandbox: no answer for the command {command!r:.200}")
        answer: dict[str, Any] = json.loads(data)
        if answer.get("timed_out"):
            raise RuntimeError(f"Command timed out after {timeout_sec} seconds")
        return ExecResult(
            stdout=answer.get("stdout"),
            stderr=answer.get("stderr"),
            return_code=int(answer["return_code"]),
        )

    async def _inside(self, command: str) -> None:
        result = await self.exec(command, cwd="/")
        if result.return_code != 0:
            raise RuntimeError(
                f"agenttap sandbox: {command!r} failed ({result.return_code}): "
                f"{(result.stderr or result.stdout or '').strip()}"
            )

    def _transfer(self) -> tuple[Path, str]:
        """A fresh name in the transfer folder: its host path and its path inside."""
        name = uuid.uuid4().hex
        return self._folder("control/xfer") / name, f"{CONTROL}/xfer/{name}"

    async def upload_file(self, source_path: Path | str, target_path: str) -> None:
        host, inside = self._transfer()
        shutil.copyfile(source_path, host)
        target = shlex.quote(target_path)
        try:
            await self._inside(
                f'mkdir -p -- "$(dirname -- {target})" && cp -f -- {inside} {target}'
            )
        finally:
            host.unlink(missing_ok=True)

    async def upload_dir(self, source_dir: Path | str, target_dir: str) -> None:
        host, inside = self._transfer()
        shutil.copytree(source_dir, host, symlinks=True)
        target = shlex.quote(target_dir)
        try:
            await self._inside(f"mkdir -p -- {target} && cp -R -- {inside}/. {target}/")
        finally:
            shutil.rmtree(host, ignore_errors=True)

    def _taken_out(self, host: Path) -> Path:
        """``host`` as the sandbox left it, if it is inside the transfer folder (a link the
        agent put in its place is refused)."""
        xfer = os.path.realpath(self._folder("control/xfer"))
        if host.is_symlink() or not os.path.realpath(host).startswith(xfer + os.sep):
            raise RuntimeError(f"agenttap sandbox: {host} was replaced by a link; not copied")
        return host

    async def download_file(self, source_path: str, target_path: Path | str) -> None:
        host, inside = self._transfer()
        try:
            await self._inside(f"cp -L -- {shlex.quote(source_path)} {inside}")
            Path(target_path).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(self._taken_out(host), target_path, follow_symlinks=False)
        finally:
            host.unlink(missing_ok=True)

    async def download_dir(self, source_dir: str, target_dir: Path | str) -> None:
        host, inside = self._transfer()
        try:
            source = shlex.quote(source_dir)
            await self._inside(f"mkdir -- {inside} && cp -R -- {source}/. {inside}/")
            shutil.copytree(self._taken_out(host), target_dir, ignore=_links, dirs_exist_ok=True)
        finally:
            shutil.rmtree(host, ignore_errors=True)


def _links(folder: str, names: list[str]) -> list[str]:
    """The links in a folder the sandbox handed out: left behind, since on the host they
    would point at the host's files (a planted ``/logs/agent/x -> /root/...``)."""
    return [name for name in names if os.path.islink(os.path.join(folder, name))]
