"""The gateway: a loopback HTTP server that answers intercepted API calls from the policy.

mitmproxy cannot stream a body an addon builds itself, so the addon points each intercepted flow
at this server (running in mitmproxy's own event loop) and lets mitmproxy stream its answer back
to the client. Here a provider request is translated to the canonical chat form, rendered to
token ids, completed by vLLM token-in/token-out, parsed, answered in the provider's format as the
tokens arrive, and recorded. Nothing here knows about mitmproxy.
"""

from __future__ import annotations

import asyncio
import json
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

from capture.records import TurnRecord
from capture.sessions import SessionStore
from capture.trajectory import Assembly
from rewriter import openai_chat
from rewriter.canonical import ChatRequest, Message, RequestError
from rewriter.parsers import ContentDelta, OutputParser, ReasoningDelta, ToolCallEvent
from rewriter.template import ChatTemplate
from rewriter.vllm_client import Completion, PolicyError, VLLMClient

logger = logging.getLogger(__name__)

TOKEN_HEADER = "X-Agenttap-Token"
SESSION_HEADER = "X-Agenttap-Session"
HOST_HEADER = "X-Agenttap-Host"


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
    extra: dict[str, Any] = field(default_factory=dict)


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


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
        self._clients: list[VLLMClient] = []
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
        self._clients = [VLLMClient(url, self._http) for url in self.config.policy_urls]
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

    def client_for(self, session_id: str) -> VLLMClient:
        # Sticky per session: a scaffold's consecutive calls reuse one server's prefix cache.
        return self._clients[zlib.crc32(session_id.encode()) % len(self._clients)]

    # -- dispatch --------------------------------------------------------------------------
    async def _dispatch(self, request: web.Request) -> web.StreamResponse:
        if request.headers.get(TOKEN_HEADER) != self.token:
            return web.Response(status=403, text="agenttap gateway: only the proxy may call this")
        path = request.path
        if request.method == "POST" and path.rstrip("/").endswith("/chat/completions"):
            return await self._openai_chat(request)
        if request.method == "GET" and path.rstrip("/") == "/v1/models":
            return await self._openai_models(request)
        host = request.headers.get(HOST_HEADER, "")
        return self._openai_error(
            404,
            f"agenttap: {request.method} {path} on {host} is not served by this proxy. It answers "
            "POST /v1/chat/completions and GET /v1/models from the policy.",
        )

    @staticmethod
    def _openai_error(status: int, message: str, param: str | None = None) -> web.Response:
        return web.json_response(openai_chat.error_body(message, status, param), status=status)

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

    async def _openai_models(self, request: web.Request) -> web.Response:
        try:
            info = await self._clients[0].info()
        except PolicyError as exc:
            return self._openai_error(503, str(exc))
        return web.json_response(
            {
                "object": "list",
                "data": [
                    {"id": info.model, "object": "model", "created": 0, "owned_by": "agenttap"}
                ],
            }
        )

    # -- OpenAI chat completions ------------------------------------------------------------
    async def _openai_chat(self, request: web.Request) -> web.StreamResponse:
        session_id = request.headers.get(SESSION_HEADER) or "anonymous"
        started = time.time()
        try:
            body = await self._read_body(request)
            chat = openai_chat.parse_request(body)
            assembly = self.store.assemble(session_id, chat)
            prompt_ids = assembly.prompt_ids
            client = self.client_for(session_id)
            info = await client.info()
            if info.max_model_len and len(prompt_ids) >= info.max_model_len:
                return web.json_response(
                    {
                        "error": {
                            "message": "This model's maximum context length is "
                            f"{info.max_model_len} "
                            f"tokens. However, your messages resulted in {len(prompt_ids)} tokens. "
                            "Please reduce the length of the messages.",
                            "type": "invalid_request_error",
                            "param": "messages",
                            "code": "context_length_exceeded",
                        }
                    },
                    status=400,
                )
            await self._recompute(client, assembly)
        except RequestError as exc:
            return self._openai_error(exc.status, exc.message, exc.param)
        except PolicyError as exc:
            return self._openai_error(503, f"the policy server is unavailable: {exc}")
        self.store.touch(session_id)
        response_id = "chatcmpl-" + secrets.token_hex(12)
        parser = OutputParser(self.config.tool_parser, self.config.reasoning_parser)
        turn = _TurnContext(
            session_id=session_id,
            request_id=response_id,
            chat=chat,
            prompt_ids=prompt_ids,
            client=client,
            assembly=assembly,
            policy_model=info.model,
            user_agent=request.headers.get("User-Agent", ""),
            started=started,
        )
        if chat.stream:
            return await self._openai_stream(request, turn, parser)
        try:
            completion = await client.complete(prompt_ids, chat.sampling)
        except PolicyError as exc:
            status = 400 if exc.status == 400 else 502
            return self._openai_error(status, str(exc))
        parser.feed(completion.text)
        parser.finish()
        reply = parser.reply()
        reason = openai_chat.finish_reason(completion.finish_reason, reply)
        self._record(turn, completion, reason, reply.as_message())
        return web.json_response(
            openai_chat.completion_response(
                response_id, chat.model, reply, reason, len(prompt_ids), len(completion.token_ids)
            )
        )

    async def _openai_stream(
        self, request: web.Request, turn: _TurnContext, parser: OutputParser
    ) -> web.StreamResponse:
        chat = turn.chat
        writer = openai_chat.ChunkWriter(turn.request_id, chat.model)
        completion = Completion()
        deltas = turn.client.stream_resuming(turn.prompt_ids, chat.sampling)
        try:
            first = await anext(deltas, None)
        except PolicyError as exc:
            return self._openai_error(400 if exc.status == 400 else 502, str(exc))
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await resp.prepare(request)
        await resp.write(_sse(writer.role()))

        async def emit(events: list[Any]) -> None:
            for event in events:
                if isinstance(event, ContentDelta):
                    await resp.write(_sse(writer.content(event.text)))
                elif isinstance(event, ReasoningDelta):
                    await resp.write(_sse(writer.reasoning(event.text)))
                elif isinstance(event, ToolCallEvent):
                    await resp.write(_sse(writer.tool_call(event.index, event.call)))

        try:
            delta = first
            while delta is not None:
                completion.extend(delta)
                await emit(parser.feed(delta.text))
                delta = await anext(deltas, None)
        except PolicyError as exc:
            await resp.write(_sse(openai_chat.error_body(str(exc), 502)))
            await resp.write_eof()
            return resp
        await emit(parser.finish())
        reply = parser.reply()
        reason = openai_chat.finish_reason(completion.finish_reason, reply)
        await resp.write(_sse(writer.finish(reason)))
        if chat.include_usage:
            await resp.write(_sse(writer.usage(len(turn.prompt_ids), len(completion.token_ids))))
        # Durable before the client sees the end of the response.
        self._record(turn, completion, reason, reply.as_message())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

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
            protocol="openai.chat",
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
        )
        self.store.record(record, turn.assembly, reply)
        return record


@dataclass
class _TurnContext:
    session_id: str
    request_id: str
    chat: ChatRequest
    prompt_ids: list[int]
    client: VLLMClient
    assembly: Assembly
    policy_model: str
    user_agent: str
    started: float
