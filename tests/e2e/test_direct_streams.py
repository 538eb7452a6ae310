"""``agenttap_stream_path=direct``: mitmproxy sends a streamed call's generation to the policy
server itself and each chunk is rewritten into the provider's events on its way
(capture/direct.py). The client must get the same events as over the loopback listener, the
turn the same record, and a policy that fails mid-stream the same error event and failed row;
the saved flow still shows the client's own request.

Real mitmdump, real HTTPS, the stub policy (and the real SDKs for two providers)."""

from __future__ import annotations

import base64
import http.client
import json
import re
import ssl
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Proxy, read_turns, start_proxy
from tests.e2e.test_policy_faults import (  # noqa: F401  (faulty: a fixture)
    FAULT_AFTER,
    GEMINI_STREAM,
    REPLY,
    assert_failed_answer,
    assert_only_good_call_trained,
    call,
    faulty,
    read_failed,
)
from tests.flows import read_flows
from tests.hostile import ENDPOINTS, good_body, post
from tests.stub_vllm import StubPolicy

PROTOCOLS = ["openai.chat", "openai.responses", "anthropic", "gemini"]
# Fields that differ between any two answers (ids minted per call, clocks).
VOLATILE = {"id", "created", "created_at", "completed_at", "responseId", "item_id", "call_id"}
VOLATILE_TEXT = re.compile(rb'"(?:chatcmpl|msg|resp|rs|fc|call|toolu)_[0-9A-Za-z_-]+"')


@pytest.fixture(scope="module")
def direct(
    stub: StubPolicy, confdir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Proxy, Path]]:
    out = tmp_path_factory.mktemp("direct") / "out"
    flows = out.parent / "flows.mitm"
    # One generation at a time: a slot a stream failed to give back holds up every later call.
    proxy = start_proxy(
        stub.url,
        out,
        confdir,
        extra=[
            "--set", "agenttap_stream_path=direct",
            "--set", "agenttap_replica_max_inflight=1",
            "-w", str(flows),
        ],
    )  # fmt: skip
    yield proxy, flows
    proxy.stop()


def streamed(proxy: Proxy, session: str, protocol: str, text: str) -> tuple[bytes, bytes]:
    """A streamed call's request body and the SSE body answered."""
    body = json.dumps(good_body(protocol, text, stream=True)).encode()
    path = GEMINI_STREAM if protocol == "gemini" else None
    answer = post(proxy, session, protocol, body, path=path)
    assert answer.status == 200, answer.body[:400]
    assert answer.content_type.startswith("text/event-stream"), answer.content_type
    return body, answer.body


def events(sse: bytes) -> list[tuple[str, Any]]:
    """The stream's events, with the values that differ between any two answers blanked."""

    def blank(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: None if k in VOLATILE else blank(v) for k, v in value.items()}
        if isinstance(value, list):
            return [blank(v) for v in value]
        return value

    found = []
    for block in VOLATILE_TEXT.sub(b'"ID"', sse).split(b"\n\n"):
        name, data = "", None
        for line in block.split(b"\n"):
            if line.startswith(b"event:"):
                name = line[6:].strip().decode()
            elif line.startswith(b"data:"):
                payload = line[5:].strip()
                data = payload.decode() if payload == b"[DONE]" else blank(json.loads(payload))
        if name or data is not None:
            found.append((name, data))
    return found


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_direct_stream_is_the_loopback_streams_twin(
    direct: tuple[Proxy, Path], stub_proxy: Proxy, stub: StubPolicy, protocol: str
) -> None:
    proxy, flows = direct
    text = "<think>\nLet me see.\n</think>\n\nThe answer is 42, said twice: 42."
    session = f"direct-{protocol}-{uuid.uuid4().hex[:6]}"
    stub.replies.clear()
    stub.script(text, text)
    stub.chunk_tokens = 3  # several tokens in some chunks, one in others
    try:
        sent, answer = streamed(proxy, session, protocol, "What is it?")
        _, over_loopback = streamed(stub_proxy, session, protocol, "What is it?")
    finally:
        stub.chunk_tokens = 1
    assert events(answer) == events(over_loopback)
    [row] = proxy.turns(session)
    [twin] = stub_proxy.turns(session)
    for field in ("prompt_ids", "completion_ids", "completion_logprobs", "completion_text"):
        assert row[field] == twin[field], field
    assert row["completion_text"].startswith(text)
    assert row["stream"] is True and row["backend"] == stub.url
    # mitmproxy dialed the policy server itself, and the flow is saved as the client sent it.
    [flow] = [f for f in read_flows(flows) if f.metadata.get("agenttap_session") == session]
    assert flow.server_conn.address[1] == int(stub.url.rsplit(":", 1)[1])
    host, path = ENDPOINTS[protocol][0], GEMINI_STREAM if protocol == "gemini" else None
    assert flow.request.host == host and flow.request.method == "POST"
    assert flow.request.path == (path or ENDPOINTS[protocol][1])
    assert flow.request.content == sent
    assert not [h for h in flow.request.headers if h.lower().startswith("x-agenttap")]
    assert "authorization" not in {h.lower() for h in flow.request.headers}


