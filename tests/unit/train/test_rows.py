"""capture/train's conversions of thread rows, pure (no torch, no trainer library): the main
row of a rollout, its prompt / completion split (as to_rl_batch cuts it), TRL's samples and
rollout function (against a fake agenttap), verl's fields and truncation, weight versions."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from capture.client.launcher import AgentTapError
from capture.storage.reader import to_rl_batch
from capture.storage.row_rules import row_versions, version_step, weight_steps
from capture.train import trl as train_trl
from capture.train.rows import (
    filler,
    main_row,
    prompt_text,
    sampled_ids,
    split_row,
    truncate_for_verl,
    verl_fields,
)
from capture.train.trl import agenttap_reward, group_prompts, make_rollout_func, sample_from_run

# A two-call row: prompt (0-3), sampled (4-5), a tool result (6-7), sampled (8-9).
IDS = [10, 11, 12, 13, 20, 21, 30, 31, 22, 23]
MASK = [0, 0, 0, 0, 1, 1, 0, 0, 1, 1]
LOGPROBS = [0.0] * 4 + [-0.5, -0.25] + [0.0, 0.0] + [-1.0, -2.0]
SPANS = [
    {"version": "step-3", "start": 4, "end": 6},
    {"version": "step-4", "start": 8, "end": 10},
]


def row(**over: Any) -> dict[str, Any]:
    base = {
        "session_id": "s1", "thread_id": "t-main", "thread_kind": "main", "dead": False,
        "input_ids": IDS, "loss_mask": MASK, "logprobs": LOGPROBS, "num_turns": 2,
        "weight_versions": SPANS, "reward": 1.0, "metadata": None,
    }  # fmt: skip
    return {**base, **over}


def test_the_main_row_is_the_live_main_row_training_the_most_calls() -> None:
    title = row(thread_id="t-title", thread_kind="auxiliary", num_turns=1)
    sub = row(thread_id="t-sub", thread_kind="subagent", num_turns=5)
    dead = row(thread_id="t-dead", dead=True, num_turns=9)
    short = row(thread_id="t-short", num_turns=1)
    main = row()
    assert main_row([title, sub, dead, short, main]) is main
    assert main_row([title, sub, dead]) is None
    assert main_row([]) is None
    legacy = row(thread_kind=None)  # written before the column: main
    assert main_row([title, legacy]) is legacy


def test_the_split_is_where_the_first_call_prompt_ends_and_matches_to_rl_batch() -> None:
    split = split_row(row())
    assert split.prompt_ids == IDS[:4]
    assert split.completion_ids == IDS[4:]
    assert split.completion_mask == MASK[4:]  # the tool tokens between the calls: 0
    assert split.completion_logprobs == LOGPROBS[4:]
    assert sampled_ids(row()) == [20, 21, 22, 23]
    batch = to_rl_batch([row()], pad_id=0)
    assert batch["prompts"][0].tolist() == split.prompt_ids
    assert batch["responses"][0].tolist() == split.completion_ids
    assert batch["response_mask"][0].tolist() == split.completion_mask
    np.testing.assert_allclose(batch["rollout_log_probs"][0], split.completion_logprobs)


def test_a_row_that_trains_nothing_keeps_one_masked_token() -> None:
    split = split_row(row(loss_mask=[0] * len(IDS)))
    assert split.prompt_ids == IDS[:-1] and split.completion_ids == IDS[-1:]
    assert split.completion_mask == [0] and split.completion_logprobs == [0.0]
    with pytest.raises(ValueError, match="differ in length"):
        split_row(row(logprobs=[0.0]))
    assert filler(7).prompt_ids == [7] and filler(7).completion_mask == [0]


def test_weight_versions_as_steps() -> None:
    assert version_step("12") == 12 and version_step("step-12") == 12
    assert version_step("default") is None
    assert row_versions(row()) == ["step-3", "step-4"]
    assert weight_steps(row()) == (3, 4)
    # A span over prompt tokens only trains nothing here: not counted.
    spans = [{"version": "step-1", "start": 0, "end": 4}, *SPANS]
    assert weight_steps(row(weight_versions=spans)) == (3, 4)
    assert row_versions(row(weight_versions=spans), trained_only=False)[0] == "step-1"
    assert weight_steps(row(weight_versions=[])) == (None, None)
    assert weight_steps(row(weight_versions=None)) == (None, None)


def test_prompt_text_takes_a_string_or_the_last_user_message() -> None:
    assert prompt_text("do it") == "do it"
    chat = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    ]
    assert prompt_text(chat) == "a\nb"
    with pytest.raises(ValueError, match="user message"):
        prompt_text([{"role": "system", "content": "x"}])


def test_a_trl_sample_from_a_rollout() -> None:
    run = {"session_id": "s1", "status": "ok", "rows": [row(thread_kind="auxiliary"), row()]}
    sample = sample_from_run(run, 0.5)
    assert sample["prompt_ids"] == IDS[:4] and sample["completion_ids"] == IDS[4:]
    assert sample["env_mask"] == MASK[4:] and sample["logprobs"] == LOGPROBS[4:]
    assert sample["agenttap_reward"] == 0.5
    assert sample["agenttap_weight_versions"] == ["step-3", "step-4"]
    empty = sample_from_run({"session_id": "s2", "status": "error", "rows": []}, None, 9)
    assert empty["prompt_ids"] == [9] and empty["completion_ids"] == [9]
    assert empty["env_mask"] == [0] and empty["agenttap_reward"] is None
    assert agenttap_reward(["x", "y"], [0.5, None]) == [0.5, None]


def test_identical_prompts_are_grouped_in_first_seen_order() -> None:
    prompts = ["a", "a", "b", "b", [{"role": "user", "content": "a"}]]
    assert group_prompts(prompts) == {"a": [0, 1, 4], "b": [2, 3]}


class FakeTap:
    """AgentTap's rollout calls, answered at once: each agent's main row has its prompt's
    length as its first id, so the test sees which prompt each sample came from."""

    def __init__(self, busy_first: bool = False, rewards: list[float | None] | None = None) -> None:
        self.started: list[dict[str, Any]] = []
        self.answers: dict[str, dict[str, Any]] = {}
        self.busy = busy_first
        self.rewards = rewards
        self.posted: list[tuple[str, Any]] = []
        self.client = self

    def rollout(self, agent: Any, prompt: str, n: int = 1, **options: Any) -> dict[str, Any]:
        if self.busy:
            self.busy = False
            raise AgentTapError("POST /rollouts: 429 too many agents", 429)
        rollout_id = f"r{len(self.started)}"
        self.started.append({"agent": agent, "prompt": prompt, "n": n, **options})
        runs = []
        for i in range(n):
            reward = self.rewards[i] if self.rewards else float(i)
            ids = [len(prompt), *IDS[1:]]
            runs.append({
                "index": i, "session_id": f"{rollout_id}-{i}", "reward": reward,
                "status": "ok" if reward is not None else "error",
                "rows": [row(input_ids=ids, session_id=f"{rollout_id}-{i}")],
                "agent_output": "HELLO" if i % 2 else "hello",
            })  # fmt: skip
        self.answers[rollout_id] = {"id": rollout_id, "status": "done", "rollouts": runs}
        return {"id": rollout_id, "status": "running"}

    def get_rollout(self, rollout_id: str) -> dict[str, Any]:
        return self.answers[rollout_id]

    def reward(self, session_id: str, reward: float | dict[str, float]) -> None:
        # As AgentTap.reward: POST /sessions/ID/reward.
        self.post(f"/sessions/{session_id}/reward", {"reward": reward})

    def post(self, path: str, body: Any = None) -> dict[str, Any]:
        self.posted.append((path, body))
        return {}


@pytest.fixture(autouse=True)
def no_waiting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(train_trl, "POLL_S", 0.0)
    monkeypatch.setattr(train_trl, "BUSY_RETRY_S", 0.0)


def test_the_rollout_function_runs_one_rollout_per_task_and_answers_in_order(
    tmp_path: Any,
) -> None:
    tap = FakeTap(busy_first=True)
    func = make_rollout_func(
        tap,
        agent="claude-code",
        workdir=tmp_path,
        verifier=["true"],
        limits={"max_calls": 3},  # type: ignore[arg-type]
    )
    prompts = ["aa", "aa", "bbb", "bbb", "aa"]
    out = func(prompts, None)
    assert [(s["prompt"], s["n"]) for s in tap.started] == [("aa", 3), ("bbb", 2)]
    assert tap.started[0]["verifier"] == ["true"] and tap.started[0]["limits"] == {"max_calls": 3}
    assert tap.started[0]["metadata"]["split"] == "train"
    assert [ids[0] for ids in out["prompt_ids"]] == [2, 2, 3, 3, 2]
    assert out["agenttap_reward"] == [0.0, 1.0, 0.0, 1.0, 2.0]
    assert out["agenttap_session_id"] == ["r0-0", "r0-1", "r1-0", "r1-1", "r0-2"]
    assert set(out) == {
        "prompt_ids", "completion_ids", "logprobs", "env_mask", "agenttap_reward",
        "agenttap_session_id", "agenttap_weight_versions",
    }  # fmt: skip
    assert func.last.agents == 5 and func.last.rollouts == 2
    assert func.last.trained_tokens == 5 * 4 and func.last.versions == ["step-3", "step-4"]


def test_a_python_verifier_scores_here_and_is_recorded_on_the_session() -> None:
    tap = FakeTap(rewards=[1.0, None])  # the second agent failed
    func = make_rollout_func(
        tap,  # type: ignore[arg-type]
        agent={"command": ["python3", "agent.py"]},
        verifier=lambda task, run: float(run["agent_output"].isupper()),
    )
    out = func(["x", "x"], None)
    assert tap.started[0].get("verifier") is None  # not sent: it runs here
    assert out["agenttap_reward"] == [0.0, None]  # a failed agent is not scored
    assert tap.posted == [("/sessions/r0-0/reward", {"reward": 0.0})]


def test_verl_fields_cut_by_verls_rule() -> None:
    run = {"session_id": "s1", "reward": 2.0, "rows": [row()]}
    fields = verl_fields(run, prompt_length=3, response_length=4)
    assert fields["prompt_ids"] == IDS[1:4]  # the prompt keeps its end
    assert fields["response_ids"] == IDS[4:8]  # the response its beginning
    assert fields["response_mask"] == MASK[4:8]
    assert fields["response_logprobs"] == LOGPROBS[4:8]
    assert fields["reward_score"] == 2.0 and fields["num_turns"] == 4
    extra = fields["extra_fields"]
    assert extra["prompt_tokens_cut"] == 1 and extra["response_tokens_cut"] == 2
    assert extra["min_global_steps"] == 3 and extra["max_global_steps"] == 4
    whole = verl_fields(run, prompt_length=100, response_length=100)
    assert whole["prompt_ids"] == IDS[:4] and whole["response_ids"] == IDS[4:]
    assert whole["extra_fields"]["response_tokens_cut"] == 0
    nothing = verl_fields({"session_id": "s3", "reward": float("nan"), "rows": []}, 8, 8, 5)
    assert nothing["prompt_ids"] == [5] and nothing["response_mask"] == [0]
    assert nothing["reward_score"] is None and "min_global_steps" not in nothing["extra_fields"]
    unlabelled = verl_fields({"rows": [row(weight_versions=[])]}, 8, 8)
    assert "min_global_steps" not in unlabelled["extra_fields"]
    with pytest.raises(ValueError, match="prompt_length"):
        truncate_for_verl(split_row(row()), 0, 4)


def test_check_logprobs_compares_the_trained_positions_of_a_version() -> None:
    from capture.train.check_logprobs import Report, RowCheck, format_report, positions_to_check

    assert positions_to_check(row()) == [4, 5, 8, 9]
    assert positions_to_check(row(), "step-4") == [8, 9]
    assert positions_to_check(row(), "step-9") == []
    report = Report([RowCheck("s1", "t1", 4, 2e-6, 8), RowCheck("s2", "t2", 2, 0.5, 9)], 1)
    assert report.tokens == 6 and report.max_diff == 0.5
    assert [r.session_id for r in report.worst()] == ["s2", "s1"]
    text = format_report(report, 1e-3, "step-4")
    assert "max |diff|: 0.5" in text and "of this version" in text
