"""Late rewards: rewards set after a session's thread rows were written.

A thread row is never rewritten once written, so a reward that arrives later (a grader that ran
after the session closed) is kept beside the rows, in ``OUT/rewards/``: one small Parquet file per
call of :func:`write_rewards` (written whole under a temporary name, then renamed), one row per
thread, or a single row with ``thread_id`` null for a reward of the whole session. Readers join
them onto the thread rows (:func:`join_rewards`; ``capture.storage.reader.load_threads`` does it by
default): among the late rewards that apply to a row, the one set last wins and replaces the
reward the row was written with, and the row's ``reward_source`` says where it came from (the
file's ``source``: ``late`` for a reward given after the close, ``close`` or ``verifier`` for the
close's own reward given to rows written before it). A ``void`` entry (:func:`void_rewards`)
takes back every reward set before it: the rows it applies to have none (a rollout whose session
someone else closed or rewarded: its rows carry no reward, capture/rollouts/runner.py).

Only files :func:`write_rewards` wrote count: each is listed, with the SHA-256 of its bytes, in
``OUT/rewards/_index.jsonl``, and :func:`load_rewards` ignores (with a warning) a file that is
not listed or whose bytes changed. A file an agent planted in the folder is not a reward.

    write_rewards(Path("OUT"), "sess-1", 1.0)                         # every thread of sess-1
    write_rewards(Path("OUT"), "sess-2", {"t-a": 0.5, "t-b": -1.0})   # per thread
    rows = join_rewards(rows, load_rewards(Path("OUT")))
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import time
import uuid
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from capture.storage.shards import REWARD_LATE, REWARD_SOURCES, rows_to_table, write_table

logger = logging.getLogger(__name__)

REWARDS_DIR = "rewards"
# The files write_rewards wrote: one JSON line each, {"name", "sha256"}.
INDEX_NAME = "_index.jsonl"

REWARD_SCHEMA = pa.schema(
    [
        ("session_id", pa.string()),
        ("thread_id", pa.string()),  # null: every thread of the session
        ("reward", pa.float64()),  # null only in a void entry
        ("set_at", pa.float64()),  # unix seconds
        # Where the reward came from (shards.REWARD_SOURCES, or VOID); null in files written
        # before the column: late.
        ("source", pa.string()),
    ]
)

# A late-rewards entry that takes back every reward set before it for its rows (void_rewards).
VOID = "void"

_ACCEPTED = (
    "a reward is a finite number (e.g. 1.0) or an object mapping thread ids to finite numbers "
    '(e.g. {"t-abc": 1.0, "t-def": 0.0})'
)


def _number(value: object, where: str) -> float:
    """``value`` as a finite float, or a ValueError saying what ``where`` held instead."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{where} is {_describe(value)}, not a number; {_ACCEPTED}")
    try:
        number = float(value)
    except OverflowError:
        raise ValueError(f"{where} is an integer too large for a float64; {_ACCEPTED}") from None
    if not math.isfinite(number):
        raise ValueError(f"{where} is {number!r}; NaN and infinities are not rewards; {_ACCEPTED}")
    return number