def test_the_sdks_stream_tool_calls_through_a_direct_stream(
    direct: tuple[Proxy, Path], stub: StubPolicy, monkeypatch: pytest.MonkeyPatch
) -> None:
    proxy, _ = direct
    call_text = '<tool_call>\n{"name": "ls", "arguments": {"path": "/tmp"}}\n</tool_call>'
    stub.replies.clear()
    stub.script(call_text, call_text)
    tools = [{"type": "function", "function": {"name": "ls", "parameters": {"type": "object"}}}]
    oa = proxy.openai("direct-sdk-openai", monkeypatch)
    chunks = list(
        oa.chat.completions.create(
            model="gpt-4o",
            messages=[{"role": "user", "content": "list /tmp"}],
            tools=tools,
            stream=True,
        )
    )
    calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or []) if c.choices]
    assert calls[0].function.name == "ls"
    assert json.loads("".join(tc.function.arguments or "" for tc in calls)) == {"path": "/tmp"}
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    an = proxy.anthropic("direct-sdk-anthropic", monkeypatch)
    with an.messages.stream(
        model="claude-sonnet-4-5",
        max_tokens=64,
        messages=[{"role": "user", "content": "list /tmp"}],
        tools=[{"name": "ls", "input_schema": {"type": "object"}}],
    ) as s:
        message = s.get_final_message()
    [use] = [b for b in message.content if b.type == "tool_use"]
    assert use.name == "ls" and use.input == {"path": "/tmp"}
    assert message.stop_reason == "tool_use"
    for session in ("direct-sdk-openai", "direct-sdk-anthropic"):
        [row] = proxy.turns(session)
        assert row["completion_text"].startswith(call_text)


@pytest.mark.parametrize("fault", ["garbage", "truncate"])
@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_policy_failing_mid_stream_is_the_clients_error_event_and_a_failed_row(
    direct: tuple[Proxy, Path], faulty: StubPolicy, protocol: str, fault: str  # noqa: F811
) -> None:
    proxy, _ = direct
    session = f"direct-fault-{protocol}-{fault}-{uuid.uuid4().hex[:6]}"
    assert call(proxy, session, protocol, True).status == 200
    faulty.fault, faulty.fault_after = fault, FAULT_AFTER
    answer = call(proxy, session, protocol, True, text="And then?")
    assert answer.status == 200  # the fault came after the first tokens went out
    said = assert_failed_answer(protocol, True, answer, set())
    assert (b"not JSON" if fault == "garbage" else b"ended its stream") in said
    [row] = assert_only_good_call_trained(proxy, session, REPLY)
    assert row["stream"] is True and row["completion_tokens"] == FAULT_AFTER
    assert row["policy_status"] == (502 if fault == "garbage" else 0)


def test_a_client_that_leaves_mid_stream_frees_the_slot_and_trains_nothing(
    direct: tuple[Proxy, Path], faulty: StubPolicy  # noqa: F811
) -> None:
    """The policy stalls after two tokens; the client hangs up. The generation's slot (the only
    one, no queue) is given back: the next call is answered, not refused."""
    proxy, _ = direct
    session = f"direct-left-{uuid.uuid4().hex[:6]}"
    faulty.fault, faulty.fault_after = "stall", FAULT_AFTER
    host, path = ENDPOINTS["openai.chat"]
    conn = http.client.HTTPSConnection(
        "127.0.0.1",
        proxy.port,
        context=ssl.create_default_context(cafile=str(proxy.ca)),
        timeout=30,
    )
    auth = base64.b64encode(f"{session}:x".encode()).decode()
    conn.set_tunnel(host, 443, headers={"Proxy-Authorization": f"Basic {auth}"})
    body = json.dumps(good_body("openai.chat", "Hi", stream=True)).encode()
    conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    first = resp.read1()  # the first tokens came; then nothing
    assert b"data: " in first
    conn.close()
    faulty.fault = None
    again = call(proxy, session, "openai.chat", True, text="Still there?")
    assert again.status == 200, again.body[:300]
    proxy.flush(session)
    assert [t["completion_text"] for t in read_turns(proxy.out, session)] == [REPLY]
    failed = read_failed(proxy.out, session)
    assert len(failed) == 1 and "broke off" in failed[0]["reason"], failed


def test_a_whole_call_is_still_answered_in_process(
    direct: tuple[Proxy, Path], stub: StubPolicy
) -> None:
    proxy, flows = direct
    session = f"direct-whole-{uuid.uuid4().hex[:6]}"
    stub.replies.clear()
    stub.script("whole")
    body = good_body("openai.chat", "hi")
    body.pop("stream")
    answer = post(proxy, session, "openai.chat", json.dumps(body).encode())
    assert answer.status == 200 and answer.content_type.startswith("application/json")
    [flow] = [f for f in read_flows(flows) if f.metadata.get("agenttap_session") == session]
    assert flow.server_conn.timestamp_start is None
