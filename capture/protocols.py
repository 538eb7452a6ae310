"""The provider protocols the gateway speaks: parsing, errors and response shapes of each.

The gateway's turn logic (assemble, generate, parse, record) is the same for every provider;
what differs is here: how a body becomes a :class:`ChatRequest`, how errors look, and how the
policy's answer is written back, whole or as a stream.
"""

from __future__ import annotations

import json
import secrets
from typing import Any, Protocol

from aiohttp import web

from rewriter import anthropic_messages, gemini, openai_chat
from rewriter.canonical import AssistantReply, ChatRequest, Message
from rewriter.parsers import ContentDelta, ParseEvent, ReasoningDelta, ToolCallEvent
from rewriter.vllm_client import Completion, PolicyError


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


class StreamWriter(Protocol):
    def start(self) -> bytes: ...

    def events(self, events: list[ParseEvent]) -> bytes: ...

    def finish(self, completion: Completion, reply: AssistantReply) -> tuple[bytes, str]:
        """The closing events up to (not including) the final one, and the finish reason
        recorded for the turn. The turn is made durable before :meth:`end` is sent."""
        ...

    def end(self) -> bytes: ...

    def error(self, message: str) -> bytes: ...


class ProviderProtocol(Protocol):
    name: str

    def parse(self, body: bytes) -> ChatRequest: ...

    def error(self, status: int, message: str, param: str | None = None) -> web.Response: ...

    def prompt_too_long(self, prompt_tokens: int, max_model_len: int) -> web.Response: ...

    def policy_error(self, exc: PolicyError) -> web.Response: ...

    def response(
        self,
        response_id: str,
        chat: ChatRequest,
        prompt_tokens: int,
        completion: Completion,
        reply: AssistantReply,
    ) -> tuple[dict[str, Any], str]: ...

    def stream_writer(
        self, response_id: str, chat: ChatRequest, prompt_tokens: int
    ) -> StreamWriter: ...

    def new_response_id(self) -> str: ...

    def recorded_reply(self, reply: AssistantReply) -> Message:
        """The reply as the client saw it (its tool-call ids), for the thread's records."""
        ...


# -- OpenAI chat completions -------------------------------------------------------------------


class OpenAIChat:
    name = "openai.chat"

    def parse(self, body: bytes) -> ChatRequest:
        return openai_chat.parse_request(body)

    def error(self, status: int, message: str, param: str | None = None) -> web.Response:
        return web.json_response(openai_chat.error_body(message, status, param), status=status)

    def prompt_too_long(self, prompt_tokens: int, max_model_len: int) -> web.Response:
        body = openai_chat.error_body(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"messages resulted in {prompt_tokens} tokens. Please reduce the length of the "
            "messages.",
            400,
            "messages",
        )
        body["error"]["code"] = "context_length_exceeded"
        return web.json_response(body, status=400)

    def policy_error(self, exc: PolicyError) -> web.Response:
        if exc.status == 400:
            return self.error(400, str(exc))
        if exc.unavailable:
            return self.error(503, f"the policy server is unavailable: {exc}")
        return self.error(502, str(exc))

    def new_response_id(self) -> str:
        return "chatcmpl-" + secrets.token_hex(12)

    def recorded_reply(self, reply: AssistantReply) -> Message:
        return reply.as_message()

    def response(
        self,
        response_id: str,
        chat: ChatRequest,
        prompt_tokens: int,
        completion: Completion,
        reply: AssistantReply,
    ) -> tuple[dict[str, Any], str]:
        reason = openai_chat.finish_reason(completion.finish_reason, reply)
        body = openai_chat.completion_response(
            response_id, chat.model, reply, reason, prompt_tokens, len(completion.token_ids)
        )
        return body, reason

    def stream_writer(
        self, response_id: str, chat: ChatRequest, prompt_tokens: int
    ) -> StreamWriter:
        return _OpenAIStream(response_id, chat, prompt_tokens)


