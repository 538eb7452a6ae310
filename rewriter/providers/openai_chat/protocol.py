"""OpenAI Chat Completions (``POST /v1/chat/completions``) <-> the canonical chat form."""

from __future__ import annotations

import json
import time
from typing import Any, Literal

from pydantic import Field, ValidationError

from rewriter import jsonbody
from rewriter.canonical import (
    AssistantReply,
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


# -- response --------------------------------------------------------------------------------


def error_body(
    message: str, status: int, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """OpenAI's error JSON (Chat Completions and Responses alike)."""
    kind = {
        400: "invalid_request_error",
        401: "authentication_error",
        403: "permission_error",
        404: "not_found_error",
        413: "invalid_request_error",
        429: "rate_limit_error",
    }.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def finish_reason(vllm_reason: str | None, reply: AssistantReply) -> str:
    if reply.tool_calls and vllm_reason == "stop":
        return "tool_calls"
    return {"length": "length", "stop": "stop"}.get(vllm_reason or "stop", "stop")


def _tool_call_out(call: ToolCall, index: int | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }
    if index is not None:
        out["index"] = index
    return out


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion_response(
    response_id: str,
    model: str,
    reply: AssistantReply,
    reason: str,
    prompt_tokens: int,
    completion_tokens: int,
) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": reply.content or None}
    if reply.tool_calls:
        message["tool_calls"] = [_tool_call_out(c) for c in reply.tool_calls]
    if reply.reasoning is not None:
        message["reasoning_content"] = reply.reasoning
    if not reply.tool_calls and message["content"] is None:
        message["content"] = ""
    return {
        "id": response_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": reason}],
        "usage": usage(prompt_tokens, completion_tokens),
        "system_fingerprint": None,
    }


class ChunkWriter:
    """Builds the ``chat.completion.chunk`` objects of one streamed response."""

    def __init__(self, response_id: str, model: str) -> None:
        self.response_id = response_id
        self.model = model
        self.created = int(time.time())

    def chunk(self, delta: dict[str, Any], reason: str | None = None) -> dict[str, Any]:
        return {
            "id": self.response_id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}],
        }

    def role(self) -> dict[str, Any]:
        return self.chunk({"role": "assistant", "content": ""})

    def content(self, text: str) -> dict[str, Any]:
        return self.chunk({"content": text})

    def reasoning(self, text: str) -> dict[str, Any]:
        return self.chunk({"reasoning_content": text})

    def tool_call(self, index: int, call: ToolCall) -> dict[str, Any]:
        return self.chunk({"tool_calls": [_tool_call_out(call, index)]})

    def finish(self, reason: str) -> dict[str, Any]:
        return self.chunk({}, reason)

    def usage(self, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
        return {
            "id": self.response_id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": [],
            "usage": usage(prompt_tokens, completion_tokens),
        }
