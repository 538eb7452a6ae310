"""Tokens that wait go out together: a policy that runs ahead of the proxy (the stub's ``burst``:
every token chunk of a stream in one write, so they wait in the proxy's socket together) is
answered in fewer events than tokens, in every provider's wire format, with the whole text, the
same parsed reply, and the same recorded row, every token's id and logprob, as when the tokens
come one by one (slower than the flush interval: the proxy keeps up and sends each as it
comes).

Real mitmdump with the addon, real HTTPS through it, the vLLM-shaped stub.
"""

from __future__ import annotations

import json
import ssl
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np
import pytest

from tests.support.paths import IM_END
from tests.support.proxies import ONE_EVENT_PER_TOKEN_S, Proxy
from tests.support.stub_vllm import StubPolicy

TEXT = "One two three four five six seven eight nine ten, and that is all of them."
# Reasoning, then content, then a tool call: coalesced text must never cross these boundaries.
TOOL_TEXT = (
    "<think>\nThe weather tool answers this, so I call it.\n</think>\n\nChecking the weather now."
    '\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
USER = "Count to ten."
# A token every PACE_S: the proxy keeps up, each token is its own event.
PACE_S = ONE_EVENT_PER_TOKEN_S
# What a row must hold alike however the tokens were sent on.
ROW_FIELDS = ("completion_ids", "completion_logprobs", "finish_reason", "response_finish_reason")


@dataclass
class Streamed:
    """What a client read of one streamed answer."""

    events: list[tuple[str, str]] = field(default_factory=list)  # (kind, text) with text
    tool_calls: list[dict[str, Any]] = field(default_factory=list)

    def text(self, kind: str = "content") -> str:
        return "".join(t for k, t in self.events if k == kind)


def chat_events(event: dict[str, Any], out: Streamed) -> None:
    for choice in event.get("choices", []):
        delta = choice["delta"]
        kinds = [k for k in ("content", "reasoning_content", "tool_calls") if delta.get(k)]
        assert len(kinds) <= 1, f"one event mixes {kinds}: {delta}"
        if delta.get("content"):
            out.events.append(("content", delta["content"]))
        if delta.get("reasoning_content"):
            out.events.append(("reasoning", delta["reasoning_content"]))
        for call in delta.get("tool_calls") or []:
            out.tool_calls.append(call["function"])


def anthropic_events(event: dict[str, Any], out: Streamed) -> None:
    if event.get("type") == "content_block_delta" and event["delta"]["type"] == "text_delta":
        out.events.append(("content", event["delta"]["text"]))


def responses_events(event: dict[str, Any], out: Streamed) -> None:
    if event.get("type") == "response.output_text.delta":
        out.events.append(("content", event["delta"]))


def gemini_events(event: dict[str, Any], out: Streamed) -> None:
    for candidate in event.get("candidates", []):
        for part in candidate.get("content", {}).get("parts", []):
            if part.get("text") and not part.get("thought"):
                out.events.append(("content", part["text"]))


# provider -> (url, body, headers, the events it reads)
CALLS: dict[str, tuple[str, dict[str, Any], dict[str, str], Callable[..., None]]] = {
    "openai.chat": (
        "https://api.openai.com/v1/chat/completions",
        {"model": "gpt-4o", "messages": [{"role": "user", "content": USER}], "stream": True},
        {"Authorization": "Bearer sk-agenttap-test-key"},
        chat_events,
    ),
    "anthropic": (
        "https://api.anthropic.com/v1/messages",
        {
            "model": "claude-sonnet-4-5",
            "max_tokens": 256,
            "messages": [{"role": "user", "content": USER}],
            "stream": True,
        },
        {"x-api-key": "sk-ant-agenttap-test-key", "anthropic-version": "2023-06-01"},
        anthropic_events,
    ),
    "openai.responses": (
        "https://api.openai.com/v1/responses",
        {"model": "gpt-4o", "input": USER, "stream": True},
        {"Authorization": "Bearer sk-agenttap-test-key"},
        responses_events,
    ),
    "gemini": (
        "https://generativelanguage.googleapis.com/v1beta/models/gemini-2.5-flash"
        ":streamGenerateContent?alt=sse",
        {
            "contents": [{"role": "user", "parts": [{"text": USER}]}],
            "generationConfig": {"thinkingConfig": {"thinkingBudget": 0}},
        },
        {"x-goog-api-key": "AIza-agenttap-test-key"},
        gemini_events,
    ),
}


def stream(
    proxy: Proxy, session: str, provider: str, body_extra: dict[str, Any] | None = None
) -> Streamed:
    url, body, headers, read = CALLS[provider]
    out = Streamed()
    with httpx.Client(
        proxy=f"http://{session}:x@127.0.0.1:{proxy.port}",
        verify=ssl.create_default_context(cafile=str(proxy.ca)),
        timeout=120,
    ) as client:
        with client.stream("POST", url, json={**body, **(body_extra or {})}, headers=headers) as r:
            assert r.status_code == 200, r.read()[:300]
            for line in r.iter_lines():
                line = line.strip()
                if line.startswith("data:") and line != "data: [DONE]":
                    read(json.loads(line[5:]), out)
    return out


def sent_both_ways(
    proxy: Proxy,
    stub: StubPolicy,
    name: str,
    provider: str,
    text: str,
    body_extra: dict[str, Any] | None = None,
) -> tuple[Streamed, Streamed, dict[str, Any], dict[str, Any]]:
    """The same answer streamed twice, its tokens in a burst, then one by one; what the client
    read of each and each one's row."""
    stub.replies.clear()
    stub.script(text, text)
    stub.burst = True
    try:
        burst = stream(proxy, f"{name}-burst", provider, body_extra)
    finally:
        stub.burst = False
    stub.chunk_delay_s = PACE_S
    try:
        paced = stream(proxy, f"{name}-paced", provider, body_extra)
    finally:
        stub.chunk_delay_s = 0.0
    (burst_row,) = proxy.turns(f"{name}-burst", expect=1)
    (paced_row,) = proxy.turns(f"{name}-paced", expect=1)
    return burst, paced, burst_row, paced_row


def check_rows(burst: dict[str, Any], paced: dict[str, Any], ids: list[int]) -> None:
    """Both rows hold every token's id and logprob, the stub's, bit for bit, and agree."""
    for row in (burst, paced):
        assert list(row["completion_ids"]) == ids
        want = [StubPolicy._logprob_of(i, t) for i, t in enumerate(ids)]
        got = np.asarray(row["completion_logprobs"], dtype=np.float32)
        assert np.array_equal(got, np.asarray(want, dtype=np.float32))
    for name in ROW_FIELDS:
        if name in burst or name in paced:
            assert np.array_equal(np.asarray(burst[name]), np.asarray(paced[name])), name
    assert burst["prompt_ids"] == paced["prompt_ids"]


@pytest.mark.parametrize("provider", list(CALLS))
def test_tokens_that_wait_go_out_together(
    stub_proxy: Proxy, stub: StubPolicy, tok: Any, provider: str
) -> None:
    burst, paced, burst_row, paced_row = sent_both_ways(
        stub_proxy, stub, f"coalesce-{provider}", provider, TEXT
    )
    ids = list(tok.encode(TEXT, add_special_tokens=False)) + [IM_END]
    assert burst.text() == paced.text() == TEXT
    # One by one, a token per event (the last, <|im_end|>, has no text); in a burst, fewer.
    assert len(paced.events) > (len(ids) - 1) // 2
    assert len(burst.events) < len(ids) - 1
    assert len(burst.events) < len(paced.events)
    check_rows(burst_row, paced_row, ids)


def test_coalesced_text_keeps_reasoning_content_and_tool_calls_apart(
    stub_proxy: Proxy, stub: StubPolicy, tok: Any
) -> None:
    burst, paced, burst_row, paced_row = sent_both_ways(
        stub_proxy, stub, "coalesce-kinds", "openai.chat", TOOL_TEXT, {"tools": TOOLS}
    )
    ids = list(tok.encode(TOOL_TEXT, add_special_tokens=False)) + [IM_END]
    for got in (burst, paced):
        assert got.text("reasoning").strip("\n") == "The weather tool answers this, so I call it."
        assert got.text().strip() == "Checking the weather now."
        assert [c["name"] for c in got.tool_calls] == ["get_weather"]
        assert json.loads(got.tool_calls[0]["arguments"]) == {"city": "Paris"}
    # The burst: a reasoning event, then content; never a kind inside another's event.
    kinds = [kind for kind, _ in burst.events]
    assert kinds == sorted(kinds, key=["reasoning", "content"].index)
    assert len(burst.events) < len(paced.events)
    check_rows(burst_row, paced_row, ids)
