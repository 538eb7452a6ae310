"""Tool calls and reasoning through the real proxy: the real openai SDK -> mitmdump -> the stub.

The stub answers exactly the scripted completion (tokenized with the Qwen3 tokenizer and ended
with ``<|im_end|>``), so every test knows the token ids the proxy must record and the parsed
reply the client must get.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

from tests.support.paths import IM_END
from tests.support.proxies import Proxy
from tests.support.stub_vllm import StubPolicy

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "Local time in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    },
]

WEATHER_ARGS = {"city": "Paris", "unit": "celsius"}
TIME_ARGS = {"city": "Tokyo"}


def hermes(name: str, arguments: dict[str, Any]) -> str:
    """A tool call exactly as Qwen3's chat template writes one."""
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def expected_ids(tok: Any, text: str) -> list[int]:
    return list(tok.encode(text, add_special_tokens=False)) + [IM_END]


def script(stub: StubPolicy, *texts: str) -> int:
    """Queue exactly these replies (dropping any a failed test left); returns the request count."""
    stub.replies.clear()
    stub.script(*texts)
    return len(stub.requests)


def check_row(row: dict[str, Any], stub: StubPolicy, request_index: int, ids: list[int]) -> None:
    """The shard row holds the stub's prompt and sampled ids and logprobs, bit for bit."""
    sent = stub.requests[request_index]
    assert row["prompt_ids"] == sent["prompt"]
    assert row["completion_ids"] == ids
    want = np.asarray([StubPolicy._logprob_of(i, t) for i, t in enumerate(ids)], dtype=np.float32)
    assert np.array_equal(np.asarray(row["completion_logprobs"], dtype=np.float32), want)
    assert row["finish_reason"] == "stop"


def collect_stream(stream: Any) -> dict[str, Any]:
    """Accumulate a streamed chat completion the way agent scaffolds do."""
    content: list[str] = []
    reasoning: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    finish = None
    usage = None
    chunks = 0
    for chunk in stream:
        chunks += 1
        assert chunk.object == "chat.completion.chunk"
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            delta = choice.delta
            content.append(delta.content or "")
            extra = delta.model_extra or {}
            reasoning.append(extra.get("reasoning_content") or "")
            for tc in delta.tool_calls or []:
                slot = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
                if tc.id:
                    slot["id"] = tc.id
                if tc.function is not None:
                    slot["name"] += tc.function.name or ""
                    slot["arguments"] += tc.function.arguments or ""
            finish = choice.finish_reason or finish
    return {
        "content": "".join(content),
        "reasoning": "".join(reasoning),
        "tool_calls": [calls[i] for i in sorted(calls)],
        "finish_reason": finish,
        "usage": usage,
        "chunks": chunks,
    }


USER = [{"role": "user", "content": "What's the weather in Paris?"}]


