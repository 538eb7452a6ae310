"""Where the TRL adapter puts its rollout numbers (capture/train/trl.py ``log_to_trainer``):
where TRL's ``GRPOTrainer`` keeps its per-step metrics, so its ``log`` hands them to
``report_to`` (the numbers themselves: test_metrics.py); the trainer's advantages sent back."""

from __future__ import annotations

import time
from collections import defaultdict
from types import SimpleNamespace
from typing import Any

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
        self.step_s: list[float | None] = []

    def advantage(
        self,
        session_id: str,
        advantage: float,
        step: int | None = None,
        step_s: float | None = None,
    ) -> None:
        self.sent.append((session_id, advantage, step))
        self.step_s.append(step_s)


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
    assert func.advantages.send(trainer, 12.5) == 2  # at the step's end: its time with them
    assert tap.sent == [("s-a", 0.7, 4), ("s-b", -0.7, 4)] and tap.step_s == [12.5, 12.5]
    assert func.advantages.send(trainer) == 0 and len(tap.sent) == 2  # once


def test_an_advantage_that_cannot_be_kept_never_stops_training(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from capture.train.trl import AgentTapRolloutFunc

    class Refusing(Tap):
        def advantage(
            self,
            session_id: str,
            advantage: float,
            step: int | None = None,
            step_s: float | None = None,
        ) -> None:
            if session_id == "s-a":
                raise KeyError(session_id)
            super().advantage(session_id, advantage, step, step_s)

    tap = Refusing()
    func = AgentTapRolloutFunc(tap, agent="claude-code")  # type: ignore[arg-type]
    func.advantages.batch(["s-a", "s-b"], 1)
    trainer = SimpleNamespace(_logs={"advantages": [0.5, -0.5]})
    assert func.advantages.send(trainer) == 1 and tap.sent == [("s-b", -0.5, 1)]
    assert "the trainer's advantage of s-a was not kept" in caplog.text


def test_the_step_end_callback_sends_the_steps_own_time() -> None:
    """``watch_steps``' callback times each step from its beginning to its end, as the trainer
    runs it, and sends it with the step's advantages (the viewer's time per step); a step whose
    beginning it did not see (added mid-step) sends none rather than a guess."""
    from capture.train.trl import AgentTapRolloutFunc

    tap = Tap()
    func = AgentTapRolloutFunc(tap, agent="claude-code")  # type: ignore[arg-type]
    callbacks: list[Any] = []
    trainer = SimpleNamespace(_logs={"advantages": []}, add_callback=callbacks.append)
    func.advantages.watch_steps(trainer)
    func.advantages.watch_steps(trainer)  # once per trainer
    assert len(callbacks) == 1
    (callback,) = callbacks
    func.advantages.batch(["s-a"], 1)
    trainer._logs["advantages"] = [0.25]
    callback.on_step_end(None, None, None)  # its beginning unseen
    assert tap.step_s == [None]
    func.advantages.batch(["s-b"], 2)
    trainer._logs["advantages"] = [0.5]
    callback.on_step_begin(None, None, None)
    time.sleep(0.05)
    callback.on_step_end(None, None, None)
    assert tap.sent[-1] == ("s-b", 0.5, 2)
    assert tap.step_s[-1] is not None and 0.05 <= tap.step_s[-1] < 5
