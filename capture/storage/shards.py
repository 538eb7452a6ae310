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

# {version, start, end}: positions [start, end) of a token list whose logprobs the weights
# labelled ``version`` gave (POST /policy/weights, vLLM's /update_weight_version).
WEIGHT_SPANS = pa.list_(
    pa.struct([("version", pa.string()), ("start", pa.int32()), ("end", pa.int32())])
)

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
        ("weight_versions", WEIGHT_SPANS),
    ]
)


def write_table(
    directory: Path, table: pa.Table, prefix: str = "part", name: str | None = None
) -> Path:
    """Write ``table`` as one Parquet file in ``directory``; returns its final path.

    ``name``: a fixed file name, so writing the same rows again (recovery after a crash in the
    middle of a session's writes) replaces the file instead of adding a second copy."""
    directory.mkdir(parents=True, exist_ok=True)
    if name is None:
        name = f"{prefix}-{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:12]}.parquet"
    final = directory / name
    tmp = directory / f".{name}.tmp"
    pq.write_table(table, tmp, **parquet_options(table.schema))
    with open(tmp, "rb+") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, final)
    return final


# One data page per column chunk up to this size: a session's calls repeat their conversation in
# every prompt_ids, and zstd finds an earlier row's ids again only within one page.
PAGE_BYTES = 64 * 1024 * 1024
ZSTD_LEVEL = 9


def parquet_options(schema: pa.Schema) -> dict[str, Any]:
    """``pyarrow.parquet.write_table``'s options for a shard of ``schema`` (docs/SHARDS.md,
    "Storage"): zstd; number lists (token ids, masks, logprobs) without a dictionary (PLAIN keeps
    each row's ids byte-aligned, so a prompt that repeats the row before compresses to almost
    nothing), float lists BYTE_STREAM_SPLIT; strings keep their dictionary. Readers need none of
    this: every Parquet reader decodes these encodings."""
    dictionary: list[str] = []
    encodings: dict[str, str] = {}
    for path, leaf, in_list in _leaves(list(schema), ""):
        if in_list and pa.types.is_floating(leaf):
            encodings[path] = "BYTE_STREAM_SPLIT"
        elif not (in_list and pa.types.is_integer(leaf)):
            dictionary.append(path)
    return {
        "compression": "zstd",
        "compression_level": ZSTD_LEVEL,
        "use_dictionary": dictionary,
        "column_encoding": encodings,
        "data_page_size": PAGE_BYTES,
    }


def _leaves(
    fields: list[pa.Field], prefix: str, in_list: bool = False
) -> list[tuple[str, pa.DataType, bool]]:
    """(Parquet column path, type, whether inside a list of numbers or structs) of each leaf."""
    out: list[tuple[str, pa.DataType, bool]] = []
    for f in fields:
        path = prefix + f.name
        if pa.types.is_list(f.type):
            value = f.type.value_field
            out += _leaves([value.with_name("element")], f"{path}.list.", True)
        elif pa.types.is_struct(f.type):
            out += _leaves(list(f.type), f"{path}.", in_list)
        else:
            out.append((path, f.type, in_list))
    return out


def rows_to_table(rows: list[dict[str, Any]], schema: pa.Schema) -> pa.Table:
    columns = {name: [row.get(name) for row in rows] for name in schema.names}
    return pa.Table.from_pydict(columns, schema=schema)


THREAD_SCHEMA = pa.schema(
    [
        ("schema_version", pa.int32()),
        ("session_id", pa.string()),
        ("thread_id", pa.string()),
        ("parent_thread_id", pa.string()),
        ("parent_relation", pa.string()),
        ("parent_tool_call_id", pa.string()),
        # main, subagent or auxiliary (capture.trajectory.kinds); null in shards written before it.
        ("thread_kind", pa.string()),
        ("dead", pa.bool_()),
        ("dead_reason", pa.string()),
        ("superseded_by", pa.string()),
        ("input_ids", pa.list_(pa.int32())),
        ("loss_mask", pa.list_(pa.int8())),
        ("logprobs", pa.list_(pa.float32())),
        ("provenance", pa.list_(pa.int8())),
        (
            "turns",
            pa.list_(
                pa.struct(
                    [
                        ("request_id", pa.string()),
                        ("turn_index", pa.int32()),
                        ("start", pa.int32()),
                        ("end", pa.int32()),
                        ("finish_reason", pa.string()),
                        ("latency_s", pa.float64()),
                        ("backend", pa.string()),
                        ("dropped", pa.bool_()),
                        ("status", pa.string()),
                        ("trained_in", pa.string()),
                    ]
                )
            ),
        ),
        ("num_turns", pa.int32()),
        ("trained_request_ids", pa.list_(pa.string())),
        ("protocol", pa.string()),
        ("user_agent", pa.string()),
        ("reward", pa.float64()),
        ("metadata", pa.string()),  # JSON text, null until set
        # Why the session ended (set when a trainer closes it): stop, max_calls, max_tokens,
        # deadline; its metrics as JSON (capture/control/sessions.py SessionMetrics).
        ("end_reason", pa.string()),
        ("metrics", pa.string()),
        # Which weights gave which positions' logprobs (spans over input_ids); null in shards
        # written before it.
        ("weight_versions", WEIGHT_SPANS),
        # Where ``reward`` came from (REWARD_SOURCES); null while it has none, and in shards
        # written before the column.
        ("reward_source", pa.string()),
    ]
)

