"""A generation the policy server aborts mid-stream (``POST /pause?mode=abort``, as an RL trainer
does for a weight sync) is resumed by the proxy and stitched: the client sees one uninterrupted
stream, and the recorded turn is one exact sequence (real vLLM, fp32 tiny Qwen3)."""

from __future__ import annotations

import re
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.e2e.providers.test_trajectory_vllm import _rescore
from tests.support.paths import QWEN3
from tests.support.proxies import start_proxy

# It changes the session's vLLM for everyone: no other test may use it meanwhile.
pytestmark = [pytest.mark.vllm, pytest.mark.policy_exclusive]

MAX_TOKENS = 300
PAUSE_AFTER_CHUNKS = 40
RESUME_LOG = "generation aborted by the policy server; resuming"
# The pause is timed by the chunks the client has read: each token its own chunk, as soon as it
# is read (agenttap_stream_flush_ms's interval would put several tokens in one).
EACH_TOKEN = ["--set", "agenttap_stream_flush_ms=0"]


def _post(url: str) -> None:
    with urllib.request.urlopen(urllib.request.Request(url, b"", method="POST"), timeout=60):
        pass


def _abort_counts(vllm_url: str) -> dict[str, float]:
    """vLLM's finished-request counters by reason (``vllm:request_success_total``)."""
    text = urllib.request.urlopen(f"{vllm_url}/metrics", timeout=30).read().decode()
    counts: dict[str, float] = {}
    for m in re.finditer(
        r'^vllm:request_success_total\{[^}]*finished_reason="(\w+)"[^}]*\} ([0-9.e+]+)$',
        text,
        re.M,
    ):
        counts[m.group(1)] = counts.get(m.group(1), 0.0) + float(m.group(2))
    return counts


@dataclass
class LongStream:
    """What the client saw of one long streamed chat completion."""

    pieces: list[str] = field(default_factory=list)
    chunks: int = 0
    finish: str | None = None
    usage: Any = None


