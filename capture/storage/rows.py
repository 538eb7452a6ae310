"""The rows a session's calls are written as: its thread rows (``thread_row``: one training row
per thread, with what a trainer said of the session, ``RowAnnotations``) and its turns rows
(``turn_row``: one per call). Schemas: capture/storage/shards.py, docs/SHARDS.md.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from capture.storage.records import SCHEMA_VERSION, TurnRecord
from capture.storage.shards import REWARD_CLOSE
from capture.trajectory import AUXILIARY, ThreadRow


@dataclass
class RowAnnotations:
    """What a trainer said about a session, written into its thread rows (``metadata``,
    ``reward`` and ``reward_source``, ``end_reason``, ``metrics`` columns)."""

    metadata: dict[str, Any] | None = None
    # One number for every row, or one per thread id; None: not set (yet).
    reward: float | dict[str, float] | None = None
    end_reason: str | None = None
    metrics: dict[str, Any] | None = None
    # One number is set on main and subagent rows; on auxiliary rows (side calls: a title, a
    # router) only with this. A per-thread reward is set on the threads it names, whatever kind.
    reward_auxiliary: bool = False
    # Who gave ``reward``: the trainer's close, or a rollout's verifier (shards.REWARD_SOURCES).
    reward_source: str = REWARD_CLOSE

    def rewards(self, row: dict[str, Any]) -> bool:
        """Whether one number for the session is the reward of ``row``."""
        return self.reward_auxiliary or row.get("thread_kind") != AUXILIARY

    def apply(self, row: dict[str, Any]) -> None:
        if self.metadata is not None:
            row["metadata"] = json.dumps(self.metadata, ensure_ascii=False)
        if isinstance(self.reward, dict):
            row["reward"] = self.reward.get(row["thread_id"])
            row["reward_source"] = self.reward_source if row["reward"] is not None else None
        elif self.reward is not None and self.rewards(row):
            row["reward"] = float(self.reward)
            row["reward_source"] = self.reward_source
        if self.end_reason is not None:
            row["end_reason"] = self.end_reason
        if self.metrics is not None:
            row["metrics"] = json.dumps(self.metrics)


def thread_row(
    session_id: str, row: ThreadRow, by_request: dict[str, TurnRecord]
) -> dict[str, Any]:
    first = by_request.get(row.turns[0]["request_id"]) if row.turns else None
    if first is None:
        first = next((by_request[r] for r in row.trained_request_ids if r in by_request), None)
    return {
        "schema_version": SCHEMA_VERSION,
        "session_id": session_id,
        "thread_id": row.thread_id,
        "parent_thread_id": row.parent_thread_id,
        "parent_relation": row.parent_relation,
        "parent_tool_call_id": row.parent_tool_call_id,
        "thread_kind": row.thread_kind,
        "dead": row.dead,
        "dead_reason": row.dead_reason,
        "superseded_by": row.superseded_by,
        "input_ids": row.input_ids,
        "loss_mask": row.loss_mask,
        "logprobs": row.logprobs,
        "provenance": row.provenance,
        "turns": row.turns,
        "num_turns": len(row.trained_request_ids),
        "trained_request_ids": row.trained_request_ids,
        "protocol": first.protocol if first else None,
        "user_agent": first.user_agent if first else None,
        "reward": None,
        "metadata": None,
        "end_reason": None,
        "metrics": None,
        "weight_versions": row.weight_versions,
        "reward_source": None,
    }


def turn_row(turn: TurnRecord) -> dict[str, Any]:
    row = turn.to_row()
    row["metadata"] = json.dumps(row["metadata"])
    return row
