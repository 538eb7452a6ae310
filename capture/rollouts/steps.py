"""The two steps of one rollout run, each in a box of its own (capture/isolation/box.py): the
agent (``run_agent``: its workdir copy on a size-capped disk, its fresh HOME and configuration,
its session's environment) and the verifier (``verify``: on the seed plus the agent's kept files,
or on the agent's copy with the seed's ``restore`` paths put back; the reward from
capture/rollouts/scoring.py)."""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from dataclasses import replace
from pathlib import Path

from capture.control.sessions import EndReason
from capture.isolation.box import Box, BoxSpec, Ended
from capture.isolation.containers import ContainerPlan
from capture.isolation.limits import limit_words
from capture.isolation.workdir import UnsafeWorkdir, copy_seed, restore, sanitize
from capture.logs.escape import printable
from capture.ports import RolloutHost
from capture.rollouts.agents import config_home, prepare_home
from capture.rollouts.images import after_agent, agent_plan, copy_tree, verifier_plan
from capture.rollouts.runs import OUTPUT_KEPT, Rollout, Run, RunStatus, plain_env, tail
from capture.rollouts.scoring import HARBOR_LOGS, graded_folder, score, verifier_command

logger = logging.getLogger(__name__)

VERIFIER_TIMEOUT_S = 300.0
# How often a running agent's session is checked for a limit it went past.
LIMIT_POLL_S = 0.2
# The verifier's output read back for its last line.
VERIFIER_TAIL = 65536


async def run_agent(host: RolloutHost, box: Box, rollout: Rollout, run: Run) -> None:
    """Run the rollout's agent for ``run`` until it ends, its timeout or a limit; what went
    wrong is the run's ``error`` (and ``limit``)."""
    spec = rollout.spec
    run.folder.mkdir(parents=True, exist_ok=True)
    # The disk limit: work/, home/ and tmp/ on a tmpfs of that size (a plain folder where
    # this process may not mount one: see capture/isolation/host.py mechanism()).
    run.quota = await asyncio.to_thread(box.disk, run.folder / "box", spec.sandbox_limits.disk_mb)
    run.base = base = run.quota.path
    work, home, tmp = base / "work", base / "home", base / "tmp"
    if spec.image is not None:
        # The image's working folder, on the run's size-capped disk (its "disk_mb").
        assert rollout.image_seed is not None
        try:
            await asyncio.to_thread(copy_tree, rollout.image_seed, work)
        except OSError as exc:
            run.error = str(exc)
            return
    elif spec.workdir is not None:
        try:
            await asyncio.to_thread(copy_seed, spec.workdir, work)
        except UnsafeWorkdir as exc:  # the seed changed since the request was checked
            run.error = str(exc)
            return
    if not work.exists():
        work.mkdir()
    for folder in (home, tmp):
        folder.mkdir()
    folders_env = await asyncio.to_thread(config_home, spec.agent, home)
    await asyncio.to_thread(prepare_home, spec.agent, home)  # its config, into its HOME
    await asyncio.to_thread(rollout.engine.hand_over, work, home, tmp)
    # Built whole, never from os.environ: the proxy's environment may hold the token.
    env = {
        **plain_env(home, tmp),
        **folders_env,
        **session_env(host, rollout, run),
        **spec.agent_env,
        "AGENTTAP_ROLLOUT": rollout.id,
    }
    log = run.folder / "agent.log"
    if rollout.cancelled:
        return
    run.status = RunStatus.RUNNING
    plan = agent_plan(rollout, work) if spec.image is not None else None
    watcher = asyncio.create_task(stop_past_limits(host, run))
    try:
        ended = await supervised(
            box, rollout, run, "agent", spec.command, env, (work, home, tmp), log, spec.timeout_s,
            container=plan,
        )  # fmt: skip
    except (OSError, ValueError) as exc:
        run.error = f"the agent could not start: {exc}"
        return
    finally:
        watcher.cancel()
        if plan is not None:  # its state kept for the verifier
            await after_agent(rollout, run)
        await asyncio.to_thread(shutil.rmtree, tmp, True)
        run.agent_output = tail(log)
    if ended.timed_out:
        run.error = f"the agent ran past its timeout ({spec.timeout_s:g} s) and was stopped"
    elif ended.limit is not None:
        run.limit = ended.limit
        run.error = limit_words("agent", ended.limit, spec.sandbox_limits)
    elif not ended.gone:
        run.error = "agenttap: the agent's processes did not end; it is not scored"


async def supervised(
    box: Box,
    rollout: Rollout,
    run: Run,
    role: str,
    command: list[str],
    env: dict[str, str],
    folders: tuple[Path, Path, Path],
    log: Path,
    timeout_s: float,
    stderr_log: Path | None = None,
    container: ContainerPlan | None = None,
) -> Ended:
    """Run ``command`` (the agent or the verifier) in a box of the rollout's engine under the
    kernel's limits (its output kept to ``output_mb`` in ``log``, its stderr apart in
    ``stderr_log`` when given) until it ends, runs past ``timeout_s``, goes past a limit or
    the rollout is cancelled; then every process of it is ended. The agent reaches the proxy
    and the API through its session's bridge; the verifier has no network."""
    spec = BoxSpec(
        name=f"{rollout.id}-{run.index}-{role}",
        engine=rollout.engine,
        command=command,
        env=env,
        folders=folders,
        limits=rollout.spec.sandbox_limits,
        log=log,
        stderr_log=stderr_log,
        session_id=run.session_id if role == "agent" else None,
        expose=rollout.spec.expose,
        quota=run.quota,
        container=container,
    )
    run.handle = handle = await box.start(spec, label=f"rollout {rollout.id}")
    ended = await handle.wait(timeout_s, lambda: rollout.cancelled)
    if role == "agent":
        run.exit_code = ended.exit_code
    run.usage[role] = ended.usage
    if ended.bridge is not None:
        run.usage["bridge"] = ended.bridge
    return ended


