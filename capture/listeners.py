"""The gateway's aiohttp listeners (the loopback one and the API listener): how each is set up
(head and body limits, a client that leaves cancels its handler, a deep accept queue), and the
host a client elsewhere is given for one."""

from __future__ import annotations

import socket
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from capture.pipeline.bodies import PARSER_HEAD_BYTES, PARSER_HEAD_FIELDS

# Pending connections the gateway's listener queues (see listen).
GATEWAY_BACKLOG = 4096


def advertised_host(listen_host: str, advertise: str = "") -> str:
    """The host a client elsewhere should use for a listener on ``listen_host``."""
    if advertise:
        return advertise
    if listen_host in ("", "0.0.0.0", "::"):
        try:
            return socket.gethostbyname(socket.gethostname())
        except OSError:
            return "127.0.0.1"
    return listen_host


def url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


async def app_runner(
    handler: Callable[[web.Request], Awaitable[web.StreamResponse]], max_body_bytes: int
) -> web.AppRunner:
    # We enforce the body limit ourselves so the client gets its provider's error format.
    app = web.Application(client_max_size=max_body_bytes + 1)
    app.router.add_route("*", "/{tail:.*}", handler)
    # handler_cancellation: a client that leaves cancels its handler, so the policy request
    # is dropped (vLLM aborts it) and the turn is not recorded as completed.
    runner = web.AppRunner(
        app,
        access_log=None,
        handler_cancellation=True,
        max_line_size=PARSER_HEAD_BYTES,
        max_field_size=PARSER_HEAD_BYTES,
        max_headers=PARSER_HEAD_FIELDS,
    )
    await runner.setup()
    return runner


async def listen(runner: web.AppRunner, host: str, port: int) -> int:
    # Every proxied call is one connection from mitmproxy: with the default backlog (128) a
    # burst of a thousand new calls overflowed the accept queue, and the kernel's dropped
    # handshakes reached clients as 502s (bench/concurrency.py). The kernel caps this at
    # net.core.somaxconn.
    site = web.TCPSite(runner, host, port, backlog=GATEWAY_BACKLOG)
    await site.start()
    server: Any = site._server  # aiohttp exposes the bound port only here
    return int(server.sockets[0].getsockname()[1])
