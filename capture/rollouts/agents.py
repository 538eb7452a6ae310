"""The real CLI agents a rollout runs headless: one ``AGENTS`` entry per agent for its command
line, the flags that make it run without asking (permissions, sandbox, trust), its environment
and its configuration folders in the run's fresh HOME. Adding an agent is one entry here and
its setup script.

Checked against the versions the setup scripts pin (Claude Code 2.1.330, Codex 0.169.0, Gemini
CLI 0.61.0, OpenCode 1.18.33 in ``scripts/install_clients.sh``; mini-swe-agent 2.4.6 in
``scripts/setup_agents.sh``; OpenHands 1.16.0 in ``scripts/setup_openhands.sh``) by
``tests/e2e/rollouts/test_rollouts.py``, ``tests/e2e/rollouts/test_rollouts_scaffolds.py`` and
``tests/e2e/rollouts/test_rollouts_openhands.py``. Each agent runs in proxy mode: the
session's ``env`` (capture/control/endpoints.py ``Endpoints.env``) carries the proxy, the CA
under every name these CLIs read it from, and its session's secret as the keys; each gets a
fresh ``HOME`` (what an agent needs in it before it starts is written by ``prepare_home``) so
no earlier run's configuration or history leaks in, and runs in the rollout's bubblewrap sandbox
(capture/isolation/sandbox.py: only its workdir copy, ``HOME`` and ``TMPDIR`` writable), which
is why the CLIs' own permission prompts and sandboxes are switched off here.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# Where scripts/install_clients.sh puts the pinned CLIs; else they are looked up on PATH.
PINNED_BIN = REPO / ".cache" / "node" / "node_modules" / ".bin"
# Where scripts/setup_agents.sh puts the pinned Python scaffolds (a venv apart from the proxy's).
AGENTS_VENV_BIN = REPO / ".venv-agents" / "bin"
# Harbor (Terminus-2), in a venv of its own by scripts/setup_harbor.sh, and the script that runs
# a trial of it in the rollout's workdir.
HARBOR_VENV_BIN = REPO / ".venv-harbor" / "bin"
HARBOR_ROLLOUT = REPO / "capture" / "harbor" / "rollout.py"
# Where scripts/setup_openhands.sh puts the pinned OpenHands CLI (a venv of its own).
OPENHANDS_VENV_BIN = REPO / ".venv-openhands" / "bin"


@dataclass(frozen=True)
class Agent:
    """How to run one CLI agent on a prompt, headless."""

    name: str
    binary: str
    # The arguments after the binary, for a prompt.
    args: Callable[[str], list[str]]
    # Environment the agent needs beyond the session's (switches for headless runs).
    env: dict[str, str] = field(default_factory=dict)
    # Files written into the run's fresh HOME before it starts: path relative to HOME -> text.
    home_files: dict[str, str] = field(default_factory=dict)
    # Where its pinned install puts the binary, and the script that installs it there.
    pinned: Path = PINNED_BIN
    installer: str = "scripts/install_clients.sh"
    # Its configuration folders: variables that name a folder in its fresh HOME (variable ->
    # path relative to HOME), and the folders made there before it starts (a CLI that refuses
    # a configuration folder that does not exist).
    home_env: dict[str, str] = field(default_factory=dict)
    home_dirs: tuple[str, ...] = ()
    # Host programs its scaffold runs beside its own, shown in a task image's container when
    # the image lacks them (capture/isolation/containers.py ``host_tools``).
    container_tools: tuple[str, ...] = ()

    def command(self, prompt: str) -> list[str]:
        return [resolve(self.binary, self.pinned, self.installer), *self.args(prompt)]

    def prepare(self, home: Path) -> None:
        """Write the agent's configuration into ``home`` (the run's fresh HOME)."""
        for relative, text in self.home_files.items():
            path = home / relative
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)


def resolve(
    binary: str, pinned_bin: Path = PINNED_BIN, installer: str = "scripts/install_clients.sh"
) -> str:
    """The pinned copy of ``binary`` if installed, else the one on PATH; a clear error if
    neither exists."""
    pinned = pinned_bin / binary
    if pinned.exists():
        return str(pinned)
    found = shutil.which(binary)
    if found is None:
        raise FileNotFoundError(
            f"agent CLI {binary!r} is not installed: run {installer} (puts it in "
            f"{pinned_bin}) or put it on PATH"
        )
    return found


# OpenCode's global config (~/.config/opencode/opencode.json): no update check or install, no
# share links; its permission prompts are answered by --auto.
OPENCODE_CONFIG = {
    "$schema": "https://opencode.ai/config.json",
    "autoupdate": False,
    "share": "disabled",
}

# OpenHands' saved configuration (~/.openhands/agent_settings.json, what its first-run setup
# writes): the CLI's default agent (its terminal, file editor, task tracker and sub-agent tools,
# the CLI system prompt with the security-risk field, the summarizing condenser) on LiteLLM's
# OpenAI route. No api_key: LiteLLM then reads OPENAI_API_KEY, the session's key.
OPENHANDS_SETTINGS = {
    "llm": {"model": "openai/gpt-4o", "usage_id": "agent"},
    "tools": [
        {"name": "terminal"},
        {"name": "file_editor"},
        {"name": "task_tracker"},
        {"name": "task_tool_set"},
    ],
    "system_prompt_kwargs": {"cli_mode": True, "llm_security_analyzer": True},
    "condenser": {
        "kind": "LLMSummarizingCondenser",
        "llm": {"model": "openai/gpt-4o", "usage_id": "condenser"},
        "max_size": 80,
        "keep_first": 4,
    },
    "kind": "Agent",
}

AGENTS: dict[str, Agent] = {
    # -p: print mode, one task, then exit. As root, --dangerously-skip-permissions is refused,
    # so the tools it may use without asking are listed instead.
    "claude-code": Agent(
        "claude-code",
        "claude",
        lambda prompt: ["-p", prompt, "--allowedTools", "Bash,Write,Edit,Read,Glob,Grep"],
        {"DISABLE_AUTOUPDATER": "1", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"},
        home_env={"CLAUDE_CONFIG_DIR": ".claude"},
    ),
    # exec: non-interactive; no approvals and no sandbox of its own (the rollout's bwrap sandbox
    # is the boundary, around a copy of the workdir);
    # outside a git repository it refuses to start without --skip-git-repo-check. CODEX_HOME must
    # be a folder that exists.
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
        home_env={"CODEX_HOME": ".codex"},
        home_dirs=(".codex",),
    ),
    # -p: one prompt, then exit; --yolo approves every tool call. Without trust in the workdir a
    # headless run exits with code 55.
    "gemini": Agent(
        "gemini",
        "gemini",
        lambda prompt: ["-p", prompt, "--yolo"],
        {"GEMINI_CLI_TRUST_WORKSPACE": "true"},
    ),
    # run: one message, then exit; --auto approves every permission not denied; --format json
    # prints its events as JSON lines (agent.log); after --, a prompt starting with - is text.
    # The anthropic provider (Messages API); the proxy answers any model name from the policy.
    # The switches keep it from reaching for the network at start (model list, default plugins
    # from npm, LSP servers, updates): a rollout's sandbox reaches only the policy.
    "opencode": Agent(
        "opencode",
        "opencode",
        lambda prompt: [
            *("run", "--format", "json", "--auto", "-m", "anthropic/claude-sonnet-4-5"),
            *("--", prompt),
        ],
        {
            "OPENCODE_DISABLE_AUTOUPDATE": "1",
            "OPENCODE_DISABLE_MODELS_FETCH": "1",
            "OPENCODE_DISABLE_DEFAULT_PLUGINS": "1",
            "OPENCODE_DISABLE_LSP_DOWNLOAD": "1",
            "OPENCODE_DISABLE_SHARE": "1",
        },
        {".config/opencode/opencode.json": json.dumps(OPENCODE_CONFIG, indent=2) + "\n"},
    ),
    # mini: its default tool-calling config (mini.yaml: one bash tool), LiteLLM's OpenAI route
    # (Chat Completions); --task=PROMPT keeps a prompt starting with - the task; -y runs each
    # command without confirmation, --exit-immediately ends when the agent submits, -l 0 lifts
    # its cost limit (the session's limits bound a run). MSWEA_CONFIGURED skips its first-run
    # setup prompt; LiteLLM reads its model cost map from its own copy (no fetch from GitHub)
    # and an unknown model's cost is not an error.
    "mini-swe-agent": Agent(
        "mini-swe-agent",
        "mini",
        lambda prompt: [
            *("-m", "openai/gpt-4o", f"--task={prompt}", "-y", "--exit-immediately"),
            *("-l", "0", "-c", "mini.yaml"),
        ],
        {
            "MSWEA_CONFIGURED": "true",
            "MSWEA_COST_TRACKING": "ignore_errors",
            "LITELLM_LOCAL_MODEL_COST_MAP": "True",
        },
        pinned=AGENTS_VENV_BIN,
        installer="scripts/setup_agents.sh",
    ),
    # openhands --headless: one task, then exit, every action approved (no UI, no critic);
    # --json prints its events as JSON lines (agent.log); --task=PROMPT keeps a prompt starting
    # with - the task. Its tools run in the sandbox, in the run's workdir (its current folder).
    # Its configuration comes from HOME; LiteLLM reads its own copy of its model cost map (no
    # fetch from GitHub). At start it tries to clone its public skills from GitHub and to ask
    # PyPI for a newer version: both refused by the proxy (403), and it goes on without them.
    # Its terminal is a tmux session, whose shell tmux takes from SHELL, else from the user's
    # passwd entry: the sandbox's user (nobody) has nologin there, which exits at once and
    # takes the tmux server with it.
    "openhands": Agent(
        "openhands",
        "openhands",
        lambda prompt: ["--headless", "--json", f"--task={prompt}"],
        {
            "LITELLM_LOCAL_MODEL_COST_MAP": "True",
            "OPENHANDS_SUPPRESS_BANNER": "1",
            "SHELL": "/bin/bash",
        },
        {".openhands/agent_settings.json": json.dumps(OPENHANDS_SETTINGS, indent=2) + "\n"},
        pinned=OPENHANDS_VENV_BIN,
        installer="scripts/setup_openhands.sh",
    ),
    # Harbor's Terminus-2 (LiteLLM's OpenAI route, Chat Completions) on the prompt as a Harbor
    # task, its commands typed into tmux in the rollout's workdir (capture/harbor/
    # rollout.py: the rollout's sandbox is its environment; verification is agenttap's).
    "terminus-2": Agent(
        "terminus-2",
        "python",
        lambda prompt: [str(HARBOR_ROLLOUT), prompt],
        {"LITELLM_LOCAL_MODEL_COST_MAP": "True", "SHELL": "/bin/bash"},
        pinned=HARBOR_VENV_BIN,
        installer="scripts/setup_harbor.sh",
        # Terminus-2 types its commands into a tmux session.
        container_tools=("tmux",),
    ),
}


def container_tools(spec: object) -> tuple[str, ...]:
    """The host programs a rollout's ``agent`` runs beside its own in a container (none for a
    ``{"command"}`` agent: the image's own program)."""
    return AGENTS[spec].container_tools if isinstance(spec, str) and spec in AGENTS else ()