def _describe(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"a boolean ({str(value).lower()})"
    if isinstance(value, str):
        return f"a string ({value[:40]!r})"
    if isinstance(value, list | tuple):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return f"a {type(value).__name__}"


def parse_reward(value: object) -> float | dict[str, float]:
    """Validate a reward as decoded from JSON: a number (the whole session) or an object
    ``{thread_id: number}``. Returns a float or a new ``dict[str, float]``.

    Raises ``ValueError``, with a message fit for the user who sent it, for booleans, NaN and
    infinities, strings and other non-numbers, an empty object, non-string or empty keys."""
    if isinstance(value, dict):
        if not value:
            raise ValueError(f"the reward object is empty: it names no thread; {_ACCEPTED}")
        out: dict[str, float] = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise ValueError(
                    f"reward key {key!r} is {_describe(key)}, not a thread id string; {_ACCEPTED}"
                )
            if not key:
                raise ValueError(f"a reward key is the empty string, not a thread id; {_ACCEPTED}")
            out[key] = _number(item, f"the reward for thread {key!r}")
        return out
    return _number(value, "the reward")


def write_rewards(
    out_dir: Path,
    session_id: str,
    reward: float | dict[str, float],
    set_at: float | None = None,
    source: str = REWARD_LATE,
) -> Path:
    """Record a late reward for ``session_id`` in ``out_dir/rewards/``; returns the file written.

    ``reward``: a number (one row, ``thread_id`` null: every thread of the session) or
    ``{thread_id: number}`` (one row per thread). It is validated as by :func:`parse_reward`.
    ``set_at``: unix seconds (default: now); the reward set last wins when several apply.
    ``source``: what the joined rows' ``reward_source`` says (shards.REWARD_SOURCES).
    The file appears whole (temporary name, fsync, rename), named so that sorting the names
    sorts the files by the time they were written."""
    if not isinstance(session_id, str) or not session_id:
        raise ValueError(f"session_id must be a non-empty string, not {session_id!r}")
    if source not in REWARD_SOURCES:
        raise ValueError(f"source must be one of {', '.join(REWARD_SOURCES)}, not {source!r}")
    parsed = parse_reward(reward)
    when = time.time() if set_at is None else _number(set_at, "set_at")
    if isinstance(parsed, dict):
        rows: list[dict[str, Any]] = [
            {"session_id": session_id, "thread_id": t, "reward": r, "set_at": when}
            for t, r in parsed.items()
        ]
    else:
        rows = [{"session_id": session_id, "thread_id": None, "reward": parsed, "set_at": when}]
    return _write(out_dir, [row | {"source": source} for row in rows])


def void_rewards(out_dir: Path, session_id: str) -> Path:
    """Take back every reward set so far for ``session_id``'s rows (at close or late): readers
    that join late rewards see them without one, until a reward set later. Returns the file
    written."""
    if not isinstance(session_id, str) or not session_id:
        raise ValueError(f"session_id must be a non-empty string, not {session_id!r}")
    row = {
        "session_id": session_id,
        "thread_id": None,
        "reward": None,
        "set_at": time.time(),
        "source": VOID,
    }
    return _write(out_dir, [row])


def _write(out_dir: Path, rows: list[dict[str, Any]]) -> Path:
    name = f"rewards-{time.time_ns():020d}-{uuid.uuid4().hex[:12]}.parquet"
    directory = Path(out_dir) / REWARDS_DIR
    path = write_table(directory, rows_to_table(rows, REWARD_SCHEMA), "rewards", name)
    line = json.dumps({"name": name, "sha256": _sha256(path)}) + "\n"
    fd = os.open(directory / INDEX_NAME, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, line.encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    return path


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _index(directory: Path) -> dict[str, str]:
    """File name -> SHA-256 of the files write_rewards wrote (a torn last line is skipped)."""
    try:
        text = (directory / INDEX_NAME).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return {}
    found: dict[str, str] = {}
    for line in text.splitlines():
        try:
            entry = json.loads(line)
            found[str(entry["name"])] = str(entry["sha256"])
        except (ValueError, KeyError, TypeError):
            continue
    return found


def load_rewards(out_dir: Path) -> pa.Table:
    """Every late reward under ``out_dir/rewards/`` as one table of ``REWARD_SCHEMA``, files in
    name order (the order they were written). A missing folder gives an empty table; a file that
    cannot be read, or lacks the columns, is skipped with a warning; temporary and hidden files
    (``.NAME.tmp``, names starting with ``.`` or ``_``) are ignored, and so is a file
    write_rewards did not write (not in its index, or changed since), with a warning."""
    directory = Path(out_dir) / REWARDS_DIR
    tables: list[pa.Table] = []
    if directory.is_dir():
        index = _index(directory)
        for path in sorted(directory.glob("*.parquet")):
            if path.name.startswith((".", "_")) or not path.is_file():
                continue
            expected = index.get(path.name)
            if expected is None or _sha256(path) != expected:
                logger.warning(
                    "ignoring %s: agenttap did not write it (not in %s, or changed since); "
                    "late rewards come through POST /sessions/ID/reward or write_rewards",
                    path,
                    INDEX_NAME,
                )
                continue
            try:
                table = pq.read_table(path)
                if "source" not in table.column_names:  # written before the column: late
                    table = table.append_column("source", pa.nulls(table.num_rows, pa.string()))
                tables.append(table.select(REWARD_SCHEMA.names).cast(REWARD_SCHEMA))
            except Exception as exc:
                logger.warning("skipping unreadable rewards file %s (%s)", path, exc)
    if not tables:
        return REWARD_SCHEMA.empty_table()
    return pa.concat_tables(tables)


def join_rewards(
    rows: list[dict[str, Any]], rewards: pa.Table | Iterable[Mapping[str, Any]]
) -> list[dict[str, Any]]:
    """Thread rows with their late rewards set; returns new row dicts (the inputs are unchanged).

    The late rewards that apply to a row are those for its ``(session_id, thread_id)`` and those
    for its session with ``thread_id`` null. Of these, the one with the greatest ``set_at`` wins
    (at equal ``set_at``, the one later in ``rewards``) and replaces the row's ``reward``, its
    ``source`` the row's ``reward_source`` (``late`` where it has none); a ``void`` entry that
    wins leaves the row without a reward. Rows with none keep theirs. ``rewards``: a table from
    :func:`load_rewards` or dicts with its columns; entries with a null session, a null or
    non-finite reward (but a void one) or ``set_at`` are ignored."""
    items = rewards.to_pylist() if isinstance(rewards, pa.Table) else rewards
    # key -> (set_at, position, reward or None (void), source); a later position wins ties.
    best: dict[tuple[str, str | None], tuple[float, int, float | None, str]] = {}
    ignored = 0
    for position, item in enumerate(items):
        session_id, thread_id = item.get("session_id"), item.get("thread_id")
        reward, set_at = item.get("reward"), item.get("set_at")
        source = item.get("source") or REWARD_LATE
        void = source == VOID and reward is None
        if (
            not isinstance(session_id, str)
            or not (thread_id is None or isinstance(thread_id, str))
            or not (void or is_finite_number(reward))
            or not is_finite_number(set_at)
        ):
            ignored += 1
            continue
        number = None if void else float(reward)  # type: ignore[arg-type]
        candidate = (float(set_at), position, number, str(source))
        key = (session_id, thread_id)
        if key not in best or candidate[:2] > best[key][:2]:
            best[key] = candidate
    if ignored:
        logger.warning("ignored %d late reward(s) with a missing or invalid field", ignored)
    out: list[dict[str, Any]] = []
    for row in rows:
        session_id, thread_id = row.get("session_id"), row.get("thread_id")
        found: list[tuple[float, int, float | None, str]] = []
        if isinstance(session_id, str):
            for key in (
                (session_id, thread_id if isinstance(thread_id, str) else None),
                (session_id, None),
            ):
                if key in best:
                    found.append(best[key])
        new = dict(row)
        if found:
            _, _, reward, source = max(found, key=lambda c: c[:2])
            new["reward"] = reward
            new["reward_source"] = source if reward is not None else None
        out.append(new)
    return out


def is_finite_number(value: object) -> bool:
    """A JSON number (not a bool) that is finite as a float: an int past float64's range is
    not (``math.isfinite`` would raise on it)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int beyond float64
        return False
