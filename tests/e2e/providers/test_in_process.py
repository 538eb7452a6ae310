"""Calls answered whole are answered in-process: the addon hands their buffered body to the
gateway's handlers in mitmproxy's own event loop, with no loopback connection. Calls that stream
still go over the loopback listener, including one whose ``"stream": true`` the addon's quick
check cannot see (an escaped key): the gateway hands it back before anything is counted.

The flow file (``-w``) tells the two apart: an in-process answer never opened a server
connection."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.flows import read_flows
from tests.support.hostile import ENDPOINTS, good_body, post
from tests.support.proxies import Proxy, start_proxy
from tests.support.stub_vllm import StubPolicy

PROTOCOLS = ["openai.chat", "openai.responses", "anthropic", "gemini"]


@pytest.fixture(scope="module")
def saving_proxy(
    stub: StubPolicy, confdir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Proxy, Path]]:
    out = tmp_path_factory.mktemp("in-process") / "out"
    flows = out.parent / "flows.mitm"
    proxy = start_proxy(stub.url, out, confdir, extra=["-w", str(flows)])
    yield proxy, flows
    proxy.stop()


def flow_of(flows: Path, session: str) -> Any:
    """The one saved flow of ``session`` (the file is complete once the proxy wrote it)."""
    found = [f for f in read_flows(flows) if f.metadata.get("agenttap_session") == session]
    assert len(found) == 1, [f.metadata.get("agenttap_session") for f in read_flows(flows)]
    return found[0]


def whole_body(protocol: str, text: str) -> dict[str, Any]:
    body = good_body(protocol, text)
    body.pop("stream", None)  # as the SDKs send a call answered whole: no "stream" at all
    return body


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_whole_answer_never_opens_a_server_connection(
    saving_proxy: tuple[Proxy, Path], stub: StubPolicy, protocol: str
) -> None:
    proxy, flows = saving_proxy
    session = f"inproc-{protocol}-{uuid.uuid4().hex[:6]}"
    stub.script(f"whole {protocol}")
    answer = post(proxy, session, protocol, json.dumps(whole_body(protocol, "hi")).encode())
    assert answer.status == 200, answer.body[:300]
    assert answer.content_type.startswith("application/json")
    assert f"whole {protocol}" in answer.body.decode()
    [row] = proxy.turns(session)
    assert row["completion_text"].startswith(f"whole {protocol}")
    flow = flow_of(flows, session)
    assert flow.server_conn.timestamp_start is None  # answered in-process
    # Saved as the client sent it: its host, no gateway header, no credential.
    assert flow.request.host == ENDPOINTS[protocol][0]
    assert not [h for h in flow.request.headers if h.lower().startswith("x-agenttap")]
    assert "authorization" not in {h.lower() for h in flow.request.headers}


def test_a_stream_goes_over_the_loopback(
    saving_proxy: tuple[Proxy, Path], stub: StubPolicy
) -> None:
    proxy, flows = saving_proxy
    session = f"inproc-stream-{uuid.uuid4().hex[:6]}"
    stub.script("streamed answer")
    body = good_body("openai.chat", "hi", stream=True)
    answer = post(proxy, session, "openai.chat", json.dumps(body).encode())
    assert answer.status == 200 and answer.content_type.startswith("text/event-stream")
    assert answer.body.rstrip().endswith(b"data: [DONE]")
    assert flow_of(flows, session).server_conn.timestamp_start is not None
    assert len(proxy.turns(session)) == 1


def test_a_stream_the_quick_check_misses_is_handed_back_and_streamed(
    saving_proxy: tuple[Proxy, Path], stub: StubPolicy
) -> None:
    """``"\\u0073tream": true`` is "stream": true to a JSON reader, not to the addon's check:
    the gateway hands the call back before counting it, and the loopback streams it. One call,
    one recorded turn."""
    proxy, flows = saving_proxy
    session = f"inproc-escaped-{uuid.uuid4().hex[:6]}"
    stub.script("escaped stream")
    text = json.dumps(whole_body("openai.chat", "hi"))
    raw = text[:-1] + ', "\\u0073tream": true}'
    assert json.loads(raw)["stream"] is True
    answer = post(proxy, session, "openai.chat", raw.encode())
    assert answer.status == 200 and answer.content_type.startswith("text/event-stream")
    assert b"escaped" in answer.body and answer.body.rstrip().endswith(b"data: [DONE]")
    assert flow_of(flows, session).server_conn.timestamp_start is not None
    [row] = proxy.turns(session)
    assert row["completion_text"].startswith("escaped stream")


def test_a_bad_whole_call_gets_the_providers_error_in_process(
    saving_proxy: tuple[Proxy, Path],
) -> None:
    proxy, flows = saving_proxy
    session = f"inproc-bad-{uuid.uuid4().hex[:6]}"
    answer = post(
        proxy, session, "anthropic", json.dumps({"model": "claude", "max_tokens": 5}).encode()
    )
    assert answer.status == 400, answer.body[:300]
    data = json.loads(answer.body)
    assert data["type"] == "error" and "messages" in data["error"]["message"]
    assert flow_of(flows, session).server_conn.timestamp_start is None
    assert proxy.turns(session, expect=0) == []
