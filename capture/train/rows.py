"""Thread rows → what trainers take: pure functions, no torch, no trainer library.

A rollout (``AgentTap.rollout``) gives each agent's thread rows. A trainer takes one sequence
per rollout: its **main row** (``main_row``): the live (not dead) ``thread_kind`` ``main`` row
that trains the most calls (the agent's own conversation; sub-agent and auxiliary rows, such as
Claude Code's title call, are left out). ``split_row`` cuts it where
``capture.storage.reader.to_rl_batch`` does: the *prompt* is its tokens before its first
trained token (the first call's prompt), the *completion* everything after: the policy's
sampled tokens (mask 1) and, in a multi-turn row, the tool / environment tokens between its
calls (mask 0).

A row's reward and weight versions are read by ``capture.storage.row_rules`` (``weight_steps``:
the versions as numbers, for verl's ``min_global_steps`` / ``max_global_steps``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from capture.storage.row_rules import reward_value, row_versions, weight_steps
from capture.train.metrics import RUN_SUMMARY_FIELD, run_summary

# Qwen's <|endoftext|>: what stands in for a sequence a rollout did not produce.
DEFAULT_FILLER_ID = 151643


@dataclass(frozen=True)
class SplitRow:
    """One row cut into prompt and completion; the completion's lists are aligned."""

    prompt_ids: list[int]
    completion_ids: list[int]
    # The sampler's logprob of each completion token (0.0 on tool / environment tokens).
    completion_logprobs: list[float]
    # 1 on the tokens the row trains (the policy's own), 0 on tool / environment tokens.
    completion_mask: list[int]


def row_is_main(row: Mapping[str, Any]) -> bool:
    """A live row of the agent's own conversation (null ``thread_kind``: written before the
    column existed, read as main)."""
    return (row.get("thread_kind") or "main") == "main" and not row.get("dead")


def main_row(rows: Sequence[Mapping[str, Any]]) -> Mapping[str, Any] | None:
    """The rollout's main row: of its live ``main`` rows, the one training the most calls
    (then the longest). None when it has none (the agent made no call, or only side calls)."""
    candidates = [r for r in rows if row_is_main(r)]
    if not candidates:
        return None
    return max(
        candidates, key=lambda r: (int(r.get("num_turns") or 0), len(r.get("input_ids") or ()))
    )


def split_row(row: Mapping[str, Any]) -> SplitRow:
    """The row cut before its first trained token. A row that trains nothing (every call of it
    trained in another row) keeps its last token as a one-token completion, masked (0): a
    trainer then learns nothing from it."""
    ids = [int(i) for i in row["input_ids"]]
    mask = [1 if m else 0 for m in row["loss_mask"]]
    logprobs = [float(x) for x in row["logprobs"]]
    if not len(ids) == len(mask) == len(logprobs):
        raise ValueError(
            f"row {row.get('thread_id')!r} of session {row.get('session_id')!r}: input_ids, "
            f"loss_mask and logprobs differ in length ({len(ids)}, {len(mask)}, "
            f"{len(logprobs)}); read the rows as agenttap wrote them"
        )
    if not ids:
        raise ValueError(f"row {row.get('thread_id')!r} has no tokens")
    if 1 not in mask:
        return SplitRow(ids[:-1], ids[-1:], [0.0], [0])
    first = mask.index(1)
    return SplitRow(ids[:first], ids[first:], logprobs[first:], mask[first:])


def sampled_ids(row: Mapping[str, Any]) -> list[int]:
    """The tokens the row trains (``loss_mask`` 1: what the policy sampled in its calls), in
    order; decoded, the policy's own answer, whatever the agent printed."""
    return [int(i) for i, m in zip(row["input_ids"], row["loss_mask"], strict=True) if m]


def filler(filler_id: int = DEFAULT_FILLER_ID) -> SplitRow:
    """What stands in for a rollout that produced no row: one prompt token, one completion
    token, masked, so the trainer's batch keeps its order and shape and learns nothing from it."""
    return SplitRow([filler_id], [filler_id], [0.0], [0])


