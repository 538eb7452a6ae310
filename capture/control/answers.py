"""What the control API answers with: its error body (``{"error": {"message", "status"}}``), a
session's rows (JSON, or an Arrow IPC stream for ``Accept: application/vnd.apache.arrow.stream``
with the session's summary in the schema's metadata and the ``X-Agenttap-Session`` header), and
the rows of thread shards written earlier, read back."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from aiohttp import web

from capture.control.media import ARROW_STREAM
from capture.control.sessions import ControlledSession
from capture.storage.shards import THREAD_SCHEMA, rows_to_table

logger = logging.getLogger(__name__)


def error(status: int, message: str, extra: dict[str, Any] | None = None) -> web.Response:
    """The control API's error body; ``extra``: more fields beside ``error``."""
    return web.json_response(
        {"error": {"message": message, "status": status}, **(extra or {})}, status=status
    )


def rows_response(
    request: web.Request,
    sess: ControlledSession,
    rows: list[dict[str, Any]],
    unmatched: list[str] | None = None,
    shards: list[Path] | None = None,
) -> web.Response:
    summary = sess.summary()
    if shards is not None:
        # Where its rows were written (thread shards), for a reader of OUT.
        summary["shards"] = [str(p) for p in shards]
    if ARROW_STREAM in request.headers.get("Accept", ""):
        table = rows_to_table(rows, THREAD_SCHEMA)
        meta = {b"agenttap_session": json.dumps(summary).encode()}
        table = table.replace_schema_metadata(meta)
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
        return web.Response(
            body=sink.getvalue().to_pybytes(),
            content_type=ARROW_STREAM,
            headers={"X-Agenttap-Session": json.dumps(summary)},
        )
    out = dict(summary)
    out["rows"] = rows
    if unmatched:
        out["unmatched_rewards"] = unmatched
    return web.json_response(out)


def unmatched_threads(reward: Any, rows: list[dict[str, Any]]) -> list[str]:
    """Thread ids a per-thread reward named that the session has no row for."""
    if not isinstance(reward, dict):
        return []
    ids = {r["thread_id"] for r in rows}
    return sorted(k for k in reward if k not in ids)


def read_rows(paths: list[Path], session_id: str) -> list[dict[str, Any]]:
    """The rows of ``session_id`` in thread shards written earlier (a shard holds one session;
    the filter keeps that true of anything else)."""
    rows: list[dict[str, Any]] = []
    for path in paths:
        try:
            table = pq.read_table(path, schema=THREAD_SCHEMA)
        except (OSError, pa.ArrowInvalid) as exc:
            logger.warning("could not read %s back (%s)", path, exc)
            continue
        rows += [r for r in table.to_pylist() if r["session_id"] == session_id]
    return rows
