"""Terminus-2 as Harbor runs it (``harbor run --path TASK --agent terminus-2``), through the
real proxy, answered by the scripted stub, in agenttap's Harbor environment (the trial in a
bubblewrap sandbox: capture/harbor/env.py; no Docker here). Harbor is installed in
.venv-harbor by scripts/setup_harbor.sh.

The task is tests/support/scaffold_task.py's as a Harbor task folder: ``instruction.md``, ``task.toml``,
``environment/notes.txt`` (the seed, put in the workdir ``/app``) and ``tests/test.sh`` (writes
the reward to ``/logs/verifier/reward.txt``). Terminus-2 has no tools: each answer is JSON with
``analysis``, ``plan``, ``commands`` (keystrokes typed into a tmux session in the sandbox) and
``task_complete``; a first ``task_complete`` is answered with a confirmation question, a second
ends the trial. So four steps (read, run, edit, finish) are five calls.

Harbor runs as a user runs it: HTTPS_PROXY, SSL_CERT_FILE for the proxy's CA, OPENAI_API_KEY,
LITELLM_LOCAL_MODEL_COST_MAP (LiteLLM's own copy of its cost map, not GitHub's), a fresh HOME,
and PYTHONPATH holding this repository (for the environment's import path).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from capture.client.launcher import AgentTap
from tests.e2e.providers.test_conservation_e2e import conservation
from tests.e2e.providers.test_trajectory_vllm import _assert_exact
from tests.e2e.rollouts.test_rollouts import agent_processes
from tests.support.paths import REPO
from tests.support.proxies import Proxy, read_threads, read_turns
from tests.support.scaffold_task import (
    DONE,
    SEED,
    TASK,
    VERIFIER,
    check_one_conversation,
    check_trained_exactly_once,
    seed,
    stub_logprobs,
)
from tests.support.stub_vllm import StubPolicy

HARBOR = REPO / ".venv-harbor" / "bin" / "harbor"
ENVIRONMENT = "capture.harbor.env:SandboxEnvironment"
# The verifier: reward 1 when beta became gamma in the workdir.
TEST_SH = """#!/bin/bash
if [ "$(cat /app/notes.txt)" = "$(printf 'alpha\\ngamma')" ]; then r=1; else r=0; fi
echo "$r" > /logs/verifier/reward.txt
"""
TASK_TOML = """version = "1.0"

[agent]
timeout_sec = 120.0

[verifier]
timeout_sec = 60.0

[environment]
network_mode = "no-network"
"""


def answer(plan: str, keystrokes: str | None, complete: bool = False, duration: float = 0.1) -> str:
    """One Terminus-2 answer in its JSON format."""
    commands = [] if keystrokes is None else [{"keystrokes": keystrokes, "duration": duration}]
    return json.dumps(
        {
            "analysis": f"Step: {plan}",
            "plan": plan,
            "commands": commands,
            "task_complete": complete,
        },
        indent=2,
    )


TERMINUS_STEPS = [
    answer("Read the notes.", "cat notes.txt\n"),
    answer("Count the lines.", "wc -l notes.txt\n"),
    answer("Replace beta with gamma.", "sed -i 's/beta/gamma/' notes.txt\n"),
    answer("The edit is done.", None, complete=True),
    answer("Yes, the task is complete.", None, complete=True),
]


def harbor_task(folder: Path) -> Path:
    (folder / "environment").mkdir(parents=True)
    (folder / "tests").mkdir()
    (folder / "instruction.md").write_text(TASK + "\n")
    (folder / "task.toml").write_text(TASK_TOML)
    (folder / "environment" / "notes.txt").write_text(SEED)
    (folder / "tests" / "test.sh").write_text(TEST_SH)
    return folder


def step_rule(stub: StubPolicy) -> Any:
    """Answers this task's calls by how many answers their prompt holds already."""

    def rule(body: dict[str, Any]) -> str | None:
        text = stub.tok.decode(body["prompt"])
        if TASK not in text or "terminal" not in text.lower():
            return None
        done = text.count("<|im_start|>assistant") - 1
        return TERMINUS_STEPS[min(done, len(TERMINUS_STEPS) - 1)]

    return rule


@pytest.fixture(scope="module")
def harbor() -> Path:
    assert HARBOR.exists(), f"Harbor is not installed at {HARBOR}: run scripts/setup.sh"
    return HARBOR


