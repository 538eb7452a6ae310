"""A ``POST /rollouts`` request: ``parse_rollout`` checks its body and reads it into a
``RolloutSpec`` (capture/rollouts/runner.py runs it); a ``ValueError`` worded for the caller
otherwise.
"""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from capture.control.sessions import (
    check_metadata,
    check_session_id,
    parse_limits,
    reject_unknown,
)
from capture.isolation.limits import SANDBOX_LIMIT_KEYS, SandboxLimits, parse_sandbox_limits
from capture.rollouts.agents import agent_command
from capture.rollouts.verifier import VerifierSpec, parse_verifier

# The most a rollout request may ask for at once (the cap applies on top of it).
MAX_N = 256
SANDBOXES = ("bwrap", "none")
# What a sandboxed agent may reach beyond the policy's API hosts, through the proxy: "none"
# (nothing) or "public" (public hosts; never loopback, private or link-local addresses, the
# policy servers or the control API).
EGRESS = ("none", "public")


@dataclass
class RolloutSpec:
    agent: Any
    prompt: str
    command: list[str]
    agent_env: dict[str, str]
    n: int = 1
    workdir: Path | None = None
    limits: dict[str, Any] = field(default_factory=dict)
    # The kernel's limits on each agent and verifier (memory, pids, disk, CPU, output).
    sandbox_limits: SandboxLimits = field(default_factory=SandboxLimits)
    metadata: dict[str, Any] = field(default_factory=dict)
    # What scores each agent, on which files, and how its reward is read
    # (capture/rollouts/verifier.py); None: its rows carry no reward.
    verifier: VerifierSpec | None = None
    # "bwrap" or "none"; None: the option's (agenttap_sandbox).
    sandbox: str | None = None
    # Shown read-only in the sandbox, beyond the system, the agent's install and the CA.
    expose: tuple[Path, ...] = ()
    egress: str = "none"
    timeout_s: float = 3600.0
    id: str = ""
    # Seeds the policy's sampling: each agent's session gets a seed of its own from it
    # (capture.control.sessions.agent_seed), each call one from that and its prompt. None: not.
    seed: int | None = None


def parse_rollout(body: Any) -> RolloutSpec:
    """A ``POST /rollouts`` body; ValueError worded for the caller otherwise."""
    if not isinstance(body, dict):
        raise ValueError("the body must be a JSON object")
    known = (
        "agent", "prompt", "workdir", "n", "limits", "metadata", "verifier", "id", "sandbox",
        "expose", "egress", "seed",
    )  # fmt: skip
    reject_unknown(body, (*known, "timeout_s", "wait", "rows"))
    prompt = body.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError('"prompt" must be the task, as text')
    if "\x00" in prompt:
        raise ValueError('"prompt" holds a NUL character, which no command line can carry')
    command, agent_env = agent_command(body.get("agent"), prompt)
    if any("\x00" in arg for arg in command):
        raise ValueError('"agent.command" holds a NUL character, which no command line can carry')
    n = body.get("n", 1)
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_N:
        raise ValueError(f'"n" must be a whole number from 1 to {MAX_N}')
    workdir = None
    if body.get("workdir") is not None:
        if not isinstance(body["workdir"], str):
            raise ValueError('"workdir" must be a folder path on the proxy\'s machine')
        workdir = Path(body["workdir"]).expanduser().resolve()
        if not workdir.is_dir():
            raise ValueError(f'"workdir" {str(workdir)!r} is not a folder on the proxy\'s machine')
    raw_limits = body.get("limits")
    if raw_limits is not None and not isinstance(raw_limits, dict):
        raise ValueError(
            '"limits" must be an object: {"max_calls", "max_tokens", "deadline_s", "memory_mb", '
            '"pids", "disk_mb", "cpu_s", "output_mb"}'
        )
    sandbox_limits = parse_sandbox_limits(raw_limits, SandboxLimits())
    session_limits = {k: v for k, v in (raw_limits or {}).items() if k not in SANDBOX_LIMIT_KEYS}
    limits = parse_limits(session_limits)
    verifier = None
    if body.get("verifier") is not None:
        verifier = parse_verifier(body["verifier"], has_workdir=workdir is not None)
    sandbox = body.get("sandbox")
    if sandbox is not None and sandbox not in SANDBOXES:
        raise ValueError(f'"sandbox" must be one of {", ".join(SANDBOXES)}')
    expose = parse_expose(body.get("expose"))
    egress = body.get("egress", "none")
    if egress not in EGRESS:
        raise ValueError(
            '"egress" must be "none" (the agent reaches only the policy) or "public" (public '
            "hosts too, through the proxy)"
        )
    timeout = body.get("timeout_s")
    if timeout is None:
        timeout = (limits.deadline_s + 60.0) if limits.deadline_s else 3600.0
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout > 0:
        raise ValueError('"timeout_s" must be a number of seconds > 0')
    if not math.isfinite(timeout):
        raise ValueError('"timeout_s" must be finite')
    rollout_id = body.get("id")
    if rollout_id is not None:
        check_session_id(rollout_id)
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ValueError('"seed" must be a whole number (the same seed, the same samples)')
    return RolloutSpec(
        agent=body.get("agent"),
        prompt=prompt,
        command=command,
        agent_env=agent_env,
        n=n,
        workdir=workdir,
        limits={k: v for k, v in vars(limits).items() if v is not None},
        sandbox_limits=sandbox_limits,
        metadata=check_metadata(body.get("metadata")),
        verifier=verifier,
        sandbox=sandbox,
        expose=expose,
        egress=egress,
        timeout_s=float(timeout),
        id=rollout_id or "r-" + uuid.uuid4().hex[:12],
        seed=seed,
    )


def parse_expose(value: Any) -> tuple[Path, ...]:
    """A rollout's ``"expose"``: absolute paths on the proxy's machine that exist."""
    if value is None:
        return ()
    words = '"expose" must be a list of absolute paths on the proxy\'s machine, shown read-only'
    if not isinstance(value, list):
        raise ValueError(words)
    paths = []
    for item in value:
        if not isinstance(item, str) or not item.startswith("/") or "\x00" in item:
            raise ValueError(f"{words}; not {item!r}")
        path = Path(item)
        if not path.exists():
            raise ValueError(f'"expose": {item!r} does not exist on the proxy\'s machine')
        paths.append(path)
    return tuple(paths)
