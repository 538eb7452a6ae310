"""bench/agent_sessions.py's wire shapes and stream readers: a session's history as chat
completions, Anthropic Messages and OpenAI Responses bodies, and each format's SSE events
folded into one reply."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

from bench.agent_plan import Plan
from rewriter.vllm_answers import tokens_as_ids


# -- the wire shapes: a session's history as each API takes it ----------------------------------
def anthropic_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        {
            "name": t["function"]["name"],
            "description": t["function"]["description"],
            "input_schema": t["function"]["parameters"],
        }
        for t in tools
    ]


def responses_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"type": "function", **t["function"]} for t in tools]


@dataclass
class Reply:
    """What one streamed call gave back: for the next call's history, and for the checks."""

    tokens: int = -1  # completion tokens the answer's usage says
    prompt_tokens: int = -1
    text: str = ""
    # The assistant turn to send back, in the path's wire format (a chat message, Anthropic
    # content blocks, Responses output items).
    echo: Any = None
    tool_ids: list[str] = field(default_factory=list)  # tool calls the reply made


class Shape:
    """A session's history in one wire format; ``body`` is the next call, ``add`` appends the
    reply and the next tool result."""

    name = "chat"

    def __init__(self, plan: Plan, session: int, model: str, max_tokens: int) -> None:
        self.plan = plan
        self.model = model
        self.max_tokens = max_tokens
        self.texts = plan.texts[session]
        self.messages: list[dict[str, Any]] = self.start()

    def start(self) -> list[dict[str, Any]]:
        return [
            {"role": "system", "content": self.plan.system},
            {"role": "user", "content": self.texts[0]},
        ]

    def body(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "messages": self.messages,
            "tools": self.plan.tools,
            "max_tokens": self.max_tokens,
            "temperature": 1.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }

    def add(self, reply: Reply, turn: int) -> None:
        """``reply`` (of call ``turn``, 0-based) and the tool result of the next turn."""
        self.messages.append(reply.echo)
        result = self.texts[turn + 1]
        if reply.tool_ids:  # the policy called tools: their results, as the API wants them
            self.messages += [
                {"role": "tool", "tool_call_id": cid, "content": result if i == 0 else "ok"}
                for i, cid in enumerate(reply.tool_ids)
            ]
        else:
            self.messages.append({"role": "user", "content": result})


class AnthropicShape(Shape):
    name = "anthropic"

    def start(self) -> list[dict[str, Any]]:
        return [{"role": "user", "content": [{"type": "text", "text": self.texts[0]}]}]

    def body(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "system": [
                {"type": "text", "text": self.plan.system, "cache_control": {"type": "ephemeral"}}
            ],
            "messages": self.messages,
            "tools": anthropic_tools(self.plan.tools),
            "max_tokens": self.max_tokens,
            "temperature": 1.0,
            "stream": True,
        }

    def add(self, reply: Reply, turn: int) -> None:
        self.messages.append({"role": "assistant", "content": reply.echo})
        result = self.texts[turn + 1]
        if reply.tool_ids:
            content = [
                {"type": "tool_result", "tool_use_id": cid, "content": result if i == 0 else "ok"}
                for i, cid in enumerate(reply.tool_ids)
            ]
        else:
            content = [{"type": "text", "text": result}]
        self.messages.append({"role": "user", "content": content})


class ResponsesShape(Shape):
    name = "responses"

    def start(self) -> list[dict[str, Any]]:
        return [
            {"type": "message", "role": "user",
             "content": [{"type": "input_text", "text": self.texts[0]}]}
        ]  # fmt: skip

    def body(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "instructions": self.plan.system,
            "input": self.messages,
            "tools": responses_tools(self.plan.tools),
            "max_output_tokens": self.max_tokens,
            "temperature": 1.0,
            "store": False,
            "stream": True,
        }

    def add(self, reply: Reply, turn: int) -> None:
        self.messages += reply.echo
        result = self.texts[turn + 1]
        if reply.tool_ids:
            self.messages += [
                {"type": "function_call_output", "call_id": cid,
                 "output": result if i == 0 else "ok"}
                for i, cid in enumerate(reply.tool_ids)
            ]  # fmt: skip
        else:
            self.messages.append(
                {"type": "message", "role": "user",
                 "content": [{"type": "input_text", "text": result}]}
            )  # fmt: skip


# -- reading the streams -------------------------------------------------------------------------
class StreamReader:
    """Folds one wire format's SSE events into a ``Reply``; ``feed`` says whether the event
    carried generated text (the first such one is the time to first token)."""

    def __init__(self) -> None:
        self.reply = Reply()

    def feed(self, event: dict[str, Any]) -> bool:
        raise NotImplementedError

    def finish(self) -> Reply:
        return self.reply

    def openai_usage(self, event: dict[str, Any]) -> None:
        """The token counts of an OpenAI-style usage chunk (chat and completions alike)."""
        usage = event.get("usage")
        if usage:
            self.reply.tokens = int(usage.get("completion_tokens", -1))
            self.reply.prompt_tokens = int(usage.get("prompt_tokens", -1))


