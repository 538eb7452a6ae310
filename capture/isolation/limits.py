"""A rollout's limit keys and values: what a request's ``"limits"`` may say
(``parse_sandbox_limits`` → ``SandboxLimits``), and the words of the error when a run goes past
one (``limit_words``).

The kernel enforces them per agent or verifier run (one sandboxed process group), one module per
mechanism: ``cgroup`` (memory, pids, CPU seconds: cgroup v1 or v2, and the rlimits),
``disk`` (a size-capped tmpfs), ``output`` (the log kept to ``output_mb``) and ``watch`` (polls
them, names the first hit); ``host`` finds which of them apply on this host. The memory limit is
the cgroup's, never RLIMIT_AS: V8 reserves far more address space than it uses, so a Node CLI
under a small RLIMIT_AS does not even start.

Standard library only; ``reject_unknown`` is shared with capture/control/sessions.py, which
reads the session's keys of the same ``"limits"`` object.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

MIB = 1 << 20
# The largest whole-number limit (MiB, tasks): a PiB, past any machine and no overflow in bytes.
MAX_WHOLE = 1 << 30
MAX_CPU_S = 1e9


@dataclass(frozen=True)
class Limit:
    """One kernel limit of a run: its key in a request's ``"limits"``, the name a run that went
    past it gives (its ``"limit"``), its unit, its default (``SandboxLimits`` says why), how the
    kernel enforces it (and which module) and the words of the error that names it. A whole
    number from 1 to ``MAX_WHOLE``, or (``whole`` False) a number > 0 up to ``MAX_CPU_S``."""

    key: str
    name: str
    unit: str
    default: int | float
    enforced: str
    words: str
    whole: bool = True


# Every kernel limit, in the order a request's keys are listed. Adding a limit: an entry here,
# a field of ``SandboxLimits`` and its enforcement (a counter ``watch`` reads).
LIMITS: tuple[Limit, ...] = (
    Limit(
        "memory_mb", "memory", "MiB", 4096,
        "cgroup memory, swap counted, the OOM killer on (capture/isolation/cgroup.py)",
        "MB of memory",
    ),
    Limit(
        "pids", "pids", "tasks", 512,
        "cgroup pids: a fork past it is refused (capture/isolation/cgroup.py)",
        "processes and threads",
    ),
    Limit(
        "disk_mb", "disk", "MiB", 2048,
        "a size-capped tmpfs for work, HOME and TMPDIR; RLIMIT_FSIZE per file "
        "(capture/isolation/disk.py)",
        "MB of disk (work, HOME and TMPDIR)",
    ),
    Limit(
        "cpu_s", "cpu_s", "CPU seconds", 3600.0,
        "cgroup cpuacct (every process together); RLIMIT_CPU per process "
        "(capture/isolation/cgroup.py)",
        "CPU seconds", whole=False,
    ),
    Limit(
        "output_mb", "output", "MiB", 16,
        "the agent's log kept to its cap (capture/isolation/output.py)",
        "MB of output",
    ),
)  # fmt: skip
LIMIT_BY_KEY = {limit.key: limit for limit in LIMITS}
LIMIT_BY_NAME = {limit.name: limit for limit in LIMITS}
# The keys of a rollout's "limits" this package reads; SESSION_LIMIT_KEYS are the session's
# (capture/control/sessions.py), allowed beside them and left to it.
SANDBOX_LIMIT_KEYS = tuple(limit.key for limit in LIMITS)
SESSION_LIMIT_KEYS = ("max_calls", "max_tokens", "deadline_s")
# What ``watch`` and ``RolloutCgroup.exceeded`` name.
LIMIT_NAMES = tuple(limit.name for limit in LIMITS)


@dataclass(frozen=True)
class SandboxLimits:
    """One run's limits (an agent's or a verifier's). The defaults, for an agent CLI:

    - ``memory_mb`` 4096: Node CLIs (Claude Code, Codex, Gemini CLI) use 300-600 MB in a
      session (``gemini --version`` alone peaks at 270 MB), the tools they run (a test suite,
      pip, a compiler) more; and the run's tmpfs pages are charged to
      the same cgroup (the kernel charges shmem to whoever wrote it), so this must hold
      ``disk_mb`` and the processes at once: 2 GiB of files and 2 GiB of processes.
    - ``pids`` 512: the kernel counts threads (a Node process alone has about a dozen); enough
      for a CLI, its shells and a parallel test run, and a fork bomb stops there.
    - ``disk_mb`` 2048: a repository checkout with a virtualenv or node_modules. It is RAM
      (tmpfs), charged to ``memory_mb`` too, hence below it.
    - ``cpu_s`` 3600: CPU seconds of every process together; a rollout's default wall-clock
      timeout is 3600 s, so a single busy core for the whole run fits.
    - ``output_mb`` 16: the agent's log is for a person to read; a CLI's stream-JSON output of a
      long session is a few MB.
    """

    memory_mb: int = int(LIMIT_BY_KEY["memory_mb"].default)
    pids: int = int(LIMIT_BY_KEY["pids"].default)
    disk_mb: int = int(LIMIT_BY_KEY["disk_mb"].default)
    cpu_s: float = float(LIMIT_BY_KEY["cpu_s"].default)
    output_mb: int = int(LIMIT_BY_KEY["output_mb"].default)

    def as_dict(self) -> dict[str, float]:
        return {k: getattr(self, k) for k in SANDBOX_LIMIT_KEYS}


def parse_sandbox_limits(value: Any, defaults: SandboxLimits) -> SandboxLimits:
    """A request's ``"limits"`` object read for the sandbox's keys (``SANDBOX_LIMIT_KEYS``,
    each optional: ``defaults`` fills what is missing); the session's keys are allowed and left
    alone, any other key is a ``ValueError`` naming the known ones, as is a bad value."""
    if value is None:
        return defaults
    if not isinstance(value, dict):
        raise ValueError(
            f'"limits" must be an object with any of {", ".join(SANDBOX_LIMIT_KEYS)}, '
            f"{', '.join(SESSION_LIMIT_KEYS)}; got {value!r}"
        )
    reject_unknown(value, (*SANDBOX_LIMIT_KEYS, *SESSION_LIMIT_KEYS), '"limits" key')
    changes: dict[str, Any] = {}
    # Whole numbers first, then the others: which bad value a request is told about first.
    for limit in sorted(LIMITS, key=lambda limit: not limit.whole):
        if limit.key in value:
            changes[limit.key] = _checked(limit, value[limit.key], getattr(defaults, limit.key))
    return replace(defaults, **changes)


def _checked(limit: Limit, v: Any, default: float) -> int | float:
    """A request's value of ``limit``; a ``ValueError`` saying what it must be otherwise."""
    if limit.whole:
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= MAX_WHOLE:
            raise ValueError(
                f'"limits.{limit.key}" must be a whole number from 1 to {MAX_WHOLE} '
                f"({limit.unit}), not {v!r}; leave it out for the default ({default})"
            )
        return v
    if (
        isinstance(v, bool)
        or not isinstance(v, int | float)
        or not math.isfinite(v)
        or not 0 < v <= MAX_CPU_S
    ):
        raise ValueError(
            f'"limits.{limit.key}" must be a number of {limit.unit} > 0 and at most '
            f"{MAX_CPU_S:g}, not {v!r}; leave it out for the default ({default:g})"
        )
    return float(v)


def reject_unknown(body: dict[str, Any], known: tuple[str, ...], what: str = "field") -> None:
    """A ``ValueError`` naming the keys of ``body`` that are not ``known`` (and those that are)."""
    unknown = sorted(set(body) - set(known))
    if unknown:
        raise ValueError(f"unknown {what}(s) {', '.join(unknown)}; known: {', '.join(known)}")


def limit_words(role: str, name: str, limits: SandboxLimits) -> str:
    """The error of a run ended by the kernel limit ``name``: which, and how to raise it."""
    limit = LIMIT_BY_NAME.get(name)
    key, what = (limit.key, limit.words) if limit is not None else (name, name)
    value = getattr(limits, key, "?")
    return (
        f"the {role} went past its limit of {value:g} {what} and was stopped "
        f'(limits.{key}; raise it in the rollout\'s "limits" if the task needs more)'
    )