def test_tool_call_non_streamed(
    stub_proxy: Proxy, stub: StubPolicy, tok: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    text = hermes("get_weather", WEATHER_ARGS)
    n = script(stub, text)
    client = stub_proxy.openai("tools-plain", monkeypatch)
    resp = client.chat.completions.create(model="gpt-4o", messages=USER, tools=TOOLS)
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.role == "assistant"
    assert not choice.message.content
    calls = choice.message.tool_calls
    assert calls is not None and len(calls) == 1
    assert calls[0].type == "function"
    assert calls[0].id.startswith("call_") and len(calls[0].id) > len("call_")
    assert calls[0].function.name == "get_weather"
    assert json.loads(calls[0].function.arguments) == WEATHER_ARGS
    ids = expected_ids(tok, text)
    assert resp.usage.completion_tokens == len(ids)
    assert resp.usage.prompt_tokens == len(stub.requests[n]["prompt"])

    # The tools reached the prompt the policy saw (Qwen3's template lists them in <tools>).
    prompt_text = tok.decode(stub.requests[n]["prompt"])
    assert "<tools>" in prompt_text and '"name": "get_weather"' in prompt_text
    assert '"name": "get_time"' in prompt_text

    rows = stub_proxy.turns("tools-plain", expect=1)
    assert len(rows) == 1
    check_row(rows[0], stub, n, ids)
    assert rows[0]["response_finish_reason"] == "tool_calls"
    assert rows[0]["completion_text"] == text
    assert rows[0]["stream"] is False


def test_tool_call_streamed(
    stub_proxy: Proxy, stub: StubPolicy, tok: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    text = hermes("get_weather", WEATHER_ARGS)
    n = script(stub, text)
    client = stub_proxy.openai("tools-stream", monkeypatch)
    stream = client.chat.completions.create(
        model="gpt-4o",
        messages=USER,
        tools=TOOLS,
        stream=True,
        stream_options={"include_usage": True},
    )
    got = collect_stream(stream)
    assert got["finish_reason"] == "tool_calls"
    assert got["content"] == ""
    assert len(got["tool_calls"]) == 1
    call = got["tool_calls"][0]
    assert call["id"].startswith("call_") and len(call["id"]) > len("call_")
    assert call["name"] == "get_weather"
    assert json.loads(call["arguments"]) == WEATHER_ARGS
    ids = expected_ids(tok, text)
    assert got["usage"] is not None and got["usage"].completion_tokens == len(ids)
    assert stub.requests[n]["stream"] is True

    rows = stub_proxy.turns("tools-stream", expect=1)
    assert len(rows) == 1
    check_row(rows[0], stub, n, ids)
    assert rows[0]["response_finish_reason"] == "tool_calls"
    assert rows[0]["stream"] is True


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_text_then_tool_call(
    stream: bool,
    stub_proxy: Proxy,
    stub: StubPolicy,
    tok: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    session = f"tools-text-{stream}"
    text = "Let me look that up.\n" + hermes("get_weather", {"city": "Paris"})
    n = script(stub, text)
    client = stub_proxy.openai(session, monkeypatch)
    kwargs: dict[str, Any] = {"model": "gpt-4o", "messages": USER, "tools": TOOLS}
    if stream:
        got = collect_stream(client.chat.completions.create(stream=True, **kwargs))
        content, calls, finish = got["content"], got["tool_calls"], got["finish_reason"]
        # Streamed text reaches the client before the call is complete; the template's newline
        # before <tool_call> may ride along with it.
        assert content.rstrip("\n") == "Let me look that up."
    else:
        resp = client.chat.completions.create(**kwargs)
        msg = resp.choices[0].message
        content, finish = msg.content, resp.choices[0].finish_reason
        calls = [
            {"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
            for c in msg.tool_calls or []
        ]
        assert content == "Let me look that up."
    assert finish == "tool_calls"
    assert len(calls) == 1
    assert calls[0]["id"].startswith("call_")
    assert calls[0]["name"] == "get_weather"
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris"}
    rows = stub_proxy.turns(session, expect=1)
    assert len(rows) == 1
    check_row(rows[0], stub, n, expected_ids(tok, text))


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_two_tool_calls_in_one_reply(
    stream: bool,
    stub_proxy: Proxy,
    stub: StubPolicy,
    tok: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    session = f"tools-two-{stream}"
    text = hermes("get_weather", WEATHER_ARGS) + "\n" + hermes("get_time", TIME_ARGS)
    n = script(stub, text)
    client = stub_proxy.openai(session, monkeypatch)
    kwargs: dict[str, Any] = {
        "model": "gpt-4o",
        "messages": [{"role": "user", "content": "Weather in Paris and time in Tokyo?"}],
        "tools": TOOLS,
    }
    if stream:
        got = collect_stream(client.chat.completions.create(stream=True, **kwargs))
        calls, finish = got["tool_calls"], got["finish_reason"]
        assert got["content"].strip() == ""
    else:
        resp = client.chat.completions.create(**kwargs)
        msg = resp.choices[0].message
        finish = resp.choices[0].finish_reason
        assert not msg.content
        calls = [
            {"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
            for c in msg.tool_calls or []
        ]
    assert finish == "tool_calls"
    assert [c["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["arguments"]) == WEATHER_ARGS
    assert json.loads(calls[1]["arguments"]) == TIME_ARGS
    assert all(c["id"].startswith("call_") for c in calls)
    assert calls[0]["id"] != calls[1]["id"]
    rows = stub_proxy.turns(session, expect=1)
    assert len(rows) == 1
    check_row(rows[0], stub, n, expected_ids(tok, text))


def test_tool_result_round_trip(
    stub_proxy: Proxy, stub: StubPolicy, tok: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    call_text = hermes("get_weather", WEATHER_ARGS)
    answer = "It is 18 degrees and sunny in Paris."
    n = script(stub, call_text, answer)
    client = stub_proxy.openai("tools-roundtrip", monkeypatch)
    first = client.chat.completions.create(model="gpt-4o", messages=USER, tools=TOOLS)
    call = first.choices[0].message.tool_calls[0]
    messages: list[dict[str, Any]] = [
        *USER,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.function.name, "arguments": call.function.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.id, "content": '{"temp_c": 18, "sky": "sunny"}'},
    ]
    second = client.chat.completions.create(model="gpt-4o", messages=messages, tools=TOOLS)
    assert second.choices[0].finish_reason == "stop"
    assert second.choices[0].message.content == answer
    assert not second.choices[0].message.tool_calls

    # The tool result reached the policy, after the call it answers.
    prompt2 = stub.requests[n + 1]["prompt"]
    text2 = tok.decode(prompt2)
    assert '<tool_response>\n{"temp_c": 18, "sky": "sunny"}\n</tool_response>' in text2
    # The second prompt extends the first exactly: prompt 1 + the sampled ids of turn 1.
    prompt1 = stub.requests[n]["prompt"]
    turn1 = prompt1 + expected_ids(tok, call_text)
    assert prompt2[: len(turn1)] == turn1

    rows = stub_proxy.turns("tools-roundtrip", expect=2)
    assert [r["turn_index"] for r in rows] == [0, 1]
    check_row(rows[0], stub, n, expected_ids(tok, call_text))
    check_row(rows[1], stub, n + 1, expected_ids(tok, answer))
    assert [r["response_finish_reason"] for r in rows] == ["tool_calls", "stop"]


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_reasoning_is_exposed_as_reasoning_content(
    stream: bool,
    stub_proxy: Proxy,
    stub: StubPolicy,
    tok: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    session = f"tools-think-{stream}"
    text = "<think>\nThe user greets me; answer briefly.\n</think>\n\nHello there!"
    n = script(stub, text)
    client = stub_proxy.openai(session, monkeypatch)
    kwargs: dict[str, Any] = {"model": "gpt-4o", "messages": [{"role": "user", "content": "Hi"}]}
    if stream:
        got = collect_stream(client.chat.completions.create(stream=True, **kwargs))
        content, reasoning, finish = got["content"], got["reasoning"], got["finish_reason"]
        assert reasoning.strip("\n") == "The user greets me; answer briefly."
    else:
        resp = client.chat.completions.create(**kwargs)
        msg = resp.choices[0].message
        content, finish = msg.content, resp.choices[0].finish_reason
        reasoning = (msg.model_extra or {}).get("reasoning_content")
        assert reasoning == "The user greets me; answer briefly."
    assert content == "Hello there!"
    assert "<think>" not in content and "</think>" not in content
    assert finish == "stop"
    rows = stub_proxy.turns(session, expect=1)
    assert len(rows) == 1
    check_row(rows[0], stub, n, expected_ids(tok, text))
    assert rows[0]["completion_text"] == text


def test_reasoning_then_tool_call(
    stub_proxy: Proxy, stub: StubPolicy, tok: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    text = "<think>\nI need the weather tool.\n</think>\n\n" + hermes("get_weather", WEATHER_ARGS)
    n = script(stub, text)
    client = stub_proxy.openai("tools-think-call", monkeypatch)
    resp = client.chat.completions.create(model="gpt-4o", messages=USER, tools=TOOLS)
    msg = resp.choices[0].message
    assert resp.choices[0].finish_reason == "tool_calls"
    assert (msg.model_extra or {}).get("reasoning_content") == "I need the weather tool."
    assert not msg.content
    assert msg.tool_calls is not None and len(msg.tool_calls) == 1
    assert msg.tool_calls[0].function.name == "get_weather"
    assert json.loads(msg.tool_calls[0].function.arguments) == WEATHER_ARGS
    rows = stub_proxy.turns("tools-think-call", expect=1)
    assert len(rows) == 1
    check_row(rows[0], stub, n, expected_ids(tok, text))


def test_stream_in_multi_token_chunks(
    stub_proxy: Proxy, stub: StubPolicy, tok: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM sends several tokens per chunk when it lags: tags split across or sharing chunks
    must parse the same."""
    text = "<think>\nThe weather tool answers this.\n</think>\n\nChecking now.\n" + hermes(
        "get_weather", WEATHER_ARGS
    )
    n = script(stub, text)
    client = stub_proxy.openai("tools-multichunk", monkeypatch)
    stub.chunk_tokens = 3
    try:
        got = collect_stream(
            client.chat.completions.create(model="gpt-4o", messages=USER, tools=TOOLS, stream=True)
        )
    finally:
        stub.chunk_tokens = 1
    assert got["reasoning"].strip("\n") == "The weather tool answers this."
    assert got["content"].strip() == "Checking now."
    assert got["finish_reason"] == "tool_calls"
    assert [c["name"] for c in got["tool_calls"]] == ["get_weather"]
    assert json.loads(got["tool_calls"][0]["arguments"]) == WEATHER_ARGS
    rows = stub_proxy.turns("tools-multichunk", expect=1)
    assert len(rows) == 1
    check_row(rows[0], stub, n, expected_ids(tok, text))
