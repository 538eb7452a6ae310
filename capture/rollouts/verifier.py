"""A rollout's ``"verifier"``: what it runs, on which files, and how its reward is read.

The verifier runs the agent's code, so the agent can try to write its own score. What this
module decides is the part no tested code can reach once the verifier has exited:

- **The reward channel.** The verifier's stdout alone, never its stderr (a number written to
  stderr without a newline once joined the harness's ``0`` into ``1e300``); or the file named by
  ``$AGENTTAP_REWARD_FILE`` (Harbor's ``reward.txt`` / ``rewards.json``), read after the verifier
  exited. One plain decimal number, finite, inside ``"reward_range"`` (default ``[0, 1]``):
  anything else ends the run ``error`` with no reward (``read_reward``).
- **The files graded** (``"keep"``): a fresh copy of the seed workdir plus only the agent's files
  that match ``keep`` (capture/rollouts/grading.py).
- **The built-in pytest verifier** (``"pytest"``): node ids; the reward is the share of them
  that passed, read from a JUnit report (capture/rollouts/pytest_verifier.py).

Pure: parsing and arithmetic only.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from capture.isolation.workdir import check_restore

REWARD_RANGE = (0.0, 1.0)
# A plain decimal number: no "nan", "inf", hex, underscores or surrounding words.
_NUMBER = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?")
_USAGE = (
    '"verifier" must be {"command": ["program", "arg", ...]} or {"pytest": ["tests/test_x.py::'
    'test_y", ...]}, with "keep"?: [globs], "restore"?: [paths], "on_error"?: "skip" | '
    '"score", "reward_range"?: [lo, hi], and for pytest "python"?: "/path/to/python"'
)


class RewardError(ValueError):
    """Why a verifier's output is no reward, in words for the run's ``error``."""


@dataclass(frozen=True)
class VerifierSpec:
    """A parsed ``"verifier"``. Exactly one of ``command`` and ``pytest`` is set."""

    command: tuple[str, ...] = ()
    # Node ids the built-in pytest verifier runs; the reward is the share that passed.
    pytest: tuple[str, ...] = ()
    # The Python that runs pytest (None: the first python3 on the proxy's PATH).
    python: str | None = None
    # Globs of the agent's files copied into a fresh copy of the seed; None: the verifier
    # runs in the agent's own copy (restore applied). The pytest verifier always grades on the
    # seed: its default keeps every file but the ones never kept (grading.NEVER_KEPT).
    keep: tuple[str, ...] | None = None
    restore: tuple[str, ...] = ()
    on_error: str = "skip"
    reward_range: tuple[float, float] = REWARD_RANGE
    # A folder on the proxy's machine shown read-only at /tests in an image's verifier only
    # (hidden tests: the agent never saw them, and nothing it left there counts).
    tests: Path | None = None
    # Harbor's convention (a task folder's tests/test.sh): the reward is what it wrote to
    # /logs/verifier (reward.json, else reward.txt), a folder made fresh for it; its exit status
    # and output are not read.
    harbor: bool = False
    # Seconds it may run (None: the default, capture/rollouts/steps.py VERIFIER_TIMEOUT_S).
    timeout_s: float | None = None


def parse_verifier(spec: Any, has_workdir: bool) -> VerifierSpec:
    """A rollout's ``"verifier"`` body; ValueError worded for the caller otherwise."""
    if isinstance(spec, list) and spec and all(isinstance(a, str) for a in spec):
        spec = {"command": spec}  # the short form: the command alone
    if not isinstance(spec, dict):
        raise ValueError(_USAGE)
    known = {"command", "pytest", "python", "keep", "restore", "on_error", "reward_range", "tests"}
    if not set(spec) <= known:
        unknown = ", ".join(sorted(map(str, set(spec) - known)))
        raise ValueError(f"{_USAGE}; not {unknown}")
    if ("command" in spec) == ("pytest" in spec):
        raise ValueError(f'{_USAGE}: give one of "command" and "pytest"')
    command = _strings(spec, "command") if "command" in spec else ()
    pytest_ids = _strings(spec, "pytest") if "pytest" in spec else ()
    python = spec.get("python")
    if python is not None:
        if not pytest_ids:
            raise ValueError('"verifier.python" goes with "pytest": the Python that runs it')
        if not isinstance(python, str) or not python.startswith("/") or "\x00" in python:
            raise ValueError('"verifier.python" must be an absolute path to a Python with pytest')
    keep = None
    if "keep" in spec:
        keep = _strings(spec, "keep")
        for glob in keep:
            if glob.startswith("/") or ".." in glob.split("/"):
                raise ValueError(f'"verifier.keep": {glob!r} must be relative, inside the workdir')
    if (keep is not None or pytest_ids) and not has_workdir:
        raise ValueError(
            '"verifier": "keep" and "pytest" grade a fresh copy of the seed "workdir": give one'
        )
    restore = check_restore(spec.get("restore", []))
    if restore and not has_workdir:
        raise ValueError('"restore" puts paths back from the "workdir": give one')
    on_error = spec.get("on_error", "skip")
    if on_error not in ("skip", "score"):
        raise ValueError(
            '"verifier.on_error" must be "skip" (a failed agent gets no reward) or "score" '
            "(the verifier scores it all the same)"
        )
    tests = None
    if "tests" in spec:
        value = spec["tests"]
        if not isinstance(value, str) or not value.startswith("/") or "\x00" in value:
            raise ValueError(
                '"verifier.tests" must be an absolute folder path on the proxy\'s machine'
            )
        tests = Path(value).resolve()
        if not tests.is_dir():
            raise ValueError(
                f'"verifier.tests" {str(tests)!r} is not a folder on the proxy\'s machine'
            )
    return VerifierSpec(
        tests=tests,
        command=command,
        pytest=pytest_ids,
        python=python,
        keep=keep,
        restore=restore,
        on_error=on_error,
        reward_range=_reward_range(spec.get("reward_range", list(REWARD_RANGE))),
    )


