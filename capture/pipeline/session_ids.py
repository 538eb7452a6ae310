"""Which session a call belongs to, as the addon tells the gateway.

The session is the proxy username a client gave (``HTTPS_PROXY=http://SESSION:x@proxy``); the
addon passes it to the gateway in ``SESSION_HEADER``, quoted, since a username may hold
characters no header value can carry. A call without one is placed by the client's own session
header where its provider names one (Claude Code's, Codex's), else in ``"anonymous"``.
"""

from __future__ import annotations

import urllib.parse
from typing import Any

from capture.storage.sessions import safe_text
from rewriter.providers.base import IncomingRequest, Provider

SESSION_HEADER = "X-Agenttap-Session"
# The proxy password a client gave (its session's secret), as the addon tells the gateway.
SESSION_SECRET_HEADER = "X-Agenttap-Session-Secret"
# Every header of ours starts so; a client's own copies are removed before anything reads them
# (a client that could set one would speak for the addon).
INTERNAL_PREFIX = "x-agenttap-"
# Credentials a client sends to its provider: never forwarded, never logged, never stored.
SECRET_HEADERS = ("authorization", "x-api-key", "x-goog-api-key", "api-key", "proxy-authorization")
SECRET_QUERY = frozenset({"key", "api-key", "api_key", "apikey", "access_token"})
ANONYMOUS = "anonymous"


def quote_session(session_id: str) -> str:
    """A proxy username as a header value: control characters (CR, LF, NUL) %-escaped, since a
    header cannot carry them; ``unquote_session`` gives the name back."""
    return "".join(
        f"%{ord(c):02X}" if ord(c) < 32 or ord(c) == 127 or c == "%" else c for c in session_id
    )


def unquote_session(value: str) -> str:
    return urllib.parse.unquote(value)


def api_keys(headers: Any, query: Any) -> list[str]:
    """The API keys a client sent, wherever its provider puts one (``Authorization: Bearer``,
    ``x-api-key``, ``x-goog-api-key``, ``api-key``, ``?key=``): in base-URL mode a session's
    secret is the API key its client sends."""
    found = []
    for name in SECRET_HEADERS:
        if name == "proxy-authorization":
            continue
        for value in headers.getall(name, []):
            scheme, _, rest = value.partition(" ")
            found.append(rest.strip() if scheme.lower() == "bearer" else value.strip())
    for name, value in query.items():
        if name.lower() in SECRET_QUERY:
            found.append(value)
    return found


def request_session_id(request: IncomingRequest, provider: Provider[Any]) -> str:
    """The session of a request the addon passed on (see the module docstring)."""
    session = request.headers.get(SESSION_HEADER) or ANONYMOUS
    if session == ANONYMOUS:
        # No proxy username: a client's own session header still keeps runs apart.
        for name, client in provider.session_headers.items():
            if request.headers.get(name):
                return safe_text(f"{client}:{request.headers[name]}")[:256]
    return safe_text(unquote_session(session))
