"""The Anthropic Messages API through the real proxy: the real anthropic SDK -> mitmdump -> stub.

The stub answers the scripted completion (Qwen3 tokenizer, ended with ``<|im_end|>``), so each test
knows the tokens the policy produced and the reply the client must see.
"""

from __future__ import annotations

import json
import ssl
from pathlib import Path
from typing import Any

import anthropic
import httpx2 as httpx
import pytest

from tests.support.paths import IM_END
from tests.support.proxies import ONE_EVENT_PER_TOKEN_S, Proxy, start_proxy
from tests.support.stub_vllm import StubPolicy

TOOLS: list[dict[str, Any]] = [
    {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "input_schema": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
        "cache_control": {"type": "ephemeral"},
    }
]
USER = [{"role": "user", "content": "What's the weather in Paris?"}]


def script(stub: StubPolicy, *texts: str) -> int:
    stub.replies.clear()
    stub.script(*texts)
    return len(stub.requests)


def hermes(name: str, arguments: dict[str, Any]) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def raw_events(proxy: Proxy, session: str, body: dict[str, Any]) -> list[tuple[str, dict]]:
    """POST /v1/messages through the proxy and split the SSE stream into (event, data)."""
    with httpx.Client(
        proxy=f"http://{session}:x@127.0.0.1:{proxy.port}",
        verify=ssl.create_default_context(cafile=str(proxy.ca)),
        timeout=60,
    ) as http:
        resp = http.post(
            "https://api.anthropic.com/v1/messages?beta=true",
            json=body,
            headers={"x-api-key": "sk-ant-test", "anthropic-version": "2023-06-01"},
        )
    assert resp.status_code == 200, resp.text
    assert resp.headers["content-type"].startswith("text/event-stream")
    events = []
    for block in resp.text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines())
        data = json.loads(lines["data"])
        assert data["type"] == lines["event"]
        events.append((lines["event"], data))
    return events


def test_text_non_streamed(
    stub_proxy: Proxy, stub: StubPolicy, tok: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    n = script(stub, "Hello there.")
    client = stub_proxy.anthropic("anth-plain", monkeypatch)
    msg = client.messages.create(model="claude-sonnet-4-5", max_tokens=100, messages=USER)
    assert msg.type == "message" and msg.role == "assistant"
    assert msg.model == "claude-sonnet-4-5"
    assert msg.id.startswith("msg_")
    assert [b.type for b in msg.content] == ["text"]
    assert msg.content[0].text == "Hello there."
    assert msg.stop_reason == "end_turn" and msg.stop_sequence is None
    sent = stub.requests[n]
    assert msg.usage.input_tokens == len(sent["prompt"])
    assert msg.usage.output_tokens == len(tok.encode("Hello there.")) + 1
    # Anthropic's default is no thinking: Qwen3's template writes the empty think block.
    assert tok.decode(sent["prompt"]).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert sent["max_tokens"] == 100
    rows = stub_proxy.turns("anth-plain", expect=1)
    assert rows[0]["protocol"] == "anthropic.messages"
    assert rows[0]["response_finish_reason"] == "end_turn"
    assert rows[0]["requested_model"] == "claude-sonnet-4-5"


def test_exact_sse_event_sequence(stub_proxy: Proxy, stub: StubPolicy) -> None:
    reply = "<think>\nLet me look.\n</think>\n\nChecking." + hermes(
        "get_weather", {"city": "Paris"}
    )
    script(stub, reply)
    body = {
        "model": "claude-opus-4-5",
        "max_tokens": 500,
        "stream": True,
        "thinking": {"type": "adaptive"},
        "tools": TOOLS,
        "messages": USER,
    }
    events = raw_events(stub_proxy, "anth-sse", body)
    kinds = [e for e, _ in events]
    assert kinds[:2] == ["message_start", "ping"]
    assert kinds[-2:] == ["message_delta", "message_stop"]
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    assert start["usage"]["input_tokens"] > 0
    blocks: list[dict[str, Any]] = []
    open_index = None
    for kind, data in events[2:-2]:
        if kind == "content_block_start":
            assert open_index is None and data["index"] == len(blocks)
            open_index = data["index"]
            blocks.append({**data["content_block"], "deltas": []})
        elif kind == "content_block_delta":
            assert data["index"] == open_index
            blocks[-1]["deltas"].append(data["delta"])
        else:
            assert kind == "content_block_stop" and data["index"] == open_index
            open_index = None
    assert [b["type"] for b in blocks] == ["thinking", "text", "tool_use"]
    thinking = blocks[0]["deltas"]
    assert (
        "".join(d["thinking"] for d in thinking if d["type"] == "thinking_delta") == "Let me look."
    )
    assert thinking[-1]["type"] == "signature_delta" and thinking[-1]["signature"]
    assert "".join(d["text"] for d in blocks[1]["deltas"]) == "Checking."
    tool = blocks[2]
    assert tool["id"].startswith("toolu_") and tool["name"] == "get_weather" and tool["input"] == {}
    partial = "".join(d["partial_json"] for d in tool["deltas"] if d["type"] == "input_json_delta")
    assert json.loads(partial) == {"city": "Paris"}
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] > 5