def stream_long_story(
    client: Any,
    after_chunks: int,
    at_chunk: Callable[[], None],
    out: LongStream,
    max_tokens: int = MAX_TOKENS,
    seed: int = 11,
) -> None:
    """Stream ``max_tokens`` tokens (EOS ignored) and call ``at_chunk`` once, after chunk
    ``after_chunks``, while the stream goes on. ``out`` fills as chunks arrive."""
    stream = client.chat.completions.create(
        model="gpt-4o",
        messages=[{"role": "user", "content": "Tell me a very long story."}],
        max_tokens=max_tokens,
        seed=seed,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    for chunk in stream:
        out.chunks += 1
        if chunk.usage:
            out.usage = chunk.usage
        for choice in chunk.choices:
            extra = choice.delta.model_extra or {}
            out.pieces.append(extra.get("reasoning_content") or "")
            out.pieces.append(choice.delta.content or "")
            out.finish = choice.finish_reason or out.finish
        if out.chunks == after_chunks:
            at_chunk()


PAUSE_ATTEMPTS = 3


@dataclass
class PausedStream:
    """One long stream during which vLLM was paused with ``mode=abort`` mid-generation."""

    session: str
    seen: LongStream
    aborted: float  # requests vLLM finished with reason "abort" during the attempt
    attempts: int
    pause_s: float


def stream_through_a_pause(
    vllm_url: str,
    proxy: Any,
    monkeypatch: pytest.MonkeyPatch,
    session: str,
    while_paused: Callable[[], None] = lambda: None,
    before_attempt: Callable[[], None] = lambda: None,
) -> PausedStream:
    """Stream ``MAX_TOKENS`` tokens through the proxy and, after chunk ``PAUSE_AFTER_CHUNKS``,
    pause vLLM with ``mode=abort``, call ``while_paused``, wait a second and resume.

    The pause is sent when the *client* has read that chunk; on a loaded machine vLLM may have
    generated every token by then (the rest sits in socket buffers), and the pause has nothing
    to abort. vLLM's own counter of aborted requests tells the two apart: an attempt in which
    vLLM aborted nothing is repeated in a new session (at most ``PAUSE_ATTEMPTS``), so the test
    checks the proxy's resume whenever vLLM really aborted, and fails if it never managed to.
    """
    for attempt in range(1, PAUSE_ATTEMPTS + 1):
        before_attempt()
        name = f"{session}-{attempt}"
        counts_before = _abort_counts(vllm_url)
        seen, pause_s = _one_paused_stream(vllm_url, proxy.openai(name, monkeypatch), while_paused)
        counts_after = _abort_counts(vllm_url)
        aborted = counts_after.get("abort", 0.0) - counts_before.get("abort", 0.0)
        print(
            f"attempt {attempt}: {seen.chunks} chunks; pause after chunk {PAUSE_AFTER_CHUNKS} "
            f"took {pause_s:.2f}s; vLLM aborted {aborted:g} request(s)"
        )
        if aborted >= 1:
            return PausedStream(name, seen, aborted, attempt, pause_s)
    pytest.fail(f"in {PAUSE_ATTEMPTS} attempts the pause never reached vLLM mid-generation")


def _one_paused_stream(
    vllm_url: str, client: Any, while_paused: Callable[[], None]
) -> tuple[LongStream, float]:
    """One attempt of :func:`stream_through_a_pause`: what the client saw, and how long the
    pause request took."""
    errors: list[BaseException] = []
    timeline: dict[str, float] = {}

    def pause_then_resume() -> None:
        try:
            timeline["pause"] = time.monotonic()
            _post(f"{vllm_url}/pause?mode=abort")
            timeline["paused"] = time.monotonic()
            while_paused()
            # While paused the proxy's resubmission waits in vLLM's queue.
            time.sleep(1.0)
        except BaseException as exc:  # reported by the test thread
            errors.append(exc)
        finally:
            try:
                _post(f"{vllm_url}/resume")
            except BaseException as exc:
                errors.append(exc)

    pauser = threading.Thread(target=pause_then_resume, daemon=True)
    seen = LongStream()
    try:
        stream_long_story(client, PAUSE_AFTER_CHUNKS, pauser.start, seen)
    finally:
        if pauser.ident is not None:  # started
            pauser.join(120)
        # Whatever happened, never leave the shared vLLM paused for the other tests.
        _post(f"{vllm_url}/resume")
    assert not errors, errors
    # The client saw one ordinary stream: all the tokens, a normal finish, no error.
    assert seen.chunks > PAUSE_AFTER_CHUNKS, "the stream ended before the pause"
    assert seen.finish == "length"
    assert seen.usage is not None and seen.usage.completion_tokens == MAX_TOKENS
    return seen, timeline["paused"] - timeline["pause"]


def test_stream_aborted_by_pause_is_resumed_and_stitched(
    vllm_url: str, confdir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    proxy = start_proxy(vllm_url, tmp_path / "out", confdir, extra=EACH_TOKEN)
    try:
        paused = stream_through_a_pause(vllm_url, proxy, monkeypatch, "abort-resume")
    finally:
        proxy.stop()
    seen = paused.seen

    # vLLM really aborted a request, and the proxy resumed it.
    log = proxy.log.read_text(errors="replace")
    assert RESUME_LOG in log, log[-3000:]

    # The recorded turn is one stitched completion of exactly max_tokens ...
    rows = proxy.turns(paused.session, expect=1, timeout=60)
    assert len(rows) == 1
    row = rows[0]
    ids, lps = row["completion_ids"], row["completion_logprobs"]
    assert len(ids) == len(lps) == MAX_TOKENS
    assert row["finish_reason"] == "length"
    assert "".join(seen.pieces) == row["completion_text"]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(QWEN3))
    assert row["completion_text"] == tok.decode(ids, skip_special_tokens=True)

    # ... whose every logprob, before and after the abort, is what the policy gives the full
    # sequence (fp32: exactly).
    seq: list[Any] = row["prompt_ids"] + ids
    rescored = _rescore(vllm_url, seq)[len(row["prompt_ids"]) :]
    stored = np.asarray(lps, dtype=np.float32)
    diff = np.abs(stored - np.asarray(rescored, dtype=np.float32))
    print(f"max |stored - rescored| over {len(ids)} tokens = {float(diff.max())}")
    assert float(diff.max()) == 0.0, np.nonzero(diff)[0][:20]


def test_a_rescore_the_server_aborts_is_asked_again(vllm_url: str) -> None:
    """A prompt_logprobs request (the re-score of a schema-constrained completion, a rewritten
    turn) in flight when a trainer pauses vLLM with ``mode=abort``: vLLM ends it with
    finish_reason "abort" and no logprobs; the client asks again (the new request waits for the
    resume) and gets the same logprobs as an uninterrupted re-score, where before it failed and
    the completion's tokens were masked."""
    import asyncio

    import aiohttp

    from rewriter.vllm_client import VLLMClient

    async def scored_through_a_pause(ids: list[int]) -> tuple[list[float | None], float]:
        async with aiohttp.ClientSession() as http:
            client = VLLMClient(vllm_url, http)
            await client.served()
            before = _abort_counts(vllm_url).get("abort", 0.0)
            task = asyncio.create_task(client.prompt_logprobs(ids))
            await asyncio.sleep(0.3)
            await asyncio.to_thread(_post, f"{vllm_url}/pause?mode=abort")
            try:
                await asyncio.sleep(1.0)
            finally:
                await asyncio.to_thread(_post, f"{vllm_url}/resume")
            got = await task
            return got, _abort_counts(vllm_url).get("abort", 0.0) - before

    for length in (6000, 9000):
        ids = [(i * 7919) % 150000 for i in range(length)]
        got, aborted = asyncio.run(scored_through_a_pause(ids))
        if aborted:
            break
        print(f"{length} ids were scored before the pause reached vLLM; longer")
    assert aborted >= 1, "the pause never reached vLLM while the re-score ran"
    # The same logprobs as an uninterrupted re-score, to fp32 at long context (the asked-again
    # request may reuse the aborted one's cached prefix, prefilled in other chunks: 2e-6 seen
    # at 6,000 ids; see _assert_exact).
    want = _rescore(vllm_url, ids)
    assert len(got) == len(want) and got[0] is None and want[0] is None
    worst = max(abs(float(g) - float(w)) for g, w in zip(got[1:], want[1:], strict=True))  # type: ignore[arg-type]
    assert worst <= 1e-5, worst
