"""A rollout's ``"agent": "terminus-2"``: Harbor's Terminus-2 on the rollout's prompt, working in
the rollout's workdir (capture/rollouts/agents.py runs it with ``.venv-harbor``'s Python).

    python rollout.py PROMPT

A rollout already runs its agent in a bubblewrap sandbox of its own (capture/isolation/sandbox.py)
that may not start another one inside it (``--disable-userns``), so Terminus-2 gets
``WorkdirEnvironment`` here instead of capture/harbor/env.py's sandbox: its commands run
as this process's children, in the current directory (the rollout's copy of the workdir), inside
the rollout's sandbox. Never use it outside one: it is no boundary of its own.

The script writes a Harbor task folder into ``$HOME`` (the prompt as its ``instruction.md``; no
tests: agenttap's verifier scores the workdir) and runs ``harbor run`` in this process on it,
with this module's class as the environment (``__main__:WorkdirEnvironment``) and verification
off. The model calls go out through the session's ``HTTPS_PROXY`` like every agent's. It exits
0 when the trial ran (its ``result.json`` has no exception), else 1. This file is shown to the
sandbox alone (it imports only Harbor and the standard library).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import sys
from pathlib import Path

from harbor.environments.base import BaseEnvironment, ExecResult
from harbor.environments.capabilities import EnvironmentCapabilities

TASK_TOML = """version = "1.0"

[agent]
timeout_sec = 3600.0

[environment]
network_mode = "no-network"
"""


class WorkdirEnvironment(BaseEnvironment):  # type: ignore[misc]  # Harbor's class (its venv)
    """Commands run here, in the rollout's workdir (see the module docstring)."""

    # The rollout's workdir copy: the directory this process started in.
    workdir = os.getcwd()

    @staticmethod
    def type() -> str:
        return "agenttap-rollout-workdir"

    @property
    def capabilities(self) -> EnvironmentCapabilities:
        # The rollout's sandbox reaches nothing but the proxy.
        return EnvironmentCapabilities(disable_internet=True)

    def _validate_definition(self) -> None:
        """Nothing to check: the task folder is this script's own."""

    async def start(self, force_build: bool) -> None:
        # Where Harbor's agents write their logs (Terminus-2's pane log), if the sandbox's root
        # lets it be made; nothing reads them back.
        for folder in ("/logs/agent", "/logs/verifier", "/logs/artifacts"):
            with contextlib.suppress(OSError):
                os.makedirs(folder, exist_ok=True)

    async def stop(self, delete: bool) -> None:
        # Terminus-2's tmux server outlives its commands; the rollout would end it anyway.
        with contextlib.suppress(Exception):
            await self.exec("tmux kill-server", timeout_sec=10)

    async def exec(
        self,
        command: str,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        timeout_sec: int | None = None,
        user: str | int | None = None,
    ) -> ExecResult:
        proc = await asyncio.create_subprocess_exec(
            "bash", "-c", command,
            cwd=cwd or self.workdir, env={**os.environ, **(self._merge_env(env) or {})},
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, start_new_session=True,
        )  # fmt: skip
        try:
            out, err = await asyncio.wait_for(proc.communicate(), timeout_sec)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.communicate()
            raise RuntimeError(f"Command timed out after {timeout_sec} seconds") from None
        return ExecResult(
            stdout=out.decode(errors="replace"),
            stderr=err.decode(errors="replace"),
            return_code=proc.returncode if proc.returncode is not None else -1,
        )

    async def upload_file(self, source_path: Path | str, target_path: str) -> None:
        Path(target_path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source_path, target_path)

    async def upload_dir(self, source_dir: Path | str, target_dir: str) -> None:
        shutil.copytree(source_dir, target_dir, symlinks=True, dirs_exist_ok=True)

    async def download_file(self, source_path: str, target_path: Path | str) -> None:
        Path(target_path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source_path, target_path)

    async def download_dir(self, source_dir: str, target_dir: Path | str) -> None:
        Path(target_dir).mkdir(parents=True, exist_ok=True)
        if Path(source_dir).is_dir():
            shutil.copytree(source_dir, target_dir, symlinks=True, dirs_exist_ok=True)


def write_task(folder: Path, prompt: str) -> Path:
    (folder / "environment").mkdir(parents=True, exist_ok=True)
    (folder / "tests").mkdir(exist_ok=True)
    (folder / "instruction.md").write_text(prompt)
    (folder / "task.toml").write_text(TASK_TOML)
    (folder / "tests" / "test.sh").write_text("#!/bin/sh\n# agenttap's verifier scores the run\n")
    return folder


def main(prompt: str) -> int:
    from harbor.cli.main import app

    home = Path(os.environ.get("HOME", "."))
    task = write_task(home / "harbor-task", prompt)
    jobs = home / "harbor-jobs"
    args = [
        "run", "--path", str(task), "--agent", "terminus-2", "--model", "openai/gpt-4o",
        "--env", "__main__:WorkdirEnvironment", "--disable-verification",
        "--jobs-dir", str(jobs), "--yes", "--quiet",
    ]  # fmt: skip
    try:
        app(args, prog_name="harbor")
    except SystemExit as exc:
        if exc.code not in (0, None):
            return 1
    results = [json.loads(p.read_text()) for p in jobs.glob("*/*/result.json")]
    failed = [r["exception_info"] for r in results if r.get("exception_info")]
    for info in failed:
        print(f"agenttap: the Terminus-2 trial failed: {json.dumps(info)[:2000]}", file=sys.stderr)
    return 0 if results and not failed else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
