"""The real OpenHands CLI, headless (``openhands --headless --override-with-envs -t TASK``: the
OpenHands SDK's default CLI agent, LiteLLM's OpenAI route, its tools run on this machine, no
Docker), through the real proxy, answered by the scripted stub: a four-turn task (view the file
with its file editor, run a command in its terminal, edit the file, finish). OpenHands is
installed in .venv-openhands by scripts/setup_openhands.sh.

It runs as a user runs it headless: HTTPS_PROXY (the session as the proxy username),
SSL_CERT_FILE for the proxy's CA, a fresh HOME, and its own switches: LLM_MODEL and a dummy
LLM_API_KEY (read only with --override-with-envs; without a saved configuration a headless run
needs both), LITELLM_LOCAL_MODEL_COST_MAP (LiteLLM's own copy of its cost map, not GitHub's) and
OPENHANDS_SUPPRESS_BANNER.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from capture.client.launcher import AgentTap
from capture.rollouts.agents import OPENHANDS_SETTINGS
from tests.e2e.providers.test_anthropic_sdk_stub import hermes
from tests.e2e.providers.test_trajectory_vllm import _assert_exact
from tests.support.paths import REPO
from tests.support.proxies import Proxy, read_threads, read_turns
from tests.support.scaffold_task import (
    DONE,
    TASK,
    check_one_conversation,
    check_trained_exactly_once,
    sampled,
    seed,
    stub_logprobs,
)
from tests.support.stub_vllm import StubPolicy

OPENHANDS = REPO / ".venv-openhands" / "bin" / "openhands"
MODEL = "openai/gpt-4o"
# What a headless run needs beyond the proxy and the CA.
SWITCHES = {
    "LLM_MODEL": MODEL,
    "LLM_API_KEY": "sk-agenttap-openhands-key",
    "LITELLM_LOCAL_MODEL_COST_MAP": "True",
    "OPENHANDS_SUPPRESS_BANNER": "1",
}
# OpenHands' system prompt ends with the folder it works in; its file editor wants absolute paths.
WORKDIR_LINE = re.compile(r"Your current working directory is: (\S+)")


def openhands_steps(workdir: str) -> list[str]:
    """The task as OpenHands' tools take it: ``file_editor`` (absolute paths), ``terminal``,
    ``finish``. Its tools that act require a ``security_risk`` (its LLM security analyzer's
    field; a call without one is refused and asked again)."""
    notes = f"{workdir.rstrip('/')}/notes.txt"
    return [
        "I'll read the notes first.\n"
        + hermes("file_editor", {"command": "view", "path": notes, "security_risk": "LOW"}),
        hermes("terminal", {"command": "wc -l notes.txt", "security_risk": "LOW"}),
        hermes(
            "file_editor",
            {
                "command": "str_replace",
                "path": notes,
                "old_str": "beta",
                "new_str": "gamma",
                "security_risk": "LOW",
            },
        ),
        hermes("finish", {"message": "Replaced beta with gamma in notes.txt."}),
    ]


def openhands_rule(stub: StubPolicy) -> Callable[[dict[str, Any]], str | None]:
    """Answers this task's calls by how far the conversation got (the tool results in its
    prompt), in the folder its system prompt names, so parallel rollouts each get the whole
    script. Other tests' calls are left to their own scripts."""

    def rule(body: dict[str, Any]) -> str | None:
        text = stub.tok.decode(body["prompt"])
        found = WORKDIR_LINE.search(text)
        if TASK not in text or found is None:
            return None
        steps = openhands_steps(found.group(1))
        return steps[min(text.count("<tool_response>"), len(steps) - 1)]

    return rule


@pytest.fixture(scope="module")
def openhands() -> Path:
    assert OPENHANDS.exists(), (
        f"OpenHands is not installed at {OPENHANDS}: run scripts/setup.sh (setup_openhands.sh)"
    )
    return OPENHANDS


def run_openhands(
    openhands: Path, proxy: Proxy, session: str, workdir: Path, model: str = MODEL
) -> subprocess.CompletedProcess[str]:
    home = workdir.parent / f"{workdir.name}-home"
    home.mkdir(exist_ok=True)
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "HTTPS_PROXY": f"http://{session}:x@127.0.0.1:{proxy.port}",
        "SSL_CERT_FILE": str(proxy.ca),
        **SWITCHES,
        "LLM_MODEL": model,
    }
    return subprocess.run(
        [str(openhands), "--headless", "--override-with-envs", "--json", "-t", TASK],
        cwd=workdir, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
        timeout=240,
    )  # fmt: skip


