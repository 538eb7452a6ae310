"""Thread rows as a trainer's padded batches: whole rows (``to_batch``), or verl-style prompts
and responses with rewards and weight versions (``to_rl_batch``, over ``select_rows``), numpy
arrays, torch tensors on request (``to_torch``)."""

from __future__ import annotations

import json
import logging
from collections.abc import Collection, Mapping
from typing import Any, Literal, TypedDict

import numpy as np

from capture.storage.row_rules import row_reward, row_versions
from capture.trajectory.export import DEAD_EMPTY
from capture.trajectory.kinds import MAIN, THREAD_KINDS

logger = logging.getLogger(__name__)


def to_batch(
    rows: list[dict[str, Any]],
    pad_id: int = 0,
    max_len: int | None = None,
    left_pad: bool = False,
) -> dict[str, np.ndarray]:
    """Pad ``input_ids``, ``loss_mask``, ``logprobs`` and ``provenance`` to one length.

    ``attention_mask`` is 1 on real tokens. Rows longer than ``max_len`` are cut at the end.
    """
    lengths = [len(r["input_ids"]) for r in rows]
    width = max(lengths, default=0) if max_len is None else max_len
    n = len(rows)
    out: dict[str, np.ndarray] = {
        "input_ids": np.full((n, width), pad_id, dtype=np.int64),
        "attention_mask": np.zeros((n, width), dtype=np.int64),
        "loss_mask": np.zeros((n, width), dtype=np.int64),
        "logprobs": np.zeros((n, width), dtype=np.float32),
        "provenance": np.zeros((n, width), dtype=np.int8),
    }
    for i, row in enumerate(rows):
        k = min(len(row["input_ids"]), width)
        sl = slice(width - k, width) if left_pad else slice(0, k)
        out["input_ids"][i, sl] = row["input_ids"][:k]
        out["attention_mask"][i, sl] = 1
        out["loss_mask"][i, sl] = row["loss_mask"][:k]
        out["logprobs"][i, sl] = row["logprobs"][:k]
        out["provenance"][i, sl] = row["provenance"][:k]
    return out


Truncation = Literal["error", "left", "right", "middle"]
_TRUNCATIONS = ("error", "left", "right", "middle")
MissingReward = Literal["error", "drop", "zero"]
_MISSING_REWARDS = ("error", "drop", "zero")
# Sessions a missing-reward error names (then how many more).
_NAMED_SESSIONS = 5


def row_kind(row: Mapping[str, Any]) -> str:
    """A row's ``thread_kind``; ``main`` for rows written before the column existed (null)."""
    return row.get("thread_kind") or MAIN


def select_rows(
    rows: list[dict[str, Any]],
    missing_reward: MissingReward = "error",
    kinds: Collection[str] | None = None,
) -> list[dict[str, Any]]:
    """The rows :func:`to_rl_batch` batches: those of ``kinds`` (None: all), then, for rows
    without a reward, what ``missing_reward`` says (see there). Never a dead end with no visible
    output (``dead_reason`` ``"empty"``): its client asked again, and the retry's row is the
    rollout's, so a trainer that groups per row counts the rollout once. Never a row marked
    ``weights_unverified`` (a policy server's weights changed without an update while it
    sampled them: they are not the policy's)."""
    if missing_reward not in _MISSING_REWARDS:
        raise ValueError(
            f"missing_reward must be one of {_MISSING_REWARDS}, not {missing_reward!r}"
        )
    rows = [r for r in rows if r.get("dead_reason") != DEAD_EMPTY]
    rows = [r for r in rows if not r.get("weights_unverified")]
    if kinds is not None:
        if isinstance(kinds, str):
            kinds = (kinds,)
        unknown = sorted(set(kinds) - set(THREAD_KINDS))
        if unknown:
            raise ValueError(f"kinds: unknown thread_kind(s) {unknown}; known: {THREAD_KINDS}")
        rows = [r for r in rows if row_kind(r) in kinds]
    missing = [r for r in rows if row_reward(r) is None]
    if not missing or missing_reward == "zero":
        return rows
    if missing_reward == "drop":
        return [r for r in rows if row_reward(r) is not None]
    sessions = list(dict.fromkeys(str(r.get("session_id")) for r in missing))
    named = ", ".join(repr(s) for s in sessions[:_NAMED_SESSIONS])
    if len(sessions) > _NAMED_SESSIONS:
        named += f" and {len(sessions) - _NAMED_SESSIONS} more"
    auxiliary = sum(1 for r in missing if row_kind(r) == "auxiliary")
    aux_note = (
        f" ({auxiliary} of them auxiliary: side calls such as titles and routers, which a "
        "session's reward leaves out unless closed with reward_auxiliary)"
        if auxiliary
        else ""
    )
    raise ValueError(
        f"{len(missing)} of {len(rows)} rows have no reward{aux_note}: rows of session(s) "
        f"{named}; "
        "give those sessions a reward (at close, or a late one), or choose: "
        "missing_reward='drop' (leave those rows out), missing_reward='zero' (reward 0), "
        "kinds=('main', 'subagent') (leave auxiliary rows out)"
    )


