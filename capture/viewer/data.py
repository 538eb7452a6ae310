"""What the trajectory viewer shows, as plain data (no HTTP here: see capture/viewer/http.py).

Sessions -> the tree of their thread rows -> one row's tokens (decoded, with loss mask,
provenance and logprobs) and its calls -> the diff of two calls of one conversation.

Rows come from a ``RowSource``: ``ShardSource`` reads an output folder's shards (the offline
viewer, and what a running proxy has written); the proxy adds its live sessions' unwritten rows
(``capture.viewer.http.LiveSource``).
"""

from __future__ import annotations

import difflib
import json
import math
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds

from capture.storage.rewards import join_rewards, load_rewards
from capture.storage.shards import TURN_SCHEMA
from rewriter.parsers import OutputParser

# Tokens per page of a row: a 100k-token row is fetched and drawn a page at a time.
PAGE_TOKENS = 2000
MAX_PAGE_TOKENS = 20_000
# Equal stretches of a diff longer than this many tokens are shown shortened (ends kept).
DIFF_CONTEXT_TOKENS = 40

PROVENANCE = ("prompt", "sampled", "recomputed", "stale")
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

Decode = Callable[[Sequence[int]], list[str]]


def ids_only(ids: Sequence[int]) -> list[str]:
    """The decoder when no tokenizer is given: each token shown as its id."""
    return [f"⟨{i}⟩" for i in ids]


def tokenizer_decoder(tokenizer: Any) -> Decode:
    """Each token's own text (a byte-level token that is part of a character shows as the
    replacement character, as the tokenizer decodes it alone)."""

    def decode(ids: Sequence[int]) -> list[str]:
        pieces = tokenizer.convert_ids_to_tokens(list(ids))
        return [
            tokenizer.convert_tokens_to_string([p]) if p is not None else f"⟨{i}⟩"
            for i, p in zip(ids, pieces, strict=True)
        ]

    return decode


def load_decoder(tokenizer_path: str | Path | None) -> Decode:
    if tokenizer_path is None:
        return ids_only
    from rewriter.template import ChatTemplate

    return tokenizer_decoder(ChatTemplate(tokenizer_path).tokenizer)


# -- sources -----------------------------------------------------------------------------------
class RowSource(Protocol):
    def summaries(self) -> list[dict[str, Any]]:
        """Every thread row without its token lists, plus ``tokens`` and ``trained_tokens``."""

    def threads(self, session_id: str) -> list[dict[str, Any]]:
        """A session's thread rows, whole (late rewards joined)."""

    def turns(self, session_id: str) -> list[dict[str, Any]]:
        """A session's turns rows (one per call)."""


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

    def _dataset(self, folder: str, schema: pa.Schema | None = None) -> ds.Dataset | None:
        directory = self.out_dir / folder
        if not _files_key(directory):
            return None
        files = [str(directory / name) for name, _, _ in _files_key(directory)]
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
            rows = dataset.to_table(filter=ds.field("session_id") == session_id).to_pylist()
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


# -- sessions ----------------------------------------------------------------------------------
def _json(text: Any) -> Any:
    if not isinstance(text, str) or not text:
        return None
    try:
        return json.loads(text)
    except ValueError:
        return text


