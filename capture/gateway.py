"""The gateway: a loopback HTTP server that answers intercepted API calls from the policy.

mitmproxy cannot stream a body an addon builds itself, so the addon points each intercepted flow
at this server (running in mitmproxy's own event loop) and lets mitmproxy stream its answer back
to the client. Here a provider request is translated to the canonical chat form, rendered to
token ids, completed by vLLM token-in/token-out, parsed, answered in the provider's format as the
tokens arrive, and recorded. Nothing here knows about mitmproxy.
"""

from __future__ import annotations

import asyncio
import fnmatch
import logging
import os
import secrets
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from capture.offline import local_answer
from capture.protocols import AnthropicMessages, GeminiAPI, OpenAIChat, ProviderProtocol
from capture.records import TurnRecord
from capture.sessions import SessionStore
from capture.trajectory import Assembly
from rewriter import anthropic_messages, gemini
from rewriter.canonical import ChatRequest, Message, RequestError
from rewriter.parsers import OutputParser
from rewriter.template import ChatTemplate
from rewriter.vllm_client import Completion, PolicyError, VLLMClient

logger = logging.getLogger(__name__)

TOKEN_HEADER = "X-Agenttap-Token"
SESSION_HEADER = "X-Agenttap-Session"
HOST_HEADER = "X-Agenttap-Host"
# A client's own session header names the session when the proxy URL has no username.
CLIENT_SESSION_HEADERS = {"X-Claude-Code-Session-Id": "claude-code", "session-id": "codex"}


def parse_model_map(spec: str) -> list[tuple[str, list[str]]]:
    """``"claude-haiku-*=http://a:8000|http://b:8000,gpt-*=http://c:8000"`` -> rules.

    Each requested model name goes to the servers of the first pattern (fnmatch) it matches;
    names no rule matches go to the policy servers (``policy_urls``).
    """
    rules: list[tuple[str, list[str]]] = []
    for item in spec.split(","):
        if not item.strip():
            continue
        pattern, sep, urls = item.partition("=")
        servers = [u.strip() for u in urls.split("|") if u.strip()]
        if not sep or not pattern.strip() or not servers:
            raise ValueError(
                f"model map entry {item.strip()!r} is not PATTERN=URL[|URL...] "
                "(e.g. claude-haiku-*=http://127.0.0.1:8001)"
            )
        rules.append((pattern.strip(), servers))
    return rules


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
    # Re-score policy tokens whose context a scaffold rewrote (vLLM prompt_logprobs); off:
    # such tokens are masked out of the loss instead.
    recompute: bool = field(
        default_factory=lambda: os.environ.get("AGENTTAP_RECOMPUTE_MISMATCH_LOGPROBS", "1") != "0"
    )
    # (pattern, servers): requested model names -> policy servers; see parse_model_map.
    model_map: list[tuple[str, list[str]]] = field(default_factory=list)
    # Extra names GET /v1/models lists (every name is served).
    model_names: list[str] = field(default_factory=list)
    normalization: anthropic_messages.Normalization = field(
        default_factory=anthropic_messages.Normalization
    )
    extra: dict[str, Any] = field(default_factory=dict)


