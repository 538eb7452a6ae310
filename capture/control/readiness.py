"""``GET /ready``: open to anyone (a load balancer's probe, a launcher waiting for start), so
what it says without the token is readiness alone. The servers' URLs (a unix socket's private
path: ``unix:/PRIVATE/vllm.sock``), the model and why a server is out are for the token's
holder (capture/control/api.py passes ``detail``)."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from capture.ports import GatewayCore
from rewriter.vllm_client import PolicyError

# Without the token: names nothing, says where the detail is.
NOT_READY = (
    "no policy server answers yet; GET /ready with 'Authorization: Bearer TOKEN' says which and why"
)


async def readiness(gateway: GatewayCore, detail: bool) -> web.Response:
    """Ready (200) once the tokenizer is loaded (it is, or this would not answer) and a policy
    server in rotation answers, else 503. With ``detail``: the model and each server's URL and
    state (serving, loading, paused, sleeping, unverified, failing: GET /replicas says why)."""
    body = await _full(gateway)
    status = 200 if body["ready"] else 503
    if not detail:
        body = {"ready": True} if status == 200 else {"ready": False, "reason": NOT_READY}
    return web.json_response(body, status=status)


async def _full(gateway: GatewayCore) -> dict[str, Any]:
    replicas = gateway.policies.default
    assert replicas is not None
    states = [{"url": r.url, "state": r.state} for r in replicas.replicas.values()]
    serving = [r for r in replicas.replicas.values() if r.serving]
    if not serving:
        listed = ", ".join(f"{s['url']} {s['state']}" for s in states)
        reason = f"no policy server is in rotation ({listed}); GET /replicas says why"
        return {"ready": False, "reason": reason, "replicas": states}
    client = serving[0].client
    up = gateway.metrics.policy_up.labels(client.base_url)
    try:
        info = await client.info()
    except PolicyError as exc:
        up.set(0)
        reason = f"the policy server does not answer: {exc}"
        return {"ready": False, "reason": reason, "replicas": states}
    up.set(1)
    return {
        "ready": True,
        "model": info.model,
        "max_model_len": info.max_model_len,
        "replicas": states,
    }
