"""Parquet shards: written whole under a temporary name, then renamed into place.

A reader (``pyarrow.dataset``, ``datasets``, Ray Data) listing the folder never sees a half-written
file: the temporary name starts with ``.`` and ends in ``.tmp``, which all of them skip.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

logger = logging.getLogger(__name__)

TURN_SCHEMA = pa.schema(
    [
        ("schema_version", pa.int32()),
        ("session_id", pa.string()),
        ("thread_id", pa.string()),
        ("request_id", pa.string()),
        ("turn_index", pa.int32()),
        ("protocol", pa.string()),
        ("requested_model", pa.string()),
        ("policy_model", pa.string()),
        ("backend", pa.string()),
        ("user_agent", pa.string()),
        ("prompt_ids", pa.list_(pa.int32())),
        ("completion_ids", pa.list_(pa.int32())),
        ("completion_logprobs", pa.list_(pa.float32())),
        ("completion_text", pa.string()),
        ("finish_reason", pa.string()),
        ("response_finish_reason", pa.string()),
        ("stream", pa.bool_()),
        ("started_at", pa.float64()),
        ("latency_s", pa.float64()),
        ("metadata", pa.string()),  # JSON text
    ]
)


def write_table(directory: Path, table: pa.Table, prefix: str = "part") -> Path:
    """Write ``table`` as one new Parquet file in ``directory``; returns its final path."""
    directory.mkdir(parents=True, exist_ok=True)
    name = f"{prefix}-{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:12]}.parquet"
    final = directory / name
    tmp = directory / f".{name}.tmp"
    pq.write_table(table, tmp, compression="zstd")
    with open(tmp, "rb+") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, final)
    return final


def rows_to_table(rows: list[dict[str, Any]], schema: pa.Schema) -> pa.Table:
    columns = {name: [row.get(name) for row in rows] for name in schema.names}
    return pa.Table.from_pydict(columns, schema=schema)
