"""Sessions nobody can claim early, and rewards nobody replaces silently (issue 37, item 5):
opening an id starts it empty, what calls made under it before recorded stays apart under a name
of its own (``ID~unopened-HEX``), a call that straddles the opening is not recorded, and rows say
where their reward came from (``reward_source``), a void entry taking every earlier one back.
In-process: a real Gateway's store and control API, real Parquet files, no sockets."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from capture.control.api import ControlAPI
from capture.control.endpoints import Endpoints
from capture.control.sessions import KEPT_APART, SessionControl, parse_limits
from capture.gateway import Gateway, GatewayConfig
from capture.storage.reader import load_threads
from capture.storage.records import TurnRecord
from capture.storage.rewards import (
    REWARDS_DIR,
    VOID,
    join_rewards,
    load_rewards,
    void_rewards,
    write_rewards,
)
from capture.storage.sessions import SessionStore, take_back_rewards
from capture.storage.shards import write_table
from rewriter.canonical import ChatRequest, Message
from rewriter.template import ChatTemplate


def call(
    store: SessionStore,
    sid: str,
    rid: str,
    text: str,
    started: float | None = None,
    history: list[Message] | None = None,
) -> None:
    """One recorded chat call of ``sid`` (``history`` then the user's ``text``), begun at
    ``started`` (default: now)."""
    template = store.renderer
    assert isinstance(template, ChatTemplate)
    messages = [*(history or []), Message("user", text)]
    assembly = store.assemble(sid, ChatRequest(messages, "m"))
    ids = template.encode(f"answer to {text}") + [template.eos_token_id]
    turn = TurnRecord(
        session_id=sid, request_id=rid, turn_index=store.next_turn_index(sid), protocol="openai",
        requested_model="m", policy_model="p", backend="b", user_agent="ua",
        prompt_ids=assembly.prompt_ids, completion_ids=ids, completion_logprobs=[-0.5] * len(ids),
        finish_reason="stop", response_finish_reason="stop",
        started_at=time.time() if started is None else started, latency_s=0.1, stream=False,
    )  # fmt: skip
    store.record(turn, assembly, Message("assistant", f"answer to {text}"))


@pytest.fixture
def gateway(tmp_path: Path, qwen3_dir: Path) -> tuple[Gateway, ControlAPI]:
    gw = Gateway(GatewayConfig(["http://127.0.0.1:9"], qwen3_dir, tmp_path))
    api = ControlAPI(gw, "t" * 32, Endpoints("http://127.0.0.1:1", "", "/ca.pem"))
    return gw, api


def test_opening_an_id_starts_it_empty_and_keeps_the_earlier_one_apart() -> None:
    control = SessionControl()
    claims: list[tuple[str, str]] = []
    control.on_claim = lambda sid, apart: claims.append((sid, apart))
    # An agent calls an id nobody opened yet (no secret needed: proxy mode's own sessions).
    assert control.credential_refusal("grpo-step-2-0", []) is None
    assert control.refusal("grpo-step-2-0") is None
    control.call_started("grpo-step-2-0")
    control.note_recorded("grpo-step-2-0", 5, 7, 0.1)
    before = time.time()
    sess = control.open("grpo-step-2-0", {"group_id": "grpo-step-2"}, parse_limits({}))
    # The opened session is new: no calls of the earlier one, its in-flight call still counted
    # in flight (so no limit lets more through), and it wants its secret from now on.
    assert sess.metrics.calls == 0 and sess.in_flight == 1 and sess.opened
    assert sess.claimed_at is not None and sess.claimed_at >= before
    assert control.claimed_at("grpo-step-2-0") == sess.claimed_at
    assert control.credential_refusal("grpo-step-2-0", []) is not None
    assert control.credential_refusal("grpo-step-2-0", [], required=False) is not None
    # The earlier one lives on under a name of its own, its metrics intact, never opened.
    ((sid, apart),) = claims
    assert sid == "grpo-step-2-0" and apart.startswith("grpo-step-2-0" + KEPT_APART)
    earlier = control.get(apart)
    assert earlier is not None and earlier.metrics.calls == 1 and not earlier.opened
    assert earlier.metadata == {}
    # The straddling call ends: the store did not record it, so it is not counted either.
    control.note_dropped("grpo-step-2-0")
    control.note_recorded("grpo-step-2-0", 5, 7, 0.1)
    control.call_finished("grpo-step-2-0")
    assert sess.metrics.calls == 0 and sess.in_flight == 0
    control.note_recorded("grpo-step-2-0", 5, 7, 0.1)  # its own call counts
    assert sess.metrics.calls == 1
    # A session opened with nothing before it claims nothing: nothing of it is ever dropped.
    assert control.open("fresh").claimed_at is None and control.claimed_at("fresh") is None
    assert control.claimed_at("never-opened") is None


def test_rows_recorded_before_the_open_never_join_the_opened_session(
    gateway: tuple[Gateway, ControlAPI], tmp_path: Path
) -> None:
    gw, api = gateway
    store, control = gw.store, gw.control
    sid = "grpo-step-2-0"
    # Planted before the open: one call written by an idle flush, one still pending.
    call(store, sid, "planted-1", "plant one")
    assert control.refusal(sid) is None
    store.end_session(sid, keep_threads=True, why="idle")
    call(store, sid, "planted-2", "plant two")
    straddling = time.time()  # a call that begins now and ends after the open
    control.open(sid, {"group_id": "grpo-step-2"})
    apart = next(s.id for s in control._past.values() if s.id.startswith(sid + KEPT_APART))
    # The earlier rows are written (and the written shard rewritten) under the other name.
    turns = pq.read_table(tmp_path / "turns").to_pylist()
    assert {t["request_id"]: t["session_id"] for t in turns} == {
        "planted-1": apart, "planted-2": apart,
    }  # fmt: skip
    threads = load_threads(tmp_path)
    assert {r["session_id"] for r in threads} == {apart}
    assert all(r["metadata"] is None and r["reward"] is None for r in threads)
    assert store.written_threads(sid) == [] and len(store.written_threads(apart)) == 2
    # The straddling call ends now: not recorded anywhere.
    call(store, sid, "straddling", "plant three", started=straddling)
    assert store.pending_rows(sid) == []
    # The opened session's own call starts a tree of its own: the conversation it continues
    # is the planted call's, but no planted thread is extended (its tokens not trained here).
    planted = [Message("user", "plant one"), Message("assistant", "answer to plant one")]
    call(store, sid, "own", "go on", history=planted)
    closed = asyncio.run(api.close_session(sid, 1.0, reward_source="verifier"))
    assert closed is not None
    _, rows, _ = closed
    assert [r["trained_request_ids"] for r in rows] == [["own"]]
    assert rows[0]["num_turns"] == 1 and rows[0]["loss_mask"][: len(threads[0]["input_ids"])] == (
        [0] * len(threads[0]["input_ids"])
    )
    assert (rows[0]["reward"], rows[0]["reward_source"]) == (1.0, "verifier")
    assert json.loads(rows[0]["metadata"]) == {"group_id": "grpo-step-2"}
    read = {r["session_id"]: r for r in load_threads(tmp_path) if r["session_id"] == sid}
    assert read[sid]["trained_request_ids"] == ["own"] and read[sid]["reward"] == 1.0
    # A late reward for the opened session never reaches the rows kept apart.
    write_rewards(tmp_path, sid, 0.25)
    by_session = {
        (r["session_id"], r["reward"], r["reward_source"]) for r in load_threads(tmp_path)
    }
    assert by_session == {(sid, 0.25, "late"), (apart, None, None)}


def test_reward_source_says_close_verifier_or_late_and_a_void_takes_all_back(
    gateway: tuple[Gateway, ControlAPI], tmp_path: Path
) -> None:
    gw, api = gateway
    store = gw.store
    for sid in ("by-close", "by-verifier"):
        gw.control.open(sid)
        call(store, sid, f"{sid}-1", "one")
        store.end_session(sid, keep_threads=True, why="flush")  # written before the close
        call(store, sid, f"{sid}-2", "two")
    asyncio.run(api.close_session("by-close", 2.0))
    asyncio.run(api.close_session("by-verifier", 1.0, reward_source="verifier"))
    got = {(r["session_id"], r["reward"], r["reward_source"]) for r in load_threads(tmp_path)}
    assert got == {("by-close", 2.0, "close"), ("by-verifier", 1.0, "verifier")}
    # Unjoined, the rows written at the close say so themselves; those written before get it
    # from the close's own late-reward file.
    raw = load_threads(tmp_path, rewards=False)
    assert {(r["trained_request_ids"][0], r["reward"], r["reward_source"]) for r in raw} == {
        ("by-close-1", None, None), ("by-close-2", 2.0, "close"),
        ("by-verifier-1", None, None), ("by-verifier-2", 1.0, "verifier"),
    }  # fmt: skip
    # A late reward, then a void: nothing of either reaches a row; a reward after it does.
    write_rewards(tmp_path, "by-close", 5.0)
    void_rewards(tmp_path, "by-close")
    rows = [r for r in load_threads(tmp_path) if r["session_id"] == "by-close"]
    assert [(r["reward"], r["reward_source"]) for r in rows] == [(None, None)] * 2
    write_rewards(tmp_path, "by-close", 3.0)
    rows = [r for r in load_threads(tmp_path) if r["session_id"] == "by-close"]
    assert [(r["reward"], r["reward_source"]) for r in rows] == [(3.0, "late")] * 2
    with pytest.raises(ValueError, match="source must be one of"):
        write_rewards(tmp_path, "x", 1.0, source="agent")


def test_take_back_rewards_rewrites_the_shards_of_a_session(
    gateway: tuple[Gateway, ControlAPI], tmp_path: Path
) -> None:
    """A rollout whose session a token holder closed with reward 42: the shards themselves
    hold no reward afterwards, and no late reward set before is joined."""
    gw, api = gateway
    store = gw.store
    began = time.time()
    for sid in ("r-0", "r-0x"):  # another session whose name starts the same is left alone
        gw.control.open(sid)
        call(store, sid, f"{sid}-a", "one")
        store.end_session(sid, keep_threads=True, why="flush")
        call(store, sid, f"{sid}-b", "two")
        asyncio.run(api.close_session(sid, 42.0))
    write_rewards(tmp_path, "r-0", 43.0)
    rows = take_back_rewards(tmp_path, "r-0", since=began - 1)
    assert sorted(r["trained_request_ids"][0] for r in rows) == ["r-0-a", "r-0-b"]
    assert all(r["reward"] is None and r["reward_source"] is None for r in rows)
    raw = {r["trained_request_ids"][0]: r["reward"] for r in load_threads(tmp_path, rewards=False)}
    assert raw == {"r-0-a": None, "r-0-b": None, "r-0x-a": None, "r-0x-b": 42.0}
    joined = {r["trained_request_ids"][0]: r["reward"] for r in load_threads(tmp_path)}
    assert joined == {"r-0-a": None, "r-0-b": None, "r-0x-a": 42.0, "r-0x-b": 42.0}
    # Shards older than ``since`` (an earlier session under the same id) are not touched.
    assert take_back_rewards(tmp_path, "r-0x", since=time.time() + 60) == []


def test_reward_files_written_before_the_source_column_are_late(tmp_path: Path) -> None:
    old = pa.table(
        {
            "session_id": ["s"],
            "thread_id": pa.array([None], pa.string()),
            "reward": [0.5],
            "set_at": [1.0],
        }
    )
    # Listed in the index as write_rewards would (only such files count).
    path = write_rewards(tmp_path, "other", 1.0)
    write_table(path.parent, old, name=path.name)
    index = tmp_path / REWARDS_DIR / "_index.jsonl"
    import hashlib

    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    index.write_text(json.dumps({"name": path.name, "sha256": digest}) + "\n")
    table = load_rewards(tmp_path)
    assert table.to_pylist() == [
        {"session_id": "s", "thread_id": None, "reward": 0.5, "set_at": 1.0, "source": None}
    ]
    (row,) = join_rewards([{"session_id": "s", "thread_id": "t", "reward": None}], table)
    assert (row["reward"], row["reward_source"]) == (0.5, "late")
    # An entry without a reward is ignored, unless it is a void: that one wins.
    entries = [{"session_id": "s", "thread_id": None, "reward": None, "set_at": 2.0,
                "source": "late"}, {"session_id": "s", "thread_id": None, "reward": None,
                "set_at": 3.0, "source": VOID}]  # fmt: skip
    (row,) = join_rewards([{"session_id": "s", "thread_id": "t", "reward": 9.0}], entries)
    assert row["reward"] is None


def test_a_busy_session_is_kept_apart_and_written_by_the_idle_sweep(
    tmp_path: Path, qwen3_dir: Path
) -> None:
    """A worker thread placing a call in the tree when the id is opened: nothing is written
    then (the tree is in use), the calls wait under their new name for the idle sweep."""
    store = SessionStore(tmp_path, ChatTemplate(qwen3_dir), idle_timeout_s=60)
    call(store, "busy", "early", "one")
    assert store.detach("busy", "busy~unopened-1", write=False) == 1
    assert store.session_ids() == ["busy~unopened-1"] and not (tmp_path / "threads").exists()
    assert store.flush_idle() == []  # not idle yet: the worker may still be at work
    written = store.flush_idle(now=time.monotonic() + 61)
    assert written and {r["session_id"] for r in load_threads(tmp_path)} == {"busy~unopened-1"}
