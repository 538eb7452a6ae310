"""The trajectory viewer's session list: one entry per session (its rows, calls, tokens,
reward, weight versions, status), found among thousands by any field or metadata key (sorted,
filtered, searched, paged)."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from capture.storage.row_rules import reward_value, row_reward, rows_versions, version_key
from capture.viewer.sources import json_column


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def session_list(
    summaries: list[dict[str, Any]], live: dict[str, dict[str, Any]] | None = None
) -> list[dict[str, Any]]:
    """One entry per session: its rows, calls, tokens, reward(s), metadata and end reason;
    ``live``: the proxy's live sessions (calls, tokens, last activity, backend) by id, listed
    even before they have rows. ``status``: ``live`` while calls can still come, else its end
    reason (``open``: rows written, never closed); ``versions``: the weight versions that
    sampled it, oldest first; ``started_at`` / ``ended_at``: its first call's start, its last
    call's end."""
    live = live or {}
    by_session: dict[str, list[dict[str, Any]]] = {}
    for row in summaries:
        by_session.setdefault(row["session_id"], []).append(row)
    out = []
    for sid in sorted(set(by_session) | set(live)):
        rows = by_session.get(sid, [])
        # Each row's reward by the row rules: a NaN or an infinity is no reward.
        rewards = sorted({x for x in map(row_reward, rows) if x is not None})
        metadata = next((json_column(r.get("metadata")) for r in rows if r.get("metadata")), None)
        state = live.get(sid)
        if metadata is None and state is not None:
            metadata = state.get("metadata") or None
        is_live = state is not None and not state.get("closed", False)
        end_reason = next((r["end_reason"] for r in rows if r.get("end_reason")), None)
        metrics = next((json_column(r.get("metrics")) for r in rows if r.get("metrics")), None)
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
                "versions": rows_versions(rows),
                "started_at": min((t for t in starts if t), default=None),
                "ended_at": max((t for t in ends if t), default=None),
                "wall_s": metrics.get("wall_time_s") if isinstance(metrics, dict) else None,
            }
        )
    return out


def reward_of(session: dict[str, Any]) -> float | None:
    """One number for a session's reward (its rows' rewards' mean where they differ); each
    number read by ``capture.storage.row_rules.reward_value``."""
    reward = session.get("reward")
    if isinstance(reward, list):
        return _mean([x for x in map(reward_value, reward) if x is not None])
    return reward_value(reward)


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


def sort_key(value: Any) -> tuple[int, float, tuple[tuple[int, Any], ...]]:
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


def value_key(key: str, value: Any) -> tuple[Any, ...]:
    """How values of ``key`` sort: weight versions by ``capture.storage.row_rules.version_key``
    (the order every reader of rows uses), any other key by ``sort_key``."""
    if key == "version" and value is not None:
        return version_key(str(value))
    return sort_key(value)


def as_text(value: Any) -> str:
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
            values[as_text(value)] = values.get(as_text(value), 0) + 1
    return [
        {
            "key": key,
            "sessions": sum(values.values()),
            "values": sorted(values, key=sort_key)[:50],
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
        and all(as_text(session_value(s, k)) == v for k, v in filters)
    ]

    def tie(s: dict[str, Any]) -> tuple[Any, ...]:
        return (
            sort_key(session_value(s, "group_id")),
            sort_key(session_value(s, "index")),
            s["id"],
        )

    matched.sort(key=tie)
    # Missing values stay last whichever way the list is sorted.
    present = [s for s in matched if session_value(s, sort) is not None]
    missing = [s for s in matched if session_value(s, sort) is None]
    present.sort(key=lambda s: value_key(sort, session_value(s, sort)), reverse=descending)
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
