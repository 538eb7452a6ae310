"""Exact trajectories against the real vLLM (fp32 tiny Qwen3): multi-turn sessions through the
proxy, one with a history the client rewrites mid-way; every exported row re-scored."""

from __future__ import annotations

import json
import urllib.request

import numpy as np
import pytest

from tests.support.proxies import Proxy, read_threads

pytestmark = pytest.mark.vllm


def _rescore(vllm_url: str, ids: list[int]) -> list[float | None]:
    model = json.load(urllib.request.urlopen(f"{vllm_url}/v1/models"))["data"][0]["id"]
    body = {"model": model, "prompt": ids, "max_tokens": 1, "prompt_logprobs": 0}
    req = urllib.request.Request(
        f"{vllm_url}/v1/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    entries = json.load(urllib.request.urlopen(req))["choices"][0]["prompt_logprobs"]
    return [None if e is None else e[str(t)]["logprob"] for t, e in zip(ids, entries, strict=True)]


def _threads(proxy: Proxy, session: str, expect_turns: int) -> list[dict]:
    rows = proxy.turns(session, expect=expect_turns, timeout=60)
    assert len(rows) == expect_turns
    return read_threads(proxy.out, session)


def _chat(client, messages: list[dict], **kw) -> str:  # type: ignore[no-untyped-def]
    resp = client.chat.completions.create(model="gpt-4o", messages=messages, max_tokens=24, **kw)
    return resp.choices[0].message.content or ""


def _assert_exact(row: dict, turns: list[dict], vllm_url: str, tolerance: float = 0.0) -> float:
    """Stored logprobs equal a prompt_logprobs re-score of the row: bit for bit by default.

    ``tolerance``: at contexts of ~10k tokens vLLM's CPU attention sums in a different order
    when decoding than when prefilling the same positions, so fp32 results differ in the last
    bits (measured: 9.5e-7 at 11.5k tokens); short sessions match exactly."""
    ids, mask, lps, prov = row["input_ids"], row["loss_mask"], row["logprobs"], row["provenance"]
    assert len(ids) == len(mask) == len(lps) == len(prov)
    # Trained tokens are policy tokens; policy tokens trained in another row are context here.
    assert all(p in (1, 2) for m, p in zip(mask, prov, strict=True) if m == 1)
    rescored = _rescore(vllm_url, ids)
    diffs = [
        abs(np.float32(lp) - np.float32(r))
        for lp, r, m in zip(lps, rescored, mask, strict=True)
        if m == 1
    ]
    assert diffs, "no trained tokens"
    max_diff = float(max(diffs))
    print(
        f"thread {row['thread_id']}: {len(diffs)} trained tokens, max |stored - rescored| = {max_diff}"
    )
    assert max_diff <= tolerance
    # The sampled ids in the thread are exactly the ids vLLM returned for each call.
    by_request = {t["request_id"]: t for t in turns}
    for span in row["turns"]:
        if span["dropped"]:
            continue
        assert ids[span["start"] : span["end"]] == by_request[span["request_id"]]["completion_ids"]
    return max_diff


def test_multi_turn_extension_is_exact(
    vllm_proxy: Proxy, vllm_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = vllm_proxy.openai("traj-extend", monkeypatch)
    messages: list[dict] = [{"role": "system", "content": "You are terse."}]
    for i in range(4):
        messages.append({"role": "user", "content": f"Question {i}: what is {i} + {i}?"})
        messages.append({"role": "assistant", "content": _chat(client, messages)})
    turns = vllm_proxy.turns("traj-extend", expect=4, timeout=60)
    threads = _threads(vllm_proxy, "traj-extend", 4)
    assert len(threads) == 1, [t["thread_id"] for t in threads]
    row = threads[0]
    assert row["num_turns"] == 4 and not any(t["dropped"] for t in row["turns"])
    # Each call's prompt extends the previous call's prompt + sampled ids: no re-tokenization gap.
    for prev, cur in zip(turns, turns[1:], strict=False):
        seq = prev["prompt_ids"] + prev["completion_ids"]
        assert cur["prompt_ids"][: len(seq)] == seq
    assert row["input_ids"][: len(turns[-1]["prompt_ids"])] == turns[-1]["prompt_ids"]
    assert set(row["provenance"]) <= {0, 1}
    _assert_exact(row, turns, vllm_url)


def test_rewritten_history_is_recomputed_exactly(
    vllm_proxy: Proxy, vllm_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = vllm_proxy.openai("traj-rewrite", monkeypatch)
    messages: list[dict] = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "First question."},
    ]
    messages.append({"role": "assistant", "content": _chat(client, messages)})
    messages.append({"role": "user", "content": "Second question."})
    messages.append({"role": "assistant", "content": _chat(client, messages)})
    # The scaffold injects a reminder into the FIRST user turn, as Claude Code does.
    messages[1] = {
        "role": "user",
        "content": "<system-reminder>Files changed.</system-reminder>\nFirst question.",
    }
    messages.append({"role": "user", "content": "Third question."})
    _chat(client, messages)
    turns = vllm_proxy.turns("traj-rewrite", expect=3, timeout=60)
    assert json.loads(turns[2]["metadata"])["assembly"] == "rewrite"
    threads = _threads(vllm_proxy, "traj-rewrite", 3)
    assert len(threads) == 1
    row = threads[0]
    # Both earlier replies sit after the rewritten user turn: their logprobs were recomputed.
    assert row["provenance"].count(2) == len(turns[0]["completion_ids"]) + len(
        turns[1]["completion_ids"]
    )
    assert row["num_turns"] == 3 and not any(t["dropped"] for t in row["turns"])
    _assert_exact(row, turns, vllm_url)


def test_retry_and_rewrite_still_rescore_exactly(
    vllm_proxy: Proxy, vllm_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An SDK retry of an identical request (its retry header), then a rewrite of the first user
    message: the abandoned answer is a dead row, the live row keeps the history, and every
    trained logprob of both rows equals vLLM's re-score of that row."""
    session = "traj-retry-rewrite"
    client = vllm_proxy.openai(session, monkeypatch)
    messages: list[dict] = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "First question."},
    ]
    messages.append({"role": "assistant", "content": _chat(client, messages)})
    messages.append({"role": "user", "content": "Second question."})
    _chat(client, messages)  # the answer the client never used
    kept = _chat(client, messages, extra_headers={"x-stainless-retry-count": "1"})
    messages.append({"role": "assistant", "content": kept})
    messages[1] = {
        "role": "user",
        "content": "<system-reminder>Files changed.</system-reminder>\nFirst question.",
    }
    messages.append({"role": "user", "content": "Third question."})
    _chat(client, messages)
    turns = vllm_proxy.turns(session, expect=4, timeout=60)
    assert [json.loads(t["metadata"])["assembly"] for t in turns] == [
        "new", "extend", "retry", "rewrite",
    ]  # fmt: skip
    threads = _threads(vllm_proxy, session, 4)
    assert len(threads) == 2
    live = next(r for r in threads if not r["dead"])
    dead = next(r for r in threads if r["dead"])
    ids = [t["request_id"] for t in turns]
    assert live["trained_request_ids"] == [ids[0], ids[2], ids[3]]
    assert dead["trained_request_ids"] == [ids[1]] and dead["superseded_by"] == live["thread_id"]
    # Every call trained once, no token twice.
    assert sum(sum(r["loss_mask"]) for r in threads) == sum(len(t["completion_ids"]) for t in turns)
    worst = max(_assert_exact(row, turns, vllm_url) for row in threads)
    print(f"retry + rewrite session: max |stored - rescored| = {worst}")


def test_side_call_starts_its_own_thread(
    vllm_proxy: Proxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = vllm_proxy.openai("traj-side", monkeypatch)
    main = [
        {"role": "system", "content": "Main agent."},
        {"role": "user", "content": "Do the task."},
    ]
    main.append({"role": "assistant", "content": _chat(client, main)})
    _chat(
        client,
        [
            {"role": "system", "content": "Write a title."},
            {"role": "user", "content": "Do the task."},
        ],
    )
    main.append({"role": "user", "content": "Continue."})
    _chat(client, main)
    threads = _threads(vllm_proxy, "traj-side", 3)
    assert sorted(t["num_turns"] for t in threads) == [1, 2]
