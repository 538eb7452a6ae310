"""The real mini-swe-agent (``mini``, its default tool-calling config, LiteLLM's OpenAI route)
through the real proxy, answered by the scripted stub: a four-turn task (read a file, run a
command, edit the file, submit) and the same task with an answer that calls no tool, which
mini-swe-agent drops from its history and answers with a format error (its one history
rewrite). mini-swe-agent is installed in .venv-agents by scripts/setup_agents.sh.

It runs as a user runs it: HTTPS_PROXY (the session as the proxy username), SSL_CERT_FILE for
the proxy's CA, OPENAI_API_KEY, a fresh HOME, and its own switches: MSWEA_CONFIGURED (no
first-run setup prompt), MSWEA_COST_TRACKING=ignore_errors and LITELLM_LOCAL_MODEL_COST_MAP
(LiteLLM's own copy of its cost map, not GitHub's).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.providers.test_trajectory_vllm import _assert_exact
from tests.support.paths import REPO
from tests.support.proxies import Proxy
from tests.support.scaffold_task import (
    DONE,
    MINI_STEPS,
    TASK,
    check_one_conversation,
    check_trained_exactly_once,
    sampled,
    seed,
)
from tests.support.stub_vllm import StubPolicy

MINI = REPO / ".venv-agents" / "bin" / "mini"
# An answer with text and no tool call: mini-swe-agent drops it and asks again.
NO_TOOL_CALL = "I think I should count the lines now."


@pytest.fixture(scope="module")
def mini() -> Path:
    assert MINI.exists(), f"mini-swe-agent is not installed at {MINI}: run scripts/setup.sh"
    return MINI


def run_mini(mini: Path, proxy: Proxy, session: str, workdir: Path) -> dict[str, Any]:
    """Run the task; mini-swe-agent's saved trajectory (its messages as it kept them)."""
    home = workdir.parent / f"{workdir.name}-home"
    home.mkdir(exist_ok=True)
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "HTTPS_PROXY": f"http://{session}:x@127.0.0.1:{proxy.port}",
        "SSL_CERT_FILE": str(proxy.ca),
        "OPENAI_API_KEY": "sk-agenttap-mini-key",
        "MSWEA_CONFIGURED": "true",
        "MSWEA_COST_TRACKING": "ignore_errors",
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",
    }
    trajectory = home / "trajectory.json"
    done = subprocess.run(
        [
            str(mini), "-m", "openai/gpt-4o", "-t", TASK, "-y", "--exit-immediately",
            "-c", "mini.yaml", "-c", "agent.step_limit=10", "-o", str(trajectory),
        ],
        cwd=workdir, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
        timeout=180,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (workdir / "notes.txt").read_text() == DONE
    return dict(json.loads(trajectory.read_text()))


def test_mini_swe_agent_does_a_four_turn_task(
    mini: Path, stub_proxy: Proxy, stub: StubPolicy, tmp_path: Path
) -> None:
    session = "mini-four-turns"
    stub.replies.clear()
    stub.script(*MINI_STEPS)
    n = len(stub.requests)
    trajectory = run_mini(mini, stub_proxy, session, seed(tmp_path / "work"))
    assert trajectory["info"]["exit_status"] == "Submitted"
    assert len(stub.requests) - n == 4 and not stub.replies

    turns = check_one_conversation(stub_proxy, stub, session, MINI_STEPS, "openai.chat")
    # Its observations come back as tool results; the last command's output is never sent.
    last = stub.tok.decode(turns[-1]["prompt_ids"])
    assert last.count("<tool_response>") == 3 and "2 notes.txt" in last


def test_a_dropped_answer_is_a_branch_trained_once(
    mini: Path, stub_proxy: Proxy, stub: StubPolicy, tmp_path: Path
) -> None:
    """An answer without a tool call is not kept in mini-swe-agent's history: the next request
    is the one before it with the format error appended. The dropped answer is a row of its
    own (the shared history masked, its answer trained), the conversation another."""
    session = "mini-format-error"
    stub.replies.clear()
    stub.script(MINI_STEPS[0], NO_TOOL_CALL, *MINI_STEPS[1:])
    trajectory = run_mini(mini, stub_proxy, session, seed(tmp_path / "work"))
    kept = [m.get("content") or "" for m in trajectory["messages"] if m["role"] == "assistant"]
    assert NO_TOOL_CALL not in kept

    turns = stub_proxy.turns(session, expect=5)
    threads = stub_proxy.threads(session, expect=2)
    where = check_trained_exactly_once(threads, turns)
    dropped = next(t for t in turns if t["completion_ids"] == sampled(stub, NO_TOOL_CALL))
    after = turns[turns.index(dropped) + 1]
    # Both it and the call after it extend the call before it; the call after it holds the
    # format error where the dropped answer was.
    before = turns[turns.index(dropped) - 1]
    head = before["prompt_ids"] + before["completion_ids"]
    assert dropped["prompt_ids"][: len(head)] == after["prompt_ids"][: len(head)] == head
    retold = stub.tok.decode(after["prompt_ids"][len(head) :])
    assert "Tool call error" in retold and NO_TOOL_CALL not in retold
    by_id = {r["thread_id"]: r for r in threads}
    main = by_id[where[after["request_id"]]]
    branch = by_id[where[dropped["request_id"]]]
    assert main is not branch
    assert main["num_turns"] == 4 and main["thread_kind"] == "main" and not main["dead"]
    assert [s["status"] for s in branch["turns"]] == ["context", "trained"]
    assert branch["turns"][0]["trained_in"] == main["thread_id"]
    assert branch["thread_kind"] == "main" and not branch["dead"]
    assert [json.loads(t["metadata"])["assembly"] for t in turns] == ["new"] + ["extend"] * 4


@pytest.mark.vllm
def test_mini_swe_agent_against_the_real_policy(
    mini: Path, vllm_proxy: Proxy, vllm_url: str, tmp_path: Path
) -> None:
    """The random tiny policy calls no tool: each answer is dropped and asked again with the
    format error, until the step limit. Every row holds vLLM's own logprobs (re-scored here;
    the trainer's forward at the session's end)."""
    session = "mini-vllm"
    home = tmp_path / "home"
    home.mkdir()
    workdir = seed(tmp_path / "work")
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "HTTPS_PROXY": f"http://{session}:x@127.0.0.1:{vllm_proxy.port}",
        "SSL_CERT_FILE": str(vllm_proxy.ca),
        "OPENAI_API_KEY": "sk-agenttap-mini-key",
        "MSWEA_CONFIGURED": "true",
        "MSWEA_COST_TRACKING": "ignore_errors",
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",
    }
    done = subprocess.run(
        [
            str(mini), "-m", "openai/gpt-4o", "-t", "Say hello.", "-y", "--exit-immediately",
            "-c", "mini.yaml", "-c", "agent.step_limit=2", "-c", "model.model_kwargs.max_tokens=64",
        ],
        cwd=workdir, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    turns = vllm_proxy.turns(session, expect=1)
    rows = vllm_proxy.threads(session, expect=1)
    assert len(turns) >= 1
    for row in rows:
        assert _assert_exact(row, turns, vllm_url, tolerance=1e-5) <= 1e-5
