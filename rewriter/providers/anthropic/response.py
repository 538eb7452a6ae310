"""Anthropic Messages answers: the message object, its content blocks, error JSON and the SSE event
writer (message_start ... message_stop).
"""

from __future__ import annotations

import hashlib
import json
import secrets
from dataclasses import replace
from typing import Any

from rewriter import wire
from rewriter.canonical import (
    AssistantReply,
    ToolCall,
)
from rewriter.parsers import ContentDelta, ParseEvent, ReasoningDelta, ToolCallEvent

# -- response --------------------------------------------------------------------------------

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    529: "overloaded_error",
}


def new_request_id() -> str:
    return "req_" + secrets.token_hex(12)


def error_body(message: str, status: int, request_id: str | None = None) -> dict[str, Any]:
    kind = _ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {
        "type": "error",
        "error": {"type": kind, "message": message},
        "request_id": request_id or new_request_id(),
    }


def prompt_too_long_message(prompt_tokens: int, max_tokens: int) -> str:
    # Claude Code looks for "prompt is too long" to decide to compact its history.
    return f"prompt is too long: {prompt_tokens} tokens > {max_tokens} maximum"


def new_message_id() -> str:
    return "msg_" + secrets.token_hex(12)


def tool_use_id(call: ToolCall) -> str:
    """The id the client sees: derived from the parser's, so records and replies agree."""
    if call.id.startswith("toolu_"):
        return call.id
    return "toolu_" + (call.id.removeprefix("call_") or secrets.token_hex(12))


def with_client_ids(reply: AssistantReply) -> AssistantReply:
    """``reply`` with the tool-call ids the client was given."""
    calls = [replace(c, id=tool_use_id(c)) for c in reply.tool_calls]
    return replace(reply, tool_calls=calls)


def tool_input(call: ToolCall) -> dict[str, Any]:
    value = call.arguments_object()
    # Anthropic's `input` is always an object.
    return value if isinstance(value, dict) else {"input": value}


def thinking_signature(text: str) -> str:
    # Clients send thinking blocks back with their signature; ours only has to be stable.
    return "agenttap-" + hashlib.sha256(text.encode()).hexdigest()[:32]


def stop_reason(
    vllm_reason: str | None, vllm_stop: int | str | None, reply: AssistantReply
) -> tuple[str, str | None]:
    """(``stop_reason``, ``stop_sequence``) for vLLM's finish and stop reasons."""
    if vllm_reason == "length":
        return "max_tokens", None
    if reply.tool_calls:
        return "tool_use", None
    if isinstance(vllm_stop, str):
        return "stop_sequence", vllm_stop
    return "end_turn", None


def usage(input_tokens: int, output_tokens: int) -> dict[str, Any]:
    return {
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
    }


def content_blocks(reply: AssistantReply) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    reasoning = (reply.reasoning or "").strip()
    if reasoning:
        blocks.append(
            {"type": "thinking", "thinking": reasoning, "signature": thinking_signature(reasoning)}
        )
    text = reply.content.strip()
    if text or not reply.tool_calls:
        blocks.append({"type": "text", "text": text})
    for call in reply.tool_calls:
        blocks.append(
            {
                "type": "tool_use",
                "id": tool_use_id(call),
                "name": call.name,
                "input": tool_input(call),
            }
        )
    return blocks


def message_response(
    message_id: str,
    model: str,
    reply: AssistantReply,
    reason: tuple[str, str | None],
    input_tokens: int,
    output_tokens: int,
) -> dict[str, Any]:
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content_blocks(reply),
        "stop_reason": reason[0],
        "stop_sequence": reason[1],
        "usage": usage(input_tokens, output_tokens),
    }


def sse(event: dict[str, Any]) -> bytes:
    """An Anthropic event: named by its type, compact JSON (as Anthropic's servers send it)."""
    return wire.sse(event, event["type"], compact=True)