def truncate_for_verl(
    split: SplitRow, prompt_length: int, response_length: int
) -> tuple[SplitRow, dict[str, int]]:
    """The split cut to verl's widths, by verl's own rule for agent loops: a prompt over
    ``prompt_length`` keeps its **last** ``prompt_length`` tokens (verl's
    ``_cap_text_prompt_length``: left truncation), a response over ``response_length`` keeps
    its **first** ``response_length`` tokens (as verl's tool agent loop cuts ``response_ids``);
    mask and logprobs are cut with it. Every kept response token keeps exactly the logprob it
    was sampled with (its context, the prompt, was what vLLM saw; a cut prompt only drops
    context the trainer will not see, as verl does). Returns the cut split and how many tokens
    each side lost."""
    if prompt_length < 1 or response_length < 1:
        raise ValueError(
            f"prompt_length and response_length must be at least 1 (got {prompt_length}, "
            f"{response_length}): set actor_rollout_ref.rollout.prompt_length / response_length"
        )
    prompt = split.prompt_ids[-prompt_length:]
    cut = {
        "prompt_tokens_cut": len(split.prompt_ids) - len(prompt),
        "response_tokens_cut": max(0, len(split.completion_ids) - response_length),
    }
    return (
        SplitRow(
            prompt,
            split.completion_ids[:response_length],
            split.completion_logprobs[:response_length],
            split.completion_mask[:response_length],
        ),
        cut,
    )


def prompt_text(prompt: Any) -> str:
    """The task text of a trainer's prompt: a string as it is; a conversation (a list of
    ``{"role", "content"}`` messages, TRL's conversational format, verl's ``raw_prompt``) → the
    text of its last user message (content blocks of type ``text`` joined). Agent CLIs take one
    task as text: a system message or earlier turns are not passed on."""
    if isinstance(prompt, str):
        return prompt
    messages = list(prompt) if isinstance(prompt, Sequence) else []
    for message in reversed(messages):
        if isinstance(message, Mapping) and message.get("role") == "user":
            content = message.get("content")
            if isinstance(content, str):
                return content
            if isinstance(content, Sequence):
                texts = [
                    str(block.get("text", ""))
                    for block in content
                    if isinstance(block, Mapping) and block.get("type") == "text"
                ]
                return "\n".join(texts)
    raise ValueError(
        "a prompt must be the task as text, or a conversation holding a user message; got "
        f"{type(prompt).__name__}: {str(prompt)[:200]!r}"
    )


def verl_fields(
    run: Mapping[str, Any],
    prompt_length: int,
    response_length: int,
    filler_id: int = DEFAULT_FILLER_ID,
) -> dict[str, Any]:
    """The fields of verl's ``AgentLoopOutput`` for one agent's rollout answer (no verl needed):
    its main row split after the first call's prompt, cut by ``truncate_for_verl``'s rule (the
    filler when it made no row). ``reward_score``: the rollout's reward (None where it has none);
    ``num_turns``: two per call the row trains (the message it answered and the reply, as verl
    counts them); ``extra_fields``: ``min_global_steps`` / ``max_global_steps`` from the weight
    versions that sampled the trained tokens (``weight_steps``; left out when the row names
    none with a number), the session id, ``agenttap_run`` (``run_summary``: what the step's
    metrics read, ``AgentTapLoopManager``), and how many tokens each side lost to the cut."""
    row = main_row(run.get("rows") or [])
    split = split_row(row) if row is not None else filler(filler_id)
    split, cut = truncate_for_verl(split, prompt_length, response_length)
    extra: dict[str, Any] = {
        "agenttap_session_id": run.get("session_id"),
        RUN_SUMMARY_FIELD: run_summary(run),
        **cut,
    }
    if run.get("node") is not None:  # run by a Ray pool's actor (capture/client/ray_pool.py)
        extra["agenttap_node"], extra["agenttap_proxy"] = run["node"], run.get("proxy")
    if row is not None:
        low, high = weight_steps(row)
        if low is not None:
            extra["min_global_steps"], extra["max_global_steps"] = low, high
        extra["agenttap_weight_versions"] = row_versions(row)
    return {
        "prompt_ids": split.prompt_ids,
        "response_ids": split.completion_ids,
        "response_mask": split.completion_mask,
        "response_logprobs": split.completion_logprobs,
        "reward_score": reward_value(run.get("reward")),
        "num_turns": 2 * int(row.get("num_turns") or 0) if row is not None else 0,
        "extra_fields": extra,
    }
