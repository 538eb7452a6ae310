"""Large request heads (issue 14): a header over 8,190 bytes got aiohttp's text/plain 400 from the
loopback gateway. The providers' own front ends take tens of kB, so such a request is served;
past the proxy's limits the client gets its provider's 431 in its own error format."""

from __future__ import annotations

import json

import pytest

from capture.pipeline.bodies import MAX_HEAD_BYTES, MAX_HEAD_FIELDS, shrink_head
from tests.support.hostile import assert_provider_error, good_body, post
from tests.support.proxies import Proxy

PROTOCOLS = ["openai.chat", "anthropic", "gemini", "openai.responses"]


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_64_kb_header_is_served(stub_proxy: Proxy, protocol: str) -> None:
    body = json.dumps(good_body(protocol)).encode()
    answer = post(stub_proxy, f"big-head-{protocol}", protocol, body, {"X-Trace": "t" * 65536})
    assert answer.status == 200, answer.body[:300]


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_head_past_the_limit_is_the_providers_431(stub_proxy: Proxy, protocol: str) -> None:
    body = json.dumps(good_body(protocol)).encode()
    big = {"X-Trace": "t" * (MAX_HEAD_BYTES + 1)}
    answer = post(stub_proxy, f"huge-head-{protocol}", protocol, body, big)
    assert answer.status == 431, answer.body[:300]
    error = assert_provider_error(protocol, answer)
    assert "header fields too large" in error["message"], error
    # The same connection's next request (a new one here) is served: nothing was left broken.
    again = post(stub_proxy, f"huge-head-{protocol}", protocol, body)
    assert again.status == 200, again.body[:300]


def test_many_header_fields_are_the_providers_431(stub_proxy: Proxy) -> None:
    body = json.dumps(good_body("anthropic")).encode()
    many = {f"X-Field-{i}": "v" for i in range(MAX_HEAD_FIELDS + 1)}
    answer = post(stub_proxy, "many-fields", "anthropic", body, many)
    assert answer.status == 431, answer.body[:300]
    error = assert_provider_error("anthropic", answer)
    assert f"at most {MAX_HEAD_FIELDS} fields" in error["message"], error


def test_shrink_head_keeps_framing_and_drops_the_rest() -> None:
    fields = [
        (b"Host", b"api.openai.com"),
        (b"Content-Length", b"12"),
        (b"Authorization", b"Bearer sk-x"),
        (b"X-Big", b"b" * MAX_HEAD_BYTES),
    ]
    assert shrink_head("/v1/chat/completions", fields[:3]) is None
    shrunk = shrink_head("/v1/chat/completions?x=1", fields)
    assert shrunk is not None
    target, kept, note = shrunk
    assert target == "/v1/chat/completions"
    assert kept == [(b"Host", b"api.openai.com"), (b"Content-Length", b"12")]
    assert "4 header fields" in note
    # A long target alone crosses the limit too, and is cut to its path.
    long_target = "/v1/messages?" + "q" * MAX_HEAD_BYTES
    shrunk = shrink_head(long_target, fields[:2])
    assert shrunk is not None and shrunk[0] == "/v1/messages"