def _versions(rows: list[dict[str, Any]]) -> list[str]:
    """The weight versions that sampled a session's tokens, in the order its rows name them."""
    seen: dict[str, None] = {}
    for row in rows:
        for span in row.get("weight_versions") or ():
            if span.get("version") is not None:
                seen.setdefault(str(span["version"]), None)
    return list(seen)


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def session_list(
    summaries: list[dict[str, Any]], live: dict[str, dict[str, Any]] | None = None
) -> list[dict[str, Any]]:
    """One entry per session: its rows, calls, tokens, reward(s), metadata and end reason;
    ``live``: the proxy's live sessions (calls, tokens, last activity, backend) by id, listed
    even before they have rows. ``status``: ``live`` while calls can still come, else its end
    reason (``open``: rows written, never closed); ``versions``: the weight versions that
    sampled it; ``started_at`` / ``ended_at``: its first call's start, its last call's end."""
    live = live or {}
    by_session: dict[str, list[dict[str, Any]]] = {}
    for row in summaries:
        by_session.setdefault(row["session_id"], []).append(row)
    out = []
    for sid in sorted(set(by_session) | set(live)):
        rows = by_session.get(sid, [])
        rewards = sorted({r["reward"] for r in rows if r.get("reward") is not None})
        metadata = next((_json(r.get("metadata")) for r in rows if r.get("metadata")), None)
        state = live.get(sid)
        if metadata is None and state is not None:
            metadata = state.get("metadata") or None
        is_live = state is not None and not state.get("closed", False)
        end_reason = next((r["end_reason"] for r in rows if r.get("end_reason")), None)
        metrics = next((_json(r.get("metrics")) for r in rows if r.get("metrics")), None)
        starts = [r["started_at"] for r in rows if r.get("started_at") is not None]
        ends = [r["ended_at"] for r in rows if r.get("ended_at") is not None]
        if state is not None:
            starts.append(state.get("opened_at") or 0.0)
            ends.append(state.get("last_active_at") or 0.0)
        out.append(
            {
                "id": sid,
                "live": is_live,
                "state": state,
                "status": "live" if is_live else (end_reason or "open"),
                "rows": len(rows),
                "dead_rows": sum(1 for r in rows if r.get("dead")),
                "calls": sum(int(r.get("num_turns") or 0) for r in rows),
                "tokens": sum(int(r.get("tokens") or 0) for r in rows),
                "trained_tokens": sum(int(r.get("trained_tokens") or 0) for r in rows),
                "reward": rewards[0] if len(rewards) == 1 else (rewards or None),
                "metadata": metadata,
                "end_reason": end_reason,
                "protocols": sorted({r["protocol"] for r in rows if r.get("protocol")}),
                "versions": _versions(rows),
                "started_at": min((t for t in starts if t), default=None),
                "ended_at": max((t for t in ends if t), default=None),
                "wall_s": metrics.get("wall_time_s") if isinstance(metrics, dict) else None,
            }
        )
    return out


def reward_of(session: dict[str, Any]) -> float | None:
    """One number for a session's reward (its rows' rewards' mean where they differ)."""
    reward = session.get("reward")
    if isinstance(reward, list):
        return _mean(reward)
    return float(reward) if reward is not None else None


# -- finding sessions among thousands ----------------------------------------------------------
# Keys the list sorts and filters by that are the session's own fields; any other key is read
# from its metadata (trainer_step, task, group_id...).
SESSION_FIELDS = (
    "id",
    "status",
    "reward",
    "rows",
    "calls",
    "tokens",
    "trained_tokens",
    "end_reason",
    "started_at",
    "ended_at",
    "version",
)
DEFAULT_PAGE = 100
MAX_PAGE = 1000


def session_value(session: dict[str, Any], key: str) -> Any:
    """``key`` of a session: one of SESSION_FIELDS, else its metadata's ``key`` (None if
    missing); ``version``: the newest weight version that sampled it."""
    if key == "reward":
        return reward_of(session)
    if key == "version":
        versions = session.get("versions") or []
        return versions[-1] if versions else None
    if key in SESSION_FIELDS:
        return session.get(key)
    meta = session.get("metadata")
    return meta.get(key) if isinstance(meta, dict) else None


def _order(value: Any) -> tuple[int, float, tuple[tuple[int, Any], ...]]:
    """Sorts mixed values: numbers by value (numeric strings too: step "10" after "9"), then
    text in natural order ("v2" before "v10"), then the missing ones last."""
    if value is None:
        return (2, 0.0, ())
    if isinstance(value, bool | int | float):
        return (0, float(value), ())
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
    try:
        return (0, float(text), ())
    except ValueError:
        parts = re.split(r"(\d+)", text)
        return (1, 0.0, tuple((1, int(p)) if p.isdecimal() else (0, p) for p in parts))


def _text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return json.dumps(value, sort_keys=True)