class ChatReader(StreamReader):
    def __init__(self) -> None:
        super().__init__()
        self.content: list[str] = []
        self.calls: dict[int, dict[str, Any]] = {}

    def feed(self, event: dict[str, Any]) -> bool:
        self.openai_usage(event)
        got = False
        for choice in event.get("choices") or ():
            delta = choice.get("delta") or {}
            text = delta.get("content")
            if text:
                self.content.append(text)
                got = True
            if delta.get("reasoning_content") or delta.get("reasoning"):
                got = True
            for call in delta.get("tool_calls") or ():
                got = True
                slot = self.calls.setdefault(
                    int(call.get("index", 0)), {"id": "", "name": "", "arguments": ""}
                )
                slot["id"] = call.get("id") or slot["id"]
                fn = call.get("function") or {}
                slot["name"] += fn.get("name") or ""
                slot["arguments"] += fn.get("arguments") or ""
        return got

    def finish(self) -> Reply:
        self.reply.text = "".join(self.content)
        message: dict[str, Any] = {"role": "assistant", "content": self.reply.text}
        if self.calls:
            message["tool_calls"] = [
                {"id": c["id"], "type": "function",
                 "function": {"name": c["name"], "arguments": c["arguments"]}}
                for _, c in sorted(self.calls.items())
            ]  # fmt: skip
            self.reply.tool_ids = [c["id"] for _, c in sorted(self.calls.items())]
        self.reply.echo = message
        return self.reply


class CompletionReader(StreamReader):
    def __init__(self) -> None:
        super().__init__()
        self.text: list[str] = []
        self.ids: list[int] = []

    def feed(self, event: dict[str, Any]) -> bool:
        self.openai_usage(event)
        got = False
        for choice in event.get("choices") or ():
            tokens = (choice.get("logprobs") or {}).get("tokens") or []
            # return_token_ids: token_ids; return_tokens_as_token_ids: "token_id:N" tokens.
            self.ids += choice.get("token_ids") or tokens_as_ids(tokens)
            if choice.get("text"):
                self.text.append(choice["text"])
                got = True
        return got

    def finish(self) -> Reply:
        self.reply.text = "".join(self.text)
        if self.reply.tokens < 0:
            self.reply.tokens = len(self.ids)
        self.reply.echo = {"role": "assistant", "content": self.reply.text}
        return self.reply


class AnthropicReader(StreamReader):
    def __init__(self) -> None:
        super().__init__()
        self.blocks: dict[int, dict[str, Any]] = {}
        self.json: dict[int, list[str]] = {}

    def feed(self, event: dict[str, Any]) -> bool:
        kind = event.get("type")
        if kind == "message_start":
            usage = (event.get("message") or {}).get("usage") or {}
            self.reply.prompt_tokens = int(usage.get("input_tokens", -1))
        elif kind == "message_delta":
            usage = event.get("usage") or {}
            self.reply.tokens = int(usage.get("output_tokens", -1))
        elif kind == "content_block_start":
            self.blocks[int(event["index"])] = dict(event["content_block"])
        elif kind == "content_block_delta":
            block = self.blocks[int(event["index"])]
            delta = event["delta"]
            if delta["type"] == "text_delta":
                block["text"] = block.get("text", "") + delta["text"]
            elif delta["type"] == "thinking_delta":
                block["thinking"] = block.get("thinking", "") + delta["thinking"]
            elif delta["type"] == "signature_delta":
                block["signature"] = block.get("signature", "") + delta["signature"]
            elif delta["type"] == "input_json_delta":
                self.json.setdefault(int(event["index"]), []).append(delta["partial_json"])
            return True
        elif kind == "error":
            raise RuntimeError(f"error event: {event}")
        return False

    def finish(self) -> Reply:
        blocks = []
        for index, block in sorted(self.blocks.items()):
            if block.get("type") == "tool_use":
                raw = "".join(self.json.get(index, []))
                block["input"] = orjson.loads(raw) if raw else block.get("input") or {}
                self.reply.tool_ids.append(block["id"])
            blocks.append(block)
        self.reply.text = "".join(b.get("text", "") for b in blocks)
        self.reply.echo = blocks or [{"type": "text", "text": ""}]
        return self.reply


class ResponsesReader(StreamReader):
    def feed(self, event: dict[str, Any]) -> bool:
        kind = event.get("type", "")
        if kind in ("response.completed", "response.incomplete"):
            response = event["response"]
            usage = response.get("usage") or {}
            self.reply.tokens = int(usage.get("output_tokens", -1))
            self.reply.prompt_tokens = int(usage.get("input_tokens", -1))
            self.reply.echo = list(response.get("output") or [])
        elif kind in ("response.failed", "error"):
            raise RuntimeError(f"error event: {event}")
        return kind.endswith(".delta")

    def finish(self) -> Reply:
        items = self.reply.echo or []
        for item in items:
            if item.get("type") == "function_call":
                self.reply.tool_ids.append(item["call_id"])
            if item.get("type") == "message":
                self.reply.text += "".join(
                    c.get("text", "") for c in item.get("content") or () if isinstance(c, dict)
                )
        self.reply.echo = items
        return self.reply
