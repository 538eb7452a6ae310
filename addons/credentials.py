"""Credentials on intercepted flows: read the proxy username, strip every key before anything
logs, saves or forwards a flow (mitmproxy types; the header names live in capture/session_ids)."""

from __future__ import annotations

import base64
import binascii
import urllib.parse

from mitmproxy import http

from capture.pipeline.session_ids import INTERNAL_PREFIX, SECRET_HEADERS, SECRET_QUERY

_SECRET_HEADER_BYTES = frozenset(name.encode() for name in SECRET_HEADERS)
_INTERNAL_PREFIX_BYTES = INTERNAL_PREFIX.encode()


def strip_secrets(request: http.Request) -> None:
    """Remove API keys and proxy credentials from a request before anything logs or stores it,
    and every ``X-Agenttap-*`` header the client sent: only the addon sets those, after this
    (a client's copy would speak for it). Keys in the query string (Gemini's ?key=, Azure's
    ?api-key=) go too: the gateway never needs them, and a saved flow keeps the query string."""
    # One pass over the raw fields (Headers.pop would scan them once per name).
    fields = request.headers.fields
    kept = tuple(
        f
        for f in fields
        if (name := f[0].lower()) not in _SECRET_HEADER_BYTES
        and not name.startswith(_INTERNAL_PREFIX_BYTES)
    )
    if len(kept) != len(fields):
        request.headers.fields = kept
    if "?" not in request.path:
        return  # no query string (most calls): nothing to parse
    query = request.query
    for name in list(query.keys()):
        if name.lower() in SECRET_QUERY:
            del query[name]


def proxy_user(header: str | None) -> str | None:
    """The username of a ``Proxy-Authorization: Basic ...`` header (the session id)."""
    return proxy_credentials(header)[0]


def proxy_credentials(header: str | None) -> tuple[str | None, str]:
    """The username (the session id) and password (its secret) of a ``Proxy-Authorization:
    Basic ...`` header; (None, "") without one."""
    if not header:
        return None, ""
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "basic":
        return None, ""
    try:
        decoded = base64.b64decode(token.strip(), validate=True).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError):
        return None, ""
    user, _, password = decoded.partition(":")
    return urllib.parse.unquote(user) or None, urllib.parse.unquote(password)
