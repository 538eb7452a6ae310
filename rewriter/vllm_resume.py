"""A generation resumed across aborts and moved across servers: ``stream_resuming`` resubmits a
generation the server aborted (a pause, a weight sync) with the tokens so far, and with a
``failover`` goes on on another server after one failed; the caller sees one completion, each
piece labelled with the server and the weights that sampled it.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace

import aiohttp

from rewriter.canonical import SamplingParams
from rewriter.vllm_answers import CompletionDelta, PolicyError, WeightSpan
from rewriter.vllm_generate import Generating
from rewriter.vllm_stream import ResumedText

# Logged under the client's name, as before the client was split in modules.
logger = logging.getLogger("rewriter.vllm_client")

# Aborts a generation may be resumed after (a weight sync each), then it fails.
MAX_RESUMES = 16
# Servers a generation may move to after the one sampling it failed (see stream_resuming).
MAX_FAILOVERS = 8


def _may_fail_over(exc: BaseException) -> bool:
    """Whether another server may succeed where this one failed: no answer, a cut or stalled
    stream, overloaded (429 / 503); not a request the server refused as such (4xx)."""
    return not isinstance(exc, PolicyError) or exc.unavailable


async def stream_resuming[G: Generating](
    first: G,
    prompt_ids: list[int],
    params: SamplingParams,
    *,
    stream: bool = True,
    failover: Callable[[G, BaseException], Awaitable[G | None]] | None = None,
    prompt_json: str | None = None,
    decode: Callable[[list[int]], str] | None = None,
) -> AsyncIterator[CompletionDelta]:
    """``first.stream`` (or, without ``stream``, one whole answer), but a generation the server
    ends with ``finish_reason: abort`` (a paused server, a weight sync) is resubmitted with the
    tokens so far appended to the prompt and the remaining budget, and stitched: the caller
    sees one completion. A generation waits while its server's weights load, and is refused
    where they are out of rotation (``Rotation.admitted``).

    ``failover(client, error)``: called when the server fails in a way another server may
    not (no answer, a cut or stalled stream, 429 / 503); the client it returns goes on
    from the tokens so far, the same way (None: the error is raised). Each piece says
    which server sampled it (``backend``). ``prompt_json``: ``prompt_ids`` as JSON text
    (rewriter/ids_json.py), sent as it is while no token was sampled yet. ``decode``: the
    policy tokenizer's; with it, a resumed generation's text is decoded here."""
    sampled: list[int] = []
    emitted: list[str] = []  # the text yielded so far
    resumed: ResumedText | None = None
    current = first
    aborts = failovers = 0
    # Spans of this completion's tokens the servers did not label (see sampling_version),
    # handed on with the next piece yielded.
    unlabelled: list[WeightSpan] = []
    while True:
        before = len(sampled)
        try:
            await current.rotation.admitted(current.base_url)
        except PolicyError as exc:
            if failover is None or failovers >= MAX_FAILOVERS:
                raise
            replacement = await failover(current, exc)
            if replacement is None:
                raise
            current, failovers = replacement, failovers + 1
            continue
        label = current.rotation.sampling_version()
        labelled = False
        budget = replace(
            params,
            max_tokens=None if params.max_tokens is None else params.max_tokens - len(sampled),
            min_tokens=None
            if params.min_tokens is None
            else max(0, params.min_tokens - len(sampled)),
        )
        aborted = False
        ids = prompt_ids + sampled if sampled else prompt_ids
        text = prompt_json if not sampled else None
        parts = (
            current.stream(ids, budget, prompt_json=text)
            if stream
            else current._complete_once(ids, budget, prompt_json=text)
        )
        try:
            async for delta in parts:
                if delta.finish_reason == "abort":
                    aborted = True
                    delta.finish_reason = None
                # The server's spans count this generation's tokens; the caller's, the whole.
                delta.weight_versions = [
                    (v, start + before, end + before) for v, start, end in delta.weight_versions
                ]
                labelled = labelled or bool(delta.weight_versions)
                delta.backend = current.base_url
                sampled.extend(delta.token_ids)
                if unlabelled:
                    delta.weight_versions[:0] = unlabelled
                    unlabelled = []
                if aborted or delta.finish_reason is not None:
                    # The piece's last: where the server labelled none of its tokens, the
                    # weights it ran under (see sampling_version) label them all.
                    if not labelled and len(sampled) > before:
                        span = (current.rotation.ran_under(label), before, len(sampled))
                        delta.weight_versions.append(span)
                if resumed is not None:
                    delta.text = resumed.step(sampled, final=delta.finish_reason is not None)
                emitted.append(delta.text)
                yield delta
        except (PolicyError, aiohttp.ClientError, TimeoutError) as exc:
            if failover is None or failovers >= MAX_FAILOVERS or not _may_fail_over(exc):
                raise
            replacement = await failover(current, exc)
            if replacement is None:
                raise
            if not labelled and len(sampled) > before:
                unlabelled.append((current.rotation.ran_under(label), before, len(sampled)))
            current, failovers = replacement, failovers + 1
        else:
            if not aborted:
                return
            aborts += 1
            if aborts > MAX_RESUMES:
                raise PolicyError(f"generation aborted {aborts} times; giving up")
            logger.info("generation aborted by the policy server; resuming (%d)", aborts)
        if params.max_tokens is not None and len(sampled) >= params.max_tokens:
            yield CompletionDelta(
                "",
                [],
                [],
                finish_reason="length",
                weight_versions=unlabelled,
                backend=current.base_url,
            )
            return
        if decode is not None and resumed is None and (aborted or sampled):
            # vLLM detokenizes a resubmission from its prompt: where the tokens so far end
            # inside a character (a byte-level token), its first text can repeat the whole
            # prompt. From here on the text is decoded from the stitched ids instead.
            resumed = ResumedText.start(decode, sampled, "".join(emitted))
