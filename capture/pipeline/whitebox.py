"""White-box generate: ``POST /sess/<id>/generate``, token ids in, sampled ids and logprobs out.

For agents that tokenize themselves: no chat template, no provider protocol. The call is a
turn of its session like any other (journaled, limits and metrics apply, trained once in its
thread row); a call whose ids start with an earlier call's whole sequence (prompt + sampled
ids) extends it, so a token-level multi-turn agent's calls form one thread.

Request: ``{"token_ids": [int, ...], "sampling_params"?: {"max_tokens", "temperature",
"top_p", "top_k", "min_tokens", "seed", "stop", "ignore_eos"}, "model"?: str}``.
Answer: ``{"id", "token_ids", "logprobs", "text", "finish_reason", "prompt_tokens",
"completion_tokens", "extends"}`` (``extends``: the request id of the call it extends, or
null); errors are ``{"error": {"message", "status"}}``.
"""

from __future__ import annotations

import logging
import math
import time
import uuid
from typing import Any

from aiohttp import web

from capture.control.sessions import reject_unknown
from capture.pipeline.recording import failed_line
from capture.pipeline.turn import TurnPipeline, session_ended_message
from capture.storage.records import FailedCall, TurnRecord
from rewriter import jsonbody
from rewriter.canonical import Message, SamplingParams
from rewriter.vllm_client import PolicyError

logger = logging.getLogger(__name__)

PROTOCOL = "tokens"
# vLLM's sampling options served here, with the type each takes.
SAMPLING_FIELDS: dict[str, type] = {
    "max_tokens": int,
    "temperature": float,
    "top_p": float,
    "top_k": int,
    "min_tokens": int,
    "seed": int,
    "stop": list,
    "ignore_eos": bool,
}


def _error(status: int, message: str, **extra: Any) -> web.Response:
    body = {"error": {"message": message, "status": status, **extra}}
    return web.json_response(body, status=status)


def parse_generate(body: Any) -> tuple[list[int], SamplingParams, str]:
    """The prompt ids, sampling options and model name of a generate request; ValueError
    worded for the caller otherwise."""
    if not isinstance(body, dict):
        raise ValueError('the body must be a JSON object: {"token_ids": [...], ...}')
    reject_unknown(body, ("token_ids", "sampling_params", "model"))
    ids = body.get("token_ids")
    if (
        not isinstance(ids, list)
        or not ids
        or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids)
    ):
        raise ValueError('"token_ids" must be a non-empty list of token ids (whole numbers >= 0)')
    model = body.get("model") or ""
    if not isinstance(model, str):
        raise ValueError('"model" must be text')
    raw = body.get("sampling_params") or {}
    if not isinstance(raw, dict):
        raise ValueError('"sampling_params" must be an object')
    bad = sorted(set(raw) - SAMPLING_FIELDS.keys())
    if bad:
        raise ValueError(
            f"sampling option(s) {', '.join(bad)} not served here; served: "
            + ", ".join(SAMPLING_FIELDS)
        )
    values: dict[str, Any] = {}
    for name, value in raw.items():
        if value is None:
            continue
        kind = SAMPLING_FIELDS[name]
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        ok = isinstance(value, kind) and (kind is bool or not isinstance(value, bool))
        if kind is float and ok:
            ok = math.isfinite(value)
        if kind is list:
            ok = ok and all(isinstance(s, str) for s in value)
        if not ok:
            raise ValueError(f'"sampling_params.{name}" must be {kind.__name__}, not {value!r}')
        values[name] = value
    if "max_tokens" in values and values["max_tokens"] < 1:
        raise ValueError('"sampling_params.max_tokens" must be at least 1')
    return [int(i) for i in ids], SamplingParams(**values), model


