"""The OpenHands rollout agent (capture/rollouts/agents.py): its headless command line, its
switches and the saved configuration written into a run's HOME; in-process, nothing started."""

from __future__ import annotations

import json
from pathlib import Path

from capture.rollouts.agents import OPENHANDS_VENV_BIN, agent_command, prepare_home


def test_openhands_runs_one_task_headless() -> None:
    command, env = agent_command("openhands", "-fix the bug")
    assert Path(command[0]) == OPENHANDS_VENV_BIN / "openhands"
    assert {"--headless", "--json"} <= set(command)
    # A prompt starting with "-" is the task, not a flag.
    assert command[-1] == "--task=-fix the bug"
    assert env["LITELLM_LOCAL_MODEL_COST_MAP"] == "True"
    # tmux runs SHELL in its terminal; the sandbox user's login shell is nologin.
    assert env["SHELL"] == "/bin/bash"


def test_prepare_home_writes_openhands_settings(tmp_path: Path) -> None:
    prepare_home("openhands", tmp_path)
    settings = json.loads((tmp_path / ".openhands" / "agent_settings.json").read_text())
    assert settings["kind"] == "Agent"
    # LiteLLM's OpenAI route, with the session's key from OPENAI_API_KEY (none in the file).
    assert settings["llm"]["model"].startswith("openai/") and "api_key" not in settings["llm"]
    assert {t["name"] for t in settings["tools"]} >= {"terminal", "file_editor"}
    assert settings["condenser"]["kind"] == "LLMSummarizingCondenser"
    assert "api_key" not in settings["condenser"]["llm"]