class _OpenAIStream:
    def __init__(self, response_id: str, chat: ChatRequest, prompt_tokens: int) -> None:
        self.writer = openai_chat.ChunkWriter(response_id, chat.model)
        self.include_usage = chat.include_usage
        self.prompt_tokens = prompt_tokens

    def start(self) -> bytes:
        return _sse(self.writer.role())

    def events(self, events: list[ParseEvent]) -> bytes:
        out = []
        for event in events:
            if isinstance(event, ContentDelta):
                out.append(_sse(self.writer.content(event.text)))
            elif isinstance(event, ReasoningDelta):
                out.append(_sse(self.writer.reasoning(event.text)))
            elif isinstance(event, ToolCallEvent):
                out.append(_sse(self.writer.tool_call(event.index, event.call)))
        return b"".join(out)

    def finish(self, completion: Completion, reply: AssistantReply) -> tuple[bytes, str]:
        reason = openai_chat.finish_reason(completion.finish_reason, reply)
        out = _sse(self.writer.finish(reason))
        if self.include_usage:
            out += _sse(self.writer.usage(self.prompt_tokens, len(completion.token_ids)))
        return out, reason

    def end(self) -> bytes:
        return b"data: [DONE]\n\n"

    def error(self, message: str) -> bytes:
        return _sse(openai_chat.error_body(message, 502))


# -- Anthropic Messages ----------------------------------------------------------------------


class AnthropicMessages:
    name = "anthropic.messages"

    def __init__(self, normalization: anthropic_messages.Normalization) -> None:
        self.normalization = normalization

    def parse(self, body: bytes) -> ChatRequest:
        return anthropic_messages.parse_request(body, self.normalization)

    def parse_count_tokens(self, body: bytes) -> ChatRequest:
        return anthropic_messages.parse_request(body, self.normalization, count_tokens=True)

    def error(self, status: int, message: str, param: str | None = None) -> web.Response:
        body = anthropic_messages.error_body(message, status)
        return web.json_response(body, status=status, headers={"request-id": body["request_id"]})

    def prompt_too_long(self, prompt_tokens: int, max_model_len: int) -> web.Response:
        return self.error(
            400, anthropic_messages.prompt_too_long_message(prompt_tokens, max_model_len)
        )

    def policy_error(self, exc: PolicyError) -> web.Response:
        if exc.status == 400:
            return self.error(400, str(exc))
        if exc.unavailable:
            # Anthropic's "overloaded": clients back off and retry.
            return self.error(529, f"Overloaded: the policy server is unavailable ({exc})")
        return self.error(500, f"the policy server failed: {exc}")

    def new_response_id(self) -> str:
        return anthropic_messages.new_message_id()

    def recorded_reply(self, reply: AssistantReply) -> Message:
        return anthropic_messages.with_client_ids(reply).as_message()

    def response(
        self,
        response_id: str,
        chat: ChatRequest,
        prompt_tokens: int,
        completion: Completion,
        reply: AssistantReply,
    ) -> tuple[dict[str, Any], str]:
        reason = anthropic_messages.stop_reason(
            completion.finish_reason, completion.stop_reason, reply
        )
        body = anthropic_messages.message_response(
            response_id, chat.model, reply, reason, prompt_tokens, len(completion.token_ids)
        )
        return body, reason[0]

    def stream_writer(
        self, response_id: str, chat: ChatRequest, prompt_tokens: int
    ) -> StreamWriter:
        return _AnthropicStream(response_id, chat, prompt_tokens)


class _AnthropicStream:
    def __init__(self, response_id: str, chat: ChatRequest, prompt_tokens: int) -> None:
        self.writer = anthropic_messages.EventWriter(response_id, chat.model, prompt_tokens)
        self._final: list[dict[str, Any]] = []

    @staticmethod
    def _join(events: list[dict[str, Any]]) -> bytes:
        return b"".join(anthropic_messages.sse(e) for e in events)

    def start(self) -> bytes:
        return self._join(self.writer.start())

    def events(self, events: list[ParseEvent]) -> bytes:
        return self._join(self.writer.events(events))

    def finish(self, completion: Completion, reply: AssistantReply) -> tuple[bytes, str]:
        reason = anthropic_messages.stop_reason(
            completion.finish_reason, completion.stop_reason, reply
        )
        events = self.writer.finish(reason, len(completion.token_ids))
        # message_stop goes out only once the turn is durable.
        self._final = events[-1:]
        return self._join(events[:-1]), reason[0]

    def end(self) -> bytes:
        return self._join(self._final)

    def error(self, message: str) -> bytes:
        return anthropic_messages.sse(anthropic_messages.error_body(message, 500))


