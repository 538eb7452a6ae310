"""Where the TRL adapter puts its rollout numbers (capture/train/trl.py ``log_to_trainer``):
where TRL's ``GRPOTrainer`` keeps its per-step metrics, so its ``log`` hands them to
``report_to`` (the numbers themselves: test_metrics.py); the trainer's advantages sent back."""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import pytest

from capture.train.trl import log_to_trainer


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
