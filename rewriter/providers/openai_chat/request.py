"""OpenAI Chat Completions requests: the wire schema and translation to the canonical chat form."""

from __future__ import annotations

import json
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
from rewriter.shapes import expect_object
from rewriter.wire import Lenient

# -- request ---------------------------------------------------------------------------------


class FunctionCallIn(Lenient):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCallIn(Lenient):
    id: str = ""
    type: str = "function"
    function: FunctionCallIn


class MessageIn(Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None


class FunctionSpecIn(Lenient):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ToolSpecIn(Lenient):
    type: str = "function"
    function: FunctionSpecIn


class ChatCompletionRequestIn(Lenient):
    model: str
    messages: list[MessageIn] = Field(min_length=1)
    tools: list[ToolSpecIn] | None = None
    tool_choice: str | dict[str, Any] | None = None
    # OpenAI takes null for its optional parameters (some clients send every field).
    stream: bool | None = False
    stream_options: dict[str, Any] | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    n: int | None = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    response_format: dict[str, Any] | None = None
    # vLLM's extra sampling parameters, accepted as vLLM's own OpenAI server accepts them.
    top_k: int | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None


def _text_of(content: str | list[dict[str, Any]] | None, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts: list[str] = []
    for part in content:
        kind = part.get("type")
        if kind == "text":
            parts.append(str(part.get("text", "")))
        elif kind in ("image_url", "input_image", "input_audio", "file"):
            raise RequestError(
                f"{where}: content part of type {kind!r} is not supported; the policy served by "
                "this proxy takes text only",
                param=where,
            )
        else:
            raise RequestError(f"{where}: unknown content part type {kind!r}", param=where)
    return "".join(parts)


def _format_validation_error(exc: ValidationError) -> RequestError:
    first = exc.errors()[0]
    loc = ".".join(str(p) for p in first["loc"])
    if first["type"] == "missing":
        return RequestError(f"Missing required parameter: '{loc}'.", param=loc)
    if first["type"] == "literal_error" and loc.endswith("role"):
        return RequestError(
            f"Invalid value for '{loc}': {first.get('input')!r}. Supported roles are 'system', "
            "'developer', 'user', 'assistant' and 'tool'.",
            param=loc,
        )
    return RequestError(f"Invalid value for '{loc}': {first['msg']}.", param=loc)


def load_json_object(body: bytes) -> dict[str, Any]:
    """A request body as a JSON object, or OpenAI's 400 saying why not (Chat and Responses)."""
    try:
        raw = jsonbody.loads(body)
    except jsonbody.JSONBodyError as exc:
        raise RequestError(
            f"We could not parse the JSON body of your request ({exc}). The body must be a JSON "
            "object."
        ) from None
    if not isinstance(raw, dict):
        raise RequestError("The request body must be a JSON object.")
    return raw


def parse_request(body: bytes) -> ChatRequest:
    raw = load_json_object(body)
    try:
        req = ChatCompletionRequestIn.model_validate(raw)
    except ValidationError as exc:
        raise _format_validation_error(exc) from None
    if req.n not in (None, 1):
        raise RequestError("Only n=1 is supported by this proxy.", param="n")

    messages: list[Message] = []
    for i, m in enumerate(req.messages):
        where = f"messages.[{i}].content"
        calls = tuple(
            ToolCall(
                id=c.id,
                name=c.function.name,
                arguments=c.function.arguments
                if isinstance(c.function.arguments, str)
                else json.dumps(c.function.arguments, ensure_ascii=False),
            )
            for c in (m.tool_calls or [])
        )
        role = "system" if m.role == "developer" else m.role
        if role == "tool" and not m.tool_call_id:
            raise RequestError(
                f"Missing parameter 'tool_call_id' in messages.[{i}] (role 'tool').",
                param=f"messages.[{i}].tool_call_id",
            )
        messages.append(
            Message(
                role=role,
                content=_text_of(m.content, where),
                reasoning=m.reasoning_content if m.reasoning_content is not None else m.reasoning,
                tool_calls=calls,
                tool_call_id=m.tool_call_id,
                name=m.name,
            )
        )

    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    schema: dict[str, Any] | None = None
    if req.response_format:
        kind = req.response_format.get("type")
        if kind == "json_schema":
            spec = expect_object(
                req.response_format.get("json_schema") or {}, "response_format.json_schema"
            )
            schema = expect_object(spec.get("schema") or {}, "response_format.json_schema.schema")
        elif kind == "json_object":
            schema = {"type": "object"}
    sampling = SamplingParams(
        max_tokens=req.max_completion_tokens or req.max_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        min_tokens=req.min_tokens,
        seed=req.seed,
        stop=stop,
        ignore_eos=req.ignore_eos,
        json_schema=schema,
    )
    kwargs = req.chat_template_kwargs or {}
    return ChatRequest(
        messages=messages,
        model=req.model,
        tools=[
            ToolSpec(t.function.name, t.function.description or "", t.function.parameters or {})
            for t in (req.tools or [])
        ],
        tool_choice=req.tool_choice,
        sampling=sampling,
        stream=bool(req.stream),
        include_usage=bool((req.stream_options or {}).get("include_usage")),
        enable_thinking=kwargs.get("enable_thinking"),
    )
