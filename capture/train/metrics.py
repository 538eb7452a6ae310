"""A training step's rollout numbers, for the trainer's own logger (TRL's ``report_to``, verl's
tracking): one definition, so both trainers log the same names with the same meaning.

``rollout_metrics`` takes each group's rollout answers (``rollouts`` of ``POST /rollouts``, or
``run_summary`` of each: what a verl sample carries without its token rows) and the rewards
trained on them. ``batch_rollout_metrics`` does the same from verl's batch, where a sample's
group is its ``uid``. ``push_metrics``: a weight push's check (``tap.update_weights``' answer),
for the driver that pushed it to log beside the step. Plain Python, no trainer imported.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from capture.storage.row_rules import reward_value, row_versions

# Every name below is logged under this prefix, beside the trainer's loss, KL and grad norm.
METRIC_PREFIX = "agenttap/"
# A rollout's own metrics (capture/control/sessions.py SessionMetrics) averaged over its agents.
PER_AGENT = ("calls", "prompt_tokens", "completion_tokens", "refused", "errors", "version_lag")
# The key of a verl sample's ``extra_fields`` that holds its ``run_summary``.
RUN_SUMMARY_FIELD = "agenttap_run"


def _versions(run: Mapping[str, Any]) -> list[str]:
    if "weight_versions" in run:  # a run_summary: its rows already read
        return [str(v) for v in run.get("weight_versions") or []]
    return [v for row in run.get("rows") or [] for v in row_versions(row)]


def run_summary(run: Mapping[str, Any]) -> dict[str, Any]:
    """What ``rollout_metrics`` reads of one agent's rollout answer, without its rows' tokens
    (small enough to travel with a verl sample): status, the session's metrics, the weight
    versions that sampled its rows, its reward."""
    return {
        "status": run.get("status"),
        "metrics": dict(run.get("metrics") or {}),
        "weight_versions": sorted(set(_versions(run))),
        "reward": reward_value(run.get("reward")),
    }


def rollout_metrics(
    groups: Sequence[Sequence[Mapping[str, Any]]],
    rewards: Sequence[Sequence[float | None]],
    seconds: float,
) -> dict[str, float]:
    """A step's rollout numbers, from each group's runs and the rewards trained on them: the
    reward's mean and its std within a group (averaged over groups: GRPO learns nothing from a
    group whose std is 0), how many agents were scored, ended ok or not, the agents' calls,
    tokens and times (means per agent), the weight versions that sampled the step and how far
    behind the trainer's weights they were (``version_lag``: updates between an agent's first
    call and its close; mean and max), and the step's rollout seconds. Nothing scored is NaN,
    not 0."""
    runs = [run for group in groups for run in group]
    scored = [r for group in rewards for r in group if r is not None]
    stds = []
    for group in rewards:
        values = [r for r in group if r is not None]
        if len(values) > 1:
            mean = sum(values) / len(values)
            stds.append((sum((v - mean) ** 2 for v in values) / len(values)) ** 0.5)
    per_agent: dict[str, list[float]] = {}
    for run in runs:
        metrics = run.get("metrics") or {}
        for name in PER_AGENT:
            per_agent.setdefault(name, []).append(float(metrics.get(name) or 0))
        per_agent.setdefault("wall_s", []).append(float(metrics.get("rollout_wall_time_s") or 0))
    versions = {v for run in runs for v in _versions(run)}
    found = {
        "reward_mean": sum(scored) / len(scored) if scored else math.nan,
        "reward_std_in_group": sum(stds) / len(stds) if stds else math.nan,
        "agents": float(len(runs)),
        "scored": float(len(scored)),
        "status_ok": float(sum(run.get("status") == "ok" for run in runs)),
        "status_not_ok": float(sum(run.get("status") != "ok" for run in runs)),
        "weight_versions": float(len(versions)),
        "rollout_s": seconds,
    }
    for name, values in per_agent.items():
        found[f"{name}_per_agent"] = sum(values) / len(values)
    if runs:
        found["version_lag_max"] = max(per_agent["version_lag"])
    return {METRIC_PREFIX + name: value for name, value in found.items()}


def batch_rollout_metrics(
    summaries: Sequence[Mapping[str, Any] | None], uids: Sequence[Any] | None = None
) -> dict[str, float]:
    """``rollout_metrics`` of a verl batch: each sample's ``run_summary`` (None for a sample
    another agent loop made: left out), grouped by verl's ``uid`` (the samples of one prompt;
    without uids each sample is its own group). The step's rollout seconds: its slowest agent's
    wall time (the samples run at once). Empty when no sample came from agenttap."""
    groups: dict[Any, list[Mapping[str, Any]]] = {}
    for i, summary in enumerate(summaries):
        if summary is None:
            continue
        key = uids[i] if uids is not None else i
        groups.setdefault(key, []).append(summary)
    if not groups:
        return {}
    runs = [run for group in groups.values() for run in group]
    walls = [float((run.get("metrics") or {}).get("rollout_wall_time_s") or 0) for run in runs]
    return rollout_metrics(
        list(groups.values()),
        [[run.get("reward") for run in group] for group in groups.values()],
        max(walls),
    )


def push_max_diff(answer: Mapping[str, Any]) -> float | None:
    """The largest |diff| any policy server's check of a weight push measured (None: none)."""
    measured = [r["max_diff"] for r in answer.get("replicas", []) if r.get("max_diff") is not None]
    return max(measured, default=None)


def push_metrics(answer: Mapping[str, Any], seconds: float) -> dict[str, float]:
    """A weight push's numbers (``POST /policy/weights``' answer, ``tap.update_weights``): how
    long it took and, where the servers were checked, the largest |diff| from the trainer's
    own logprobs (``push_max_diff``; left out when nothing was measured)."""
    found = {METRIC_PREFIX + "push_s": seconds}
    diff = push_max_diff(answer)
    if diff is not None:
        found[METRIC_PREFIX + "push_max_diff"] = diff
    return found
