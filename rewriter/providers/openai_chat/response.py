"""OpenAI Chat Completions answers: the completion object, error JSON and the chunk writer."""

from __future__ import annotations

import time
from typing import Any

from rewriter.canonical import (
    AssistantReply,
    ToolCall,
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
