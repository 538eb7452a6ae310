"""Sessions: the calls of one scaffold run, journaled as they complete, sharded when it ends.

Durability: every completed call is appended to the session's journal (one JSON line, flushed and
fsynced) before the client's response finishes. The line holds the call's record and how it
changed its thread (what was kept, what replaced the rest), so threads can be rebuilt from the
journal alone. A session becomes Parquet shards (``turns/`` one row per call, ``threads/`` one
training row per thread) when it has been idle for ``idle_timeout_s`` or the proxy stops; only
then is its journal removed. A proxy killed with ``kill -9`` leaves journals behind, and the next
start turns them into shards.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from capture.records import SCHEMA_VERSION, TurnRecord
from capture.shards import THREAD_SCHEMA, TURN_SCHEMA, write_rows
from capture.trajectory import Assembly, Renderer, Thread, ThreadSet, TurnSpan
from rewriter.canonical import ChatRequest, Message

logger = logging.getLogger(__name__)

# Sessions whose threads are kept after an idle flush (about 58 bytes per token each).
DORMANT_SESSIONS = 64
_SAFE = re.compile(r"[^A-Za-z0-9_.-]")


def _journal_name(session_id: str) -> str:
    # Session ids come from the client (the proxy username): never trust them as a path.
    return _SAFE.sub("_", session_id)[:80] + "-" + os.urandom(4).hex() + ".jsonl"


@dataclass
class Session:
    session_id: str
    journal_path: Path
    threads: ThreadSet | None
    turns: list[TurnRecord] = field(default_factory=list)
    last_active: float = field(default_factory=time.monotonic)


class SessionStore:
    def __init__(
        self,
        out_dir: Path,
        renderer: Renderer | None = None,
        idle_timeout_s: float = 300.0,
        recompute: bool = True,
    ) -> None:
        self.out_dir = out_dir
        self.renderer = renderer
        self.idle_timeout_s = idle_timeout_s
        self.recompute = recompute
        self.journal_dir = out_dir / "journal"
        self.turns_dir = out_dir / "turns"
        self.threads_dir = out_dir / "threads"
        self.journal_dir.mkdir(parents=True, exist_ok=True)
        self._sessions: dict[str, Session] = {}
        # Calls already sharded per session id: a scaffold that pauses past the idle timeout
        # and goes on under the same session keeps counting, never reusing a turn index.
        self._sharded_turns: dict[str, int] = {}
        # Threads of sessions flushed while idle, most recent last (see end_session).
        self._dormant: OrderedDict[str, ThreadSet] = OrderedDict()

    def session(self, session_id: str) -> Session:
        sess = self._sessions.get(session_id)
        if sess is None:
            threads = self._dormant.pop(session_id, None) or (
                ThreadSet(session_id, self.renderer, self.recompute) if self.renderer else None
            )
            sess = Session(session_id, self.journal_dir / _journal_name(session_id), threads)
            self._sessions[session_id] = sess
        return sess

    def next_turn_index(self, session_id: str) -> int:
        return self._sharded_turns.get(session_id, 0) + len(self.session(session_id).turns)

    def assemble(self, session_id: str, chat: ChatRequest) -> Assembly:
        threads = self.session(session_id).threads
        assert threads is not None, "SessionStore needs a renderer to assemble prompts"
        return threads.assemble(chat.messages, chat.tools, chat.enable_thinking)

    def record(
        self, turn: TurnRecord, assembly: Assembly | None = None, reply: Message | None = None
    ) -> None:
        """Make ``turn`` durable (journal + fsync) and apply it to its thread."""
        sess = self.session(turn.session_id)
        entry: dict[str, Any] = {}
        if assembly is not None and reply is not None and sess.threads is not None:
            thread = sess.threads.commit(
                assembly,
                reply,
                turn.completion_ids,
                turn.completion_logprobs,
                request_id=turn.request_id,
                turn_index=turn.turn_index,
                finish_reason=turn.finish_reason,
                latency_s=turn.latency_s,
                backend=turn.backend,
            )
            turn.thread_id = thread.thread_id
            turn.metadata["assembly"] = assembly.kind
            forked = thread is not assembly.thread
            entry = {
                "thread_id": thread.thread_id,
                "parent_thread_id": thread.parent_thread_id,
                "parent_tool_call_id": thread.parent_tool_call_id,
                # A fork starts from the prompt's kept prefix, all prompt tokens.
                "forked_prefix_logprobs": thread.logprobs[: assembly.base] if forked else None,
                "suffix_logprobs": assembly.suffix_logprobs,
                "suffix_provenance": [int(p) for p in assembly.suffix_provenance],
                "base": assembly.base,
                "spans": [[t.start, t.end, t.dropped] for t in thread.turns],
            }
        line = json.dumps({"turn": turn.to_row(), "thread": entry}, separators=(",", ":")) + "\n"
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
        return [p for s in idle for p in self.end_session(s.session_id, keep_threads=True)]

    def end_session(self, session_id: str, keep_threads: bool = False) -> list[Path]:
        """Write the session's shards. ``keep_threads``: the session may go on (idle flush), so
        its threads stay in memory and a later call extends their exact ids."""
        sess = self._sessions.pop(session_id, None)
        if sess is None or not sess.turns:
            return []
        threads = sess.threads.seal() if sess.threads else []
        if keep_threads and sess.threads is not None:
            self._dormant[session_id] = sess.threads
            self._dormant.move_to_end(session_id)
            while len(self._dormant) > DORMANT_SESSIONS:
                self._dormant.popitem(last=False)
        paths = self._write(sess.turns, threads, sess.journal_path.stem)
        self._sharded_turns[session_id] = self._sharded_turns.get(session_id, 0) + len(sess.turns)
        sess.journal_path.unlink(missing_ok=True)
        logger.info(
            "session %r ended: %d calls in %d threads written to %s",
            session_id,
            len(sess.turns),
            len(threads),
            self.out_dir,
        )
        return paths

    def _write(self, turns: list[TurnRecord], threads: list[Thread], batch: str) -> list[Path]:
        """Shards named after the journal (``batch``) they come from; the journal is removed only
        after they are all in place. A crash in between leaves the journal, and recovery writes
        the same names again: every row ends up exactly once."""
        by_request = {t.request_id: t for t in turns}
        turn_rows = [_turn_row(t) for t in turns]
        paths = write_rows(self.turns_dir, turn_rows, TURN_SCHEMA, "turns", batch=batch)
        rows = [thread_row(th, by_request) for th in threads if th.turns]
        if rows:
            paths += write_rows(self.threads_dir, rows, THREAD_SCHEMA, "threads", batch=batch)
        return paths

    def close(self) -> list[Path]:
        return [p for sid in list(self._sessions) for p in self.end_session(sid)]

    # -- recovery after a crash ------------------------------------------------------------
    def recover(self) -> list[Path]:
        """Turn journals left by an earlier process into shards. Call before serving."""
        written: list[Path] = []
        for journal in sorted(self.journal_dir.glob("*.jsonl")):
            try:
                written += self._recover_one(journal)
            except Exception:
                # One unreadable journal must not stop the proxy or the other journals.
                quarantine = self.journal_dir / "quarantine"
                quarantine.mkdir(exist_ok=True)
                os.replace(journal, quarantine / journal.name)
                logger.exception(
                    "could not recover %s; moved it to %s for inspection", journal.name, quarantine
                )
        return written

    def _recover_one(self, journal: Path) -> list[Path]:
        written: list[Path] = []
        turns: list[TurnRecord] = []
        threads: dict[str, Thread] = {}
        for line in journal.read_text(encoding="utf-8").splitlines():
            try:
                entry = json.loads(line)
                turn = TurnRecord.from_row(entry["turn"])
            except (json.JSONDecodeError, TypeError, KeyError):
                # A line cut short by the crash: that call had not completed.
                logger.warning("skipping a torn line in %s", journal)
                continue
            turns.append(turn)
            if entry.get("thread"):
                _replay(threads, turn, entry["thread"])
        if turns:
            written += self._write(turns, list(threads.values()), journal.stem)
            logger.info("recovered %d calls from %s", len(turns), journal.name)
        journal.unlink()
        return written


def _replay(threads: dict[str, Thread], turn: TurnRecord, delta: dict[str, Any]) -> None:
    """Apply one journaled call to its thread, as ``ThreadSet.commit`` did live."""
    thread = threads.get(delta["thread_id"])
    if thread is None:
        thread = Thread(
            thread_id=delta["thread_id"],
            session_id=turn.session_id,
            header=(),
            parent_thread_id=delta.get("parent_thread_id"),
            parent_tool_call_id=delta.get("parent_tool_call_id"),
        )
        threads[thread.thread_id] = thread
    base = delta["base"]
    if delta.get("forked_prefix_logprobs") is not None:  # forked from its parent
        thread.ids = list(turn.prompt_ids[:base])
        thread.logprobs = list(delta["forked_prefix_logprobs"])
        thread.provenance = [0] * base
    thread.ids[base:] = turn.prompt_ids[base:]
    thread.logprobs[base:] = delta["suffix_logprobs"]
    thread.provenance[base:] = delta["suffix_provenance"]
    thread.ids.extend(turn.completion_ids)
    thread.logprobs.extend(turn.completion_logprobs)
    thread.provenance.extend([1] * len(turn.completion_ids))
    thread.turns.append(
        TurnSpan(
            turn.request_id, turn.turn_index, 0, 0, turn.finish_reason, turn.latency_s, turn.backend
        )
    )
    for span, (start, end, dropped) in zip(thread.turns, delta["spans"], strict=True):
        span.start, span.end, span.dropped = start, end, dropped


def thread_row(thread: Thread, by_request: dict[str, TurnRecord]) -> dict[str, Any]:
    first = by_request.get(thread.turns[0].request_id)
    return {
        "schema_version": SCHEMA_VERSION,
        "session_id": thread.session_id,
        "thread_id": thread.thread_id,
        "parent_thread_id": thread.parent_thread_id,
        "parent_tool_call_id": thread.parent_tool_call_id,
        "input_ids": thread.ids,
        "loss_mask": thread.loss_mask(),
        "logprobs": thread.logprobs,
        "provenance": thread.provenance,
        "turns": [t.to_row() for t in thread.turns],
        "num_turns": len(thread.turns),
        "protocol": first.protocol if first else None,
        "user_agent": first.user_agent if first else None,
        "reward": None,
        "metadata": None,
    }


def _turn_row(turn: TurnRecord) -> dict[str, Any]:
    row = turn.to_row()
    row["metadata"] = json.dumps(row["metadata"])
    return row
