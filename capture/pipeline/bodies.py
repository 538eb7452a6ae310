"""What the gateway reads of a request before any provider sees it: its head and its body.

Heads: the providers' own front ends take tens of kB of headers, so the proxy passes heads up to
``MAX_HEAD_BYTES`` on; a larger one is cut down to what HTTP framing needs (``shrink_head``, in
the addon) and the gateway answers it with the provider's 431. Bodies: read whole, decoded
(gzip, deflate) under the ``agenttap_max_body_bytes`` limit, so a compressed bomb never inflates
past it; every refusal is a ``RequestError`` the provider words as its own 400, 413 or 415.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError
from multidict import CIMultiDict, CIMultiDictProxy, MultiDictProxy
from yarl import URL

from rewriter.canonical import RequestError
from rewriter.providers.base import IncomingRequest

# The client's Content-Encoding, moved here by the addon so that the gateway decodes the body
# itself, bounded and with errors in the provider's format (aiohttp would answer a bad one with
# a text/plain 400).
UNSUPPORTED_ENCODING_HEADER = "X-Agenttap-Content-Encoding"

# Request heads (request target and header fields) the proxy passes on. The providers' own front
# ends take tens of kB of headers, so a client sending that much is served; past these limits the
# addon passes the gateway only what framing needs (``shrink_head``) and marks the request with
# OVERSIZED_HEADER, and the client gets its provider's 431 instead of aiohttp's text/plain 400.
MAX_HEAD_BYTES = 256 * 1024
MAX_HEAD_FIELDS = 512
OVERSIZED_HEADER = "X-Agenttap-Oversized-Head"
# What the gateway's HTTP parser reads: the limits above plus the headers the addon adds.
PARSER_HEAD_BYTES = MAX_HEAD_BYTES + 16 * 1024
PARSER_HEAD_FIELDS = MAX_HEAD_FIELDS + 16
# Fields an oversized request keeps on its way to the gateway (HTTP framing and the WebSocket
# handshake), when short.
_FRAMING = frozenset(
    {
        b"host",
        b"content-length",
        b"transfer-encoding",
        b"content-type",
        b"connection",
        b"upgrade",
        b"sec-websocket-key",
        b"sec-websocket-version",
    }
)


def shrink_head(
    target: str, fields: list[tuple[bytes, bytes]]
) -> tuple[str, list[tuple[bytes, bytes]], str] | None:
    """None when a request head (its target, its header fields) is within the limits; else the
    target and fields to pass on instead, and what was too large (for the client's error)."""
    size = len(target) + sum(len(name) + len(value) + 4 for name, value in fields)
    if size <= MAX_HEAD_BYTES and len(fields) <= MAX_HEAD_FIELDS:
        return None
    note = f"{size} bytes in {len(fields)} header fields"
    kept = [(n, v) for n, v in fields if n.lower() in _FRAMING and len(v) <= 1024]
    # The path alone still routes the call (whose provider words the error); the query goes.
    return target.split("?", 1)[0][:8192], kept, note


def oversized_head_message(note: str) -> str:
    """The client's 431 for a head ``shrink_head`` cut down (``note``: what was too large)."""
    return (
        f"Request header fields too large ({note[:80]}): this proxy accepts a request target "
        f"and headers of at most {MAX_HEAD_BYTES} bytes in at most {MAX_HEAD_FIELDS} fields."
    )


class NeedsLoopback(Exception):
    """A buffered call the gateway cannot answer in-process (it streams, or upgrades to a
    WebSocket): raised before anything of it is counted or recorded, so the addon sends it on
    to the loopback listener instead."""


@dataclass(frozen=True)
class BufferedRequest:
    """A call whose body mitmproxy already holds whole, answered by the gateway in-process
    (``Gateway.answer_buffered``): the fields of a ``web.Request`` the gateway reads."""

    method: str
    path: str
    query: MultiDictProxy[str]
    headers: CIMultiDictProxy[str]
    body: bytes

    @classmethod
    def of(
        cls, method: str, target: str, headers: list[tuple[str, str]], body: bytes
    ) -> BufferedRequest:
        """From a request line's target (path and query, still percent-encoded, as on the
        wire) and its header fields."""
        url = URL(target, encoded=True)
        return cls(
            method=method,
            path=url.path,
            query=url.query,
            headers=CIMultiDictProxy(CIMultiDict(headers)),
            body=body,
        )

    @property
    def content_length(self) -> int | None:
        return len(self.body)

    async def read(self) -> bytes:
        return self.body


async def read_body(request: IncomingRequest, max_body_bytes: int) -> bytes:
    """The request's body, decoded; a ``RequestError`` (400, 413, 415) when it is too large,
    in an unsupported encoding, or cannot be read or decoded."""
    if (request.content_length or 0) > max_body_bytes:
        raise RequestError(too_large_message(max_body_bytes, request.content_length), status=413)
    encoding = request.headers.get("Content-Encoding", "").strip().lower()
    encoding = request.headers.get(UNSUPPORTED_ENCODING_HEADER, encoding).strip().lower()
    if encoding not in ("", "identity", "gzip", "deflate"):
        raise RequestError(
            f"Unsupported Content-Encoding {encoding[:40]!r}; send the body as identity, "
            "gzip or deflate.",
            status=415,
        )
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise RequestError(too_large_message(max_body_bytes), status=413) from None
    except RequestPayloadError as exc:
        raise RequestError(f"The request body could not be read: {exc}", status=400) from None
    if encoding in ("", "identity"):
        return raw
    # gzip (wbits 16+) or zlib/raw deflate (wbits 32+ detects a header); bounded output.
    inflater = zlib.decompressobj(16 + zlib.MAX_WBITS if encoding == "gzip" else 47)
    try:
        body = inflater.decompress(raw, max_body_bytes + 1)
    except zlib.error as exc:
        raise RequestError(
            f"The request body is not valid {encoding} ({exc}); send it uncompressed or "
            "compressed whole.",
            status=400,
        ) from None
    if len(body) > max_body_bytes or inflater.unconsumed_tail:
        raise RequestError(too_large_message(max_body_bytes), status=413)
    if not inflater.eof:
        raise RequestError(
            f"The request body is a truncated {encoding} stream; send it whole.", status=400
        )
    return body


def too_large_message(max_body_bytes: int, size: int | None = None) -> str:
    """The client's 413; ``size``: the declared length, when there was one."""
    got = f" ({size} bytes)" if size else ""
    return (
        f"Request body too large{got}: this proxy accepts at most {max_body_bytes} bytes "
        "(option agenttap_max_body_bytes)."
    )
