"""Compact storage (issue 19, item 5): agent-like sessions (long growing prompts, logprobs) take
at most 16 bytes per thread token in their journal at its peak and in their shards, read back
exactly the rows the process held, and recover from the compact journal exactly."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.dataset as ds
import pytest

from capture.storage import journal_lines
from capture.storage.reader import load_threads
from capture.storage.records import TurnRecord
from capture.storage.rows import turn_row
from capture.storage.sessions import SessionStore
from capture.storage.shards import THREAD_SCHEMA, TURN_SCHEMA, rows_to_table
from rewriter.template import ChatTemplate
from tests.support.agent_sessions import Script, build, corpus, record

BYTES_PER_TOKEN = 16


@pytest.fixture(scope="module")
def template(qwen3_dir: Path) -> ChatTemplate:
    return ChatTemplate(qwen3_dir)


@pytest.fixture(scope="module")
def scripts(template: ChatTemplate) -> list[Script]:
    text = corpus()
    return [build(template, text, f"agent{i}", 40, 12_000, seed=i) for i in range(2)]


def _table(folder: Path, keys: list[str]) -> pa.Table:
    table = ds.dataset(str(folder), format="parquet").to_table()
    return table.sort_by([(k, "ascending") for k in keys])


KEYS = {"turns": ["session_id", "turn_index"], "threads": ["session_id", "thread_id"]}


def _write(template: ChatTemplate, scripts: list[Script], out: Path, kept: Path) -> dict:
    """Record and write every session; the journals at their peak are copied to ``kept``."""
    store = SessionStore(out, template)
    turns: list[TurnRecord] = []
    rows: list[dict] = []
    journal_bytes = 0
    for script in scripts:
        record(store, script)
        turns += store._sessions[script.session_id].turns
        (journal,) = (out / "journal").glob(f"{script.session_id}-*.jsonl")
        journal_bytes += journal.stat().st_size
        kept.mkdir(parents=True, exist_ok=True)
        shutil.copy(journal, kept / journal.name)
        store.end_session(script.session_id, rows_out=rows)
    return {"turns": turns, "rows": rows, "journal_bytes": journal_bytes}


def test_agent_sessions_are_compact_and_read_back_identically(
    template: ChatTemplate, scripts: list[Script], tmp_path: Path
) -> None:
    got = _write(template, scripts, tmp_path / "out", tmp_path / "crash" / "journal")
    # Every column, as the process held the rows (logprobs as the float32 the schema says).
    expected = {
        "turns": rows_to_table([turn_row(t) for t in got["turns"]], TURN_SCHEMA),
        "threads": rows_to_table(got["rows"], THREAD_SCHEMA),
    }
    for name, keys in KEYS.items():
        table = _table(tmp_path / "out" / name, keys)
        assert table.equals(expected[name].sort_by([(k, "ascending") for k in keys])), name
    threads = expected["threads"].to_pylist()
    loaded = load_threads(tmp_path / "out")
    assert sorted(loaded, key=lambda r: r["thread_id"]) == sorted(
        threads, key=lambda r: r["thread_id"]
    )
    assert any(r["dead"] for r in threads)  # the resent request left a dead row
    assert any(r["num_turns"] >= 39 for r in threads)
    # Bytes per token: bytes on disk / tokens of the thread rows (docs/SHARDS.md, "Storage").
    tokens = sum(len(r["input_ids"]) for r in threads)
    assert tokens > 20_000
    shards = sum(p.stat().st_size for p in (tmp_path / "out").glob("*/*.parquet"))
    assert got["journal_bytes"] / tokens <= BYTES_PER_TOKEN, got["journal_bytes"] / tokens
    assert shards / tokens <= BYTES_PER_TOKEN, shards / tokens
    # A kill -9 at the peak: the journals alone give the same shards.
    SessionStore(tmp_path / "crash", template).recover()
    for name, keys in KEYS.items():
        assert _table(tmp_path / "crash" / name, keys).equals(
            _table(tmp_path / "out" / name, keys)
        ), name


def test_journals_of_json_lists_still_recover(
    template: ChatTemplate, scripts: list[Script], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A journal left by a version before the compact lines (every array a JSON list, every
    prompt whole) recovers to the same shards."""
    monkeypatch.setattr(journal_lines, "COMPACT", False)
    _write(template, scripts[:1], tmp_path / "out", tmp_path / "crash" / "journal")
    (journal,) = (tmp_path / "crash" / "journal").glob("*.jsonl")
    first = json.loads(journal.read_text().splitlines()[1])
    assert isinstance(first["turn"]["prompt_ids"], list)
    monkeypatch.setattr(journal_lines, "COMPACT", True)
    SessionStore(tmp_path / "crash", template).recover()
    for name, keys in KEYS.items():
        assert _table(tmp_path / "crash" / name, keys).equals(
            _table(tmp_path / "out" / name, keys)
        ), name


