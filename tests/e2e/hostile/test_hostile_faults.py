"""Issue 10 item 6 regressions, through the real proxy: a hung policy is answered within the
policy timeout with the provider's retryable error, and a call whose client hung up is dropped
at the policy and not recorded as a completed turn."""

from __future__ import annotations

import json
import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.hostile import assert_provider_error, good_body, post
from tests.support.proxies import Proxy, start_proxy
from tests.support.stub_vllm import StubPolicy

POLICY_TIMEOUT_S = 1
HANG_S = 6.0  # well past the 1 s timeout, even on a loaded machine


@pytest.fixture(scope="module")
def impatient_proxy(
    stub: StubPolicy, confdir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Proxy]:
    out = tmp_path_factory.mktemp("impatient-proxy") / "out"
    proxy = start_proxy(
        stub.url, out, confdir, extra=["--set", f"agenttap_policy_timeout={POLICY_TIMEOUT_S}"]
    )
    yield proxy
    proxy.proc.terminate()
    proxy.proc.wait(timeout=30)


@pytest.fixture
def hung_policy(stub: StubPolicy) -> Iterator[StubPolicy]:
    stub.first_delay_s = HANG_S
    stub.abandoned = 0
    try:
        yield stub
    finally:
        stub.first_delay_s = 0.0


# protocol, stream -> the retryable status its clients back off on
RETRYABLE = [
    ("openai.chat", False, 503),
    ("openai.chat", True, 503),
    ("anthropic", False, 529),
    ("anthropic", True, 529),
    ("openai.responses", False, 503),
    ("openai.responses", True, 503),
]


@pytest.mark.parametrize(("protocol", "stream", "status"), RETRYABLE)
def test_hung_policy_times_out_with_the_providers_retryable_error(
    impatient_proxy: Proxy, hung_policy: StubPolicy, protocol: str, stream: bool, status: int
) -> None:
    session = f"hung-{protocol}-{stream}-{uuid.uuid4().hex[:6]}"
    began = time.monotonic()
    answer = post(
        impatient_proxy, session, protocol, json.dumps(good_body(protocol, stream=stream)).encode()
    )
    waited = time.monotonic() - began
    assert answer.status == status, answer.body[:300]
    err = assert_provider_error(protocol, answer)
    assert "did not answer in time" in err["message"], err
    assert waited < HANG_S, f"the client waited {waited:.1f}s for a {POLICY_TIMEOUT_S}s timeout"
    assert impatient_proxy.turns(session, expect=0) == []


def test_a_call_whose_client_left_is_dropped_and_not_recorded(
    stub_proxy: Proxy, hung_policy: StubPolicy
) -> None:
    session = f"left-{uuid.uuid4().hex[:6]}"
    asked = len(hung_policy.requests)
    with pytest.raises((TimeoutError, socket.timeout)):
        post(
            stub_proxy,
            session,
            "openai.chat",
            json.dumps(good_body("openai.chat")).encode(),
            timeout=1,
        )
    # The policy sees its caller gone when its delay ends (the gateway dropped the request).
    # This call's own request (index ``asked``): earlier tests' hung requests end meanwhile.
    deadline = time.monotonic() + HANG_S + 10
    while asked not in hung_policy.abandoned_at:
        assert time.monotonic() < deadline, "the policy request outlived its client"
        time.sleep(0.1)
    assert len(hung_policy.requests) == asked + 1
    hung_policy.first_delay_s = 0.0
    assert stub_proxy.turns(session, expect=0) == []
    # The session goes on normally: its next call is its first recorded turn.
    hung_policy.script("back")
    answer = post(stub_proxy, session, "openai.chat", json.dumps(good_body("openai.chat")).encode())
    assert answer.status == 200, answer.body[:300]
    rows = stub_proxy.turns(session)
    assert [r["completion_text"] for r in rows] == ["back"]


# protocol -> what its stream ends with when the policy stalls after the first token
MID_STREAM_FAILURE = [
    ("openai.chat", b'"error"'),
    ("anthropic", b"event: error"),
    ("openai.responses", b"event: response.failed"),
]


@pytest.mark.parametrize(("protocol", "marker"), MID_STREAM_FAILURE)
def test_a_policy_that_stalls_mid_stream_ends_the_stream_with_the_providers_error(
    impatient_proxy: Proxy, stub: StubPolicy, protocol: str, marker: bytes
) -> None:
    """The first tokens went out (200, events streamed); then the policy goes silent past
    agenttap_policy_timeout. The stream ends with the provider's own error event (Responses:
    response.failed), and no turn is recorded for a call the client never got whole."""
    session = f"stall-{protocol}-{uuid.uuid4().hex[:6]}"
    stub.replies.clear()
    stub.script("One two three four five six.")
    stub.chunk_delay_s = POLICY_TIMEOUT_S + 2.0
    try:
        answer = post(
            impatient_proxy,
            session,
            protocol,
            json.dumps(good_body(protocol, stream=True)).encode(),
        )
    finally:
        stub.chunk_delay_s = 0.0
    assert answer.status == 200, answer.body[:300]
    assert answer.content_type.startswith("text/event-stream")
    assert marker in answer.body, answer.body[-600:]
    assert b"did not answer in time" in answer.body, answer.body[-600:]
    if protocol == "openai.responses":
        body = answer.body
        assert body.index(b"response.output_text.delta") < body.index(b"response.failed")
        assert b"response.completed" not in body
    assert impatient_proxy.turns(session, expect=0) == []
