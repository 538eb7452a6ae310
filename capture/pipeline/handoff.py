"""The hand-off of an intercepted call from the addon to the gateway: the internal headers the
addon sets on a routed request (and takes back before the flow is saved or shown), the control
host, and which session and secret a call is made under.

The addon (``addons/capture.py``) is mitmproxy glue; what it tells the gateway is decided here,
over plain header mappings, so that the gateway (``capture/gateway.py``) and the addon read the
same names. Every header here starts with ``INTERNAL_PREFIX``: a client's own copies are removed
before anything reads them (``addons/credentials.py``).
"""

from __future__ import annotations

from collections.abc import MutableMapping, Sequence

from capture.pipeline.bodies import UNSUPPORTED_ENCODING_HEADER
from capture.pipeline.session_ids import (
    ANONYMOUS,
    SESSION_HEADER,
    SESSION_SECRET_HEADER,
    quote_session,
)

TOKEN_HEADER = "X-Agenttap-Token"
HOST_HEADER = "X-Agenttap-Host"
# The addon checks a control call's bearer token (then strips it like every credential) and
# says here what it found: "ok", "wrong" or "" (none). A client's own copy of any X-Agenttap-*
# header is removed before (addons/credentials.py); only calls with TOKEN_HEADER are read.
BEARER_HEADER = "X-Agenttap-Bearer"
CONTROL_HOST = "agenttap.local"
# The addon found the client's connection came through a rollout's bridge: the session it is
# bound to (capture/control/bindings.py). Read only behind TOKEN_HEADER, like every other.
BOUND_HEADER = "X-Agenttap-Bound"
# What the addon adds to a routed request, all taken back before a flow is saved or shown.
GATEWAY_HEADERS = (
    TOKEN_HEADER,
    SESSION_HEADER,
    SESSION_SECRET_HEADER,
    HOST_HEADER,
    BEARER_HEADER,
    BOUND_HEADER,
)


def caller(
    proxyauth: Sequence[object] | None,
    tunnel: tuple[str, str] | None,
    user: str | None,
    password: str,
    recorded: object = None,
) -> tuple[str, str]:
    """The session a call is made under and its secret: mitmproxy's proxyauth's (a user's own
    proxyauth read them), else those given on the CONNECT of the call's tunnel, else the
    call's own ``Proxy-Authorization`` (plain HTTP), else the session a replayed flow was
    ``recorded`` under (or ``"anonymous"``), without a secret."""
    if proxyauth:
        return str(proxyauth[0]), str(proxyauth[1]) if len(proxyauth) > 1 else ""
    if tunnel is not None:
        return tunnel
    if user:
        return user, password
    return str(recorded or ANONYMOUS), ""


def mark_for_gateway(
    headers: MutableMapping[str, str],
    *,
    token: str,
    session_id: str,
    secret: str,
    host: str,
    bound: str | None,
) -> None:
    """Add to a routed request's headers what the gateway reads: the addon's ``token``, the
    session (quoted: a proxy username may hold what no header can carry), its ``secret`` if
    one was given (checked against the session's, capture/control/sessions.py), the API
    ``host`` called, and the session a rollout's bridge ``bound`` the connection to."""
    headers[TOKEN_HEADER] = token
    headers[SESSION_HEADER] = quote_session(session_id)
    if secret:
        headers[SESSION_SECRET_HEADER] = quote_session(secret)
    headers[HOST_HEADER] = host
    if bound is not None:
        # Came through a rollout's bridge: the gateway serves it only as that session.
        headers[BOUND_HEADER] = quote_session(bound)
    if "Content-Encoding" in headers:
        # The gateway decodes the body itself (bounded, errors in the provider's format);
        # aiohttp would answer a bad one with a text/plain 400.
        headers[UNSUPPORTED_ENCODING_HEADER] = headers.pop("Content-Encoding")


def unmark_for_gateway(headers: MutableMapping[str, str], answered: bool) -> None:
    """Take the gateway's headers back off a request, so that a saved flow holds none of its
    secrets; a body the gateway ``answered`` (read whole) gets its ``Content-Encoding`` back."""
    for name in GATEWAY_HEADERS:
        headers.pop(name, None)
    if UNSUPPORTED_ENCODING_HEADER in headers and answered:
        # Only a body the gateway read whole gets its encoding back: the dump (flow_detail
        # >= 3) decodes it, and a refused one may be a gzip bomb. Left moved aside, a saved
        # flow still replays alike (the gateway decodes by that header too).
        headers["Content-Encoding"] = headers.pop(UNSUPPORTED_ENCODING_HEADER)
