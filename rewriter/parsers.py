"""Output parsers: the policy's completion text -> reasoning, content and tool calls.

Parsers are chosen by the names vLLM gives them (``--tool-call-parser hermes``,
``--reasoning-parser qwen3``), so a user configures agenttap as they configure vLLM. Each parser
works incrementally: text deltas go in as the policy produces them, events come out as soon as
they are certain, which is what lets the proxy stream without waiting for the whole completion.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable
from dataclasses import dataclass

from rewriter.canonical import AssistantReply, ToolCall


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True)
class ToolCallEvent:
    index: int
    call: ToolCall


ParseEvent = ContentDelta | ReasoningDelta | ToolCallEvent


def new_tool_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def _held_back(buffer: str, tag: str) -> int:
    """Length of the longest suffix of ``buffer`` that could be the start of ``tag``."""
    # Called for every streamed token: such a suffix starts with the tag's first character, and
    # most tokens hold none, so that one C-level search usually settles it.
    start = buffer.find(tag[0], max(0, len(buffer) - len(tag) + 1))
    while start != -1:
        if tag.startswith(buffer[start:]):
            return len(buffer) - start
        start = buffer.find(tag[0], start + 1)
    return 0


# -- tool-call parsers ----------------------------------------------------------------------


class ToolCallStream:
    """Incremental tool-call parser: ``feed`` content text, get content and tool-call events."""

    def feed(self, text: str) -> list[ParseEvent]:
        raise NotImplementedError

    def finish(self) -> list[ParseEvent]:
        raise NotImplementedError


class NoToolCalls(ToolCallStream):
    def feed(self, text: str) -> list[ParseEvent]:
        return [ContentDelta(text)] if text else []

    def finish(self) -> list[ParseEvent]:
        return []


class HermesToolCalls(ToolCallStream):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Qwen2.5, Qwen3, Hermes)."""

    OPEN = "<tool_call>"
    CLOSE = "</tool_call>"

    def __init__(self) -> None:
        self._buffer = ""
        self._in_call = False
        self._count = 0

    def feed(self, text: str) -> list[ParseEvent]:
        self._buffer += text
        events: list[ParseEvent] = []
        while self._buffer:
            if self._in_call:
                end = self._buffer.find(self.CLOSE)
                if end < 0:
                    break
                body = self._buffer[:end]
                self._buffer = self._buffer[end + len(self.CLOSE) :]
                self._in_call = False
                events.append(self._call_or_text(body))
            else:
                start = self._buffer.find(self.OPEN)
                if start >= 0:
                    before = self._buffer[:start]
                    self._buffer = self._buffer[start + len(self.OPEN) :]
                    self._in_call = True
                else:
                    keep = _held_back(self._buffer, self.OPEN)
                    before = self._buffer[: len(self._buffer) - keep]
                    self._buffer = self._buffer[len(self._buffer) - keep :]
                if before:
                    events.append(ContentDelta(before))
                if not self._in_call:
                    break
        return events

    def finish(self) -> list[ParseEvent]:
        # An unclosed call (the budget ran out) is given back as text: nothing is dropped.
        rest = (self.OPEN if self._in_call else "") + self._buffer
        self._buffer, self._in_call = "", False
        return [ContentDelta(rest)] if rest else []

    def _call_or_text(self, body: str) -> ParseEvent:
        try:
            obj = json.loads(body.strip(), strict=False)
        except json.JSONDecodeError:
            obj = None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return ContentDelta(self.OPEN + body + self.CLOSE)
        arguments = obj.get("arguments", obj.get("parameters", {}))
        args_text = (
            arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
        )
        event = ToolCallEvent(self._count, ToolCall(new_tool_call_id(), obj["name"], args_text))
        self._count += 1
        return event


TOOL_PARSERS: dict[str, Callable[[], ToolCallStream]] = {
    "hermes": HermesToolCalls,
    "none": NoToolCalls,
}


# -- reasoning parsers ----------------------------------------------------------------------


