"""Scoring on a vLLM server: the log-probability of each token of a sequence given the ones
before it (``prompt_logprobs``), for health checks, weight probes and fingerprints.
"""

from __future__ import annotations

import asyncio
import logging
import uuid

from rewriter.ids_json import ids_json
from rewriter.vllm_answers import (
    PolicyError,
    answer_choices,
    answer_json,
    checked_logprob,
    malformed_answer,
)
from rewriter.vllm_probe import Probing
from rewriter.vllm_request import JSON_CONTENT, RawJson

logger = logging.getLogger(__name__)
# As many aborts as a generation is resumed across (rewriter/vllm_resume.py MAX_RESUMES).
MAX_ABORTS = 16


class Scoring(Probing):
    """``Probing`` plus a sequence's prompt logprobs."""

    async def prompt_logprobs(self, ids: list[int], check: bool = False) -> list[float | None]:
        """Log-probability of each token of ``ids`` given the ones before it (entry 0: None).
        It is a 1-token generation too: agenttap's health checks and weight fingerprints
        (``check``: its request id says so, ``agenttap-check-...``, in vLLM's logs)."""
        headers = None
        if check:
            headers = {**JSON_CONTENT, "X-Request-Id": f"agenttap-check-{uuid.uuid4().hex[:12]}"}
        info = await self.served()
        body = {
            "model": info.model,
            "prompt": RawJson(ids_json(ids)),  # tens of thousands of ids: orjson writes them
            "max_tokens": 1,
            "prompt_logprobs": 0,
        }
        # A server paused with mode=abort (a trainer's weight sync) ends the request at once:
        # finish_reason "abort" and no prompt logprobs. Asked again, it waits for the resume.
        for _ in range(MAX_ABORTS + 1):
            try:
                async with asyncio.timeout_at(self._deadline()):
                    resp = await self._post("/v1/completions", body, headers)
                    async with resp:
                        raw = await resp.read()
            except TimeoutError as exc:
                raise self._stalled() from exc
            choices = answer_choices(answer_json(raw, "an answer"))
            if not (choices and choices[0].get("finish_reason") == "abort"):
                break
            logger.info("a prompt_logprobs request was aborted by the policy server; asking again")
        else:
            raise PolicyError(
                f"the policy server at {self.base_url} aborted a prompt_logprobs request "
                f"{MAX_ABORTS + 1} times (paused with mode=abort each time); giving up"
            )
        try:
            entries = choices[0]["prompt_logprobs"]
            out: list[float | None] = []
            for token, entry in zip(ids, entries, strict=True):
                out.append(None if entry is None else checked_logprob(entry[str(token)]["logprob"]))
        except (KeyError, IndexError, TypeError, ValueError):
            raise malformed_answer(
                "prompt_logprobs that do not match the prompt", raw[:200]
            ) from None
        return out