class RLBatch(TypedDict):
    """What :func:`to_rl_batch` returns (``n`` rows, ``P`` prompt and ``R`` response columns)."""

    prompts: np.ndarray  # (n, P) int64, left-padded with pad_id
    responses: np.ndarray  # (n, R) int64, right-padded with pad_id
    response_mask: np.ndarray  # (n, R) int64: 1 on the policy's trained tokens
    rollout_log_probs: np.ndarray  # (n, R) float32: the sampler's logprobs, 0 elsewhere
    input_ids: np.ndarray  # (n, P + R) int64: prompts ++ responses
    attention_mask: np.ndarray  # (n, P + R) int64: 1 on real tokens
    position_ids: np.ndarray  # (n, P + R) int64: clip(cumsum(attention_mask) - 1, 0)
    reward: np.ndarray  # (n,) float64 (missing_reward: rows without one dropped, 0, or refused)
    token_level_rewards: np.ndarray  # (n, R) float32: reward on the last trained token
    group_id: list[str]  # metadata "group_id", else the session id
    session_id: list[str | None]
    thread_id: list[str | None]
    # The oldest and newest weights that gave a trained token's logprob (version labels, in
    # capture.storage.row_rules's order); None: the row says none (written before
    # weight_versions).
    min_weight_version: list[str | None]
    max_weight_version: list[str | None]


