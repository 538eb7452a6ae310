"""OpenAI Chat Completions (``POST */chat/completions``) and OpenAI's ``GET /v1/models``.

Translation lives in ``request.py`` and ``response.py`` beside it; this is its HTTP glue.
"""

from __future__ import annotations

import secrets
from typing import Any

from aiohttp import web

from rewriter.canonical import AssistantReply
from rewriter.parsers import ContentDelta, ParseEvent, ReasoningDelta, ToolCallEvent
from rewriter.providers.base import (
    Call,
    Provider,
    ProviderTurn,
    Route,
    RouteKind,
    StreamWriter,
    register,
    sse,
)
from rewriter.providers.openai_chat import request as chat_request
from rewriter.providers.openai_chat import response as chat_response
from rewriter.vllm_client import Completion
from rewriter.wire import TextEvent


class OpenAIErrors:
    """OpenAI's error JSON and statuses, shared by the Chat Completions and Responses providers."""

    def error(self, status: int, message: str, param: str | None = None) -> web.Response:
        return web.json_response(chat_response.error_body(message, status, param), status=status)

    def prompt_too_long(self, prompt_tokens: int, max_model_len: int) -> web.Response:
        body = chat_response.error_body(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"messages resulted in {prompt_tokens} tokens. Please reduce the length of the "
            "messages.",
            400,
            "messages",
        )
        body["error"]["code"] = "context_length_exceeded"
        return web.json_response(body, status=400)


def openai_models_body(names: list[str], model_id: str) -> dict[str, Any]:
    data = [{"id": n, "object": "model", "created": 0, "owned_by": "agenttap"} for n in names]
    if model_id:
        return {"id": model_id, "object": "model", "created": 0, "owned_by": "agenttap"}
    return {"object": "list", "data": data}


@register
class OpenAIChat(OpenAIErrors, Provider[ProviderTurn]):
    name = "openai.chat"
    hosts = ("api.openai.com",)
    # Harbor's Terminus-2 names each trial here (--ak 'session_id_headers=["X-Session-ID"]'),
    # as vLLM's router reads it for session affinity.
    session_headers = {"X-Session-ID": "x-session-id"}
    served = "POST /v1/chat/completions and GET /v1/models"

    def match(self, call: Call) -> Route | None:
        if call.method == "POST" and call.path.endswith("/chat/completions"):
            return Route(RouteKind.TURN)
        if call.method == "GET" and self.owns(call):
            if call.path == "/v1/models":
                return Route(RouteKind.MODELS)
            if call.path.startswith("/v1/models/"):
                return Route(RouteKind.MODELS, model_id=call.path[len("/v1/models/") :])
        return None

    def parse(self, call: Call, body: bytes, session_id: str) -> ProviderTurn:
        chat = chat_request.parse_request(body)
        return ProviderTurn(chat, "chatcmpl-" + secrets.token_hex(12), session_id)

    def models_body(self, names: list[str], model_id: str) -> dict[str, Any]:
        return openai_models_body(names, model_id)

    def response(
        self, turn: ProviderTurn, prompt_tokens: int, completion: Completion, reply: AssistantReply
    ) -> tuple[dict[str, Any], str]:
        reason = chat_response.finish_reason(completion.finish_reason, reply)
        body = chat_response.completion_response(
            turn.response_id,
            turn.chat.model,
            reply,
            reason,
            prompt_tokens,
            len(completion.token_ids),
        )
        return body, reason

    def stream_writer(self, turn: ProviderTurn, prompt_tokens: int) -> StreamWriter:
        return _ChunkStream(turn, prompt_tokens)


class _ChunkStream:
    def __init__(self, turn: ProviderTurn, prompt_tokens: int) -> None:
        self.writer = chat_response.ChunkWriter(turn.response_id, turn.chat.model)
        self.include_usage = turn.chat.include_usage
        self.prompt_tokens = prompt_tokens
        # A chunk per token: only its text changes.
        self._content = TextEvent(lambda text: sse(self.writer.content(text)))
        self._reasoning = TextEvent(lambda text: sse(self.writer.reasoning(text)))

    def start(self) -> bytes:
        return sse(self.writer.role())

    def events(self, events: list[ParseEvent]) -> bytes:
        out = []
        for event in events:
            if isinstance(event, ContentDelta):
                out.append(self._content(event.text))
            elif isinstance(event, ReasoningDelta):
                out.append(self._reasoning(event.text))
            elif isinstance(event, ToolCallEvent):
                out.append(sse(self.writer.tool_call(event.index, event.call)))
        return b"".join(out)

    def finish(self, completion: Completion, reply: AssistantReply) -> tuple[bytes, str]:
        reason = chat_response.finish_reason(completion.finish_reason, reply)
        out = sse(self.writer.finish(reason))
        if self.include_usage:
            out += sse(self.writer.usage(self.prompt_tokens, len(completion.token_ids)))
        return out, reason

    def end(self) -> bytes:
        return b"data: [DONE]\n\n"

    def error(self, message: str) -> bytes:
        return sse(chat_response.error_body(message, 502))
