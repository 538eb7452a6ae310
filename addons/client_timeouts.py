"""Client timeouts: a connection that does not send a whole request in time is closed.

mitmproxy closes a connection only after ``tcp_timeout`` (10 minutes) with no byte at all, so a
client that opens a connection and sends nothing holds it for 10 minutes, and one that sends a
header a byte a second holds it forever. Here each client connection must send a whole request
(headers and body) within ``agenttap_client_timeout`` seconds of opening, of its CONNECT being
answered, or of its previous answer ending. While the proxy is answering (the policy may take
minutes) and once the connection is a WebSocket (idle between turns by design), the clock is
stopped: mitmproxy's own ``tcp_timeout`` still applies there.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from mitmproxy import connection, ctx, http

logger = logging.getLogger(__name__)

SERVING = "agenttap_serving"  # flow metadata: this flow holds its connection's clock


class ClientTimeouts:
    def __init__(self, timeout_s: Callable[[], float | None]) -> None:
        """``timeout_s``: the configured timeout, read when a clock starts (None: none yet)."""
        self._timeout_s = timeout_s
        self._timers: dict[str, asyncio.TimerHandle] = {}
        self._serving: dict[str, int] = {}  # client id -> requests being answered
        self._websockets: set[str] = set()

    # -- the clock ------------------------------------------------------------------------------
    def _wait_for_client(self, client_id: str) -> None:
        """(Re)start the clock: the client owes us a whole request."""
        self._stop(client_id)
        timeout = self._timeout_s()
        if timeout is None or client_id in self._websockets or self._serving.get(client_id):
            return
        loop = asyncio.get_running_loop()
        self._timers[client_id] = loop.call_later(timeout, self._expired, client_id, timeout)

    def _stop(self, client_id: str) -> None:
        timer = self._timers.pop(client_id, None)
        if timer is not None:
            timer.cancel()

    def _expired(self, client_id: str, timeout: float) -> None:
        self._timers.pop(client_id, None)
        proxyserver = ctx.master.addons.get("proxyserver")
        handler = proxyserver.connections.get(client_id) if proxyserver else None
        if handler is None:
            return
        io = handler.transports.get(handler.client)
        if io is None or io.handler is None:
            return
        logger.info(
            "agenttap: closed a connection from %s that sent no whole request within %.0f s "
            "(option agenttap_client_timeout)",
            handler.client.peername[0] if handler.client.peername else "?",
            timeout,
        )
        io.handler.cancel("agenttap_client_timeout")

    # -- hooks -----------------------------------------------------------------------------------
    def client_connected(self, client: connection.Client) -> None:
        self._wait_for_client(client.id)

    def client_disconnected(self, client: connection.Client) -> None:
        self._stop(client.id)
        self._serving.pop(client.id, None)
        self._websockets.discard(client.id)

    def http_connect(self, flow: http.HTTPFlow) -> None:
        # The tunnel is open: now the TLS handshake and the first request inside it.
        self._wait_for_client(flow.client_conn.id)

    def requestheaders(self, flow: http.HTTPFlow) -> None:
        if flow.request.stream:
            # A body too large to hold goes on to the gateway as it arrives; it reads at most
            # agenttap_max_body_bytes of it and answers.
            self._start_serving(flow)
        else:
            self._wait_for_client(flow.client_conn.id)  # now the body, in time

    def request(self, flow: http.HTTPFlow) -> None:
        self._start_serving(flow)

    def response(self, flow: http.HTTPFlow) -> None:
        self._done_serving(flow)

    def error(self, flow: http.HTTPFlow) -> None:
        self._done_serving(flow)

    def websocket_start(self, flow: http.HTTPFlow) -> None:
        self._websockets.add(flow.client_conn.id)
        self._stop(flow.client_conn.id)

    def _start_serving(self, flow: http.HTTPFlow) -> None:
        if flow.metadata.get(SERVING):
            return
        flow.metadata[SERVING] = True
        client_id = flow.client_conn.id
        self._serving[client_id] = self._serving.get(client_id, 0) + 1
        self._stop(client_id)

    def _done_serving(self, flow: http.HTTPFlow) -> None:
        if not flow.metadata.pop(SERVING, None):
            return
        client_id = flow.client_conn.id
        left = self._serving.get(client_id, 1) - 1
        if left > 0:
            self._serving[client_id] = left
            return
        self._serving.pop(client_id, None)
        if not flow.client_conn.timestamp_end:  # still open: the next request, in time
            self._wait_for_client(client_id)
