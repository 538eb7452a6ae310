"""capture/pipeline/bodies.py: a buffered call as the gateway reads it, and its body under the limits."""

from __future__ import annotations

import gzip

import pytest

from capture.pipeline.bodies import UNSUPPORTED_ENCODING_HEADER, BufferedRequest, read_body
from rewriter.canonical import RequestError
from rewriter.providers.base import Call


def test_a_buffered_request_reads_like_the_loopback_one() -> None:
    req = BufferedRequest.of(
        "POST",
        "/v1beta/models/gemini-2.5-flash:generateContent?alt=sse&key=%2Fk",
        [("Content-Type", "application/json"), ("x-a", "1"), ("X-A", "2")],
        b"{}",
    )
    assert req.path == "/v1beta/models/gemini-2.5-flash:generateContent"
    assert dict(req.query) == {"alt": "sse", "key": "/k"}
    assert req.headers.getall("x-a") == ["1", "2"] and req.headers["content-type"]
    assert req.content_length == 2
    call = Call.of(req, "generativelanguage.googleapis.com")
    assert call.method == "POST" and call.path == req.path and call.query["alt"] == "sse"


async def test_a_buffered_body_is_decoded_and_bounded_as_on_the_loopback() -> None:
    packed = gzip.compress(b'{"a": 1}')
    req = BufferedRequest.of(
        "POST", "/v1/messages", [(UNSUPPORTED_ENCODING_HEADER, "gzip")], packed
    )
    assert await read_body(req, 1000) == b'{"a": 1}'
    with pytest.raises(RequestError) as too_large:
        await read_body(BufferedRequest.of("POST", "/", [], b"x" * 11), 10)
    assert too_large.value.status == 413
    with pytest.raises(RequestError) as unknown:
        await read_body(
            BufferedRequest.of("POST", "/", [(UNSUPPORTED_ENCODING_HEADER, "br")], b"x"), 10
        )
    assert unknown.value.status == 415
