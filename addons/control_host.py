"""``http://agenttap.local`` through the proxy: the control API (capture/control/api.py).

Plain-HTTP requests to that name are sent to the gateway, which answers them; nothing leaves
the machine. A control call's ``Authorization: Bearer`` token is checked here, then stripped
like every credential (a saved or logged flow never holds it): the gateway is told only ``ok``,
``wrong`` or nothing, in a header of ours that the client's own copy (removed first, with every
``X-Agenttap-*`` header it sent) cannot stand in for. Every route but ``/healthz`` and
``/ready`` wants the token, ``/flush`` included. Runs before the main addon, which strips
credentials from every flow."""

from __future__ import annotations

import json
from collections.abc import Callable

from mitmproxy import http

from addons.credentials import strip_secrets
from capture.control.routing import bearer_state
from capture.gateway import Gateway
from capture.pipeline.handoff import BEARER_HEADER, CONTROL_HOST, HOST_HEADER, TOKEN_HEADER


class ControlHost:
    def __init__(self, gateway: Callable[[], Gateway | None]) -> None:
        self._gateway = gateway

    @staticmethod
    def _ours(flow: http.HTTPFlow) -> bool:
        return flow.request.pretty_host.lower() == CONTROL_HOST

    def requestheaders(self, flow: http.HTTPFlow) -> None:
        if self._ours(flow):
            self._read_bearer(flow)

    def request(self, flow: http.HTTPFlow) -> None:
        if not self._ours(flow) or flow.response or flow.metadata.get("agenttap_routed"):
            return
        self._read_bearer(flow)
        strip_secrets(flow.request)
        if flow.request.scheme != "http":
            return  # https://agenttap.local is no API host: the main addon refuses it
        gateway = self._gateway()
        if gateway is None:
            flow.response = http.Response.make(
                503,
                json.dumps({"error": "agenttap is not running: no policy server configured"}),
                {"Content-Type": "application/json"},
            )
            return
        req = flow.request
        # Put back by the main addon's _restore before the flow is saved or shown.
        flow.metadata["agenttap_origin"] = [
            req.scheme, req.host, req.port, req.authority, req.headers.get("Host"),
        ]  # fmt: skip
        # Always set (stripped of any copy above): "" tells the gateway no token was given.
        req.headers[BEARER_HEADER] = flow.metadata.get("agenttap_bearer") or ""
        req.headers[TOKEN_HEADER] = gateway.token
        req.headers[HOST_HEADER] = CONTROL_HOST
        req.host = "127.0.0.1"
        req.port = gateway.port
        req.headers["Host"] = CONTROL_HOST
        flow.metadata["agenttap_routed"] = True

    def _read_bearer(self, flow: http.HTTPFlow) -> None:
        """Once per flow, before the header is stripped: ``ok``, ``wrong`` or "" (none)."""
        if "agenttap_bearer" in flow.metadata:
            return
        gateway = self._gateway()
        token = gateway.api_token if gateway is not None else ""
        authorization = flow.request.headers.get("Authorization", "")
        flow.metadata["agenttap_bearer"] = bearer_state(authorization, token)
