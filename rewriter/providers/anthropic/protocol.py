"""Anthropic Messages (``POST /v1/messages``) <-> the canonical chat form.

Requests are normalized before they become canonical messages, so that the policy sees the same
tokens for the same conversation on every call (see :class:`Normalization`). Responses are built
as Anthropic's message object, or as its exact SSE event sequence by :class:`EventWriter`.
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from pydantic import Field, ValidationError

from rewriter import jsonbody, wire
from rewriter.canonical import (
    AssistantReply,
    ChatRequest,
    Message,
    RequestError,
    SamplingParams,
    ToolCall,
    ToolSpec,
)
from rewriter.parsers import ContentDelta, ParseEvent, ReasoningDelta, ToolCallEvent
from rewriter.shapes import expect_list, expect_object
from rewriter.wire import Lenient

# Claude Code's system block 0: its `cch=` value changes on every call.
BILLING_HEADER_RE = r"^x-anthropic-billing-header:"
# How text blocks of one message are joined into the canonical message's text.
BLOCK_SEPARATOR = "\n\n"


@dataclass(frozen=True)
class Normalization:
    """Scaffold noise removed before rendering (documented in README, "Normalization").

    ``drop_system_blocks``: text blocks of ``system`` (top-level or a ``role: "system"``
    message) matching any of these regexes are dropped. ``cache_control``, ``citations`` and
    block ids never reach the template: only the text of a block is rendered.
    """

    drop_system_blocks: tuple[re.Pattern[str], ...] = field(
        default_factory=lambda: (re.compile(BILLING_HEADER_RE),)
    )

    @classmethod
    def from_option(cls, patterns: str) -> Normalization:
        """``patterns``: regexes separated by ``||``; empty keeps every system block."""
        compiled = []
        for raw in patterns.split("||"):
            if raw.strip():
                try:
                    compiled.append(re.compile(raw.strip()))
                except re.error as exc:
                    raise ValueError(f"bad regex {raw.strip()!r}: {exc}") from None
        return cls(tuple(compiled))

    def keep_system_text(self, text: str) -> bool:
        return not any(p.search(text) for p in self.drop_system_blocks)


# -- request ---------------------------------------------------------------------------------


class MessageIn(Lenient):
    role: Literal["user", "assistant", "system"]
    content: str | list[dict[str, Any]]


class MessagesRequestIn(Lenient):
    model: str
    messages: list[MessageIn] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0)
    stop_sequences: list[str] | None = None
    stream: bool | None = False
    output_config: dict[str, Any] | None = None
    # The structured-outputs beta's spelling of output_config.format.
    output_format: dict[str, Any] | None = None


_UNSUPPORTED_BLOCKS = {
    "image": "image",
    "document": "document",
    "search_result": "search result",
    "container_upload": "file",
}


def _unsupported(kind: str, where: str) -> RequestError:
    what = _UNSUPPORTED_BLOCKS.get(kind)
    if what is not None:
        return RequestError(
            f"{where}: {what} content is not supported: the policy served by this proxy reads "
            "text only. Send the content as text instead.",
            param=where,
        )
    return RequestError(
        f"{where}: content block type {kind!r} is not supported by this proxy (it takes text, "
        "thinking, redacted_thinking, tool_use and tool_result blocks).",
        param=where,
    )


def _texts(blocks: str | list[dict[str, Any]], where: str) -> list[str]:
    """The texts of a string or a list of text blocks."""
    if isinstance(blocks, str):
        return [blocks]
    out: list[str] = []
    for j, item in enumerate(expect_list(blocks, where)):
        block = expect_object(item, f"{where}.{j}")
        kind = block.get("type")
        if kind != "text":
            raise _unsupported(str(kind), f"{where}.{j}")
        out.append(str(block.get("text", "")))
    return out


def _join(texts: list[str]) -> str:
    return BLOCK_SEPARATOR.join(t for t in texts if t)


def _tool_result_text(block: dict[str, Any], where: str) -> str:
    content = block.get("content", "")
    text = _join(_texts(content, f"{where}.content")) if content else ""
    # The template has no error flag for tool results; the policy still needs to know.
    if block.get("is_error"):
        text = "Error: " + text if text else "Error"
    return text


def _user_messages(content: str | list[dict[str, Any]], where: str) -> list[Message]:
    """One Anthropic user message -> canonical tool results and user turns, in order."""
    if isinstance(content, str):
        return [Message(role="user", content=content)]
    out: list[Message] = []
    texts: list[str] = []

    def flush() -> None:
        if texts:
            out.append(Message(role="user", content=_join(texts)))
            texts.clear()

    for j, block in enumerate(content):
        kind = block.get("type")
        if kind == "text":
            texts.append(str(block.get("text", "")))
        elif kind == "tool_result":
            flush()
            out.append(
                Message(
                    role="tool",
                    content=_tool_result_text(block, f"{where}.{j}"),
                    tool_call_id=str(block.get("tool_use_id", "")),
                )
            )
        else:
            raise _unsupported(str(kind), f"{where}.{j}")
    flush()
    if not out:
        out.append(Message(role="user", content=""))
    return out


def _assistant_message(content: str | list[dict[str, Any]], where: str) -> Message:
    if isinstance(content, str):
        return Message(role="assistant", content=content)
    texts: list[str] = []
    thinking: list[str] = []
    calls: list[ToolCall] = []
    for j, block in enumerate(content):
        kind = block.get("type")
        if kind == "text":
            texts.append(str(block.get("text", "")))
        elif kind == "thinking":
            thinking.append(str(block.get("thinking", "")))
        elif kind == "redacted_thinking":
            continue  # opaque to anyone but its author; the policy never wrote one
        elif kind == "tool_use":
            calls.append(
                ToolCall(
                    id=str(block.get("id", "")),
                    name=str(block.get("name", "")),
                    arguments=json.dumps(block.get("input", {}), ensure_ascii=False),
                )
            )
        else:
            raise _unsupported(str(kind), f"{where}.{j}")
    return Message(
        role="assistant",
        content=_join(texts),
        reasoning=_join(thinking) or None,
        tool_calls=tuple(calls),
    )


def _system_text(
    system: str | list[dict[str, Any]], where: str, normalization: Normalization
) -> str:
    return _join([t for t in _texts(system, where) if normalization.keep_system_text(t)])


def _tools(tools: list[dict[str, Any]] | None) -> list[ToolSpec]:
    out: list[ToolSpec] = []
    for i, tool in enumerate(tools or []):
        name = tool.get("name")
        if not isinstance(name, str) or not name:
            raise RequestError(f"tools.{i}.name: Field required", param=f"tools.{i}.name")
        if "input_schema" not in tool:
            # Server tools (web_search_..., code_execution_...) run at Anthropic; nothing here
            # can run them, so the policy is not offered them.
            if tool.get("type", "custom") not in ("custom", None):
                continue
            raise RequestError(
                f"tools.{i}.input_schema: Field required", param=f"tools.{i}.input_schema"
            )
        out.append(
            ToolSpec(
                name=name,
                description=str(tool.get("description") or ""),
                parameters=dict(
                    expect_object(tool.get("input_schema") or {}, f"tools.{i}.input_schema")
                ),
            )
        )
    return out


def _tool_choice(choice: dict[str, Any] | None) -> str | dict[str, Any] | None:
    if not choice:
        return None
    kind = choice.get("type")
    if kind == "auto":
        return "auto"
    if kind == "any":
        return "required"
    if kind == "none":
        return "none"
    if kind == "tool":
        return {"type": "function", "function": {"name": choice.get("name", "")}}
    raise RequestError(
        f"tool_choice.type: Input should be 'auto', 'any', 'tool' or 'none' (got {kind!r})",
        param="tool_choice.type",
    )


def _json_schema(req: MessagesRequestIn) -> dict[str, Any] | None:
    fmt = (req.output_config or {}).get("format") or req.output_format
    if not fmt:
        return None
    if (
        not isinstance(fmt, dict)
        or fmt.get("type") != "json_schema"
        or not isinstance(fmt.get("schema"), dict)
    ):
        raise RequestError(
            "output_config.format: only {'type': 'json_schema', 'schema': {...}} is supported",
            param="output_config.format",
        )
    schema: dict[str, Any] = fmt["schema"]
    return schema


def _enable_thinking(thinking: dict[str, Any] | None) -> bool:
    # Anthropic's default is no thinking; `adaptive` lets the model decide, which a Qwen3-style
    # template's thinking switch can only express as "on".
    if not thinking:
        return False
    kind = thinking.get("type")
    if kind in ("enabled", "adaptive"):
        return True
    if kind == "disabled":
        return False
    raise RequestError(
        f"thinking.type: Input should be 'enabled', 'adaptive' or 'disabled' (got {kind!r})",
        param="thinking.type",
    )


def _format_validation_error(exc: ValidationError) -> RequestError:
    first = exc.errors()[0]
    # pydantic names the union member it tried ("content.str", "content.list[...]"): drop it.
    loc = ".".join(
        str(p) for p in first["loc"] if not (isinstance(p, str) and ("[" in p or p == "str"))
    )
    if first["type"] == "missing":
        return RequestError(f"{loc}: Field required", param=loc)
    return RequestError(f"{loc}: {first['msg']}", param=loc)


def parse_request(
    body: bytes,
    normalization: Normalization | None = None,
    *,
    count_tokens: bool = False,
) -> ChatRequest:
    """A Messages request (or a ``count_tokens`` one, which has no ``max_tokens``)."""
    normalization = normalization or Normalization()
    try:
        raw = jsonbody.loads(body)
    except jsonbody.JSONBodyError as exc:
        raise RequestError(f"The request body is not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise RequestError("The request body must be a JSON object.")
    try:
        req = MessagesRequestIn.model_validate(raw)
    except ValidationError as exc:
        raise _format_validation_error(exc) from None
    if req.max_tokens is None and not count_tokens:
        raise RequestError("max_tokens: Field required", param="max_tokens")

    messages: list[Message] = []
    if req.system:
        text = _system_text(req.system, "system", normalization)
        if text:
            messages.append(Message(role="system", content=text))
    for i, m in enumerate(req.messages):
        where = f"messages.{i}.content"
        if m.role == "user":
            messages.extend(_user_messages(m.content, where))
        elif m.role == "assistant":
            messages.append(_assistant_message(m.content, where))
        else:  # Claude Code sends role "system" messages in the middle of a conversation
            text = _system_text(m.content, where, normalization)
            if text:
                messages.append(Message(role="system", content=text))

    schema = _json_schema(req)
    thinking = _enable_thinking(req.thinking)
    if schema is not None:
        # The schema constrains the completion from its first token: no room for a <think>.
        thinking = False
    sampling = SamplingParams(
        max_tokens=req.max_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        stop=list(req.stop_sequences or []),
        json_schema=schema,
    )
    return ChatRequest(
        messages=messages,
        model=req.model,
        tools=_tools(req.tools),
        tool_choice=_tool_choice(req.tool_choice),
        sampling=sampling,
        stream=bool(req.stream),
        enable_thinking=thinking,
    )


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
