"""Where the trajectory viewer's rows come from: the ``RowSource`` protocol, and ``ShardSource``,
an output folder's shards re-read when they change (the proxy adds its live sessions' unwritten
rows: ``capture.viewer.http.LiveSource``)."""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import pyarrow as pa
import pyarrow.compute as pc

from capture.storage.advantages import ADVANTAGES_FILE, load_advantages
from capture.storage.out_folder import nearby_outs
from capture.storage.rewards import join_rewards, load_rewards
from capture.storage.shards import TURN_SCHEMA

if TYPE_CHECKING:
    import pyarrow.dataset as ds

# Thread-row columns the session list and the tree need (not the token lists).
_ROW_META = (
    "session_id",
    "thread_id",
    "parent_thread_id",
    "parent_relation",
    "parent_tool_call_id",
    "dead",
    "dead_reason",
    "superseded_by",
    "num_turns",
    "protocol",
    "user_agent",
    "reward",
    "metadata",
    "end_reason",
    "metrics",
    "turns",
    "weight_versions",
)


class RowSource(Protocol):
    def summaries(self) -> list[dict[str, Any]]:
        """Every thread row without its token lists, plus ``tokens`` and ``trained_tokens``."""

    def threads(self, session_id: str) -> list[dict[str, Any]]:
        """A session's thread rows, whole (late rewards joined)."""

    def turns(self, session_id: str) -> list[dict[str, Any]]:
        """A session's turns rows (one per call)."""

    def advantages(self) -> dict[str, dict[str, Any]]:
        """The trainer's own advantages, by session (``OUT/advantages.jsonl``)."""


def _files_key(directory: Path) -> tuple[tuple[str, int, int], ...]:
    if not directory.is_dir():
        return ()
    out = []
    for p in sorted(directory.glob("*.parquet")):
        if p.name.startswith((".", "_")):
            continue
        try:
            st = p.stat()
        except FileNotFoundError:
            continue
        out.append((p.name, st.st_mtime_ns, st.st_size))
    return tuple(out)


