"""What is recorded per policy call: plain dataclasses, no I/O."""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, field
from typing import Any

# 2: thread rows say which calls they train (loss_mask), and which rows are dead branches.
SCHEMA_VERSION = 2


@dataclass
class TurnRecord:
    """One call answered by the policy: the exact prompt it saw and what it sampled."""

    session_id: str
    request_id: str
    turn_index: int
    protocol: str  # e.g. "openai.chat"
    requested_model: str
    policy_model: str
    backend: str
    user_agent: str
    prompt_ids: list[int]
    completion_ids: list[int]
    completion_logprobs: list[float]
    finish_reason: str  # the policy's: stop / length / ...
    response_finish_reason: str  # what the client was told: stop / tool_calls / length ...
    started_at: float
    latency_s: float
    stream: bool
    completion_text: str = ""
    thread_id: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)
    # Which weights sampled which completion tokens: {version, start, end} over completion_ids
    # (as vLLM's generate endpoint reports them, stitched across aborts); empty when unknown.
    weight_versions: list[dict[str, Any]] = field(default_factory=list)
    schema_version: int = SCHEMA_VERSION

    def to_row(self) -> dict[str, Any]:
        # What asdict gives, without its element-by-element walk of the token lists (tens of
        # thousands of ids a call): lists copied whole, the small nested values deep-copied.
        row = dict(self.__dict__)
        for name in ("prompt_ids", "completion_ids", "completion_logprobs"):
            row[name] = list(row[name])
        row["metadata"] = copy.deepcopy(self.metadata)
        row["weight_versions"] = copy.deepcopy(self.weight_versions)
        return row

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> TurnRecord:
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in row.items() if k in known})


@dataclass
class FailedCall:
    """A call the policy failed (garbage, a cut or stalled stream, an error status): the client
    got its provider's error, and nothing of it is trained. Kept so a session's failures can be
    counted and looked into (``failed/`` shards), never in a thread row."""

    session_id: str
    request_id: str
    protocol: str
    requested_model: str
    policy_model: str
    backend: str
    user_agent: str
    stream: bool
    reason: str  # the error as the client was told it
    policy_status: int  # the policy's HTTP status; 0: it did not answer (properly)
    prompt_tokens: int
    # Tokens the client had been sent before the failure (a stream's); they are not trained.
    completion_tokens: int
    started_at: float
    failed_at: float
    schema_version: int = SCHEMA_VERSION

    def to_row(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> FailedCall:
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in row.items() if k in known})
