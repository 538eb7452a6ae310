"""One model call (a turn), from a parsed request to a recorded answer.

prepare (pick the policy server, place the call in its session's tree and build its prompt ids
off the event loop, recompute logprobs a history rewrite made stale) -> generate, whole or
streamed through the provider's writer as the tokens arrive -> record (journaled before the client
sees the end of its answer). A call the policy fails is the client's error in its provider's
format, and is journaled as failed, never trained. Nothing here routes calls or knows mitmproxy.
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from aiohttp import web

from capture.control.metrics import Metrics
from capture.control.sessions import SessionControl
from capture.pipeline.bodies import NeedsLoopback, read_body
from capture.pipeline.recording import TurnContext, TurnRecording
from capture.pipeline.recording import call_logger as call_logger  # the addon's filter uses it
from capture.pipeline.session_ids import request_session_id
from capture.policy.pools import POLICY_FAILURES, Generation, PolicyPools, policy_failure
from capture.storage.journal_sync import JournalSyncer
from capture.storage.sessions import SessionStore
from capture.trajectory import Assembly, NotInline
from rewriter.canonical import ChatRequest, RequestError
from rewriter.ids_json import ids_json
from rewriter.parsers import OutputParser
from rewriter.providers.base import Call, IncomingRequest, Provider, ProviderTurn
from rewriter.template import ChatTemplate
from rewriter.vllm_client import Completion, PolicyError

logger = logging.getLogger(__name__)

# New text (characters) an extension may add and still be assembled on the event loop: about a
# millisecond of tokenizing, against a quarter of one for the hop to a worker thread and back.
# Past it, the worker thread's tokenizer lets the loop serve other sessions meanwhile.
INLINE_ASSEMBLY_CHARS = 4096
# The openai and anthropic SDKs (and so Claude Code, Codex's SDK users, ...) count their retries
# of a request in this header; a retry's earlier answer, if never continued, is a dead branch.
RETRY_HEADER = "x-stainless-retry-count"


def is_client_retry(headers: Any) -> bool:
    value = headers.get(RETRY_HEADER, "0").strip()
    return value.isdigit() and int(value) > 0


def prompt_text_bytes(chat: ChatRequest) -> int:
    """UTF-8 bytes of the text a prompt renders verbatim: every message but the assistant's
    (those the prompt may hold as the ids the policy sampled, which a client can send back
    longer, re-serialized)."""
    verbatim = (m.content for m in chat.messages if m.role != "assistant")
    return sum(len(text.encode("utf-8", "surrogatepass")) for text in verbatim)


def session_ended_message(session_id: str, reason: str) -> str:
    """What a client refused by its session's limit is told (it reaches the agent's user)."""
    why = {
        "max_calls": "reached its limit of model calls (max_calls)",
        "max_tokens": "reached its limit of sampled tokens (max_tokens)",
        "deadline": "passed its deadline (deadline_s)",
        "closed": "was closed by the trainer",
        "stale": "started under weights too many updates old (agenttap_max_staleness)",
    }.get(reason, reason)
    return (
        f"agenttap: session {session_id!r} {why}; this rollout is over and no more calls are "
        f"answered. Do not retry."
    )


class TurnPipeline(TurnRecording):
    """Runs turns against the policy and records them in the session store."""

    def __init__(
        self,
        template: ChatTemplate,
        store: SessionStore,
        policies: PolicyPools,
        *,
        tool_parser: str,
        reasoning_parser: str,
        recompute_logprobs: bool,
        max_body_bytes: int,
        control: SessionControl | None = None,
        metrics: Metrics | None = None,
        fsync_before_reply: bool = False,
    ) -> None:
        self.template = template
        self.journal_syncer = JournalSyncer()
        self.fsync_before_reply = fsync_before_reply
        self.metrics = metrics or Metrics()
        # Running totals for the status line (capture/gateway.py).
        self.totals = {"calls": 0, "completion_tokens": 0, "errors": 0, "refused": 0}
        # Sessions' limits and metrics (capture/control/sessions.py).
        self.control = control or SessionControl()
        self.store = store
        self.policies = policies
        self.tool_parser = tool_parser
        self.reasoning_parser = reasoning_parser
        # Re-score schema-constrained completions (rewrites: the store's own switch).
        self.recompute_logprobs = recompute_logprobs
        self.max_body_bytes = max_body_bytes
        # Prompt assembly runs here, off the event loop (see assemble).
        self._render_pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="agenttap-render")
        self._session_locks: weakref.WeakValueDictionary[str, asyncio.Lock] = (
            weakref.WeakValueDictionary()
        )

    # -- the assembly workers ----------------------------------------------------------------
    async def warm_up(self) -> None:
        """Read once from the vocabulary (a fraction of a second), before any call needs it."""
        await asyncio.get_running_loop().run_in_executor(
            self._render_pool, lambda: self.template.max_token_bytes
        )

    async def shutdown(self) -> None:
        """Wait for assemblies still running in the workers (before the sessions are written)."""
        await asyncio.get_running_loop().run_in_executor(None, self._render_pool.shutdown)

    def session_lock(self, session_id: str) -> asyncio.Lock:
        """Held while a session's tree changes: an assembly in a worker thread, a record, a
        flush. First come, first served, so a session's calls are placed in arrival order."""
        lock = self._session_locks.get(session_id)
        if lock is None:
            lock = self._session_locks[session_id] = asyncio.Lock()
        return lock

    def busy_sessions(self) -> set[str]:
        """Sessions whose tree is changing now (the idle sweeper leaves them alone)."""
        return {sid for sid, lock in self._session_locks.items() if lock.locked()}

    async def assemble(self, session_id: str, chat: ChatRequest) -> Assembly:
        """Place a request in its session's tree and build its prompt ids. An extension that
        adds little text (an agent's next call, as a rule) is placed right here; anything
        larger in a worker thread: rendering and tokenizing a long prompt takes a second or
        more, and the event loop serves every other session meanwhile (the tokenizer releases
        the GIL)."""

        def inline(sid: str, request: ChatRequest) -> Assembly:
            return self.store.assemble(sid, request, inline_budget=INLINE_ASSEMBLY_CHARS)

        return await self._place(session_id, self.store.assemble, chat, inline)

    async def assemble_tokens(self, session_id: str, token_ids: list[int]) -> Assembly:
        """``assemble`` for a call made of token ids (capture/pipeline/whitebox.py)."""
        return await self._place(session_id, self.store.assemble_tokens, token_ids)

    async def _place(
        self,
        session_id: str,
        place: Callable[[str, Any], Assembly],
        request: Any,
        inline: Callable[[str, Any], Assembly] | None = None,
    ) -> Assembly:
        """``place`` in a worker thread, under the session's lock; ``inline`` first, here, if
        given (NotInline: it changed nothing, and ``place`` runs, in the same turn of the lock)."""
        async with self.session_lock(session_id):
            self.store.session(session_id)  # created here, never from a worker thread
            if inline is not None:
                try:
                    return inline(session_id, request)
                except NotInline:
                    pass
            return await asyncio.get_running_loop().run_in_executor(
                self._render_pool, place, session_id, request
            )

    # -- HTTP entry points -------------------------------------------------------------------
    async def serve_http(
        self, request: IncomingRequest, call: Call, provider: Provider[Any]
    ) -> web.StreamResponse:
        """A model call over HTTP: answered whole, or as the provider's event stream (that
        only over the loopback listener: a buffered call that streams is handed back)."""
        session_id = request_session_id(request, provider)
        started = time.time()
        try:
            parsed = provider.parse(call, await read_body(request, self.max_body_bytes), session_id)
            parsed.chat.client_retry = is_client_retry(request.headers)
        except RequestError as exc:
            return self._bad_request(provider, exc)
        if parsed.chat.stream and not isinstance(request, web.Request):
            raise NeedsLoopback("a streamed answer")
        refused = self._limit_refusal(provider, parsed)
        if refused is not None:
            return refused
        self.control.call_started(session_id)
        try:
            return await self._serve_http(request, provider, parsed, started)
        finally:
            self.control.call_finished(session_id)

    async def _serve_http(
        self,
        request: IncomingRequest,
        provider: Provider[Any],
        parsed: ProviderTurn,
        started: float,
    ) -> web.StreamResponse:
        turn = await self._prepare(provider, parsed, request.headers.get("User-Agent", ""), started)
        if isinstance(turn, web.Response):
            return turn
        parser = self._parser(turn)
        if not turn.chat.stream:
            return await self._whole(turn, parser)
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )

        assert isinstance(request, web.Request)  # serve_http handed a buffered one back

        async def send(chunk: bytes) -> None:
            if not resp.prepared:
                await resp.prepare(request)
            if chunk:
                await resp.write(chunk)

        refused = await self._stream(turn, parser, send)
        if refused is not None:
            return refused
        await resp.write_eof()
        return resp

    async def count_tokens(
        self, request: IncomingRequest, call: Call, provider: Provider[Any]
    ) -> web.Response:
        """Exactly as many tokens as the policy would be sent for this request now."""
        session_id = request_session_id(request, provider)
        try:
            chat = provider.count_tokens(
                call, await read_body(request, self.max_body_bytes), session_id
            )
            if not chat.messages:
                # Nothing to render (Gemini counts an empty request): no template takes that.
                return web.json_response(provider.count_tokens_body(0))
            assembly = await self.assemble(session_id, chat)
        except RequestError as exc:
            return provider.error(exc.status, exc.message, exc.param)
        return web.json_response(provider.count_tokens_body(len(assembly.prompt_ids)))

    async def run_turn(
        self,
        provider: Provider[Any],
        parsed: ProviderTurn,
        send: Callable[[bytes], Awaitable[None]],
        user_agent: str = "",
    ) -> web.Response | None:
        """A parsed turn streamed through ``send`` (a provider's WebSocket); see TurnRunner."""
        refused = self._limit_refusal(provider, parsed)
        if refused is not None:
            return refused
        self.control.call_started(parsed.session_id)
        try:
            turn = await self._prepare(provider, parsed, user_agent, time.time())
            if isinstance(turn, web.Response):
                return turn
            return await self._stream(turn, self._parser(turn), send)
        finally:
            self.control.call_finished(parsed.session_id)

    def _bad_request(self, provider: Provider[Any], exc: RequestError) -> web.Response:
        """A model call the client got wrong (a body the provider refuses, a shape the chat
        template refuses): counted, and answered with the provider's error."""
        self.metrics.calls.labels(provider.name, "bad_request").inc()
        self.metrics.errors.labels("bad_request").inc()
        return provider.error(exc.status, exc.message, exc.param)

    def _limit_refusal(self, provider: Provider[Any], parsed: ProviderTurn) -> web.Response | None:
        """The answer to a call its session may no longer make (a limit reached, or closed by
        the trainer): final in its client's eyes, and the policy never sees it. Else None, and
        the call's ``max_tokens`` is lowered to what is left of a token budget."""
        sid = parsed.session_id
        reason = self.control.refusal(sid)
        if reason is not None:
            logger.info("agenttap: session %r: call refused (%s)", sid, reason)
            self.totals["refused"] += 1
            self.metrics.calls.labels(provider.name, "refused").inc()
            self.metrics.errors.labels("limit").inc()
            return provider.session_ended(reason, session_ended_message(sid, reason))
        left = self.control.tokens_left(sid)
        if left is not None:
            sampling = parsed.chat.sampling
            sampling.max_tokens = min(sampling.max_tokens or left, left)
        return None

    # -- the steps ---------------------------------------------------------------------------
    async def _prepare(
        self, provider: Provider[Any], parsed: ProviderTurn, user_agent: str, started: float
    ) -> TurnContext | web.Response:
        chat = parsed.chat
        try:
            self.policies.remember_model(parsed.session_id, chat.model)
            client = self.policies.client_for(parsed.session_id, chat.model)
            info = await client.info()
            if info.max_model_len:
                # Refused before any rendering when the text alone cannot fit the context.
                at_least = self.template.min_tokens(prompt_text_bytes(chat))
                if at_least >= info.max_model_len:
                    self.metrics.errors.labels("prompt_too_long").inc()
                    return provider.prompt_too_long(at_least, info.max_model_len)
            assembly = await self.assemble(parsed.session_id, chat)
            if info.max_model_len and len(assembly.prompt_ids) >= info.max_model_len:
                self.metrics.errors.labels("prompt_too_long").inc()
                return provider.prompt_too_long(len(assembly.prompt_ids), info.max_model_len)
            await self._recompute(client, assembly)
            if chat.sampling.seed is None:  # a seeded rollout's call (POST /rollouts "seed")
                chat.sampling.seed = self.control.sampling_seed(
                    parsed.session_id, assembly.prompt_ids
                )
        except RequestError as exc:
            return self._bad_request(provider, exc)
        except PolicyError as exc:
            self.note_policy_error(provider.name, exc)
            return provider.policy_error(exc)
        self.store.touch(parsed.session_id)
        return TurnContext(
            parsed=parsed,
            provider=provider,
            client=client,
            assembly=assembly,
            policy_model=info.model,
            user_agent=user_agent,
            started=started,
            prompt_json=ids_json(assembly.prompt_ids, self.store.last_prompt(parsed.session_id)),
        )

    def _parser(self, turn: TurnContext) -> OutputParser:
        # tool_choice "none": whatever the policy writes is text, never a call the client runs.
        tool_parser = "none" if turn.chat.tool_choice == "none" else self.tool_parser
        return OutputParser(tool_parser, self.reasoning_parser)

    async def _whole(self, turn: TurnContext, parser: OutputParser) -> web.Response:
        provider = turn.provider
        try:
            async with self._generation(turn) as gen:
                completion = await turn.client.complete(
                    turn.prompt_ids,
                    turn.chat.sampling,
                    failover=gen.failover,
                    prompt_json=turn.prompt_json,
                )
        except (PolicyError, *POLICY_FAILURES) as exc:
            return self._refused_by_policy(turn, exc)
        parser.feed(completion.text)
        parser.finish()
        reply = parser.reply()
        body, reason = provider.response(turn.parsed, len(turn.prompt_ids), completion, reply)
        await self._record(turn, completion, reason, reply)
        return web.json_response(body)

    async def _stream(
        self, turn: TurnContext, parser: OutputParser, send: Callable[[bytes], Awaitable[None]]
    ) -> web.Response | None:
        """Stream one turn through ``send``; an error response when the policy refused it
        before anything was sent, else None."""
        gen = self._generation(turn)
        try:
            await gen.acquire()
        except PolicyError as exc:  # the replica's slots and queue are full
            return self._refused_by_policy(turn, exc)
        try:
            return await self._stream_on(turn, parser, send, gen)
        finally:
            await gen.release()

    async def _stream_on(
        self,
        turn: TurnContext,
        parser: OutputParser,
        send: Callable[[bytes], Awaitable[None]],
        gen: Generation,
    ) -> web.Response | None:
        provider = turn.provider
        writer = provider.stream_writer(turn.parsed, len(turn.prompt_ids))
        completion = Completion()
        deltas = turn.client.stream_resuming(
            turn.prompt_ids, turn.chat.sampling, failover=gen.failover, prompt_json=turn.prompt_json
        )
        try:
            # The first piece comes before any byte is sent, so a refusal is a proper error.
            first = await anext(deltas, None)
        except (PolicyError, *POLICY_FAILURES) as exc:
            return self._refused_by_policy(turn, exc)
        self.metrics.first_token.labels(provider.name).observe(time.time() - turn.started)
        # Events not sent yet: the pieces the policy sent in one read go out in one write.
        pending = [writer.start()]
        delta = first
        while delta is not None:
            completion.extend(delta)
            pending.append(writer.events(parser.feed(delta.text)))
            if not delta.more:
                await send(b"".join(pending))
                pending.clear()
            try:
                # Only the policy's part is caught here: a client that left makes ``send``
                # fail (or cancels this handler), which is no failure of the policy's.
                delta = await anext(deltas, None)
            except (PolicyError, *POLICY_FAILURES) as exc:
                # Mid-stream the status line is gone: the provider's error event ends it.
                error = exc if isinstance(exc, PolicyError) else policy_failure(turn.client, exc)
                self._record_failure(turn, error, len(completion.token_ids))
                await send(b"".join(pending) + writer.error(str(error)))
                return None
        tail = writer.events(parser.finish())
        reply = parser.reply()
        closing, reason = writer.finish(completion, reply)
        await send(b"".join(pending) + tail + closing)
        # Journaled before the client sees the end of the response.
        await self._record(turn, completion, reason, reply)
        await send(writer.end())
        return None

    def _generation(self, turn: TurnContext) -> Generation:
        """The call's generation slot on its replica (capture/policy/pools.py ``generation``)."""
        return self.policies.generation(turn.parsed.session_id, turn.chat.model, turn.client)

    def _refused_by_policy(self, turn: TurnContext, exc: BaseException) -> web.Response:
        """The policy failed before anything was sent: the call is recorded as failed and the
        client gets its provider's error."""
        error = exc if isinstance(exc, PolicyError) else policy_failure(turn.client, exc)
        self._record_failure(turn, error, 0)
        return turn.provider.policy_error(error)
