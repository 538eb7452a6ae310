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
import contextlib
import logging
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from capture.control.endpoints import Endpoints
from capture.control.sessions import END_STOP, agent_seed, parse_limits
from capture.egress import EGRESS_PUBLIC
from capture.logsafe import printable
from capture.ports import RolloutHost
from capture.rollouts.admission import MemoryBudget, MemoryBusy, default_budget_mb, run_need_mb
from capture.rollouts.agents import prepare_home
from capture.rollouts.limits import (
    MIB,
    DiskQuota,
    OutputPump,
    RolloutCgroup,
    SandboxLimits,
    cap_instance_memory,
    limit_hit,
    mechanism,
    release,
    remove_stale,
    watch,
)
from capture.rollouts.netbridge import (
    INSIDE,
    Bridges,
    NetBridge,
    inside_url,
    interpreter,
    route_for,
)
from capture.rollouts.processes import Child, stop
from capture.rollouts.sandbox import (
    SANDBOX_UID,
    Jail,
    SandboxSpec,
    UnsafeWorkdir,
    copy_seed,
    find_bwrap,
    give_to,
    make_stage,
    program_paths,
    read_info,
    restore,
    sandbox_argv,
    sanitize,
)
from capture.rollouts.scoring import graded_folder, score, verifier_command
from capture.rollouts.spec import RolloutSpec
from capture.storage.sessions import take_back_rewards
from capture.storage.shards import REWARD_VERIFIER

logger = logging.getLogger(__name__)

