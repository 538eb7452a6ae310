"""Credentials on intercepted flows: read the proxy username, strip every key before anything
logs, saves or forwards a flow (mitmproxy types; the header names live in capture/session_ids)."""

from __future__ import annotations

import base64
import binascii
import urllib.parse

from mitmproxy import http

from capture.session_ids import SECRET_HEADERS, SECRET_QUERY

_SECRET_HEADER_BYTES = frozenset(name.encode() for name in SECRET_HEADERS)


def strip_secrets(request: http.Request) -> None:
    """Remove API keys and proxy credentials from a request before anything logs or stores it.
    Keys in the query string (Gemini's ?key=, Azure's ?api-key=) go too: the gateway never needs
    them, and a saved flow keeps the query string."""
    # One pass over the raw fields (Headers.pop would scan them once per name).
    fields = request.headers.fields
    kept = tuple(f for f in fields if f[0].lower() not in _SECRET_HEADER_BYTES)
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
    if not header:
        return None
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        user = base64.b64decode(token.strip(), validate=True).decode("utf-8").partition(":")[0]
    except (binascii.Error, UnicodeDecodeError):
        return None
    return urllib.parse.unquote(user) or None