def to_rl_batch(
    rows: list[dict[str, Any]],
    pad_id: int,
    max_prompt_len: int | None = None,
    max_response_len: int | None = None,
    truncation: Truncation = "error",
    missing_reward: MissingReward = "error",
    kinds: Collection[str] | None = None,
) -> RLBatch:
    """Split thread rows into prompt and response, padded as verl's PPO / GRPO batches are.

    Which rows: ``kinds`` keeps only rows of these ``thread_kind`` values (None, the default: all;
    ``("main", "subagent")`` leaves out auxiliary rows, the side calls a session's reward is not
    set on by default; a row written before the column existed counts as ``main``). A row with
    no reward (null) is refused: ``missing_reward="error"`` (default) raises ValueError naming
    the first sessions whose rows have none; ``"drop"`` leaves those rows out of the batch;
    ``"zero"`` batches them with reward 0. The batch's ``session_id`` and ``thread_id`` say
    which rows it holds.

    A row's *prompt* is its tokens before its first trained token (the first ``loss_mask`` 1);
    its *response* is the rest: the policy's sampled tokens and, in a multi-turn row, the tool /
    environment tokens between its calls (``response_mask`` 0 on these, as verl's agent loop
    masks tool responses). A row that trains nothing has all its tokens as prompt and an empty
    response.

    Returns numpy arrays (see :class:`RLBatch`): ``prompts`` left-padded, ``responses``
    right-padded, ``input_ids`` = ``prompts`` ++ ``responses``, ``attention_mask``,
    ``position_ids`` (``clip(cumsum(attention_mask) - 1, min=0)``, as verl computes them),
    ``min_weight_version`` / ``max_weight_version`` (the oldest and newest weights that gave a
    trained token's logprob, from the row's ``weight_versions``: a trainer's staleness check),
    ``response_mask``, ``rollout_log_probs``, ``reward`` (0 for a row without one only with
    ``missing_reward="zero"``), ``token_level_rewards`` (the row's reward on its last
    ``response_mask`` 1 token, 0 elsewhere; all 0 for a row that trains nothing), and the lists
    ``group_id`` (the ``"group_id"`` of the row's ``metadata`` JSON, else its ``session_id``;
    verl's GRPO groups by ``non_tensor_batch["uid"]``: pass it as that), ``session_id`` and
    ``thread_id``.

    ``max_prompt_len`` / ``max_response_len``: pad to exactly this width (default: the longest in
    the batch). ``truncation`` for what exceeds them: ``"error"`` (default) raises ValueError
    naming the row and its lengths; otherwise a prompt keeps its end (``"left"``), its beginning
    (``"right"``) or both halves (``"middle"``), as verl's ``truncation`` option does, and a
    response over ``max_response_len`` is cut at its end (its later tokens are dropped: the kept
    ones stay exactly the ones sampled in that context).
    """
    if truncation not in _TRUNCATIONS:
        raise ValueError(f"truncation must be one of {_TRUNCATIONS}, not {truncation!r}")
    for name, limit in (("max_prompt_len", max_prompt_len), ("max_response_len", max_response_len)):
        if limit is not None and (
            isinstance(limit, bool) or not isinstance(limit, int) or limit < 1
        ):
            raise ValueError(f"{name} must be a positive int or None, not {limit!r}")
    rows = select_rows(rows, missing_reward, kinds)

    prompts: list[np.ndarray] = []
    responses: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    rewards = np.full(len(rows), np.nan, dtype=np.float64)
    group_ids: list[str] = []
    session_ids: list[str | None] = []
    thread_ids: list[str | None] = []
    versions: list[list[str]] = []
    for i, row in enumerate(rows):
        label = f"row {i} (session {row.get('session_id')!r}, thread {row.get('thread_id')!r})"
        ids, mask, logprobs = _aligned(row, label)
        trained = np.flatnonzero(mask)
        first = int(trained[0]) if trained.size else len(ids)
        prompt = _truncate_prompt(ids[:first], max_prompt_len, truncation, label)
        response = slice(first, len(ids))
        if max_response_len is not None and len(ids) - first > max_response_len:
            if truncation == "error":
                raise ValueError(
                    f"{label}: response is {len(ids) - first} tokens, over "
                    f"max_response_len={max_response_len} (prompt {first} tokens); raise the "
                    "limit, or pass truncation='left' / 'right' / 'middle' to cut responses at "
                    "their end"
                )
            response = slice(first, first + max_response_len)
        prompts.append(prompt)
        responses.append((ids[response], mask[response], logprobs[response]))
        reward = row_reward(row)
        if reward is not None:
            rewards[i] = reward
        elif missing_reward == "zero":
            rewards[i] = 0.0
        session_ids.append(row.get("session_id"))
        thread_ids.append(row.get("thread_id"))
        group_ids.append(_group_id(row, label))
        versions.append(row_versions(row))

    n = len(rows)
    width_p = max_prompt_len if max_prompt_len is not None else max(map(len, prompts), default=0)
    width_r = (
        max_response_len
        if max_response_len is not None
        else max((len(r[0]) for r in responses), default=0)
    )
    out_prompts = np.full((n, width_p), pad_id, dtype=np.int64)
    prompt_mask = np.zeros((n, width_p), dtype=np.int64)
    out_responses = np.full((n, width_r), pad_id, dtype=np.int64)
    response_attn = np.zeros((n, width_r), dtype=np.int64)
    response_mask = np.zeros((n, width_r), dtype=np.int64)
    rollout_log_probs = np.zeros((n, width_r), dtype=np.float32)
    token_level_rewards = np.zeros((n, width_r), dtype=np.float32)
    for i, (prompt, (r_ids, r_mask, r_logprobs)) in enumerate(zip(prompts, responses, strict=True)):
        if len(prompt):
            out_prompts[i, width_p - len(prompt) :] = prompt
            prompt_mask[i, width_p - len(prompt) :] = 1
        k = len(r_ids)
        out_responses[i, :k] = r_ids
        response_attn[i, :k] = 1
        response_mask[i, :k] = r_mask
        rollout_log_probs[i, :k] = r_logprobs
        trained = np.flatnonzero(r_mask)
        if trained.size:
            token_level_rewards[i, trained[-1]] = rewards[i]
    attention_mask = np.concatenate([prompt_mask, response_attn], axis=1)
    return RLBatch(
        prompts=out_prompts,
        responses=out_responses,
        response_mask=response_mask,
        rollout_log_probs=rollout_log_probs,
        input_ids=np.concatenate([out_prompts, out_responses], axis=1),
        attention_mask=attention_mask,
        position_ids=np.clip(np.cumsum(attention_mask, axis=1) - 1, 0, None),
        reward=rewards,
        token_level_rewards=token_level_rewards,
        group_id=group_ids,
        session_id=session_ids,
        thread_id=thread_ids,
        min_weight_version=[v[0] if v else None for v in versions],
        max_weight_version=[v[-1] if v else None for v in versions],
    )