@pytest.fixture
def scripted(stub: StubPolicy) -> Any:
    rule = step_rule(stub)
    stub.rules.insert(0, rule)
    yield
    stub.rules.remove(rule)


def proxy_env(proxy: Proxy, user: str | None) -> dict[str, str]:
    """Proxy mode: the proxy (its username the session, if given), its CA, a dummy key."""
    auth = f"{user}:x@" if user is not None else ""
    return {
        "HTTPS_PROXY": f"http://{auth}127.0.0.1:{proxy.port}",
        "SSL_CERT_FILE": str(proxy.ca),
        "OPENAI_API_KEY": "sk-agenttap-harbor-key",
    }


def run_harbor(
    harbor: Path, proxy: Proxy | dict[str, str], user: str | None, folder: Path, *extra: str
) -> list[dict[str, Any]]:
    """``harbor run`` on the task, through ``proxy`` (or with the environment given instead);
    each trial's result.json."""
    home = folder / "home"
    home.mkdir()
    jobs = folder / "jobs"
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",
        "PYTHONPATH": str(REPO),
        **(proxy_env(proxy, user) if isinstance(proxy, Proxy) else proxy),
    }
    done = subprocess.run(
        [
            str(harbor), "run", "--path", str(harbor_task(folder / "task")),
            "--agent", "terminus-2", "--model", "openai/gpt-4o", "--env", ENVIRONMENT,
            "--jobs-dir", str(jobs), "--yes", "--quiet", *extra,
        ],
        cwd=folder, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
        timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    trials = [json.loads(p.read_text()) for p in jobs.glob("*/*/result.json")]
    assert trials, f"no trial results under {jobs}:\n{done.stdout[-3000:]}"
    return trials


def check_trial(stub_proxy: Proxy, stub: StubPolicy, session: str) -> None:
    """One trial's rows: one main row of the five calls, each extending the last, each trained
    once at the stub's ids and logprobs."""
    turns = check_one_conversation(stub_proxy, stub, session, TERMINUS_STEPS, "openai.chat")
    # What the terminal showed came back: the file, the count, the confirmation question.
    last = stub.tok.decode(turns[-1]["prompt_ids"])
    assert "2 notes.txt" in last and "Are you sure you want to mark the task as complete" in last


@pytest.mark.usefixtures("scripted")
def test_terminus_2_does_the_task_in_the_sandbox_each_trial_its_own_session(
    harbor: Path, stub_proxy: Proxy, stub: StubPolicy, tmp_path: Path
) -> None:
    """Two attempts of the four-step task run at once by one ``harbor run``, each in its own
    sandbox, with no session in the proxy URL: Terminus-2 names each trial in the
    ``X-Session-ID`` header it is told to send, and the proxy keeps each trial's calls in a
    session of that name. Each scores 1.0 and is five calls."""
    n = len(stub.requests)
    trials = run_harbor(
        harbor, stub_proxy, None, tmp_path,
        "--n-attempts", "2", "--n-concurrent", "2",
        "--ak", 'session_id_headers=["X-Session-ID"]',
    )  # fmt: skip
    assert len({t["trial_name"] for t in trials}) == 2
    assert len(stub.requests) - n == 10
    for trial in trials:
        assert trial.get("exception_info") is None, trial["exception_info"]
        assert trial["verifier_result"]["rewards"] == {"reward": 1.0}
        check_trial(stub_proxy, stub, f"x-session-id:{trial['trial_name']}__agent")


# Terminus-2's context summarization (its history rewrite), forced by a threshold that a long
# command output crosses: three side calls (a summary of the conversation so far, questions
# asked from a fresh context, their answers from the full one), then the conversation goes on
# from a new history: the first prompt, the questions' prompt and the questions, the answers.
SUMMARY = "Summary: I read notes.txt and printed a long sequence; beta is still to be replaced."
QUESTIONS = "1. Is notes.txt in /app?\n2. Which word must change?"
ANSWERS = "1. Yes.\n2. beta becomes gamma."
BEFORE = [
    answer("Read the notes.", "cat notes.txt\n"),
    answer("Print a long sequence.", "seq 1 2000\n", duration=1.0),
    # Its output is in the history from this call on: the summary comes before the next one.
    answer("Count the lines.", "wc -l notes.txt\n"),
]
AFTER = [
    answer("Replace beta with gamma.", "sed -i 's/beta/gamma/' notes.txt\n"),
    answer("The edit is done.", None, complete=True),
    answer("Yes, the task is complete.", None, complete=True),
]
# The summary subagents' prompts, told apart by their last user message.
SIDE_CALLS = {
    "hand off your work to another AI agent": SUMMARY,
    "Please begin by asking several questions": QUESTIONS,
    "The next agent has a few questions for you": ANSWERS,
}
HANDOFF = "Here are the answers the other agent provided."


def summarizing_rule(stub: StubPolicy) -> Any:
    def rule(body: dict[str, Any]) -> str | None:
        text = stub.tok.decode(body["prompt"])
        if TASK not in text:
            return None
        last_user = text.rsplit("<|im_start|>user", 1)[-1]
        for marker, reply in SIDE_CALLS.items():
            if marker in last_user:
                return reply
        if HANDOFF in text:
            done = text.split(HANDOFF)[-1].count("<|im_start|>assistant") - 1
            return AFTER[min(done, len(AFTER) - 1)]
        done = text.count("<|im_start|>assistant") - 1
        return BEFORE[min(done, len(BEFORE) - 1)]

    return rule


def test_a_summarized_history_is_trained_once(
    harbor: Path, stub_proxy: Proxy, stub: StubPolicy, tmp_path: Path
) -> None:
    session = "harbor-terminus-summarized"
    rule = summarizing_rule(stub)
    stub.rules.insert(0, rule)
    try:
        (trial,) = run_harbor(
            harbor, stub_proxy, session, tmp_path,
            # The policy's context as Terminus-2 is told it: with the default threshold (8000
            # tokens left), it summarizes once the history is over 3000 tokens.
            "--ak", 'model_info={"max_input_tokens": 11000, "max_output_tokens": 4096}',
        )  # fmt: skip
    finally:
        stub.rules.remove(rule)
    assert trial.get("exception_info") is None, trial["exception_info"]
    assert trial["verifier_result"]["rewards"] == {"reward": 1.0}
    # Three steps, the summary's three side calls, then three more: nine calls.
    turns = stub_proxy.turns(session, expect=9)
    assert len(turns) == 9
    rows = stub_proxy.threads(session, expect=2)
    where = conservation(rows, turns)
    by_text = {stub.tok.decode(t["completion_ids"], skip_special_tokens=True): t for t in turns}
    before = [by_text[text] for text in (*BEFORE, SUMMARY, ANSWERS)]
    after = [by_text[text] for text in (QUESTIONS, *AFTER)]
    # The conversation up to the handoff, the summary and its answers extending it: one row.
    # The questions (asked from a fresh context) open the row the conversation goes on in: its
    # new history holds them after the first prompt, where they were not sampled, so their
    # tokens are trained there re-scored (provenance 2); nothing else is re-scored.
    assert [json.loads(t["metadata"])["assembly"] for t in before] == ["new"] + ["extend"] * 4
    assert [json.loads(t["metadata"])["assembly"] for t in after] == [
        "new", "rewrite", "extend", "extend",
    ]  # fmt: skip
    by_id = {r["thread_id"]: r for r in rows}
    first, second = by_id[where[before[0]["request_id"]]], by_id[where[after[0]["request_id"]]]
    assert {where[t["request_id"]] for t in before} == {first["thread_id"]}
    assert {where[t["request_id"]] for t in after} == {second["thread_id"]}
    assert len(rows) == 2 and first["num_turns"] == 5 and second["num_turns"] == 4
    assert {r["thread_kind"] for r in rows} == {"main"} and not any(r["dead"] for r in rows)
    for row in rows:
        for span in row["turns"]:
            call = next(t for t in turns if t["request_id"] == span["request_id"])
            got = row["logprobs"][span["start"] : span["end"]]
            kinds = set(row["provenance"][span["start"] : span["end"]])
            if call is after[0]:
                assert kinds == {2}
                positions = range(span["start"], span["end"])
                want = [StubPolicy._logprob_of(i, row["input_ids"][i]) for i in positions]
            else:
                assert kinds == {1}
                want = list(stub_logprobs(call["completion_ids"]))
            assert got == pytest.approx(want, abs=1e-6)


@pytest.mark.vllm
def test_terminus_2_against_the_real_policy(
    harbor: Path, vllm_proxy: Proxy, vllm_url: str, tmp_path: Path
) -> None:
    """The random tiny policy writes no JSON: Terminus-2 answers each reply with its parse
    error and asks again, until its turn limit; the verifier scores 0. Every row holds vLLM's
    own logprobs (re-scored here; the trainer's forward at the session's end)."""
    session = "harbor-terminus-vllm"
    (trial,) = run_harbor(
        harbor, vllm_proxy, session, tmp_path,
        "--ak", "max_turns=2", "--ak", 'llm_call_kwargs={"max_tokens": 64}',
    )  # fmt: skip
    assert trial["verifier_result"]["rewards"] == {"reward": 0.0}
    turns = vllm_proxy.turns(session, expect=2)
    rows = vllm_proxy.threads(session, expect=1)
    assert all(len(t["completion_ids"]) <= 64 for t in turns)
    for row in rows:
        assert _assert_exact(row, turns, vllm_url, tolerance=1e-5) <= 1e-5


@pytest.mark.usefixtures("scripted")
def test_a_terminus_2_rollout_is_scored_into_its_rows(stub_tap: AgentTap, tmp_path: Path) -> None:
    """``"agent": "terminus-2"``: agenttap runs Harbor in its rollout sandbox on the prompt (a
    Harbor task of its own, the rollout's workdir copy as the environment); the stub scripts
    the task, agenttap's verifier scores the copy."""
    task = seed(tmp_path / "task")
    result = stub_tap.rollout(
        "terminus-2", TASK, n=1, workdir=task, verifier=VERIFIER, metadata={"task_id": "notes"}
    )
    assert result["status"] == "done" and result["sandbox"] == "bwrap"
    (run,) = result["rollouts"]
    assert run["status"] == "ok", run
    assert run["finish_reason"] == "stop" and run["reward"] == 1.0
    assert (Path(run["workdir"]).parent / "work" / "notes.txt").read_text() == DONE
    (row,) = run["rows"]
    assert row["thread_kind"] == "main" and row["num_turns"] == 5
    assert row["reward"] == 1.0 and run["metrics"]["calls"] == 5
    sid = run["session_id"]
    check_trained_exactly_once(read_threads(stub_tap.out, sid), read_turns(stub_tap.out, sid))
    assert (task / "notes.txt").read_text() == SEED
    assert not agent_processes(stub_tap.out / "rollouts" / result["id"])


@pytest.mark.usefixtures("scripted")
def test_a_terminus_2_rollout_ends_at_its_max_calls(stub_tap: AgentTap, tmp_path: Path) -> None:
    """Past ``max_calls`` the rollout's Terminus-2 is stopped at once: its fourth answer is the
    last (the task is not finished: the fifth step, confirming, is never answered). Left
    running, Harbor retries a refused call with back-off for about 25 s."""
    task = seed(tmp_path / "task")
    result = stub_tap.rollout("terminus-2", TASK, n=1, workdir=task, limits={"max_calls": 4})
    ended = time.time()
    (run,) = result["rollouts"]
    assert run["status"] == "ok" and run["finish_reason"] == "max_calls", run
    # No retries of the refused call: Harbor is stopped before its back-off asks again.
    assert run["metrics"]["calls"] == 4 and run["metrics"]["refused"] == 1, run["metrics"]
    turns = read_turns(stub_tap.out, run["session_id"])
    assert len(turns) == 4
    fourth = max(t["started_at"] + t["latency_s"] for t in turns)
    # Terminus-2 acts on its fourth answer and asks a fifth time: refused, and its agent is
    # stopped within a poll (0.2 s). The proxy's log says when, to the millisecond.
    stopped = [
        line for line in stub_tap.log.read_text().splitlines()
        if f"rollout session {run['session_id']} reached its max_calls" in line
    ]  # fmt: skip
    assert len(stopped) == 1, stopped
    clock = time.strftime("%Y-%m-%d ", time.localtime(fourth)) + stopped[0][1:13]
    stopped_at = time.mktime(time.strptime(clock[:-4], "%Y-%m-%d %H:%M:%S")) + float(clock[-4:])
    assert 0 <= stopped_at - fourth < 1.0, (stopped[0], fourth)
    # Then Harbor exits on its SIGTERM (its trial's teardown), the session is closed and its
    # rows written; the rollout's answer comes once it has ended (``wait``).
    assert ended - fourth < 6.0, (ended - fourth, run["metrics"])
    assert not agent_processes(stub_tap.out / "rollouts" / result["id"])


@pytest.mark.usefixtures("scripted")
def test_terminus_2_by_base_url(
    harbor: Path, stub_tap: AgentTap, stub: StubPolicy, tmp_path: Path
) -> None:
    """Base-URL mode: no proxy, no CA; Terminus-2 takes the session's openai base URL from
    OPENAI_BASE_URL and its key from OPENAI_API_KEY."""
    sess = stub_tap.open_session(metadata={"task_id": "terminus-base-url"})
    env = {"OPENAI_BASE_URL": sess.base_urls["openai"], "OPENAI_API_KEY": sess.api_key}
    (trial,) = run_harbor(harbor, env, None, tmp_path)
    assert trial.get("exception_info") is None, trial["exception_info"]
    assert trial["verifier_result"]["rewards"] == {"reward": 1.0}
    (row,) = sess.close(reward=1.0).to_pylist()
    assert row["thread_kind"] == "main" and row["num_turns"] == 5 and row["reward"] == 1.0
    out = stub_tap.out
    check_trained_exactly_once(read_threads(out, sess.id), read_turns(out, sess.id))


# Drives SandboxEnvironment directly in Harbor's venv, as an agent that tries to reach the host
# would: prints what each step gave as JSON.
ADVERSARY = """
import asyncio, json, sys
from pathlib import Path
from harbor.models.task.config import EnvironmentConfig
from harbor.models.trial.paths import TrialPaths
from capture.harbor.env import SandboxEnvironment

root = Path(sys.argv[1])
secret = root / "secret"
env = SandboxEnvironment(
    environment_dir=root / "environment", environment_name="t", session_id="t__env",
    trial_paths=TrialPaths(trial_dir=root / "trial"), task_env_config=EnvironmentConfig(),
)
got = {}

async def main():
    await env.start(force_build=False)
    got["seeded"] = (await env.exec("pwd; cat seed.txt")).stdout
    got["secret"] = (await env.exec(f"cat {secret}")).return_code
    got["network"] = (await env.exec("getent hosts example.com")).return_code
    await env.exec("tmux new-session -d -s s 'sleep 300'")
    got["tmux"] = (await env.exec("tmux has-session -t s")).return_code
    await env.exec(f"mkdir -p /logs/agent && echo hi > /logs/agent/a.txt"
                   f" && ln -s {secret} /logs/agent/leak")
    await env.download_dir("/logs/agent", root / "out")
    got["downloaded"] = sorted(p.name for p in (root / "out").iterdir())
    try:
        await env.download_file("/logs/agent/leak", root / "leak.txt")
        got["leak"] = (root / "leak.txt").read_text()
    except RuntimeError as exc:
        got["leak"] = None
    await env.upload_file(root / "environment" / "seed.txt", "/tests/x/seed.txt")
    got["uploaded"] = (await env.exec("cat /tests/x/seed.txt")).stdout
    try:
        await env.exec("sleep 30", timeout_sec=1)
    except RuntimeError as exc:
        got["timeout"] = str(exc)
    await env.stop(delete=True)
    print(json.dumps(got))

asyncio.run(main())
"""


def test_the_sandbox_environment_keeps_the_host_out(harbor: Path, tmp_path: Path) -> None:
    """The environment's own guarantees, driven as a hostile agent would: the task's seed in the
    workdir, no host file and no network inside, a tmux server that outlives its command, and
    out of the sandbox only what is inside it: a planted link to a host file comes out neither
    in a folder nor as a file."""
    (tmp_path / "environment").mkdir()
    (tmp_path / "environment" / "seed.txt").write_text("seed\n")
    (tmp_path / "secret").write_text("host secret\n")
    script = tmp_path / "adversary.py"
    script.write_text(ADVERSARY)
    done = subprocess.run(
        [str(harbor.parent / "python"), str(script), str(tmp_path)],
        env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(REPO)},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["seeded"] == "/app\nseed\n"
    assert got["secret"] != 0 and got["network"] != 0 and got["tmux"] == 0
    assert got["downloaded"] == ["a.txt"] and got["leak"] is None
    assert got["uploaded"] == "seed\n"
    assert got["timeout"] == "Command timed out after 1 seconds"
