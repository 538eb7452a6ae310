"""Rollouts of the scaffolds beside the CLIs (``"agent": "opencode"`` and ``"mini-swe-agent"``):
agenttap runs each in its bubblewrap sandbox (only the system, the agent's own install, the CA and
the run's folders shown), headless, in a fresh copy of the task's workdir with its config written
into the run's HOME; the stub scripts the four-turn task (tests/support/scaffold_task.py) and the
verifier scores the copy."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from capture.client.launcher import AgentTap
from capture.rollouts.agents import AGENTS
from tests.e2e.rollouts.test_rollouts import agent_processes
from tests.support.proxies import read_threads, read_turns
from tests.support.scaffold_task import (
    DONE,
    MINI_STEPS,
    OPENCODE_STEPS,
    SEED,
    TASK,
    VERIFIER,
    check_trained_exactly_once,
    seed,
    step_rule,
)
from tests.support.stub_vllm import StubPolicy

STEPS = {"opencode": OPENCODE_STEPS, "mini-swe-agent": MINI_STEPS}


@pytest.fixture
def scripted(stub: StubPolicy, request: pytest.FixtureRequest) -> Iterator[None]:
    rule = step_rule(stub, STEPS[request.node.callspec.params["agent"]])
    stub.rules.insert(0, rule)
    yield
    stub.rules.remove(rule)


@pytest.mark.parametrize("agent", list(STEPS))
@pytest.mark.usefixtures("scripted")
def test_a_rollout_of_each_scaffold_is_scored_into_its_rows(
    stub_tap: AgentTap, agent: str, tmp_path: Path
) -> None:
    task = seed(tmp_path / "task")
    result = stub_tap.rollout(
        agent, TASK, n=1, workdir=task, verifier=VERIFIER, metadata={"task_id": "notes"}
    )
    assert result["status"] == "done" and result["sandbox"] == "bwrap"
    for run in result["rollouts"]:
        assert run["status"] == "ok", run
        assert run["finish_reason"] == "stop" and run["reward"] == 1.0
        assert run["verifier_output"].splitlines() == ["checking", "1"]
        folder = Path(run["workdir"]).parent
        assert (folder / "work" / "notes.txt").read_text() == DONE
        # Its config went into its own HOME before it started.
        for relative, text in AGENTS[agent].home_files.items():
            assert (folder / "home" / relative).read_text() == text
        rows = run["rows"]
        mains = [r for r in rows if r["thread_kind"] == "main"]
        assert len(mains) == 1 and mains[0]["num_turns"] == 4, rows
        assert mains[0]["reward"] == 1.0 and mains[0]["end_reason"] == "stop"
        assert json.loads(mains[0]["metadata"])["group_id"] == result["id"]
        # OpenCode's title call is its one side call.
        aux = [r for r in rows if r["thread_kind"] == "auxiliary"]
        assert len(aux) == (1 if agent == "opencode" else 0), rows
        assert run["metrics"]["calls"] == 4 + len(aux)
    # The rows as written, every call trained once at the stub's ids and logprobs.
    for run in result["rollouts"]:
        sid = run["session_id"]
        check_trained_exactly_once(read_threads(stub_tap.out, sid), read_turns(stub_tap.out, sid))
    assert (task / "notes.txt").read_text() == SEED  # each run worked on its own copy
    assert not agent_processes(stub_tap.out / "rollouts" / result["id"])