def test_openhands_does_a_four_turn_task(
    openhands: Path, stub_proxy: Proxy, stub: StubPolicy, tmp_path: Path
) -> None:
    session = "openhands-four-turns"
    workdir = seed(tmp_path / "work")
    steps = openhands_steps(str(workdir))
    stub.replies.clear()
    stub.script(*steps)
    n = len(stub.requests)
    done = run_openhands(openhands, stub_proxy, session, workdir)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (workdir / "notes.txt").read_text() == DONE
    assert len(stub.requests) - n == 4 and not stub.replies

    turns = check_one_conversation(stub_proxy, stub, session, steps, "openai.chat")
    # The tools' results come back as tool messages: the file's lines, the count, the edit.
    last = stub.tok.decode(turns[-1]["prompt_ids"])
    assert last.count("<tool_response>") == 3
    assert "2 notes.txt" in last and "has been edited" in last


# OpenHands' default model; the SDK asks it for reasoning_effort "high", which LiteLLM sends
# as Anthropic's extended thinking.
CLAUDE = "anthropic/claude-sonnet-4-5-20250929"
THOUGHT = "<think>\nThe next step of the task.\n</think>\n\n"


def test_openhands_on_the_anthropic_route(
    openhands: Path, stub_proxy: Proxy, stub: StubPolicy, tmp_path: Path
) -> None:
    """With a Claude model LiteLLM speaks the Messages API, extended thinking on. The policy
    thinks (as Qwen3 does with thinking on), so each answer has a thinking block that OpenHands
    sends back (LiteLLM drops ``thinking`` from a request whose last tool-call turn has none):
    one main row, every call extending the last."""
    session = "openhands-anthropic"
    workdir = seed(tmp_path / "work")
    steps = [THOUGHT + step for step in openhands_steps(str(workdir))]
    stub.replies.clear()
    stub.script(*steps)
    done = run_openhands(openhands, stub_proxy, session, workdir, model=CLAUDE)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (workdir / "notes.txt").read_text() == DONE and not stub.replies

    check_one_conversation(stub_proxy, stub, session, steps, "anthropic.messages")


def test_a_tool_call_without_its_security_risk_is_answered_and_kept(
    openhands: Path, stub_proxy: Proxy, stub: StubPolicy, tmp_path: Path
) -> None:
    """The field its tools require missing: OpenHands answers the call with a tool error and
    keeps both in its history, so the next call extends it; one row, five calls."""
    session = "openhands-no-risk"
    workdir = seed(tmp_path / "work")
    steps = openhands_steps(str(workdir))
    bad = hermes("terminal", {"command": "cat notes.txt"})
    stub.replies.clear()
    stub.script(bad, *steps)
    done = run_openhands(openhands, stub_proxy, session, workdir)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (workdir / "notes.txt").read_text() == DONE and not stub.replies

    turns = stub_proxy.turns(session, expect=5)
    (row,) = stub_proxy.threads(session, expect=1)
    check_trained_exactly_once([row], turns)
    assert row["thread_kind"] == "main" and row["num_turns"] == 5
    assert [json.loads(t["metadata"])["assembly"] for t in turns] == ["new"] + ["extend"] * 4
    second = stub.tok.decode(turns[1]["prompt_ids"])
    assert "Failed to provide security_risk field" in second


def test_a_task_handed_to_a_sub_agent_is_a_subagent_row(
    openhands: Path, stub_proxy: Proxy, stub: StubPolicy, tmp_path: Path
) -> None:
    """Its ``task`` tool runs a sub-agent in the same process (a conversation of its own, the
    tool's ``prompt`` as its first user message, the parent's LLM) until it finishes; its
    result comes back as the tool's result. The sub-agent's calls are a ``subagent`` row hung
    off the spawning call; the parent's row goes on. Every call trained once."""
    session = "openhands-task"
    job = "Count the lines of notes.txt with wc -l and report the number."
    workdir = seed(tmp_path / "work")
    steps = openhands_steps(str(workdir))
    spawn = {
        "description": "Count lines",
        "prompt": job,
        "subagent_type": "general-purpose",
        "security_risk": "LOW",
    }
    stub.replies.clear()
    stub.script(
        hermes("task", spawn),
        # The sub-agent, sequentially: the task tool waits for it.
        hermes("terminal", {"command": "wc -l notes.txt", "security_risk": "LOW"}),
        hermes("finish", {"message": "notes.txt has 2 lines."}),
        steps[2],
        steps[3],
    )
    done = run_openhands(openhands, stub_proxy, session, workdir)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (workdir / "notes.txt").read_text() == DONE and not stub.replies

    turns = stub_proxy.turns(session, expect=5)
    threads = stub_proxy.threads(session, expect=2)
    where = check_trained_exactly_once(threads, turns)
    by_kind = {r["thread_kind"]: r for r in threads}
    assert sorted(by_kind) == ["main", "subagent"] and len(threads) == 2
    main, sub = by_kind["main"], by_kind["subagent"]
    assert [where[t["request_id"]] for t in turns] == [main["thread_id"]] + [
        sub["thread_id"]
    ] * 2 + [main["thread_id"]] * 2
    assert sub["parent_thread_id"] == main["thread_id"] and sub["parent_relation"] == "spawn"
    assert sub["parent_tool_call_id"]
    assert job in stub.tok.decode(sub["input_ids"])
    # The parent's next call holds the sub-agent's answer as the task tool's result.
    back = stub.tok.decode(turns[3]["prompt_ids"])
    assert "notes.txt has 2 lines." in back and "Status: completed" in back


