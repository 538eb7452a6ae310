"""The viewer's data (capture/viewer.py): sessions, the row tree, token pages, call lists and
diffs, over shards written with the proxy's own writer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from capture import viewer
from capture.rewards import write_rewards
from capture.viewer import ShardSource
from tests.viewer_data import REMINDER, write_agent_session, write_long_session


@pytest.fixture
def out(tmp_path: Path, tok: Any) -> Path:
    write_agent_session(tmp_path, tok)
    write_long_session(tmp_path, tokens=30_000)
    return tmp_path


def test_sessions_list_rows_calls_tokens_reward_metadata(out: Path) -> None:
    sessions = {s["id"]: s for s in viewer.session_list(ShardSource(out).summaries())}
    agent = sessions["agent-1"]
    assert agent["rows"] == 4 and agent["dead_rows"] == 1
    assert agent["calls"] == 5  # every row trains its own calls once
    assert agent["reward"] == 1.0 and agent["end_reason"] == "stop"
    assert agent["metadata"] == {"task_id": "swe-42", "group_id": "g-7", "split": "train"}
    assert sessions["long-1"]["tokens"] == 30_000
    assert sessions["long-1"]["trained_tokens"] == 1500 and not sessions["long-1"]["live"]


def test_a_late_reward_shows_once_written(out: Path) -> None:
    source = ShardSource(out)
    assert {s["id"]: s["reward"] for s in viewer.session_list(source.summaries())}["long-1"] == 0.5
    write_rewards(out, "long-1", -2.0)
    assert {s["id"]: s["reward"] for s in viewer.session_list(source.summaries())}["long-1"] == -2.0
    assert source.threads("long-1")[0]["reward"] == -2.0


def test_live_sessions_are_listed_before_they_have_rows(out: Path) -> None:
    live = {"fresh": {"metadata": {"task_id": "t9"}, "closed": False, "metrics": {"calls": 0}}}
    sessions = {s["id"]: s for s in viewer.session_list(ShardSource(out).summaries(), live)}
    assert sessions["fresh"]["live"] and sessions["fresh"]["rows"] == 0
    assert sessions["fresh"]["metadata"] == {"task_id": "t9"}


def test_the_tree_hangs_branches_spawns_and_rewrites_off_their_parent(out: Path) -> None:
    roots = viewer.row_tree(ShardSource(out).threads("agent-1"))
    assert [r["thread_id"] for r in roots] == ["t-req-1"]
    children = {c["thread_id"]: c for c in roots[0]["children"]}
    assert children["t-req-0b"]["dead"] and children["t-req-0b"]["parent_relation"] == "branch"
    assert children["t-req-sub"]["parent_relation"] == "spawn"
    assert children["t-req-sub"]["parent_tool_call_id"] == "call_abc"
    assert children["t-req-2"]["parent_relation"] == "rewritten"
    assert [t["request_id"] for t in roots[0]["turns"]] == ["req-0", "req-1"]


def test_a_page_of_tokens_is_decoded_with_mask_provenance_and_logprobs(out: Path, tok: Any) -> None:
    row = next(r for r in ShardSource(out).threads("agent-1") if r["thread_id"] == "t-req-1")
    decode = viewer.tokenizer_decoder(tok)
    page = viewer.token_page(row, decode, 0, 10_000)
    assert page["total"] == len(row["input_ids"]) == len(page["text"])
    # Decoded token by token, the pieces are the row's text.
    assert "".join(page["text"]) == tok.decode(row["input_ids"])
    start, end = row["turns"][0]["start"], row["turns"][0]["end"]
    assert "".join(page["text"][start:end]).startswith("<tool_call>")
    assert page["provenance"][start:end] == [1] * (end - start)
    assert page["loss_mask"][start - 1] == 0 and page["loss_mask"][start] == 1
    assert page["logprobs"][start] == pytest.approx(row["logprobs"][start], abs=1e-5)
    second = viewer.token_page(row, decode, 5, 3)
    assert second["ids"] == row["input_ids"][5:8] and second["offset"] == 5
    with pytest.raises(ValueError, match="offset"):
        viewer.token_page(row, decode, len(row["input_ids"]) + 1, 10)
    with pytest.raises(ValueError, match="limit"):
        viewer.token_page(row, decode, 0, viewer.MAX_PAGE_TOKENS + 1)
    overview = viewer.row_overview(row)
    assert overview["trained"] == sum(row["loss_mask"]) and overview["provenance"]["stale"] == 0


def test_without_a_tokenizer_tokens_show_as_ids(out: Path) -> None:
    row = ShardSource(out).threads("long-1")[0]
    page = viewer.token_page(row, viewer.ids_only, 0, 3)
    assert page["text"] == [f"⟨{i}⟩" for i in row["input_ids"][:3]]


def test_calls_carry_the_tool_calls_the_client_was_given(out: Path) -> None:
    calls = viewer.call_list(ShardSource(out).turns("agent-1"))
    assert [c["request_id"] for c in calls] == ["req-0", "req-1", "req-2", "req-0b", "req-sub"]
    first = calls[0]
    assert first["tool_calls"] == [{"name": "read_file", "arguments": '{"path": "src/app.py"}'}]
    assert first["response_finish_reason"] == "tool_calls" and calls[1]["tool_calls"] == []


def test_the_diff_of_two_calls_shows_what_the_scaffold_rewrote(out: Path, tok: Any) -> None:
    turns = {t["request_id"]: t for t in ShardSource(out).turns("agent-1")}
    decode = viewer.tokenizer_decoder(tok)
    extended = viewer.diff_calls(turns["req-0"], turns["req-1"], decode)
    assert extended["extends"] and [o["op"] for o in extended["ops"]] == ["equal", "insert"]
    assert "<tool_response>" in extended["ops"][1]["b"]["text"]
    rewritten = viewer.diff_calls(turns["req-1"], turns["req-2"], decode)
    assert not rewritten["extends"]
    added = "".join(o["b"]["text"] for o in rewritten["ops"] if "b" in o)
    assert REMINDER in added and "Thanks" in added
    assert rewritten["kept"] == len(turns["req-1"]["prompt_ids"]) + len(
        turns["req-1"]["completion_ids"]
    )


def test_a_long_diff_shortens_what_is_unchanged(out: Path) -> None:
    turns = ShardSource(out).turns("long-1")
    d = viewer.diff_calls(turns[0], turns[1], viewer.ids_only)
    equal = d["ops"][0]
    assert equal["op"] == "equal" and equal["a"]["elided"] == equal["a"]["tokens"] - 80
    assert d["extends"]


def test_the_source_sees_new_shards(out: Path, tok: Any) -> None:
    source = ShardSource(out)
    before = {s["id"] for s in viewer.session_list(source.summaries())}
    write_agent_session(out, tok, sid="agent-2")
    after = {s["id"] for s in viewer.session_list(source.summaries())}
    assert after - before == {"agent-2"}
    assert len(source.threads("agent-2")) == 4
