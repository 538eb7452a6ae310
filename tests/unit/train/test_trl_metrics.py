"""The rollout numbers the TRL adapter puts in the trainer's own logs (capture/train/trl.py
``rollout_metrics``, ``log_to_trainer``): computed from the rollouts' answers, and kept where
TRL's ``GRPOTrainer`` keeps its per-step metrics, so its ``log`` hands them to ``report_to``."""

from __future__ import annotations

import math
from collections import defaultdict
from types import SimpleNamespace
from typing import Any

import pytest

from capture.train.trl import METRIC_PREFIX, log_to_trainer, rollout_metrics


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


def test_the_numbers_go_where_grpo_keeps_its_own() -> None:
    # GRPOTrainer: _metrics = {"train": defaultdict(list), "eval": defaultdict(list)}.
    store: dict[str, defaultdict[str, list[float]]] = {
        "train": defaultdict(list), "eval": defaultdict(list),
    }  # fmt: skip
    trainer = SimpleNamespace(_metrics=store, model=SimpleNamespace(training=True))
    assert log_to_trainer(trainer, {"agenttap/x": 1.0})
    assert log_to_trainer(trainer, {"agenttap/x": 3.0})
    assert store["train"]["agenttap/x"] == [1.0, 3.0] and not store["eval"]
    trainer.model.training = False
    assert log_to_trainer(trainer, {"agenttap/x": 5.0}) and store["eval"]["agenttap/x"] == [5.0]
    # No trainer, or one that keeps no such store: nothing to do, no error.
    assert not log_to_trainer(None, {"agenttap/x": 1.0})
    assert not log_to_trainer(SimpleNamespace(), {"agenttap/x": 1.0})


class Tap:
    def __init__(self) -> None:
        self.sent: list[tuple[str, float, int | None]] = []

    def advantage(self, session_id: str, advantage: float, step: int | None = None) -> None:
        self.sent.append((session_id, advantage, step))


def test_the_trainers_advantages_go_to_their_sessions_once() -> None:
    """TRL keeps the latest batch's advantages, every process's in order; this process's slice
    goes to the sessions of its samples, once, when TRL has scored them."""
    from capture.train.trl import AgentTapRolloutFunc

    tap = Tap()
    func = AgentTapRolloutFunc(tap, agent="claude-code")  # type: ignore[arg-type]
    func.advantages.batch(["s-a", "s-b"], 4)
    trainer = SimpleNamespace(
        _logs={"advantages": []}, accelerator=SimpleNamespace(process_index=1)
    )
    assert func.advantages.send(trainer) == 0 and tap.sent == []  # not scored yet
    trainer._logs["advantages"] = [0.1, 0.2, 0.7, -0.7]
    assert func.advantages.send(trainer) == 2
    assert tap.sent == [("s-a", 0.7, 4), ("s-b", -0.7, 4)]
    assert func.advantages.send(trainer) == 0 and len(tap.sent) == 2  # once


def test_an_advantage_that_cannot_be_kept_never_stops_training(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from capture.train.trl import AgentTapRolloutFunc

    class Refusing(Tap):
        def advantage(self, session_id: str, advantage: float, step: int | None = None) -> None:
            if session_id == "s-a":
                raise KeyError(session_id)
            super().advantage(session_id, advantage, step)

    tap = Refusing()
    func = AgentTapRolloutFunc(tap, agent="claude-code")  # type: ignore[arg-type]
    func.advantages.batch(["s-a", "s-b"], 1)
    trainer = SimpleNamespace(_logs={"advantages": [0.5, -0.5]})
    assert func.advantages.send(trainer) == 1 and tap.sent == [("s-b", -0.5, 1)]
    assert "the trainer's advantage of s-a was not kept" in caplog.text
