"""Rows a policy server sampled while its weights had changed without an update (the gateway's
OUT/weights_unverified.jsonl windows) are marked ``weights_unverified`` by the reader and left
out of a trainer's batch: they are not the policy's."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from capture.storage.reader import load_threads, select_rows, unverified_request_ids
from capture.storage.shards import THREAD_SCHEMA, write_rows
from tests.unit.storage.test_reader import thread_row


def write_out(out: Path, windows: list[dict[str, object]]) -> None:
    rows = []
    for sid, rid in (("s-ok", "r-ok"), ("s-bad", "r-bad"), ("s-other", "r-other")):
        row = thread_row(sid, f"t-{rid}", [1, 2, 3], [0, 1, 1], reward=1.0)
        row["trained_request_ids"] = [rid]
        rows.append(row)
    (out / "threads").mkdir(parents=True)
    write_rows(out / "threads", rows, THREAD_SCHEMA, "threads")
    (out / "turns").mkdir()
    calls = pa.table({
        "request_id": ["r-ok", "r-bad", "r-other"],
        # r-ok before the window, r-bad inside it, r-other inside it on another server.
        "backend": ["http://a", "http://a", "http://b"],
        "started_at": [100.0, 205.0, 205.0],
        "latency_s": [2.0, 1.0, 1.0],
    })  # fmt: skip
    pq.write_table(calls, out / "turns" / "turns-0.parquet")
    text = "".join(json.dumps(w) + "\n" for w in windows) + '{"backend": "http://a", "since'
    (out / "weights_unverified.jsonl").write_text(text)


def test_rows_sampled_in_a_window_are_marked_and_left_out(tmp_path: Path) -> None:
    write_out(tmp_path, [{"backend": "http://a", "since": 200.0, "found": 210.0, "reason": "x"}])
    assert unverified_request_ids(tmp_path) == {"r-bad"}
    rows = {r["session_id"]: r for r in load_threads(tmp_path)}
    assert rows["s-bad"]["weights_unverified"] is True
    assert rows["s-ok"]["weights_unverified"] is False
    assert rows["s-other"]["weights_unverified"] is False  # another server, same time
    assert {r["session_id"] for r in select_rows(list(rows.values()))} == {"s-ok", "s-other"}


def test_without_windows_nothing_is_marked(tmp_path: Path) -> None:
    write_out(tmp_path, [])
    rows = load_threads(tmp_path)
    assert rows and not any(r["weights_unverified"] for r in rows)
    assert len(select_rows(rows)) == 3
    (tmp_path / "weights_unverified.jsonl").unlink()  # none ever seen: rows as written
    assert not any("weights_unverified" in r for r in load_threads(tmp_path))
