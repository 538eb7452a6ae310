"""The ``terminus-2`` rollout agent (capture/rollouts/agents.py): Harbor's Python running
capture/harbor/rollout.py on the prompt, and what its sandbox is shown for it; the
exec server the Harbor environment runs inside its sandbox (capture/harbor/execd.py).
In-process, nothing of Harbor imported (it lives in .venv-harbor)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from capture.harbor import execd as harbor_execd
from capture.isolation.sandbox import program_paths
from capture.rollouts.agents import HARBOR_ROLLOUT, HARBOR_VENV_BIN, agent_command


def test_terminus_2_runs_the_harbor_script_on_the_prompt() -> None:
    if not (HARBOR_VENV_BIN / "python").exists():
        pytest.fail(f"Harbor is not installed in {HARBOR_VENV_BIN}: run scripts/setup.sh")
    command, env = agent_command("terminus-2", "-fix the bug")
    assert command == [str(HARBOR_VENV_BIN / "python"), str(HARBOR_ROLLOUT), "-fix the bug"]
    assert env["LITELLM_LOCAL_MODEL_COST_MAP"] == "True" and env["SHELL"] == "/bin/bash"
    # The sandbox shows Harbor's venv and the script file, nothing else of the repository.
    shown = program_paths(command, os.environ.get("PATH", "/usr/bin:/bin"))
    assert HARBOR_ROLLOUT in shown
    assert HARBOR_VENV_BIN.parent in shown
    assert not any(p in (HARBOR_ROLLOUT.parent, HARBOR_ROLLOUT.parents[2]) for p in shown)


def test_the_exec_server_answers_output_and_status() -> None:
    done = harbor_execd.run({"command": "echo out; echo err >&2; exit 3", "cwd": "/"})
    assert done == {"stdout": "out\n", "stderr": "err\n", "return_code": 3, "timed_out": False}
    env = harbor_execd.run({"command": 'echo "$HOME $X"', "cwd": "/", "env": {"X": "y"}})
    assert env["stdout"] == "/root y\n"


def test_a_command_past_its_timeout_is_killed_with_its_group(tmp_path: Path) -> None:
    """What the command started in the background goes too (it is in the command's group)."""
    pidfile = tmp_path / "pid"
    started = time.monotonic()
    done = harbor_execd.run(
        {"command": f"sleep 30 & echo $! > {pidfile}; sleep 30", "cwd": "/", "timeout": 0.5}
    )
    assert done["timed_out"] and time.monotonic() - started < 10
    pid = int(pidfile.read_text())
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return  # gone
        if state == "Z":
            return  # killed, not yet reaped by its new parent
        time.sleep(0.05)
    raise AssertionError(f"the background sleep {pid} outlived the timeout")
