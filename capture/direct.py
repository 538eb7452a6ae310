"""A streamed turn whose generation mitmproxy itself requests and relays
(``agenttap_stream_path=direct``).

Over the loopback listener (the default), a streamed call's tokens make two trips through this
process: vLLM -> the gateway's HTTP client -> the gateway's HTTP server -> mitmproxy -> the
client. Here the call's request is turned into its generation's request, mitmproxy sends it to
the policy server itself, and each chunk mitmproxy reads is rewritten into the provider's events
on its way to the client (``feed``, mitmproxy's ``flow.response.stream``): one read and one write
per chunk, as plain forwarding does.

The price: a generation here is one HTTP exchange, so nothing can be stitched onto it. A server
that aborts it (a pause, a weight sync), fails mid-stream or stalls ends the client's answer with
its provider's error event (or a cut connection) instead of resuming, on the same server or
another; the call is journaled as failed, never trained. Everything else (placement, prompt ids,
recording, the events the client gets) is the loopback path's own code.
"""

from __future__ import annotations

import logging
import time
import urllib.parse
from typing import TYPE_CHECKING

from rewriter.vllm_client import Completion, PolicyError, StreamPieces, policy_refusal

if TYPE_CHECKING:
    from aiohttp import web

    from capture.pipeline import TurnPipeline, _TurnContext
    from capture.policies import Generation
    from rewriter.canonical import AssistantReply
    from rewriter.parsers import OutputParser

logger = logging.getLogger(__name__)

# The answer's head: what the loopback listener sends for a stream (aiohttp adds its own Date).
STREAM_HEADERS = (
    ("Content-Type", "text/event-stream"),
    ("Cache-Control", "no-cache"),
    ("Transfer-Encoding", "chunked"),
)


class DirectStream:
    """One streamed turn from its generation's request to its record. The proxy glue sends
    ``body`` to ``url``; hands the answer's bytes to ``feed`` as they come when its status is
    200 (``refused`` when not); and calls ``close`` once the exchange is over, however it
    ended. Holds the turn's slot on its replica until then."""

    def __init__(
        self,
        pipeline: TurnPipeline,
        turn: _TurnContext,
        parser: OutputParser,
        generation: Generation,
        url: str,
        body: bytes,
        pieces: StreamPieces,
    ) -> None:
        self.url = url
        self.body = body
        parts = urllib.parse.urlsplit(url)
        self.scheme = parts.scheme
        self.host = parts.hostname or ""
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.path = parts.path + (f"?{parts.query}" if parts.query else "")
        self._pipeline = pipeline
        self._turn = turn
        self._parser = parser
        self._generation = generation
        self._pieces = pieces
        self._writer = turn.provider.stream_writer(turn.parsed, len(turn.prompt_ids))
        self._completion = Completion()
        self._started = False  # the writer's first events sent
        self._ended = False  # its last sent (the end, or an error), or a refusal answered
        # A finished turn whose session's tree was busy when it ended: recorded in close().
        self._unrecorded: tuple[str, AssistantReply] | None = None
        self._closed = False

    @property
    def session_id(self) -> str:
        return self._turn.parsed.session_id

    def feed(self, data: bytes) -> list[bytes]:
        """The provider's events for the next bytes of the policy's answer (b"": it ended), as
        the chunks mitmproxy sends on (none, or one)."""
        if self._ended:
            return []
        out: list[bytes] = []
        if not self._started:
            self._started = True
            out.append(self._writer.start())
        batch, error = self._pieces.feed(data)
        for delta in batch:
            if not self._completion.token_ids and delta.token_ids:
                self._pipeline.metrics.first_token.labels(self._turn.provider.name).observe(
                    time.time() - self._turn.started
                )
            if delta.finish_reason == "abort":
                error = PolicyError(
                    f"the policy server at {self._pieces.base_url} aborted the generation (a "
                    "pause or a weight sync); with agenttap_stream_path=direct it is not "
                    "resumed. Retry the call."
                )
                break
            self._completion.extend(delta)
            out.append(self._writer.events(self._parser.feed(delta.text)))
        if error is None and not data and not self._pieces.finished:
            error = self._pieces.ended_early()
        if error is not None:
            out.append(self._fail(error))
        elif self._pieces.done or (not data and self._pieces.finished):
            out.append(self._finish())
        payload = b"".join(out)
        # Nothing to send is no chunk at all: an empty one would end a chunked body.
        return [payload] if payload else []

    def refused(self, status: int, body: bytes) -> web.Response:
        """The provider's error for a policy server that answered ``status`` instead of a
        stream (its body, whole, given); journaled as a failed call."""
        self._ended = True
        error = policy_refusal(status, body.decode("utf-8", "replace"))
        return self._pipeline._refused_by_policy(self._turn, error)

    async def close(self, error: str | None = None) -> None:
        """The exchange is over (``error``: how it broke off, if it did). Records a finished
        turn that could not be recorded in ``feed``, journals one that never finished as
        failed, and gives the slot back. Called once per stream; later calls do nothing."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._unrecorded is not None:
                reason, reply = self._unrecorded
                self._unrecorded = None
                await self._pipeline._record(self._turn, self._completion, reason, reply)
            elif not self._ended:
                self._ended = True
                why = error or "the exchange with the policy server ended early"
                self._pipeline._record_failure(
                    self._turn,
                    PolicyError(f"the policy server's stream broke off: {why}"),
                    len(self._completion.token_ids),
                )
        finally:
            await self._generation.release()
            self._pipeline.control.call_finished(self.session_id)

    def _finish(self) -> bytes:
        self._ended = True
        tail = self._writer.events(self._parser.finish())
        reply = self._parser.reply()
        closing, reason = self._writer.finish(self._completion, reply)
        # Journaled before the answer's last event goes out, as over the loopback; where the
        # session's tree is busy (an assembly of it in a worker thread), in close(), which
        # mitmproxy runs before the answer's end of message.
        if not self._pipeline.record_now(self._turn, self._completion, reason, reply):
            self._unrecorded = (reason, reply)
        return tail + closing + self._writer.end()

    def _fail(self, error: PolicyError) -> bytes:
        # Mid-stream the status line is gone: the provider's error event ends it.
        self._ended = True
        self._pipeline._record_failure(self._turn, error, len(self._completion.token_ids))
        return self._writer.error(str(error))
