"""The control host addon in-process (mitmproxy's tflow): http://agenttap.local calls go to the
gateway with the bearer token checked and stripped; nothing else is touched."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from mitmproxy.test import tflow

from addons.control_host import ControlHost
from capture.pipeline.handoff import BEARER_HEADER, HOST_HEADER, TOKEN_HEADER

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
    [("Bearer " + "t" * 24, "ok"), ("Bearer nope", "wrong"), (None, ""), ("Basic abc", "")],
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
    assert flow.metadata["agenttap_routed"] is True


@pytest.mark.parametrize("authorization", [None, "Bearer nope", "Basic abc"])
def test_a_forged_bearer_or_any_header_of_ours_from_the_client_is_dropped(
    authorization: str | None,
) -> None:
    """A client's own X-Agenttap-Bearer: ok (and every other X-Agenttap-* header it sends)
    never reaches the gateway: the gateway hears only what the addon found."""
    flow = control_flow(authorization)
    flow.request.headers[BEARER_HEADER] = "ok"
    flow.request.headers["X-Agenttap-Loopback"] = "1"
    flow.request.headers["x-agenttap-session-secret"] = "forged"
    addon = ControlHost(lambda: GATEWAY)
    addon.requestheaders(flow)
    addon.request(flow)
    headers = flow.request.headers
    assert headers.get_all(BEARER_HEADER) == ["wrong" if authorization == "Bearer nope" else ""]
    assert "X-Agenttap-Loopback" not in headers and "X-Agenttap-Session-Secret" not in headers


def test_other_flows_are_left_alone_and_a_stopped_gateway_is_a_503() -> None:
    addon = ControlHost(lambda: GATEWAY)
    for flow in [control_flow(None, host="api.openai.com"), control_flow(None, scheme="https")]:
        addon.request(flow)
        assert "agenttap_routed" not in flow.metadata and flow.response is None
    stopped = ControlHost(lambda: None)
    flow = control_flow("Bearer x")
    stopped.request(flow)
    assert flow.response is not None and flow.response.status_code == 503
