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
# The keys of a rollout's "limits" this module reads; SESSION_LIMIT_KEYS are the session's
# (capture/control/sessions.py), allowed beside them and left to it.
SANDBOX_LIMIT_KEYS = ("memory_mb", "pids", "disk_mb", "cpu_s", "output_mb")
SESSION_LIMIT_KEYS = ("max_calls", "max_tokens", "deadline_s")
# What ``watch`` and ``RolloutCgroup.exceeded`` name.
LIMIT_NAMES = ("memory", "pids", "cpu_s", "disk", "output")
# The largest whole-number limit (MiB, tasks): a PiB, past any machine and no overflow in bytes.
MAX_WHOLE = 1 << 30
MAX_CPU_S = 1e9


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

    memory_mb: int = 4096
    pids: int = 512
    disk_mb: int = 2048
    cpu_s: float = 3600.0
    output_mb: int = 16

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
    units = {"memory_mb": " (MiB)", "pids": " (tasks)", "disk_mb": " (MiB)", "output_mb": " (MiB)"}
    for key, unit in units.items():
        if key not in value:
            continue
        v = value[key]
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= MAX_WHOLE:
            raise ValueError(
                f'"limits.{key}" must be a whole number from 1 to {MAX_WHOLE}{unit}, not {v!r}; '
                f"leave it out for the default ({getattr(defaults, key)})"
            )
        changes[key] = v
    if "cpu_s" in value:
        v = value["cpu_s"]
        if (
            isinstance(v, bool)
            or not isinstance(v, int | float)
            or not math.isfinite(v)
            or not 0 < v <= MAX_CPU_S
        ):
            raise ValueError(
                f'"limits.cpu_s" must be a number of CPU seconds > 0 and at most {MAX_CPU_S:g}, '
                f"not {v!r}; leave it out for the default ({defaults.cpu_s:g})"
            )
        changes["cpu_s"] = float(v)
    return replace(defaults, **changes)


def reject_unknown(body: dict[str, Any], known: tuple[str, ...], what: str = "field") -> None:
    """A ``ValueError`` naming the keys of ``body`` that are not ``known`` (and those that are)."""
    unknown = sorted(set(body) - set(known))
    if unknown:
        raise ValueError(f"unknown {what}(s) {', '.join(unknown)}; known: {', '.join(known)}")


# Which limit key says what, for the words of an error.
LIMIT_KEYS = {
    "memory": ("memory_mb", "MB of memory"),
    "pids": ("pids", "processes and threads"),
    "cpu_s": ("cpu_s", "CPU seconds"),
    "disk": ("disk_mb", "MB of disk (work, HOME and TMPDIR)"),
    "output": ("output_mb", "MB of output"),
}


def limit_words(role: str, limit: str, limits: SandboxLimits) -> str:
    """The error of a run ended by a kernel limit: which, and how to raise it."""
    key, what = LIMIT_KEYS.get(limit, (limit, limit))
    value = getattr(limits, key, "?")
    return (
        f"the {role} went past its limit of {value:g} {what} and was stopped "
        f'(limits.{key}; raise it in the rollout\'s "limits" if the task needs more)'
    )