async def serve_generate(
    pipeline: TurnPipeline, request: web.Request, session_id: str
) -> web.Response:
    if request.method != "POST":
        return _error(405, "agenttap: generate takes POST with a JSON body")
    try:
        ids, sampling, model = parse_generate(jsonbody.loads(await request.read()))
    except ValueError as exc:
        return _error(400, f"agenttap: {exc}")
    control = pipeline.control
    reason = control.refusal(session_id)
    if reason is not None:
        return _error(400, session_ended_message(session_id, reason), reason=reason)
    control.call_started(session_id)
    try:
        return await _generate(pipeline, session_id, ids, sampling, model, request)
    finally:
        control.call_finished(session_id)


async def _generate(
    pipeline: TurnPipeline,
    session_id: str,
    ids: list[int],
    sampling: SamplingParams,
    model: str,
    request: web.Request,
) -> web.Response:
    started = time.time()
    left = pipeline.control.tokens_left(session_id)
    if left is not None:
        sampling.max_tokens = min(sampling.max_tokens or left, left)
    if sampling.seed is None:  # a seeded rollout's call (POST /rollouts "seed")
        sampling.seed = pipeline.control.sampling_seed(session_id, ids)
    client = pipeline.policies.client_for(session_id, model)
    try:
        info = await client.info()
    except PolicyError as exc:
        return _error(503, f"agenttap: the policy server does not answer: {exc}")
    if info.max_model_len and len(ids) >= info.max_model_len:
        return _error(
            400,
            f"agenttap: prompt is too long: {len(ids)} tokens >= {info.max_model_len} (the "
            f"policy's context)",
        )
    assembly = await pipeline.assemble_tokens(session_id, ids)
    request_id = "gen-" + uuid.uuid4().hex[:24]
    user_agent = request.headers.get("User-Agent", "")
    try:
        async with pipeline.policies.generation(session_id, model, client) as gen:
            completion = await client.complete(ids, sampling, failover=gen.failover)
    except PolicyError as exc:
        pipeline.control.note_failure(session_id)
        pipeline.note_policy_error(PROTOCOL, exc, client.base_url)
        failed = FailedCall(
            session_id=session_id, request_id=request_id, protocol=PROTOCOL,
            requested_model=model, policy_model=info.model, backend=client.base_url,
            user_agent=user_agent, stream=False, reason=str(exc), policy_status=exc.status,
            prompt_tokens=len(ids), completion_tokens=0, started_at=started,
            failed_at=time.time(),
        )  # fmt: skip
        logger.warning("%s", failed_line(failed))
        pipeline.store.record_failure(failed)
        status = 400 if exc.status == 400 else 503 if exc.unavailable else 502
        return _error(status, f"agenttap: the policy failed: {exc}")
    record = TurnRecord(
        session_id=session_id,
        request_id=request_id,
        turn_index=-1,  # numbered under the session's lock, below
        protocol=PROTOCOL,
        requested_model=model,
        policy_model=info.model,
        backend=completion.backends[-1][0] if completion.backends else client.base_url,
        user_agent=user_agent,
        prompt_ids=ids,
        completion_ids=completion.token_ids,
        completion_logprobs=completion.logprobs,
        completion_text=completion.text,
        finish_reason=completion.finish_reason or "",
        response_finish_reason=completion.finish_reason or "",
        started_at=started,
        latency_s=time.time() - started,
        stream=False,
        weight_versions=[
            {"version": v, "start": start, "end": end}
            for v, start, end in completion.weight_versions
        ],
    )
    async with pipeline.session_lock(session_id):
        # Numbered here: a flush or another record while this one waited would repeat an index.
        record.turn_index = pipeline.store.next_turn_index(session_id)
        pipeline.store.record(record, assembly, Message("assistant", completion.text))
    pipeline.control.note_recorded(
        session_id, len(ids), len(completion.token_ids), record.latency_s
    )
    pipeline.note_recorded(record)
    return web.json_response(
        {
            "id": request_id,
            "token_ids": completion.token_ids,
            "logprobs": completion.logprobs,
            "text": completion.text,
            "finish_reason": completion.finish_reason,
            "prompt_tokens": len(ids),
            "completion_tokens": len(completion.token_ids),
            "extends": assembly.parent.request_id if assembly.parent is not None else None,
        }
    )
