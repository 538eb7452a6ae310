"""Rollouts: agenttap runs the agent too. ``POST /rollouts`` runs ``n`` real CLI agents on a task,
each in its own session (one group id), scores each with a verifier and closes its session
with that reward; the answer holds each rollout's status, finish reason, metrics and rows.

A rollout's files live in ``OUT/rollouts/<id>/<index>/``: ``work/`` (a fresh copy of the
task's workdir, where the agent runs and the verifier scores), ``home/`` (the agent's own
``HOME``), ``verifier-home/``, ``agent.log`` and ``verifier.log`` (scratch ``tmp/`` and
``verifier-tmp/`` folders, each one's ``TMPDIR``, are removed once it has ended).

The agent and the verifier each run in a bubblewrap sandbox (capture/rollouts/sandbox.py; option
``agenttap_sandbox``, or ``"sandbox"`` in the request): the host read-only, only ``work``, its
``HOME`` and ``TMPDIR`` writable, OUT (every other rollout included), mitmproxy's confdir (but
the CA certificate) and ``agenttap_sandbox_hide`` hidden, its own PID namespace. A rollout that
ends, is cancelled (``DELETE``) or outlives its timeout, and the proxy stopping, end every
process of its agents (unsandboxed: their process groups); the verifier starts only once every
process of the agent is gone, after ``restore`` put the seed's copies of its paths back. The
number of agents running at once is capped (``agenttap_max_rollouts``); past it a new request
is refused (429, ``Retry-After``).

The request: capture/rollouts/spec.py (``parse_rollout``); ending a child's processes:
capture/rollouts/processes.py (``stop``).
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from capture.control.sessions import END_STOP, parse_limits
from capture.ports import RolloutHost
from capture.rollouts.processes import Child, stop
from capture.rollouts.sandbox import (
    Jail,
    SandboxSpec,
    UnsafeWorkdir,
    bwrap_argv,
    copy_seed,
    find_bwrap,
    host_sockets,
    read_info,
    restore,
)
from capture.rollouts.spec import RolloutSpec

logger = logging.getLogger(__name__)

# Finish reasons beyond the session's own (stop, max_calls, max_tokens, deadline).
FINISH_ERROR = "error"
FINISH_CANCELLED = "cancelled"
VERIFIER_TIMEOUT_S = 300.0
OUTPUT_KEPT = 4000
# The verifier's output read back for its last line.
VERIFIER_TAIL = 65536


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
    # The process running now: the agent, then the verifier.
    child: Child | None = None

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
    # How its agents run: "bwrap" (with the bwrap found) or "none".
    sandbox: str = "bwrap"
    bwrap: str | None = None
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
            "sandbox": self.sandbox,
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

    def __init__(self, api: RolloutHost, max_running: int) -> None:
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
        an id in use; SandboxUnavailable, a ValueError, when it would run in bwrap and bwrap is
        not installed)."""
        if spec.id in self._rollouts:
            raise ValueError(f"rollout id {spec.id!r} is in use")
        sandbox = spec.sandbox or self.api.gateway.config.sandbox
        bwrap = find_bwrap() if sandbox == "bwrap" else None
        running = self.running_agents()
        if running + spec.n > self.max_running:
            raise Busy(running, self.max_running)
        if bwrap is None:
            logger.warning(
                "agenttap: rollout %s runs its agents and verifier unsandboxed (sandbox none): "
                "they can read and write everything this user can, the token file and the CA "
                "key included",
                spec.id,
            )
        runs = []
        for i in range(spec.n):
            sid = f"{spec.id}-{i}"
            metadata = {**spec.metadata, "group_id": spec.id, "rollout_id": spec.id, "index": i}
            self.api.gateway.control.open(sid, metadata, parse_limits(spec.limits or None))
            runs.append(Run(i, sid, self.root / spec.id / str(i)))
        rollout = Rollout(spec, runs, sandbox, bwrap)
        self._rollouts[spec.id] = rollout
        rollout.task = asyncio.get_running_loop().create_task(self._run_all(rollout))
        logger.info("agenttap: rollout %s: %d x %s started", spec.id, spec.n, spec.command[0])
        return rollout

    async def cancel(self, rollout: Rollout) -> None:
        """Stop a rollout: its agents' process groups end, its sessions are closed with their
        rows kept (``end_reason`` ``cancelled``)."""
        rollout.cancelled = True
        await asyncio.gather(
            *(stop(run.child, graceful=True) for run in rollout.runs if run.child is not None)
        )
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
            failure = None
            if not rollout.cancelled and run.error is None:
                failure = run.error = self._agent_failure(run)
            if rollout.cancelled:
                run.status, run.finish_reason = "cancelled", FINISH_CANCELLED
            elif spec.verifier is not None and (
                run.error is None or (failure is not None and spec.on_error == "score")
            ):
                run.status = "scoring"
                await self._verify(rollout, run)
                if rollout.cancelled:
                    run.status = "cancelled"
        except Exception as exc:  # a defect of ours must not leave the session open
            logger.exception("agenttap: rollout %s/%d failed", rollout.id, run.index)
            run.error = f"agenttap: internal error: {exc}"
        finally:
            await self._close(run)
            run.wall_time_s = time.monotonic() - run.started_at

    def _agent_failure(self, run: Run) -> str | None:
        """Why an agent that ended by itself failed: a non-zero exit (unless its session
        reached a limit, where the CLIs exit non-zero by design), or no model call at all (a
        CLI that could not start, a wrong key). None: it did its part."""
        sess = self.api.gateway.control.get(run.session_id)
        limit = sess.limit_reached if sess is not None else None
        calls = sess.metrics.calls if sess is not None else 0
        if run.exit_code not in (0, None) and limit is None:
            return f"the agent exited with code {run.exit_code} (its output: agent_output)"
        if calls == 0 and limit is None:
            return (
                "the agent made no model call: it never reached the policy (see agent_output; "
                "a CLI that could not start, or a client not configured by the session's env)"
            )
        return None

    async def _agent(self, rollout: Rollout, run: Run) -> None:
        spec = rollout.spec
        work, home, tmp = run.folder / "work", run.folder / "home", run.folder / "tmp"
        run.folder.mkdir(parents=True, exist_ok=True)
        if spec.workdir is not None:
            try:
                await asyncio.to_thread(copy_seed, spec.workdir, work)
            except UnsafeWorkdir as exc:  # the seed changed since the request was checked
                run.error = str(exc)
                return
        else:
            work.mkdir()
        for folder in (home, home / ".codex", tmp):
            folder.mkdir()
        # Built whole, never from os.environ: the proxy's environment may hold the token.
        env = {
            "PATH": os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"),
            "LANG": os.environ.get("LANG", "C.UTF-8"),
            "HOME": str(home),
            "TMPDIR": str(tmp),
            "CLAUDE_CONFIG_DIR": str(home / ".claude"),
            "CODEX_HOME": str(home / ".codex"),
            **self._session_env(run),
            **spec.agent_env,
            "AGENTTAP_ROLLOUT": rollout.id,
        }
        log = run.folder / "agent.log"
        if rollout.cancelled:
            return
        run.status = "running"
        with open(log, "wb") as out:
            try:
                run.child = await self._spawn(rollout, spec.command, env, work, home, tmp, out)
            except OSError as exc:
                run.error = f"the agent could not start: {exc}"
                return
            timed_out = False
            try:
                # A DELETE while it started found no process to stop: it is stopped here.
                if not rollout.cancelled:
                    run.exit_code = await asyncio.wait_for(run.child.proc.wait(), spec.timeout_s)
            except TimeoutError:
                timed_out = True
                run.error = f"the agent ran past its timeout ({spec.timeout_s:g} s) and was stopped"
            finally:
                # Whatever it left running (a tool's server, a daemon) ends with it.
                gone = await stop(run.child, graceful=timed_out or rollout.cancelled)
                run.exit_code = run.child.proc.returncode
        if not gone and run.error is None:
            run.error = "agenttap: the agent's processes did not end; it is not scored"
        await asyncio.to_thread(shutil.rmtree, tmp, True)
        run.agent_output = _tail(log)

    def _session_env(self, run: Run) -> dict[str, str]:
        """The session's environment for its agent (proxy, CA, its secret as the keys)."""
        sess = self.api.gateway.control.get(run.session_id)
        return self.api.endpoints.env(run.session_id, sess.secret if sess is not None else "")

    def _hidden(self) -> tuple[Path, ...]:
        config = self.api.gateway.config
        confdir = (Path(config.confdir),) if config.confdir else ()
        return (Path(self.api.out_dir), *confdir, *config.sandbox_hide, *host_sockets())

    async def _spawn(
        self,
        rollout: Rollout,
        command: list[str],
        env: dict[str, str],
        work: Path,
        home: Path,
        tmp: Path,
        out: IO[bytes],
    ) -> Child:
        """Start ``command`` in ``work`` (its output to ``out``), in the rollout's sandbox: only
        ``work``, ``home`` and ``tmp`` writable."""
        common: dict[str, Any] = {
            "env": env,
            "stdin": asyncio.subprocess.DEVNULL,
            "stdout": out,
            "stderr": asyncio.subprocess.STDOUT,
            "start_new_session": True,
        }
        if rollout.bwrap is None:
            return Child(await asyncio.create_subprocess_exec(*command, cwd=work, **common))
        ends = self.api.endpoints
        box = SandboxSpec(
            work, home, tmp, hide=self._hidden(),
            expose_files=tuple(Path(p) for p in (ends.ca_path, ends.bundle_path) if p),
        )  # fmt: skip
        info_r, info_w = os.pipe()
        try:
            argv = bwrap_argv(box, command, rollout.bwrap, info_fd=info_w)
            proc = await asyncio.create_subprocess_exec(*argv, pass_fds=(info_w,), **common)
        except BaseException:
            os.close(info_r)
            raise
        finally:
            os.close(info_w)
        child = Child(proc)
        try:
            child.jail = Jail.from_info(await read_info(info_r))
        except TimeoutError:  # never set up: it is killed as a process group
            logger.error("agenttap: rollout %s: bwrap did not report its sandbox", rollout.id)
        return child

    async def _verify(self, rollout: Rollout, run: Run) -> None:
        """Score the agent's copy: the seed's ``restore`` paths put back, the verifier run in a
        sandbox of its own (a fresh HOME and TMPDIR, PYTHONSAFEPATH=1 so a module the agent
        dropped in the workdir does not shadow the standard library). Its last output line is
        the reward; anything else is an error, its output kept."""
        spec = rollout.spec
        assert spec.verifier is not None
        work = run.folder / "work"
        home, tmp = run.folder / "verifier-home", run.folder / "verifier-tmp"
        if spec.restore and spec.workdir is not None:
            try:
                await asyncio.to_thread(restore, spec.workdir, work, spec.restore)
            except (UnsafeWorkdir, OSError) as exc:
                run.error = f"the verifier's restore failed: {exc}"
                return
        home.mkdir()
        tmp.mkdir()
        env = {
            "PATH": os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"),
            "LANG": os.environ.get("LANG", "C.UTF-8"),
            "HOME": str(home),
            "TMPDIR": str(tmp),
            "PYTHONSAFEPATH": "1",
            "AGENTTAP_SESSION": run.session_id,
        }
        log = run.folder / "verifier.log"
        with open(log, "wb") as out:
            try:
                run.child = await self._spawn(rollout, spec.verifier, env, work, home, tmp, out)
            except OSError as exc:
                run.error = f"the verifier could not start: {exc}"
                return
            timed_out = False
            try:
                if not rollout.cancelled:
                    await asyncio.wait_for(run.child.proc.wait(), VERIFIER_TIMEOUT_S)
            except TimeoutError:
                timed_out = True
                run.error = f"the verifier ran past {VERIFIER_TIMEOUT_S:g} s and was stopped"
            finally:
                await stop(run.child, graceful=False)
        await asyncio.to_thread(shutil.rmtree, tmp, True)
        output = _tail(log, VERIFIER_TAIL)
        run.verifier_output = output[-OUTPUT_KEPT:]
        returncode = run.child.proc.returncode
        if timed_out or rollout.cancelled:  # stopped: its output is no score
            return
        if returncode != 0:
            run.error = f"the verifier exited with {returncode}"
            return
        lines = [line.strip() for line in output.splitlines() if line.strip()]
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


def _tail(path: Path, size: int = OUTPUT_KEPT) -> str:
    """The last ``size`` bytes of a log, as text."""
    try:
        with open(path, "rb") as fh:
            fh.seek(max(0, fh.seek(0, os.SEEK_END) - size))
            return fh.read().decode("utf-8", "replace")
    except OSError:
        return ""