async def stop_past_limits(host: RolloutHost, run: Run, poll_s: float = LIMIT_POLL_S) -> None:
    """Stop the agent as soon as its session is past a limit: a call refused past
    ``max_calls`` or ``max_tokens`` (the agent has acted on every answer it was given), or
    ``deadline_s`` passed. An agent left running would retry refused calls until its timeout.
    The run then ends as the limit says (``finish_reason`` ``max_calls`` ...), scored as its
    verifier's ``on_error`` says."""
    while True:
        await asyncio.sleep(poll_s)
        sess = host.session(run.session_id)
        if sess is None or run.handle is None:
            continue
        if sess.past_deadline(time.monotonic()):
            sess.limit_reached = sess.limit_reached or EndReason.DEADLINE
        if sess.limit_reached is not None:
            logger.info(
                "agenttap: rollout session %s reached its %s: its agent is stopped",
                run.session_id, sess.limit_reached,
            )  # fmt: skip
            await run.handle.stop(graceful=True)
            return


def session_env(host: RolloutHost, rollout: Rollout, run: Run) -> dict[str, str]:
    """The session's environment for its agent (proxy, CA, its secret as the keys), its URLs
    as the rollout's engine reaches them (inside a sandbox: 127.0.0.1, where the forwarder
    listens)."""
    sess = host.session(run.session_id)
    ends, url = host.endpoints, rollout.engine.url
    ends = replace(
        ends, api_url=url(ends.api_url), proxy_url=url(ends.proxy_url) if ends.proxy_url else ""
    )
    return ends.env(run.session_id, sess.secret if sess is not None else "")


async def verify(box: Box, rollout: Rollout, run: Run) -> None:
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
    timeout_s = verifier.timeout_s or VERIFIER_TIMEOUT_S
    base = run.base or run.folder
    work = base / "work"
    home, tmp = base / "verifier-home", base / "verifier-tmp"
    seed = rollout.image_seed if spec.image is not None else spec.workdir
    try:
        graded = await asyncio.to_thread(graded_folder, verifier, seed, work, base / "graded")
        if graded is None and verifier.restore and spec.workdir is not None and not spec.image:
            await asyncio.to_thread(restore, spec.workdir, work, verifier.restore)
    except (UnsafeWorkdir, OSError) as exc:
        run.error = f"the verifier's files could not be made ready: {exc}"
        return
    if graded is not None:
        run.graded = graded.summary()
        work = base / "graded"
    elif spec.image is None:
        # What the agent left to trip the verifier (a link out of the workdir, a FIFO that
        # blocks a read) goes before it runs. (In an image its links resolve in its container.)
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
        if verifier.harbor:  # Harbor's /logs/verifier, fresh (made before it is handed over)
            (tmp / HARBOR_LOGS).mkdir()
        await asyncio.to_thread(rollout.engine.hand_over, work, home, tmp)
        plan = None
        if spec.image is not None:
            logs = tmp / HARBOR_LOGS if verifier.harbor else None
            plan = verifier_plan(rollout, run, work, graded is not None, logs)
        env = {
            **plain_env(home, tmp),
            "PYTHONSAFEPATH": "1",
            "AGENTTAP_SESSION": run.session_id,
            **extra,
        }
        log, errors = run.folder / "verifier.log", run.folder / "verifier-stderr.log"
        ended = await supervised(
            box, rollout, run, "verifier", command, env, (work, home, tmp), log,
            timeout_s, stderr_log=errors, container=plan,
        )  # fmt: skip
        stdout = tail(log, VERIFIER_TAIL)  # read for the reward: its stderr never is
        run.verifier_output = stdout[-OUTPUT_KEPT:]
        run.verifier_stderr = tail(errors)
        if ended.timed_out:
            run.error = f"the verifier ran past {timeout_s:g} s and was stopped"
        elif ended.limit is not None:
            run.limit = ended.limit
            run.error = limit_words("verifier", ended.limit, spec.sandbox_limits)
        if ended.timed_out or ended.limit is not None or rollout.cancelled:
            return  # stopped: its output is no score
        scored = await asyncio.to_thread(score, verifier, ended.exit_code, stdout, tmp)
    except (OSError, ValueError) as exc:
        run.error = f"the verifier could not start: {exc}"
        return
    finally:
        await asyncio.to_thread(shutil.rmtree, tmp, True)
    run.tests, run.rewards = scored.tests, scored.rewards
    if scored.error is not None:
        run.error = scored.error
        return
    run.reward = scored.reward
