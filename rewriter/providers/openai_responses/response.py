"""OpenAI Responses answers: the response object, its output items, usage, error JSON and the SSE
event writer (the same events serve the WebSocket mode).
"""

from __future__ import annotations

import time
from typing import Any

from rewriter.canonical import (
    AssistantReply,
    ToolCall,
)
from rewriter.parsers import ContentDelta, ParseEvent, ReasoningDelta, ToolCallEvent
from rewriter.providers.openai_chat import response as openai_chat
from rewriter.providers.openai_responses.ids import new_item_id
from rewriter.providers.openai_responses.request import ResponsesRequest, encrypt_reasoning

# -- response --------------------------------------------------------------------------------


# OpenAI's error codes clients act on (Codex resends the whole history on this one).
_ERROR_CODES = {"previous_response_id": "previous_response_not_found"}


def error_body(message: str, status: int, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error JSON, with the ``code`` the Responses API adds for some parameters."""
    return openai_chat.error_body(message, status, param, _ERROR_CODES.get(param or ""))


def status_of(vllm_reason: str | None) -> tuple[str, dict[str, Any] | None]:
    """The response status and incomplete_details for vLLM's finish reason."""
    if vllm_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    return "completed", None


def usage(input_tokens: int, output_tokens: int, reasoning_tokens: int = 0) -> dict[str, Any]:
    return {
        "input_tokens": input_tokens,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": input_tokens + output_tokens,
    }


def custom_input(call: ToolCall) -> str:
    """The string a custom tool's call carries (see :func:`custom_tool_parameters`)."""
    value = call.arguments_object()
    if isinstance(value, dict) and isinstance(value.get("input"), str):
        return value["input"]
    return call.arguments


def reasoning_item(item_id: str, text: str, include_encrypted: bool) -> dict[str, Any]:
    item: dict[str, Any] = {
        "type": "reasoning",
        "id": item_id,
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
    }
    if include_encrypted:
        item["encrypted_content"] = encrypt_reasoning(text)
    return item


def message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {
        "type": "message",
        "id": item_id,
        "status": status,
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
        if status == "completed"
        else [],
    }


def call_item(
    item_id: str, call: ToolCall, req: ResponsesRequest, status: str = "completed"
) -> dict[str, Any]:
    done = status == "completed"
    namespace, name = req.namespaces.get(call.name, (None, call.name))
    item: dict[str, Any]
    if call.name in req.custom_tools:
        item = {
            "type": "custom_tool_call",
            "id": item_id,
            "call_id": call.id,
            "name": name,
            "input": custom_input(call) if done else "",
            "status": status,
        }
    else:
        item = {
            "type": "function_call",
            "id": item_id,
            "call_id": call.id,
            "name": name,
            "arguments": call.arguments if done else "",
            "status": status,
        }
    if namespace:
        item["namespace"] = namespace
    return item


def output_items(
    reply: AssistantReply, req: ResponsesRequest, response_id: str
) -> list[dict[str, Any]]:
    items = []
    if reply.reasoning is not None:
        rs_id = new_item_id("rs", response_id)
        items.append(reasoning_item(rs_id, reply.reasoning, req.include_encrypted))
    if reply.content or not reply.tool_calls:
        items.append(message_item(new_item_id("msg", response_id), reply.content))
    for c in reply.tool_calls:
        prefix = "ctc" if c.name in req.custom_tools else "fc"
        items.append(call_item(new_item_id(prefix, response_id), c, req))
    return items


def response_object(
    response_id: str,
    req: ResponsesRequest,
    created_at: int,
    status: str,
    output: list[dict[str, Any]],
    usage_body: dict[str, Any] | None = None,
    incomplete_details: dict[str, Any] | None = None,
    error: dict[str, Any] | None = None,
) -> dict[str, Any]:
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "status": status,
        "error": error,
        "incomplete_details": incomplete_details,
        "model": req.chat.model,
        "output": output,
        "usage": usage_body,
        "truncation": "disabled",
        "user": None,
        **req.echo,
    }


def whole_response(
    response_id: str,
    req: ResponsesRequest,
    reply: AssistantReply,
    vllm_reason: str | None,
    input_tokens: int,
    output_tokens: int,
) -> dict[str, Any]:
    status, details = status_of(vllm_reason)
    return response_object(
        response_id,
        req,
        int(time.time()),
        status,
        output_items(reply, req, response_id),
        usage(input_tokens, output_tokens),
        details,
    )


