"""A turn's record step, and the calls' log lines: ``TurnRecording``, the part of
``TurnPipeline`` (capture/pipeline/turn.py) that journals a call answered (``_record``, a
schema-constrained completion re-scored first) or failed (``_record_failure``), recomputes
logprobs a history rewrite made stale, and counts both in the metrics.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from typing import Any

from capture.control.metrics import Metrics
from capture.control.sessions import SessionControl
from capture.logs.escape import printable
from capture.storage.journal_sync import JournalSyncer
from capture.storage.records import FailedCall, TurnRecord
from capture.storage.sessions import SessionStore
from capture.trajectory import Assembly
from rewriter.canonical import AssistantReply, ChatRequest
from rewriter.providers.base import Provider, ProviderTurn
from rewriter.vllm_client import Completion, PolicyError, VLLMClient

logger = logging.getLogger(__name__)
# The one line per call (``agenttap call:``, ``agenttap call failed:``): a logger of its own, so
# the proxy can spare it work no one asks for (addons/capture.py, skip_legacy_log_events). Its
# name is the turn's (docs/RUNNING.md).
call_logger = logging.getLogger("capture.pipeline.turn.calls")


def log_field(value: str) -> str:
    """A client-chosen value (a session name, a request id) as one word of a log line: as it is
    when it is plain, else JSON-quoted (no space, newline or control character gets through)."""
    if value and value.isprintable() and not any(c.isspace() or c == '"' for c in value):
        return value
    return json.dumps(value)


def call_line(record: TurnRecord) -> str:
    """The one log line of a recorded call (``agenttap call: ...``)."""
    return (
        f"agenttap call: session={log_field(record.session_id)} {record.protocol} "
        f"{log_field(record.request_id)} {len(record.prompt_ids)}+{len(record.completion_ids)} "
        f"tokens {log_field(record.finish_reason or '?')} "
        f"{record.latency_s:.2f} s via {record.backend}"
    )


def failed_line(failed: FailedCall) -> str:
    """The one log line of a call the policy failed (``agenttap call failed: ...``)."""
    return (
        f"agenttap call failed: session={log_field(failed.session_id)} {failed.protocol} "
        f"{log_field(failed.request_id)} {failed.prompt_tokens}+{failed.completion_tokens} "
        f"tokens after {failed.failed_at - failed.started_at:.2f} s via {failed.backend}: "
        f"{printable(failed.reason)}"
    )


@dataclass
class TurnContext:
    """A prepared turn: everything generating and recording it needs."""

    parsed: ProviderTurn
    provider: Provider[Any]
    client: VLLMClient
    assembly: Assembly
    policy_model: str
    user_agent: str
    started: float
    # prompt_ids as JSON text, built from the session's previous prompt's (rewriter/ids_json.py).
    prompt_json: str
    # The weights that re-scored a schema-constrained completion (None: not re-scored).
    rescore_version: str | None = None

    @property
    def chat(self) -> ChatRequest:
        return self.parsed.chat

    @property
    def prompt_ids(self) -> list[int]:
        return self.assembly.prompt_ids


class TurnRecording:
    """The record step of ``TurnPipeline``, which sets these in its ``__init__``."""

    store: SessionStore
    control: SessionControl
    metrics: Metrics
    # Running totals for the status line (capture/gateway.py).
    totals: dict[str, int]
    journal_syncer: JournalSyncer
    fsync_before_reply: bool
    recompute_logprobs: bool

    def session_lock(self, session_id: str) -> asyncio.Lock:
        raise NotImplementedError  # TurnPipeline's

    def note_recorded(self, record: TurnRecord) -> None:
        """Metrics and the log line of a call answered and recorded."""
        call_logger.info("%s", call_line(record))
        m, protocol = self.metrics, record.protocol
        self.totals["calls"] += 1
        self.totals["completion_tokens"] += len(record.completion_ids)
        m.calls.labels(protocol, "ok").inc()
        m.prompt_tokens.labels(protocol).inc(len(record.prompt_ids))
        m.completion_tokens.labels(protocol).inc(len(record.completion_ids))
        m.latency.labels(protocol).observe(record.latency_s)
        m.policy_up.labels(record.backend).set(1)

    def note_policy_error(self, protocol: str, exc: PolicyError, backend: str = "") -> None:
        """Metrics of a call the policy refused or failed."""
        self.totals["errors"] += 1
        self.metrics.calls.labels(protocol, "policy_error").inc()
        self.metrics.errors.labels(
            "policy_unavailable" if exc.unavailable else "policy_failed"
        ).inc()
        if backend and exc.unavailable:
            self.metrics.policy_up.labels(backend).set(0)

    def _record_failure(self, turn: TurnContext, error: PolicyError, streamed: int) -> None:
        """Journal a call the policy failed (see FailedCall); its tokens are never trained."""
        parsed = turn.parsed
        failed = FailedCall(
            session_id=parsed.session_id,
            request_id=parsed.response_id,
            protocol=turn.provider.name,
            requested_model=turn.chat.model,
            policy_model=turn.policy_model,
            backend=turn.client.base_url,
            user_agent=turn.user_agent,
            stream=turn.chat.stream,
            reason=str(error),
            policy_status=error.status,
            prompt_tokens=len(turn.prompt_ids),
            completion_tokens=streamed,
            started_at=turn.started,
            failed_at=time.time(),
        )
        call_logger.warning("%s", failed_line(failed))
        self.control.note_failure(parsed.session_id)
        self.note_policy_error(turn.provider.name, error, turn.client.base_url)
        try:
            self.store.record_failure(failed)
        except OSError:
            # A full disk must not turn the client's error into a hang or a 500.
            logger.exception("could not journal a failed call")

    async def _recompute(self, client: VLLMClient, assembly: Assembly) -> None:
        """Re-score policy tokens whose context changed, on the sequence the policy now sees."""
        positions = assembly.needs_recompute()
        if not positions:
            return
        # Paused during an update, a re-score runs on the incoming weights: its label.
        version = client.sampling_version()
        scores = await client.prompt_logprobs(assembly.prompt_ids[: positions[-1] + 1])
        assembly.recompute_version = version
        for pos in positions:
            value = scores[pos]
            assert value is not None  # position 0 is never a policy token
            assembly.suffix_logprobs[pos - assembly.base] = value
        logger.info("recomputed %d logprobs after a history rewrite", len(positions))

    async def _rescore_constrained(
        self, turn: TurnContext, completion: Completion
    ) -> list[float] | None:
        """The policy's own logprobs of a completion sampled under a JSON schema: vLLM reports
        the constrained distribution's, which no trainer would compute. None: not re-scored
        (recompute switched off, or the policy refused), and the tokens are masked."""
        if not self.recompute_logprobs or not completion.token_ids:
            return None
        turn.rescore_version = turn.client.sampling_version()
        try:
            scores = await turn.client.prompt_logprobs(
                list(turn.prompt_ids) + list(completion.token_ids)
            )
        except PolicyError as exc:
            logger.warning("could not re-score a schema-constrained completion: %s", exc)
            return None
        return [float(x) if x is not None else 0.0 for x in scores[len(turn.prompt_ids) :]]

    async def _record(
        self, turn: TurnContext, completion: Completion, reason: str, reply: AssistantReply
    ) -> TurnRecord:
        constrained = turn.chat.sampling.json_schema is not None
        rescored = await self._rescore_constrained(turn, completion) if constrained else None
        parsed = turn.parsed
        record = TurnRecord(
            session_id=parsed.session_id,
            request_id=parsed.response_id,
            turn_index=-1,  # numbered under the session's lock, below
            protocol=turn.provider.name,
            requested_model=turn.chat.model,
            policy_model=turn.policy_model,
            # The server that finished the generation (failover: the last of its spans).
            backend=completion.backends[-1][0] if completion.backends else turn.client.base_url,
            user_agent=turn.user_agent,
            prompt_ids=list(turn.prompt_ids),
            completion_ids=completion.token_ids,
            completion_logprobs=completion.logprobs,
            completion_text=completion.text,
            finish_reason=completion.finish_reason or "",
            response_finish_reason=reason,
            started_at=turn.started,
            latency_s=time.time() - turn.started,
            stream=turn.chat.stream,
            weight_versions=[
                {"version": v, "start": start, "end": end}
                for v, start, end in completion.weight_versions
            ],
        )
        if len(completion.backends) > 1:
            # A replica failed mid-generation: which server sampled which completion tokens.
            record.metadata["backends"] = [
                {"backend": b, "start": start, "end": end} for b, start, end in completion.backends
            ]
        async with self.session_lock(parsed.session_id):
            # Numbered here: a flush or another call's record while this one waited for the lock
            # would otherwise leave two calls of the session with one turn index.
            record.turn_index = self.store.next_turn_index(parsed.session_id)
            journal = self.store.record(
                record,
                turn.assembly,
                turn.provider.recorded_reply(parsed, reply),
                rescored=rescored,
                constrained=constrained,
                durable=False,
                rescored_version=turn.rescore_version,
                prompt_json=turn.prompt_json,
            )
        # Written before the client sees the end of its answer (a crash of this process loses
        # nothing). The fsync, a millisecond or more on a disk, runs in a worker thread, batched;
        # the answer waits for it only with agenttap_journal_fsync=before_reply.
        synced = self.journal_syncer.request(journal)
        if self.fsync_before_reply:
            # Shielded: other turns of this journal share the fsync; a cancelled reply must
            # not cancel theirs.
            await asyncio.shield(synced)
        self.control.note_recorded(
            parsed.session_id,
            len(record.prompt_ids),
            len(record.completion_ids),
            record.latency_s,
            retry=turn.assembly.kind == "retry",
        )
        self.note_recorded(record)
        turn.provider.finished(parsed, reply, completion)
        return record
