"""capture/client/ray_pool.py (and its pool_shards.py) without Ray: placement, replica affinity (the gateway's own rule), shard
uploads to a pyarrow filesystem and the pool's shards read back as one dataset."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.fs as pafs
import pytest

from capture.client.pool_shards import (
    Uploader,
    load_lost,
    open_dataset,
    resolve_filesystem,
    save_lost,
)
from capture.client.ray_pool import least_loaded, replica_for
from capture.policy.pools import PolicyPools
from capture.storage.shards import write_table


def test_least_loaded_counts_sessions_then_calls_in_flight() -> None:
    idle = [{"sessions": 0, "in_flight": 0}] * 3
    assert least_loaded(idle, [0, 0, 0]) == 0  # a tie: the lowest index
    assert least_loaded(idle, [1, 0, 1]) == 1  # placed but not yet reported live
    busy = [{"sessions": 2, "in_flight": 3}, {"sessions": 2, "in_flight": 1}, {"sessions": 3}]
    assert least_loaded(busy, [2, 2, 0]) == 1
    assert least_loaded([{}, {}], [5, 4]) == 1


def test_replica_for_is_the_gateways_rule() -> None:
    """replica_for names the replica an idle proxy (PolicyPools.client_for, the real thing)
    sends a session's first call to: the same on every actor given the same ordered list."""
    urls = ["http://a:1", "http://b:2", "http://c:3"]

    async def check() -> None:
        for n in range(40):
            sid = f"s-{n}"
            pools = PolicyPools(urls, [], [], 10.0, 4)  # a fresh (idle) proxy's
            pools.open(decode=lambda ids: "")
            try:
                assert pools.client_for(sid).base_url == replica_for(sid, urls)
            finally:
                await pools.close()

    asyncio.run(check())
    assert {replica_for(f"s-{n}", urls) for n in range(50)} == set(urls)


def _shard(folder: Path, session: str, reward: float, name: str | None = None) -> Path:
    table = pa.table({"session_id": [session], "reward": [reward]})
    return write_table(folder, table, prefix="threads", name=name)


def test_upload_copies_new_and_changed_shards_once(tmp_path: Path) -> None:
    local = tmp_path / "local" / "proxy-0"
    first = _shard(local / "threads", "a", 1.0)
    (local / "journal").mkdir()
    (local / "journal" / "a.jsonl").write_text("{}\n")  # never uploaded
    (local / "threads" / ".half.parquet.tmp").write_bytes(b"PAR")  # a shard being written
    store = tmp_path / "store"
    fs, base = resolve_filesystem(f"file://{store}")
    uploader = Uploader(local, fs, f"{base}/proxy-0")
    assert uploader.sync() == [f"{store}/proxy-0/threads/{first.name}"]
    assert uploader.sync() == []  # nothing new
    assert sorted(p.name for p in (store / "proxy-0").rglob("*")) == ["threads", first.name]
    # A shard rewritten under the same name (recovery replaces files) is uploaded again.
    _shard(local / "threads", "a", 0.5, name=first.name)
    os.utime(local / "threads" / first.name, ns=(1, 1))
    assert len(uploader.sync()) == 1
    assert open_dataset(f"file://{store}").to_table().column("reward").to_pylist() == [0.5]


def test_dataset_of_every_proxy_folder_through_a_subtree_filesystem(tmp_path: Path) -> None:
    for n, session in enumerate(["a", "b", "c"]):
        _shard(tmp_path / "root" / f"proxy-{n % 2}" / "threads", session, float(n))
    (tmp_path / "root" / "other" / "threads").mkdir(parents=True)
    _shard(tmp_path / "root" / "other" / "threads", "not-a-proxy", 9.0)
    fs = pafs.SubTreeFileSystem(str(tmp_path), pafs.LocalFileSystem())
    rows = open_dataset(fs, "root").to_table().to_pylist()
    assert sorted((r["session_id"], r["proxy"], r["reward"]) for r in rows) == [
        ("a", "proxy-0", 0.0),
        ("b", "proxy-1", 1.0),
        ("c", "proxy-0", 2.0),
    ]
    assert open_dataset(str(tmp_path / "root")).count_rows() == 3  # a plain local path
    with pytest.raises(FileNotFoundError):
        open_dataset(fs, "root", kind="turns")


def test_a_lost_attempts_rows_are_never_read_back(tmp_path: Path) -> None:
    """A rollout attempt lost with its node: its sessions are listed in the pool's
    lost-sessions.json, and the dataset leaves their rows out, whichever proxy folder holds
    them (a journal recovered after the loss writes them later)."""
    root = tmp_path / "root"
    for n, session in enumerate(["g-0", "g-1", "g-retry1-1"]):
        _shard(root / f"proxy-{n}" / "threads", session, 1.0)
    fs, base = resolve_filesystem(str(root))
    assert open_dataset(fs, base).count_rows() == 3
    save_lost(fs, base, [{"proxy": 1, "session_ids": ["g-1"], "why": "node lost"}])
    assert load_lost(fs, base)[0]["session_ids"] == ["g-1"]
    rows = open_dataset(fs, base).to_table().to_pylist()
    assert sorted(r["session_id"] for r in rows) == ["g-0", "g-retry1-1"]
    assert not list(root.glob(".lost-sessions*"))  # written whole, then moved in place
    # A file that cannot be read stops the reading (its rows would be trained otherwise).
    (root / "lost-sessions.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot be read"):
        open_dataset(fs, base)
