"""Rollouts: agenttap runs the real CLIs itself (POST /rollouts, through the launcher), each in a
fresh copy of the task's workdir, scores them with a verifier, and returns the rows with the
reward and the finish reason. The policy is the stub, answering by rule: a tool call that writes
hello.txt first, then "Done." once the tool's result is in the prompt."""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from capture.launcher import AgentTap, AgentTapError, AsyncAgentTap
from tests.conftest import QWEN3
from tests.e2e.test_anthropic_sdk_stub import hermes
from tests.e2e.test_gemini_cli import answer_router
from tests.stub_vllm import StubPolicy

WRITE_FILE = "printf hi > hello.txt"
# The verifier: 1 if the agent wrote hello.txt holding "hi", else 0 (its last line is the reward).
VERIFIER = [
    "sh",
    "-c",
    'echo checking; if [ "$(cat hello.txt 2>/dev/null)" = hi ]; then echo 1; else echo 0; fi',
]
FIRST_CALL = {
    "claude-code": hermes("Bash", {"command": WRITE_FILE, "description": "Write hello.txt"}),
    "codex": "<think>\nWrite it.\n</think>\n\n"
    + hermes(
        "exec",
        {"input": f'const r = await tools.exec_command({{cmd: "{WRITE_FILE}"}});\ntext(r.output);'},
    ),
    "gemini": hermes("run_shell_command", {"command": WRITE_FILE, "description": "write"}),
}


def agent_rule(stub: StubPolicy, first: str) -> Callable[[dict[str, Any]], str | None]:
    """The tool call until a tool's result is in the prompt, then a final answer; Gemini CLI's
    router call gets a schema-valid answer."""

    def rule(body: dict[str, Any]) -> str | None:
        routed = answer_router(body)
        if routed is not None:
            return routed
        return "Done." if "<tool_response>" in stub.tok.decode(body["prompt"]) else first

    return rule


@pytest.fixture
def scripted(stub: StubPolicy) -> Iterator[Callable[[str], None]]:
    rules: list[Any] = []

    def use(agent: str) -> None:
        rule = agent_rule(stub, FIRST_CALL[agent])
        rules.append(rule)
        stub.rules.insert(0, rule)

    yield use
    for rule in rules:
        stub.rules.remove(rule)


def agent_processes(root: Path) -> list[str]:
    """Processes whose working directory is under ``root`` (an agent or its children)."""
    found = []
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        try:
            cwd = os.readlink(f"/proc/{pid}/cwd")
        except OSError:
            continue
        if cwd.startswith(str(root)):
            found.append(pid)
    return found


@pytest.mark.parametrize("agent", ["claude-code", "codex", "gemini"])
def test_a_rollout_of_each_cli_is_scored_into_its_rows(
    stub_tap: AgentTap, scripted: Callable[[str], None], agent: str, tmp_path: Path
) -> None:
    task = tmp_path / "task"
    task.mkdir()
    (task / "README").write_text("write hello.txt")
    scripted(agent)
    result = stub_tap.rollout(
        agent, "Create hello.txt containing hi", n=2, workdir=task, verifier=VERIFIER,
        metadata={"task_id": "hello", "split": "train"},
    )  # fmt: skip
    assert result["status"] == "done" and result["n"] == 2
    for run in result["rollouts"]:
        assert run["status"] == "ok", run
        assert run["finish_reason"] == "stop" and run["reward"] == 1.0
        work = Path(run["workdir"])
        assert (work / "hello.txt").read_text() == "hi" and (work / "README").exists()
        assert run["verifier_output"].splitlines()[0] == "checking"
        assert run["metrics"]["calls"] >= 2 and run["metrics"]["rollout_wall_time_s"] > 0
        main = max(run["rows"], key=lambda r: r["num_turns"])
        assert main["reward"] == 1.0 and main["end_reason"] == "stop"
        meta = json.loads(main["metadata"])
        assert meta["group_id"] == result["id"] and meta["task_id"] == "hello"
    # The task's own folder is untouched: each agent worked in its own copy.
    assert not (task / "hello.txt").exists()
    assert not agent_processes(stub_tap.out / "rollouts" / result["id"])


def test_a_rollout_stopped_by_its_limit(
    stub_tap: AgentTap, scripted: Callable[[str], None]
) -> None:
    scripted("claude-code")
    result = stub_tap.rollout(
        "claude-code", "Create hello.txt containing hi", limits={"max_calls": 1}, verifier=VERIFIER
    )
    (run,) = result["rollouts"]
    # Its one call wrote the file; the next was refused and Claude Code stopped.
    assert run["finish_reason"] == "max_calls" and run["reward"] == 1.0, run
    assert run["metrics"]["calls"] == 1 and run["metrics"]["refused"] == 1
    assert all(r["end_reason"] == "max_calls" for r in run["rows"])


