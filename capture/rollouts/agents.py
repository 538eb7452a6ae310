"""The real CLI agents a rollout runs headless: one place per agent for its command line and the
flags that make it run without asking (permissions, sandbox, trust).

Checked against the versions ``scripts/install_clients.sh`` pins (Claude Code 2.1.330, Codex
0.169.0, Gemini CLI 0.61.0) by ``tests/e2e/test_rollouts.py``. Each agent runs in proxy mode:
the session's ``env`` (capture/control/api.py ``Endpoints.env``) carries the proxy, the CA under
every name these CLIs read it from, and its session's secret as the keys; each gets a fresh
``HOME`` so no earlier run's configuration or history leaks in, and runs in the rollout's
bubblewrap sandbox (capture/rollouts/sandbox.py: only its workdir copy, ``HOME`` and ``TMPDIR``
writable), which is why the CLIs' own permission prompts and sandboxes are switched off here.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# Where scripts/install_clients.sh puts the pinned CLIs; else they are looked up on PATH.
PINNED_BIN = REPO / ".cache" / "node" / "node_modules" / ".bin"


@dataclass(frozen=True)
class Agent:
    """How to run one CLI agent on a prompt, headless."""

    name: str
    binary: str
    # The arguments after the binary, for a prompt.
    args: Callable[[str], list[str]]
    # Environment the agent needs beyond the session's (switches for headless runs).
    env: dict[str, str] = field(default_factory=dict)

    def command(self, prompt: str) -> list[str]:
        return [resolve(self.binary), *self.args(prompt)]


def resolve(binary: str) -> str:
    """The pinned copy of ``binary`` if installed, else the one on PATH; a clear error if
    neither exists."""
    pinned = PINNED_BIN / binary
    if pinned.exists():
        return str(pinned)
    found = shutil.which(binary)
    if found is None:
        raise FileNotFoundError(
            f"agent CLI {binary!r} is not installed: run scripts/install_clients.sh (puts it in "
            f"{PINNED_BIN}) or put it on PATH"
        )
    return found


AGENTS: dict[str, Agent] = {
    # -p: print mode, one task, then exit. As root, --dangerously-skip-permissions is refused,
    # so the tools it may use without asking are listed instead.
    "claude-code": Agent(
        "claude-code",
        "claude",
        lambda prompt: ["-p", prompt, "--allowedTools", "Bash,Write,Edit,Read,Glob,Grep"],
        {"DISABLE_AUTOUPDATER": "1", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"},
    ),
    # exec: non-interactive; no approvals and no sandbox of its own (the rollout's bwrap sandbox
    # is the boundary, around a copy of the workdir);
    # outside a git repository it refuses to start without --skip-git-repo-check.
    "codex": Agent(
        "codex",
        "codex",
        lambda prompt: [
            "exec",
            "--skip-git-repo-check",
            "--dangerously-bypass-approvals-and-sandbox",
            "--json",
            prompt,
        ],
    ),
    # -p: one prompt, then exit; --yolo approves every tool call. Without trust in the workdir a
    # headless run exits with code 55.
    "gemini": Agent(
        "gemini",
        "gemini",
        lambda prompt: ["-p", prompt, "--yolo"],
        {"GEMINI_CLI_TRUST_WORKSPACE": "true"},
    ),
}


def agent_command(spec: object, prompt: str) -> tuple[list[str], dict[str, str]]:
    """The command and extra environment for a rollout's ``agent``: a name from ``AGENTS`` or
    ``{"command": [...]}`` (the prompt is appended as its last argument). ValueError otherwise."""
    if isinstance(spec, str):
        agent = AGENTS.get(spec)
        if agent is None:
            raise ValueError(
                f'unknown agent {spec!r}; known: {", ".join(AGENTS)}, or {{"command": [...]}}'
            )
        return agent.command(prompt), dict(agent.env)
    if isinstance(spec, dict) and set(spec) == {"command"}:
        command = spec["command"]
        if isinstance(command, list) and command and all(isinstance(a, str) for a in command):
            return [*command, prompt], {}
    raise ValueError(
        f'"agent" must be one of {", ".join(AGENTS)} or {{"command": ["program", "arg", ...]}}'
    )
