"""Gemini answers: GenerateContentResponse objects and chunks, the SSE chunk writer, token counts,
models and Google's error JSON.
"""

from __future__ import annotations

import secrets
from typing import Any

from rewriter import wire
from rewriter.canonical import (
    AssistantReply,
    ToolCall,
)
from rewriter.parsers import ContentDelta, ParseEvent, ReasoningDelta, ToolCallEvent
from rewriter.providers.gemini.request import model_name
from rewriter.providers.gemini.routes import GENERATION_METHODS

# -- response --------------------------------------------------------------------------------

_STATUS_NAMES = {
    400: "INVALID_ARGUMENT",
    401: "UNAUTHENTICATED",
    403: "PERMISSION_DENIED",
    404: "NOT_FOUND",
    409: "ABORTED",
    413: "INVALID_ARGUMENT",
    429: "RESOURCE_EXHAUSTED",
    500: "INTERNAL",
    501: "UNIMPLEMENTED",
    502: "UNAVAILABLE",
    503: "UNAVAILABLE",
    504: "DEADLINE_EXCEEDED",
}


def status_name(code: int) -> str:
    return _STATUS_NAMES.get(code, "INTERNAL" if code >= 500 else "INVALID_ARGUMENT")


def error_body(code: int, message: str) -> dict[str, Any]:
    return {"error": {"code": code, "message": message, "status": status_name(code)}}


def prompt_too_long_message(prompt_tokens: int, max_tokens: int) -> str:
    # Google's own wording for an over-long input.
    return (
        f"The input token count ({prompt_tokens}) exceeds the maximum number of tokens allowed "
        f"({max_tokens})."
    )


def new_response_id() -> str:
    return secrets.token_urlsafe(16)


def finish_reason(vllm_reason: str | None) -> str:
    """Gemini's ``finishReason``: function calls and stop sequences end with STOP too."""
    return "MAX_TOKENS" if vllm_reason == "length" else "STOP"


def function_args(call: ToolCall) -> dict[str, Any]:
    value = call.arguments_object()
    # Gemini's `args` is always an object.
    return value if isinstance(value, dict) else {"input": value}


def function_call_part(call: ToolCall) -> dict[str, Any]:
    # The id lets a client answer with it, so the trajectory matches results to calls exactly.
    return {"functionCall": {"id": call.id, "name": call.name, "args": function_args(call)}}


def usage_metadata(
    prompt_tokens: int, output_tokens: int, thoughts_tokens: int = 0
) -> dict[str, Any]:
    """``candidatesTokenCount`` excludes thoughts; ``totalTokenCount`` counts everything."""
    out: dict[str, Any] = {
        "promptTokenCount": prompt_tokens,
        "candidatesTokenCount": output_tokens - thoughts_tokens,
        "totalTokenCount": prompt_tokens + output_tokens,
        "promptTokensDetails": [{"modality": "TEXT", "tokenCount": prompt_tokens}],
    }
    if thoughts_tokens:
        out["thoughtsTokenCount"] = thoughts_tokens
    return out


def response_parts(reply: AssistantReply, include_thoughts: bool) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = []
    reasoning = (reply.reasoning or "").strip()
    if include_thoughts and reasoning:
        parts.append({"text": reasoning, "thought": True})
    text = reply.content.strip()
    if text:
        parts.append({"text": text})
    parts.extend(function_call_part(c) for c in reply.tool_calls)
    if not parts:
        parts.append({"text": ""})
    return parts


def _response(
    response_id: str,
    model: str,
    parts: list[dict[str, Any]] | None,
    reason: str | None,
    usage: dict[str, Any] | None,
) -> dict[str, Any]:
    candidate: dict[str, Any] = {"index": 0}
    if parts is not None:
        candidate["content"] = {"parts": parts, "role": "model"}
    if reason is not None:
        candidate["finishReason"] = reason
    out: dict[str, Any] = {"candidates": [candidate]}
    if usage is not None:
        out["usageMetadata"] = usage
    out["modelVersion"] = model
    out["responseId"] = response_id
    return out


