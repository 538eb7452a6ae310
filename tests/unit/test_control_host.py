"""The control host addon in-process (mitmproxy's tflow): http://agenttap.local calls go to the
gateway with the bearer token checked and stripped; nothing else is touched."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from mitmproxy.test import tflow

from addons.control_host import ControlHost
from capture.gateway import BEARER_HEADER, HOST_HEADER, LOOPBACK_HEADER, TOKEN_HEADER

GATEWAY: Any = SimpleNamespace(token="internal-secret", port=40123, api_token="t" * 24)


def control_flow(
    authorization: str | None, scheme: str = "http", host: str = "agenttap.local"
) -> Any:
    flow = tflow.tflow()
    flow.request.scheme, flow.request.host, flow.request.port = scheme, host, 80
    flow.request.path = "/sessions"
    flow.request.headers["Host"] = host
    if authorization is not None:
        flow.request.headers["Authorization"] = authorization
    return flow


@pytest.mark.parametrize(
    ("authorization", "state"),
    [("Bearer " + "t" * 24, "ok"), ("Bearer nope", "wrong"), (None, None), ("Basic abc", None)],
)
def test_control_calls_reach_the_gateway_with_the_token_checked(
    authorization: str | None, state: str | None
) -> None:
    addon = ControlHost(lambda: GATEWAY)
    flow = control_flow(authorization)
    addon.requestheaders(flow)
    addon.request(flow)
    req = flow.request
    assert (req.host, req.port) == ("127.0.0.1", GATEWAY.port)
    assert (
        req.headers[TOKEN_HEADER] == GATEWAY.token and req.headers[HOST_HEADER] == "agenttap.local"
    )
    assert req.headers.get(BEARER_HEADER) == state
    assert "Authorization" not in req.headers  # never saved, never logged
    assert req.headers.get(LOOPBACK_HEADER) == "1"  # tflow's client is on loopback
    assert flow.metadata["agenttap_routed"] is True


def test_a_remote_client_is_not_loopback() -> None:
    flow = control_flow(None)
    flow.client_conn.peername = ("192.0.2.7", 50000)
    ControlHost(lambda: GATEWAY).request(flow)
    assert LOOPBACK_HEADER not in flow.request.headers  # its /flush needs the token


def test_other_flows_are_left_alone_and_a_stopped_gateway_is_a_503() -> None:
    addon = ControlHost(lambda: GATEWAY)
    for flow in [control_flow(None, host="api.openai.com"), control_flow(None, scheme="https")]:
        addon.request(flow)
        assert "agenttap_routed" not in flow.metadata and flow.response is None
    stopped = ControlHost(lambda: None)
    flow = control_flow("Bearer x")
    stopped.request(flow)
    assert flow.response is not None and flow.response.status_code == 503
