"""A rollout and its runs as the runner keeps them (``Rollout``, ``Run``: status, finish reason,
reward, what it used) and what their answers say (``summary``); how a run finishes
(``RunStatus``, ``FinishReason``) and the plain environment every agent and verifier starts from."""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from capture.isolation.box import BoxHandle
from capture.isolation.disk import DiskQuota
from capture.isolation.engines import Engine
from capture.rollouts.spec import RolloutSpec


class RunStatus(StrEnum):
    """Where one agent of a rollout is: waiting for memory, running, being scored, or ended."""

    PENDING = "pending"
    RUNNING = "running"
    SCORING = "scoring"
    OK = "ok"
    ERROR = "error"
    CANCELLED = "cancelled"


# A run still going: what cancelling a rollout ends.
RUN_LIVE = (RunStatus.PENDING, RunStatus.RUNNING, RunStatus.SCORING)


class RolloutStatus(StrEnum):
    RUNNING = "running"
    DONE = "done"


class FinishReason(StrEnum):
    """Why a run ended, beyond its session's own end reasons (capture/control/sessions.py
    ``EndReason``: stop, max_calls, max_tokens, deadline)."""

    ERROR = "error"
    CANCELLED = "cancelled"
    # A kernel limit of the sandbox ended it (the run's "limit" names which).
    LIMIT = "limit"


OUTPUT_KEPT = 4000


@dataclass
class Run:
    """One agent of a rollout: its session, process and outcome."""

    index: int
    session_id: str
    folder: Path
    status: RunStatus = RunStatus.PENDING
    finish_reason: str | None = None
    reward: float | None = None
    exit_code: int | None = None
    error: str | None = None
    agent_output: str = ""
    verifier_output: str = ""
    # The verifier's stderr: shown, never read for the reward.
    verifier_stderr: str = ""
    # What of its files could not be kept on disk at the end (special files, paths too long).
    not_kept: list[str] = field(default_factory=list)
    # With "keep" or the pytest verifier: what of the agent's was graded and what was left out.
    graded: dict[str, Any] | None = None
    # The pytest verifier's tests by outcome; a rewards.json's named rewards.
    tests: dict[str, Any] | None = None
    rewards: dict[str, float] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)
    rows: list[dict[str, Any]] = field(default_factory=list)
    started_at: float = 0.0
    wall_time_s: float = 0.0
    # What was removed from the workdir before scoring (links out of it, FIFOs, sockets).
    sanitized: list[str] = field(default_factory=list)
    # The kernel limit the agent or verifier went past ("memory", "pids", "cpu_s", "disk",
    # "output"), and what its processes used (peak memory, CPU seconds).
    limit: str | None = None
    usage: dict[str, Any] = field(default_factory=dict)
    # Where work/, home/ and tmp/ live while it runs: the run's folder, or the size-capped tmpfs
    # in it (box/) that holds the disk limit; kept on disk in the run's folder at the end.
    base: Path | None = None
    quota: DiskQuota | None = None
    # The box running now: the agent's, then the verifier's.
    handle: BoxHandle | None = None
    # An image's run: the agent's stopped container committed, the verifier's starting state.
    state_image: str | None = None

    def summary(self, rows: bool = True) -> dict[str, Any]:
        out = {
            "index": self.index,
            "session_id": self.session_id,
            "status": self.status,
            "finish_reason": self.finish_reason,
            "reward": self.reward,
            "exit_code": self.exit_code,
            "error": self.error,
            "workdir": str((self.base or self.folder) / "work"),
            "agent_output": self.agent_output,
            "verifier_output": self.verifier_output,
            "verifier_stderr": self.verifier_stderr,
            "graded": self.graded,
            "not_kept": self.not_kept,
            "tests": self.tests,
            "rewards": self.rewards,
            "sanitized": self.sanitized,
            "limit": self.limit,
            "usage": self.usage,
            "metrics": {**self.metrics, "rollout_wall_time_s": round(self.wall_time_s, 3)},
        }
        if rows:
            out["rows"] = self.rows
        return out


@dataclass
class Rollout:
    spec: RolloutSpec
    runs: list[Run]
    # How its agents run: the engine's name ("bwrap", "none") and the engine.
    sandbox: str
    engine: Engine
    created_at: float = field(default_factory=time.time)
    cancelled: bool = False
    task: asyncio.Task[None] | None = None
    # With an "image": where its runs start (its WORKDIR or "cwd") and its PATH, read from
    # the image before any runs; or why it cannot be used.
    image_workdir: str = "/"
    image_path: str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    image_error: str | None = None
    # The image's working folder as it was built (for "keep": the seed its files go onto).
    image_seed: Path | None = None
    # A Harbor task's verifier image, when it has one of its own (tests/Dockerfile).
    verifier_image: str | None = None

    @property
    def id(self) -> str:
        return self.spec.id

    @property
    def done(self) -> bool:
        return self.task is not None and self.task.done()

    def summary(self, rows: bool = True) -> dict[str, Any]:
        return {
            "id": self.id,
            "group_id": self.id,
            "agent": self.spec.agent,
            "n": self.spec.n,
            "status": RolloutStatus.DONE if self.done else RolloutStatus.RUNNING,
            "sandbox": self.sandbox,
            "cancelled": self.cancelled,
            "created_at": self.created_at,
            "rollouts": [r.summary(rows) for r in self.runs],
        }


class Busy(Exception):
    """Too many agents would run at once."""

    def __init__(self, running: int, cap: int) -> None:
        super().__init__(
            f"agenttap: {running} agent(s) are running and at most {cap} may run at once "
            f"(agenttap_max_rollouts); retry when some have ended"
        )


def plain_env(home: Path, tmp: Path) -> dict[str, str]:
    """What an agent's or a verifier's environment starts from: built whole, never from
    os.environ (the proxy's environment may hold the token)."""
    return {
        "PATH": os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"),
        "LANG": os.environ.get("LANG", "C.UTF-8"),
        "HOME": str(home),
        "TMPDIR": str(tmp),
    }


def tail(path: Path, size: int = OUTPUT_KEPT) -> str:
    """The last ``size`` bytes of a log, as text."""
    try:
        with open(path, "rb") as fh:
            fh.seek(max(0, fh.seek(0, os.SEEK_END) - size))
            return fh.read().decode("utf-8", "replace")
    except OSError:
        return ""
