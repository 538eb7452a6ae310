"""The gateway: a loopback HTTP server that answers intercepted API calls from the policy.

mitmproxy cannot stream a body an addon builds itself, so the addon points each intercepted flow
at this server (running in mitmproxy's own event loop) and lets mitmproxy stream its answer back
to the client. Here the registry's providers (``capture/providers``) say who answers a call; a
model call is translated by its provider to the canonical chat form, rendered to token ids,
completed by vLLM token-in/token-out, parsed, answered in the provider's format as the tokens
arrive, and recorded. Nothing here knows about mitmproxy or any one provider.
"""

from __future__ import annotations

import asyncio
import fnmatch
import logging
import secrets
import time
import urllib.parse
import weakref
import zlib
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError

from capture.options import parse_model_map  # noqa: F401 (its home before options.py)
from capture.providers import registered
from capture.providers.base import (
    MALFORMED,
    Call,
    Provider,
    ProviderTurn,
    Route,
    RouteKind,
    malformed_message,
)
from capture.records import FailedCall, TurnRecord
from capture.sessions import SessionStore, safe_text
from capture.trajectory import Assembly
from rewriter.canonical import AssistantReply, ChatRequest, RequestError
from rewriter.parsers import OutputParser
from rewriter.template import ChatTemplate
from rewriter.vllm_client import Completion, PolicyError, VLLMClient

logger = logging.getLogger(__name__)

TOKEN_HEADER = "X-Agenttap-Token"
SESSION_HEADER = "X-Agenttap-Session"
HOST_HEADER = "X-Agenttap-Host"
# Answers calls on hosts no provider owns (its error format, its 404).
DEFAULT_PROVIDER = "openai.chat"


# The client's Content-Encoding, moved here by the addon so that the gateway decodes the body.
UNSUPPORTED_ENCODING_HEADER = "X-Agenttap-Content-Encoding"

# Request heads (request target and header fields) the proxy passes on. The providers' own front
# ends take tens of kB of headers, so a client sending that much is served; past these limits the
# addon passes the gateway only what framing needs (``shrink_head``) and marks the request with
# OVERSIZED_HEADER, and the client gets its provider's 431 instead of aiohttp's text/plain 400.
MAX_HEAD_BYTES = 256 * 1024
MAX_HEAD_FIELDS = 512
OVERSIZED_HEADER = "X-Agenttap-Oversized-Head"
# What the gateway's HTTP parser reads: the limits above plus the headers the addon adds.
_PARSER_HEAD_BYTES = MAX_HEAD_BYTES + 16 * 1024
_PARSER_HEAD_FIELDS = MAX_HEAD_FIELDS + 16
# Fields an oversized request keeps on its way to the gateway (HTTP framing and the WebSocket
# handshake), when short.
_FRAMING = frozenset(
    {
        b"host",
        b"content-length",
        b"transfer-encoding",
        b"content-type",
        b"connection",
        b"upgrade",
        b"sec-websocket-key",
        b"sec-websocket-version",
    }
)


def shrink_head(
    target: str, fields: list[tuple[bytes, bytes]]
) -> tuple[str, list[tuple[bytes, bytes]], str] | None:
    """None when a request head (its target, its header fields) is within the limits; else the
    target and fields to pass on instead, and what was too large (for the client's error)."""
    size = len(target) + sum(len(name) + len(value) + 4 for name, value in fields)
    if size <= MAX_HEAD_BYTES and len(fields) <= MAX_HEAD_FIELDS:
        return None
    note = f"{size} bytes in {len(fields)} header fields"
    kept = [(n, v) for n, v in fields if n.lower() in _FRAMING and len(v) <= 1024]
    # The path alone still routes the call (whose provider words the error); the query goes.
    return target.split("?", 1)[0][:8192], kept, note


def _malformed(provider: Provider[Any], exc: BaseException) -> web.Response:
    """A request no check refused but that could not be read: the client's error (400 in the
    provider's shape), never a text/plain 500. Its traceback is logged at debug level."""
    # The client's mistake, not ours: one line; the traceback only at debug level.
    logger.warning("refused a request that could not be read: %r", exc)
    logger.debug("where it could not be read", exc_info=exc)
    return provider.error(400, malformed_message(exc), None)


