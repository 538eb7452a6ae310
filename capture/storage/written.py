"""What this process has written per session: its shards (the thread shards apart: the rows
returned at close), and how many of its calls are in shards, so that a session written (idle,
flushed, recovered) and going on keeps counting its turns."""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path
from typing import Any

from capture.storage.shards import (
    FAILED_SCHEMA,
    THREAD_SCHEMA,
    TURN_SCHEMA,
    rewrite_rows,
    written_turn_counts,
)

# Sessions whose written shards are remembered (for the rows returned at close).
WRITTEN_KEPT = 10_000


class WrittenShards:
    """The shards written per session under one OUT folder's ``turns/``, ``threads/`` and
    ``failed/``, most recent session last, and the calls sharded per session id."""

    def __init__(self, turns_dir: Path, threads_dir: Path, failed_dir: Path) -> None:
        self.turns_dir = turns_dir
        self.threads_dir = threads_dir
        self.failed_dir = failed_dir
        # Calls already sharded per session id: a scaffold that pauses past the idle timeout
        # and goes on under the same session keeps counting, never reusing a turn index.
        self._turns: dict[str, int] = {}
        # Thread shards written per session so far (see threads).
        self._threads: OrderedDict[str, list[Path]] = OrderedDict()
        # Every shard (turns, threads, failed) written per session so far (see rename).
        self._all: OrderedDict[str, list[Path]] = OrderedDict()

    def knows(self, session_id: str) -> bool:
        """Whether shards of ``session_id`` were written (by this process, or counted)."""
        return session_id in self._threads or session_id in self._turns

    def turns(self, session_id: str) -> int:
        """How many of the session's calls are in shards."""
        return self._turns.get(session_id, 0)

    def count(self, session_id: str, done: int) -> None:
        """At least ``done`` of the session's calls are in shards."""
        self._turns[session_id] = max(self._turns.get(session_id, 0), done)

    def count_from_shards(self) -> None:
        """Turn indices the shards of earlier processes hold: a session written before a restart
        (idle, flushed, or recovered then) and going on after it keeps counting."""
        for session_id, done in written_turn_counts(self.turns_dir).items():
            self.count(session_id, done)

    def add(self, session_id: str, paths: list[Path], calls: int) -> None:
        """``paths`` were written for ``session_id``, holding ``calls`` more of its calls."""
        for kept, written in (
            (self._threads, [p for p in paths if p.parent == self.threads_dir]),
            (self._all, paths),
        ):
            kept.setdefault(session_id, []).extend(written)
            kept.move_to_end(session_id)
            while len(kept) > WRITTEN_KEPT:
                kept.popitem(last=False)
        self._turns[session_id] = self._turns.get(session_id, 0) + calls

    def threads(self, session_id: str, forget: bool = False) -> list[Path]:
        """The thread shards written for ``session_id`` (shards hold rows of one session each);
        ``forget``: the session is over, stop remembering them."""
        if forget:
            return self._threads.pop(session_id, [])
        return list(self._threads.get(session_id, []))

    def rename(self, session_id: str, new_id: str) -> int:
        """Rewrite every shard written for ``session_id`` with ``session_id`` ``new_id``, and
        remember them as ``new_id``'s (its turns stay counted under ``session_id``: the id goes
        on counting). Returns how many calls (turns rows) moved."""
        self._threads.pop(session_id, None)
        schemas = {
            self.turns_dir: TURN_SCHEMA,
            self.threads_dir: THREAD_SCHEMA,
            self.failed_dir: FAILED_SCHEMA,
        }
        moved = 0
        rewritten: list[Path] = []

        def rename(row: dict[str, Any]) -> None:
            row["session_id"] = new_id

        for path in self._all.pop(session_id, []):
            rows = rewrite_rows(path, schemas[path.parent], rename)
            if path.parent == self.turns_dir:
                moved += rows
            rewritten.append(path)
        if rewritten:
            self._all.setdefault(new_id, []).extend(rewritten)
            self._threads.setdefault(new_id, []).extend(
                p for p in rewritten if p.parent == self.threads_dir
            )
        return moved
