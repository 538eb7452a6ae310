"""An answer with no visible output and the scaffold's request asking again (issue 40): Claude Code
re-sends its request with "[Your previous response had no visible output...]" appended to the last
user message (seen through the real CLI: tests/e2e/clis/test_claude_code_empty_retry.py). The empty
answer's row is a dead end (``dead_reason`` ``empty``) hung off the row that went on
(``parent_relation`` ``retry``), so ``to_rl_batch`` and ``main_row`` count the rollout once.
Sessions are built in-process as the gateway places them (real Qwen3 template)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from capture.storage.reader import to_rl_batch
from capture.train.rows import main_row
from capture.trajectory import ThreadRow
from capture.trajectory.commits import appends_to
from capture.trajectory.journal import call_entry, call_from_entry
from rewriter.canonical import Message
from rewriter.template import ChatTemplate
from tests.unit.trajectory.test_thread_kind import CLAUDE_SYSTEM, CLAUDE_TOOLS, Client, claude_main

NUDGE = (
    "[Your previous response had no visible output. Please continue and produce a "
    "user-visible response.]"
)
TASK = "<system-reminder>Today is Monday.</system-reminder>\nSay hello."


@pytest.fixture(scope="module")
def template(qwen3_dir: Path) -> ChatTemplate:
    return ChatTemplate(qwen3_dir)


def rows_by_call(client: Client) -> dict[str, ThreadRow]:
    rows, _ = client.threads.export()
    return {rid: r for r in rows for rid in r.trained_request_ids}


def batch_rows(rows: list[ThreadRow]) -> list[dict[str, Any]]:
    return [dataclasses.asdict(r) | {"session_id": "s", "reward": 1.0} for r in rows]


def test_an_empty_first_answer_and_its_retry_are_one_rollout(template: ChatTemplate) -> None:
    client = Client(template)
    first = [Message("system", CLAUDE_SYSTEM), Message("user", TASK)]
    empty, _ = client.call(first, "", CLAUDE_TOOLS)
    again = [Message("system", CLAUDE_SYSTEM), Message("user", TASK + "\n\n\n" + NUDGE)]
    retry, _ = client.call(again, "Hello.", CLAUDE_TOOLS)
    assert retry.retry_of is empty and retry.parent is None
    rows = rows_by_call(client)
    dead, live = rows["r0"], rows["r1"]
    assert dead.dead and dead.dead_reason == "empty" and dead.superseded_by == live.thread_id
    assert dead.parent_relation == "retry" and dead.parent_thread_id == live.thread_id
    assert not live.dead and live.parent_thread_id is None
    # Trainers see one conversation for the rollout.
    batch = to_rl_batch(batch_rows([dead, live]), pad_id=0)
    assert batch["thread_id"] == [live.thread_id]
    picked = main_row(batch_rows([dead, live]))
    assert picked is not None and picked["thread_id"] == live.thread_id


def test_an_empty_answer_after_a_tool_result(template: ChatTemplate) -> None:
    client = Client(template)
    msgs = claude_main(client)  # r0: a Write call; its result
    client.call(msgs, "", CLAUDE_TOOLS)  # r1: nothing visible
    client.call(msgs + [Message("user", NUDGE)], "Done: hello.txt holds hi.", CLAUDE_TOOLS)
    rows = rows_by_call(client)
    live = rows["r2"]
    assert rows["r0"] is live and not live.dead  # the conversation went on in the retry's row
    dead = rows["r1"]
    assert dead.dead and dead.dead_reason == "empty"
    assert (dead.parent_thread_id, dead.parent_relation) == (live.thread_id, "retry")
    assert len(to_rl_batch(batch_rows([dead, live]), pad_id=0)["thread_id"]) == 1


def test_twice_empty_both_hang_off_the_answer_that_came(template: ChatTemplate) -> None:
    client = Client(template)
    base = [Message("system", CLAUDE_SYSTEM)]
    client.call(base + [Message("user", TASK)], "", CLAUDE_TOOLS)
    client.call(base + [Message("user", TASK + "\n" + NUDGE)], "  \n", CLAUDE_TOOLS)
    client.call(base + [Message("user", TASK + "\n" + NUDGE + "\n" + NUDGE)], "Hi.", CLAUDE_TOOLS)
    rows = rows_by_call(client)
    live = rows["r2"]
    for rid in ("r0", "r1"):
        assert rows[rid].dead_reason == "empty" and rows[rid].superseded_by == live.thread_id
        assert rows[rid].parent_thread_id == live.thread_id
    assert not live.dead


def test_what_is_not_a_retry_of_an_empty_answer(template: ChatTemplate) -> None:
    client = Client(template)
    base = [Message("system", CLAUDE_SYSTEM)]
    client.call(base + [Message("user", TASK)], "", CLAUDE_TOOLS)
    # Another task, not the same request with text appended: a conversation of its own.
    other, _ = client.call(base + [Message("user", "Say goodbye.")], "Bye.", CLAUDE_TOOLS)
    assert other.retry_of is None
    # An answer with text is not an empty one, whatever follows it.
    client.call(base + [Message("user", "Count.")], "1 2 3", CLAUDE_TOOLS)
    counted, _ = client.call(base + [Message("user", "Count.\nmore")], "4", CLAUDE_TOOLS)
    assert counted.retry_of is None
    assert not any(r.dead for r in client.threads.export()[0])
    # The rule itself: one message's text extended, or messages (not replies) added at the end.
    sys_, user = ("system", "s"), ("user", "hi")
    assert appends_to([sys_, user], [sys_, ("user", "hi\nnudge")])
    assert appends_to([sys_, user], [sys_, user, ("user", "nudge")])
    assert not appends_to([sys_, user], [sys_, user])  # the same request: a plain resend
    assert not appends_to([sys_, user], [sys_, ("user", "ho")])
    assert not appends_to([sys_, user], [("system", "s2"), ("user", "hi\nnudge")])
    assert not appends_to([sys_, user], [sys_, user, ("assistant", "x", ())])


def test_the_link_survives_the_journal(template: ChatTemplate) -> None:
    client = Client(template)
    base = [Message("system", CLAUDE_SYSTEM)]
    empty, _ = client.call(base + [Message("user", TASK)], "", CLAUDE_TOOLS)
    retry, _ = client.call(base + [Message("user", TASK + "\n" + NUDGE)], "Hi.", CLAUDE_TOOLS)
    entry = call_entry(retry)
    assert entry["retry_of"] == empty.request_id

    class Turn:  # what call_from_entry reads of a journaled turn record
        request_id, turn_index, finish_reason, latency_s, backend = "r1", 1, "stop", 0.1, "b"
        prompt_ids = retry.prompt_ids or []
        completion_ids = retry.sampled_ids
        completion_logprobs = retry.sampled_logprobs
        weight_versions: list[dict[str, Any]] = []

    rebuilt = call_from_entry(Turn(), entry, {empty.request_id: empty})  # type: ignore[arg-type]
    assert rebuilt.retry_of is empty