def test_stream_with_sdk_helper(
    stub_proxy: Proxy, stub: StubPolicy, monkeypatch: pytest.MonkeyPatch
) -> None:
    script(stub, "One two three four five.")
    client = stub_proxy.anthropic("anth-stream", monkeypatch)
    texts = []
    # A token slower than the flush interval: the proxy keeps up, so each goes out as it comes
    # (tokens that came within the interval go out together: tests/e2e/providers/test_coalesced_stream.py).
    stub.chunk_delay_s = ONE_EVENT_PER_TOKEN_S
    try:
        with client.messages.stream(model="claude-sonnet-4-5", max_tokens=64, messages=USER) as s:
            for text in s.text_stream:
                texts.append(text)
            final = s.get_final_message()
    finally:
        stub.chunk_delay_s = 0.0
    assert len(texts) > 3  # token by token, not one blob
    assert "".join(texts) == "One two three four five."
    assert final.content[0].text == "One two three four five."
    assert final.stop_reason == "end_turn"
    rows = stub_proxy.turns("anth-stream", expect=1)
    assert rows[0]["stream"] is True


def test_tool_use_loop_extends_one_thread(
    stub_proxy: Proxy, stub: StubPolicy, tok: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    call = hermes("get_weather", {"city": "Paris"})
    n = script(stub, call, "It is sunny in Paris.")
    client = stub_proxy.anthropic("anth-tools", monkeypatch)
    system = [
        {"type": "text", "text": "x-anthropic-billing-header: cc_version=1; cch=aaaaa;"},
        {"type": "text", "text": "You are a weather bot.", "cache_control": {"type": "ephemeral"}},
    ]
    first = client.messages.create(
        model="claude-opus-4-5", max_tokens=200, system=system, tools=TOOLS, messages=USER
    )
    assert first.stop_reason == "tool_use"
    use = first.content[-1]
    assert use.type == "tool_use" and use.name == "get_weather" and use.input == {"city": "Paris"}
    # Claude Code's way: the billing header changes, cache_control moves, the user turn flips
    # from a string to blocks.
    system2 = [
        {"type": "text", "text": "x-anthropic-billing-header: cc_version=1; cch=bbbbb;"},
        {"type": "text", "text": "You are a weather bot."},
    ]
    history = [
        {"role": "user", "content": [{"type": "text", "text": USER[0]["content"]}]},
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": use.id,
                    "content": [{"type": "text", "text": "18C, sunny"}],
                    "cache_control": {"type": "ephemeral"},
                }
            ],
        },
    ]
    second = client.messages.create(
        model="claude-opus-4-5", max_tokens=200, system=system2, tools=TOOLS, messages=history
    )
    assert second.stop_reason == "end_turn"
    assert second.content[0].text == "It is sunny in Paris."

    prompt1, prompt2 = stub.requests[n]["prompt"], stub.requests[n + 1]["prompt"]
    text1 = tok.decode(prompt1)
    assert "billing-header" not in text1 and "You are a weather bot." in text1
    # No divergence: call 2's prompt is call 1's prompt + the exact sampled ids + new messages.
    sampled = list(tok.encode(call, add_special_tokens=False)) + [IM_END]
    assert prompt2[: len(prompt1) + len(sampled)] == prompt1 + sampled
    assert "<tool_response>\n18C, sunny\n</tool_response>" in tok.decode(prompt2)
    rows = stub_proxy.turns("anth-tools", expect=2)
    assert [json.loads(r["metadata"])["assembly"] for r in rows] == ["new", "extend"]
    assert [r["response_finish_reason"] for r in rows] == ["tool_use", "end_turn"]
    (thread,) = stub_proxy.threads("anth-tools")
    assert thread["num_turns"] == 2 and 2 not in thread["provenance"]
    assert thread["protocol"] == "anthropic.messages"


