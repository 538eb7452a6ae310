"""The policy replica routes of the control API: agenttap_policy_url's pool
(capture/policy/replicas.py), grown and shrunk while agenttap runs.

- ``GET /replicas``: every server's state, ``max_inflight`` and ``queue``
- ``POST /replicas`` ``{"url": "http://HOST:PORT"}``: a server joins once it completes a
  1-token generation (its fingerprint taken then)
- ``DELETE /replicas?url=URL``: no new call goes there
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from capture.control.answers import error
from capture.control.sessions import reject_unknown
from capture.option_values import parse_urls
from capture.ports import GatewayCore

logger = logging.getLogger(__name__)


class ReplicaRoutes:
    """The ``/replicas`` routes; ``body`` reads a request's JSON body (the control API's)."""

    def __init__(
        self, gateway: GatewayCore, body: Callable[[web.Request], Awaitable[dict[str, Any]]]
    ) -> None:
        self.gateway = gateway
        self.body = body

    def summary(self) -> web.Response:
        replicas = self.gateway.policies.default
        assert replicas is not None
        return web.json_response(
            {
                "replicas": replicas.summary(),
                "max_inflight": replicas.max_in_flight,
                "queue": replicas.max_queue,
            }
        )

    async def list(self, request: web.Request) -> web.Response:
        return self.summary()

    async def add(self, request: web.Request) -> web.Response:
        """``{"url": "http://HOST:PORT"}``: a vLLM server joins agenttap_policy_url's pool once
        it completes a 1-token generation; new sessions may go there from then on."""
        body = await self.body(request)
        reject_unknown(body, ("url",))
        urls = parse_urls(str(body.get("url") or ""))
        if len(urls) != 1:
            raise ValueError(
                '"url" must be one policy URL such as http://127.0.0.1:8000 or unix:/PATH/vllm.sock'
            )
        policies = self.gateway.policies
        replicas = policies.default
        assert replicas is not None and policies.http is not None
        if urls[0].rstrip("/") in replicas.replicas:
            return self.summary()
        replica = replicas.add(urls[0])
        # It is expected to serve what the others serve (POST /policy/weights pushes to all).
        replica.client.weight_version = policies.weights.history.current
        if not await replicas.check(replica, policies.http):
            replicas.remove(replica.url)
            return error(
                400,
                f"agenttap: the policy server at {replica.url} did not complete a 1-token "
                f"generation ({replica.last_error}); start it (and resume it, if paused) "
                "first, then add it",
            )
        logger.info("agenttap: policy server %s added", replica.url)
        return self.summary()

    async def remove(self, request: web.Request) -> web.Response:
        """``?url=URL``: no new call goes there; generations running on it finish; its
        sessions move to another server on their next call."""
        url = request.query.get("url", "")
        if not url:
            raise ValueError("DELETE /replicas wants ?url=URL (one of GET /replicas)")
        replicas = self.gateway.policies.default
        assert replicas is not None
        try:
            replicas.remove(url)
        except KeyError:
            return error(404, f"agenttap: no policy server {url!r} (GET /replicas lists them)")
        logger.info("agenttap: policy server %s removed", url.rstrip("/"))
        return self.summary()
