"""A policy replica killed mid-generation (``kill -9`` of a real vLLM process): the generation
goes on on the other replica from the tokens already streamed, the client sees one
uninterrupted answer, and the recorded turn holds both spans with their backends; no turn is
lost or duplicated, and every logprob is the policy's (real vLLM, fp32 tiny Qwen3 on both)."""

from __future__ import annotations

import json
import os
import signal
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.policy.test_abort_resume_vllm import LongStream, stream_long_story
from tests.e2e.providers.test_trajectory_vllm import _rescore
from tests.support.paths import QWEN3
from tests.support.proxies import start_proxy
from tests.support.vllm_servers import DOOMED, Server, VllmServers

pytestmark = pytest.mark.vllm

MAX_TOKENS = 1500
KILL_AFTER_CHUNKS = 20


@pytest.fixture
def doomed_vllm(vllm_servers: VllmServers) -> Iterator[Server]:
    """A second server like the session's, for this test alone to kill."""
    yield vllm_servers.ready(DOOMED)
    vllm_servers.stop(DOOMED)


def test_a_replica_killed_mid_stream_hands_the_generation_over(
    vllm_url: str,
    doomed_vllm: Server,
    confdir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    doomed_url, doomed = doomed_vllm.url, doomed_vllm.proc
    proxy = None
    try:
        proxy = start_proxy(f"{doomed_url},{vllm_url}", tmp_path / "out", confdir)
        # Idle replicas: a new session goes where its hash says; this one to the doomed one.
        session = next(
            f"failover-{i}" for i in range(1000) if zlib.crc32(f"failover-{i}".encode()) % 2 == 0
        )
        client = proxy.openai(session, monkeypatch)
        seen = LongStream()
        killed: list[int] = []

        def kill() -> None:
            os.killpg(doomed.pid, signal.SIGKILL)
            killed.append(seen.chunks)

        stream_long_story(client, KILL_AFTER_CHUNKS, kill, seen, max_tokens=MAX_TOKENS, seed=5)
        assert killed == [KILL_AFTER_CHUNKS]
        # One ordinary answer: every token, a normal finish, no error event.
        assert seen.finish == "length"
        assert seen.usage is not None and seen.usage.completion_tokens == MAX_TOKENS

        rows = proxy.turns(session, expect=1, timeout=60)
        assert len(rows) == 1
        row = rows[0]
        ids, lps = row["completion_ids"], row["completion_logprobs"]
        assert len(ids) == len(lps) == MAX_TOKENS and row["finish_reason"] == "length"
        assert "".join(seen.pieces) == row["completion_text"]
        spans = json.loads(row["metadata"])["backends"]
        assert [s["backend"] for s in spans] == [doomed_url, vllm_url], spans
        cut = spans[0]["end"]
        assert spans == [
            {"backend": doomed_url, "start": 0, "end": cut},
            {"backend": vllm_url, "start": cut, "end": MAX_TOKENS},
        ]
        assert cut >= KILL_AFTER_CHUNKS - 2  # the client had these before the kill
        assert row["backend"] == vllm_url
        print(f"the doomed replica sampled {cut} tokens; the other {MAX_TOKENS - cut}")
        from transformers import AutoTokenizer

        tok: Any = AutoTokenizer.from_pretrained(str(QWEN3))
        assert row["completion_text"] == tok.decode(ids, skip_special_tokens=True)
        # Every logprob, before and after the handover, is what the policy gives the whole
        # sequence (the same fp32 weights on both servers).
        scores = _rescore(vllm_url, list(row["prompt_ids"]) + list(ids))[len(row["prompt_ids"]) :]
        worst = max(abs(a - float(b)) for a, b in zip(lps, scores, strict=True) if b is not None)
        print(f"largest logprob difference from a re-score: {worst:.3g}")
        assert worst <= 1e-4
        log = proxy.log.read_text(errors="replace")
        assert "failed mid-generation" in log and doomed_url in log
    finally:
        if proxy is not None:
            proxy.stop()
