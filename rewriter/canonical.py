"""The one canonical chat form every provider protocol is translated into.

Plain dataclasses: no HTTP, no pydantic, no tokenizer. Provider adapters
(``rewriter.providers.openai_chat.request``, ...) build a :class:`ChatRequest` from a request
body; the template renders it to token ids; the parsers turn the policy's completion text back
into an :class:`AssistantReply`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

Role = Literal["system", "user", "assistant", "tool"]


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    # The arguments as the JSON text the model produced or the client sent back.
    arguments: str

    def arguments_object(self) -> Any:
        """Arguments as a JSON value (lenient: a scaffold may send control chars, strict=False)."""
        try:
            return json.loads(self.arguments, strict=False)
        except (json.JSONDecodeError, TypeError):
            return self.arguments


@dataclass(frozen=True)
class Message:
    role: Role
    content: str = ""
    reasoning: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    name: str | None = None
    # Ids this proxy minted for an assistant reply that the client echoes back (a Responses API
    # response, named by its items' ids): evidence of which policy call the message is. Never
    # rendered, never part of a message's key.
    ids: tuple[str, ...] = ()


@dataclass(frozen=True)
class ToolSpec:
    name: str
    description: str = ""
    parameters: dict[str, Any] = field(default_factory=dict)


@dataclass
class SamplingParams:
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_tokens: int | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool | None = None
    # A JSON schema the completion must satisfy (vLLM structured outputs).
    json_schema: dict[str, Any] | None = None


@dataclass
class ChatRequest:
    messages: list[Message]
    model: str
    tools: list[ToolSpec] = field(default_factory=list)
    tool_choice: str | dict[str, Any] | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stream: bool = False
    include_usage: bool = False
    # None: the template's default.
    enable_thinking: bool | None = None
    # The client marked this request as a retry of one it sent before (e.g. the SDKs'
    # x-stainless-retry-count header): the earlier answer, if never continued, is a dead branch.
    client_retry: bool = False


@dataclass
class AssistantReply:
    """What the policy said, parsed out of its completion text."""

    content: str
    reasoning: str | None
    tool_calls: list[ToolCall]

    def as_message(self) -> Message:
        return Message(
            role="assistant",
            content=self.content,
            reasoning=self.reasoning,
            tool_calls=tuple(self.tool_calls),
        )


class RequestError(ValueError):
    """A request the proxy refuses; ``status`` is the HTTP status the client gets."""

    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