@pytest.mark.parametrize(
    ("values", "kind"),
    [
        ([], "i4"),
        ([0, 1, 151643, 2**31 - 1, -(2**31)], "i4"),
        ([0, 1, 2, 3, 3, 3], "i1"),
        ([0.0, -0.5, -1e-7, -math.inf, -3.4e38, 1.5], "f4"),
        ([0, 0, 0], "f4"),
    ],
)
def test_packed_arrays_round_trip(values: list, kind: str) -> None:
    packed = journal_lines.pack(values, kind)
    assert isinstance(packed, dict)
    back = journal_lines.unpack(json.loads(json.dumps(packed)))
    if kind == "f4":
        expected = pa.array(values, pa.float32()).to_pylist()
    else:
        expected = values
    assert back == expected


@pytest.mark.parametrize(
    ("values", "kind"),
    [([2**31], "i4"), ([300], "i1"), ([1.5], "i4"), ([None, -0.5], "f4"), ([[1]], "i4")],
)
def test_arrays_that_do_not_fit_stay_lists(values: list, kind: str) -> None:
    assert journal_lines.pack(values, kind) == values
    assert journal_lines.unpack(values) == values


def _turn(request_id: str, prompt: list[int], completion: list[int]) -> TurnRecord:
    return TurnRecord(
        session_id="s", request_id=request_id, turn_index=0, protocol="openai.chat",
        requested_model="m", policy_model="p", backend="b", user_agent="ua", prompt_ids=prompt,
        completion_ids=completion, completion_logprobs=[-0.25] * len(completion),
        finish_reason="stop", response_finish_reason="stop", started_at=0.0, latency_s=0.1,
        stream=False,
    )  # fmt: skip


def test_a_prompt_is_stored_as_the_call_it_extends_plus_its_new_ids() -> None:
    a = _turn("a", [1, 2, 3], [4, 5])
    b = _turn("b", [9, 9], [8])  # the journal's last call, unrelated
    c = _turn("c", [1, 2, 3, 4, 5, 6, 7], [10])  # extends a's prompt and completion
    d = _turn("d", [1, 2, 3, 4, 0], [11])  # a rewrite: diverges inside a's completion
    earlier: list[TurnRecord] = [a, b]
    by_id = {t.request_id: t for t in earlier}
    for turn, parent, keep in [(c, "a", 5), (d, "a", 4), (c, None, 0)]:
        line = journal_lines.encode({"turn": turn.to_row(), "call": {"parent": parent}}, earlier)
        entry = json.loads(line)
        prompt = entry["turn"]["prompt_ids"]
        if keep:
            assert prompt["ref"] == "a" and prompt["keep"] == keep
            assert prompt["tail"]["n"] == len(turn.prompt_ids) - keep
        else:  # the parent unknown and the last call shares nothing: stored whole
            assert "ref" not in prompt
        back = journal_lines.decode(entry, by_id)
        assert back["turn"]["prompt_ids"] == turn.prompt_ids
        assert back["turn"]["completion_ids"] == turn.completion_ids
        assert back["turn"]["completion_logprobs"] == turn.completion_logprobs
    # A reference to a call the journal does not hold (its line was damaged) cannot be read.
    entry = json.loads(journal_lines.encode({"turn": c.to_row(), "call": {"parent": "a"}}, earlier))
    with pytest.raises(KeyError):
        journal_lines.decode(entry, {})
    entry["turn"]["prompt_ids"]["keep"] = 99
    with pytest.raises(ValueError):
        journal_lines.decode(entry, by_id)


def test_a_line_with_a_lone_surrogate_is_still_written() -> None:
    turn = _turn("a", [1], [2])
    turn.completion_text = "bad \ud800 text"
    line = journal_lines.encode({"turn": turn.to_row(), "call": {}}, [])
    back = journal_lines.decode(json.loads(line), {})
    assert back["turn"]["completion_text"] == "bad \ud800 text"
