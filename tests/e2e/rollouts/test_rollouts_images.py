"""Rollouts in a task's own image (``"image"``): a real scaffold brought in from the host runs
in a podman container of a SWE-style task image (the repository at /testbed, Debian's Python
3.11, no node, none of the host's installs); its tool calls run the image's tools; the
verifier starts from the state the agent left, with the task's hidden tests shown at /tests.
What the agent plants there, or a limit it hits, counts for nothing."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from capture.client.launcher import AgentTap
from capture.isolation.podman import LABEL, engine_command, engine_env
from tests.e2e.providers.test_anthropic_sdk_stub import hermes
from tests.support.paths import REPO
from tests.support.proxies import read_threads, read_turns
from tests.support.scaffold_task import check_trained_exactly_once
from tests.support.stub_vllm import StubPolicy
from tests.support.task_images import swe_task, task_folder, task_image

TASK = swe_task("swe-slugify")
HIDDEN = str(task_folder("swe-slugify") / "tests")
# The hidden tests, their verdict as one number on stdout (pytest's own output to stderr). The
# verifier runs with PYTHONSAFEPATH=1 (no module the agent left shadows the standard library):
# the repository is put on the path by name.
GRADE = [
    "sh", "-c",
    "PYTHONPATH=/testbed python3 -m pytest -q -p no:cacheprovider /tests >&2 && echo 1 || echo 0",
]  # fmt: skip
# mini-swe-agent's one tool is bash; each step runs in the image's /testbed.
MINI_FIX = [
    "Look first.\n" + hermes("bash", {"command": "python3 --version; cat textkit/slug.py"}),
    "Fix the run.\n" + hermes("bash", {"command": "sed -i 's/9]\"/9]+\"/' textkit/slug.py"}),
    "Done.\n" + hermes("bash", {"command": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"}),
]
# A conftest.py that marks every test passed, planted where the verifier's tests will be.
PLANT = (
    "mkdir -p /tests && printf '%s\\n' 'import pytest' '@pytest.hookimpl(hookwrapper=True)' "
    "'def pytest_runtest_makereport(item, call):' '    out = yield' "
    "'    out.get_result().outcome = \"passed\"' > /tests/conftest.py && echo planted"
)


@pytest.fixture(scope="module")
def image() -> str:
    return task_image("swe-slugify")


def _rule(stub: StubPolicy, steps: list[str]) -> Callable[[dict[str, Any]], str | None]:
    def rule(body: dict[str, Any]) -> str | None:
        text = stub.tok.decode(body["prompt"])
        if TASK["prompt"] not in text:
            return None
        return steps[min(text.count("<tool_response>"), len(steps) - 1)]

    return rule


@pytest.fixture
def scripted(stub: StubPolicy) -> Iterator[None]:
    rule = _rule(stub, MINI_FIX)
    stub.rules.insert(0, rule)
    yield
    stub.rules.remove(rule)


def containers_of(rollout_id: str) -> list[str]:
    listed = subprocess.run(
        [*engine_command(), "ps", "--all", "--filter", f"label={LABEL}", "--format", "{{.Names}}"],
        capture_output=True, text=True, env=engine_env(), check=True,
    )  # fmt: skip
    return [name for name in listed.stdout.split() if rollout_id in name]


@pytest.mark.usefixtures("scripted")
def test_mini_swe_agent_fixes_a_swe_task_in_its_image(stub_tap: AgentTap, image: str) -> None:
    verifier = {"command": GRADE, "tests": HIDDEN}
    result = stub_tap.rollout("mini-swe-agent", TASK["prompt"], image=image, verifier=verifier)
    assert result["status"] == "done" and result["sandbox"] == "podman", result
    run = result["rollouts"][0]
    assert run["status"] == "ok", run["error"]
    assert run["reward"] == 1.0 and run["finish_reason"] == "stop", run["verifier_stderr"]
    folder = Path(run["workdir"]).parent
    # Its tool calls ran the image's Python (3.11), not the host's (3.12): its trajectory,
    # in the HOME it was given.
    trajectory = folder / "home" / ".config" / "mini-swe-agent" / "last_mini_run.traj.json"
    assert "Python 3.11" in trajectory.read_text()
    # Its working folder is kept with the run, fixed.
    fixed = (folder / "work" / "textkit" / "slug.py").read_text()
    assert '9]+"' in fixed
    sid = run["session_id"]
    check_trained_exactly_once(read_threads(stub_tap.out, sid), read_turns(stub_tap.out, sid))
    assert containers_of(result["id"]) == []  # every container went with its run


def test_tests_planted_by_the_agent_are_not_the_tests_run(stub_tap: AgentTap, image: str) -> None:
    """The agent writes a /tests/conftest.py that passes everything and fixes nothing: the
    verifier's /tests is the task's hidden tests alone, so the reward is 0."""
    verifier = {"command": GRADE, "tests": HIDDEN, "on_error": "score"}
    agent = {"command": ["sh", "-c", PLANT]}
    result = stub_tap.rollout(agent, "plant", image=image, verifier=verifier)
    run = result["rollouts"][0]
    assert "planted" in run["agent_output"], run
    assert run["reward"] == 0.0, run
    assert "failed" in run["verifier_stderr"]
    # The control: the same grade on the solved repository is 1 (the tests can pass).
    solve = ["sh", "-c", "sed -i 's/9]\"/9]+\"/' textkit/slug.py && echo solved"]
    result = stub_tap.rollout({"command": solve}, "solve", image=image, verifier=verifier)
    assert result["rollouts"][0]["reward"] == 1.0, result["rollouts"][0]


def test_a_container_past_its_memory_ends_with_that_limit(stub_tap: AgentTap, image: str) -> None:
    agent = {"command": ["python3", "-c", "x = bytearray(600 << 20); print('alive')"]}
    result = stub_tap.rollout(agent, "grow", image=image, limits={"memory_mb": 256, "disk_mb": 64})
    run = result["rollouts"][0]
    assert run["limit"] == "memory" and run["finish_reason"] == "limit", run
    assert "alive" not in run["agent_output"]
    assert containers_of(result["id"]) == []


def test_what_a_container_writes_outside_its_folders_is_held_to_its_disk(
    stub_tap: AgentTap, image: str
) -> None:
    """The image's own tree (its writable layer, on the host's disk) holds ``disk_mb`` too: one
    file is cut there (RLIMIT_FSIZE) and files past it in sum end the run with the "disk" limit,
    even when the agent exits at once. The control: the same files under the cap."""

    def fill(files: int) -> dict[str, list[str]]:
        script = f"for i in $(seq {files}); do head -c 16000000 /dev/zero > /var/tmp/f$i; done"
        return {"command": ["sh", "-c", script + "; echo wrote"]}

    limits = {"disk_mb": 64}
    result = stub_tap.rollout(fill(6), "fill", image=image, limits=limits)
    run = result["rollouts"][0]
    assert run["limit"] == "disk" and run["finish_reason"] == "limit", run
    big = ["sh", "-c", "head -c 100000000 /dev/zero > /var/tmp/big; ls -l /var/tmp/big"]
    result = stub_tap.rollout({"command": big}, "one big file", image=image, limits=limits)
    run = result["rollouts"][0]
    assert run["limit"] == "disk" and str(64 << 20) in run["agent_output"], run
    result = stub_tap.rollout(fill(2), "fill", image=image, limits=limits)
    run = result["rollouts"][0]
    # (It calls no model: the run is an error for that, not for its disk.)
    assert run["limit"] is None and run["finish_reason"] != "limit", run
    assert run["agent_output"].strip() == "wrote" and "model call" in run["error"]
    assert containers_of(result["id"]) == []


HARBOR = task_folder("harbor-fix-script")
HARBOR_FIX = [
    "Look.\n" + hermes("bash", {"command": "cat /app/report.py"}),
    "Fix.\n"
    + hermes(
        "bash",
        {
            "command": 'sed -i \'s/sum(row\\["amount"\\] for/sum(float(row["amount"]) for/\' '
            "/app/report.py && python3 /app/report.py /app/sales.csv"
        },
    ),  # fmt: skip
    "Done.\n" + hermes("bash", {"command": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"}),
]


def harbor_rule(stub: StubPolicy) -> Callable[[dict[str, Any]], str | None]:
    """The stub's answers to mini-swe-agent on harbor-fix-script, by how far it got."""
    prompt = (HARBOR / "instruction.md").read_text().strip()

    def rule(body: dict[str, Any]) -> str | None:
        text = stub.tok.decode(body["prompt"])
        if prompt[:60] not in text:
            return None
        return HARBOR_FIX[min(text.count("<tool_response>"), len(HARBOR_FIX) - 1)]

    return rule


