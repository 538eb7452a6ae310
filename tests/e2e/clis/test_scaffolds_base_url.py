"""OpenCode and mini-swe-agent in base-URL mode: no proxy, no CA; the session's base URL (the
control API's ``/sess/ID/...``) and its key, handed over the way each scaffold takes a base URL
(OpenCode: its provider's ``baseURL`` option in its config; mini-swe-agent: LiteLLM's
``OPENAI_BASE_URL``). The stub scripts the four-turn task (tests/support/scaffold_task.py); the rows come
back with the session's close."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from capture.client.launcher import AgentTap
from tests.e2e.clis.test_mini_swe_agent import MINI
from tests.e2e.clis.test_opencode import OPENCODE
from tests.support.proxies import read_threads, read_turns
from tests.support.scaffold_task import (
    DONE,
    MINI_STEPS,
    OPENCODE_STEPS,
    TASK,
    check_trained_exactly_once,
    seed,
    step_rule,
)
from tests.support.stub_vllm import StubPolicy


def run(
    cmd: list[str], workdir: Path, extra: dict[str, str], opencode_config: dict | None = None
) -> subprocess.CompletedProcess[str]:
    """``cmd`` in ``workdir`` with a fresh HOME (OpenCode's global config written into it)."""
    home = workdir.parent / "home"
    home.mkdir(exist_ok=True)
    if opencode_config is not None:
        path = home / ".config" / "opencode" / "opencode.json"
        path.parent.mkdir(parents=True)
        path.write_text(json.dumps(opencode_config))
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home), **extra}
    return subprocess.run(
        cmd, cwd=workdir, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
        timeout=180,
    )  # fmt: skip


def test_opencode_by_base_url(stub_tap: AgentTap, stub: StubPolicy, tmp_path: Path) -> None:
    workdir = seed(tmp_path / "work")
    sess = stub_tap.open_session(metadata={"task_id": "opencode-base-url"})
    # Its Anthropic provider's base URL ends in /v1 (it posts to BASE/messages).
    base = sess.base_urls["anthropic"].rstrip("/")
    config = {"provider": {"anthropic": {"options": {"baseURL": f"{base}/v1"}}}}
    rule = step_rule(stub, OPENCODE_STEPS)
    stub.rules.insert(0, rule)
    try:
        done = run(
            [str(OPENCODE), "run", "--format", "json", "--auto", "-m",
             "anthropic/claude-sonnet-4-5", TASK],
            workdir,
            {"ANTHROPIC_API_KEY": sess.api_key},
            config,
        )  # fmt: skip
    finally:
        stub.rules.remove(rule)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (workdir / "notes.txt").read_text() == DONE
    rows = sess.close(reward=1.0).to_pylist()
    kinds = sorted(r["thread_kind"] for r in rows)
    assert kinds == ["auxiliary", "main"], rows
    main = next(r for r in rows if r["thread_kind"] == "main")
    assert main["num_turns"] == 4 and main["reward"] == 1.0
    assert main["protocol"] == "anthropic.messages"
    out = stub_tap.out
    check_trained_exactly_once(read_threads(out, sess.id), read_turns(out, sess.id))


def test_mini_swe_agent_by_base_url(stub_tap: AgentTap, stub: StubPolicy, tmp_path: Path) -> None:
    workdir = seed(tmp_path / "work")
    sess = stub_tap.open_session(metadata={"task_id": "mini-base-url"})
    rule = step_rule(stub, MINI_STEPS)
    stub.rules.insert(0, rule)
    try:
        done = run(
            [str(MINI), "-m", "openai/gpt-4o", "-t", TASK, "-y", "--exit-immediately",
             "-c", "mini.yaml"],
            workdir,
            {
                "OPENAI_BASE_URL": sess.base_urls["openai"],
                "OPENAI_API_KEY": sess.api_key,
                "MSWEA_CONFIGURED": "true",
                "MSWEA_COST_TRACKING": "ignore_errors",
                "LITELLM_LOCAL_MODEL_COST_MAP": "True",
            },
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
