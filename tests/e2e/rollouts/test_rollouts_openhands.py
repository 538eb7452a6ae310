"""A rollout of ``"agent": "openhands"``: agenttap runs the OpenHands CLI headless in its
bubblewrap sandbox (only the system, .venv-openhands and its base Python, the CA and the run's
folders shown), in a fresh copy of the task's workdir, with its saved configuration
(``~/.openhands/agent_settings.json``) written into the run's HOME; the stub scripts the
four-turn task in whatever folder the sandbox shows the copy at (OpenHands' system prompt names
it) and the verifier scores the copy."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from capture.client.launcher import AgentTap
from capture.rollouts.agents import AGENTS
from tests.e2e.clis.test_openhands import OPENHANDS, openhands_rule
from tests.e2e.rollouts.test_rollouts import agent_processes
from tests.support.proxies import read_threads, read_turns
from tests.support.scaffold_task import DONE, SEED, TASK, VERIFIER, check_trained_exactly_once, seed
from tests.support.stub_vllm import StubPolicy


@pytest.fixture
def scripted(stub: StubPolicy) -> Iterator[None]:
    rule = openhands_rule(stub)
    stub.rules.insert(0, rule)
    yield
    stub.rules.remove(rule)


@pytest.mark.usefixtures("scripted")
def test_a_rollout_of_openhands_is_scored_into_its_rows(stub_tap: AgentTap, tmp_path: Path) -> None:
    assert OPENHANDS.exists(), "OpenHands is not installed: run scripts/setup.sh"
    task = seed(tmp_path / "task")
    result = stub_tap.rollout(
        "openhands", TASK, n=1, workdir=task, verifier=VERIFIER, metadata={"task_id": "notes"}
    )
    assert result["status"] == "done" and result["sandbox"] == "bwrap"
    (run,) = result["rollouts"]
    assert run["status"] == "ok", run
    assert run["finish_reason"] == "stop" and run["reward"] == 1.0
    assert run["verifier_output"].splitlines() == ["checking", "1"]
    folder = Path(run["workdir"]).parent
    assert (folder / "work" / "notes.txt").read_text() == DONE
    # Its configuration went into its own HOME before it started, and it kept its
    # conversation there (its events as JSON files).
    for relative, text in AGENTS["openhands"].home_files.items():
        assert (folder / "home" / relative).read_text() == text
    assert list((folder / "home" / ".openhands" / "conversations").glob("*/events/event-*.json"))
    rows = run["rows"]
    (main,) = rows
    assert main["thread_kind"] == "main" and main["num_turns"] == 4, rows
    assert main["reward"] == 1.0 and main["end_reason"] == "stop"
    assert json.loads(main["metadata"])["group_id"] == result["id"]
    assert run["metrics"]["calls"] == 4
    # The rows as written, every call trained once at the stub's ids and logprobs.
    sid = run["session_id"]
    check_trained_exactly_once(read_threads(stub_tap.out, sid), read_turns(stub_tap.out, sid))
    assert (task / "notes.txt").read_text() == SEED  # the run worked on its own copy
    assert not agent_processes(stub_tap.out / "rollouts" / result["id"])
