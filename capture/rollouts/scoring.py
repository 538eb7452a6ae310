"""What the runner does around a verifier's process (capture/rollouts/runner.py ``_verify``):
the files it grades, the environment it gets, and the reward read once it has exited.

Everything the verifier's process could write (its stdout, the reward file, the JUnit report)
is read here as an adversary's output: through no link, bounded, and parsed strictly
(capture/rollouts/verifier.py).
"""

from __future__ import annotations

import os
import shutil
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from capture.logs.escape import printable
from capture.rollouts.grading import Graded, grade_on_seed
from capture.rollouts.pytest_guard import TAMPERED_STATUS
from capture.rollouts.pytest_verifier import RAN, REPORT_CAP, PytestRun, grade
from capture.rollouts.verifier import RewardError, VerifierSpec, file_reward, stdout_reward

# Harbor's convention: the verifier may write its reward here instead of printing it.
REWARD_FILE_ENV = "AGENTTAP_REWARD_FILE"
REWARD_FILE_NAME = "agenttap-reward"
PYTEST_FOLDER = "agenttap-pytest"
# In a Harbor verifier's TMPDIR: the folder shown at /logs/verifier, made fresh for it.
HARBOR_LOGS = "harbor-logs"
REWARD_FILE_CAP = 64 * 1024
# Every file of the agent's, for the pytest verifier when no "keep" is given.
KEEP_ALL = ("**",)


@dataclass
class Scored:
    """A verifier's outcome: its reward, or why there is none (``error``)."""

    reward: float | None = None
    error: str | None = None
    # Named rewards from a rewards.json; the pytest verifier's tests by outcome.
    rewards: dict[str, float] = field(default_factory=dict)
    tests: dict[str, Any] | None = None


def graded_folder(
    verifier: VerifierSpec, seed: Path | None, agent_work: Path, dest: Path
) -> Graded | None:
    """With ``keep`` (or the pytest verifier), make ``dest`` the seed plus the agent's kept
    files and say what was kept; None: the verifier runs in the agent's own copy."""
    if verifier.keep is None and not verifier.pytest:
        return None
    assert seed is not None  # parse_verifier wants a workdir for both
    keep = verifier.keep if verifier.keep is not None else KEEP_ALL
    return grade_on_seed(seed, agent_work, dest, keep, verifier.restore)


def verifier_command(
    verifier: VerifierSpec, tmp: Path, kept: list[Path]
) -> tuple[list[str], dict[str, str]]:
    """The command to run and what it adds to the verifier's environment."""
    if not verifier.pytest:
        return list(verifier.command), {REWARD_FILE_ENV: str(tmp / REWARD_FILE_NAME)}
    python = verifier.python or shutil.which("python3")
    if python is None:
        raise OSError(
            'no python3 on the proxy\'s PATH for the pytest verifier: give "verifier.python"'
        )
    run = PytestRun(tmp / PYTEST_FOLDER)
    run.prepare(kept)
    # No reward file: the JUnit report is its only channel.
    return run.command(python, verifier.pytest), run.env()


def score(verifier: VerifierSpec, returncode: int | None, stdout: str, tmp: Path) -> Scored:
    """The reward of a verifier that exited by itself with ``returncode``."""
    try:
        if verifier.pytest:
            return _pytest_score(verifier, returncode, tmp)
        if verifier.harbor:
            return _harbor_score(verifier, tmp / HARBOR_LOGS)
        if returncode != 0:
            return Scored(error=f"the verifier exited with {returncode}")
        written = read_inside(tmp, REWARD_FILE_NAME, REWARD_FILE_CAP)
        if written is not None:
            reward, named = file_reward(written.decode("utf-8", "replace"), verifier.reward_range)
            return Scored(reward=reward, rewards=named)
        return Scored(reward=stdout_reward(stdout, verifier.reward_range))
    except RewardError as exc:
        return Scored(error=str(exc))


def _harbor_score(verifier: VerifierSpec, logs: Path) -> Scored:
    """A Harbor test script's reward: reward.json (a number, or named numbers), else
    reward.txt, in the /logs/verifier it was given fresh."""
    for name in ("reward.json", "reward.txt"):
        written = read_inside(logs, name, REWARD_FILE_CAP)
        if written is not None:
            reward, named = file_reward(written.decode("utf-8", "replace"), verifier.reward_range)
            return Scored(reward=reward, rewards=named)
    return Scored(
        error="the task's tests/test.sh wrote no /logs/verifier/reward.txt or reward.json "
        "(its output is kept)"
    )


def _pytest_score(verifier: VerifierSpec, returncode: int | None, tmp: Path) -> Scored:
    run = PytestRun(tmp / PYTEST_FOLDER)
    if returncode not in RAN:
        verdict = read_inside(run.folder, run.verdict.name, 4096)
        if returncode == TAMPERED_STATUS and verdict:
            # Written where the tested code could write too: shown escaped, never trusted.
            why = f"not scored: {printable(verdict.decode('utf-8', 'replace'))}"
        else:
            why = f"pytest exited with {returncode}: the named tests did not all run"
        return Scored(error=f"{why} (the verifier's output is kept)")
    report = read_inside(run.folder, run.junit.name, REPORT_CAP)
    if report is None:
        return Scored(error="pytest wrote no JUnit report: the named tests were not scored")
    result = grade(report, verifier.pytest)
    lo, hi = verifier.reward_range
    reward = lo + (hi - lo) * result.reward
    return Scored(reward=reward, tests=result.summary())


def read_inside(folder: Path, name: str, cap: int) -> bytes | None:
    """``folder/name`` if it is a regular file (never through a link: the verifier could have
    swapped one in), at most ``cap`` bytes; None if it is not there. RewardError if it is
    something else or larger. ``folder`` itself must be one the verifier cannot replace, or
    a folder inside such a one (opened without following links too)."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        parent = os.open(folder, flags | os.O_DIRECTORY)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise RewardError(f"{folder.name}/ is not a plain folder ({exc.strerror})") from None
    try:
        try:
            fd = os.open(name, flags | os.O_NONBLOCK, dir_fd=parent)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise RewardError(f"{name} is not a plain file ({exc.strerror})") from None
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise RewardError(f"{name} is not a plain file")
            data = f.read(cap + 1)
    finally:
        os.close(parent)
    if len(data) > cap:
        raise RewardError(f"{name} is over {cap} bytes")
    return data
