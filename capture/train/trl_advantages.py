"""TRL's own advantages, each to its session (``POST /sessions/ID/advantage``), for the viewer
to show instead of its estimate, with each step's time as the trainer ran it:
``AdvantageSender``, held by capture/train/trl.py's rollout function. Nothing trains on them; a
failure to send one is logged and training goes on. No torch or TRL import at module level (the
step's-end callback is transformers' ``TrainerCallback``, imported once a trainer calls)."""

from __future__ import annotations

import logging
import time
from typing import Any, Protocol

logger = logging.getLogger(__name__)


class AdvantageSink(Protocol):
    def advantage(
        self,
        session_id: str,
        advantage: float,
        step: int | None = None,
        step_s: float | None = None,
    ) -> None: ...


class AdvantageSender:
    """The latest batch's sessions in the order of its samples and the step they train (TRL
    scores them after the rollout function returns), sent once TRL has."""

    def __init__(self, tap: AdvantageSink) -> None:
        self.tap = tap
        self._unsent: tuple[list[str], int | None] | None = None
        self._watching: Any = None

    def batch(self, sessions: list[str], step: int | None) -> None:
        """The batch the rollout function just returned: its advantages are sent next."""
        self._unsent = (sessions, step)

    def send(self, trainer: Any, step_s: float | None = None) -> int:
        """The advantages TRL computed for the latest batch, each to its session. TRL keeps the
        latest generation batch's, all processes' in order, in ``trainer._logs["advantages"]``;
        this process's samples are its ``process_index``-th slice, as TRL cuts it. Sent once per
        batch, at the step's end (with ``step_s``, the trainer's time for the step, measured by
        ``watch_steps``' callback) or on the next call; returns how many were sent (0 when TRL
        has not scored the batch yet)."""
        if self._unsent is None or trainer is None:
            return 0
        sessions, step = self._unsent
        logs = getattr(trainer, "_logs", None)
        values = list(logs.get("advantages") or ()) if isinstance(logs, dict) else []
        index = getattr(getattr(trainer, "accelerator", None), "process_index", 0)
        mine = values[index * len(sessions) : (index + 1) * len(sessions)]
        if not sessions or len(mine) != len(sessions):
            return 0
        self._unsent = None
        sent = 0
        for sid, advantage in zip(sessions, mine, strict=True):
            try:
                self.tap.advantage(sid, float(advantage), step, step_s)
                sent += 1
            except Exception as exc:  # a pool's actor raises its own kinds
                # For the viewer only: the training goes on without it.
                logger.warning("agenttap: the trainer's advantage of %s was not kept: %s", sid, exc)
        return sent

    def watch_steps(self, trainer: Any) -> None:
        """Once per trainer: a callback that sends each step's advantages at its end (the
        last step's would otherwise wait for a call that never comes), with the step's time
        from its beginning to its end as the trainer ran it (rollouts, update, callbacks)."""
        if self._watching is trainer or not callable(getattr(trainer, "add_callback", None)):
            return
        from transformers import TrainerCallback

        send = self.send

        class SendAdvantages(TrainerCallback):  # type: ignore[misc]  # transformers' class
            began: float | None = None

            def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
                self.began = time.monotonic()

            def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
                took = time.monotonic() - self.began if self.began is not None else None
                send(trainer, took)

        trainer.add_callback(SendAdvantages())
        self._watching = trainer
