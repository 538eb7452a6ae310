"""capture/storage/records.py: a record's row is what ``dataclasses.asdict`` gives, and owns its values."""

from __future__ import annotations

from dataclasses import asdict

from capture.storage.records import TurnRecord


def _record() -> TurnRecord:
    return TurnRecord(
        "sess", "req-1", 0, "openai.chat", "gpt-4o", "policy", "http://b", "ua/1",
        list(range(5000)), [7, 8], [-0.25, -1.5], "stop", "tool_calls", 1.0, 0.5, True,
        completion_text="hi", thread_id="t-1", metadata={"assembly": "extend", "n": {"k": [1]}},
        weight_versions=[{"version": 3, "start": 0, "end": 2}],
    )  # fmt: skip


def test_a_row_is_what_asdict_gives_in_the_same_order() -> None:
    record = _record()
    row = record.to_row()
    assert row == asdict(record)
    assert list(row) == list(asdict(record))
    assert TurnRecord.from_row(row) == record


def test_changing_a_row_leaves_its_record_alone() -> None:
    record = _record()
    row = record.to_row()
    row["prompt_ids"].append(1)
    row["completion_logprobs"][0] = 0.0
    row["metadata"]["n"]["k"].append(2)
    row["weight_versions"][0]["end"] = 9
    assert record == _record()