# A row's reward_source: its rollout's verifier (POST /rollouts), the trainer's close
# (POST /sessions/ID/close), a late reward (POST /sessions/ID/reward, write_rewards).
REWARD_VERIFIER = "verifier"
REWARD_CLOSE = "close"
REWARD_LATE = "late"
REWARD_SOURCES = (REWARD_VERIFIER, REWARD_CLOSE, REWARD_LATE)

# Calls the policy failed (capture.storage.records.FailedCall): never trained, kept to be counted.
FAILED_SCHEMA = pa.schema(
    [
        ("schema_version", pa.int32()),
        ("session_id", pa.string()),
        ("request_id", pa.string()),
        ("protocol", pa.string()),
        ("requested_model", pa.string()),
        ("policy_model", pa.string()),
        ("backend", pa.string()),
        ("user_agent", pa.string()),
        ("stream", pa.bool_()),
        ("reason", pa.string()),
        ("policy_status", pa.int32()),
        ("prompt_tokens", pa.int32()),
        ("completion_tokens", pa.int32()),
        ("started_at", pa.float64()),
        ("failed_at", pa.float64()),
    ]
)

# Rows are split so that one file stays near this size: shards roll over by size.
SHARD_TARGET_BYTES = 128 * 1024 * 1024


def write_rows(
    directory: Path,
    rows: list[dict[str, Any]],
    schema: pa.Schema,
    prefix: str,
    target_bytes: int = SHARD_TARGET_BYTES,
    stem: str | None = None,
) -> list[Path]:
    """Write rows as one or more shards of about ``target_bytes`` each.

    ``stem``: name the files ``PREFIX-STEM-N.parquet`` (N from 0): the same rows written again
    under the same stem replace those files, so a write repeated after a crash is idempotent."""
    paths: list[Path] = []
    chunk: list[dict[str, Any]] = []
    size = 0

    def flush() -> None:
        name = f"{prefix}-{stem}-{len(paths)}.parquet" if stem is not None else None
        paths.append(write_table(directory, rows_to_table(chunk, schema), prefix, name))

    for row in rows:
        # ~5 bytes a token per list column after encoding: a cheap, conservative estimate.
        size += 64 + sum(5 * len(v) for v in row.values() if isinstance(v, list))
        chunk.append(row)
        if size >= target_bytes:
            flush()
            chunk, size = [], 0
    if chunk:
        flush()
    return paths


def written_turn_counts(directory: Path) -> dict[str, int]:
    """Per session, how many calls its turns shards in ``directory`` number (its highest
    ``turn_index`` plus one). A shard that cannot be read is skipped with a warning."""
    counts: dict[str, int] = {}
    for shard in sorted(directory.glob("*.parquet")):
        try:
            table = pq.read_table(shard, columns=["session_id", "turn_index"])
            last = table.group_by("session_id").aggregate([("turn_index", "max")])
        except Exception as exc:
            logger.warning("could not read the turn indices of %s (%s)", shard.name, exc)
            continue
        for session_id, index in zip(
            last.column("session_id").to_pylist(),
            last.column("turn_index_max").to_pylist(),
            strict=True,
        ):
            if session_id is not None and index is not None:
                counts[session_id] = max(counts.get(session_id, 0), int(index) + 1)
    return counts


def rewrite_rows(path: Path, schema: pa.Schema, change: Any) -> int:
    """Rewrite the shard ``path`` in place (whole, under a temporary name, then renamed, like
    every write here): ``change(row)`` edits each row's dict; returns how many rows it holds.
    Columns of ``schema`` the file lacks (written before they existed) are null."""
    table = pq.read_table(path)
    rows = table.to_pylist()
    for row in rows:
        change(row)
    write_table(path.parent, rows_to_table(rows, schema), name=path.name)
    return len(rows)