# -- Gemini API ------------------------------------------------------------------------------


class GeminiAPI:
    """``generateContent`` / ``streamGenerateContent`` on one model: Gemini names the model and
    whether to stream in the URL, so one instance serves one request's route."""

    name = "gemini.generate_content"

    def __init__(self, route: gemini.Route | None = None) -> None:
        self.route = route or gemini.Route("other", "v1beta")

    def parse(self, body: bytes) -> ChatRequest:
        return gemini.parse_request(body, self.route.model, stream=self.route.kind == "stream")

    def parse_count_tokens(self, body: bytes) -> ChatRequest:
        return gemini.parse_count_tokens(body, self.route.model)

    def error(self, status: int, message: str, param: str | None = None) -> web.Response:
        return web.json_response(gemini.error_body(status, message), status=status)

    def prompt_too_long(self, prompt_tokens: int, max_model_len: int) -> web.Response:
        return self.error(400, gemini.prompt_too_long_message(prompt_tokens, max_model_len))

    def policy_error(self, exc: PolicyError) -> web.Response:
        if exc.status == 400:
            return self.error(400, str(exc))
        if exc.unavailable:
            # UNAVAILABLE: Google's clients back off and retry.
            return self.error(
                503, f"The policy server is unavailable ({exc}); try again in a moment."
            )
        return self.error(500, f"The policy server failed: {exc}")

    def new_response_id(self) -> str:
        return gemini.new_response_id()

    def recorded_reply(self, reply: AssistantReply) -> Message:
        # Function calls carry the parser's ids, which the client is given as functionCall.id.
        return reply.as_message()

    def response(
        self,
        response_id: str,
        chat: ChatRequest,
        prompt_tokens: int,
        completion: Completion,
        reply: AssistantReply,
    ) -> tuple[dict[str, Any], str]:
        reason = gemini.finish_reason(completion.finish_reason)
        body = gemini.generate_response(
            response_id,
            chat.model,
            reply,
            reason,
            prompt_tokens,
            len(completion.token_ids),
            include_thoughts=_include_thoughts(chat),
        )
        return body, reason

    def stream_writer(
        self, response_id: str, chat: ChatRequest, prompt_tokens: int
    ) -> StreamWriter:
        return _GeminiStream(response_id, chat, prompt_tokens)


def _include_thoughts(chat: ChatRequest) -> bool:
    return isinstance(chat, gemini.GeminiChatRequest) and chat.include_thoughts


class _GeminiStream:
    def __init__(self, response_id: str, chat: ChatRequest, prompt_tokens: int) -> None:
        self.writer = gemini.ChunkWriter(
            response_id, chat.model, prompt_tokens, _include_thoughts(chat)
        )
        self._final = b""

    def start(self) -> bytes:
        return b""  # Gemini's stream has no opening event: its first chunk carries content

    def events(self, events: list[ParseEvent]) -> bytes:
        return b"".join(gemini.sse(c) for c in self.writer.chunks(events))

    def finish(self, completion: Completion, reply: AssistantReply) -> tuple[bytes, str]:
        reason = gemini.finish_reason(completion.finish_reason)
        # The chunk with finishReason goes out only once the turn is durable.
        self._final = gemini.sse(self.writer.finish(reason, len(completion.token_ids)))
        return b"", reason

    def end(self) -> bytes:
        return self._final

    def error(self, message: str) -> bytes:
        return gemini.sse(gemini.error_body(500, f"The policy server failed: {message}"))
