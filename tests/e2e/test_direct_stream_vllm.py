"""``agenttap_stream_path=direct`` in front of a real vLLM (fp32 tiny Qwen3): a streamed turn is
recorded with exactly the tokens and logprobs the policy sampled (a ``prompt_logprobs`` rescore
of the whole sequence equals them to the bit), and a generation vLLM aborts mid-stream
(``POST /pause?mode=abort``, a weight sync) ends the client's answer with its provider's error
and a failed row: this path does not resume (the loopback path's test is
test_abort_resume_vllm.py)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import openai
import pytest

from tests.conftest import Proxy, read_turns, start_proxy
from tests.e2e.test_abort_resume_vllm import (
    PAUSE_AFTER_CHUNKS,
    PAUSE_ATTEMPTS,
    LongStream,
    _abort_counts,
    _post,
    stream_long_story,
)
from tests.e2e.test_policy_faults import read_failed
from tests.e2e.test_trajectory_vllm import _rescore

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def direct_proxy(
    vllm_url: str, confdir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Proxy]:
    out = tmp_path_factory.mktemp("direct-vllm") / "out"
    proxy = start_proxy(vllm_url, out, confdir, extra=["--set", "agenttap_stream_path=direct"])
    yield proxy
    proxy.stop()


def test_a_direct_stream_records_exactly_what_the_policy_sampled(
    direct_proxy: Proxy, vllm_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    session = "direct-vllm-exact"
    seen = LongStream()
    client = direct_proxy.openai(session, monkeypatch)
    stream_long_story(client, 10**9, lambda: None, seen, max_tokens=120)
    assert seen.finish == "length" and seen.usage.completion_tokens == 120
    [row] = direct_proxy.turns(session)
    ids, lps = row["completion_ids"], row["completion_logprobs"]
    assert len(ids) == len(lps) == 120 and row["finish_reason"] == "length"
    assert "".join(seen.pieces) == row["completion_text"]
    prompt = row["prompt_ids"]
    rescored = _rescore(vllm_url, prompt + ids)[len(prompt) :]
    diff = np.abs(np.asarray(lps, np.float32) - np.asarray(rescored, np.float32))
    assert float(diff.max()) == 0.0, np.nonzero(diff)[0][:20]


def test_a_generation_vllm_aborts_ends_with_the_providers_error_and_a_failed_row(
    direct_proxy: Proxy, vllm_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As in test_abort_resume_vllm.py, an attempt in which the pause reached vLLM after every
    token was out (nothing aborted) is repeated in a new session."""
    for attempt in range(1, PAUSE_ATTEMPTS + 1):
        session = f"direct-vllm-abort-{attempt}"
        before = _abort_counts(vllm_url)

        def pause_then_resume() -> None:
            try:
                _post(f"{vllm_url}/pause?mode=abort")
                time.sleep(0.5)
            finally:
                _post(f"{vllm_url}/resume")

        pauser = threading.Thread(target=pause_then_resume, daemon=True)
        seen = LongStream()
        error: openai.APIError | None = None
        try:
            stream_long_story(
                direct_proxy.openai(session, monkeypatch), PAUSE_AFTER_CHUNKS, pauser.start, seen
            )
        except openai.APIError as exc:
            error = exc
        finally:
            if pauser.ident is not None:
                pauser.join(60)
            _post(f"{vllm_url}/resume")  # never leave the shared vLLM paused
        aborted = _abort_counts(vllm_url).get("abort", 0.0) - before.get("abort", 0.0)
        if aborted >= 1:
            break
    else:
        pytest.fail(f"in {PAUSE_ATTEMPTS} attempts the pause never reached vLLM mid-generation")
    # The client's stream ended with its provider's error, after the tokens sent before it.
    assert error is not None, f"the stream ended normally ({seen.finish}) after an abort"
    assert "aborted the generation" in str(error)
    assert seen.chunks >= PAUSE_AFTER_CHUNKS and seen.finish is None
    # Nothing of it is trained: a failed row with what was streamed, no turn.
    direct_proxy.flush(session)
    assert read_turns(direct_proxy.out, session) == []
    [failed] = read_failed(direct_proxy.out, session)
    assert "aborted the generation" in failed["reason"]
    assert failed["stream"] is True and failed["completion_tokens"] >= PAUSE_AFTER_CHUNKS - 1
