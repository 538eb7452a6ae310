"""The scaffolds' rollout agents (capture/rollouts/agents.py): OpenCode and mini-swe-agent's
command lines, switches and the config written into a run's HOME; in-process, nothing started."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from capture.rollouts.agents import (
    AGENTS,
    AGENTS_VENV_BIN,
    PINNED_BIN,
    Agent,
    agent_command,
    prepare_home,
)


def test_opencode_runs_one_message_headless_without_reaching_out() -> None:
    command, env = agent_command("opencode", "-fix the bug")
    assert Path(command[0]) == PINNED_BIN / "opencode"
    assert command[1] == "run" and "--auto" in command
    assert command[command.index("--format") + 1] == "json"
    assert command[command.index("-m") + 1].startswith("anthropic/")
    # A prompt starting with "-" is the message, not a flag.
    assert command[-2:] == ["--", "-fix the bug"]
    for switch in ("AUTOUPDATE", "MODELS_FETCH", "DEFAULT_PLUGINS", "LSP_DOWNLOAD", "SHARE"):
        assert env[f"OPENCODE_DISABLE_{switch}"] == "1"


def test_mini_swe_agent_runs_its_default_config_headless() -> None:
    command, env = agent_command("mini-swe-agent", "-fix the bug")
    assert Path(command[0]) == AGENTS_VENV_BIN / "mini"
    assert "--task=-fix the bug" in command
    assert {"-y", "--exit-immediately"} <= set(command)
    assert command[command.index("-c") + 1] == "mini.yaml"
    assert command[command.index("-l") + 1] == "0"
    assert command[command.index("-m") + 1].startswith("openai/")
    assert env == {
        "MSWEA_CONFIGURED": "true",
        "MSWEA_COST_TRACKING": "ignore_errors",
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",
    }


def test_prepare_home_writes_the_agents_config(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    prepare_home("opencode", home)
    config = json.loads((home / ".config" / "opencode" / "opencode.json").read_text())
    assert config["autoupdate"] is False and config["share"] == "disabled"
    # The others need nothing in HOME; a command agent gets nothing written.
    for spec in ("mini-swe-agent", "claude-code", {"command": ["true"]}, "nope"):
        other = tmp_path / str(len(list(tmp_path.iterdir())))
        other.mkdir()
        prepare_home(spec, other)
        assert not any(other.iterdir())


def test_a_missing_scaffold_names_its_installer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    missing = Agent("x", "no-such-agent", lambda p: [p], installer="scripts/setup_agents.sh")
    with pytest.raises(FileNotFoundError, match="scripts/setup_agents.sh"):
        missing.command("task")
    assert set(AGENTS) >= {"opencode", "mini-swe-agent"}
