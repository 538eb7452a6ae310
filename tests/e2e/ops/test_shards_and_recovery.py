"""Shards: atomic, readable by pyarrow.dataset / datasets; the reader's batches; kill -9 recovery."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import numpy as np
import pyarrow.dataset as ds
import pytest

from capture.storage.reader import load_threads, to_batch
from capture.storage.sessions import SessionStore
from capture.storage.shards import TURN_SCHEMA, rows_to_table, write_rows
from rewriter.canonical import ChatRequest, Message
from rewriter.template import ChatTemplate
from tests.support.proxies import Proxy, read_turns, record_turn, start_proxy
from tests.support.stub_vllm import StubPolicy


def test_recovery_from_journal_equals_live_shards(qwen3_dir: Path, tmp_path: Path) -> None:
    """Threads rebuilt from the journal alone equal the ones the live process would write."""
    template = ChatTemplate(qwen3_dir)
    live, crashed = (
        SessionStore(tmp_path / "live", template),
        SessionStore(tmp_path / "crash", template),
    )
    msgs = [Message("system", "s"), Message("user", "q0")]
    for i in range(4):
        if i == 3:
            msgs[1] = Message("user", "<system-reminder>x</system-reminder>q0")  # a rewrite
        ids = template.encode(f"answer {i}") + [template.eos_token_id]
        for store in (live, crashed):
            record_turn(store, "sess", ChatRequest(messages=list(msgs), model="m"), ids, i)
        msgs += [Message("assistant", f"answer {i}"), Message("user", f"q{i + 1}")]
    live.close()
    # The crashed store never ends its session; a new store over the same folder recovers it.
    assert list((tmp_path / "crash" / "journal").glob("*.jsonl"))
    SessionStore(tmp_path / "crash", template).recover()
    assert not list((tmp_path / "crash" / "journal").glob("*.jsonl"))
    a, b = load_threads(tmp_path / "live" / "threads"), load_threads(tmp_path / "crash" / "threads")
    assert len(a) == len(b) == 1
    for key in ("input_ids", "loss_mask", "logprobs", "provenance", "turns", "parent_thread_id"):
        assert a[0][key] == b[0][key], key
    assert 2 in a[0]["provenance"]  # the rewrite marked tokens for recompute
    assert len(read_turns(tmp_path / "crash")) == 4


def test_session_going_on_after_an_idle_flush_keeps_exact_ids(
    qwen3_dir: Path, tmp_path: Path
) -> None:
    """A scaffold idle past the timeout, then back: its next prompt still extends the exact ids,
    on a new thread whose earlier tokens are prompt (trained in the first shard, not twice)."""
    template = ChatTemplate(qwen3_dir)
    store = SessionStore(tmp_path / "out", template, idle_timeout_s=300)
    msgs = [Message("user", "q0")]
    sampled: list[list[int]] = []
    for i in range(3):
        ids = template.encode(f"answer {i}") + [template.eos_token_id]
        sampled.append(ids)
        record_turn(store, "sess", ChatRequest(messages=list(msgs), model="m"), ids, i)
        msgs += [Message("assistant", f"answer {i}"), Message("user", f"q{i + 1}")]
        if i == 1:
            assert store.flush_idle(now=time.monotonic() + 301)  # idle: shards written
            assert not list((tmp_path / "out" / "journal").glob("*.jsonl"))
    store.close()
    rows = sorted(load_threads(tmp_path / "out" / "threads"), key=lambda r: len(r["input_ids"]))
    assert len(rows) == 2
    first, second = rows
    assert first["num_turns"] == 2 and second["num_turns"] == 1
    assert second["parent_thread_id"] == first["thread_id"]
    # The third call's prompt is the first thread's exact ids, then the new messages.
    n = len(first["input_ids"])
    assert second["input_ids"][:n] == first["input_ids"]
    turns = read_turns(tmp_path / "out")
    assert [t["turn_index"] for t in turns] == [0, 1, 2]
    assert '"extend"' in turns[2]["metadata"]
    assert turns[2]["prompt_ids"][:n] == first["input_ids"]
    # Only the new call's tokens are trained in the second row.
    (span,) = [t for t in second["turns"] if t["status"] == "trained"]
    assert [t["status"] for t in second["turns"]] == ["context", "context", "trained"]
    assert {t["trained_in"] for t in second["turns"][:2]} == {first["thread_id"]}
    assert second["parent_relation"] == "continued" and not second["dead"]
    trained = [i for i, m in enumerate(second["loss_mask"]) if m]
    assert trained == list(range(span["start"], span["end"]))
    assert second["input_ids"][span["start"] : span["end"]] == sampled[2]


def test_shards_are_atomic_roll_over_and_load_everywhere(tmp_path: Path) -> None:
    rows = [
        {name: None for name in TURN_SCHEMA.names}
        | {
            "session_id": f"s{i}",
            "prompt_ids": list(range(1000)),
            "completion_ids": [1, 2],
            "completion_logprobs": [-1.0, -2.0],
            "turn_index": i,
        }
        for i in range(10)
    ]
    paths = write_rows(tmp_path, rows, TURN_SCHEMA, "turns", target_bytes=12_000)
    assert len(paths) > 1  # rolled over by size
    assert not list(tmp_path.glob(".*.tmp"))
    assert ds.dataset(str(tmp_path), format="parquet").count_rows() == 10
    # A reader never sees a half-written file: temporary names are hidden from it.
    (tmp_path / ".turns-partial.parquet.tmp").write_bytes(b"PAR1 garbage")
    assert ds.dataset(str(tmp_path), format="parquet").count_rows() == 10
    import datasets

    loaded = datasets.load_dataset("parquet", data_files=[str(p) for p in paths], split="train")
    assert len(loaded) == 10 and loaded[0]["completion_ids"] == [1, 2]
    # Ray Data (one local worker), as a distributed trainer would read them.
    import ray
    import ray.data

    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    try:
        table = ray.data.read_parquet(str(tmp_path)).take_all()
        assert len(table) == 10
        assert sorted(r["session_id"] for r in table) == sorted(f"s{i}" for i in range(10))
        assert all(list(r["completion_ids"]) == [1, 2] for r in table)
    finally:
        ray.shutdown()
    assert rows_to_table(rows, TURN_SCHEMA).num_rows == 10


def test_reader_pads_batches(tmp_path: Path) -> None:
    rows = [
        {
            "input_ids": [5, 6, 7],
            "loss_mask": [0, 1, 1],
            "logprobs": [0.0, -1.0, -2.0],
            "provenance": [0, 1, 1],
        },
        {"input_ids": [8], "loss_mask": [0], "logprobs": [0.0], "provenance": [0]},
    ]
    batch = to_batch(rows, pad_id=99)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 99, 99]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["loss_mask"].tolist() == [[0, 1, 1], [0, 0, 0]]
    assert np.allclose(batch["logprobs"][0], [0.0, -1.0, -2.0])
    left = to_batch(rows, pad_id=99, left_pad=True)
    assert left["input_ids"].tolist() == [[5, 6, 7], [99, 99, 8]]


# Either way a completed call's line is written before its answer ends; before_reply also waits
# for its fsync.
@pytest.mark.parametrize("fsync", ["after_reply", "before_reply"])
def test_kill_9_mid_session_keeps_completed_turns(
    stub: StubPolicy, confdir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fsync: str
) -> None:
    out = tmp_path / "out"
    idle = 3600  # the session never ends by itself
    mode = ["--set", f"agenttap_journal_fsync={fsync}"]
    proxy = start_proxy(stub.url, out, confdir, idle_timeout=idle, extra=mode)
    try:
        client = proxy.openai("crashy", monkeypatch)
        msgs: list[dict] = [{"role": "user", "content": "one"}]
        for i in range(3):
            stub.script(f"answer number {i}")
            reply = client.chat.completions.create(model="gpt-4o", messages=msgs, max_tokens=50)
            msgs += [
                {"role": "assistant", "content": reply.choices[0].message.content},
                {"role": "user", "content": f"q{i}"},
            ]
        assert read_turns(out, "crashy") == []  # not sharded yet: only journaled
        os.kill(proxy.proc.pid, signal.SIGKILL)
        proxy.proc.wait()
    finally:
        proxy.stop()
    restarted: Proxy = start_proxy(stub.url, out, confdir, idle_timeout=idle, extra=mode)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and len(read_turns(out, "crashy")) < 3:
            time.sleep(0.2)
        turns = read_turns(out, "crashy")
        assert [t["turn_index"] for t in turns] == [0, 1, 2]
        threads = [r for r in load_threads(out / "threads") if r["session_id"] == "crashy"]
        assert len(threads) == 1 and threads[0]["num_turns"] == 3
        last = turns[-1]
        assert threads[0]["input_ids"] == last["prompt_ids"] + last["completion_ids"]
    finally:
        restarted.stop()
