"""The policy replica routes of the control API: agenttap_policy_url's pool
(capture/policy/replicas.py), grown and shrunk while agenttap runs.

- ``GET /replicas``: every server's state, ``max_inflight`` and ``queue``
- ``POST /replicas`` ``{"url": "http://HOST:PORT"}``: a server joins once it completes a
  1-token generation (its fingerprint taken then); one whose fingerprint differs from the
  pool's serving replicas stays out of rotation (409) until a weight update verifies it
- ``DELETE /replicas?url=URL``: no new call goes there
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from capture.control.answers import error
from capture.control.sessions import reject_unknown
from capture.options.values import parse_urls
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
        replica.rotation.weight_version = policies.weights.history.current
        if not await replicas.check(replica, policies.http):
            replicas.remove(replica.url)
            return error(
                400,
                f"agenttap: the policy server at {replica.url} did not complete a 1-token "
                f"generation ({replica.last_error}); start it (and resume it, if paused) "
                "first, then add it",
            )
        differs = replicas.differs_from_pool(replica)
        if differs:
            # It joins out of rotation: its sessions would be sampled from other weights than
            # the rows' weight version says. The next POST /policy/weights loads and checks
            # the trainer's weights on it with the rest, which brings it in.
            replica.unverified = replica.rotation.refuse = (
                f"it serves other weights than the pool: {differs}"
            )
            logger.warning(
                "agenttap: policy server %s added out of rotation: %s", replica.url, differs
            )
            return error(
                409,
                f"agenttap: the policy server at {replica.url} serves other weights than the "
                f"pool ({differs}). It is in the pool but out of rotation: start it from the "
                "checkpoint the others serve and add it again, or POST /policy/weights to load "
                "the trainer's weights on every server (this one included); DELETE "
                f"/replicas?url={replica.url} removes it",
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