def quote_session(session_id: str) -> str:
    """A proxy username as a header value: control characters (CR, LF, NUL) %-escaped, since a
    header cannot carry them; ``unquote_session`` gives the name back."""
    return "".join(
        f"%{ord(c):02X}" if ord(c) < 32 or ord(c) == 127 or c == "%" else c for c in session_id
    )


def unquote_session(value: str) -> str:
    return urllib.parse.unquote(value)


# The openai and anthropic SDKs (and so Claude Code, Codex's SDK users, ...) count their retries
# of a request in this header; a retry's earlier answer, if never continued, is a dead branch.
RETRY_HEADER = "x-stainless-retry-count"


def is_client_retry(headers: Any) -> bool:
    value = headers.get(RETRY_HEADER, "0").strip()
    return value.isdigit() and int(value) > 0


@dataclass
class GatewayConfig:
    policy_urls: list[str]
    tokenizer_path: Path
    out_dir: Path
    tool_parser: str = "hermes"
    reasoning_parser: str = "qwen3"
    idle_timeout_s: float = 300.0
    max_body_bytes: int = 8 * 1024 * 1024
    sweep_interval_s: float = 5.0
    # Re-score policy tokens whose context a scaffold rewrote, and schema-constrained samples
    # (vLLM prompt_logprobs); off: such tokens are masked out of the loss instead. Option
    # agenttap_recompute_mismatch_logprobs.
    recompute_logprobs: bool = True
    # (pattern, servers): requested model names -> policy servers; see parse_model_map.
    model_map: list[tuple[str, list[str]]] = field(default_factory=list)
    # Extra names GET /v1/models lists (every name is served).
    model_names: list[str] = field(default_factory=list)
    # Provider option values by option name (see ProviderOption); missing ones take defaults.
    provider_options: dict[str, Any] = field(default_factory=dict)
    # Registry names of the providers to serve, in the order they are asked; empty: all.
    providers: list[str] = field(default_factory=list)
    # Longest wait for the policy's next byte; then the client gets its provider's retryable
    # error (OpenAI 503, Anthropic 529) instead of hanging until its own timeout.
    policy_timeout_s: float = 300.0
    # Concurrent policy requests (HTTP connections); a streaming session holds one per call.
    policy_max_connections: int = 1024
    extra: dict[str, Any] = field(default_factory=dict)


