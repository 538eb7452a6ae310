"""The scripted task the scaffold tests (OpenCode, mini-swe-agent) give a real agent: read a
file, run a command, edit the file, finish, each step a tool call the stub policy answers in the
Qwen3 template's hermes format; and the checks on the rows it leaves.

The seed is ``notes.txt`` holding ``alpha`` and ``beta``; the task replaces ``beta`` with
``gamma``; ``VERIFIER`` prints 1 when it was done, else 0.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from tests.e2e.providers.test_anthropic_sdk_stub import hermes
from tests.e2e.providers.test_conservation_e2e import conservation
from tests.support.paths import IM_END
from tests.support.proxies import Proxy
from tests.support.stub_vllm import StubPolicy

TASK = "In notes.txt replace the word beta with gamma"
SEED = "alpha\nbeta\n"
DONE = "alpha\ngamma\n"
# Its last line is the reward (capture/rollouts/runner.py).
VERIFIER = [
    "sh",
    "-c",
    'echo checking; if [ "$(cat notes.txt)" = "$(printf \'alpha\\ngamma\')" ]; then echo 1; else echo 0; fi',
]


# OpenCode's tools: read and edit take a file path (a relative one is resolved in its working
# directory), bash a command and a description.
OPENCODE_STEPS = [
    "I'll read the notes first.\n" + hermes("read", {"filePath": "notes.txt"}),
    hermes("bash", {"command": "wc -l notes.txt", "description": "Count the lines"}),
    hermes("edit", {"filePath": "notes.txt", "oldString": "beta", "newString": "gamma"}),
    "Replaced beta with gamma in notes.txt.",
]
# mini-swe-agent has one tool, bash; it finishes when the command echoes its submit word.
MINI_STEPS = [
    "Let me read the notes.\n" + hermes("bash", {"command": "cat notes.txt"}),
    "Count the lines.\n" + hermes("bash", {"command": "wc -l notes.txt"}),
    "Now the edit.\n" + hermes("bash", {"command": "sed -i 's/beta/gamma/' notes.txt"}),
    "Done.\n" + hermes("bash", {"command": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"}),
]
# OpenCode's side call: a title for the session, from a system prompt of its own, no tools.
TITLE_PROMPT = "You are a title generator"
TITLE = "Notes word swap"


def seed(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "notes.txt").write_text(SEED)
    return folder


def step_rule(stub: StubPolicy, steps: list[str]) -> Callable[[dict[str, Any]], str | None]:
    """Answers this task's calls by how far the conversation got (the tool results in its
    prompt), so parallel rollouts each get the whole script; OpenCode's title call gets a
    title. Other tests' calls are left to their own scripts."""

    def rule(body: dict[str, Any]) -> str | None:
        text = stub.tok.decode(body["prompt"])
        if TASK not in text:
            return None
        if TITLE_PROMPT in text:
            return TITLE
        return steps[min(text.count("<tool_response>"), len(steps) - 1)]

    return rule


def sampled(stub: StubPolicy, text: str) -> list[int]:
    """The ids the stub samples for ``text``: its tokens and the end of turn."""
    return list(stub.tok.encode(text, add_special_tokens=False)) + [IM_END]


def stub_logprobs(ids: list[int]) -> np.ndarray:
    return np.asarray([StubPolicy._logprob_of(i, t) for i, t in enumerate(ids)], dtype=np.float32)


def check_trained_exactly_once(
    threads: list[dict[str, Any]], turns: list[dict[str, Any]]
) -> dict[str, str]:
    """Every call trained in exactly one row, at the stub's own ids and logprobs, sampled
    (nothing re-scored); request id -> the thread that trains it."""
    where = conservation(threads, turns)
    by_request = {t["request_id"]: t for t in turns}
    for turn in turns:
        np.testing.assert_array_equal(
            np.asarray(turn["completion_logprobs"], dtype=np.float32),
            stub_logprobs(turn["completion_ids"]),
        )
    for row in threads:
        for span in row["turns"]:
            if span["status"] != "trained":
                continue
            call = by_request[span["request_id"]]
            got = np.asarray(row["logprobs"][span["start"] : span["end"]], dtype=np.float32)
            np.testing.assert_array_equal(got, stub_logprobs(call["completion_ids"]))
            assert set(row["provenance"][span["start"] : span["end"]]) == {1}, "not re-scored"
    return where


def check_one_conversation(
    proxy: Proxy, stub: StubPolicy, session: str, steps: list[str], protocol: str
) -> list[dict[str, Any]]:
    """A scaffold's run of ``steps`` (the stub's scripted answers, in order) left one live
    ``main`` row: a call per step over ``protocol``, each extending the last, each trained once
    at the stub's ids and logprobs; the calls' turns."""
    turns = proxy.turns(session, expect=len(steps))
    rows = proxy.threads(session, expect=1)
    check_trained_exactly_once(rows, turns)
    assert [(r["thread_kind"], r["num_turns"], r["dead"]) for r in rows] == [
        ("main", len(steps), False)
    ]
    assert {t["protocol"] for t in turns} == {protocol}
    assembly = [json.loads(t["metadata"])["assembly"] for t in turns]
    assert assembly == ["new"] + ["extend"] * (len(steps) - 1)
    assert [t["completion_ids"] for t in turns] == [sampled(stub, s) for s in steps]
    return turns
