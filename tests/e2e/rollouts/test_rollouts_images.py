"""Rollouts in a task's own image (``"image"``): a real scaffold brought in from the host runs
in a podman container of an image that has neither it nor node nor the host's Python; its tool
calls run the image's tools; the verifier starts from the state the agent left, with the hidden
tests shown at /tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from capture.client.launcher import AgentTap
from tests.e2e.rollouts.test_rollouts import agent_processes
from tests.support.proxies import read_threads, read_turns
from tests.support.scaffold_task import (
    DONE,
    MINI_STEPS,
    TASK,
    VERIFIER,
    check_trained_exactly_once,
    step_rule,
)
from tests.support.stub_vllm import StubPolicy

IMAGE = "localhost/agenttap-notes:test"


@pytest.fixture
def scripted(stub: StubPolicy) -> Iterator[None]:
    rule = step_rule(stub, MINI_STEPS)
    stub.rules.insert(0, rule)
    yield
    stub.rules.remove(rule)


@pytest.mark.usefixtures("scripted")
def test_mini_swe_agent_in_an_image_is_scored_on_its_state(stub_tap: AgentTap) -> None:
    result = stub_tap.rollout("mini-swe-agent", TASK, n=1, image=IMAGE, verifier=VERIFIER)
    assert result["status"] == "done" and result["sandbox"] == "podman", result
    run = result["rollouts"][0]
    assert run["status"] == "ok", run["error"]
    assert run["reward"] == 1.0 and run["finish_reason"] == "stop"
    folder = Path(run["workdir"]).parent
    assert (folder / "work" / "notes.txt").read_text() == DONE
    sid = run["session_id"]
    check_trained_exactly_once(read_threads(stub_tap.out, sid), read_turns(stub_tap.out, sid))
    assert not agent_processes(stub_tap.out / "rollouts" / result["id"])