class EventWriter:
    """The events of one streamed response, as the policy's output is parsed.

    Items open and close as the output moves from reasoning to text to tool calls; every event
    carries the next ``sequence_number``."""

    def __init__(self, response_id: str, req: ResponsesRequest, input_tokens: int) -> None:
        self.response_id = response_id
        self.req = req
        self.input_tokens = input_tokens
        self.created_at = int(time.time())
        self.sequence = 0
        self.output: list[dict[str, Any]] = []
        # The open item: its kind ("reasoning" / "message"), id and text so far.
        self._open: tuple[str, str] | None = None
        self._text: list[str] = []

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    def _response(self, status: str, **extra: Any) -> dict[str, Any]:
        return response_object(
            self.response_id, self.req, self.created_at, status, list(self.output), **extra
        )

    def start(self) -> list[dict[str, Any]]:
        return [
            self._event("response.created", response=self._response("in_progress")),
            self._event("response.in_progress", response=self._response("in_progress")),
        ]

    def _close(self) -> list[dict[str, Any]]:
        if self._open is None:
            return []
        kind, item_id = self._open
        text = "".join(self._text)
        index = len(self.output)
        self._open, self._text = None, []
        if kind == "reasoning":
            item = reasoning_item(item_id, text, self.req.include_encrypted)
            events = [
                self._event(
                    "response.reasoning_text.done",
                    item_id=item_id,
                    output_index=index,
                    content_index=0,
                    text=text,
                )
            ]
        else:
            item = message_item(item_id, text)
            part = item["content"][0]
            events = [
                self._event(
                    "response.output_text.done",
                    item_id=item_id,
                    output_index=index,
                    content_index=0,
                    text=text,
                    logprobs=[],
                ),
                self._event(
                    "response.content_part.done",
                    item_id=item_id,
                    output_index=index,
                    content_index=0,
                    part=part,
                ),
            ]
        events.append(self._event("response.output_item.done", output_index=index, item=item))
        self.output.append(item)
        return events

    def _text_delta(self, kind: str, text: str) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if self._open is not None and self._open[0] != kind:
            events += self._close()
        index = len(self.output)
        if self._open is None:
            item_id = new_item_id("rs" if kind == "reasoning" else "msg", self.response_id)
            self._open = (kind, item_id)
            if kind == "reasoning":
                added = {"type": "reasoning", "id": item_id, "summary": [], "content": []}
                events.append(
                    self._event("response.output_item.added", output_index=index, item=added)
                )
            else:
                events.append(
                    self._event(
                        "response.output_item.added",
                        output_index=index,
                        item=message_item(item_id, "", status="in_progress"),
                    )
                )
                events.append(
                    self._event(
                        "response.content_part.added",
                        item_id=item_id,
                        output_index=index,
                        content_index=0,
                        part={"type": "output_text", "text": "", "annotations": [], "logprobs": []},
                    )
                )
        item_id = self._open[1]
        self._text.append(text)
        name = (
            "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        )
        fields: dict[str, Any] = {"item_id": item_id, "output_index": index, "content_index": 0}
        if kind == "message":
            fields["logprobs"] = []
        events.append(self._event(name, delta=text, **fields))
        return events

    def _tool_call(self, call: ToolCall) -> list[dict[str, Any]]:
        events = self._close()
        index = len(self.output)
        item_id = new_item_id(
            "ctc" if call.name in self.req.custom_tools else "fc", self.response_id
        )
        events.append(
            self._event(
                "response.output_item.added",
                output_index=index,
                item=call_item(item_id, call, self.req, status="in_progress"),
            )
        )
        item = call_item(item_id, call, self.req)
        if call.name in self.req.custom_tools:
            text = item["input"]
            events.append(
                self._event(
                    "response.custom_tool_call_input.delta",
                    item_id=item_id,
                    output_index=index,
                    delta=text,
                )
            )
            events.append(
                self._event(
                    "response.custom_tool_call_input.done",
                    item_id=item_id,
                    output_index=index,
                    input=text,
                )
            )
        else:
            events.append(
                self._event(
                    "response.function_call_arguments.delta",
                    item_id=item_id,
                    output_index=index,
                    delta=call.arguments,
                )
            )
            events.append(
                self._event(
                    "response.function_call_arguments.done",
                    item_id=item_id,
                    output_index=index,
                    name=call.name,
                    arguments=call.arguments,
                )
            )
        events.append(self._event("response.output_item.done", output_index=index, item=item))
        self.output.append(item)
        return events

    def events(self, parsed: list[ParseEvent]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for event in parsed:
            if isinstance(event, ReasoningDelta):
                out += self._text_delta("reasoning", event.text)
            elif isinstance(event, ContentDelta):
                out += self._text_delta("message", event.text)
            elif isinstance(event, ToolCallEvent):
                out += self._tool_call(event.call)
        return out

    def finish(self, vllm_reason: str | None, output_tokens: int) -> list[dict[str, Any]]:
        """Closing events; the last one is ``response.completed`` or ``.incomplete``."""
        out = self._close()
        if not self.output:
            # An empty answer is still one (empty) assistant message.
            out += self._text_delta("message", "")
            out += self._close()
        status, details = status_of(vllm_reason)
        final = self._response(
            status,
            usage_body=usage(self.input_tokens, output_tokens),
            incomplete_details=details,
        )
        kind = "response.completed" if status == "completed" else "response.incomplete"
        out.append(self._event(kind, response=final))
        return out

    def warmup(self) -> list[dict[str, Any]]:
        """A ``generate: false`` request's whole answer: created and completed, no output."""
        final = self._response("completed", usage_body=usage(self.input_tokens, 0))
        return [
            self._event("response.created", response=self._response("in_progress")),
            self._event("response.completed", response=final),
        ]

    def failed(self, message: str) -> dict[str, Any]:
        error = {"code": "server_error", "message": message}
        return self._event("response.failed", response=self._response("failed", error=error))
