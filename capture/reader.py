"""Read thread shards into padded batches for a trainer.

rows = load_threads("OUT/threads")
batch = to_batch(rows, pad_id=151643)           # numpy arrays
tensors = to_torch(batch)                       # torch tensors, if torch is installed
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pyarrow.dataset as ds


def load_threads(
    path: str | os.PathLike[str], columns: list[str] | None = None
) -> list[dict[str, Any]]:
    """All thread rows under ``path`` (a folder of shards, or one file)."""
    return ds.dataset(str(path), format="parquet").to_table(columns=columns).to_pylist()


def to_batch(
    rows: list[dict[str, Any]],
    pad_id: int = 0,
    max_len: int | None = None,
    left_pad: bool = False,
) -> dict[str, np.ndarray]:
    """Pad ``input_ids``, ``loss_mask``, ``logprobs`` and ``provenance`` to one length.

    ``attention_mask`` is 1 on real tokens. Rows longer than ``max_len`` are cut at the end.
    """
    lengths = [len(r["input_ids"]) for r in rows]
    width = max(lengths, default=0) if max_len is None else max_len
    n = len(rows)
    out: dict[str, np.ndarray] = {
        "input_ids": np.full((n, width), pad_id, dtype=np.int64),
        "attention_mask": np.zeros((n, width), dtype=np.int64),
        "loss_mask": np.zeros((n, width), dtype=np.int64),
        "logprobs": np.zeros((n, width), dtype=np.float32),
        "provenance": np.zeros((n, width), dtype=np.int8),
    }
    for i, row in enumerate(rows):
        k = min(len(row["input_ids"]), width)
        sl = slice(width - k, width) if left_pad else slice(0, k)
        out["input_ids"][i, sl] = row["input_ids"][:k]
        out["attention_mask"][i, sl] = 1
        out["loss_mask"][i, sl] = row["loss_mask"][:k]
        out["logprobs"][i, sl] = row["logprobs"][:k]
        out["provenance"][i, sl] = row["provenance"][:k]
    return out


def to_torch(batch: dict[str, np.ndarray]) -> dict[str, Any]:
    import torch

    return {k: torch.from_numpy(v) for k, v in batch.items()}
