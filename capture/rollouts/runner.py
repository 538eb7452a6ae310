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
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import shutil
import signal
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from capture.control.sessions import (
    END_STOP,
    check_metadata,
    check_session_id,
    parse_limits,
    reject_unknown,
)
from capture.ports import RolloutHost
from capture.rollouts.agents import agent_command
from capture.rollouts.sandbox import (
    Jail,
    SandboxSpec,
    UnsafeWorkdir,
    bwrap_argv,
    check_restore,
    copy_seed,
    find_bwrap,
    host_sockets,
    read_info,
    restore,
)

logger = logging.getLogger(__name__)

# Finish reasons beyond the session's own (stop, max_calls, max_tokens, deadline).
FINISH_ERROR = "error"
FINISH_CANCELLED = "cancelled"
# The most a rollout request may ask for at once (the cap applies on top of it).
MAX_N = 256
VERIFIER_TIMEOUT_S = 300.0
# A grace period between SIGTERM and SIGKILL for an agent's process group.
KILL_GRACE_S = 3.0
# The longest wait for a sandbox's last process once it was killed (the kernel's work: quick).
GONE_TIMEOUT_S = 10.0
OUTPUT_KEPT = 4000
# The verifier's output read back for its last line.
VERIFIER_TAIL = 65536
SANDBOXES = ("bwrap", "none")


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
    # Paths (relative) put back from the seed workdir into the agent's copy before scoring.
    restore: tuple[str, ...] = ()
    # Score a rollout whose agent failed (exited non-zero, made no call) all the same:
    # "score"; "skip" (the default): its reward stays null.
    on_error: str = "skip"
    # "bwrap" or "none"; None: the option's (agenttap_sandbox).
    sandbox: str | None = None
    timeout_s: float = 3600.0
    id: str = ""


def parse_rollout(body: Any) -> RolloutSpec:
    """A ``POST /rollouts`` body; ValueError worded for the caller otherwise."""
    if not isinstance(body, dict):
        raise ValueError("the body must be a JSON object")
    known = ("agent", "prompt", "workdir", "n", "limits", "metadata", "verifier", "id", "sandbox")
    reject_unknown(body, (*known, "timeout_s", "wait"))
    prompt = body.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError('"prompt" must be the task, as text')
    if "\x00" in prompt:
        raise ValueError('"prompt" holds a NUL character, which no command line can carry')
    command, agent_env = agent_command(body.get("agent"), prompt)
    if any("\x00" in arg for arg in command):
        raise ValueError('"agent.command" holds a NUL character, which no command line can carry')
    n = body.get("n", 1)
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_N:
        raise ValueError(f'"n" must be a whole number from 1 to {MAX_N}')
    workdir = None
    if body.get("workdir") is not None:
        if not isinstance(body["workdir"], str):
            raise ValueError('"workdir" must be a folder path on the proxy\'s machine')
        workdir = Path(body["workdir"]).expanduser().resolve()
        if not workdir.is_dir():
            raise ValueError(f'"workdir" {str(workdir)!r} is not a folder on the proxy\'s machine')
    limits = parse_limits(body.get("limits"))
    verifier = None
    restore_paths: tuple[str, ...] = ()
    on_error = "skip"
    if body.get("verifier") is not None:
        spec = body["verifier"]
        command_ok = (
            isinstance(spec, dict)
            and set(spec) <= {"command", "restore", "on_error"}
            and isinstance(spec.get("command"), list)
            and spec["command"]
            and all(isinstance(a, str) for a in spec["command"])
        )
        if not command_ok:
            raise ValueError(
                '"verifier" must be {"command": ["program", "arg", ...], "restore"?: ["path", '
                '...], "on_error"?: "skip" | "score"}'
            )
        if any("\x00" in arg for arg in spec["command"]):
            raise ValueError('"verifier.command" holds a NUL character')
        on_error = spec.get("on_error", "skip")
        if on_error not in ("skip", "score"):
            raise ValueError(
                '"verifier.on_error" must be "skip" (a failed agent gets no reward) or "score" '
                "(the verifier scores it all the same)"
            )
        verifier = list(spec["command"])
        restore_paths = check_restore(spec.get("restore", []))
        if restore_paths and workdir is None:
            raise ValueError('"restore" puts paths back from the "workdir": give one')
    sandbox = body.get("sandbox")
    if sandbox is not None and sandbox not in SANDBOXES:
        raise ValueError(f'"sandbox" must be one of {", ".join(SANDBOXES)}')
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
        restore=restore_paths,
        on_error=on_error,
        sandbox=sandbox,
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
class Child:
    """A started agent or verifier: the process we started (bwrap, or the command itself) and,
    sandboxed, the sandbox's PID namespace."""

    proc: asyncio.subprocess.Process
    jail: Jail | None = None


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
            *(_stop(run.child, graceful=True) for run in rollout.runs if run.child is not None)
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
            if not rollout.cancelled and run.error is None:
                run.error = self._agent_failure(run)
                agent_failed = run.error is not None
            else:
                agent_failed = False
            if rollout.cancelled:
                run.status, run.finish_reason = "cancelled", FINISH_CANCELLED
            elif spec.verifier is not None and (
                run.error is None or (agent_failed and spec.on_error == "score")
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
                gone = await _stop(run.child, graceful=timed_out or rollout.cancelled)
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
                await _stop(run.child, graceful=False)
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


async def _stop(child: Child, graceful: bool) -> bool:
    """End every process of an agent or verifier; True once none is left. Sandboxed: with
    ``graceful``, SIGTERM to each of its processes and a grace for it to exit, then SIGKILL to
    its sandbox's init (the kernel kills the rest of its PID namespace), and a wait until that
    init is gone. Unsandboxed: its process group, SIGTERM then SIGKILL."""
    jail, proc = child.jail, child.proc
    if jail is None:
        await _kill_group(proc)
        return not _group_alive(proc.pid)
    if graceful and proc.returncode is None:
        jail.terminate()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(proc.wait(), KILL_GRACE_S)
    jail.kill()
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
    await proc.wait()
    gone = await jail.wait_gone(GONE_TIMEOUT_S)
    if not gone:
        logger.error("agenttap: a sandbox's processes did not end in %g s", GONE_TIMEOUT_S)
    return gone


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


def _tail(path: Path, size: int = OUTPUT_KEPT) -> str:
    """The last ``size`` bytes of a log, as text."""
    try:
        with open(path, "rb") as fh:
            fh.seek(max(0, fh.seek(0, os.SEEK_END) - size))
            return fh.read().decode("utf-8", "replace")
    except OSError:
        return ""