def _aligned(row: Mapping[str, Any], label: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The row's ``input_ids``, ``loss_mask`` (0/1) and ``logprobs``, checked to be aligned."""
    missing = [c for c in ("input_ids", "loss_mask", "logprobs") if row.get(c) is None]
    if missing:
        raise ValueError(f"{label} has no {', '.join(missing)} (read those columns)")
    ids = np.asarray(row["input_ids"], dtype=np.int64)
    mask = (np.asarray(row["loss_mask"]) != 0).astype(np.int64)
    logprobs = np.asarray(row["logprobs"], dtype=np.float32)
    if not len(ids) == len(mask) == len(logprobs):
        raise ValueError(
            f"{label}: input_ids, loss_mask and logprobs differ in length "
            f"({len(ids)}, {len(mask)}, {len(logprobs)})"
        )
    return ids, mask, logprobs


def _truncate_prompt(
    prompt: np.ndarray, limit: int | None, truncation: Truncation, label: str
) -> np.ndarray:
    n = len(prompt)
    if limit is None or n <= limit:
        return prompt
    if truncation == "error":
        raise ValueError(
            f"{label}: prompt is {n} tokens, over max_prompt_len={limit}; raise the limit, or "
            "pass truncation='left' (keep its end), 'right' (keep its beginning) or 'middle'"
        )
    if truncation == "left":
        return prompt[n - limit :]
    if truncation == "right":
        return prompt[:limit]
    half = limit // 2
    return np.concatenate([prompt[:half], prompt[n - (limit - half) :]])


def _group_id(row: Mapping[str, Any], label: str) -> str:
    metadata = row.get("metadata")
    if metadata:
        try:
            parsed = json.loads(metadata)
        except (TypeError, ValueError):
            logger.warning("%s: metadata is not JSON; grouping it by its session", label)
            parsed = None
        if isinstance(parsed, dict) and parsed.get("group_id") is not None:
            group = parsed["group_id"]
            return group if isinstance(group, str) else json.dumps(group, sort_keys=True)
    return str(row.get("session_id"))


def to_torch(batch: Mapping[str, Any]) -> dict[str, Any]:
    """The batch with its numpy arrays as torch tensors (sharing memory); other entries (the
    lists of ids) pass through unchanged. Needs torch; the numpy batches do not."""
    try:
        import torch
    except ImportError as exc:
        raise ImportError(
            "capture.reader.to_torch needs PyTorch, which is not installed: pip install torch "
            "(to_batch and to_rl_batch give numpy arrays without it)"
        ) from exc
    return {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in batch.items()}