# The condenser's own prompt (openhands/sdk/context/condenser/prompts/summarizing_prompt.j2).
CONDENSER_PROMPT = "You are maintaining a context-aware state summary"
SUMMARY = "USER_CONTEXT: replace beta with gamma in notes.txt. PROGRESS: nothing changed yet."
# Its default CLI agent condenses once its history holds over 80 events (a tool call and its
# result are two); the test's saved configuration lowers that to 30 (the same condenser, less
# waiting), which this many think calls (no side effects) pass once.
CONDENSE_AT = 30
THINKS = 16


def test_openhands_condensation_is_a_rewrite_trained_once(
    openhands: Path, stub_proxy: Proxy, stub: StubPolicy, tmp_path: Path
) -> None:
    """Past its threshold the summarizing condenser asks the LLM for a summary of older events
    (one call, its own prompt, no tools) and the next call's history is the first call, the
    summary as a user message, then the calls it kept. The summary call is an auxiliary row;
    the conversation's row drops the forgotten calls (trained in a ``rewritten`` row, in the
    sequence they were sampled in, at their own logprobs) and trains the kept ones re-scored
    at their new positions; the calls after it are sampled as before. Every call trained once."""
    session = "openhands-condense"
    workdir = seed(tmp_path / "work")
    # Its saved configuration (the rollout agent's) with the condenser's threshold lowered; the
    # model and key still come from the environment (--override-with-envs).
    settings = json.loads(json.dumps(OPENHANDS_SETTINGS))
    settings["condenser"]["max_size"] = CONDENSE_AT
    saved = tmp_path / "work-home" / ".openhands" / "agent_settings.json"
    saved.parent.mkdir(parents=True)
    saved.write_text(json.dumps(settings))
    thinks = [
        hermes("think", {"thought": f"Step {i}: think about the notes."}) for i in range(THINKS)
    ]
    steps = iter([*thinks, *openhands_steps(str(workdir))])

    def rule(body: dict[str, Any]) -> str | None:
        # Called once per request, in order: the conversation's calls are sequential.
        return SUMMARY if CONDENSER_PROMPT in stub.tok.decode(body["prompt"]) else next(steps)

    stub.rules.insert(0, rule)
    try:
        done = run_openhands(openhands, stub_proxy, session, workdir)
    finally:
        stub.rules.remove(rule)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (workdir / "notes.txt").read_text() == DONE
    assert next(steps, None) is None  # every scripted step was asked for

    turns = stub_proxy.turns(session, expect=THINKS + 5)
    assert len(turns) == THINKS + 5  # the agent's calls and one summary
    index = {t["request_id"]: i for i, t in enumerate(turns)}
    (summary_at,) = [
        i for i, t in enumerate(turns) if t["completion_ids"] == sampled(stub, SUMMARY)
    ]
    after = stub.tok.decode(turns[summary_at + 1]["prompt_ids"])
    assert SUMMARY in after and "Step 0:" in after and "Step 1:" not in after

    threads = stub_proxy.threads(session, expect=3)
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for row in threads:
        by_kind.setdefault(row["thread_kind"], []).append(row)
    (aux,) = by_kind["auxiliary"]
    main, rewritten = sorted(by_kind["main"], key=lambda r: r["parent_relation"] or "")
    assert main["parent_relation"] is None and not main["dead"]
    assert rewritten["parent_relation"] == "rewritten"
    assert rewritten["parent_thread_id"] == main["thread_id"]
    assert [index[s["request_id"]] for s in aux["turns"]] == [summary_at]

    # Each call trained in exactly one row, at its own sampled ids.
    trained: dict[int, tuple[dict[str, Any], dict[str, Any]]] = {}
    for row in threads:
        for span in row["turns"]:
            if span["status"] == "trained":
                i = index[span["request_id"]]
                assert i not in trained, f"call {i} trained twice"
                trained[i] = (row, span)
                assert row["input_ids"][span["start"] : span["end"]] == turns[i]["completion_ids"]
    assert sorted(trained) == list(range(len(turns)))
    total = sum(sum(row["loss_mask"]) for row in threads)
    assert total == sum(len(t["completion_ids"]) for t in turns), "no token trained twice"

    # The main row: the forgotten calls dropped (the rewritten row trains them as sampled),
    # the kept ones re-scored where they now stand, the rest as sampled.
    status = {index[s["request_id"]]: s["status"] for s in main["turns"]}
    forgotten = {i for i, st in status.items() if st == "dropped"}
    kept = {i for i, st in status.items() if st == "trained" and 0 < i < summary_at}
    assert forgotten and kept and min(kept) == max(forgotten) + 1 and max(kept) == summary_at - 1
    assert {i for i, (row, _) in trained.items() if row is rewritten} == forgotten
    for i, (row, span) in trained.items():
        lps = np.asarray(row["logprobs"][span["start"] : span["end"]], dtype=np.float32)
        provenance = set(row["provenance"][span["start"] : span["end"]])
        if i in kept:
            assert provenance == {2}, f"call {i} kept after the summary: re-scored"
            expected = [
                StubPolicy._logprob_of(k, row["input_ids"][k])
                for k in range(span["start"], span["end"])
            ]
            np.testing.assert_array_equal(lps, np.asarray(expected, dtype=np.float32))
        else:
            assert provenance == {1}, f"call {i}: its own sampled logprobs"
            np.testing.assert_array_equal(lps, stub_logprobs(turns[i]["completion_ids"]))