class Gateway:
    def __init__(self, config: GatewayConfig, template: ChatTemplate | None = None) -> None:
        self.config = config
        self.template = template or ChatTemplate(config.tokenizer_path)
        self.store = SessionStore(
            config.out_dir, self.template, config.idle_timeout_s, recompute=config.recompute
        )
        self.token = secrets.token_hex(16)
        self.port = 0
        self._http: aiohttp.ClientSession | None = None
        self._clients: dict[str, VLLMClient] = {}
        self._requested_models: set[str] = set()
        self.openai = OpenAIChat()
        self.anthropic = AnthropicMessages(config.normalization)
        self._runner: web.AppRunner | None = None
        self._sweeper: asyncio.Task[None] | None = None

    # -- lifecycle -------------------------------------------------------------------------
    async def start(self) -> int:
        recovered = self.store.recover()
        if recovered:
            logger.info("recovered turns of an earlier run into %d shard(s)", len(recovered))
        self._http = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10)
        )
        urls = list(self.config.policy_urls)
        for _, servers in self.config.model_map:
            urls += servers
        self._clients = {url: VLLMClient(url, self._http) for url in dict.fromkeys(urls)}
        # We enforce the body limit ourselves so the client gets its provider's error format.
        app = web.Application(client_max_size=self.config.max_body_bytes + 1)
        app.router.add_route("*", "/{tail:.*}", self._dispatch)
        self._runner = web.AppRunner(app, access_log=None)
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
        self.store.close()

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(
                min(self.config.sweep_interval_s, max(0.2, self.config.idle_timeout_s / 2))
            )
            try:
                self.store.flush_idle()
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
    def _protocol_for(self, request: web.Request) -> ProviderProtocol:
        host = request.headers.get(HOST_HEADER, "")
        if host == "anthropic.com" or host.endswith(".anthropic.com"):
            return self.anthropic
        if "anthropic-version" in request.headers:
            return self.anthropic
        return self.openai

    async def _dispatch(self, request: web.Request) -> web.StreamResponse:
        if request.headers.get(TOKEN_HEADER) != self.token:
            return web.Response(status=403, text="agenttap gateway: only the proxy may call this")
        path = request.path.rstrip("/") or "/"
        method = request.method
        if _is_google(request.headers.get(HOST_HEADER, "")):
            return await self._gemini(request, method, path)
        if method == "POST" and path.endswith("/chat/completions"):
            return await self._turn(request, self.openai)
        if method == "POST" and path == "/v1/messages":
            return await self._turn(request, self.anthropic)
        if method == "POST" and path == "/v1/messages/count_tokens":
            return await self._count_tokens(request)
        protocol = self._protocol_for(request)
        if method == "GET" and (path == "/v1/models" or path.startswith("/v1/models/")):
            return await self._models(request, protocol, path[len("/v1/models/") :])
        host = request.headers.get(HOST_HEADER, "")
        answer = local_answer(host, method, path)
        if answer is not None:
            return web.json_response(answer)
        served = (
            "POST /v1/messages, POST /v1/messages/count_tokens and GET /v1/models"
            if protocol is self.anthropic
            else "POST /v1/chat/completions and GET /v1/models"
        )
        return protocol.error(
            404,
            f"agenttap: {method} {path} on {host} is not served by this proxy. It answers "
            f"{served} from the policy.",
        )

    async def _read_body(self, request: web.Request) -> bytes:
        if (request.content_length or 0) > self.config.max_body_bytes:
            raise RequestError(self._too_large_message(request.content_length or 0), status=413)
        try:
            return await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise RequestError(self._too_large_message(None), status=413) from None

    def _too_large_message(self, size: int | None) -> str:
        limit = self.config.max_body_bytes
        got = f" ({size} bytes)" if size else ""
        return (
            f"Request body too large{got}: this proxy accepts at most {limit} bytes "
            "(option agenttap_max_body_bytes)."
        )

    async def _models(
        self, request: web.Request, protocol: ProviderProtocol, model_id: str
    ) -> web.Response:
        try:
            info = await self._pool_for("*")[0].info()
        except PolicyError as exc:
            return protocol.policy_error(exc)
        if protocol is self.anthropic:
            if model_id:
                return web.json_response(anthropic_messages.model_object(model_id))
            return web.json_response(anthropic_messages.models_list(self.model_names(info.model)))
        names = [model_id] if model_id else self.model_names(info.model)
        data = [{"id": n, "object": "model", "created": 0, "owned_by": "agenttap"} for n in names]
        if model_id:
            return web.json_response(data[0])
        return web.json_response({"object": "list", "data": data})

    def model_names(self, served: str) -> list[str]:
        """Names clients may ask for: every one maps to a policy (``model_map``)."""
        names = [served, *self.config.model_names, *sorted(self._requested_models)]
        names += [p for p, _ in self.config.model_map if not any(c in p for c in "*?[")]
        return list(dict.fromkeys(n for n in names if n))

    # -- one turn: assemble, generate, parse, answer, record ---------------------------------
    def _session_id(self, request: web.Request) -> str:
        session = request.headers.get(SESSION_HEADER) or "anonymous"
        if session == "anonymous":
            # No proxy username: a client's own session header still keeps runs apart.
            for name, client in CLIENT_SESSION_HEADERS.items():
                if request.headers.get(name):
                    return f"{client}:{request.headers[name]}"
        return session

    async def _prepare(
        self, request: web.Request, protocol: ProviderProtocol
    ) -> _TurnContext | web.Response:
        session_id = self._session_id(request)
        started = time.time()
        try:
            chat = protocol.parse(await self._read_body(request))
            self._requested_models.add(chat.model)
            client = self.client_for(session_id, chat.model)
            assembly = self.store.assemble(session_id, chat)
            info = await client.info()
            if info.max_model_len and len(assembly.prompt_ids) >= info.max_model_len:
                return protocol.prompt_too_long(len(assembly.prompt_ids), info.max_model_len)
            await self._recompute(client, assembly)
        except RequestError as exc:
            return protocol.error(exc.status, exc.message, exc.param)
        except PolicyError as exc:
            return protocol.policy_error(exc)
        self.store.touch(session_id)
        return _TurnContext(
            session_id=session_id,
            request_id=protocol.new_response_id(),
            protocol=protocol,
            chat=chat,
            client=client,
            assembly=assembly,
            policy_model=info.model,
            user_agent=request.headers.get("User-Agent", ""),
            started=started,
        )

    async def _turn(self, request: web.Request, protocol: ProviderProtocol) -> web.StreamResponse:
        turn = await self._prepare(request, protocol)
        if isinstance(turn, web.StreamResponse):
            return turn
        # tool_choice "none": whatever the policy writes is text, never a call the client runs.
        tool_parser = "none" if turn.chat.tool_choice == "none" else self.config.tool_parser
        parser = OutputParser(tool_parser, self.config.reasoning_parser)
        if turn.chat.stream:
            return await self._stream(request, turn, parser)
        try:
            completion = await turn.client.complete(turn.prompt_ids, turn.chat.sampling)
        except PolicyError as exc:
            return protocol.policy_error(exc)
        parser.feed(completion.text)
        parser.finish()
        reply = parser.reply()
        body, reason = protocol.response(
            turn.request_id, turn.chat, len(turn.prompt_ids), completion, reply
        )
        self._record(turn, completion, reason, protocol.recorded_reply(reply))
        return web.json_response(body)

    async def _stream(
        self, request: web.Request, turn: _TurnContext, parser: OutputParser
    ) -> web.StreamResponse:
        protocol = turn.protocol
        writer = protocol.stream_writer(turn.request_id, turn.chat, len(turn.prompt_ids))
        completion = Completion()
        deltas = turn.client.stream_resuming(turn.prompt_ids, turn.chat.sampling)
        try:
            # The first piece comes before any byte is sent, so a refusal is a proper error.
            first = await anext(deltas, None)
        except PolicyError as exc:
            return protocol.policy_error(exc)
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await resp.prepare(request)
        await resp.write(writer.start())
        try:
            delta = first
            while delta is not None:
                completion.extend(delta)
                chunk = writer.events(parser.feed(delta.text))
                if chunk:
                    await resp.write(chunk)
                delta = await anext(deltas, None)
        except PolicyError as exc:
            await resp.write(writer.error(str(exc)))
            await resp.write_eof()
            return resp
        tail = writer.events(parser.finish())
        reply = parser.reply()
        closing, reason = writer.finish(completion, reply)
        await resp.write(tail + closing)
        # Durable before the client sees the end of the response.
        self._record(turn, completion, reason, protocol.recorded_reply(reply))
        await resp.write(writer.end())
        await resp.write_eof()
        return resp

    async def _count_tokens(
        self, request: web.Request, protocol: AnthropicMessages | GeminiAPI | None = None
    ) -> web.Response:
        """Exactly as many tokens as the policy would be sent for this request now."""
        protocol = protocol or self.anthropic
        try:
            chat = protocol.parse_count_tokens(await self._read_body(request))
            assembly = self.store.assemble(self._session_id(request), chat)
        except RequestError as exc:
            return protocol.error(exc.status, exc.message, exc.param)
        if isinstance(protocol, GeminiAPI):
            return web.json_response(gemini.count_tokens_response(len(assembly.prompt_ids)))
        return web.json_response({"input_tokens": len(assembly.prompt_ids)})

    async def _gemini(self, request: web.Request, method: str, path: str) -> web.StreamResponse:
        """The Gemini API: the model and the method are in the path."""
        route = gemini.parse_route(method, path)
        protocol = GeminiAPI(route)
        if route is None or route.kind == "other":
            return protocol.error(
                404,
                f"agenttap: {method} {path} is not served by this proxy. It answers POST "
                "/v1beta/models/MODEL:generateContent, :streamGenerateContent?alt=sse and "
                ":countTokens, and GET /v1beta/models[/MODEL], from the policy.",
            )
        if route.kind in ("generate", "stream"):
            if route.kind == "stream" and request.query.get("alt") != "sse":
                return protocol.error(
                    400,
                    "streamGenerateContent is served as server-sent events only: add ?alt=sse "
                    "to the URL (every Google SDK does).",
                )
            return await self._turn(request, protocol)
        if route.kind == "count_tokens":
            return await self._count_tokens(request, protocol)
        try:
            info = await self._pool_for("*")[0].info()
        except PolicyError as exc:
            return protocol.policy_error(exc)
        if route.kind == "get_model":
            return web.json_response(gemini.model_object(route.model, info.max_model_len))
        names = self.model_names(info.model)
        return web.json_response(gemini.models_list(names, info.max_model_len))

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

    def _record(
        self, turn: _TurnContext, completion: Completion, reason: str, reply: Message
    ) -> TurnRecord:
        record = TurnRecord(
            session_id=turn.session_id,
            request_id=turn.request_id,
            turn_index=self.store.next_turn_index(turn.session_id),
            protocol=turn.protocol.name,
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
        self.store.record(record, turn.assembly, reply)
        return record


def _is_google(host: str) -> bool:
    return host == "googleapis.com" or host.endswith(".googleapis.com")


@dataclass
class _TurnContext:
    session_id: str
    request_id: str
    protocol: ProviderProtocol
    chat: ChatRequest
    client: VLLMClient
    assembly: Assembly
    policy_model: str
    user_agent: str
    started: float

    @property
    def prompt_ids(self) -> list[int]:
        return self.assembly.prompt_ids
