"""OpenCode's automatic compaction through the real proxy, answered by the scripted stub.

OpenCode compacts when the last call's usage (prompt plus answer tokens, from the response)
reaches the model's usable context: ``limit.context`` less its output limit, both from the
model's entry, which its config can set (``provider.<id>.models.<model>.limit``). Then it
sends one call of its own (a summarization system prompt, no tools) holding the older history
as text, and goes on from "What did we do so far?", the summary as the assistant's answer, the
recent calls it kept (``compaction.preserve_recent_tokens``, by default a quarter of the
usable context) and a synthetic "Continue if you have next steps ..." user message.

Here a small limit (16000 tokens, 2000 of them output) and a file read of ~8k tokens on top
of its ~7k-token prompt make it compact once, after the second call.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from tests.e2e.clis.test_opencode import opencode, run_opencode  # noqa: F401 (the fixture)
from tests.e2e.providers.test_anthropic_sdk_stub import hermes
from tests.support.proxies import Proxy
from tests.support.scaffold_task import (
    DONE,
    TITLE,
    TITLE_PROMPT,
    sampled,
    seed,
    stub_logprobs,
)
from tests.support.stub_vllm import StubPolicy

MODEL = "anthropic/claude-sonnet-4-5"
PROMPT = "Read big.txt, then in notes.txt replace beta with gamma"
# OpenCode's compaction prompt (its summarization agent's system prompt and the user message).
COMPACTION_SYSTEM = "You are a context summarization agent"
COMPACTION_ASK = "Create a new anchored summary from the conversation history"
SUMMARY = "## Objective\n- Replace beta with gamma in notes.txt after reading big.txt."
CONTINUE = "Continue if you have next steps, or stop and ask for clarification"
LIMIT = {"context": 16000, "output": 2000}
BIG_LINES = 400
STEPS = [
    hermes("read", {"filePath": "big.txt"}),
    hermes("bash", {"command": "wc -l notes.txt", "description": "Count the lines"}),
    hermes("edit", {"filePath": "notes.txt", "oldString": "beta", "newString": "gamma"}),
    "Replaced beta with gamma in notes.txt.",
]


def test_opencode_compaction_is_auxiliary_and_a_rewrite_trained_once(
    opencode: Path,  # noqa: F811 (the fixture imported above)
    stub_proxy: Proxy,
    stub: StubPolicy,
    tmp_path: Path,
) -> None:
    """The summary call is an ``auxiliary`` row. The conversation after it holds the kept
    calls' replies by their tool-call ids, so it is placed as a rewrite of the conversation's
    row: the calls the summary replaced are ``dropped`` there and trained in a ``rewritten``
    row at their own sampled logprobs; the kept call, whose answer OpenCode sends back with the
    summary merged into it, is rendered as sent (the policy sees the summary) and is trained
    in the rewritten row too; the calls after the compaction are sampled in the conversation's
    row. Every call trained once, at the stub's ids and logprobs."""
    session = "opencode-compaction"
    workdir = seed(tmp_path / "work")
    lines = [f"line {i}: the quick brown fox jumps over the lazy dog\n" for i in range(BIG_LINES)]
    (workdir / "big.txt").write_text("".join(lines))
    config = tmp_path / "work-home" / ".config" / "opencode" / "opencode.json"
    config.parent.mkdir(parents=True)
    models = {"claude-sonnet-4-5": {"limit": LIMIT}}
    config.write_text(json.dumps({"provider": {"anthropic": {"models": models}}}))
    steps = iter(STEPS)

    def rule(body: dict[str, Any]) -> str | None:
        # The conversation's calls are sequential; the title call runs beside the first one.
        text = stub.tok.decode(body["prompt"])
        if PROMPT not in text and COMPACTION_SYSTEM not in text and "What did we do" not in text:
            return None
        if TITLE_PROMPT in text:
            return TITLE
        return SUMMARY if COMPACTION_SYSTEM in text else next(steps)

    stub.rules.insert(0, rule)
    try:
        done = run_opencode(opencode, stub_proxy, session, workdir, MODEL, PROMPT)
    finally:
        stub.rules.remove(rule)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (workdir / "notes.txt").read_text() == DONE
    assert next(steps, None) is None  # every scripted step was asked for

    turns = stub_proxy.turns(session, expect=6)
    assert len(turns) == 6  # the title, two calls, the summary, two calls
    text = [stub.tok.decode(t["prompt_ids"]) for t in turns]
    (title_at,) = [i for i, t in enumerate(text) if TITLE_PROMPT in t]
    (summary_at,) = [i for i, t in enumerate(text) if COMPACTION_SYSTEM in t]
    conv = [i for i in range(len(turns)) if i not in (title_at, summary_at)]
    assert [turns[i]["completion_ids"] for i in conv] == [sampled(stub, s) for s in STEPS]
    assert turns[summary_at]["completion_ids"] == sampled(stub, SUMMARY)
    # It compacted after the second call, whose prompt (the read's result on top) passed the
    # usable 14000 tokens; the summary call asks for the older history (the read) as text.
    before, after = conv[1], conv[2]
    assert len(turns[before]["prompt_ids"]) >= LIMIT["context"] - LIMIT["output"]
    assert summary_at == before + 1 and COMPACTION_ASK in text[summary_at]
    assert '[Assistant tool call]: read({"filePath":"big.txt"})' in text[summary_at]
    assert "<tools>" not in text[summary_at]  # no tools offered
    # The next call: the summary where the history was, the kept bash call, then "Continue".
    resumed = text[after]
    assert "What did we do so far?" in resumed and SUMMARY in resumed and CONTINUE in resumed
    assert "line 0: the quick" not in resumed and PROMPT not in resumed
    assert resumed.index(SUMMARY) < resumed.index("wc -l notes.txt") < resumed.index(CONTINUE)
    assembly = [json.loads(turns[i]["metadata"])["assembly"] for i in conv]
    assert assembly == ["new", "extend", "rewrite", "extend"]

    threads = stub_proxy.threads(session, expect=4)
    assert len(threads) == 4, [(r["thread_kind"], r["parent_relation"]) for r in threads]
    index = {t["request_id"]: i for i, t in enumerate(turns)}
    # Each call trained in exactly one row, at its own sampled ids and the stub's logprobs
    # (nothing re-scored: no trained token's context changed); no token trained twice.
    trained: dict[int, dict[str, Any]] = {}
    for row in threads:
        for span in row["turns"]:
            if span["status"] != "trained":
                continue
            i = index[span["request_id"]]
            assert i not in trained, f"call {i} trained twice"
            trained[i] = row
            ids = turns[i]["completion_ids"]
            assert row["input_ids"][span["start"] : span["end"]] == ids
            lps = np.asarray(row["logprobs"][span["start"] : span["end"]], dtype=np.float32)
            np.testing.assert_array_equal(lps, stub_logprobs(ids))
            assert set(row["provenance"][span["start"] : span["end"]]) == {1}
    assert sorted(trained) == list(range(len(turns)))
    total = sum(sum(row["loss_mask"]) for row in threads)
    assert total == sum(len(t["completion_ids"]) for t in turns), "no token trained twice"
    for t in turns:
        np.testing.assert_array_equal(
            np.asarray(t["completion_logprobs"], dtype=np.float32),
            stub_logprobs(t["completion_ids"]),
        )

    assert trained[title_at]["thread_kind"] == trained[summary_at]["thread_kind"] == "auxiliary"
    assert {trained[i]["thread_kind"] for i in conv} == {"main"}
    main, rewritten = trained[after], trained[conv[0]]
    assert main["parent_relation"] is None and not main["dead"]
    assert rewritten["parent_relation"] == "rewritten"
    assert rewritten["parent_thread_id"] == main["thread_id"]
    # The two calls before the compaction are trained in the rewritten row, in the order they
    # were sampled; the conversation's row drops them and trains the two after it.
    status = {index[s["request_id"]]: s["status"] for s in main["turns"]}
    assert [status[i] for i in conv] == ["dropped", "dropped", "trained", "trained"]
    assert [index[s["request_id"]] for s in rewritten["turns"] if s["status"] == "trained"] == [
        conv[0], conv[1]
    ]  # fmt: skip
    assert SUMMARY in stub.tok.decode(main["input_ids"])
