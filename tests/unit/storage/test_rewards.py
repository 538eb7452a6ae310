"""Late rewards (capture.storage.rewards): validation, the files written, loading, and the join's
precedence rules."""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from capture.storage.rewards import (
    REWARD_SCHEMA,
    join_rewards,
    load_rewards,
    parse_reward,
    write_rewards,
)


def _row(session_id: str, thread_id: str, reward: float | None = None) -> dict[str, Any]:
    return {"session_id": session_id, "thread_id": thread_id, "reward": reward, "input_ids": [1]}


# -- parse_reward ---------------------------------------------------------------------------


@pytest.mark.parametrize(("value", "expected"), [(1, 1.0), (-0.5, -0.5), (0, 0.0), (1e300, 1e300)])
def test_parse_reward_accepts_numbers(value: Any, expected: float) -> None:
    parsed = parse_reward(value)
    assert parsed == expected and type(parsed) is float


def test_parse_reward_accepts_thread_object() -> None:
    parsed = parse_reward({"t-a": 1, "t-b": -2.5})
    assert parsed == {"t-a": 1.0, "t-b": -2.5}
    assert isinstance(parsed, dict) and all(type(v) is float for v in parsed.values())


@pytest.mark.parametrize(
    ("value", "says"),
    [
        (True, "boolean"),
        (False, "boolean"),
        (float("nan"), "nan"),
        (float("inf"), "inf"),
        (-float("inf"), "inf"),
        ("1.0", "string"),
        (None, "null"),
        ([1.0], "array"),
        ({}, "empty"),
        ({1: 1.0}, "not a thread id"),
        ({"": 1.0}, "empty string"),
        ({"t-a": True}, "'t-a'"),
        ({"t-a": float("nan")}, "'t-a'"),
        ({"t-a": "high"}, "'t-a'"),
        ({"t-a": {"x": 1}}, "object"),
        (10**400, "too large"),
    ],
)
def test_parse_reward_rejects_with_a_message(value: Any, says: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_reward(value)
    message = str(info.value)
    assert says in message
    assert "finite number" in message and "thread id" in message  # what is accepted


# -- write_rewards / load_rewards -----------------------------------------------------------


def test_write_rewards_session_wide(tmp_path: Path) -> None:
    before = time.time()
    path = write_rewards(tmp_path, "s1", 0.75)
    assert path.parent == tmp_path / "rewards" and path.suffix == ".parquet"
    # No temp file left; the index (which readers check) lists it.
    assert sorted(p.name for p in (tmp_path / "rewards").iterdir()) == ["_index.jsonl", path.name]
    table = pq.read_table(path)
    assert table.schema == REWARD_SCHEMA
    [row] = table.to_pylist()
    assert row["session_id"] == "s1" and row["thread_id"] is None and row["reward"] == 0.75
    assert before <= row["set_at"] <= time.time()


def test_write_rewards_per_thread(tmp_path: Path) -> None:
    path = write_rewards(tmp_path, "s1", {"t-a": 1.0, "t-b": 0}, set_at=123.5)
    rows = pq.read_table(path).to_pylist()
    assert rows == [
        {"session_id": "s1", "thread_id": "t-a", "reward": 1.0, "set_at": 123.5, "source": "late"},
        {"session_id": "s1", "thread_id": "t-b", "reward": 0.0, "set_at": 123.5, "source": "late"},
    ]


@pytest.mark.parametrize(
    ("session_id", "reward", "set_at"),
    [
        ("s", float("nan"), None),
        ("s", True, None),
        ("s", {}, None),
        ("", 1.0, None),
        ("s", 1.0, math.inf),
    ],
)
def test_write_rewards_rejects_bad_input_and_writes_nothing(
    tmp_path: Path, session_id: str, reward: Any, set_at: Any
) -> None:
    with pytest.raises(ValueError):
        write_rewards(tmp_path, session_id, reward, set_at=set_at)
    assert not (tmp_path / "rewards").exists() or not any((tmp_path / "rewards").iterdir())


def test_load_rewards_missing_folder_is_empty(tmp_path: Path) -> None:
    table = load_rewards(tmp_path / "nowhere")
    assert table.num_rows == 0 and table.schema == REWARD_SCHEMA


def test_load_rewards_reads_files_in_write_order(tmp_path: Path) -> None:
    write_rewards(tmp_path, "s1", 1.0, set_at=10.0)
    write_rewards(tmp_path, "s2", {"t-x": 2.0}, set_at=5.0)
    write_rewards(tmp_path, "s1", 3.0, set_at=1.0)
    table = load_rewards(tmp_path)
    assert table.schema == REWARD_SCHEMA
    assert table.column("reward").to_pylist() == [1.0, 2.0, 3.0]
    assert table.column("session_id").to_pylist() == ["s1", "s2", "s1"]


def test_load_rewards_skips_unreadable_and_temp_files(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    write_rewards(tmp_path, "s1", 1.0, set_at=1.0)
    folder = tmp_path / "rewards"
    (folder / "rewards-0-garbage.parquet").write_bytes(b"not parquet at all")
    pq.write_table(
        pa.table({"session_id": ["s1"], "score": [9.0]}), folder / "rewards-1-wrong.parquet"
    )
    pq.write_table(
        pa.table({"session_id": ["s1"], "thread_id": [None], "reward": [7.0], "set_at": [99.0]}),
        folder / ".rewards-2.parquet.tmp",
    )
    with caplog.at_level(logging.WARNING, logger="capture.storage.rewards"):
        table = load_rewards(tmp_path)
    assert table.to_pylist() == [
        {"session_id": "s1", "thread_id": None, "reward": 1.0, "set_at": 1.0, "source": "late"}
    ]
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert "rewards-0-garbage.parquet" in warned and "rewards-1-wrong.parquet" in warned
    assert ".tmp" not in warned


def test_a_planted_or_changed_rewards_file_is_ignored(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An agent that reaches OUT/rewards (no sandbox) cannot give itself a reward: a file
    write_rewards did not write, or one it wrote and the agent changed, is not read."""
    real = write_rewards(tmp_path, "s1", 0.0, set_at=1.0)
    planted = pa.table(
        {"session_id": ["s1"], "thread_id": [None], "reward": [100.0], "set_at": [9e9]}
    )
    pq.write_table(planted, tmp_path / "rewards" / "rewards-99999999999999999999-x.parquet")
    with caplog.at_level(logging.WARNING, logger="capture.storage.rewards"):
        assert load_rewards(tmp_path).column("reward").to_pylist() == [0.0]
    assert "rewards-99999999999999999999-x.parquet" in caplog.text
    pq.write_table(planted, real)  # the real file, rewritten
    assert load_rewards(tmp_path).num_rows == 0


# -- join_rewards ---------------------------------------------------------------------------


def _late(session_id: str, thread_id: str | None, reward: float, set_at: float) -> dict[str, Any]:
    return {"session_id": session_id, "thread_id": thread_id, "reward": reward, "set_at": set_at}


def test_join_session_wide_applies_to_every_thread_of_the_session() -> None:
    rows = [_row("s1", "t-a"), _row("s1", "t-b", 0.2), _row("s2", "t-c", 0.3), _row("s2", "t-d")]
    joined = join_rewards(rows, [_late("s1", None, 1.0, 5.0)])
    assert [r["reward"] for r in joined] == [1.0, 1.0, 0.3, None]


def test_join_thread_reward_set_later_beats_session_reward() -> None:
    rows = [_row("s1", "t-a"), _row("s1", "t-b")]
    joined = join_rewards(rows, [_late("s1", None, 1.0, 5.0), _late("s1", "t-a", -1.0, 6.0)])
    assert [r["reward"] for r in joined] == [-1.0, 1.0]


def test_join_session_reward_set_later_beats_thread_reward() -> None:
    rows = [_row("s1", "t-a"), _row("s1", "t-b")]
    # Listed first but set later: set_at decides, not the order of the list.
    joined = join_rewards(rows, [_late("s1", None, 1.0, 7.0), _late("s1", "t-a", -1.0, 6.0)])
    assert [r["reward"] for r in joined] == [1.0, 1.0]


def test_join_latest_of_several_for_one_thread_wins() -> None:
    late = [
        _late("s1", "t-a", 1.0, 3.0),
        _late("s1", "t-a", 2.0, 9.0),
        _late("s1", "t-a", 3.0, 4.0),
    ]
    assert join_rewards([_row("s1", "t-a")], late)[0]["reward"] == 2.0


def test_join_equal_set_at_the_later_entry_wins() -> None:
    late = [_late("s1", "t-a", 1.0, 3.0), _late("s1", None, 2.0, 3.0)]
    assert join_rewards([_row("s1", "t-a")], late)[0]["reward"] == 2.0
    assert join_rewards([_row("s1", "t-a")], late[::-1])[0]["reward"] == 1.0


def test_join_replaces_written_reward_and_keeps_unmatched_rows() -> None:
    rows = [_row("s1", "t-a", 0.5), _row("s1", "t-b", 0.25), _row("s9", "t-z", 0.125)]
    joined = join_rewards(rows, [_late("s1", "t-a", 0.0, 1.0), _late("s1", "t-nope", 9.0, 1.0)])
    assert [r["reward"] for r in joined] == [0.0, 0.25, 0.125]
    assert rows[0]["reward"] == 0.5  # the input rows are not modified
    assert joined[0] is not rows[0] and joined[0]["input_ids"] == [1]


def test_join_ignores_invalid_entries(caplog: pytest.LogCaptureFixture) -> None:
    late = [
        _late("s1", "t-a", 5.0, 1.0),
        {"session_id": None, "thread_id": None, "reward": 9.0, "set_at": 9.0},
        _late("s1", None, float("nan"), 9.0),
        {"session_id": "s1", "thread_id": None, "reward": 9.0, "set_at": None},
    ]
    with caplog.at_level(logging.WARNING, logger="capture.storage.rewards"):
        joined = join_rewards([_row("s1", "t-a")], late)
    assert joined[0]["reward"] == 5.0
    assert "ignored 3" in caplog.text


def test_join_with_loaded_table_round_trip(tmp_path: Path) -> None:
    write_rewards(tmp_path, "s1", 1.0, set_at=100.0)
    write_rewards(tmp_path, "s1", {"t-b": 0.0}, set_at=200.0)
    write_rewards(tmp_path, "s2", {"t-c": 0.5}, set_at=50.0)
    rows = [_row("s1", "t-a"), _row("s1", "t-b"), _row("s2", "t-c", 0.9), _row("s2", "t-d", 0.9)]
    joined = join_rewards(rows, load_rewards(tmp_path))
    assert [r["reward"] for r in joined] == [1.0, 0.0, 0.5, 0.9]


def test_join_nothing_changes_without_late_rewards(tmp_path: Path) -> None:
    rows = [_row("s1", "t-a", 0.5), _row("s1", "t-b")]
    assert join_rewards(rows, load_rewards(tmp_path)) == rows
