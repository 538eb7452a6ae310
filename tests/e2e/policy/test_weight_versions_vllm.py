"""Weight versions per token span (real vLLM with ``--enable-scale-out``, fp32 tiny Qwen3).

The proxy finds vLLM's ``/inference/v1/generate`` and uses it, so each recorded turn keeps the
weight versions vLLM reports. A weight sync (``/pause?mode=abort``, ``/update_weight_version``,
``/resume``) in the middle of a streamed generation gives one stitched turn with two spans.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.e2e.policy.test_abort_resume_vllm import (
    EACH_TOKEN,
    MAX_TOKENS,
    PAUSE_AFTER_CHUNKS,
    RESUME_LOG,
    stream_through_a_pause,
)
from tests.e2e.providers.test_trajectory_vllm import _rescore
from tests.support.paths import QWEN3
from tests.support.proxies import start_proxy
from tests.support.vllm_servers import SCALE_OUT, VllmServers

pytestmark = pytest.mark.vllm


def _post(url: str, body: dict[str, Any] | None = None) -> Any:
    data = json.dumps(body).encode() if body is not None else b""
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read() or b"null")


def _set_version(url: str, version: str) -> None:
    _post(f"{url}/update_weight_version", {"new_version": version})
    with urllib.request.urlopen(f"{url}/weight_info", timeout=30) as resp:
        assert json.load(resp)["weight_version"] == version


@pytest.fixture(scope="module")
def generate_vllm_url(vllm_servers: VllmServers) -> Iterator[str]:
    """A second real vLLM, this one serving /inference/v1/generate (``--enable-scale-out``)."""
    yield vllm_servers.ready(SCALE_OUT).url
    vllm_servers.stop(SCALE_OUT)


def test_weight_sync_mid_stream_gives_two_spans(
    generate_vllm_url: str, confdir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = generate_vllm_url
    proxy = start_proxy(url, tmp_path / "out", confdir, extra=EACH_TOKEN)
    try:
        paused = stream_through_a_pause(
            url,
            proxy,
            monkeypatch,
            "weight-sync",
            while_paused=lambda: _set_version(url, "step-2"),
            before_attempt=lambda: _set_version(url, "step-1"),
        )
    finally:
        proxy.stop()
    seen = paused.seen
    log = proxy.log.read_text(errors="replace")
    assert RESUME_LOG in log, log[-3000:]

    rows = proxy.turns(paused.session, expect=1, timeout=60)
    assert len(rows) == 1
    row = rows[0]
    ids, lps = row["completion_ids"], row["completion_logprobs"]
    assert len(ids) == len(lps) == MAX_TOKENS
    assert row["finish_reason"] == "length"

    # Two spans, the old weights' then the new ones', covering every completion token once.
    spans = row["weight_versions"]
    print(f"weight_versions: {spans}")
    assert [s["version"] for s in spans] == ["step-1", "step-2"], spans
    assert spans[0]["start"] == 0 and spans[-1]["end"] == MAX_TOKENS
    assert spans[0]["end"] == spans[1]["start"]
    # The sync landed mid-generation (vLLM aborted the request): both spans hold tokens.
    assert PAUSE_AFTER_CHUNKS // 2 <= spans[0]["end"] < MAX_TOKENS

    # The text the client saw is vLLM's text of the stitched ids ...
    assert "".join(seen.pieces) == row["completion_text"]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(QWEN3))
    assert row["completion_text"] == tok.decode(ids, skip_special_tokens=True)
    # ... and every logprob, before and after the sync, is the sampled token's under the
    # policy's full sequence (fp32: exactly; the tiny model's weights did not really change).
    seq: list[Any] = row["prompt_ids"] + ids
    rescored = _rescore(url, seq)[len(row["prompt_ids"]) :]
    diff = np.abs(np.asarray(lps, np.float32) - np.asarray(rescored, np.float32))
    assert float(diff.max()) == 0.0, np.nonzero(diff)[0][:20]


def test_whole_answer_has_one_span(
    generate_vllm_url: str, confdir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _set_version(generate_vllm_url, "step-3")
    proxy = start_proxy(generate_vllm_url, tmp_path / "out", confdir)
    try:
        client = proxy.openai("one-span", monkeypatch)
        resp = client.chat.completions.create(
            model="gpt-4o",
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=20,
            seed=3,
            extra_body={"ignore_eos": True},
        )
    finally:
        proxy.stop()
    assert resp.usage is not None and resp.usage.completion_tokens == 20
    (row,) = proxy.turns("one-span", expect=1, timeout=60)
    assert row["weight_versions"] == [{"version": "step-3", "start": 0, "end": 20}]
    assert len(row["completion_ids"]) == len(row["completion_logprobs"]) == 20
