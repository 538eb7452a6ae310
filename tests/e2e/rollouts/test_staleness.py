"""agenttap_max_staleness through a real mitmdump (the vLLM-shaped stub as the policy): a
session that started under weights too many updates old gets its next call answered as final,
ends ``stale``, and its rows say which weights sampled its calls."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from capture.client.launcher import AgentTap, Session
from tests.support.paths import QWEN3
from tests.support.stub_vllm import StubPolicy


def _chat(sess: Session, text: str) -> object:
    client = openai.OpenAI(
        base_url=sess.base_urls["openai"], api_key=sess.api_key, max_retries=0, timeout=60
    )
    return client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": text}]
    )


def test_a_session_older_than_max_staleness_ends_stale(
    stub: StubPolicy, confdir: Path, tmp_path: Path
) -> None:
    stub.replies.clear()
    tap = AgentTap.start(
        stub.url, QWEN3, tmp_path / "out", confdir=confdir,
        options={"agenttap_max_staleness": "1"},
    )  # fmt: skip
    try:
        old = tap.open_session("old")
        _chat(old, "first, under the default weights")
        assert tap.set_weight_version("v1")["version"] == "v1"
        young = tap.open_session("young")
        _chat(young, "first, under v1")
        _chat(old, "one update behind: still answered")
        tap.set_weight_version("v2")
        n = len(stub.requests)
        with pytest.raises(openai.BadRequestError) as err:
            _chat(old, "two updates behind")
        assert err.value.response.headers["x-should-retry"] == "false"
        assert "agenttap_max_staleness" in str(err.value)
        assert len(stub.requests) == n  # the policy never saw it
        _chat(young, "one update behind: answered")
        assert tap.client.get("/policy/version")["index"] == 2
        rows = old.close().to_pylist()
        assert old.end_reason == "stale" and old.metrics["refused"] == 1
        assert {r["end_reason"] for r in rows} == {"stale"}
        # Its two answered calls: one under each weights.
        versions = sorted(span["version"] for r in rows for span in r["weight_versions"])
        assert versions == ["default", "v1"]
    finally:
        tap.close()