class EventWriter:
    """The SSE events of one streamed message, from the parser's events.

    Blocks open lazily and whitespace at a block's edges is held back, so a reply of
    ``"\\n\\n<tool_call>..."`` streams as one ``tool_use`` block, not an empty text block first.
    """

    def __init__(self, message_id: str, model: str, input_tokens: int) -> None:
        self.message_id = message_id
        self.model = model
        self.input_tokens = input_tokens
        self.index = -1  # of the last block started; -1: none yet
        self.open_kind: str | None = None  # "text" / "thinking"
        self._held = ""  # whitespace not yet sent: it may end the block
        self._thinking: list[str] = []

    def start(self) -> list[dict[str, Any]]:
        message: dict[str, Any] = {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": usage(self.input_tokens, 1),
        }
        return [{"type": "message_start", "message": message}, {"type": "ping"}]

    def _close(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if self.open_kind == "thinking":
            signature = thinking_signature("".join(self._thinking).strip())
            out.append(
                {
                    "type": "content_block_delta",
                    "index": self.index,
                    "delta": {"type": "signature_delta", "signature": signature},
                }
            )
        if self.open_kind is not None:
            out.append({"type": "content_block_stop", "index": self.index})
        self.open_kind = None
        self._held = ""
        self._thinking = []
        return out

    def _text(self, kind: str, text: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if self.open_kind != kind:
            text = text.lstrip()
            if not text:
                return out
            out.extend(self._close())
            self.index += 1
            self.open_kind = kind
            empty = (
                {"type": "thinking", "thinking": "", "signature": ""}
                if kind == "thinking"
                else {
                    "type": "text",
                    "text": "",
                }
            )
            out.append({"type": "content_block_start", "index": self.index, "content_block": empty})
        text = self._held + text
        body = text.rstrip()
        self._held = text[len(body) :]
        if body:
            if kind == "thinking":
                self._thinking.append(body)
                delta = {"type": "thinking_delta", "thinking": body}
            else:
                delta = {"type": "text_delta", "text": body}
            out.append({"type": "content_block_delta", "index": self.index, "delta": delta})
        return out

    def events(self, parsed: list[ParseEvent]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for event in parsed:
            if isinstance(event, ContentDelta):
                out.extend(self._text("text", event.text))
            elif isinstance(event, ReasoningDelta):
                out.extend(self._text("thinking", event.text))
            elif isinstance(event, ToolCallEvent):
                out.extend(self._close())
                self.index += 1
                call = event.call
                start = {
                    "type": "tool_use",
                    "id": tool_use_id(call),
                    "name": call.name,
                    "input": {},
                }
                out.append(
                    {"type": "content_block_start", "index": self.index, "content_block": start}
                )
                partial = json.dumps(tool_input(call), ensure_ascii=False)
                out.append(
                    {
                        "type": "content_block_delta",
                        "index": self.index,
                        "delta": {"type": "input_json_delta", "partial_json": partial},
                    }
                )
                out.append({"type": "content_block_stop", "index": self.index})
        return out

    def finish(self, reason: tuple[str, str | None], output_tokens: int) -> list[dict[str, Any]]:
        out = self._close()
        if self.index < 0:  # no block was sent
            # A message always has a content block, as Anthropic's own empty replies do.
            self.index += 1
            empty = {"type": "text", "text": ""}
            out.append({"type": "content_block_start", "index": self.index, "content_block": empty})
            out.append({"type": "content_block_stop", "index": self.index})
        out.append(
            {
                "type": "message_delta",
                "delta": {"stop_reason": reason[0], "stop_sequence": reason[1]},
                "usage": usage(self.input_tokens, output_tokens),
            }
        )
        out.append({"type": "message_stop"})
        return out


def model_object(name: str) -> dict[str, Any]:
    return {
        "type": "model",
        "id": name,
        "display_name": name,
        "created_at": "2025-01-01T00:00:00Z",
    }


def models_list(names: list[str]) -> dict[str, Any]:
    return {
        "data": [model_object(n) for n in names],
        "has_more": False,
        "first_id": names[0] if names else None,
        "last_id": names[-1] if names else None,
    }