@pytest.fixture
def harbor_scripted(stub: StubPolicy) -> Iterator[None]:
    rule = harbor_rule(stub)
    stub.rules.insert(0, rule)
    yield
    stub.rules.remove(rule)


@pytest.mark.usefixtures("harbor_scripted")
def test_a_harbor_task_folder_is_built_run_and_scored_by_its_tests(stub_tap: AgentTap) -> None:
    """``"task": DIR``: the image built from environment/, instruction.md the prompt,
    tests/test.sh the verifier, its /logs/verifier/reward.txt the reward, task.toml's limits."""
    result = stub_tap.rollout("mini-swe-agent", "", task=HARBOR)
    run = result["rollouts"][0]
    assert result["sandbox"] == "podman" and run["status"] == "ok", run["error"]
    assert run["reward"] == 1.0, run["verifier_output"]
    # task.toml's memory (1024) and storage (1024, at most half the memory: RAM) applied.
    assert run["usage"]["agent"]["memory_peak_bytes"] <= 1024 << 20
    assert containers_of(result["id"]) == []


def test_a_reward_file_the_agent_wrote_never_counts(stub_tap: AgentTap) -> None:
    """The agent writes 1 to /logs/verifier/reward.txt and fixes nothing: the verifier's
    /logs/verifier is a fresh folder, so the task's tests give 0."""
    plant = ["sh", "-c", "mkdir -p /logs/verifier && echo 1 > /logs/verifier/reward.txt; echo ok"]
    result = stub_tap.rollout(
        {"command": plant}, "plant", task=HARBOR, verifier={"on_error": "score"}
    )
    run = result["rollouts"][0]
    assert run["reward"] == 0.0, run
    # The control: the task's own solution scores 1 through the same verifier.
    solve = ["bash", "-c", (HARBOR / "solution" / "solve.sh").read_text()]
    result = stub_tap.rollout(
        {"command": solve}, "solve", task=HARBOR, verifier={"on_error": "score"}
    )
    assert result["rollouts"][0]["reward"] == 1.0, result["rollouts"][0]


