"""Anthropic Messages requests: the wire schema, normalization of scaffold noise, and translation to
the canonical chat form.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import Field, ValidationError

from rewriter import jsonbody
from rewriter.canonical import (
    ChatRequest,
    Message,
    RequestError,
    SamplingParams,
    ToolCall,
    ToolSpec,
)
from rewriter.shapes import expect_list, expect_object
from rewriter.wire import Lenient

# Claude Code's system block 0: its `cch=` value changes on every call.
BILLING_HEADER_RE = r"^x-anthropic-billing-header:"
# How text blocks of one message are joined into the canonical message's text.
BLOCK_SEPARATOR = "\n\n"


@dataclass(frozen=True)
class Normalization:
    """Scaffold noise removed before rendering (documented in docs/PROVIDERS.md, "Normalization").

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
