"""A session's journal as a file: its name (the session id made safe for a path), one line
appended durably, the text of a call made safe to write before it is journaled, and the file
read back after a crash (``replay``)."""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from capture.storage import journal_lines
from capture.storage.records import FailedCall, TurnRecord
from capture.trajectory import CallNode
from capture.trajectory.journal import call_from_entry

logger = logging.getLogger(__name__)

_SAFE = re.compile(r"[^A-Za-z0-9_.-]")


def safe_stem(session_id: str) -> str:
    """How a session's journal name, and its shards' names after it, begin: its id with every
    character a path or a glob could read as more than a letter replaced, cut to 80."""
    # Session ids come from the client (the proxy username): never trust them as a path.
    return _SAFE.sub("_", session_id)[:80]


def journal_name(session_id: str) -> str:
    """A new journal file name for ``session_id`` (random: a session can have several)."""
    return safe_stem(session_id) + "-" + os.urandom(4).hex() + ".jsonl"


def append_line(
    journal: Path, entry: dict[str, Any], earlier: Sequence[TurnRecord] = (), fsync: bool = True
) -> None:
    """One journal line, durable (flushed and fsynced) before this returns (``fsync=False``:
    once ``sync_journal`` has run). ``earlier``: the calls this journal holds already
    (capture.storage.journal_lines: a prompt refers to one of them)."""
    line = journal_lines.encode(entry, earlier) + b"\n"
    with open(journal, "ab") as fh:
        fh.write(line)
        fh.flush()
        if fsync:
            os.fsync(fh.fileno())


def safe_text(text: str) -> str:
    """``text`` without lone surrogates (a client's undecodable header bytes, a JSON ``\ud800``):
    they cannot be written to Parquet, so they become U+FFFD before anything is journaled."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-8", "surrogatepass").decode("utf-8", "replace")


def make_text_safe(turn: TurnRecord) -> None:
    # Not session_id: sessions are keyed by it; the gateway makes it safe before anything else.
    for name in ("requested_model", "policy_model", "user_agent", "completion_text"):
        setattr(turn, name, safe_text(getattr(turn, name)))
    turn.metadata = json.loads(safe_text(json.dumps(turn.metadata, ensure_ascii=False)))


def replay(journal: Path) -> tuple[list[TurnRecord], list[FailedCall], dict[str, CallNode]]:
    """What a journal left by an earlier process holds: its calls, its failed calls, and the
    calls' places in their threads (by request id), the lines a crash tore or damaged skipped."""
    turns: list[TurnRecord] = []
    failed: list[FailedCall] = []
    calls: dict[str, CallNode] = {}
    for entry in journal_lines.read(journal):
        try:
            if entry is None:
                raise ValueError("unreadable")
            if "failed" in entry:
                failed.append(FailedCall.from_row(entry["failed"]))
                continue
            turn = entry["record"]
        except Exception:
            # A line cut short by the crash (that call had not completed), or damaged (or
            # its prompt refers to a damaged line).
            logger.warning("skipping a torn or unreadable line in %s", journal)
            continue
        turns.append(turn)
        if entry.get("call"):
            try:
                calls[turn.request_id] = call_from_entry(turn, entry["call"], calls)
            except Exception:
                logger.warning(
                    "%s: the thread placement of call %s cannot be read; the call is kept "
                    "in the turns shard only",
                    journal.name,
                    turn.request_id,
                )
    return turns, failed, calls