def _agent_of(spec: object) -> Agent:
    """A rollout's ``agent``'s entry; a ``{"command": [...]}`` agent may be any CLI, so it gets
    every entry's configuration folders and variables (none of their files or switches)."""
    if isinstance(spec, str) and spec in AGENTS:
        return AGENTS[spec]
    return Agent(
        "command",
        "",
        lambda prompt: [prompt],
        home_env={k: v for agent in AGENTS.values() for k, v in agent.home_env.items()},
        home_dirs=tuple(d for agent in AGENTS.values() for d in agent.home_dirs),
    )


def claude_code_capped(max_tokens: int) -> dict[str, list[str]]:
    """Claude Code as the ``claude-code`` agent runs it, its answers capped at ``max_tokens``
    (``CLAUDE_CODE_MAX_OUTPUT_TOKENS``, a variable: so as a ``{"command": [...]}`` agent, the
    task appended last). A tiny policy that forgets to stop would write thousands of tokens."""
    agent = AGENTS["claude-code"]
    env = {**agent.env, "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(max_tokens)}
    return {
        "command": [
            "env", *(f"{k}={v}" for k, v in env.items()), resolve(agent.binary),
            "--allowedTools", "Bash,Write,Edit,Read,Glob,Grep", "-p",
        ]
    }  # fmt: skip


def prepare_home(spec: object, home: Path) -> None:
    """Write what a rollout's ``agent`` needs in its fresh ``home`` before it starts (nothing
    for a ``{"command": [...]}`` agent)."""
    if isinstance(spec, str) and spec in AGENTS:
        AGENTS[spec].prepare(home)


def config_home(spec: object, home: Path) -> dict[str, str]:
    """Make a rollout's ``agent``'s configuration folders in ``home`` and return the variables
    that name them (for a ``{"command": [...]}`` agent, every agent's)."""
    agent = _agent_of(spec)
    for folder in agent.home_dirs:
        (home / folder).mkdir(parents=True, exist_ok=True)
    return {name: str(home / relative) for name, relative in agent.home_env.items()}


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