def test_count_tokens_is_the_prompt_length(
    stub_proxy: Proxy, stub: StubPolicy, monkeypatch: pytest.MonkeyPatch
) -> None:
    n = script(stub, "Fine.")
    client = stub_proxy.anthropic("anth-count", monkeypatch)
    kwargs: dict[str, Any] = {"model": "claude-opus-4-5", "tools": TOOLS, "messages": USER}
    counted = client.messages.count_tokens(**kwargs)
    client.messages.create(max_tokens=20, **kwargs)
    assert counted.input_tokens == len(stub.requests[n]["prompt"])


def test_structured_output_is_constrained(
    stub_proxy: Proxy, stub: StubPolicy, monkeypatch: pytest.MonkeyPatch
) -> None:
    n = script(stub, '{"title": "Weather in Paris"}')
    client = stub_proxy.anthropic("anth-json", monkeypatch)
    schema = {
        "type": "object",
        "properties": {"title": {"type": "string"}},
        "required": ["title"],
        "additionalProperties": False,
    }
    msg = client.messages.create(
        model="claude-haiku-4-5",
        max_tokens=100,
        messages=USER,
        thinking={"type": "enabled", "budget_tokens": 1024},
        extra_body={"output_config": {"format": {"type": "json_schema", "schema": schema}}},
    )
    assert json.loads(msg.content[0].text) == {"title": "Weather in Paris"}
    assert stub.requests[n]["structured_outputs"] == {"json": schema}


def test_stop_sequence_and_max_tokens(
    stub_proxy: Proxy, stub: StubPolicy, monkeypatch: pytest.MonkeyPatch
) -> None:
    script(stub, "alpha beta END gamma", "one two three four five six seven")
    client = stub_proxy.anthropic("anth-stops", monkeypatch)
    msg = client.messages.create(
        model="claude-opus-4-5", max_tokens=50, messages=USER, stop_sequences=["END"]
    )
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == "END"
    assert msg.content[0].text == "alpha beta"
    msg = client.messages.create(model="claude-opus-4-5", max_tokens=3, messages=USER)
    assert msg.stop_reason == "max_tokens" and msg.usage.output_tokens == 3


def test_mid_conversation_system_message(
    stub_proxy: Proxy, stub: StubPolicy, tok: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    n = script(stub, "Noted.")
    client = stub_proxy.anthropic("anth-midsys", monkeypatch)
    messages: Any = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "<system-reminder>x</system-reminder>"}],
        },
        {"role": "system", "content": "Deferred tools: none."},
        {"role": "user", "content": "hi"},
    ]
    client.messages.create(model="claude-opus-4-5", max_tokens=20, messages=messages)
    text = tok.decode(stub.requests[n]["prompt"])
    assert "<|im_start|>system\nDeferred tools: none.<|im_end|>" in text


def test_errors_in_anthropic_format(stub_proxy: Proxy, monkeypatch: pytest.MonkeyPatch) -> None:
    client = stub_proxy.anthropic("anth-errors", monkeypatch)
    image = {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/png", "data": "AA=="},
    }
    with pytest.raises(anthropic.BadRequestError) as exc:
        client.messages.create(
            model="claude-opus-4-5",
            max_tokens=10,
            messages=[{"role": "user", "content": [image]}],
        )
    assert exc.value.status_code == 400
    body: Any = exc.value.body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "text only" in body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError) as nf:
        client.get("/v1/no-such-endpoint", cast_to=object)
    assert nf.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]


