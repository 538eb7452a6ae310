"""Rollouts: agenttap runs the agent too. ``POST /rollouts`` runs ``n`` real CLI agents on a task,
each in its own session (one group id), scores each with a verifier and closes its session
with that reward; the answer holds each rollout's status, finish reason, metrics and rows.

A rollout's files live in ``OUT/rollouts/<id>/<index>/``: ``work/`` (a fresh copy of the
task's workdir, where the agent runs and the verifier scores), ``home/`` (the agent's own
``HOME``), ``agent.log`` and ``verifier.log``. Agents run in process groups of their own: a
rollout that ends, is cancelled (``DELETE``) or outlives its timeout, and the proxy stopping,
end every process of theirs. The number of agents running at once is capped
(``agenttap_max_rollouts``); past it a new request is refused (429, ``Retry-After``).
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import shutil
import signal
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from capture.agents import agent_command
from capture.session_control import (
    END_STOP,
    check_metadata,
    check_session_id,
    parse_limits,
    reject_unknown,
)

if TYPE_CHECKING:
    from capture.control_api import ControlAPI

logger = logging.getLogger(__name__)

# Finish reasons beyond the session's own (stop, max_calls, max_tokens, deadline).
FINISH_ERROR = "error"
FINISH_CANCELLED = "cancelled"
# The most a rollout request may ask for at once (the cap applies on top of it).
MAX_N = 256
VERIFIER_TIMEOUT_S = 300.0
# A grace period between SIGTERM and SIGKILL for an agent's process group.
KILL_GRACE_S = 3.0
OUTPUT_KEPT = 4000


@dataclass
class RolloutSpec:
    agent: Any
    prompt: str
    command: list[str]
    agent_env: dict[str, str]
    n: int = 1
    workdir: Path | None = None
    limits: dict[str, Any] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)
    verifier: list[str] | None = None
    timeout_s: float = 3600.0
    id: str = ""


def parse_rollout(body: Any) -> RolloutSpec:
    """A ``POST /rollouts`` body; ValueError worded for the caller otherwise."""
    if not isinstance(body, dict):
        raise ValueError("the body must be a JSON object")
    known = ("agent", "prompt", "workdir", "n", "limits", "metadata", "verifier", "id")
    reject_unknown(body, (*known, "timeout_s", "wait"))
    prompt = body.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError('"prompt" must be the task, as text')
    command, agent_env = agent_command(body.get("agent"), prompt)
    n = body.get("n", 1)
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_N:
        raise ValueError(f'"n" must be a whole number from 1 to {MAX_N}')
    workdir = None
    if body.get("workdir") is not None:
        if not isinstance(body["workdir"], str):
            raise ValueError('"workdir" must be a folder path on the proxy\'s machine')
        workdir = Path(body["workdir"]).expanduser()
        if not workdir.is_dir():
            raise ValueError(f'"workdir" {str(workdir)!r} is not a folder on the proxy\'s machine')
    limits = parse_limits(body.get("limits"))
    verifier = None
    if body.get("verifier") is not None:
        spec = body["verifier"]
        command_ok = (
            isinstance(spec, dict)
            and set(spec) == {"command"}
            and isinstance(spec["command"], list)
            and spec["command"]
            and all(isinstance(a, str) for a in spec["command"])
        )
        if not command_ok:
            raise ValueError('"verifier" must be {"command": ["program", "arg", ...]}')
        verifier = list(spec["command"])
    timeout = body.get("timeout_s")
    if timeout is None:
        timeout = (limits.deadline_s + 60.0) if limits.deadline_s else 3600.0
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout > 0:
        raise ValueError('"timeout_s" must be a number of seconds > 0')
    if not math.isfinite(timeout):
        raise ValueError('"timeout_s" must be finite')
    rollout_id = body.get("id")
    if rollout_id is not None:
        check_session_id(rollout_id)
    return RolloutSpec(
        agent=body.get("agent"),
        prompt=prompt,
        command=command,
        agent_env=agent_env,
        n=n,
        workdir=workdir,
        limits={k: v for k, v in vars(limits).items() if v is not None},
        metadata=check_metadata(body.get("metadata")),
        verifier=verifier,
        timeout_s=float(timeout),
        id=rollout_id or "r-" + uuid.uuid4().hex[:12],
    )


@dataclass
class Run:
    """One agent of a rollout: its session, process and outcome."""

    index: int
    session_id: str
    folder: Path
    status: str = "pending"  # pending, running, scoring, ok, error, cancelled
    finish_reason: str | None = None
    reward: float | None = None
    exit_code: int | None = None
    error: str | None = None
    agent_output: str = ""
    verifier_output: str = ""
    metrics: dict[str, Any] = field(default_factory=dict)
    rows: list[dict[str, Any]] = field(default_factory=list)
    started_at: float = 0.0
    wall_time_s: float = 0.0
    proc: asyncio.subprocess.Process | None = None

    def summary(self, rows: bool = True) -> dict[str, Any]:
        out = {
            "index": self.index,
            "session_id": self.session_id,
            "status": self.status,
            "finish_reason": self.finish_reason,
            "reward": self.reward,
            "exit_code": self.exit_code,
            "error": self.error,
            "workdir": str(self.folder / "work"),
            "agent_output": self.agent_output,
            "verifier_output": self.verifier_output,
            "metrics": {**self.metrics, "rollout_wall_time_s": round(self.wall_time_s, 3)},
        }
        if rows:
            out["rows"] = self.rows
        return out


@dataclass
class Rollout:
    spec: RolloutSpec
    runs: list[Run]
    created_at: float = field(default_factory=time.time)
    cancelled: bool = False
    task: asyncio.Task[None] | None = None

    @property
    def id(self) -> str:
        return self.spec.id

    @property
    def done(self) -> bool:
        return self.task is not None and self.task.done()

    def summary(self, rows: bool = True) -> dict[str, Any]:
        return {
            "id": self.id,
            "group_id": self.id,
            "agent": self.spec.agent,
            "n": self.spec.n,
            "status": "done" if self.done else "running",
            "cancelled": self.cancelled,
            "created_at": self.created_at,
            "rollouts": [r.summary(rows) for r in self.runs],
        }


class Busy(Exception):
    """Too many agents would run at once."""

    def __init__(self, running: int, cap: int) -> None:
        super().__init__(
            f"agenttap: {running} agent(s) are running and at most {cap} may run at once "
            f"(agenttap_max_rollouts); retry when some have ended"
        )


class Rollouts:
    """Every rollout of this process; runs them as asyncio tasks in the gateway's loop."""

    def __init__(self, api: ControlAPI, max_running: int) -> None:
        self.api = api
        self.max_running = max_running
        self._rollouts: dict[str, Rollout] = {}

    @property
    def root(self) -> Path:
        return self.api.out_dir / "rollouts"

    def running_agents(self) -> int:
        return sum(
            1
            for r in self._rollouts.values()
            if not r.done
            for run in r.runs
            if run.status in ("pending", "running", "scoring")
        )

    def get(self, rollout_id: str) -> Rollout | None:
        return self._rollouts.get(rollout_id)

    def all(self) -> list[Rollout]:
        return list(self._rollouts.values())

    def start(self, spec: RolloutSpec) -> Rollout:
        """Open the rollout's sessions and start its agents (Busy past the cap; ValueError for
        an id in use)."""
        if spec.id in self._rollouts:
            raise ValueError(f"rollout id {spec.id!r} is in use")
        running = self.running_agents()
        if running + spec.n > self.max_running:
            raise Busy(running, self.max_running)
        runs = []
        for i in range(spec.n):
            sid = f"{spec.id}-{i}"
            metadata = {**spec.metadata, "group_id": spec.id, "rollout_id": spec.id, "index": i}
            self.api.gateway.control.open(sid, metadata, parse_limits(spec.limits or None))
            self.api.gateway.metrics.sessions_opened.inc()
            runs.append(Run(i, sid, self.root / spec.id / str(i)))
        rollout = Rollout(spec, runs)
        self._rollouts[spec.id] = rollout
        rollout.task = asyncio.get_running_loop().create_task(self._run_all(rollout))
        logger.info("agenttap: rollout %s: %d x %s started", spec.id, spec.n, spec.command[0])
        return rollout

    async def cancel(self, rollout: Rollout) -> None:
        """Stop a rollout: its agents' process groups end, its sessions are closed with their
        rows kept (``end_reason`` ``cancelled``)."""
        rollout.cancelled = True
        for run in rollout.runs:
            if run.proc is not None and run.proc.returncode is None:
                await _kill_group(run.proc)
        if rollout.task is not None:
            await asyncio.wait([rollout.task])

    async def shutdown(self) -> None:
        for rollout in self.all():
            if not rollout.done:
                await self.cancel(rollout)

    # -- running -------------------------------------------------------------------------------
    async def _run_all(self, rollout: Rollout) -> None:
        await asyncio.gather(*(self._run(rollout, run) for run in rollout.runs))
        logger.info(
            "agenttap: rollout %s done: %s",
            rollout.id,
            ", ".join(f"{r.status}/{r.finish_reason}/{r.reward}" for r in rollout.runs),
        )

    async def _run(self, rollout: Rollout, run: Run) -> None:
        spec = rollout.spec
        run.started_at = time.monotonic()
        try:
            await self._agent(rollout, run)
            if rollout.cancelled:
                run.status, run.finish_reason = "cancelled", FINISH_CANCELLED
            elif run.error is None and spec.verifier is not None:
                run.status = "scoring"
                await self._verify(spec.verifier, run)
        except Exception as exc:  # a defect of ours must not leave the session open
            logger.exception("agenttap: rollout %s/%d failed", rollout.id, run.index)
            run.error = f"agenttap: internal error: {exc}"
        finally:
            await self._close(run)
            run.wall_time_s = time.monotonic() - run.started_at

    async def _agent(self, rollout: Rollout, run: Run) -> None:
        spec = rollout.spec
        work, home = run.folder / "work", run.folder / "home"
        run.folder.mkdir(parents=True, exist_ok=True)
        if spec.workdir is not None:
            await asyncio.to_thread(shutil.copytree, spec.workdir, work, symlinks=True)
        else:
            work.mkdir()
        home.mkdir()
        env = {
            "PATH": os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"),
            "LANG": os.environ.get("LANG", "C.UTF-8"),
            "HOME": str(home),
            "CLAUDE_CONFIG_DIR": str(home / ".claude"),
            "CODEX_HOME": str(home / ".codex"),
            **self.api.endpoints.env(run.session_id),
            **spec.agent_env,
            "AGENTTAP_ROLLOUT": rollout.id,
        }
        (home / ".codex").mkdir()
        log = run.folder / "agent.log"
        if rollout.cancelled:
            return
        run.status = "running"
        with open(log, "wb") as out:
            try:
                run.proc = await asyncio.create_subprocess_exec(
                    *spec.command, cwd=work, env=env, stdin=asyncio.subprocess.DEVNULL,
                    stdout=out, stderr=asyncio.subprocess.STDOUT, start_new_session=True,
                )  # fmt: skip
            except OSError as exc:
                run.error = f"the agent could not start: {exc}"
                return
            try:
                run.exit_code = await asyncio.wait_for(run.proc.wait(), spec.timeout_s)
            except TimeoutError:
                run.error = f"the agent ran past its timeout ({spec.timeout_s:g} s) and was stopped"
            finally:
                # Whatever it left running (a tool's server, a sub-process) ends with it.
                await _kill_group(run.proc)
                run.exit_code = run.proc.returncode
        run.agent_output = _tail(log)

    async def _verify(self, command: list[str], run: Run) -> None:
        """The verifier's last stdout line is the reward; anything else is an error, its output
        kept."""
        work = run.folder / "work"
        env = {
            "PATH": os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"),
            "HOME": str(run.folder / "home"),
            "AGENTTAP_SESSION": run.session_id,
        }
        try:
            proc = await asyncio.create_subprocess_exec(
                *command, cwd=work, env=env, stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        except OSError as exc:
            run.error = f"the verifier could not start: {exc}"
            return
        try:
            raw, _ = await asyncio.wait_for(proc.communicate(), VERIFIER_TIMEOUT_S)
        except TimeoutError:
            await _kill_group(proc)
            run.error = f"the verifier ran past {VERIFIER_TIMEOUT_S:g} s and was stopped"
            return
        output = raw.decode("utf-8", "replace")
        (run.folder / "verifier.log").write_text(output)
        run.verifier_output = output[-OUTPUT_KEPT:]
        lines = [line.strip() for line in output.splitlines() if line.strip()]
        if proc.returncode != 0:
            run.error = f"the verifier exited with {proc.returncode}"
            return
        try:
            reward = float(lines[-1]) if lines else math.nan
        except ValueError:
            reward = math.nan
        if not math.isfinite(reward):
            run.error = "the verifier's last line is not a number (it must print the reward last)"
            return
        run.reward = reward

    async def _close(self, run: Run) -> None:
        """Close the run's session with its reward; the rows say how it finished."""
        control = self.api.gateway.control
        sess = control.get(run.session_id)
        limit = sess.limit_reached if sess is not None else None
        if run.status == "cancelled":
            reason = FINISH_CANCELLED
        elif run.error is not None:
            run.status, reason = "error", FINISH_ERROR
        else:
            run.status, reason = "ok", limit or END_STOP
        run.finish_reason = reason
        closed = await self.api.close_session(run.session_id, run.reward, end_reason=reason)
        if closed is not None:
            sess, rows, _ = closed
            run.metrics = sess.metrics.as_dict()
            run.rows = rows


async def _kill_group(proc: asyncio.subprocess.Process) -> None:
    """End a process and every process of its group: SIGTERM, then SIGKILL after a grace."""
    for sig, wait in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, KILL_GRACE_S)):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
        if proc.returncode is None:
            try:
                await asyncio.wait_for(proc.wait(), wait)
            except TimeoutError:
                continue
        if not _group_alive(proc.pid):
            return


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def _tail(path: Path) -> str:
    try:
        return path.read_text(errors="replace")[-OUTPUT_KEPT:]
    except OSError:
        return ""