# Finish reasons beyond the session's own (stop, max_calls, max_tokens, deadline).
FINISH_ERROR = "error"
FINISH_CANCELLED = "cancelled"
# A kernel limit of the sandbox ended it (the run's "limit" names which).
FINISH_LIMIT = "limit"
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
    # The verifier's stderr: shown, never read for the reward.
    verifier_stderr: str = ""
    # What of its files could not be kept on disk at the end (special files, paths too long).
    not_kept: list[str] = field(default_factory=list)
    # With "keep" or the pytest verifier: what of the agent's was graded and what was left out.
    graded: dict[str, Any] | None = None
    # The pytest verifier's tests by outcome; a rewards.json's named rewards.
    tests: dict[str, Any] | None = None
    rewards: dict[str, float] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)
    rows: list[dict[str, Any]] = field(default_factory=list)
    started_at: float = 0.0
    wall_time_s: float = 0.0
    # What was removed from the workdir before scoring (links out of it, FIFOs, sockets).
    sanitized: list[str] = field(default_factory=list)
    # The kernel limit the agent or verifier went past ("memory", "pids", "cpu_s", "disk",
    # "output"), and what its processes used (peak memory, CPU seconds).
    limit: str | None = None
    usage: dict[str, Any] = field(default_factory=dict)
    # Where work/, home/ and tmp/ live while it runs: the run's folder, or the size-capped tmpfs
    # in it (box/) that holds the disk limit; kept on disk in the run's folder at the end.
    base: Path | None = None
    quota: DiskQuota | None = None
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
            "workdir": str((self.base or self.folder) / "work"),
            "agent_output": self.agent_output,
            "verifier_output": self.verifier_output,
            "verifier_stderr": self.verifier_stderr,
            "graded": self.graded,
            "not_kept": self.not_kept,
            "tests": self.tests,
            "rewards": self.rewards,
            "sanitized": self.sanitized,
            "limit": self.limit,
            "usage": self.usage,
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
        # Each sandboxed agent's unix sockets to the proxy and the API (its own folder, bound to
        # its session, under its connection budget); made on the first sandboxed rollout.
        self._bridges: Bridges | None = None
        # Where the launcher stages what bwrap binds (an empty folder; mounts go on it only in
        # each launcher's own mount namespace).
        self._stage: Path | None = None
        # What a crashed instance left (its cgroups, its tmpfs) goes; the log says which kernel
        # limits apply on this host.
        removed = remove_stale()
        if removed:
            logger.info("agenttap: removed what an earlier instance left: %s", ", ".join(removed))
        logger.info("%s", mechanism())
        # What running agents and verifiers are promised together (capture/rollouts/admission.py).
        total_mb = api.gateway.config.rollout_memory_mb or default_budget_mb()
        self.memory = MemoryBudget(total_mb)
        logger.info("agenttap: %s", cap_instance_memory(total_mb))

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

    def start(self, spec: RolloutSpec, wait: bool = True) -> Rollout:
        """Open the rollout's sessions and start its agents (Busy past the cap; ValueError for
        an id in use; SandboxUnavailable, a ValueError, when it would run in bwrap and bwrap is
        not installed)."""
        if spec.id in self._rollouts:
            raise ValueError(f"rollout id {spec.id!r} is in use")
        sandbox = spec.sandbox or self.api.gateway.config.sandbox
        bwrap = find_bwrap() if sandbox == "bwrap" else None
        self._check_expose(spec.expose)
        running = self.running_agents()
        if running + spec.n > self.max_running:
            raise Busy(running, self.max_running)
        # Each run waits for its memory and tmpfs (_run). NeverFits (a ValueError) if one
        # never can; MemoryBusy, asking not to wait, if not even one fits now.
        need = run_need_mb(spec.sandbox_limits)
        self.memory.check(need)
        if not wait and not self.memory.fits(need):
            raise MemoryBusy(need, self.memory.promised_mb, self.memory.total_mb)
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
            sess = self.api.gateway.control.open(sid, metadata, parse_limits(spec.limits or None))
            if spec.seed is not None:  # each agent samples its own way, the same in every run
                sess.seed = agent_seed(spec.seed, i)
            if spec.egress == EGRESS_PUBLIC:
                self.api.gateway.egress_public.add(sid)
            runs.append(Run(i, sid, self.root / spec.id / str(i)))
        rollout = Rollout(spec, runs, sandbox, bwrap)
        self._rollouts[spec.id] = rollout
        rollout.task = asyncio.get_running_loop().create_task(self._run_all(rollout))
        logger.info("agenttap: rollout %s: %d x %s started", spec.id, spec.n, spec.command[0])
        return rollout

    def _check_expose(self, expose: tuple[Path, ...]) -> None:
        """Refuse (ValueError) exposing a folder agenttap keeps from agents: OUT, mitmproxy's
        confdir, the hidden paths, or a folder above one of them."""
        kept = [Path(os.path.realpath(p)) for p in self._hidden()]
        for path in expose:
            real = Path(os.path.realpath(path))
            for secret in kept:
                if secret.is_relative_to(real) or real.is_relative_to(secret):
                    raise ValueError(
                        f'"expose": {str(path)!r} would show {str(secret)!r} (OUT, the CA key, '
                        "the token or a path of agenttap_sandbox_hide) to the agent; expose a "
                        "folder that holds none of them"
                    )

    async def cancel(self, rollout: Rollout) -> None:
        """Stop a rollout: its agents' process groups end, its sessions are closed with their
        rows kept (``end_reason`` ``cancelled``)."""
        rollout.cancelled = True
        self.memory.nudge()  # its runs still waiting for memory give up
        await asyncio.gather(
            *(stop(run.child, graceful=True) for run in rollout.runs if run.child is not None)
        )
        if rollout.task is not None:
            await asyncio.wait([rollout.task])

    async def shutdown(self) -> None:
        for rollout in self.all():
            if not rollout.done:
                await self.cancel(rollout)
        if self._bridges is not None:
            await self._bridges.close_all()
        if self._stage is not None:
            shutil.rmtree(self._stage, ignore_errors=True)
            self._stage = None
        release()

    async def bridge(self, run: Run) -> NetBridge:
        """The bridge into ``run``'s sandbox's network: the proxy's port (when mitmdump
        listens) and the API's (base URLs), its connections bound to the run's session."""
        if self._bridges is None:
            gateway = self.api.gateway
            self._bridges = Bridges(
                gateway.bindings, gateway.config.rollout_max_connections, self.max_running
            )
        ends = self.api.endpoints
        routes = [route_for("api", ends.api_url)]
        if ends.proxy_url:
            routes.insert(0, route_for("proxy", ends.proxy_url))
        return await self._bridges.open(run.session_id, routes)

    async def _close_bridge(self, run: Run) -> None:
        """The run's agent ended: its bridge goes; what it refused joins the run's usage."""
        if self._bridges is not None:
            counted = await self._bridges.close(run.session_id)
            if counted is not None:
                run.usage["bridge"] = counted

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
        need = run_need_mb(spec.sandbox_limits)
        promised = False
        try:
            # Its memory and tmpfs, once they fit beside the running agents (admission.py).
            promised = await self.memory.acquire(need, lambda: rollout.cancelled)
            if promised:
                await self._agent(rollout, run)
            failure = None
            if not rollout.cancelled and run.error is None:
                failure = run.error = self._agent_failure(run)
            # A session someone else closed is not scored: its rows get no reward (_close).
            taken = self._taken_over(run, self.api.gateway.control.get(run.session_id))
            if rollout.cancelled:
                run.status, run.finish_reason = "cancelled", FINISH_CANCELLED
            elif (
                taken is None
                and spec.verifier is not None
                and (
                    run.error is None or (failure is not None and spec.verifier.on_error == "score")
                )
            ):
                run.status = "scoring"
                await self._verify(rollout, run)
                if rollout.cancelled:
                    run.status = "cancelled"
        except Exception as exc:  # a defect of ours must not leave the session open
            logger.exception("agenttap: rollout %s/%d failed", rollout.id, run.index)
            run.error = f"agenttap: internal error: {exc}"
        finally:
            await self._keep_files(run)
            await self._close(run)
            run.wall_time_s = time.monotonic() - run.started_at
            if promised:
                self.memory.give_back(need)

    async def _keep_files(self, run: Run) -> None:
        """The run's work/ and HOMEs out of its size-capped tmpfs, onto disk in its folder."""
        quota, run.quota = run.quota, None
        if quota is None:
            return
        names = ("work", "graded", "home", "verifier-home")
        try:
            skipped = await asyncio.to_thread(quota.unmount_keeping, names, run.folder)
        except OSError as exc:
            logger.error(
                "agenttap: rollout run %s: its files could not be kept: %s", run.folder, exc
            )
            return
        run.base = run.folder
        with contextlib.suppress(OSError):
            quota.path.rmdir()
        if skipped:
            run.not_kept = [printable(path) for path in skipped[:100]]
            logger.info(
                "agenttap: %s: %d path(s) not kept (special files, paths past PATH_MAX): %s",
                run.folder, len(skipped), printable(", ".join(skipped[:5])),
            )  # fmt: skip

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
        run.folder.mkdir(parents=True, exist_ok=True)
        # The disk limit: work/, home/ and tmp/ on a tmpfs of that size (a plain folder where
        # this process may not mount one: see limits.mechanism()).
        run.quota = await asyncio.to_thread(
            DiskQuota.mount, run.folder / "box", spec.sandbox_limits.disk_mb
        )
        run.base = base = run.quota.path
        work, home, tmp = base / "work", base / "home", base / "tmp"
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
        await asyncio.to_thread(prepare_home, spec.agent, home)  # its config, into its HOME
        if rollout.bwrap is not None:
            await asyncio.to_thread(give_to, sandbox_user(), work, home, tmp)
        # Built whole, never from os.environ: the proxy's environment may hold the token.
        env = {
            **_plain_env(home, tmp),
            "CLAUDE_CONFIG_DIR": str(home / ".claude"),
            "CODEX_HOME": str(home / ".codex"),
            **self._session_env(run, inside=rollout.bwrap is not None),
            **spec.agent_env,
            "AGENTTAP_ROLLOUT": rollout.id,
        }
        log = run.folder / "agent.log"
        if rollout.cancelled:
            return
        run.status = "running"
        try:
            ended = await self._supervised(
                rollout, run, "agent", spec.command, env, (work, home, tmp), log, spec.timeout_s
            )
        except OSError as exc:
            run.error = f"the agent could not start: {exc}"
            return
        finally:
            await asyncio.to_thread(shutil.rmtree, tmp, True)
            run.agent_output = _tail(log)
        if ended.timed_out:
            run.error = f"the agent ran past its timeout ({spec.timeout_s:g} s) and was stopped"
        elif ended.limit is not None:
            run.limit = ended.limit
            run.error = limit_words("agent", ended.limit, spec.sandbox_limits)
        elif not ended.gone:
            run.error = "agenttap: the agent's processes did not end; it is not scored"

    async def _supervised(
        self,
        rollout: Rollout,
        run: Run,
        role: str,
        command: list[str],
        env: dict[str, str],
        folders: tuple[Path, Path, Path],
        log: Path,
        timeout_s: float,
        stderr_log: Path | None = None,
    ) -> Ended:
        """Run ``command`` (the agent or the verifier) in the rollout's sandbox under the
        kernel's limits (a cgroup of its own: memory, pids, CPU seconds; rlimits; its output
        kept to ``output_mb`` in ``log``, its stderr apart in ``stderr_log`` when given) until
        it ends, runs past ``timeout_s``, goes past a limit or the rollout is cancelled; then
        every process of it is ended."""
        limits = rollout.spec.sandbox_limits
        cgroup = RolloutCgroup.create(f"{rollout.id}-{run.index}-{role}", limits)
        pump = OutputPump(log, limits.output_mb * MIB)
        errors = OutputPump(stderr_log, limits.output_mb * MIB) if stderr_log else None
        timed_out, limit, gone = False, None, True
        try:
            run.child = child = await self._spawn(
                rollout, run, command, env, *folders, network=role == "agent",
                prefix=cgroup.launch_prefix(), stderr_apart=errors is not None,
            )  # fmt: skip
            assert child.proc.stdout is not None
            pumping: asyncio.Future[Any] = asyncio.ensure_future(pump.run(child.proc.stdout))
            if errors is not None:
                assert child.proc.stderr is not None
                pumping = asyncio.gather(pumping, errors.run(child.proc.stderr))
            waiting = asyncio.ensure_future(child.proc.wait())
            watching = asyncio.ensure_future(watch(cgroup, run.quota, pump))
            try:
                # A DELETE while it started found no process to stop: it is stopped here.
                if not rollout.cancelled:
                    done, _ = await asyncio.wait(
                        {waiting, watching}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED
                    )
                    timed_out = not done
                    if watching in done:
                        limit = watching.result()
            finally:
                watching.cancel()
                # Whatever it left running (a tool's server, a daemon) ends with it.
                gone = await stop(child, graceful=timed_out or rollout.cancelled)
                await cgroup.kill_all()
                await pumping
            # An agent the kernel killed (out of memory) may have exited before a poll saw it.
            limit = limit or limit_hit(cgroup, run.quota, pump)
            if limit is None and errors is not None and errors.hit:
                limit = "output"
            if role == "agent":
                run.exit_code = child.proc.returncode
            run.usage[role] = cgroup.usage()
        finally:
            await cgroup.remove()
            if role == "agent":
                await self._close_bridge(run)
        return Ended(timed_out, limit, gone)

    def _session_env(self, run: Run, inside: bool) -> dict[str, str]:
        """The session's environment for its agent (proxy, CA, its secret as the keys);
        ``inside`` a sandbox, the proxy's and the API's host is 127.0.0.1, where the forwarder
        listens."""
        sess = self.api.gateway.control.get(run.session_id)
        ends = self.api.endpoints
        if inside:
            ends = Endpoints(
                inside_url(ends.api_url),
                inside_url(ends.proxy_url) if ends.proxy_url else "",
                ends.ca_path,
                ends.bundle_path,
            )
        return ends.env(run.session_id, sess.secret if sess is not None else "")

    def _hidden(self) -> tuple[Path, ...]:
        config = self.api.gateway.config
        confdir = (Path(config.confdir),) if config.confdir else ()
        return (Path(self.api.out_dir), *confdir, *config.sandbox_hide)

    async def _spawn(
        self,
        rollout: Rollout,
        run: Run,
        command: list[str],
        env: dict[str, str],
        work: Path,
        home: Path,
        tmp: Path,
        network: bool,
        prefix: list[str],
        stderr_apart: bool = False,
    ) -> Child:
        """Start ``command`` in ``work`` (its output on a pipe), in the rollout's sandbox: only
        ``work``, ``home`` and ``tmp`` writable; with ``network``, the proxy's and the API's
        ports handed in by the forwarder (the agent), else no network at all (the verifier).
        ``prefix`` runs first, as this process's user (it joins the run's cgroup, sets the
        rlimits, then execs the rest). Its stderr joins its stdout unless ``stderr_apart``."""
        common: dict[str, Any] = {
            "env": env,
            "stdin": asyncio.subprocess.DEVNULL,
            "stdout": asyncio.subprocess.PIPE,
            "stderr": asyncio.subprocess.PIPE if stderr_apart else asyncio.subprocess.STDOUT,
            "start_new_session": True,
        }
        if rollout.bwrap is None:
            return Child(
                await asyncio.create_subprocess_exec(*prefix, *command, cwd=work, **common)
            )
        ends, config = self.api.endpoints, self.api.gateway.config
        path_env = env.get("PATH", "")
        bridge = await self.bridge(run) if network else None
        inner, python = command, interpreter()
        if bridge is not None:
            inner = [python, "-I", "-S", str(INSIDE / "bridge.py"), *bridge.forwards(), "--"]
            inner += command
        box = SandboxSpec(
            work, home, tmp, hide=self._hidden(),
            expose=(
                *program_paths(command, path_env),
                *(program_paths([python], path_env) if bridge is not None else ()),
                *(Path(p) for p in (ends.ca_path, ends.bundle_path) if p),
                *config.sandbox_expose,
                *rollout.spec.expose,
            ),
            bridge=bridge.folder if bridge is not None else None,
        )  # fmt: skip
        info_r, info_w = os.pipe()
        try:
            user = sandbox_user()
            if user is not None and self._stage is None:
                self._stage = make_stage()
            argv = sandbox_argv(
                box, inner, rollout.bwrap, info_fd=info_w, uid=user, stage=self._stage
            )
            proc = await asyncio.create_subprocess_exec(
                *prefix, *argv, pass_fds=(info_w,), cwd="/", **common
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
            logger.error("agenttap: rollout %s: bwrap did not report its sandbox", rollout.id)
        return child

    async def _verify(self, rollout: Rollout, run: Run) -> None:
        """Score the agent's work in a sandbox of its own (a fresh HOME and TMPDIR,
        PYTHONSAFEPATH=1 so a module the agent dropped does not shadow the standard library):
        on a fresh copy of the seed plus the agent's kept files (``keep``, the pytest
        verifier), else in the agent's copy with the seed's ``restore`` paths put back. The
        reward comes from the verifier's stdout, ``$AGENTTAP_REWARD_FILE`` or the pytest
        verifier's JUnit report (capture/rollouts/scoring.py); anything else is an error, its
        output kept."""
        spec = rollout.spec
        verifier = spec.verifier
        assert verifier is not None
        base = run.base or run.folder
        work = base / "work"
        home, tmp = base / "verifier-home", base / "verifier-tmp"
        try:
            graded = await asyncio.to_thread(
                graded_folder, verifier, spec.workdir, work, base / "graded"
            )
            if graded is None and verifier.restore and spec.workdir is not None:
                await asyncio.to_thread(restore, spec.workdir, work, verifier.restore)
        except (UnsafeWorkdir, OSError) as exc:
            run.error = f"the verifier's files could not be made ready: {exc}"
            return
        if graded is not None:
            run.graded = graded.summary()
            work = base / "graded"
        else:
            # What the agent left to trip the verifier (a link out of the workdir, a FIFO that
            # blocks a read) goes before it runs.
            removed = await asyncio.to_thread(sanitize, work)
            if removed:
                run.sanitized = removed[:100]
                logger.info(
                    "agenttap: rollout %s/%d: removed %d link(s) out of the workdir or special "
                    "file(s) before scoring: %s",
                    rollout.id, run.index, len(removed), printable(", ".join(removed[:5])),
                )  # fmt: skip
        home.mkdir()
        tmp.mkdir()
        try:
            kept = [work / rel for rel in (graded.kept if graded is not None else [])]
            command, extra = await asyncio.to_thread(verifier_command, verifier, tmp, kept)
            if rollout.bwrap is not None:
                await asyncio.to_thread(give_to, sandbox_user(), work, home, tmp)
            env = {
                **_plain_env(home, tmp),
                "PYTHONSAFEPATH": "1",
                "AGENTTAP_SESSION": run.session_id,
                **extra,
            }
            log, errors = run.folder / "verifier.log", run.folder / "verifier-stderr.log"
            ended = await self._supervised(
                rollout, run, "verifier", command, env, (work, home, tmp), log,
                VERIFIER_TIMEOUT_S, stderr_log=errors,
            )  # fmt: skip
            stdout = _tail(log, VERIFIER_TAIL)  # read for the reward: its stderr never is
            run.verifier_output = stdout[-OUTPUT_KEPT:]
            run.verifier_stderr = _tail(errors)
            if ended.timed_out:
                run.error = f"the verifier ran past {VERIFIER_TIMEOUT_S:g} s and was stopped"
            elif ended.limit is not None:
                run.limit = ended.limit
                run.error = limit_words("verifier", ended.limit, spec.sandbox_limits)
            if ended.timed_out or ended.limit is not None or rollout.cancelled:
                return  # stopped: its output is no score
            assert run.child is not None
            scored = await asyncio.to_thread(
                score, verifier, run.child.proc.returncode, stdout, tmp
            )
        except OSError as exc:
            run.error = f"the verifier could not start: {exc}"
            return
        finally:
            await asyncio.to_thread(shutil.rmtree, tmp, True)
        run.tests, run.rewards = scored.tests, scored.rewards
        if scored.error is not None:
            run.error = scored.error
            return
        run.reward = scored.reward

    async def _close(self, run: Run) -> None:
        """Close the run's session with its reward (the verifier's: the rows' ``reward_source``
        says so); the rows say how it finished. A session someone else closed (and so could
        reward) before this runner did ends the run ``error``, its rows without a reward."""
        self.api.gateway.egress_public.discard(run.session_id)
        control = self.api.gateway.control
        sess = control.get(run.session_id)
        taken = self._taken_over(run, sess)
        if taken is not None:
            await self._close_taken_over(run, taken)
            return
        limit = sess.limit_reached if sess is not None else None
        if run.status == "cancelled":
            reason = FINISH_CANCELLED
        elif run.limit is not None:
            run.status, reason = "error", FINISH_LIMIT
        elif run.error is not None:
            run.status, reason = "error", FINISH_ERROR
        else:
            run.status, reason = "ok", limit or END_STOP
        run.finish_reason = reason
        closed = await self.api.close_session(
            run.session_id, run.reward, end_reason=reason, reward_source=REWARD_VERIFIER
        )
        if closed is not None:
            sess, rows, _ = closed
            run.metrics = sess.metrics.as_dict()
            run.rows = rows

    async def _close_taken_over(self, run: Run, why: str) -> None:
        """The run's session was closed (and maybe rewarded) by a caller of the control API, not
        by this runner: the run ends ``error`` saying so, and every reward its rows were given
        is taken back (the verifier's is not given: its session's calls are not the run's to
        vouch for)."""
        control = self.api.gateway.control
        sid = run.session_id
        if sid in {s.id for s in control.live()}:  # opened again by that caller: ended too
            await self.api.close_session(sid, None, end_reason=FINISH_ERROR)
        sess = control.get(sid)
        # Shards written since the run began (a second's margin for the file times).
        since = time.time() - (time.monotonic() - run.started_at) - 1.0
        run.rows = await asyncio.to_thread(take_back_rewards, self.api.out_dir, sid, since)
        run.metrics = sess.metrics.as_dict() if sess is not None else {}
        verifier = f" (the verifier's was {run.reward:g})" if run.reward is not None else ""
        run.status, run.finish_reason, run.reward = "error", FINISH_ERROR, None
        run.error = (
            f"agenttap: {why}, before the rollout's verifier ran; its rows carry no reward"
            f"{verifier}. Only agenttap closes a rollout's session: whoever did holds the "
            f"control API's token (an agent that read it?)"
        )
        logger.warning("agenttap: rollout session %r: %s", sid, run.error)

    @staticmethod
    def _taken_over(run: Run, sess: Any) -> str | None:
        """What someone other than the runner did to the run's session before the runner
        closed it (None: nothing): closed it through the control API, maybe with a reward and
        late ones, or closed it and opened it again."""
        sid = run.session_id
        if sess is None:
            return f"session {sid!r} is gone (closed by a caller of the control API)"
        if sess.closed:
            rewarded = []
            if sess.close_reward is not None:
                rewarded.append(f"with reward {sess.close_reward}")
            if sess.late_rewards:
                rewarded.append(f"then given {sess.late_rewards} late reward(s)")
            said = " ".join(rewarded) or "without a reward"
            return f"session {sid!r} was closed through the control API {said}"
        if sess.opened_mono > run.started_at:
            return f"session {sid!r} was closed and opened again through the control API"
        return None


@dataclass(frozen=True)
class Ended:
    """How a supervised agent or verifier ended."""

    timed_out: bool
    limit: str | None
    gone: bool


# Which limit key says what, for the words of an error.
LIMIT_KEYS = {
    "memory": ("memory_mb", "MB of memory"),
    "pids": ("pids", "processes and threads"),
    "cpu_s": ("cpu_s", "CPU seconds"),
    "disk": ("disk_mb", "MB of disk (work, HOME and TMPDIR)"),
    "output": ("output_mb", "MB of output"),
}


def limit_words(role: str, limit: str, limits: SandboxLimits) -> str:
    """The error of a run ended by a kernel limit: which, and how to raise it."""
    key, what = LIMIT_KEYS.get(limit, (limit, limit))
    value = getattr(limits, key, "?")
    return (
        f"the {role} went past its limit of {value:g} {what} and was stopped "
        f'(limits.{key}; raise it in the rollout\'s "limits" if the task needs more)'
    )


def sandbox_user() -> int | None:
    """The uid (and gid) sandboxes run under: ``SANDBOX_UID`` when agenttap runs as root (a
    user that owns nothing on the host), else None (this user's own, the kernel allowing no
    other)."""
    return SANDBOX_UID if os.geteuid() == 0 else None


def _plain_env(home: Path, tmp: Path) -> dict[str, str]:
    """What an agent's or a verifier's environment starts from: built whole, never from
    os.environ (the proxy's environment may hold the token)."""
    return {
        "PATH": os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"),
        "LANG": os.environ.get("LANG", "C.UTF-8"),
        "HOME": str(home),
        "TMPDIR": str(tmp),
    }


def _tail(path: Path, size: int = OUTPUT_KEPT) -> str:
    """The last ``size`` bytes of a log, as text."""
    try:
        with open(path, "rb") as fh:
            fh.seek(max(0, fh.seek(0, os.SEEK_END) - size))
            return fh.read().decode("utf-8", "replace")
    except OSError:
        return ""