def test_prompt_too_long(
    stub_proxy: Proxy, stub: StubPolicy, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = stub_proxy.anthropic("anth-long", monkeypatch)
    long_text = "word " * (stub.max_model_len + 10)
    with pytest.raises(anthropic.BadRequestError) as exc:
        client.messages.create(
            model="claude-opus-4-5",
            max_tokens=10,
            messages=[{"role": "user", "content": long_text}],
        )
    body: Any = exc.value.body
    assert body["error"]["type"] == "invalid_request_error"
    assert body["error"]["message"].startswith("prompt is too long:")


def test_models_and_local_answers(stub_proxy: Proxy, monkeypatch: pytest.MonkeyPatch) -> None:
    client = stub_proxy.anthropic("anth-models", monkeypatch)
    ids = [m.id for m in client.models.list()]
    assert "claude-haiku-5-5" in ids and "stub-policy" in ids
    assert client.models.retrieve("claude-opus-4-7").id == "claude-opus-4-7"
    with httpx.Client(
        proxy=f"http://anth-models:x@127.0.0.1:{stub_proxy.port}",
        verify=ssl.create_default_context(cafile=str(stub_proxy.ca)),
    ) as http:
        boot = http.get("https://api.anthropic.com/api/claude_cli/bootstrap")
        assert boot.status_code == 200 and boot.json() == {}
        logged = http.post("https://api.anthropic.com/api/event_logging/v2/batch", json={"x": 1})
        assert logged.status_code == 200


def test_overloaded_when_policy_is_down(
    tmp_path: Path, confdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from policy_server.launcher import free_port

    # A policy that is down: started anyway, so its calls get the provider's retryable error.
    proxy = start_proxy(
        f"http://127.0.0.1:{free_port()}",
        tmp_path / "out",
        confdir,
        extra=["--set", "agenttap_check_policy=false"],
    )
    try:
        client = proxy.anthropic("anth-down", monkeypatch)
        with pytest.raises(anthropic.APIStatusError) as exc:
            client.messages.create(model="claude-opus-4-5", max_tokens=10, messages=USER)
        assert exc.value.status_code == 529
        body: Any = exc.value.body
        assert body["error"]["type"] == "overloaded_error"
    finally:
        proxy.stop()


def test_session_without_proxy_credentials(
    stub_proxy: Proxy, stub: StubPolicy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No username in HTTPS_PROXY: no 407; the client's own session header names the session."""
    script(stub, "Hi.")
    monkeypatch.setenv("HTTPS_PROXY", f"http://127.0.0.1:{stub_proxy.port}")
    monkeypatch.setenv("SSL_CERT_FILE", str(stub_proxy.ca))
    monkeypatch.delenv("ANTHROPIC_BASE_URL", raising=False)
    client = anthropic.Anthropic(
        api_key="sk-ant-test",
        max_retries=0,
        default_headers={"X-Claude-Code-Session-Id": "5f0c-no-creds"},
    )
    msg = client.messages.create(model="claude-opus-4-5", max_tokens=20, messages=USER)
    assert msg.content[0].text == "Hi."
    rows = stub_proxy.turns("claude-code:5f0c-no-creds", expect=1)
    assert len(rows) == 1


def test_tool_choice_none_gives_text(
    stub_proxy: Proxy, stub: StubPolicy, monkeypatch: pytest.MonkeyPatch
) -> None:
    call = hermes("get_weather", {"city": "Paris"})
    script(stub, call)
    client = stub_proxy.anthropic("anth-choice-none", monkeypatch)
    msg = client.messages.create(
        model="claude-opus-4-5",
        max_tokens=200,
        tools=TOOLS,
        tool_choice={"type": "none"},
        messages=USER,
    )
    assert msg.stop_reason == "end_turn"
    assert [b.type for b in msg.content] == ["text"]
    assert '"name": "get_weather"' in msg.content[0].text


def test_model_map_sends_side_models_to_their_own_server(
    stub: StubPolicy,
    qwen3_dir: Path,
    confdir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """agenttap_model_map: claude-haiku-* goes to a second policy server, the rest to the policy."""
    small = StubPolicy(str(qwen3_dir), model_name="small-policy")
    small.start()
    proxy = start_proxy(
        stub.url,
        tmp_path / "out",
        confdir,
        extra=["--set", f"agenttap_model_map=claude-haiku-*={small.url}"],
    )
    try:
        script(stub, "From the main policy.")
        small.script("From the small policy.")
        client = proxy.anthropic("anth-map", monkeypatch)
        side = client.messages.create(model="claude-haiku-5-5", max_tokens=20, messages=USER)
        main = client.messages.create(model="claude-opus-5-5", max_tokens=20, messages=USER)
        assert side.content[0].text == "From the small policy."
        assert main.content[0].text == "From the main policy."
        assert len(small.requests) == 1
        rows = proxy.turns("anth-map", expect=2)
        by_model = {r["requested_model"]: r for r in rows}
        assert by_model["claude-haiku-5-5"]["backend"] == small.url
        assert by_model["claude-haiku-5-5"]["policy_model"] == "small-policy"
        assert by_model["claude-opus-5-5"]["backend"] == stub.url
    finally:
        proxy.stop()
        small.stop()