class ShardSource:
    """An output folder's shards (``threads/``, ``turns/``, ``rewards/``), re-read when its
    files change. Whole rows are read per session and a few sessions are kept."""

    def __init__(self, out_dir: str | Path, keep_sessions: int = 8) -> None:
        self.out_dir = Path(out_dir)
        self._lock = threading.Lock()
        self._keep = keep_sessions
        self._summary: tuple[Any, list[dict[str, Any]]] | None = None
        self._rows: OrderedDict[tuple[str, str, Any], list[dict[str, Any]]] = OrderedDict()
        self._advantages: tuple[Any, dict[str, dict[str, Any]]] | None = None

    def _dataset(self, folder: str, schema: pa.Schema | None = None) -> ds.Dataset | None:
        directory = self.out_dir / folder
        if not _files_key(directory):
            return None
        files = [str(directory / name) for name, _, _ in _files_key(directory)]
        # Imported at first use: pyarrow.dataset brings pandas (0.4 s at every proxy's start).
        import pyarrow.dataset as ds

        return ds.dataset(files, format="parquet", schema=schema)

    def _key(self, folder: str) -> Any:
        return (_files_key(self.out_dir / folder), _files_key(self.out_dir / "rewards"))

    def summaries(self) -> list[dict[str, Any]]:
        # The summaries carry the sessions' call times, read from the turns.
        key = (self._key("threads"), _files_key(self.out_dir / "turns"))
        with self._lock:
            if self._summary is not None and self._summary[0] == key:
                return self._summary[1]
        dataset = self._dataset("threads")
        rows: list[dict[str, Any]] = []
        if dataset is not None:
            names = set(dataset.schema.names)
            table = dataset.to_table(
                columns=[c for c in (*_ROW_META, "input_ids", "loss_mask") if c in names]
            )
            tokens = pc.list_value_length(table["input_ids"]).to_pylist()
            masks = table["loss_mask"].to_pylist()
            table = table.drop_columns(["input_ids", "loss_mask"])
            rows = table.to_pylist()
            for row, n, mask in zip(rows, tokens, masks, strict=True):
                row["tokens"] = n or 0
                row["trained_tokens"] = sum(mask or ())
            rows = join_rewards(rows, load_rewards(self.out_dir))
            times = self._call_times()
            for row in rows:
                span = times.get(row["session_id"])
                if span is not None:
                    row["started_at"], row["ended_at"] = span
        with self._lock:
            self._summary = (key, rows)
        return rows

    def advantages(self) -> dict[str, dict[str, Any]]:
        """The trainer's own advantages (capture/storage/advantages.py), re-read when the file
        changes."""
        try:
            st = (self.out_dir / ADVANTAGES_FILE).stat()
            key: Any = (st.st_mtime_ns, st.st_size)
        except FileNotFoundError:
            return {}
        with self._lock:
            if self._advantages is not None and self._advantages[0] == key:
                return self._advantages[1]
        found = load_advantages(self.out_dir)
        with self._lock:
            self._advantages = (key, found)
        return found

    def _call_times(self) -> dict[str, tuple[float, float]]:
        """Each session's first call's start and last call's end (unix seconds), from its turns:
        the run view's time per step."""
        dataset = self._dataset("turns", TURN_SCHEMA)
        if dataset is None:
            return {}
        table = dataset.to_table(columns=["session_id", "started_at", "latency_s"])
        ends = pc.add(table["started_at"], pc.fill_null(table["latency_s"], 0.0))
        table = table.append_column("ended_at", ends)
        spans = table.group_by("session_id").aggregate([("started_at", "min"), ("ended_at", "max")])
        return {
            sid: (start, end)
            for sid, start, end in zip(
                spans["session_id"].to_pylist(),
                spans["started_at_min"].to_pylist(),
                spans["ended_at_max"].to_pylist(),
                strict=True,
            )
            if sid is not None and start is not None and end is not None
        }

    def _session_rows(self, folder: str, session_id: str) -> list[dict[str, Any]]:
        key = (folder, session_id, self._key(folder))
        with self._lock:
            if key in self._rows:
                self._rows.move_to_end(key)
                return self._rows[key]
        dataset = self._dataset(folder, TURN_SCHEMA if folder == "turns" else None)
        rows: list[dict[str, Any]] = []
        if dataset is not None:
            rows = dataset.to_table(filter=pc.field("session_id") == session_id).to_pylist()
        if folder == "threads" and rows:
            rows = join_rewards(rows, load_rewards(self.out_dir))
        with self._lock:
            self._rows[key] = rows
            while len(self._rows) > self._keep:
                self._rows.popitem(last=False)
        return rows

    def threads(self, session_id: str) -> list[dict[str, Any]]:
        return self._session_rows("threads", session_id)

    def turns(self, session_id: str) -> list[dict[str, Any]]:
        return self._session_rows("turns", session_id)


def json_column(text: Any) -> Any:
    """A JSON text column (``metadata``, ``metrics``) decoded; None when empty, the text when
    it is not JSON."""
    if not isinstance(text, str) or not text:
        return None
    try:
        return json.loads(text)
    except ValueError:
        return text


class OtherRuns:
    """The output folders a run is compared with (``GET /ui/api/run?compare=PATH``), each read
    as a ``ShardSource`` and kept for the next asks (the ``keep`` last ones)."""

    def __init__(self, keep: int = 4) -> None:
        self._keep = keep
        self._lock = threading.Lock()
        self._sources: OrderedDict[Path, ShardSource] = OrderedDict()

    def source(self, folder: str) -> ShardSource:
        """``folder``'s shards; ValueError, naming what to give, when it holds none."""
        path = Path(folder).expanduser().resolve()
        if not (path / "threads").is_dir():
            raise ValueError(
                f"compare={folder}: not an agenttap output folder (no threads/ in it): give "
                f"the folder another run wrote (its agenttap_out){nearby_outs(path)}"
            )
        with self._lock:
            found = self._sources.pop(path, None) or ShardSource(path)
            self._sources[path] = found
            while len(self._sources) > self._keep:
                self._sources.popitem(last=False)
        return found
