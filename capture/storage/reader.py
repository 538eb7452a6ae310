"""Read thread shards into padded batches for a trainer.

rows = load_threads("OUT")                      # OUT/threads, late rewards from OUT/rewards joined
batch = to_rl_batch(rows, pad_id=151643)        # verl-style prompts / responses (numpy); rows
                                                # without a reward: missing_reward=, kinds=
batch = to_batch(rows, pad_id=151643)           # or whole rows padded to one length (numpy)
tensors = to_torch(batch)                       # torch tensors, if torch is installed

The batches are made in ``capture.storage.batches``, rows marked by ``capture.storage.unverified``
and shards found by ``capture.storage.out_folder``; their names are importable from here.
"""

from __future__ import annotations

import os
from typing import Any

import pyarrow as pa
import pyarrow.dataset as ds

from capture.storage.batches import (
    MissingReward,
    RLBatch,
    Truncation,
    row_kind,
    select_rows,
    to_batch,
    to_rl_batch,
    to_torch,
)
from capture.storage.out_folder import check_shards, locate
from capture.storage.rewards import join_rewards, load_rewards
from capture.storage.shards import THREAD_SCHEMA
from capture.storage.unverified import (
    WEIGHTS_UNVERIFIED_FILE,
    mark_unverified,
    unverified_request_ids,
)

__all__ = [
    "WEIGHTS_UNVERIFIED_FILE",
    "MissingReward",
    "RLBatch",
    "Truncation",
    "load_threads",
    "mark_unverified",
    "row_kind",
    "select_rows",
    "to_batch",
    "to_rl_batch",
    "to_torch",
    "unverified_request_ids",
]


def load_threads(
    path: str | os.PathLike[str],
    columns: list[str] | None = None,
    rewards: bool = True,
) -> list[dict[str, Any]]:
    """All thread rows under ``path``, as dicts.

    ``path``: ``OUT`` itself (a folder holding ``threads/``, or another of OUT's folders),
    ``OUT/threads`` (any folder of thread shards), or one shard file.
    ``columns``: read only these (default: all).
    ``rewards``: join the late rewards of ``capture.storage.rewards`` (``OUT/rewards/``, the folder
    beside the shards' folder) onto the rows' ``reward`` (the reward set last wins and replaces
    the one the row was written with; see ``capture.storage.rewards.join_rewards``). Skipped when
    ``columns`` leaves out ``reward``; ``session_id`` and ``thread_id`` are read for the join
    and dropped again if ``columns`` leaves them out."""
    threads, out_dir = locate(path)
    if threads is None:
        return []
    check_shards(path, threads)
    dataset = ds.dataset(str(threads), format="parquet")
    if not dataset.files:
        return []
    # The schema of the first file, with the columns of THREAD_SCHEMA it lacks (shards written
    # before a column existed, such as thread_kind): null for the rows of those files.
    schema = pa.unify_schemas([dataset.schema, THREAD_SCHEMA])
    if schema != dataset.schema:
        dataset = ds.dataset(str(threads), format="parquet", schema=schema)
    join = rewards and (columns is None or "reward" in columns)
    read = columns
    if join and columns is not None:
        read = list(dict.fromkeys([*columns, "session_id", "thread_id"]))
    rows: list[dict[str, Any]] = dataset.to_table(columns=read).to_pylist()
    if columns is None:
        mark_unverified(rows, out_dir)
    if join:
        late = load_rewards(out_dir)
        if late.num_rows:
            rows = join_rewards(rows, late)
        if columns is not None:
            # Only what was asked: not the join's keys, nor the reward_source it sets.
            wanted = set(columns)
            rows = [{k: v for k, v in row.items() if k in wanted} for row in rows]
    return rows