def _strings(spec: dict[str, Any], key: str) -> tuple[str, ...]:
    value = spec[key]
    if not isinstance(value, list) or not value or not all(isinstance(a, str) and a for a in value):
        raise ValueError(f'"verifier": "{key}" must be a non-empty list of strings')
    if any("\x00" in a for a in value):
        raise ValueError(f'"verifier": "{key}" holds a NUL character')
    return tuple(value)


def _reward_range(value: Any) -> tuple[float, float]:
    words = '"verifier.reward_range" must be [lo, hi]: two finite numbers, lo < hi'
    if not isinstance(value, list) or len(value) != 2:
        raise ValueError(words)
    if any(isinstance(v, bool) or not isinstance(v, int | float) for v in value):
        raise ValueError(words)
    lo, hi = float(value[0]), float(value[1])
    if not (math.isfinite(lo) and math.isfinite(hi) and lo < hi):
        raise ValueError(words)
    return lo, hi


def number(text: str, where: str, reward_range: tuple[float, float]) -> float:
    """``text`` as a reward: one plain decimal number, finite, inside ``reward_range``."""
    word = text.strip()
    if not _NUMBER.fullmatch(word):
        raise RewardError(f"{where} is not one number: {_shown(word)}")
    value = float(word)
    lo, hi = reward_range
    if not math.isfinite(value):
        raise RewardError(f"{where} is not a finite number: {_shown(word)}")
    if not lo <= value <= hi:
        raise RewardError(
            f'{where} is {value:g}, outside the verifier\'s "reward_range" [{lo:g}, {hi:g}]'
        )
    return value


def stdout_reward(stdout: str, reward_range: tuple[float, float]) -> float:
    """The reward a verifier printed: the last non-empty line of its stdout."""
    lines = [line for line in stdout.splitlines() if line.strip()]
    if not lines:
        raise RewardError(
            "the verifier printed nothing on stdout: it must print the reward last (its "
            "stderr is never read for it), or write it to $AGENTTAP_REWARD_FILE"
        )
    return number(lines[-1], "the verifier's last stdout line", reward_range)


def file_reward(text: str, reward_range: tuple[float, float]) -> tuple[float, dict[str, float]]:
    """The reward in ``$AGENTTAP_REWARD_FILE``: a number (Harbor's ``reward.txt``), or a JSON
    object of named rewards (``rewards.json``) whose ``"reward"`` (or only entry) is the
    rollout's reward. Returns it and every named one."""
    where = "$AGENTTAP_REWARD_FILE"
    stripped = text.strip()
    if not stripped.startswith("{"):
        return number(stripped, where, reward_range), {}
    try:
        named = json.loads(stripped)
    except ValueError as exc:
        raise RewardError(f"{where} is neither a number nor a JSON object ({exc})") from None
    if not isinstance(named, dict) or not named:
        raise RewardError(f"{where} holds an empty JSON object: name at least one reward")
    values: dict[str, float] = {}
    for name, value in named.items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise RewardError(f"{where}: {_shown(str(name))} is not a number")
        if not math.isfinite(value):
            raise RewardError(f"{where}: {_shown(str(name))} is not finite")
        values[str(name)] = float(value)
    if "reward" in values:
        main = "reward"
    elif len(values) == 1:
        main = next(iter(values))
    else:
        raise RewardError(
            f'{where} names {len(values)} rewards and none is "reward": say which one is the '
            "rollout's"
        )
    return number(repr(values[main]), f"{where}'s {_shown(main)}", reward_range), values


def _shown(text: str) -> str:
    """Agent-written text quoted for an error: bounded, controls escaped."""
    return repr(text[:80] + ("..." if len(text) > 80 else ""))
