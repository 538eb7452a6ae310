"""White-box generate against the real fp32 vLLM: token ids in, sampled ids and logprobs out,
recorded as the session's turns; the stored logprobs equal vLLM's, and a prompt_logprobs
re-score of the row, to the bit."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from capture.client.launcher import AgentTap
from tests.e2e.providers.test_trajectory_vllm import _rescore
from tests.support.paths import QWEN3


@pytest.fixture(scope="module")
def tap(
    vllm_url: str, confdir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[AgentTap]:
    instance = AgentTap.start(
        vllm_url, QWEN3, tmp_path_factory.mktemp("wb") / "out", confdir=confdir
    )
    yield instance
    instance.close()


def generate(url: str, body: Any, key: str) -> tuple[int, dict[str, Any]]:
    """POST /sess/ID/generate with the session's secret (its API key)."""
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {key}"}
    req = urllib.request.Request(url, json.dumps(body).encode(), headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_generate_records_token_turns_exactly(tap: AgentTap, vllm_url: str, tok: Any) -> None:
    sess = tap.open_session(metadata={"task_id": "white-box"})
    url = f"{tap.api_url}/sess/{sess.id}/generate"
    prompt = list(tok.encode("The agent reads the file and", add_special_tokens=False))
    sampling = {"max_tokens": 12, "temperature": 1.0, "seed": 7}
    status, first = generate(url, {"token_ids": prompt, "sampling_params": sampling}, sess.api_key)
    assert status == 200, first
    assert len(first["token_ids"]) == len(first["logprobs"]) == first["completion_tokens"] > 0
    assert first["extends"] is None
    # The agent's next call: the whole first sequence, then its own (environment) tokens.
    env_ids = list(tok.encode("\nObservation: ok\n", add_special_tokens=False))
    second_prompt = prompt + first["token_ids"] + env_ids
    status, second = generate(
        url, {"token_ids": second_prompt, "sampling_params": sampling}, sess.api_key
    )
    assert status == 200, second
    assert second["extends"] == first["id"]

    rows = sess.close(reward=1.0).to_pylist()
    assert len(rows) == 1
    row = rows[0]
    assert row["input_ids"] == second_prompt + second["token_ids"]
    assert row["num_turns"] == 2 and row["reward"] == 1.0
    mask = row["loss_mask"]
    trained = [lp for lp, m in zip(row["logprobs"], mask, strict=True) if m == 1]
    # Exactly the sampled tokens are trained; the environment tokens between are not.
    assert sum(mask) == len(first["token_ids"]) + len(second["token_ids"])
    assert mask[len(prompt) + len(first["token_ids"]) : len(second_prompt)] == [0] * len(env_ids)
    # Stored = what vLLM returned = a prompt_logprobs re-score, bit for bit (fp32).
    returned = np.asarray(first["logprobs"] + second["logprobs"], dtype=np.float32)
    assert np.array_equal(np.asarray(trained, dtype=np.float32), returned)
    rescored = _rescore(vllm_url, row["input_ids"])
    again = [r for r, m in zip(rescored, mask, strict=True) if m == 1]
    diff = float(np.max(np.abs(np.asarray(again, dtype=np.float32) - returned)))
    print(f"white-box generate: {len(again)} trained tokens, max |stored - rescored| = {diff}")
    assert diff == 0.0


def test_generate_refuses_bad_input_and_ended_sessions(tap: AgentTap) -> None:
    sess = tap.open_session(limits={"max_calls": 1})
    url = f"{tap.api_url}/sess/{sess.id}/generate"
    for body, words in [
        ({"token_ids": []}, "non-empty list"),
        ({"token_ids": [1, "a"]}, "non-empty list"),
        ({"token_ids": [1], "sampling_params": {"best_of": 2}}, "best_of"),
        ({"token_ids": [1], "sampling_params": {"temperature": "hot"}}, "temperature"),
        ({"token_ids": [1], "extra": 1}, "unknown field"),
    ]:
        status, answer = generate(url, body, sess.api_key)
        assert status == 400 and words in answer["error"]["message"], (body, answer)
    # Without the session's secret: refused, and not counted against its max_calls.
    status, answer = generate(url, {"token_ids": [9707]}, "sk-guess")
    assert status == 401 and "wants its secret" in answer["error"]["message"], answer
    assert (
        generate(url, {"token_ids": [9707], "sampling_params": {"max_tokens": 2}}, sess.api_key)[0]
        == 200
    )
    status, answer = generate(url, {"token_ids": [9707]}, sess.api_key)
    assert status == 400 and answer["error"]["reason"] == "max_calls"
    sess.close()
    assert sess.metrics["calls"] == 1 and sess.metrics["refused"] == 1
