"""Rewards taken back from a session's written thread rows (a rollout whose session someone
else closed or rewarded before its verifier ran: its rows carry no reward)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from capture.storage.journal_files import safe_stem
from capture.storage.rewards import void_rewards
from capture.storage.shards import THREAD_SCHEMA, rewrite_rows

logger = logging.getLogger(__name__)


def take_back_rewards(out_dir: Path, session_id: str, since: float) -> list[dict[str, Any]]:
    """Take back every reward given to ``session_id``'s rows written since ``since`` (unix
    seconds): its thread shards rewritten with ``reward`` and ``reward_source`` null, and a void
    late reward (``capture.storage.rewards.void_rewards``) so that none given before now is
    joined onto them. Returns those rows, as now written. For a rollout whose session someone
    else closed or rewarded before its verifier ran (capture/rollouts/runner.py): its rows must
    carry no reward, rather than the one that someone chose."""
    threads_dir = Path(out_dir) / "threads"
    rows_out: list[dict[str, Any]] = []

    def take_back(row: dict[str, Any]) -> None:
        if row.get("session_id") == session_id:
            row["reward"] = None
            row["reward_source"] = None
            rows_out.append(row)

    # A session's shards are named after its journal, which starts with its id made safe (no
    # character glob reads as a pattern is left in it).
    prefix = "threads-" + safe_stem(session_id) + "-"
    for path in sorted(threads_dir.glob(f"{prefix}*.parquet")):
        try:
            if path.stat().st_mtime < since:
                continue
            ids = pq.read_table(path, columns=["session_id"]).column("session_id").to_pylist()
        except (OSError, pa.ArrowException) as exc:
            logger.warning("could not read %s to take back its rewards (%s)", path, exc)
            continue
        if session_id in ids:
            rewrite_rows(path, THREAD_SCHEMA, take_back)
    void_rewards(Path(out_dir), session_id)
    return rows_out
