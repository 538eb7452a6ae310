"""Recorded client traffic replayed offline through the addon gives the same threads.

A real openai SDK tool loop (plain and streamed calls, plus a side call) runs through the proxy
against the scripted stub while mitmdump saves the flows (``-w``). The saved file shows what the
client sent to api.openai.com, minus its key; ``mitmdump -n -C FILE`` then replays it through
the addon, offline, and the replayed shards hold exactly the recorded threads.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.providers.test_openai_tools_stub import (
    TIME_ARGS,
    TOOLS,
    WEATHER_ARGS,
    collect_stream,
    hermes,
)
from tests.support.flows import (
    read_flows,
    recorded_replies,
    recording,
    replay_flows,
    thread_signatures,
)
from tests.support.proxies import Proxy, read_turns
from tests.support.stub_vllm import StubPolicy

SESSION = "replay-tools"
API_KEY = "sk-agenttap-test-key"  # what Proxy.openai gives the SDK
ANSWER = "It is 18 degrees and sunny in Paris; in Tokyo it is 21:05."
REPLIES = [
    hermes("get_weather", WEATHER_ARGS),
    "Weather in Paris",  # the side call's title
    "Checking the time too.\n" + hermes("get_time", TIME_ARGS),
    ANSWER,
]


def _assistant(call: dict[str, str], content: str | None = None) -> dict[str, Any]:
    return {
        "role": "assistant",
        "content": content,
        "tool_calls": [
            {
                "id": call["id"],
                "type": "function",
                "function": {"name": call["name"], "arguments": call["arguments"]},
            }
        ],
    }


def _tool_loop(proxy: Proxy, monkeypatch: pytest.MonkeyPatch) -> None:
    """A scaffold's loop: call, run the tool, call again; one side call for a title."""
    client = proxy.openai(SESSION, monkeypatch)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a weather agent."},
        {"role": "user", "content": "Weather in Paris, and the time in Tokyo?"},
    ]
    first = client.chat.completions.create(model="gpt-4o", messages=messages, tools=TOOLS)
    assert first.choices[0].finish_reason == "tool_calls"
    tc = first.choices[0].message.tool_calls[0]
    call = {"id": tc.id, "name": tc.function.name, "arguments": tc.function.arguments}
    messages += [
        _assistant(call),
        {"role": "tool", "tool_call_id": call["id"], "content": '{"temp_c": 18, "sky": "sunny"}'},
    ]
    title = client.chat.completions.create(
        model="gpt-4o-mini",
        messages=[
            {"role": "system", "content": "Write a short title for this conversation."},
            {"role": "user", "content": messages[1]["content"]},
        ],
    )
    assert title.choices[0].message.content == "Weather in Paris"
    got = collect_stream(
        client.chat.completions.create(
            model="gpt-4o",
            messages=messages,
            tools=TOOLS,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert got["finish_reason"] == "tool_calls"
    assert [c["name"] for c in got["tool_calls"]] == ["get_time"]
    messages += [
        _assistant(got["tool_calls"][0], got["content"]),
        {"role": "tool", "tool_call_id": got["tool_calls"][0]["id"], "content": "21:05"},
    ]
    got = collect_stream(
        client.chat.completions.create(model="gpt-4o", messages=messages, tools=TOOLS, stream=True)
    )
    assert got["finish_reason"] == "stop" and got["content"] == ANSWER


def test_replayed_flows_give_the_recorded_threads(
    stub: StubPolicy, confdir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    flow_file = tmp_path / "tool-loop.flows"
    live, replayed = tmp_path / "live", tmp_path / "replayed"

    # -- record ---------------------------------------------------------------------------
    stub.replies.clear()
    stub.script(*REPLIES)
    first_request = len(stub.requests)
    with recording(stub.url, live, confdir, flow_file) as proxy:
        _tool_loop(proxy, monkeypatch)
    live_prompts = [r["prompt"] for r in stub.requests[first_request:]]
    assert len(live_prompts) == len(REPLIES)
    live_log = proxy.log.read_text(errors="replace")
    assert "dial-guard: loopback 127.0.0.1:" in live_log
    assert "REFUSED" not in live_log

    # -- the flow file: the client's original requests, nothing secret ----------------------
    raw = flow_file.read_bytes()
    assert API_KEY.encode() not in raw
    assert b"x-agenttap-" not in raw.lower()
    flows = read_flows(flow_file)
    assert len(flows) == len(REPLIES), [f.request.pretty_url for f in flows]
    for f in flows:
        assert f.request.method == "POST"
        assert f.request.pretty_url == "https://api.openai.com/v1/chat/completions"
        assert (f.request.scheme, f.request.host, f.request.port) == (
            "https",
            "api.openai.com",
            443,
        )
        assert f.request.headers["Host"] == "api.openai.com"
        assert "authorization" not in f.request.headers
        assert not any(k.lower().startswith("x-agenttap") for k in f.request.headers)
        assert f.metadata["agenttap_session"] == SESSION
        assert "proxyauth" not in f.metadata  # the proxy password stays out too
        assert f.response is not None and f.response.status_code == 200
        assert f.response.raw_content  # streamed bodies stored too
    assert [json.loads(f.request.content).get("stream", False) for f in flows] == [
        False,
        False,
        True,
        True,
    ]

    # -- replay, offline: the stub answers the same texts again -----------------------------
    replies = recorded_replies(live, SESSION)
    assert replies == REPLIES
    stub.replies.clear()
    stub.script(*replies)
    first_request = len(stub.requests)
    replay = replay_flows(flow_file, stub.url, replayed, confdir)
    print(f"replay took {replay.seconds:.1f}s")
    assert replay.returncode == 0, replay.log[-4000:]
    # Only the gateway was dialed: never api.openai.com.
    assert replay.dials and all(d.startswith("loopback 127.0.0.1:") for d in replay.dials), (
        replay.dials
    )
    assert not stub.replies, "not every recorded call was replayed"
    assert [r["prompt"] for r in stub.requests[first_request:]] == live_prompts

    # -- the same threads -------------------------------------------------------------------
    live_turns, replay_turns = read_turns(live, SESSION), read_turns(replayed, SESSION)
    assert len(replay_turns) == len(live_turns) == len(REPLIES)
    for a, b in zip(live_turns, replay_turns, strict=True):
        assert (a["prompt_ids"], a["completion_ids"]) == (b["prompt_ids"], b["completion_ids"])
        assert a["response_finish_reason"] == b["response_finish_reason"]
        assert a["stream"] == b["stream"]
    want, got = thread_signatures(live, SESSION), thread_signatures(replayed, SESSION)
    assert len(want) == 2 and sorted(t["num_turns"] for t in want) == [1, 3]
    assert len(got) == len(want)
    for a, b in zip(want, got, strict=True):
        assert a["input_ids"] == b["input_ids"]
        assert a["loss_mask"] == b["loss_mask"]
        assert 2 not in b["provenance"]  # nothing had to be recomputed
    assert got == want