def test_delete_stops_a_rollout_and_leaves_no_process(stub_tap: AgentTap) -> None:
    # An agent that would run for minutes, with a child of its own.
    sleeper = {"command": ["sh", "-c", "sleep 300 & sleep 300"]}
    started = stub_tap.rollout(sleeper, "wait", n=2, wait=False, id="to-stop")
    assert started["status"] == "running"
    root = stub_tap.out / "rollouts" / "to-stop"
    deadline = time.monotonic() + 30
    while len(agent_processes(root)) < 4:
        assert time.monotonic() < deadline, "the agents did not start"
        time.sleep(0.1)
    assert stub_tap.get_rollout("to-stop")["rollouts"][0]["status"] == "running"
    stopped = stub_tap.cancel_rollout("to-stop")
    assert stopped["cancelled"] and stopped["status"] == "done"
    assert {r["finish_reason"] for r in stopped["rollouts"]} == {"cancelled"}
    assert not agent_processes(root)


def test_the_cap_refuses_with_429_and_retry_after(stub_tap: AgentTap) -> None:
    sleeper = {"command": ["sh", "-c", "sleep 300"]}  # the prompt is its $0
    stub_tap.rollout(sleeper, "wait", n=8, wait=False, id="fills-the-cap")
    try:
        with pytest.raises(AgentTapError) as refused:
            stub_tap.rollout(sleeper, "one more", wait=False)
        assert refused.value.status == 429 and "agenttap_max_rollouts" in str(refused.value)
    finally:
        stub_tap.cancel_rollout("fills-the-cap")
    assert not agent_processes(stub_tap.out / "rollouts" / "fills-the-cap")


def test_a_verifier_that_prints_no_number_is_an_error_with_its_output(
    stub_tap: AgentTap,
) -> None:
    result = stub_tap.rollout(
        {"command": ["true"]}, "nothing to do", verifier=["sh", "-c", "echo looks fine to me"]
    )
    (run,) = result["rollouts"]
    assert run["status"] == "error" and run["finish_reason"] == "error"
    assert run["reward"] is None and "looks fine to me" in run["verifier_output"]
    assert "not a number" in run["error"]


def test_bad_requests_are_refused_with_the_reason(stub_tap: AgentTap, tmp_path: Path) -> None:
    for body, words in [
        ({"agent": "cursor", "prompt": "x"}, "unknown agent"),
        ({"agent": "codex"}, '"prompt"'),
        ({"agent": "codex", "prompt": "x", "n": 0}, '"n"'),
        ({"agent": "codex", "prompt": "x", "workdir": str(tmp_path / "nope")}, "not a folder"),
        ({"agent": "codex", "prompt": "x", "verifier": "check.sh"}, '"verifier"'),
    ]:
        with pytest.raises(AgentTapError, match=words) as err:
            stub_tap.client.post("/rollouts", body)
        assert err.value.status == 400


def test_rollouts_from_asyncio(stub: StubPolicy, confdir: Path, tmp_path: Path) -> None:
    async def main() -> dict[str, Any]:
        async with await AsyncAgentTap.start(
            stub.url, QWEN3, tmp_path / "out", confdir=confdir
        ) as tap:
            return await tap.rollout(
                {"command": ["sh", "-c", "echo hi > hello.txt; echo done"]}, "go", n=2,
                verifier=VERIFIER,
            )  # fmt: skip

    result = asyncio.run(main())
    assert [r["reward"] for r in result["rollouts"]] == [1.0, 1.0]
    # An agent that made no model call has no rows, and says so.
    assert all(r["rows"] == [] and r["metrics"]["calls"] == 0 for r in result["rollouts"])


def test_stopping_the_proxy_ends_every_agent_and_keeps_the_rows(
    stub: StubPolicy, confdir: Path, tmp_path: Path
) -> None:
    tap = AgentTap.start(stub.url, QWEN3, tmp_path / "out", confdir=confdir)
    try:
        tap.rollout(
            {"command": ["sh", "-c", "sleep 300 & sleep 300"]}, "wait", n=2, wait=False, id="orphan"
        )
        root = tmp_path / "out" / "rollouts" / "orphan"
        deadline = time.monotonic() + 30
        while len(agent_processes(root)) < 4:
            assert time.monotonic() < deadline, "the agents did not start"
            time.sleep(0.1)
    finally:
        tap.close()
    assert tap.proc.returncode == 0
    assert not agent_processes(root)
