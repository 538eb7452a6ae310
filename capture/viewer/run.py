"""The trajectory viewer's run: per trainer step or weight version (its sessions' reward mean
and spread, statuses, tokens, time: the trainer's where it sent it), per GRPO group, and one
group's rollouts side by side with their advantages."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from capture.viewer.session_list import as_text, reward_of, session_value, sort_key, value_key

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


def trainer_step_times(advantages: Mapping[str, Mapping[str, Any]]) -> dict[str, float]:
    """Session id -> the trainer's own time for its step, from the advantages its adapter sent
    (capture/storage/advantages.py ``load_advantages``; those without ``step_s`` left out)."""
    return {
        sid: float(given["step_s"])
        for sid, given in advantages.items()
        if given.get("step_s") is not None
    }


def run_summary(
    sessions: list[dict[str, Any]],
    by: str | None = None,
    trainer_step_s: Mapping[str, float] | None = None,
) -> dict[str, Any]:
    """The run at a glance, one point per step (the sessions' ``by``: ``trainer_step``, the
    weight ``version``, or any metadata key): its sessions, their reward's mean, spread
    (standard deviation), min and max, its sessions per status, tokens (all, trained), calls,
    and time in seconds: the trainer's own time for the step where its adapter sent it with a
    session's advantage (``trainer_step_s``: session id -> seconds; ``time_source``
    "trainer"), else its first call's start to its last call's end (``time_source`` "calls").
    Sessions without the key are counted apart (``unstepped``)."""
    trainer_step_s = trainer_step_s or {}
    by = by or run_by_default(sessions)
    steps: dict[str, list[dict[str, Any]]] = {}
    labels: dict[str, Any] = {}
    unstepped = 0
    for session in sessions:
        value = session_value(session, by)
        if value is None:
            unstepped += 1
            continue
        steps.setdefault(as_text(value), []).append(session)
        labels[as_text(value)] = value
    statuses: dict[str, int] = {}
    points = []
    for key in sorted(steps, key=lambda k: value_key(by, labels[k])):
        group = steps[key]
        rewards = [r for r in (reward_of(s) for s in group) if r is not None]
        count: dict[str, int] = {}
        for s in group:
            count[s["status"]] = count.get(s["status"], 0) + 1
            statuses[s["status"]] = statuses.get(s["status"], 0) + 1
        starts = [s["started_at"] for s in group if s.get("started_at")]
        ends = [s["ended_at"] for s in group if s.get("ended_at")]
        told = [trainer_step_s[s["id"]] for s in group if s["id"] in trainer_step_s]
        span = max(ends) - min(starts) if starts and ends else None
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
                "time_s": max(told) if told else span,
                "time_source": "trainer" if told else "calls",
                "groups": len({as_text(session_value(s, "group_id")) for s in group}),
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
            groups.setdefault(as_text(value), []).append(session)
    out = []
    for gid, members in groups.items():
        rewards = [r for r in (reward_of(s) for s in members) if r is not None]
        steps = {
            as_text(v) for v in (session_value(s, "trainer_step") for s in members) if v is not None
        }
        statuses: dict[str, int] = {}
        for s in members:
            statuses[s["status"]] = statuses.get(s["status"], 0) + 1
        out.append(
            {
                "id": gid,
                "trainer_step": ", ".join(sorted(steps, key=sort_key)) or None,
                "n": len(members),
                "reward": _stats(rewards),
                "statuses": statuses,
                "started_at": min(
                    (s["started_at"] for s in members if s.get("started_at")), default=None
                ),
            }
        )
    # Newest step first; groups without a step after them.
    out.sort(key=lambda g: (sort_key(g["started_at"]), g["id"]), reverse=True)
    stepped = [g for g in out if g["trainer_step"] is not None]
    stepped.sort(key=lambda g: sort_key(g["trainer_step"]), reverse=True)
    out = stepped + [g for g in out if g["trainer_step"] is None]
    return out


def group_view(
    sessions: list[dict[str, Any]],
    summaries: list[dict[str, Any]],
    group_id: str,
    trainer_advantages: dict[str, dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """A GRPO group's rollouts side by side: each one's reward, advantage, status, calls,
    trained tokens, end reason and rows (to open). The advantage is the trainer's own where its
    adapter sent it (``trainer_advantages``: its grouping and scaling, ``advantage_source``
    "trainer"), else this view's estimate, the reward less the group's mean over the rewarded
    ones, as GRPO centres it ("estimate"). A LookupError for a group no session is in."""
    trainer_advantages = trainer_advantages or {}
    members = [s for s in sessions if as_text(session_value(s, "group_id")) == group_id]
    if not members:
        raise LookupError(
            f"no session has group_id {group_id!r} in its metadata (GET /ui/api/run lists groups)"
        )
    members.sort(key=lambda s: (sort_key(session_value(s, "index")), s["id"]))
    rewards = [r for r in (reward_of(s) for s in members) if r is not None]
    stats = _stats(rewards)
    rows: dict[str, list[dict[str, Any]]] = {}
    for row in summaries:
        rows.setdefault(row["session_id"], []).append(row)
    rollouts = []
    for s in members:
        reward = reward_of(s)
        mean = stats["mean"]
        estimate = reward - mean if reward is not None and mean is not None else None
        given = trainer_advantages.get(s["id"])
        rollouts.append(
            {
                "id": s["id"],
                "index": session_value(s, "index"),
                "reward": reward,
                "advantage": given["advantage"] if given is not None else estimate,
                "advantage_source": "trainer" if given is not None else "estimate",
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
    steps = {
        as_text(v) for v in (session_value(s, "trainer_step") for s in members) if v is not None
    }
    sources = {r["advantage_source"] for r in rollouts}
    return {
        "id": group_id,
        "trainer_step": ", ".join(sorted(steps, key=sort_key)) or None,
        "metadata": members[0].get("metadata"),
        "reward": stats,
        # "trainer" (every rollout's advantage the trainer's own), "estimate", or "mixed".
        "advantage_source": sources.pop() if len(sources) == 1 else "mixed",
        "rollouts": rollouts,
    }
