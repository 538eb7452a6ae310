"""The policy weight routes of the control API (capture/policy/weights.py does the work):

- ``POST /policy/weights`` ``{"path": DIR, "version": "V", "probe": {"ids", "logprobs"}}``:
  every replica of agenttap_policy_url's pool serves the weights in DIR, labelled V; answers
  once all do. With a probe (the trainer model's logprobs for a short sequence), each
  replica's logprobs for it must be within agenttap_weights_tolerance: one past it is out of
  rotation and the route answers 502 naming it and the difference. Without one, the answer
  says nothing was checked (``"checked": false``). ``{"lora": DIR, ...}`` instead of ``path``:
  a PEFT adapter loaded beside the base weights (vLLM's runtime LoRA loading); calls from
  then on ask for it
- ``POST /policy/version`` ``{"version": "V", "probe"?}``: the trainer pushed weights to vLLM
  itself; calls from now on are labelled V (with a probe, each replica checked as above)
- ``GET /policy/version``: the current label, how many updates came before it, the last ones
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from capture.control.answers import error
from capture.control.sessions import reject_unknown
from capture.policy.weights import (
    WeightUpdateError,
    check_lora_dir,
    check_probe,
    check_version,
    check_weights_dir,
)
from capture.ports import GatewayCore


class PolicyRoutes:
    """The ``/policy`` routes; ``body`` reads a request's JSON body (the control API's)."""

    def __init__(
        self, gateway: GatewayCore, body: Callable[[web.Request], Awaitable[dict[str, Any]]]
    ) -> None:
        self.gateway = gateway
        self.body = body

    async def weights(self, request: web.Request) -> web.Response:
        body = await self.body(request)
        reject_unknown(body, ("path", "lora", "version", "probe"))
        lora = body.get("lora") is not None
        if lora == (body.get("path") is not None):
            raise ValueError(
                'give "path" (the folder save_pretrained wrote) or "lora" (a PEFT adapter\'s '
                "folder, loaded beside the base weights), one of them"
            )
        path = check_lora_dir(body.get("lora")) if lora else check_weights_dir(body.get("path"))
        version = check_version(body.get("version"))
        probe = check_probe(body.get("probe"))
        policies = self.gateway.policies
        assert policies.default is not None and policies.http is not None
        checked = probe is not None
        try:
            outcomes = await policies.weights.update(
                policies.http, policies.default, path, version, probe, lora=lora
            )
        except WeightUpdateError as exc:
            return error(
                502, f"agenttap: {exc}", extra={"replicas": exc.replicas, "checked": checked}
            )
        answer: dict[str, Any] = {"version": version, "replicas": outcomes, "checked": checked}
        if not checked:
            answer["note"] = (
                "no probe given: nothing checked that the servers' logprobs are the trainer's "
                '(pass "probe": capture.train.probe computes it from the model in memory)'
            )
        return web.json_response(answer)

    async def set_version(self, request: web.Request) -> web.Response:
        body = await self.body(request)
        reject_unknown(body, ("version", "probe"))
        version = check_version(body.get("version"))
        probe = check_probe(body.get("probe"))
        policies = self.gateway.policies
        assert policies.default is not None and policies.http is not None
        try:
            outcomes = await policies.weights.set_version(
                policies.http, policies.default, version, probe
            )
        except WeightUpdateError as exc:
            return error(502, f"agenttap: {exc}", extra={"replicas": exc.replicas, "checked": True})
        return web.json_response(
            {"version": version, "replicas": outcomes, "checked": probe is not None}
        )

    async def get_version(self, request: web.Request) -> web.Response:
        return web.json_response(self.gateway.policies.weights.history.summary())