def test_a_scaffold_in_an_image_records_the_real_policy_exactly(
    vllm_url: str, confdir: Path, tmp_path: Path, image: str
) -> None:
    """mini-swe-agent in the task's image, answered by the real vLLM (the tiny random Qwen3):
    its rows equal vLLM's own re-score of them, as a scaffold's rows do in the bwrap sandbox."""
    from capture.client.launcher import AgentTap
    from tests.e2e.providers.test_trajectory_vllm import _assert_exact
    from tests.support.paths import QWEN3

    tap = AgentTap.start(vllm_url, QWEN3, tmp_path / "out", confdir=confdir)
    try:
        result = tap.rollout("mini-swe-agent", TASK["prompt"], image=image, limits={"max_calls": 2})
        sid = result["rollouts"][0]["session_id"]
        rows = read_threads(tap.out, sid)
        turns = read_turns(tap.out, sid)
    finally:
        tap.close()
    assert rows and len(turns) >= 1, result
    for row in rows:
        assert _assert_exact(row, turns, vllm_url, tolerance=1e-5) <= 1e-5
    assert containers_of(result["id"]) == []


def test_a_crashed_instances_containers_are_removed_at_the_next_start(image: str) -> None:
    """A container whose owner label names an instance that is gone (a pid of this namespace
    that no longer runs) is removed by the next start; one of a live instance is kept."""
    from capture.isolation.containers import OWNER, remove_stale
    from capture.isolation.host import instance_tag

    dead = subprocess.Popen(["true"])
    dead.wait()
    gone_owner = instance_tag().rsplit("-", 2)[0] + f"-{dead.pid}-1"
    names = {"agenttap-stale-test-gone": gone_owner, "agenttap-stale-test-live": OWNER}
    for name, owner in names.items():
        subprocess.run(
            [*engine_command(), "create", "--name", name, "--label", f"{LABEL}={owner}",
             image, "true"],
            capture_output=True, env=engine_env(), check=True,
        )  # fmt: skip
    # A committed state (an agent's, for its verifier) carries its container's owner.
    state = "localhost/agenttap-state:stale-test"
    subprocess.run(
        [*engine_command(), "commit", "--quiet", "agenttap-stale-test-gone", state],
        capture_output=True, env=engine_env(), check=True,
    )  # fmt: skip
    try:
        removed = remove_stale()
        assert state in removed
        assert "agenttap-stale-test-gone" in removed
        assert "agenttap-stale-test-live" not in removed
        assert containers_of("agenttap-stale-test") == ["agenttap-stale-test-live"]
    finally:
        subprocess.run(
            [*engine_command(), "rm", "--force", *names], capture_output=True, env=engine_env()
        )


