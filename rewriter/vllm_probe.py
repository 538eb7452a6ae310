"""What a vLLM client learns of its server once: the served model and its context length, whether
it serves the generate endpoint, and its default sampling parameters (``info``, single-flight),
and the model name a generation asks for (``served``: the LoRA adapter's where one is loaded).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace
from typing import Any

import aiohttp

from rewriter.canonical import SamplingParams
from rewriter.vllm_answers import (
    PolicyError,
    answer_json,
    answer_object,
    is_int,
    malformed_answer,
    typed_field,
)
from rewriter.vllm_request import GENERATE_PATH, SERVER_DEFAULTS, PolicyInfo, generation_body
from rewriter.vllm_rotation import Rotation
from rewriter.vllm_transport import Transport, status_hint

# Logged under the client's name, as before the client was split in modules.
logger = logging.getLogger("rewriter.vllm_client")


class Probing(Transport):
    """``Transport`` plus what the server is (set up by ``VLLMClient.__init__``)."""

    # auto, completions or generate (VLLMClient's ``api``).
    _api: str
    _info: PolicyInfo | None
    # The probe under way: concurrent first calls all wait for this one.
    _probing: asyncio.Task[PolicyInfo] | None
    # The server's weight-rotation state (rewriter/vllm_rotation.py): its replica's.
    rotation: Rotation

    async def info(self) -> PolicyInfo:
        """The served model's name and context length (asked once, then remembered).

        Single-flight: callers arriving while the probe runs await that same probe (a burst of
        first calls probes the server once, not once each). A failed probe is not remembered,
        so a later call asks again; a caller that is cancelled (its client left) does not
        cancel the probe the others wait for."""
        if self._info is not None:
            return self._info
        if self._probing is None:
            self._probing = asyncio.get_running_loop().create_task(self._probe())
            self._probing.add_done_callback(self._probed)
        return await asyncio.shield(self._probing)

    def _probed(self, task: asyncio.Task[PolicyInfo]) -> None:
        self._probing = None
        if not task.cancelled() and task.exception() is None:  # retrieved: never "unhandled"
            self._info = task.result()

    async def _probe(self) -> PolicyInfo:
        try:
            async with asyncio.timeout(self.progress_timeout_s):
                async with self._session.get(self.url("/v1/models")) as resp:
                    if resp.status != 200:
                        raise PolicyError(
                            f"{self.base_url}/v1/models answered {resp.status}"
                            f"{status_hint(resp.status, listing=True)}",
                            resp.status,
                        )
                    raw = await resp.read()
        except TimeoutError as exc:
            raise self._stalled() from exc
        except aiohttp.ClientError as exc:
            raise PolicyError(f"cannot reach the policy server at {self.base_url}: {exc}") from exc
        listing = typed_field(
            answer_object(answer_json(raw, "a model listing"), "a model listing"), "data", list
        )
        if not listing:
            raise malformed_answer("a model listing without models", raw)
        model = answer_object(listing[0], "a model")
        name, max_len = model.get("id"), model.get("max_model_len")
        if not isinstance(name, str) or not (max_len is None or is_int(max_len)):
            raise malformed_answer("a model without a name or with a bad max_model_len", model)
        info = PolicyInfo(model=name, max_model_len=max_len)
        if self._api != "completions":
            info.generate = self._api == "generate" or await self._has_generate()
        if info.generate:
            info.sampling_defaults = await self._sampling_defaults(info.model)
        self._info = info
        return info

    async def _has_generate(self) -> bool:
        """Whether the server serves the generate endpoint: an empty body is refused as
        invalid (400/422) where it does; 404 where it is absent, 403 where it is disabled."""
        try:
            async with self._session.post(self.url(GENERATE_PATH), json={}) as resp:
                available = resp.status in (400, 422)
        except aiohttp.ClientError:
            return False
        if available:
            logger.info("%s: token ids go to vLLM's %s", self.base_url, GENERATE_PATH)
        else:
            logger.info(
                "%s: this server has no %s; token ids go to /v1/completions instead (the same "
                "tokens and logprobs; nothing to do)",
                self.base_url,
                GENERATE_PATH,
            )
        return available

    async def _sampling_defaults(self, model: str) -> dict[str, Any]:
        body = {"model": model, "prompt": [0], "max_tokens": 1}
        try:
            async with self._session.post(self.url("/v1/completions/render"), json=body) as resp:
                data = await resp.json() if resp.status == 200 else None
        except (aiohttp.ClientError, ValueError):
            data = None
        if not isinstance(data, list) or not data:
            logger.warning(
                "%s: /v1/completions/render did not answer; the generate endpoint samples with "
                "vLLM's neutral defaults where a request sets none",
                self.base_url,
            )
            return {}
        params = data[0].get("sampling_params") or {}
        return {k: params[k] for k in SERVER_DEFAULTS if params.get(k) is not None}

    async def _body(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        stream: bool,
        prompt_json: str | None = None,
    ) -> tuple[str, dict[str, Any]]:
        """The endpoint and body for one generation (``prompt_json``: the ids' JSON text)."""
        return generation_body(await self.served(), prompt_ids, params, stream, prompt_json)

    async def served(self) -> PolicyInfo:
        """``info()`` with the model name generations ask for: the LoRA adapter's if one is
        loaded (``lora``), else the served model's."""
        info = await self.info()
        lora = self.rotation.lora
        return replace(info, model=lora) if lora else info
