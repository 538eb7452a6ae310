"""Rollouts: agenttap runs the agent too. ``POST /rollouts`` runs ``n`` real CLI agents on a task,
each in its own session (one group id), scores each with a verifier and closes its session
with that reward; the answer holds each rollout's status, finish reason, metrics and rows.

A rollout's files live in ``OUT/rollouts/<id>/<index>/``: ``work/`` (a fresh copy of the
task's workdir, where the agent runs and the verifier scores), ``home/`` (the agent's own
``HOME``), ``verifier-home/``, ``agent.log`` and ``verifier.log`` (scratch ``tmp/`` and
``verifier-tmp/`` folders, each one's ``TMPDIR``, are removed once it has ended).

The agent and the verifier each run in a bubblewrap sandbox (capture/isolation/sandbox.py; option
``agenttap_sandbox``, or ``"sandbox"`` in the request): the host read-only, only ``work``, its
``HOME`` and ``TMPDIR`` writable, OUT (every other rollout included), mitmproxy's confdir (but
the CA certificate) and ``agenttap_sandbox_hide`` hidden, its own PID namespace. A rollout that
ends, is cancelled (``DELETE``) or outlives its timeout, and the proxy stopping, end every
process of its agents (unsandboxed: their process groups); the verifier starts only once every
process of the agent is gone, after ``restore`` put the seed's copies of its paths back. The
number of agents running at once is capped (``agenttap_max_rollouts``); past it a new request
is refused (429, ``Retry-After``).

The request: capture/rollouts/spec.py (``parse_rollout``); a rollout and its runs:
capture/rollouts/runs.py; the agent's and the verifier's steps: capture/rollouts/steps.py;
closing a run's session with its reward: capture/rollouts/closing.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from pathlib import Path

from capture.control.sessions import agent_seed, parse_limits
from capture.egress import EGRESS_PUBLIC
from capture.isolation.box import Box
from capture.isolation.netbridge import Route, route_for
from capture.logs.escape import printable
from capture.ports import RolloutHost
from capture.rollouts.admission import MemoryBudget, MemoryBusy, default_budget_mb, run_need_mb
from capture.rollouts.closing import close, taken_over
from capture.rollouts.images import build_task, forget_state, read_image
from capture.rollouts.runs import RUN_LIVE, Busy, FinishReason, Rollout, Run, RunStatus
from capture.rollouts.spec import RolloutSpec
from capture.rollouts.steps import run_agent, verify

logger = logging.getLogger(__name__)

__all__ = ["Busy", "Rollout", "Rollouts", "Run"]


class Rollouts:
    """Every rollout of this process; runs them as asyncio tasks in the gateway's loop."""

    def __init__(self, api: RolloutHost, max_running: int) -> None:
        self.api = api
        self.max_running = max_running
        self._rollouts: dict[str, Rollout] = {}
        ends, config = api.endpoints, api.settings
        # What every sandboxed run is shown read-only: the CA certificate and bundle, the
        # paths of agenttap_sandbox_expose.
        shown = (*(Path(p) for p in (ends.ca_path, ends.bundle_path) if p), *config.sandbox_expose)
        self.box = Box(
            hide=self._hidden(),
            expose=shown,
            routes=self._routes,
            bindings=api.bindings,
            max_connections=config.rollout_max_connections,
            max_running=max_running,
            paths=config.sandbox_paths,
        )
        # What running agents and verifiers are promised together (capture/rollouts/admission.py);
        # the kernel caps them at the same total.
        total_mb = config.rollout_memory_mb or default_budget_mb()
        self.memory = MemoryBudget(total_mb)
        self.box.prepare(total_mb)

    def _routes(self) -> list[Route]:
        """The proxy's port (when mitmdump listens) and the API's, for a run's bridge."""
        ends = self.api.endpoints
        routes = [route_for("api", ends.api_url)]
        if ends.proxy_url:
            routes.insert(0, route_for("proxy", ends.proxy_url))
        return routes

    @property
    def root(self) -> Path:
        return self.api.out_dir / "rollouts"

    def running_agents(self) -> int:
        return sum(
            1
            for r in self._rollouts.values()
            if not r.done
            for run in r.runs
            if run.status in RUN_LIVE
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
        # A rollout with an image runs in its containers; else in the sandbox asked for.
        in_image = spec.image is not None or spec.task is not None
        sandbox = "podman" if in_image else (spec.sandbox or self.api.settings.sandbox)
        engine = self.box.make_engine(sandbox)
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
        if sandbox == "none":
            logger.warning(
                "agenttap: rollout %s runs its agents and verifier unsandboxed (sandbox none): "
                "they can read and write everything this user can, the token file and the CA "
                "key included",
                spec.id,
            )
        runs = []
        for i in range(spec.first_index, spec.first_index + spec.n):
            sid = f"{spec.id}-{i}"
            metadata = {
                **spec.metadata, "group_id": spec.id, "rollout_id": spec.id, "index": i,
                "agent": agent_label(spec.agent),
            }  # fmt: skip
            sess = self.api.open_session(sid, metadata, parse_limits(spec.limits or None))
            if spec.seed is not None:  # each agent samples its own way, the same in every run
                sess.seed = agent_seed(spec.seed, i)
            if spec.egress == EGRESS_PUBLIC:
                self.api.allow_egress(sid, public=True)
            runs.append(Run(i, sid, self.root / spec.id / str(i)))
        rollout = Rollout(spec, runs, sandbox, engine)
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
            *(run.handle.stop(graceful=True) for run in rollout.runs if run.handle is not None)
        )
        if rollout.task is not None:
            await asyncio.wait([rollout.task])

    async def shutdown(self) -> None:
        for rollout in self.all():
            if not rollout.done:
                await self.cancel(rollout)
        await self.box.close()

    # -- running -------------------------------------------------------------------------------
    async def _run_all(self, rollout: Rollout) -> None:
        if rollout.spec.task is not None:
            await build_task(rollout)
        if rollout.spec.image and rollout.image_error is None:
            await read_image(rollout, self.root / rollout.id / "image-seed")
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
            if rollout.image_error is not None:
                run.error = rollout.image_error
            elif promised:
                await run_agent(self.api, self.box, rollout, run)
            failure = None
            if not rollout.cancelled and run.error is None:
                failure = run.error = self._agent_failure(run)
            # A session someone else closed is not scored: its rows get no reward (_close).
            taken = taken_over(run, self.api.session(run.session_id))
            if rollout.cancelled:
                run.status, run.finish_reason = RunStatus.CANCELLED, FinishReason.CANCELLED
            elif (
                taken is None
                and spec.verifier is not None
                and (
                    run.error is None or (failure is not None and spec.verifier.on_error == "score")
                )
            ):
                run.status = RunStatus.SCORING
                await verify(self.box, rollout, run)
                if rollout.cancelled:
                    run.status = RunStatus.CANCELLED
        except Exception as exc:  # a defect of ours must not leave the session open
            logger.exception("agenttap: rollout %s/%d failed", rollout.id, run.index)
            run.error = f"agenttap: internal error: {exc}"
        finally:
            await forget_state(rollout, run)
            await self._keep_files(run)
            await close(self.api, run)
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
        sess = self.api.session(run.session_id)
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

    def _hidden(self) -> tuple[Path, ...]:
        config = self.api.settings
        confdir = (Path(config.confdir),) if config.confdir else ()
        return (Path(self.api.out_dir), *confdir, *config.sandbox_hide)


def agent_label(agent: object) -> str:
    """What made a rollout's rows, as its rows' metadata ``agent`` says: the agent kind
    (``claude-code``, ...), or ``command:`` and the program's name (never its arguments: the
    prompt is one)."""
    if isinstance(agent, str):
        return agent
    command = agent.get("command") if isinstance(agent, dict) else None
    program = command[0] if isinstance(command, list) and command else "?"
    return "command:" + os.path.basename(str(program))
