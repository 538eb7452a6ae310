"""The narrow interfaces between the gateway and what is built on it.

The gateway (``capture/gateway.py``) answers intercepted calls; the control plane
(``capture/control/api.py``), rollouts (``capture/rollouts/runner.py``) and the viewer
(``capture/viewer/http.py``) are built on it. Dependencies run one way: those modules see the
gateway only as ``GatewayCore``, and the gateway sees the control plane only as
``ControlPlane``, built at start by the factory the addon registers. Neither imports the other's
module (``tests/unit/test_import_graph.py`` holds that)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from aiohttp import web

from capture.control.bindings import Bindings
from capture.control.endpoints import Endpoints
from capture.control.metrics import Metrics
from capture.control.sessions import ControlledSession, Limits, SessionControl
from capture.gateway_config import GatewayConfig as GatewayConfig
from capture.pipeline.turn import TurnPipeline
from capture.policy.pools import PolicyPools
from capture.storage.sessions import SessionStore

# What a rollout's close names as its rows' reward source (its verifier's), for the runner.
from capture.storage.shards import REWARD_VERIFIER as REWARD_VERIFIER
from rewriter.template import ChatTemplate


class GatewayCore(Protocol):
    """What the control plane, rollouts and the viewer use of the gateway."""

    config: GatewayConfig
    control: SessionControl
    metrics: Metrics
    pipeline: TurnPipeline
    policies: PolicyPools
    store: SessionStore
    template: ChatTemplate
    api_token: str
    # Sessions whose agent may open tunnels to public hosts (a rollout's "egress": "public").
    egress_public: set[str]
    # Connections rollouts' bridges relay, each bound to its run's session.
    bindings: Bindings

    async def flush(self, session_id: str | None = None) -> list[Path]: ...

    def take_back_rewards(self, session_id: str, since: float) -> list[dict[str, Any]]: ...


class ControlPlane(Protocol):
    """What the gateway asks of the control plane it serves."""

    @property
    def api_url(self) -> str: ...

    async def handle(
        self, request: web.Request, bearer: str | None = None
    ) -> web.StreamResponse: ...

    def running_agents(self) -> int: ...

    async def shutdown(self) -> None: ...


class RolloutHost(Protocol):
    """What rollouts ask of the proxy, and nothing more: its settings (read-only), the
    session environments and the output folder; a session opened, looked up, given or denied
    public egress, closed with its reward, its rewards taken back; the bindings of relayed
    connections; a request's JSON body read."""

    endpoints: Endpoints

    @property
    def out_dir(self) -> Path: ...

    @property
    def settings(self) -> GatewayConfig: ...

    @property
    def bindings(self) -> Bindings: ...

    def open_session(
        self, sid: str, metadata: dict[str, Any], limits: Limits
    ) -> ControlledSession: ...

    def session(self, sid: str) -> ControlledSession | None: ...

    def is_live(self, sid: str) -> bool: ...

    def allow_egress(self, sid: str, public: bool) -> None: ...

    async def close_session(
        self,
        sid: str,
        reward: float | dict[str, float] | None,
        end_reason: str | None = None,
        reward_auxiliary: bool = False,
        reward_source: str = "close",
    ) -> tuple[Any, list[dict[str, Any]], list[str]] | None: ...

    def take_back_rewards(self, sid: str, since: float) -> list[dict[str, Any]]: ...

    async def body(self, request: web.Request) -> dict[str, Any]: ...