def metadata_keys(sessions: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The metadata keys the sessions carry, with how many carry each and (up to 50) their
    distinct values: what the list offers to sort and filter by."""
    keys: dict[str, dict[str, int]] = {}
    for session in sessions:
        meta = session.get("metadata")
        if not isinstance(meta, dict):
            continue
        for key, value in meta.items():
            values = keys.setdefault(key, {})
            values[_text(value)] = values.get(_text(value), 0) + 1
    return [
        {
            "key": key,
            "sessions": sum(values.values()),
            "values": sorted(values, key=_order)[:50],
            "distinct": len(values),
        }
        for key, values in sorted(keys.items())
    ]


def default_sort(sessions: list[dict[str, Any]]) -> str:
    """Newest training step first where sessions carry ``trainer_step``, else newest first."""
    if any(session_value(s, "trainer_step") is not None for s in sessions):
        return "trainer_step"
    return "started_at"


def query_sessions(
    sessions: list[dict[str, Any]],
    sort: str | None = None,
    descending: bool = True,
    filters: Sequence[tuple[str, str]] = (),
    search: str = "",
    offset: int = 0,
    limit: int = DEFAULT_PAGE,
) -> dict[str, Any]:
    """A page of ``sessions``: those whose every ``(key, value)`` filter matches (the value as
    the list shows it: ``trainer_step`` ``3``, ``group_id`` ``g-7``) and whose id contains
    ``search``, sorted by ``sort`` (a field or a metadata key; ties by group, index, id).
    A ValueError for an offset or limit out of range."""
    if offset < 0 or limit < 1 or limit > MAX_PAGE:
        raise ValueError(f"offset must be 0 or more and limit 1..{MAX_PAGE}; got {offset}, {limit}")
    sort = sort or default_sort(sessions)
    needle = search.strip().lower()
    matched = [
        s
        for s in sessions
        if (not needle or needle in s["id"].lower())
        and all(_text(session_value(s, k)) == v for k, v in filters)
    ]

    def tie(s: dict[str, Any]) -> tuple[Any, ...]:
        return (
            _order(session_value(s, "group_id")),
            _order(session_value(s, "index")),
            s["id"],
        )

    matched.sort(key=tie)
    # Missing values stay last whichever way the list is sorted.
    present = [s for s in matched if session_value(s, sort) is not None]
    missing = [s for s in matched if session_value(s, sort) is None]
    present.sort(key=lambda s: _order(session_value(s, sort)), reverse=descending)
    ordered = present + missing
    return {
        "total": len(sessions),
        "matched": len(matched),
        "offset": offset,
        "limit": limit,
        "sort": sort,
        "descending": descending,
        "filters": [list(f) for f in filters],
        "search": search,
        "sessions": ordered[offset : offset + limit],
    }


# -- the run: per step, per group ---------------------------------------------------------------
RUN_BY = ("trainer_step", "version")


def _stats(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "std": None, "min": None, "max": None}
    mean = sum(values) / len(values)
    var = sum((v - mean) ** 2 for v in values) / len(values)
    return {"mean": mean, "std": var**0.5, "min": min(values), "max": max(values)}


def run_by_default(sessions: list[dict[str, Any]]) -> str:
    """``trainer_step`` where the sessions carry it, else the weight version."""
    if any(session_value(s, "trainer_step") is not None for s in sessions):
        return "trainer_step"
    return "version"


def run_summary(sessions: list[dict[str, Any]], by: str | None = None) -> dict[str, Any]:
    """The run at a glance, one point per step (the sessions' ``by``: ``trainer_step``, the
    weight ``version``, or any metadata key): its sessions, their reward's mean, spread
    (standard deviation), min and max, its sessions per status, tokens (all, trained), calls,
    and time (first call's start to last call's end over its sessions, seconds). Sessions
    without the key are counted apart (``unstepped``)."""
    by = by or run_by_default(sessions)
    steps: dict[str, list[dict[str, Any]]] = {}
    labels: dict[str, Any] = {}
    unstepped = 0
    for session in sessions:
        value = session_value(session, by)
        if value is None:
            unstepped += 1
            continue
        steps.setdefault(_text(value), []).append(session)
        labels[_text(value)] = value
    statuses: dict[str, int] = {}
    points = []
    for key in sorted(steps, key=lambda k: _order(labels[k])):
        group = steps[key]
        rewards = [r for r in (reward_of(s) for s in group) if r is not None]
        count: dict[str, int] = {}
        for s in group:
            count[s["status"]] = count.get(s["status"], 0) + 1
            statuses[s["status"]] = statuses.get(s["status"], 0) + 1
        starts = [s["started_at"] for s in group if s.get("started_at")]
        ends = [s["ended_at"] for s in group if s.get("ended_at")]
        points.append(
            {
                "step": key,
                "sessions": len(group),
                "rewarded": len(rewards),
                "reward": _stats(rewards),
                "statuses": count,
                "tokens": sum(s["tokens"] for s in group),
                "trained_tokens": sum(s["trained_tokens"] for s in group),
                "calls": sum(s["calls"] for s in group),
                "time_s": max(ends) - min(starts) if starts and ends else None,
                "groups": len({_text(session_value(s, "group_id")) for s in group}),
            }
        )
    return {
        "by": by,
        "sessions": len(sessions),
        "unstepped": unstepped,
        "statuses": sorted(statuses, key=lambda k: -statuses[k]),
        "steps": points,
    }


def group_list(sessions: list[dict[str, Any]], key: str = "group_id") -> list[dict[str, Any]]:
    """The sessions by group (their metadata's ``group_id``: a GRPO group, one rollout's
    ``n`` runs): its step, size, reward mean and spread, statuses; newest step first."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for session in sessions:
        value = session_value(session, key)
        if value is not None:
            groups.setdefault(_text(value), []).append(session)
    out = []
    for gid, members in groups.items():
        rewards = [r for r in (reward_of(s) for s in members) if r is not None]
        steps = {
            _text(v) for v in (session_value(s, "trainer_step") for s in members) if v is not None
        }
        statuses: dict[str, int] = {}
        for s in members:
            statuses[s["status"]] = statuses.get(s["status"], 0) + 1
        out.append(
            {
                "id": gid,
                "trainer_step": ", ".join(sorted(steps, key=_order)) or None,
                "n": len(members),
                "reward": _stats(rewards),
                "statuses": statuses,
                "started_at": min(
                    (s["started_at"] for s in members if s.get("started_at")), default=None
                ),
            }
        )
    # Newest step first; groups without a step after them.
    out.sort(key=lambda g: (_order(g["started_at"]), g["id"]), reverse=True)
    stepped = [g for g in out if g["trainer_step"] is not None]
    stepped.sort(key=lambda g: _order(g["trainer_step"]), reverse=True)
    out = stepped + [g for g in out if g["trainer_step"] is None]
    return out


def group_view(
    sessions: list[dict[str, Any]], summaries: list[dict[str, Any]], group_id: str
) -> dict[str, Any]:
    """A GRPO group's rollouts side by side: each one's reward, advantage (its reward less the
    group's mean over the rewarded ones, as GRPO centres it), status, calls, trained tokens,
    end reason and rows (to open). A LookupError for a group no session is in."""
    members = [s for s in sessions if _text(session_value(s, "group_id")) == group_id]
    if not members:
        raise LookupError(
            f"no session has group_id {group_id!r} in its metadata (GET /ui/api/run lists groups)"
        )
    members.sort(key=lambda s: (_order(session_value(s, "index")), s["id"]))
    rewards = [r for r in (reward_of(s) for s in members) if r is not None]
    stats = _stats(rewards)
    rows: dict[str, list[dict[str, Any]]] = {}
    for row in summaries:
        rows.setdefault(row["session_id"], []).append(row)
    rollouts = []
    for s in members:
        reward = reward_of(s)
        mean = stats["mean"]
        rollouts.append(
            {
                "id": s["id"],
                "index": session_value(s, "index"),
                "reward": reward,
                "advantage": reward - mean if reward is not None and mean is not None else None,
                "status": s["status"],
                "calls": s["calls"],
                "tokens": s["tokens"],
                "trained_tokens": s["trained_tokens"],
                "end_reason": s["end_reason"],
                "versions": s["versions"],
                "rows": [
                    {
                        "thread_id": r["thread_id"],
                        "parent_relation": r.get("parent_relation"),
                        "dead": bool(r.get("dead")),
                        "trained_tokens": int(r.get("trained_tokens") or 0),
                    }
                    for r in rows.get(s["id"], [])
                ],
            }
        )
    steps = {_text(v) for v in (session_value(s, "trainer_step") for s in members) if v is not None}
    return {
        "id": group_id,
        "trainer_step": ", ".join(sorted(steps, key=_order)) or None,
        "metadata": members[0].get("metadata"),
        "reward": stats,
        "rollouts": rollouts,
    }


def first_trained(loss_mask: Sequence[int] | None) -> int | None:
    """The position of a row's first trained token (``loss_mask`` 1), where the page opens the
    row (its sampled tokens may sit 12k prompt tokens in); None when nothing is trained."""
    for pos, mask in enumerate(loss_mask or ()):
        if mask == 1:
            return pos
    return None


def row_node(row: dict[str, Any]) -> dict[str, Any]:
    """A thread row for the tree: its links, counts and calls, no token lists;
    ``first_trained``: where its trained tokens start (None unknown: no loss mask read, or
    nothing trained)."""
    tokens = row.get("tokens")
    if tokens is None:
        tokens = len(row.get("input_ids") or ())
    trained = row.get("trained_tokens")
    if trained is None:
        trained = sum(row.get("loss_mask") or ())
    spans = [dict(s) for s in row.get("weight_versions") or ()]
    return {
        "thread_id": row["thread_id"],
        "parent_thread_id": row.get("parent_thread_id"),
        "parent_relation": row.get("parent_relation"),
        "parent_tool_call_id": row.get("parent_tool_call_id"),
        "dead": bool(row.get("dead")),
        "dead_reason": row.get("dead_reason"),
        "superseded_by": row.get("superseded_by"),
        "tokens": int(tokens),
        "trained_tokens": int(trained),
        "first_trained": first_trained(row.get("loss_mask")),
        "num_turns": int(row.get("num_turns") or 0),
        "reward": row.get("reward"),
        "end_reason": row.get("end_reason"),
        "metrics": _json(row.get("metrics")),
        "protocol": row.get("protocol"),
        "pending": bool(row.get("pending")),
        "weight_versions": spans,
        "versions": _versions([row]),
        "turns": [
            dict(t, versions=versions_in(spans, t.get("start"), t.get("end")))
            for t in row.get("turns") or ()
        ],
    }


def versions_in(spans: list[dict[str, Any]], start: int | None, end: int | None) -> list[str]:
    """The weight versions whose spans overlap positions [start, end): which weights sampled a
    call's tokens."""
    if start is None or end is None:
        return []
    out: dict[str, None] = {}
    for span in spans:
        if span["start"] < end and span["end"] > start and span.get("version") is not None:
            out.setdefault(str(span["version"]), None)
    return list(out)


def row_tree(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows as a forest: each node gets ``children`` (rows whose parent it is); roots are
    rows without a parent or whose parent is not among ``rows``. Order: as written."""
    nodes = [row_node(r) for r in rows]
    by_id = {n["thread_id"]: n for n in nodes}
    roots = []
    for node in nodes:
        node["children"] = []
    for node in nodes:
        parent = by_id.get(node["parent_thread_id"] or "")
        if parent is not None and parent is not node:
            parent["children"].append(node)
        else:
            roots.append(node)
    return roots


def tool_calls(text: str, tool_parser: str, reasoning_parser: str) -> list[dict[str, Any]]:
    """The tool calls in a completion's text, as the proxy parsed them for the client."""
    parser = OutputParser(tool_parser, reasoning_parser)
    try:
        parser.feed(text)
        parser.finish()
    except Exception:  # an unparsable completion shows no calls; its text is still there
        return []
    return [{"name": c.name, "arguments": c.arguments} for c in parser.tool_calls]


def call_list(
    turns: list[dict[str, Any]], tool_parser: str = "hermes", reasoning_parser: str = "qwen3"
) -> list[dict[str, Any]]:
    """A session's calls in order, with what the client was told and the tool calls made."""
    out = []
    for t in sorted(turns, key=lambda t: (t.get("turn_index") or 0, t.get("started_at") or 0)):
        meta = _json(t.get("metadata")) or {}
        out.append(
            {
                "request_id": t["request_id"],
                "turn_index": t.get("turn_index"),
                "thread_id": t.get("thread_id"),
                "protocol": t.get("protocol"),
                "requested_model": t.get("requested_model"),
                "backend": t.get("backend"),
                "prompt_tokens": len(t.get("prompt_ids") or ()),
                "completion_tokens": len(t.get("completion_ids") or ()),
                "finish_reason": t.get("finish_reason"),
                "response_finish_reason": t.get("response_finish_reason"),
                "latency_s": t.get("latency_s"),
                "started_at": t.get("started_at"),
                "stream": t.get("stream"),
                "assembly": meta.get("assembly") if isinstance(meta, dict) else None,
                "tool_calls": tool_calls(
                    t.get("completion_text") or "", tool_parser, reasoning_parser
                ),
            }
        )
    return out


# -- one row's tokens --------------------------------------------------------------------------
def token_page(
    row: dict[str, Any], decode: Decode, offset: int = 0, limit: int = PAGE_TOKENS
) -> dict[str, Any]:
    """Tokens ``offset`` .. ``offset + limit`` of a thread row: ids, text, loss mask,
    provenance, logprobs. A ValueError for an offset or limit out of range."""
    ids = row.get("input_ids") or []
    total = len(ids)
    if offset < 0 or (offset > total) or limit < 1 or limit > MAX_PAGE_TOKENS:
        raise ValueError(
            f"offset must be 0..{total} and limit 1..{MAX_PAGE_TOKENS}; got {offset}, {limit}"
        )
    end = min(total, offset + limit)
    page = list(ids[offset:end])
    return {
        "thread_id": row["thread_id"],
        "total": total,
        "offset": offset,
        "ids": page,
        "text": decode(page),
        "loss_mask": list((row.get("loss_mask") or [])[offset:end]),
        "provenance": list((row.get("provenance") or [])[offset:end]),
        "logprobs": [
            round(float(x), 5) if x is not None else None
            for x in (row.get("logprobs") or [])[offset:end]
        ],
    }


def row_overview(row: dict[str, Any]) -> dict[str, Any]:
    """A row's counts by provenance and loss mask (the legend's numbers), and its ``strip``."""
    prov = row.get("provenance") or []
    mask = row.get("loss_mask") or []
    counts = {name: 0 for name in PROVENANCE}
    for p in prov:
        if 0 <= p < len(PROVENANCE):
            counts[PROVENANCE[p]] += 1
    return {
        "provenance": counts,
        "trained": int(sum(mask)),
        "total": len(prov),
        "first_trained": first_trained(mask),
        "strip": logprob_strip(row),
    }


# Points in a row's logprob strip: one per sampled token up to this many, else each point is
# the mean (and min) of a run of consecutive sampled tokens.
STRIP_POINTS = 1200


def entropy(top_logprobs: Sequence[float] | None) -> float | None:
    """The entropy (nats) of a position's top-k distribution, renormalised over the k: a lower
    bound on the policy's whole entropy there; None without top-k."""
    if not top_logprobs:
        return None
    probs = [math.exp(x) for x in top_logprobs if x is not None]
    total = sum(probs)
    if total <= 0:
        return None
    return -sum(p / total * math.log(p / total) for p in probs if p > 0)


def logprob_strip(row: dict[str, Any], points: int = STRIP_POINTS) -> dict[str, Any]:
    """The logprobs of a row's sampled (and recomputed) tokens, in order, for the strip drawn
    under the row's header: ``pos`` (each point's first position), ``end`` (one past its last),
    ``lp`` (mean logprob), ``min``; ``entropy`` where the row carries top-k logprobs
    (``top_logprobs``, a list per position), else None."""
    prov = row.get("provenance") or []
    lps = row.get("logprobs") or []
    tops = row.get("top_logprobs")
    sampled = [i for i, p in enumerate(prov) if p in (1, 2) and i < len(lps) and lps[i] is not None]
    size = max(1, math.ceil(len(sampled) / points))
    out: dict[str, Any] = {"bucket": size, "pos": [], "end": [], "lp": [], "min": []}
    ents: list[float | None] = []
    for k in range(0, len(sampled), size):
        chunk = sampled[k : k + size]
        values = [float(lps[i]) for i in chunk]
        out["pos"].append(chunk[0])
        out["end"].append(chunk[-1] + 1)
        out["lp"].append(round(sum(values) / len(values), 4))
        out["min"].append(round(min(values), 4))
        if tops is not None:
            found = [e for e in (entropy(tops[i]) for i in chunk if i < len(tops)) if e is not None]
            ents.append(round(sum(found) / len(found), 4) if found else None)
    out["entropy"] = ents if tops is not None and any(e is not None for e in ents) else None
    return out


# -- diff of two calls -------------------------------------------------------------------------
def _segment(decode: Decode, ids: Sequence[int], shorten: bool) -> dict[str, Any]:
    ids = list(ids)
    if shorten and len(ids) > 2 * DIFF_CONTEXT_TOKENS:
        head, tail = ids[:DIFF_CONTEXT_TOKENS], ids[-DIFF_CONTEXT_TOKENS:]
        return {
            "tokens": len(ids),
            "text": "".join(decode(head)),
            "tail": "".join(decode(tail)),
            "elided": len(ids) - 2 * DIFF_CONTEXT_TOKENS,
        }
    return {"tokens": len(ids), "text": "".join(decode(ids))}


def _opcodes(a: list[int], b: list[int]) -> list[tuple[str, int, int, int, int]]:
    """difflib's opcodes, the common prefix and suffix taken off first: a later call mostly
    extends an earlier one, and matching 100k-token sequences whole would take seconds."""
    n = min(len(a), len(b))
    pre = 0
    while pre < n and a[pre] == b[pre]:
        pre += 1
    suf = 0
    while suf < n - pre and a[len(a) - 1 - suf] == b[len(b) - 1 - suf]:
        suf += 1
    mid_a, mid_b = a[pre : len(a) - suf], b[pre : len(b) - suf]
    out: list[tuple[str, int, int, int, int]] = []
    if pre:
        out.append(("equal", 0, pre, 0, pre))
    if mid_a or mid_b:
        matcher = difflib.SequenceMatcher(None, mid_a, mid_b, autojunk=len(mid_b) > 5000)
        for tag, i1, i2, j1, j2 in matcher.get_opcodes():
            out.append((tag, i1 + pre, i2 + pre, j1 + pre, j2 + pre))
    if suf:
        out.append(("equal", len(a) - suf, len(a), len(b) - suf, len(b)))
    return out


def diff_calls(earlier: dict[str, Any], later: dict[str, Any], decode: Decode) -> dict[str, Any]:
    """What ``later``'s prompt kept, dropped and added of ``earlier``'s conversation (its prompt
    and what it sampled): the scaffold's rewrites show as ``delete`` / ``replace``, the new
    turns (tool results, the next user message) as ``insert`` at the end."""
    a = list(earlier.get("prompt_ids") or []) + list(earlier.get("completion_ids") or [])
    b = list(later.get("prompt_ids") or [])
    ops = []
    for tag, i1, i2, j1, j2 in _opcodes(a, b):
        op: dict[str, Any] = {"op": tag, "a_start": i1, "a_end": i2, "b_start": j1, "b_end": j2}
        if tag == "equal":
            op["a"] = _segment(decode, a[i1:i2], shorten=True)
        else:
            if i2 > i1:
                op["a"] = _segment(decode, a[i1:i2], shorten=False)
            if j2 > j1:
                op["b"] = _segment(decode, b[j1:j2], shorten=False)
        ops.append(op)
    kept = sum(o["a_end"] - o["a_start"] for o in ops if o["op"] == "equal")
    return {
        "a": earlier["request_id"],
        "b": later["request_id"],
        "a_tokens": len(a),
        "b_tokens": len(b),
        "kept": kept,
        # The later prompt extends the earlier call exactly: nothing was rewritten.
        "extends": b[: len(a)] == a,
        "ops": ops,
    }