def test_a_container_past_its_pids_or_its_time_is_ended(stub_tap: AgentTap, image: str) -> None:
    bomb = ["sh", "-c", "for i in $(seq 200); do sleep 30 & done; wait"]
    result = stub_tap.rollout({"command": bomb}, "fork", image=image, limits={"pids": 64})
    run = result["rollouts"][0]
    assert run["limit"] == "pids" and run["finish_reason"] == "limit", run
    slow = ["sh", "-c", "echo started; sleep 120"]
    result = stub_tap.rollout({"command": slow}, "slow", image=image, timeout_s=3)
    run = result["rollouts"][0]
    assert "ran past its timeout (3 s)" in run["error"], run
    assert run["metrics"].get("wall_time_s", 0) < 60
    assert containers_of(result["id"]) == []


def test_a_container_reaches_no_host_file_and_its_listener_stays_inside(
    stub_tap: AgentTap, image: str
) -> None:
    """From inside: OUT, the token file and the repository are not there; a port it listens
    on is its own loopback's, not the host's."""
    port = 18000 + os.getpid() % 1000
    probe = (
        "import os, socket, sys, time\n"
        "for path in sys.argv[1:]:\n"
        "    print(path, os.path.exists(path))\n"
        f"s = socket.socket(); s.bind(('127.0.0.1', {port})); s.listen(); print('listening')\n"
        "sys.stdout.flush(); time.sleep(4)\n"
    )
    hidden = [str(stub_tap.out), str(REPO / "capture"), "/root/.bash_history"]
    agent = {"command": ["python3", "-c", probe, *hidden]}
    result = stub_tap.rollout(agent, "/etc/hostname", image=image, wait=False)
    log = stub_tap.out / "rollouts" / result["id"] / "0" / "agent.log"
    deadline = time.monotonic() + 60
    while "listening" not in (log.read_text() if log.exists() else ""):
        assert time.monotonic() < deadline, "the probe never listened"
        time.sleep(0.2)
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    while stub_tap.get_rollout(result["id"])["status"] != "done":
        assert time.monotonic() < deadline + 60
        time.sleep(0.5)
    output = log.read_text()
    for path in hidden:
        assert f"{path} False" in output, output
    assert "/etc/hostname True" in output  # the control: its own files are there


def test_keep_grades_the_image_as_built_not_programs_the_agent_left(
    stub_tap: AgentTap, image: str
) -> None:
    """Graded on its state, the verifier runs the container's programs, which the agent (its
    root) could replace. With "keep" it starts from the image as built, only the kept files of
    the working folder copied in: a fake python3 the agent left that "passes" is not there."""
    fake = (
        "printf '#!/bin/sh\\nexit 0\\n' > /usr/local/bin/python3 && "
        "chmod +x /usr/local/bin/python3 && echo faked"
    )
    verifier = {"command": GRADE, "tests": HIDDEN, "keep": ["textkit/*.py"], "on_error": "score"}
    result = stub_tap.rollout(
        {"command": ["sh", "-c", fake]}, "fake", image=image, verifier=verifier
    )
    run = result["rollouts"][0]
    assert "faked" in run["agent_output"], run
    assert run["reward"] == 0.0 and run["graded"], run
    # The control: the fix, kept, scores 1 on the image as built.
    solve = ["sh", "-c", "sed -i 's/9]\"/9]+\"/' textkit/slug.py && echo solved"]
    result = stub_tap.rollout({"command": solve}, "solve", image=image, verifier=verifier)
    assert result["rollouts"][0]["reward"] == 1.0, result["rollouts"][0]
    assert containers_of(result["id"]) == []