class Gateway:
    def __init__(self, config: GatewayConfig, template: ChatTemplate | None = None) -> None:
        self.config = config
        self.template = template or ChatTemplate(config.tokenizer_path)
        self.store = SessionStore(
            config.out_dir,
            self.template,
            config.idle_timeout_s,
            recompute=config.recompute_logprobs,
        )
        self.token = secrets.token_hex(16)
        self.port = 0
        self._http: aiohttp.ClientSession | None = None
        self._clients: dict[str, VLLMClient] = {}
        # Model names each session asked for (GET /v1/models lists the asker's own), bounded.
        self._session_models: OrderedDict[str, OrderedDict[str, None]] = OrderedDict()
        available = registered()
        names = config.providers or list(available)
        unknown = [n for n in names if n not in available]
        if unknown:
            raise ValueError(
                f"unknown provider(s) {', '.join(unknown)}; known: {', '.join(available)}"
            )
        self.providers: list[Provider[Any]] = [available[n](config.provider_options) for n in names]
        self.default_provider = next(
            (p for p in self.providers if p.name == DEFAULT_PROVIDER), self.providers[0]
        )
        self._runner: web.AppRunner | None = None
        self._sweeper: asyncio.Task[None] | None = None
        # Prompt assembly runs here, off the event loop (see assemble).
        self._render_pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="agenttap-render")
        self._session_locks: weakref.WeakValueDictionary[str, asyncio.Lock] = (
            weakref.WeakValueDictionary()
        )

    # -- lifecycle -------------------------------------------------------------------------
    async def start(self) -> int:
        # Read once from the vocabulary (a fraction of a second), before any call needs it.
        await asyncio.get_running_loop().run_in_executor(
            self._render_pool, lambda: self.template.max_token_bytes
        )
        recovered = self.store.recover()
        if recovered:
            logger.info("recovered turns of an earlier run into %d shard(s)", len(recovered))
        self._http = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=self.config.policy_max_connections),
            timeout=aiohttp.ClientTimeout(
                total=None, sock_connect=10, sock_read=self.config.policy_timeout_s
            ),
        )
        urls = list(self.config.policy_urls)
        for _, servers in self.config.model_map:
            urls += servers
        decode = partial(self.template.decode, skip_special_tokens=True)
        # The policy timeout bounds time without a new token, not without a byte (keep-alives).
        self._clients = {
            url: VLLMClient(
                url, self._http, decode=decode, progress_timeout_s=self.config.policy_timeout_s
            )
            for url in dict.fromkeys(urls)
        }
        # We enforce the body limit ourselves so the client gets its provider's error format.
        app = web.Application(client_max_size=self.config.max_body_bytes + 1)
        app.router.add_route("*", "/{tail:.*}", self._dispatch)
        # handler_cancellation: a client that leaves cancels its handler, so the policy request
        # is dropped (vLLM aborts it) and the turn is not recorded as completed.
        self._runner = web.AppRunner(
            app,
            access_log=None,
            handler_cancellation=True,
            max_line_size=_PARSER_HEAD_BYTES,
            max_field_size=_PARSER_HEAD_BYTES,
            max_headers=_PARSER_HEAD_FIELDS,
        )
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        server: Any = site._server  # aiohttp exposes the bound port only here
        self.port = int(server.sockets[0].getsockname()[1])
        self._sweeper = asyncio.get_running_loop().create_task(self._sweep())
        return self.port

    async def stop(self) -> None:
        if self._sweeper:
            self._sweeper.cancel()
        if self._runner:
            await self._runner.cleanup()
        if self._http:
            await self._http.close()
        # Assemblies still running in the workers finish before the sessions are written.
        await asyncio.get_running_loop().run_in_executor(None, self._render_pool.shutdown)
        self.store.close()

    @property
    def max_body_bytes(self) -> int:
        return self.config.max_body_bytes

    async def flush(self, session_id: str | None = None) -> list[Path]:
        """Write a session's shards now (all sessions: None). The session may go on: its next
        call extends the written rows' exact ids, in a new row parented to them."""
        store = self.store
        sessions = [session_id] if session_id is not None else store.session_ids()
        written = []
        for sid in sessions:
            # Not while a worker thread is placing a call in that session's tree.
            async with self.session_lock(sid):
                written += store.end_session(sid, keep_threads=True)
        return written

    def session_lock(self, session_id: str) -> asyncio.Lock:
        """Held while a session's tree changes: an assembly in a worker thread, a record, a
        flush. First come, first served, so a session's calls are placed in arrival order."""
        lock = self._session_locks.get(session_id)
        if lock is None:
            lock = self._session_locks[session_id] = asyncio.Lock()
        return lock

    async def assemble(self, session_id: str, chat: ChatRequest) -> Assembly:
        """Place a request in its session's tree and build its prompt ids, in a worker thread:
        rendering and tokenizing a long prompt takes a second or more, and the event loop
        serves every other session meanwhile (the tokenizer releases the GIL)."""
        async with self.session_lock(session_id):
            self.store.session(session_id)  # created here, never from a worker thread
            return await asyncio.get_running_loop().run_in_executor(
                self._render_pool, self.store.assemble, session_id, chat
            )

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(
                min(self.config.sweep_interval_s, max(0.2, self.config.idle_timeout_s / 2))
            )
            try:
                busy = {sid for sid, lock in self._session_locks.items() if lock.locked()}
                self.store.flush_idle(skip=busy)
            except Exception:  # a full disk must not kill the sweeper; the journal still holds it
                logger.exception("could not write the shard of an idle session")

    def _pool_for(self, model: str) -> list[VLLMClient]:
        for pattern, servers in self.config.model_map:
            if fnmatch.fnmatchcase(model, pattern):
                return [self._clients[u] for u in servers]
        return [self._clients[u] for u in self.config.policy_urls]

    def client_for(self, session_id: str, model: str = "") -> VLLMClient:
        pool = self._pool_for(model)
        # Sticky per session: a scaffold's consecutive calls reuse one server's prefix cache.
        return pool[zlib.crc32(session_id.encode()) % len(pool)]

    # -- dispatch --------------------------------------------------------------------------
    def _route(self, call: Call) -> tuple[Provider[Any], Route | None]:
        """The provider that answers ``call`` and its route; the route is None when nobody
        serves it (the host's owner then answers 404 in its format)."""
        owners = [p for p in self.providers if p.owns(call)]
        for provider in owners + [p for p in self.providers if p not in owners]:
            route = provider.match(call)
            if route is not None:
                return provider, route
        return (owners[0] if owners else self.default_provider), None

    def _served(self, call: Call) -> str:
        owners = [p for p in self.providers if p.owns(call)] or [self.default_provider]
        return "; ".join(p.served for p in owners)

    async def _dispatch(self, request: web.Request) -> web.StreamResponse:
        if request.headers.get(TOKEN_HEADER) != self.token:
            return web.Response(status=403, text="agenttap gateway: only the proxy may call this")
        call = Call.of(request, request.headers.get(HOST_HEADER, ""))
        provider, route = self._route(call)
        oversized = request.headers.get(OVERSIZED_HEADER)
        if oversized:
            return provider.error(
                431,
                f"Request header fields too large ({oversized[:80]}): this proxy accepts a "
                f"request target and headers of at most {MAX_HEAD_BYTES} bytes in at most "
                f"{MAX_HEAD_FIELDS} fields.",
            )
        if route is None:
            return provider.error(
                404,
                f"agenttap: {call.method} {call.path} on {call.host} is not served by this "
                f"proxy. It answers {self._served(call)} from the policy.",
            )
        try:
            return await self._serve(request, call, provider, route)
        except web.HTTPException:
            raise
        except Exception:
            # A defect of ours, never the client's: answer in its provider's format, keep the
            # traceback for the operator.
            logger.exception("agenttap: internal error on %s %s", call.method, call.path)
            return provider.error(
                500, "agenttap: internal error in the proxy; its log has the details."
            )

    async def _serve(
        self, request: web.Request, call: Call, provider: Provider[Any], route: Route
    ) -> web.StreamResponse:
        if route.kind is RouteKind.TURN:
            return await self._turn(request, call, provider)
        if route.kind is RouteKind.COUNT_TOKENS:
            return await self._count_tokens(request, call, provider)
        if route.kind is RouteKind.MODELS:
            return await self._models(provider, route.model_id, self.session_id(request, provider))
        if route.kind is RouteKind.LOCAL:
            return web.json_response(route.body)
        if route.kind is RouteKind.WEBSOCKET:
            return await provider.serve_websocket(request, call, self)
        return provider.error(route.status, route.message)

    async def _read_body(self, request: web.Request) -> bytes:
        if (request.content_length or 0) > self.config.max_body_bytes:
            raise RequestError(self._too_large_message(request.content_length or 0), status=413)
        encoding = request.headers.get("Content-Encoding", "").strip().lower()
        encoding = request.headers.get(UNSUPPORTED_ENCODING_HEADER, encoding).strip().lower()
        if encoding not in ("", "identity", "gzip", "deflate"):
            raise RequestError(
                f"Unsupported Content-Encoding {encoding[:40]!r}; send the body as identity, "
                "gzip or deflate.",
                status=415,
            )
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise RequestError(self._too_large_message(None), status=413) from None
        except RequestPayloadError as exc:
            raise RequestError(f"The request body could not be read: {exc}", status=400) from None
        if encoding in ("", "identity"):
            return raw
        # gzip (wbits 16+) or zlib/raw deflate (wbits 32+ detects a header); bounded output.
        inflater = zlib.decompressobj(16 + zlib.MAX_WBITS if encoding == "gzip" else 47)
        try:
            body = inflater.decompress(raw, self.config.max_body_bytes + 1)
        except zlib.error as exc:
            raise RequestError(
                f"The request body is not valid {encoding} ({exc}); send it uncompressed or "
                "compressed whole.",
                status=400,
            ) from None
        if len(body) > self.config.max_body_bytes or inflater.unconsumed_tail:
            raise RequestError(self._too_large_message(None), status=413)
        if not inflater.eof:
            raise RequestError(
                f"The request body is a truncated {encoding} stream; send it whole.", status=400
            )
        return body

    def _too_large_message(self, size: int | None) -> str:
        limit = self.config.max_body_bytes
        got = f" ({size} bytes)" if size else ""
        return (
            f"Request body too large{got}: this proxy accepts at most {limit} bytes "
            "(option agenttap_max_body_bytes)."
        )

    async def _models(
        self, provider: Provider[Any], model_id: str, session_id: str = ""
    ) -> web.Response:
        try:
            info = await self._pool_for("*")[0].info()
        except PolicyError as exc:
            return provider.policy_error(exc)
        names = [model_id] if model_id else self.model_names(info.model, session_id)
        return web.json_response(provider.models_body(names, model_id))

    def model_names(self, served: str, session_id: str = "") -> list[str]:
        """Names clients may ask for: every one maps to a policy (``model_map``). Besides the
        configured ones, only the asking session's own names: never another session's."""
        own = list(self._session_models.get(session_id, ())) if session_id else []
        names = [served, *self.config.model_names, *own]
        names += [p for p, _ in self.config.model_map if not any(c in p for c in "*?[")]
        return list(dict.fromkeys(n for n in names if n))

    def _remember_model(self, session_id: str, model: str) -> None:
        models = self._session_models.pop(session_id, None) or OrderedDict()
        models.pop(model, None)
        models[model] = None
        while len(models) > MAX_MODELS_PER_SESSION:
            models.popitem(last=False)
        self._session_models[session_id] = models
        while len(self._session_models) > MAX_SESSIONS_WITH_MODELS:
            self._session_models.popitem(last=False)

    # -- one turn: assemble, generate, parse, answer, record ---------------------------------
    def session_id(self, request: web.Request, provider: Provider[Any]) -> str:
        session = request.headers.get(SESSION_HEADER) or "anonymous"
        if session == "anonymous":
            # No proxy username: a client's own session header still keeps runs apart.
            for name, client in provider.session_headers.items():
                if request.headers.get(name):
                    return safe_text(f"{client}:{request.headers[name]}")[:256]
        return safe_text(unquote_session(session))

    async def _turn(
        self, request: web.Request, call: Call, provider: Provider[Any]
    ) -> web.StreamResponse:
        session_id = self.session_id(request, provider)
        started = time.time()
        try:
            parsed = provider.parse(call, await self._read_body(request), session_id)
            parsed.chat.client_retry = is_client_retry(request.headers)
        except RequestError as exc:
            return provider.error(exc.status, exc.message, exc.param)
        except MALFORMED as exc:
            return _malformed(provider, exc)
        turn = await self._prepare(provider, parsed, call.headers.get("User-Agent", ""), started)
        if isinstance(turn, web.Response):
            return turn
        parser = self._parser(turn)
        if not turn.chat.stream:
            return await self._whole(turn, parser)
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )

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

    async def run_turn(
        self,
        provider: Provider[Any],
        parsed: ProviderTurn,
        send: Callable[[bytes], Awaitable[None]],
        user_agent: str = "",
    ) -> web.Response | None:
        """A parsed turn streamed through ``send`` (a provider's WebSocket); see TurnRunner."""
        turn = await self._prepare(provider, parsed, user_agent, time.time())
        if isinstance(turn, web.Response):
            return turn
        return await self._stream(turn, self._parser(turn), send)

    async def _prepare(
        self, provider: Provider[Any], parsed: ProviderTurn, user_agent: str, started: float
    ) -> _TurnContext | web.Response:
        chat = parsed.chat
        try:
            self._remember_model(parsed.session_id, chat.model)
            client = self.client_for(parsed.session_id, chat.model)
            info = await client.info()
            if info.max_model_len:
                # Refused before any rendering when the text alone cannot fit the context.
                at_least = self.template.min_tokens(prompt_text_bytes(chat))
                if at_least >= info.max_model_len:
                    return provider.prompt_too_long(at_least, info.max_model_len)
            assembly = await self.assemble(parsed.session_id, chat)
            if info.max_model_len and len(assembly.prompt_ids) >= info.max_model_len:
                return provider.prompt_too_long(len(assembly.prompt_ids), info.max_model_len)
            await self._recompute(client, assembly)
        except RequestError as exc:
            return provider.error(exc.status, exc.message, exc.param)
        except PolicyError as exc:
            return provider.policy_error(exc)
        except MALFORMED as exc:
            return _malformed(provider, exc)
        self.store.touch(parsed.session_id)
        return _TurnContext(
            parsed=parsed,
            provider=provider,
            client=client,
            assembly=assembly,
            policy_model=info.model,
            user_agent=user_agent,
            started=started,
        )

    def _parser(self, turn: _TurnContext) -> OutputParser:
        # tool_choice "none": whatever the policy writes is text, never a call the client runs.
        tool_parser = "none" if turn.chat.tool_choice == "none" else self.config.tool_parser
        return OutputParser(tool_parser, self.config.reasoning_parser)

    async def _whole(self, turn: _TurnContext, parser: OutputParser) -> web.Response:
        provider = turn.provider
        try:
            completion = await turn.client.complete(turn.prompt_ids, turn.chat.sampling)
        except PolicyError as exc:
            self._record_failure(turn, exc, 0)
            return provider.policy_error(exc)
        except POLICY_FAILURES as exc:
            error = policy_failure(turn.client, exc)
            self._record_failure(turn, error, 0)
            return provider.policy_error(error)
        parser.feed(completion.text)
        parser.finish()
        reply = parser.reply()
        body, reason = provider.response(turn.parsed, len(turn.prompt_ids), completion, reply)
        await self._record(turn, completion, reason, reply)
        return web.json_response(body)

    async def _stream(
        self, turn: _TurnContext, parser: OutputParser, send: Callable[[bytes], Awaitable[None]]
    ) -> web.Response | None:
        """Stream one turn through ``send``; an error response when the policy refused it
        before anything was sent, else None."""
        provider = turn.provider
        writer = provider.stream_writer(turn.parsed, len(turn.prompt_ids))
        completion = Completion()
        deltas = turn.client.stream_resuming(turn.prompt_ids, turn.chat.sampling)
        try:
            # The first piece comes before any byte is sent, so a refusal is a proper error.
            first = await anext(deltas, None)
        except PolicyError as exc:
            self._record_failure(turn, exc, 0)
            return provider.policy_error(exc)
        except POLICY_FAILURES as exc:
            error = policy_failure(turn.client, exc)
            self._record_failure(turn, error, 0)
            return provider.policy_error(error)
        await send(writer.start())
        delta = first
        while delta is not None:
            completion.extend(delta)
            chunk = writer.events(parser.feed(delta.text))
            if chunk:
                await send(chunk)
            try:
                # Only the policy's part is caught here: a client that left makes ``send``
                # fail (or cancels this handler), which is no failure of the policy's.
                delta = await anext(deltas, None)
            except (PolicyError, *POLICY_FAILURES) as exc:
                # Mid-stream the status line is gone: the provider's error event ends it.
                error = exc if isinstance(exc, PolicyError) else policy_failure(turn.client, exc)
                self._record_failure(turn, error, len(completion.token_ids))
                await send(writer.error(str(error)))
                return None
        tail = writer.events(parser.finish())
        reply = parser.reply()
        closing, reason = writer.finish(completion, reply)
        await send(tail + closing)
        # Durable before the client sees the end of the response.
        await self._record(turn, completion, reason, reply)
        await send(writer.end())
        return None

    def _record_failure(self, turn: _TurnContext, error: PolicyError, streamed: int) -> None:
        """Journal a call the policy failed (see FailedCall); its tokens are never trained."""
        parsed = turn.parsed
        logger.warning(
            "agenttap: session %r call %s failed at the policy after %d tokens: %s",
            parsed.session_id,
            parsed.response_id,
            streamed,
            error,
        )
        try:
            self.store.record_failure(
                FailedCall(
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
            )
        except OSError:
            # A full disk must not turn the client's error into a hang or a 500.
            logger.exception("could not journal a failed call")

    async def _count_tokens(
        self, request: web.Request, call: Call, provider: Provider[Any]
    ) -> web.Response:
        """Exactly as many tokens as the policy would be sent for this request now."""
        session_id = self.session_id(request, provider)
        try:
            chat = provider.count_tokens(call, await self._read_body(request), session_id)
            assembly = await self.assemble(session_id, chat)
        except RequestError as exc:
            return provider.error(exc.status, exc.message, exc.param)
        except MALFORMED as exc:
            return _malformed(provider, exc)
        return web.json_response(provider.count_tokens_body(len(assembly.prompt_ids)))

    async def _recompute(self, client: VLLMClient, assembly: Assembly) -> None:
        """Re-score policy tokens whose context changed, on the sequence the policy now sees."""
        positions = assembly.needs_recompute()
        if not positions:
            return
        scores = await client.prompt_logprobs(assembly.prompt_ids[: positions[-1] + 1])
        for pos in positions:
            value = scores[pos]
            assert value is not None  # position 0 is never a policy token
            assembly.suffix_logprobs[pos - assembly.base] = value
        logger.info("recomputed %d logprobs after a history rewrite", len(positions))

    async def _rescore_constrained(
        self, turn: _TurnContext, completion: Completion
    ) -> list[float] | None:
        """The policy's own logprobs of a completion sampled under a JSON schema: vLLM reports
        the constrained distribution's, which no trainer would compute. None: not re-scored
        (recompute switched off, or the policy refused), and the tokens are masked."""
        if not self.config.recompute_logprobs or not completion.token_ids:
            return None
        try:
            scores = await turn.client.prompt_logprobs(
                list(turn.prompt_ids) + list(completion.token_ids)
            )
        except PolicyError as exc:
            logger.warning("could not re-score a schema-constrained completion: %s", exc)
            return None
        return [float(x) if x is not None else 0.0 for x in scores[len(turn.prompt_ids) :]]

    async def _record(
        self, turn: _TurnContext, completion: Completion, reason: str, reply: AssistantReply
    ) -> TurnRecord:
        constrained = turn.chat.sampling.json_schema is not None
        rescored = await self._rescore_constrained(turn, completion) if constrained else None
        parsed = turn.parsed
        record = TurnRecord(
            session_id=parsed.session_id,
            request_id=parsed.response_id,
            turn_index=self.store.next_turn_index(parsed.session_id),
            protocol=turn.provider.name,
            requested_model=turn.chat.model,
            policy_model=turn.policy_model,
            backend=turn.client.base_url,
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
        async with self.session_lock(parsed.session_id):
            self.store.record(
                record,
                turn.assembly,
                turn.provider.recorded_reply(parsed, reply),
                rescored=rescored,
                constrained=constrained,
            )
        turn.provider.finished(parsed, reply, completion)
        return record


# The policy connection failing mid-call (a read timeout, a dropped connection).
POLICY_FAILURES = (aiohttp.ClientError, TimeoutError)
MAX_MODELS_PER_SESSION = 32
MAX_SESSIONS_WITH_MODELS = 10_000


def prompt_text_bytes(chat: ChatRequest) -> int:
    """UTF-8 bytes of the text a prompt renders verbatim: every message but the assistant's
    (those the prompt may hold as the ids the policy sampled, which a client can send back
    longer, re-serialized)."""
    verbatim = (m.content for m in chat.messages if m.role != "assistant")
    return sum(len(text.encode("utf-8", "surrogatepass")) for text in verbatim)


def policy_failure(client: VLLMClient, exc: BaseException) -> PolicyError:
    if isinstance(exc, TimeoutError):  # aiohttp's read timeouts are TimeoutErrors too
        return PolicyError(
            f"the policy server at {client.base_url} did not answer in time; "
            "option agenttap_policy_timeout"
        )
    return PolicyError(f"the connection to the policy server at {client.base_url} failed: {exc}")


@dataclass
class _TurnContext:
    parsed: ProviderTurn
    provider: Provider[Any]
    client: VLLMClient
    assembly: Assembly
    policy_model: str
    user_agent: str
    started: float

    @property
    def chat(self) -> ChatRequest:
        return self.parsed.chat

    @property
    def prompt_ids(self) -> list[int]:
        return self.assembly.prompt_ids