class ReasoningStream:
    """Splits ``<think>...</think>`` off the start of a completion (vLLM's ``qwen3`` parser)."""

    OPEN = "<think>"
    CLOSE = "</think>"

    def __init__(self, starts_in_reasoning: bool = False) -> None:
        self._state = "reasoning" if starts_in_reasoning else "start"
        self._buffer = ""
        self._strip_newlines = False

    def feed(self, text: str) -> list[ParseEvent]:
        self._buffer += text
        events: list[ParseEvent] = []
        if self._state == "start":
            stripped = self._buffer.lstrip()
            if stripped.startswith(self.OPEN):
                self._buffer = stripped[len(self.OPEN) :]
                self._state = "reasoning"
            elif self.OPEN.startswith(stripped):
                return events  # may still become "<think>"
            else:
                self._state = "content"
        if self._state == "reasoning":
            end = self._buffer.find(self.CLOSE)
            if end >= 0:
                if self._buffer[:end]:
                    events.append(ReasoningDelta(self._buffer[:end]))
                self._buffer = self._buffer[end + len(self.CLOSE) :]
                self._state = "content"
                self._strip_newlines = True
            else:
                keep = _held_back(self._buffer, self.CLOSE)
                out = self._buffer[: len(self._buffer) - keep]
                self._buffer = self._buffer[len(self._buffer) - keep :]
                if out:
                    events.append(ReasoningDelta(out))
                return events
        if self._state == "content":
            if self._strip_newlines:
                self._buffer = self._buffer.lstrip("\n")
                if not self._buffer:
                    return events
                self._strip_newlines = False
            if self._buffer:
                events.append(ContentDelta(self._buffer))
            self._buffer = ""
        return events

    def finish(self) -> list[ParseEvent]:
        rest, self._buffer = self._buffer, ""
        if not rest:
            return []
        return [ReasoningDelta(rest)] if self._state == "reasoning" else [ContentDelta(rest)]


class NoReasoning(ReasoningStream):
    def __init__(self, starts_in_reasoning: bool = False) -> None:
        super().__init__()
        self._state = "content"


REASONING_PARSERS: dict[str, Callable[[], ReasoningStream]] = {
    "qwen3": ReasoningStream,
    "deepseek_r1": lambda: ReasoningStream(starts_in_reasoning=True),
    "none": NoReasoning,
}


def _lookup[T](registry: dict[str, T], name: str, kind: str) -> T:
    try:
        return registry[name]
    except KeyError:
        known = ", ".join(sorted(registry))
        raise ValueError(f"unknown {kind} {name!r}; known: {known}") from None


def check_parser_names(tool_parser: str, reasoning_parser: str) -> None:
    _lookup(TOOL_PARSERS, tool_parser, "tool-call parser")
    _lookup(REASONING_PARSERS, reasoning_parser, "reasoning parser")


class OutputParser:
    """Reasoning first, then tool calls in what remains: one incremental pipeline."""

    def __init__(self, tool_parser: str = "hermes", reasoning_parser: str = "qwen3") -> None:
        self._reasoning = _lookup(REASONING_PARSERS, reasoning_parser, "reasoning parser")()
        self._tools = _lookup(TOOL_PARSERS, tool_parser, "tool-call parser")()
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.tool_calls: list[ToolCall] = []

    def feed(self, text: str) -> list[ParseEvent]:
        return self._route(self._reasoning.feed(text))

    def finish(self) -> list[ParseEvent]:
        events = self._route(self._reasoning.finish())
        events.extend(self._record(self._tools.finish()))
        return events

    def _route(self, events: list[ParseEvent]) -> list[ParseEvent]:
        out: list[ParseEvent] = []
        for event in events:
            if isinstance(event, ContentDelta):
                out.extend(self._record(self._tools.feed(event.text)))
            else:
                out.extend(self._record([event]))
        return out

    def _record(self, events: list[ParseEvent]) -> list[ParseEvent]:
        for event in events:
            if isinstance(event, ContentDelta):
                self.content.append(event.text)
            elif isinstance(event, ReasoningDelta):
                self.reasoning.append(event.text)
            else:
                self.tool_calls.append(event.call)
        return events

    def reply(self) -> AssistantReply:
        content = "".join(self.content)
        if self.tool_calls:
            content = content.strip()  # the template's newline before <tool_call> is not content
        reasoning = "".join(self.reasoning).strip("\n") if self.reasoning else None
        return AssistantReply(
            content=content, reasoning=reasoning, tool_calls=list(self.tool_calls)
        )


def parse_completion(
    text: str, tool_parser: str = "hermes", reasoning_parser: str = "qwen3"
) -> AssistantReply:
    parser = OutputParser(tool_parser, reasoning_parser)
    parser.feed(text)
    parser.finish()
    return parser.reply()
