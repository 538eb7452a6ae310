"""The API listener's base URLs (``/sess/<id>/...``: a call as if intercepted on its provider's
host, no proxy, no CA) and the checks every request to that listener passes first: its ``Host``
(DNS rebinding) and its ``Origin`` (web pages elsewhere). The gateway (``capture/gateway.py``)
answers what gets through."""

from __future__ import annotations

import ipaddress
import urllib.parse
from collections.abc import Awaitable, Callable

from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError
from multidict import CIMultiDict
from yarl import URL

from capture.control.bindings import binding_refusal
from capture.control.sessions import SessionControl
from capture.gateway_config import GatewayConfig
from capture.pipeline.bodies import too_large_message
from capture.pipeline.session_ids import (
    INTERNAL_PREFIX,
    SECRET_HEADERS,
    SECRET_QUERY,
    SESSION_HEADER,
    api_keys,
    quote_session,
)
from capture.pipeline.turn import TurnPipeline
from capture.pipeline.whitebox import serve_generate
from rewriter.providers.base import IncomingRequest

# Base-URL mode: /sess/<id>/<prefix>/... names the provider's host; no prefix: guessed.
BASE_URL_PREFIXES = {
    "openai": "api.openai.com",
    "anthropic": "api.anthropic.com",
    "gemini": "generativelanguage.googleapis.com",
}

# The gateway's answer to a call on a host: (request, host, the secrets the client gave).
Answer = Callable[[IncomingRequest, str, list[str], str | None], Awaitable[web.StreamResponse]]


def refuse_foreign(
    request: web.Request, config: GatewayConfig, api_url: str
) -> web.Response | None:
    """The API listener's answer to a request it must not serve (a host name it does not
    serve: 421; a web page of another origin: 403); None for one it serves."""
    if not host_served(request.host, config):
        # DNS rebinding: a web page's own name resolved to this machine must not reach the
        # API (a browser sends no token, but a base URL needs none in a session never
        # opened). IP literals and the names configured here are served.
        return web.json_response(
            {
                "error": {
                    "message": f"agenttap: this listener does not serve the host name "
                    f"{request.host.rpartition(':')[0] or request.host!r}; use "
                    f"{api_url} (or set agenttap_advertise_host)",
                    "status": 421,
                }
            },
            status=421,
        )
    origin = request.headers.get("Origin")
    if origin is not None and urllib.parse.urlsplit(origin).netloc.lower() != (
        request.host.lower()
    ):
        # A web page elsewhere (a browser sends Origin with every cross-site POST, and a
        # text/plain one needs no preflight): neither the API nor a base URL is its to use.
        return web.json_response(
            {
                "error": {
                    "message": f"agenttap: requests from web pages of another origin "
                    f"({origin[:100]}) are refused",
                    "status": 403,
                }
            },
            status=403,
        )
    return None


def host_served(host_header: str, config: GatewayConfig) -> bool:
    """The API listener's ``Host`` check: an IP literal, ``localhost``, or a name this
    instance listens on or hands out."""
    host = host_header.strip().lower()
    if host.startswith("["):
        host = host[1 : host.find("]")] if "]" in host else host
    elif host.count(":") == 1:
        host = host.partition(":")[0]
    host = host.rstrip(".")
    if not host:
        return False
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        pass
    names = {"localhost", (config.api_host or "").lower(), config.advertise_host.lower()}
    return host in names or host.endswith(".localhost")


async def serve_base_url(
    request: web.Request,
    control: SessionControl,
    pipeline: TurnPipeline,
    require_session_secret: bool,
    answer: Answer,
    bound: str | None = None,
) -> web.StreamResponse:
    """``/sess/<id>[/openai|/anthropic|/gemini]/<API path>``: the call as if it had been
    intercepted on its provider's host, in session ``<id>``. No CA, no proxy needed. ``bound``:
    the session a rollout's bridge bound the connection to (any other id gets a 401)."""
    _, _, rest = request.raw_path.partition("/sess/")
    raw_id, _, tail = rest.partition("/")
    raw_path, _, _ = tail.partition("?")
    session_id = urllib.parse.unquote(raw_id)
    given = api_keys(request.headers, request.query)
    if raw_path.rstrip("/") == "generate":
        read = await _read_whole(request)
        if read is not None:
            return read
        refused = binding_refusal(bound, session_id) or control.credential_refusal(
            session_id, given, required=require_session_secret
        )
        if refused is not None:
            return web.json_response(
                {"error": {"message": refused, "type": "authentication_error"}}, status=401
            )
        return await serve_generate(pipeline, request, session_id)
    first, _, after = raw_path.partition("/")
    host = BASE_URL_PREFIXES.get(first)
    if host is not None:
        raw_path = after
    else:
        host = guess_host(request, "/" + raw_path)
    # The client's keys and every X-Agenttap-* header it sent go: only we set those.
    headers = CIMultiDict(
        (k, v)
        for k, v in request.headers.items()
        if (name := k.lower()) not in SECRET_HEADERS and not name.startswith(INTERNAL_PREFIX)
    )
    headers[SESSION_HEADER] = quote_session(session_id or "anonymous")
    query = [(k, v) for k, v in request.query.items() if k.lower() not in SECRET_QUERY]
    url = URL.build(path="/" + raw_path, encoded=True).with_query(query)
    clone = request.clone(rel_url=url, headers=headers)
    read = await _read_whole(clone)
    if read is not None:
        return read
    return await answer(clone, host, given, bound)


async def _read_whole(request: web.Request) -> web.Response | None:
    """Read the request's body whole (kept by the request for whoever reads it next) before its
    session's secret is checked: a call let in while its id was not opened yet must not stretch
    across the time a trainer opens it (a body sent slowly on purpose) and be counted then.
    None: read (or none); else the error answering a body that cannot be read (larger than
    agenttap_max_body_bytes, or cut short)."""
    if not request.can_read_body:
        return None
    try:
        await request.read()
        return None
    except web.HTTPRequestEntityTooLarge:
        status, message = 413, too_large_message(request.client_max_size)
    except RequestPayloadError as exc:
        status, message = 400, f"The request body could not be read: {exc}"
    return web.json_response(
        {"error": {"message": f"agenttap: {message}", "status": status}}, status=status
    )


def guess_host(request: web.Request, path: str) -> str:
    """The provider of a base-URL call without a prefix, by what its clients send."""
    if "anthropic-version" in request.headers:
        return BASE_URL_PREFIXES["anthropic"]
    if "x-goog-api-key" in request.headers or path.startswith(("/v1beta/", "/v1alpha/")):
        return BASE_URL_PREFIXES["gemini"]
    return BASE_URL_PREFIXES["openai"]