def generate_response(
    response_id: str,
    model: str,
    reply: AssistantReply,
    reason: str,
    prompt_tokens: int,
    output_tokens: int,
    *,
    include_thoughts: bool = False,
    thoughts_tokens: int = 0,
) -> dict[str, Any]:
    return _response(
        response_id,
        model,
        response_parts(reply, include_thoughts),
        reason,
        usage_metadata(prompt_tokens, output_tokens, thoughts_tokens),
    )


def sse(chunk: dict[str, Any]) -> bytes:
    # The line ending Google's servers use; every SDK splits on it.
    return wire.sse(chunk, terminator=b"\r\n\r\n")


class ChunkWriter:
    """The ``GenerateContentResponse`` chunks of one ``streamGenerateContent`` answer.

    Text goes out as it arrives; whitespace at the edges of the reply's text is held back (as
    the whole answer strips it), so ``"\\n\\n<tool_call>..."`` streams as a function call alone.
    Thoughts are sent only when the request asked for them (``includeThoughts``).
    """

    def __init__(
        self, response_id: str, model: str, prompt_tokens: int, include_thoughts: bool = False
    ) -> None:
        self.response_id = response_id
        self.model = model
        self.prompt_tokens = prompt_tokens
        self.include_thoughts = include_thoughts
        self.sent_parts = 0
        self._held: dict[str, str] = {"text": "", "thought": ""}
        self._started: dict[str, bool] = {"text": False, "thought": False}

    def _chunk(self, parts: list[dict[str, Any]]) -> dict[str, Any]:
        self.sent_parts += len(parts)
        usage = {"promptTokenCount": self.prompt_tokens, "totalTokenCount": self.prompt_tokens}
        return _response(self.response_id, self.model, parts, None, usage)

    def _text(self, kind: str, text: str) -> dict[str, Any] | None:
        if not self._started[kind]:
            text = text.lstrip()
            if not text:
                return None
            self._started[kind] = True
        text = self._held[kind] + text
        body = text.rstrip()
        self._held[kind] = text[len(body) :]
        if not body:
            return None
        part: dict[str, Any] = {"text": body}
        if kind == "thought":
            part["thought"] = True
        return part

    def chunks(self, events: list[ParseEvent]) -> list[dict[str, Any]]:
        """The chunks for these parser events: one per event that has something to send."""
        out: list[dict[str, Any]] = []
        for event in events:
            part: dict[str, Any] | None = None
            if isinstance(event, ContentDelta):
                part = self._text("text", event.text)
            elif isinstance(event, ReasoningDelta):
                if self.include_thoughts:
                    part = self._text("thought", event.text)
            elif isinstance(event, ToolCallEvent):
                part = function_call_part(event.call)
            if part is not None:
                out.append(self._chunk([part]))
        return out

    def finish(self, reason: str, output_tokens: int, thoughts_tokens: int = 0) -> dict[str, Any]:
        """The last chunk: the finish reason and the usage (an empty text part if nothing at
        all was sent, as Gemini answers an empty reply)."""
        parts = [] if self.sent_parts else [{"text": ""}]
        self.sent_parts += len(parts)
        usage = usage_metadata(self.prompt_tokens, output_tokens, thoughts_tokens)
        return _response(self.response_id, self.model, parts or None, reason, usage)

    def error(self, code: int, message: str) -> dict[str, Any]:
        return error_body(code, message)


def count_tokens_response(total_tokens: int) -> dict[str, Any]:
    return {
        "totalTokens": total_tokens,
        "promptTokensDetails": [{"modality": "TEXT", "tokenCount": total_tokens}],
    }


def model_object(
    name: str, input_token_limit: int | None = None, output_token_limit: int | None = None
) -> dict[str, Any]:
    name = model_name(name)
    out: dict[str, Any] = {
        "name": f"models/{name}",
        "baseModelId": name,
        "version": "agenttap",
        "displayName": name,
        "description": f"{name}, answered by the agenttap policy",
        "supportedGenerationMethods": list(GENERATION_METHODS),
        "thinking": True,
    }
    if input_token_limit:
        out["inputTokenLimit"] = input_token_limit
        out["outputTokenLimit"] = output_token_limit or input_token_limit
    return out


def models_list(
    names: list[str], input_token_limit: int | None = None, output_token_limit: int | None = None
) -> dict[str, Any]:
    return {"models": [model_object(n, input_token_limit, output_token_limit) for n in names]}