def test_openhands_by_base_url(
    openhands: Path, stub_tap: AgentTap, stub: StubPolicy, tmp_path: Path
) -> None:
    """No proxy, no CA: the session's openai base URL as LLM_BASE_URL and its key as
    LLM_API_KEY (both read with --override-with-envs); LiteLLM posts to BASE/chat/completions."""
    workdir = seed(tmp_path / "work")
    home = tmp_path / "home"
    home.mkdir()
    sess = stub_tap.open_session(metadata={"task_id": "openhands-base-url"})
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        **SWITCHES,
        "LLM_BASE_URL": sess.base_urls["openai"],
        "LLM_API_KEY": sess.api_key,
    }
    rule = openhands_rule(stub)
    stub.rules.insert(0, rule)
    try:
        done = subprocess.run(
            [str(openhands), "--headless", "--override-with-envs", "-t", TASK],
            cwd=workdir, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
            timeout=240,
        )  # fmt: skip
    finally:
        stub.rules.remove(rule)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (workdir / "notes.txt").read_text() == DONE
    rows = sess.close(reward=1.0).to_pylist()
    (main,) = rows
    assert main["thread_kind"] == "main" and main["num_turns"] == 4 and main["reward"] == 1.0
    assert main["protocol"] == "openai.chat"
    out = stub_tap.out
    check_trained_exactly_once(read_threads(out, sess.id), read_turns(out, sess.id))


@pytest.mark.vllm
def test_openhands_against_the_real_policy(
    openhands: Path, vllm_proxy: Proxy, vllm_url: str, tmp_path: Path
) -> None:
    """The random tiny policy answers text and calls no tool, which ends OpenHands' task: one
    call, its ~8k-token prompt and answer in one main row holding vLLM's own logprobs
    (re-scored here; the trainer's forward at the session's end). Its answer is capped through
    its saved configuration (the rollout agent's, with max_output_tokens), so no env overrides."""
    session = "openhands-vllm"
    workdir = seed(tmp_path / "work")
    home = tmp_path / "home"
    settings = json.loads(json.dumps(OPENHANDS_SETTINGS))
    settings["llm"]["max_output_tokens"] = 64
    (home / ".openhands").mkdir(parents=True)
    (home / ".openhands" / "agent_settings.json").write_text(json.dumps(settings))
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "HTTPS_PROXY": f"http://{session}:x@127.0.0.1:{vllm_proxy.port}",
        "SSL_CERT_FILE": str(vllm_proxy.ca),
        "OPENAI_API_KEY": "sk-agenttap-openhands-key",
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",
        "OPENHANDS_SUPPRESS_BANNER": "1",
    }
    done = subprocess.run(
        [str(openhands), "--headless", "--json", "-t", "Say hello."],
        cwd=workdir, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    turns = vllm_proxy.turns(session, expect=1)
    rows = vllm_proxy.threads(session, expect=1)
    assert all(len(t["completion_ids"]) <= 64 for t in turns)
    assert {r["thread_kind"] for r in rows} == {"main"}
    diffs = [_assert_exact(row, turns, vllm_url, tolerance=1e-5) for row in rows]
    print(f"openhands: {len(turns)} calls, {len(rows)} rows, max |diff| vs vLLM {max(diffs)}")
    assert max(diffs) <= 1e-5
