"""Sessions: the turns of one scaffold run, journaled as they complete, sharded when it ends.

Durability: every completed turn is appended to the session's journal (one JSON line, flushed and
fsynced) before the client's response finishes. A session becomes a Parquet shard when it has
been idle for ``idle_timeout_s`` or the proxy stops; only then is its journal removed. A proxy
killed with ``kill -9`` leaves journals behind, and the next start turns them into shards.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from capture.records import TurnRecord
from capture.shards import TURN_SCHEMA, rows_to_table, write_table

logger = logging.getLogger(__name__)

_SAFE = re.compile(r"[^A-Za-z0-9_.-]")


def _journal_name(session_id: str) -> str:
    # Session ids come from the client (the proxy username): never trust them as a path.
    return _SAFE.sub("_", session_id)[:80] + "-" + os.urandom(4).hex() + ".jsonl"


@dataclass
class Session:
    session_id: str
    journal_path: Path
    turns: list[TurnRecord] = field(default_factory=list)
    last_active: float = field(default_factory=time.monotonic)


class SessionStore:
    def __init__(self, out_dir: Path, idle_timeout_s: float = 300.0) -> None:
        self.out_dir = out_dir
        self.idle_timeout_s = idle_timeout_s
        self.journal_dir = out_dir / "journal"
        self.turns_dir = out_dir / "turns"
        self.journal_dir.mkdir(parents=True, exist_ok=True)
        self._sessions: dict[str, Session] = {}

    def session(self, session_id: str) -> Session:
        sess = self._sessions.get(session_id)
        if sess is None:
            sess = Session(session_id, self.journal_dir / _journal_name(session_id))
            self._sessions[session_id] = sess
        return sess

    def next_turn_index(self, session_id: str) -> int:
        return len(self.session(session_id).turns)

    def record(self, turn: TurnRecord) -> None:
        """Make ``turn`` durable (journal + fsync) and keep it for the session's shard."""
        sess = self.session(turn.session_id)
        line = json.dumps(turn.to_row(), separators=(",", ":")) + "\n"
        with open(sess.journal_path, "a", encoding="utf-8") as fh:
            fh.write(line)
            fh.flush()
            os.fsync(fh.fileno())
        sess.turns.append(turn)
        sess.last_active = time.monotonic()

    def touch(self, session_id: str) -> None:
        self.session(session_id).last_active = time.monotonic()

    # -- ending sessions -------------------------------------------------------------------
    def flush_idle(self, now: float | None = None) -> list[Path]:
        now = time.monotonic() if now is None else now
        idle = [s for s in self._sessions.values() if now - s.last_active >= self.idle_timeout_s]
        return [p for s in idle for p in self.end_session(s.session_id)]

    def end_session(self, session_id: str) -> list[Path]:
        sess = self._sessions.pop(session_id, None)
        if sess is None or not sess.turns:
            return []
        path = write_table(self.turns_dir, _turn_table(sess.turns), prefix="turns")
        sess.journal_path.unlink(missing_ok=True)
        logger.info("session %r ended: %d turns written to %s", session_id, len(sess.turns), path)
        return [path]

    def close(self) -> list[Path]:
        return [p for sid in list(self._sessions) for p in self.end_session(sid)]

    # -- recovery after a crash ------------------------------------------------------------
    def recover(self) -> list[Path]:
        """Turn journals left by an earlier process into shards. Call before serving."""
        written: list[Path] = []
        for journal in sorted(self.journal_dir.glob("*.jsonl")):
            turns: list[TurnRecord] = []
            for line in journal.read_text(encoding="utf-8").splitlines():
                try:
                    turns.append(TurnRecord.from_row(json.loads(line)))
                except (json.JSONDecodeError, TypeError):
                    # A line cut short by the crash: that turn had not completed.
                    logger.warning("skipping a torn line in %s", journal)
            if turns:
                written.append(write_table(self.turns_dir, _turn_table(turns), prefix="turns"))
                logger.info("recovered %d turns from %s", len(turns), journal.name)
            journal.unlink()
        return written


def _turn_table(turns: list[TurnRecord]):  # type: ignore[no-untyped-def]
    rows = []
    for t in turns:
        row = t.to_row()
        row["metadata"] = json.dumps(row["metadata"])
        rows.append(row)
    return rows_to_table(rows, TURN_SCHEMA)
