"""Issue 38 item 6, in the store: a session written while one of its calls is in flight. The call
was placed in the session's tree before the write; when it ends it must be committed to that
very tree (or, where the tree was let go, to a tree of its own), never to a fresh tree that
numbers its calls anew: rows would then put a call's span where another call's tokens are.
Every call is trained exactly once, at its own ids (tests/e2e/ops/test_flush_race.py: the same
through a real mitmdump, under load)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from capture.storage.records import TurnRecord
from capture.storage.sessions import SessionStore
from capture.trajectory import Assembly
from rewriter.canonical import ChatRequest, Message
from rewriter.template import ChatTemplate
from tests.support.proxies import read_threads, read_turns

SYSTEM = Message("system", "You are a careful agent.")


@pytest.fixture(scope="module")
def template(qwen3_dir: Path) -> ChatTemplate:
    return ChatTemplate(qwen3_dir)


def chat(*messages: Message) -> ChatRequest:
    return ChatRequest(model="m", messages=list(messages))


def finish(store: SessionStore, assembly: Assembly, rid: str, ids: list[int], text: str) -> None:
    """Record call ``rid`` answering ``ids`` (logprobs -ids/1000), as the gateway would after
    vLLM answered the prompt ``assembly`` was made for."""
    record = TurnRecord(
        session_id="s", request_id=rid, turn_index=store.next_turn_index("s"),
        protocol="openai.chat", requested_model="m", policy_model="p", backend="b",
        user_agent="ua", prompt_ids=assembly.prompt_ids, completion_ids=ids,
        completion_logprobs=[-i / 1000 for i in ids], finish_reason="stop",
        response_finish_reason="stop", started_at=0.0, latency_s=0.1, stream=False,
    )  # fmt: skip
    store.record(record, assembly, Message("assistant", text))


def trained_once(rows: list[dict[str, Any]], turns: list[dict[str, Any]]) -> dict[str, str]:
    """Each call trained in exactly one row, at a span holding its ids and logprobs, and no
    other token trained; request id -> that row's thread id."""
    calls = {t["request_id"]: t for t in turns}
    where: dict[str, str] = {}
    for row in rows:
        covered = [False] * len(row["input_ids"])
        for span in row["turns"]:
            call = calls[span["request_id"]]
            start, end = span["start"], span["end"]
            assert row["input_ids"][start:end] == call["completion_ids"], (row["thread_id"], span)
            if span["status"] == "trained":
                assert span["request_id"] not in where, f"{span['request_id']} trained twice"
                where[span["request_id"]] = row["thread_id"]
                expected = call["completion_logprobs"]
                assert row["logprobs"][start:end] == pytest.approx(expected, abs=1e-6)
                covered[start:end] = [True] * (end - start)
        assert all(c for c, m in zip(covered, row["loss_mask"], strict=True) if m), row["turns"]
    assert set(where) == set(calls)
    return where


@pytest.mark.parametrize("write", ["flush", "idle"])
def test_a_write_with_nothing_new_keeps_the_tree_a_call_in_flight_was_placed_in(
    template: ChatTemplate, tmp_path: Path, write: str
) -> None:
    """Two conversations answered and written; A's next call is placed (in flight), and the
    session is written again with nothing new to write (the trainer's flush, or the idle
    sweep). B's next call and then A's end: both extend their conversations' exact ids, in rows
    continuing the rows written before, every call trained once."""
    store = SessionStore(tmp_path, template)

    def written() -> None:
        if write == "flush":
            store.flush("s")
        else:
            store.end_session("s", keep_threads=True, why="idle")

    a = [SYSTEM, Message("user", "Rename the config file.")]
    b = [SYSTEM, Message("user", "Delete the temp folder.")]
    finish(store, store.assemble("s", chat(*a)), "a1", [11, 12, 13], "Renamed.")
    finish(store, store.assemble("s", chat(*b)), "b1", [21, 22], "Deleted.")
    written()
    a += [Message("assistant", "Renamed."), Message("user", "And the backup.")]
    in_flight = store.assemble("s", chat(*a))
    assert in_flight.parent is not None and in_flight.parent.request_id == "a1"
    written()  # nothing new: before the fix, the session's tree was let go here
    b += [Message("assistant", "Deleted."), Message("user", "Also the cache.")]
    b2 = store.assemble("s", chat(*b))
    assert b2.kind == "extend" and b2.parent is not None and b2.parent.request_id == "b1"
    finish(store, b2, "b2", [31, 32, 33, 34], "Cache gone.")
    finish(store, in_flight, "a2", [41, 42], "Backup renamed.")
    written()

    turns = read_turns(tmp_path, "s")
    rows = read_threads(tmp_path, "s")
    assert [t["turn_index"] for t in turns] == [0, 1, 2, 3]
    where = trained_once(rows, turns)
    by_id = {row["thread_id"]: row for row in rows}
    for later, earlier in (("a2", "a1"), ("b2", "b1")):
        row = by_id[where[later]]
        assert (row["parent_thread_id"], row["parent_relation"]) == (where[earlier], "continued")
        assert [s["request_id"] for s in row["turns"]] == [earlier, later]


def test_a_call_that_ends_after_its_session_was_closed_is_trained_once_in_a_tree_of_its_own(
    template: ChatTemplate, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A conversation of four calls; its fifth is placed, and the session is closed (its tree
    let go) before that call ends. Committed to the session's next tree, whose calls are
    numbered from 0 again, it would share a number with the first call of its own history
    (which would be trained a second time, at the fifth call's span). It starts a tree of its
    own instead: trained once, at its ids, its history context."""
    store = SessionStore(tmp_path, template)
    messages = [SYSTEM, Message("user", "Fix the failing test.")]
    for k in range(4):
        text = f"Step {k} done."
        finish(store, store.assemble("s", chat(*messages)), f"r{k}", [100 + k, 200 + k], text)
        messages += [Message("assistant", text), Message("user", "Go on.")]
    in_flight = store.assemble("s", chat(*messages))
    assert in_flight.parent is not None and in_flight.parent.request_id == "r3"
    store.end_session("s", why="close")
    with caplog.at_level(logging.WARNING):
        finish(store, in_flight, "r4", [301, 302, 303], "All fixed.")
    assert "ended after the tree it was placed in was written and let go" in caplog.text
    next_call = messages + [Message("assistant", "All fixed."), Message("user", "Thanks.")]
    after = store.assemble("s", chat(*next_call))
    assert after.parent is not None and after.parent.request_id == "r4", "its tree goes on"
    store.end_session("s", why="stop")

    turns = read_turns(tmp_path, "s")
    rows = read_threads(tmp_path, "s")
    where = trained_once(rows, turns)
    late = next(row for row in rows if row["thread_id"] == where["r4"])
    assert late["trained_request_ids"] == ["r4"]
    assert late["input_ids"] == in_flight.prompt_ids + [301, 302, 303]
    assert sum(late["loss_mask"]) == 3, "the history in its prompt is context"
