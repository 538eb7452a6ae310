"""OUT holds only data: after a real capture through the launcher, the output folder is what a
trainer's loaders read whole (Hugging Face ``datasets``, ``pyarrow.dataset``), with no log file
in it (the launcher keeps mitmdump's log in a private folder outside OUT). Late rewards live in
``OUT/rewards/`` beside an ``_index.jsonl`` that pyarrow's dataset discovery skips by its ``_``
prefix, so the folder still reads as Parquet."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow.dataset as ds
import pytest

from capture.client.launcher import AgentTap, Session
from tests.support.paths import QWEN3
from tests.support.stub_vllm import StubPolicy


@pytest.fixture
def captured(
    stub: StubPolicy, confdir: Path, tmp_path: Path
) -> Iterator[tuple[AgentTap, Session, Path]]:
    """Two calls of one session in base-URL mode with the openai SDK, closed with a reward."""
    import openai

    out = tmp_path / "out"
    tap = AgentTap.start(stub.url, QWEN3, out, confdir=confdir)
    try:
        sess = tap.open_session(metadata={"task_id": "out-is-data"})
        client = openai.OpenAI(
            base_url=sess.base_urls["openai"], api_key=sess.api_key, max_retries=0, timeout=60
        )
        messages: list[Any] = [{"role": "user", "content": "Say hello."}]
        first = client.chat.completions.create(model="gpt-5", messages=messages)
        messages += [
            {"role": "assistant", "content": first.choices[0].message.content or ""},
            {"role": "user", "content": "Again."},
        ]
        client.chat.completions.create(model="gpt-5", messages=messages)
        rows = sess.close(reward=1.0)
        assert rows.num_rows >= 1
        yield tap, sess, out
    finally:
        tap.close()


def _files(out: Path) -> list[Path]:
    return sorted(p for p in out.rglob("*") if p.is_file())


def _not_data(out: Path) -> list[Path]:
    """Files under OUT that a Parquet reader would trip on: every file is a shard, or named
    with a leading ``_`` or ``.`` (which pyarrow's and datasets' discovery skip)."""
    return [p for p in _files(out) if p.suffix != ".parquet" and not p.name.startswith(("_", "."))]


def test_out_holds_no_log_and_loads_as_datasets(
    captured: tuple[AgentTap, Session, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    tap, sess, out = captured
    files = _files(out)
    assert list((out / "threads").glob("*.parquet")), files
    assert not [p for p in files if p.suffix == ".log"], files
    assert not _not_data(out), files
    # The launcher's log is not in OUT.
    assert out.resolve() not in tap.log.resolve().parents

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    import datasets

    loaded = datasets.load_dataset(
        "parquet", data_dir=str(out / "threads"), cache_dir=str(out.parent / "hf-cache")
    )
    train = loaded["train"]
    assert train.num_rows >= 1 and set(train["session_id"]) == {sess.id}
    assert {"input_ids", "loss_mask", "logprobs"} <= set(train.column_names)
    assert sum(sum(m) for m in train["loss_mask"]) > 0
    # Loading wrote nothing into OUT (its cache is elsewhere).
    assert _files(out) == files

    threads = ds.dataset(str(out / "threads"), format="parquet").to_table()
    assert threads.num_rows == train.num_rows
    assert set(threads.column("reward").to_pylist()) == {1.0}
    turns = ds.dataset(str(out / "turns"), format="parquet").to_table()
    assert turns.num_rows == 2 and set(turns.column("session_id").to_pylist()) == {sess.id}


def test_a_late_reward_keeps_rewards_a_parquet_folder(
    captured: tuple[AgentTap, Session, Path],
) -> None:
    _, sess, out = captured
    sess.reward(0.5)
    rewards = out / "rewards"
    assert (rewards / "_index.jsonl").is_file()
    # pyarrow's discovery skips files named with a leading "_" or ".": the index is not read.
    table = ds.dataset(str(rewards)).to_table()
    assert max(table.to_pylist(), key=lambda r: r["set_at"])["reward"] == 0.5
    assert set(table.column("session_id").to_pylist()) == {sess.id}
    assert not [p for p in _files(out) if p.suffix == ".log"]
    assert not _not_data(out), _files(out)
    # The rows read with the late reward joined.
    from capture.storage.reader import load_threads

    assert {r["reward"] for r in load_threads(out)} == {0.5}
