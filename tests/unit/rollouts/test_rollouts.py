"""Rollout requests and the agents' command lines (capture/rollouts/spec.py, capture/rollouts/agents.py):
in-process, no agent started."""

from __future__ import annotations

from pathlib import Path

import pytest

from capture.rollouts.agents import AGENTS, PINNED_BIN, agent_command
from capture.rollouts.spec import MAX_N, parse_rollout


def test_each_cli_runs_headless_with_its_switches() -> None:
    claude, env = agent_command("claude-code", "do it")
    assert claude[1:3] == ["-p", "do it"] and "--allowedTools" in claude
    assert env["CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC"] == "1"
    codex, _ = agent_command("codex", "do it")
    assert codex[1] == "exec" and "--dangerously-bypass-approvals-and-sandbox" in codex
    assert "--skip-git-repo-check" in codex and codex[-1] == "do it"
    gemini, env = agent_command("gemini", "do it")
    assert gemini[1:] == ["-p", "do it", "--yolo"] and env["GEMINI_CLI_TRUST_WORKSPACE"] == "true"
    # The pinned copies scripts/install_clients.sh installs are the ones run.
    for command in (claude, codex, gemini):
        assert Path(command[0]).parent == PINNED_BIN
    assert agent_command({"command": ["python", "agent.py"]}, "task") == (
        ["python", "agent.py", "task"],
        {},
    )
    assert set(AGENTS) == {
        *("claude-code", "codex", "gemini", "opencode", "mini-swe-agent", "openhands"),
        "terminus-2",
    }


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({"agent": "aider", "prompt": "x"}, "unknown agent"),
        ({"agent": {"command": []}, "prompt": "x"}, '"agent"'),
        ({"agent": "codex", "prompt": ""}, '"prompt"'),
        ({"agent": "codex", "prompt": "x", "n": MAX_N + 1}, '"n"'),
        ({"agent": "codex", "prompt": "x", "n": True}, '"n"'),
        ({"agent": "codex", "prompt": "x", "verifier": {"command": "check"}}, '"verifier"'),
        ({"agent": "codex", "prompt": "x", "timeout_s": 0}, '"timeout_s"'),
        ({"agent": "codex", "prompt": "x", "limits": {"max_calls": -1}}, "max_calls"),
        ({"agent": "codex", "prompt": "x", "id": "a b"}, '"id"'),
        ({"agent": "codex", "prompt": "x", "tools": []}, "unknown field"),
        ({"agent": "codex", "prompt": "x", "sandbox": "docker"}, '"sandbox"'),
        ({"agent": "codex", "prompt": "x", "sandbox": False}, '"sandbox"'),
        ({"agent": "codex", "prompt": "x", "verifier": {"restore": ["tests"]}}, '"verifier"'),
        (
            {"agent": "codex", "prompt": "x", "verifier": {"command": ["t"], "on_error": "x"}},
            '"verifier',  # "verifier" or "verifier.on_error"
        ),
        (
            {"agent": "codex", "prompt": "x", "verifier": {"command": ["t"], "restore": ["t"]}},
            '"restore" puts paths back from the "workdir"',
        ),
        (
            {
                "agent": "codex",
                "prompt": "x",
                "workdir": "/",
                "verifier": {"command": ["t"], "restore": ["../etc"]},
            },
            '"restore"',
        ),
        (
            {
                "agent": "codex",
                "prompt": "x",
                "workdir": "/",
                "verifier": {"command": ["t"], "restore": ["/etc"]},
            },
            '"restore"',
        ),
    ],
)
def test_bad_rollout_requests_say_what_is_wrong(body: dict, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        parse_rollout(body)


def test_a_rollout_request_is_read(tmp_path: Path) -> None:
    spec = parse_rollout(
        {"agent": "codex", "prompt": "fix it", "n": 3, "workdir": str(tmp_path),
         "limits": {"deadline_s": 60}, "verifier": {"command": ["pytest", "-q"]},
         "metadata": {"task_id": "t"}, "id": "run-1"}
    )  # fmt: skip
    assert spec.n == 3 and spec.workdir == tmp_path and spec.verifier is not None
    assert spec.verifier.command == ("pytest", "-q")
    assert spec.limits == {"deadline_s": 60.0} and spec.id == "run-1"
    # The agent's own timeout follows its deadline, with a minute to end cleanly.
    assert spec.timeout_s == 120.0
    assert parse_rollout({"agent": "codex", "prompt": "x"}).id.startswith("r-")


def test_the_sandbox_and_restore_are_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "task").mkdir()
    monkeypatch.chdir(tmp_path)
    spec = parse_rollout(
        {"agent": "codex", "prompt": "x", "workdir": "task", "sandbox": "none",
         "verifier": {"command": ["pytest"], "restore": ["tests/", "setup.cfg"]}}
    )  # fmt: skip
    # A relative workdir is the proxy's, resolved once: the copy does not depend on a later cwd.
    assert spec.workdir == tmp_path / "task" and spec.workdir.is_absolute()
    assert spec.verifier is not None and spec.verifier.restore == ("tests", "setup.cfg")
    assert spec.sandbox == "none"
    # No "sandbox": the option's (agenttap_sandbox) applies.
    assert parse_rollout({"agent": "codex", "prompt": "x"}).sandbox is None
    assert parse_rollout({"agent": "codex", "prompt": "x", "sandbox": "bwrap"}).sandbox == "bwrap"
