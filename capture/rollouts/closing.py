"""How a rollout's run ends: its session closed with the verifier's reward (``close``), its
rows saying how it finished; or, where someone other than the runner closed that session first
(``taken_over``), the run ends ``error`` and every reward its rows were given is taken back."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from capture.control.sessions import EndReason
from capture.ports import REWARD_VERIFIER, RolloutHost
from capture.rollouts.runs import FinishReason, Run, RunStatus

logger = logging.getLogger(__name__)


async def close(host: RolloutHost, run: Run) -> None:
    """Close the run's session with its reward (the verifier's: the rows' ``reward_source``
    says so); the rows say how it finished. A session someone else closed (and so could
    reward) before this runner did ends the run ``error``, its rows without a reward."""
    host.allow_egress(run.session_id, public=False)
    sess = host.session(run.session_id)
    taken = taken_over(run, sess)
    if taken is not None:
        await _close_taken_over(host, run, taken)
        return
    limit = sess.limit_reached if sess is not None else None
    # A finish reason of its own, else its session's end reason (a limit it reached, or stop).
    reason: str
    if run.status == RunStatus.CANCELLED:
        reason = FinishReason.CANCELLED
    elif run.limit is not None:
        run.status, reason = RunStatus.ERROR, FinishReason.LIMIT
    elif run.error is not None:
        run.status, reason = RunStatus.ERROR, FinishReason.ERROR
    else:
        run.status, reason = RunStatus.OK, limit or EndReason.STOP
    run.finish_reason = reason
    closed = await host.close_session(
        run.session_id, run.reward, end_reason=reason, reward_source=REWARD_VERIFIER
    )
    if closed is not None:
        sess, rows, _ = closed
        run.metrics = sess.metrics.as_dict()
        run.rows = rows


async def _close_taken_over(host: RolloutHost, run: Run, why: str) -> None:
    """The run's session was closed (and maybe rewarded) by a caller of the control API, not
    by this runner: the run ends ``error`` saying so, and every reward its rows were given
    is taken back (the verifier's is not given: its session's calls are not the run's to
    vouch for)."""
    sid = run.session_id
    if host.is_live(sid):  # opened again by that caller: ended too
        await host.close_session(sid, None, end_reason=FinishReason.ERROR)
    sess = host.session(sid)
    # Shards written since the run began (a second's margin for the file times).
    since = time.time() - (time.monotonic() - run.started_at) - 1.0
    run.rows = await asyncio.to_thread(host.take_back_rewards, sid, since)
    run.metrics = sess.metrics.as_dict() if sess is not None else {}
    verifier = f" (the verifier's was {run.reward:g})" if run.reward is not None else ""
    run.status, run.finish_reason, run.reward = RunStatus.ERROR, FinishReason.ERROR, None
    run.error = (
        f"agenttap: {why}, before the rollout's verifier ran; its rows carry no reward"
        f"{verifier}. Only agenttap closes a rollout's session: whoever did holds the "
        f"control API's token (an agent that read it?)"
    )
    logger.warning("agenttap: rollout session %r: %s", sid, run.error)


def taken_over(run: Run, sess: Any) -> str | None:
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
