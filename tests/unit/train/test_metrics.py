"""A step's rollout numbers (capture/train/metrics.py), as both trainers' adapters log them:
from the rollouts' answers (TRL), and from verl's batch, each sample's ``run_summary`` grouped
by its ``uid``."""

from __future__ import annotations

import math
from typing import Any

import pytest

from capture.train.metrics import (
    METRIC_PREFIX,
    batch_rollout_metrics,
    rollout_metrics,
    run_summary,
)


def run(status: str, calls: int, wall: float, versions: list[str], lag: int = 0) -> dict[str, Any]:
    spans = [{"version": v, "start": i, "end": i + 1} for i, v in enumerate(versions)]
    return {
        "status": status,
        "metrics": {"calls": calls, "prompt_tokens": 100, "completion_tokens": 10 * calls,
                    "refused": 0, "errors": 0, "rollout_wall_time_s": wall,
                    "version_lag": lag},
        "rows": [{"loss_mask": [1] * len(versions), "weight_versions": spans}],
    }  # fmt: skip


def test_a_steps_numbers_from_its_groups() -> None:
    groups = [
        [run("ok", 1, 2.0, ["step-1"]), run("ok", 3, 4.0, ["step-1"])],
        [run("ok", 2, 6.0, ["step-1", "step-2"], lag=1), run("error", 0, 8.0, [])],
    ]
    rewards = [[1.0, 0.0], [0.5, None]]
    got = rollout_metrics(groups, rewards, 12.5)
    assert all(name.startswith(METRIC_PREFIX) for name in got)
    short = {name.removeprefix(METRIC_PREFIX): value for name, value in got.items()}
    assert short["reward_mean"] == pytest.approx(0.5)
    # Within each group (a group with one scored agent has no spread): only the first, 0.5.
    assert short["reward_std_in_group"] == pytest.approx(0.5)
    assert (short["agents"], short["scored"]) == (4, 3)
    assert (short["status_ok"], short["status_not_ok"]) == (3, 1)
    assert short["calls_per_agent"] == pytest.approx(1.5)
    assert short["completion_tokens_per_agent"] == pytest.approx(15)
    assert short["wall_s_per_agent"] == pytest.approx(5.0)
    assert short["weight_versions"] == 2 and short["rollout_s"] == 12.5
    # One agent's tokens came from weights one update behind when it closed.
    assert short["version_lag_per_agent"] == pytest.approx(0.25)
    assert short["version_lag_max"] == 1


def test_nothing_scored_is_not_a_number_not_zero() -> None:
    got = rollout_metrics([[run("error", 0, 1.0, [])]], [[None]], 1.0)
    assert math.isnan(got[METRIC_PREFIX + "reward_mean"])
    assert math.isnan(got[METRIC_PREFIX + "reward_std_in_group"])


def test_a_verl_batch_gives_the_numbers_its_answers_give() -> None:
    """The same four agents as above, as verl carries them: each sample's summary (no rows),
    its group its prompt's uid, in any order; the rollout seconds its slowest agent's."""
    answers = [
        run("ok", 1, 2.0, ["step-1"]), run("ok", 3, 4.0, ["step-1"]),
        run("ok", 2, 6.0, ["step-1", "step-2"], lag=1), run("error", 0, 8.0, []),
    ]  # fmt: skip
    for answer, reward in zip(answers, (1.0, 0.0, 0.5, None), strict=True):
        answer["reward"] = reward
    summaries = [run_summary(a) for a in answers]
    assert all("rows" not in s for s in summaries)
    assert summaries[2]["weight_versions"] == ["step-1", "step-2"]
    order = [2, 0, 3, 1]
    uids = ["a", "a", "b", "b"]  # by the answers above: two prompts
    got = batch_rollout_metrics([summaries[i] for i in order], [uids[i] for i in order])
    groups = [answers[:2], answers[2:]]
    want = rollout_metrics(groups, [[1.0, 0.0], [0.5, None]], 8.0)
    assert got.keys() == want.keys()
    for name, value in want.items():
        assert got[name] == pytest.approx(value), name


def test_a_batch_without_uids_or_without_agenttap_samples() -> None:
    one = run_summary({**run("ok", 1, 2.0, ["v"]), "reward": 1.0})
    other = run_summary({**run("ok", 1, 3.0, ["v"]), "reward": 0.0})
    # No uid: each sample alone, so no group has a spread.
    alone = batch_rollout_metrics([one, other])
    assert alone[METRIC_PREFIX + "reward_mean"] == 0.5
    assert math.isnan(alone[METRIC_PREFIX + "reward_std_in_group"])
    # Samples another agent loop made carry no summary: left out; none at all, nothing logged.
    mixed = batch_rollout_metrics([one, None, other], ["u", "u", "u"])
    assert mixed[METRIC_PREFIX + "agents"] == 2
    assert mixed[METRIC_PREFIX + "reward_std_in_group"] == pytest.approx(0.5)
    assert batch_rollout_metrics([None, None], ["u", "u"]) == {}


def test_a_pushs_numbers_from_its_answer() -> None:
    from capture.train.metrics import push_metrics

    answer = {"checked": True, "replicas": [{"max_diff": 2e-6}, {"max_diff": 5e-6}, {}]}
    assert push_metrics(answer, 1.5) == {
        METRIC_PREFIX + "push_s": 1.5, METRIC_PREFIX + "push_max_diff": 5e-6,
    }  # fmt: skip
    # Not checked (no probe, no server measured): the time only, no made-up 0.
    assert push_metrics({"checked": False, "replicas": [{}]}, 0.5) == {
        METRIC_PREFIX + "push_s": 0.5
    }
