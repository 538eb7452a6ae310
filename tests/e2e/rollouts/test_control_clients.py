"""The real CLIs driven through sessions of the control API: configured only by a session's
``env`` (proxy mode) or its ``base_urls`` (base-URL mode), and stopped by a session's limit
without retrying. The policy is the scripted stub."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from capture.client.launcher import AgentTap, Session
from tests.e2e.clis.test_claude_code import CLAUDE
from tests.e2e.clis.test_codex import CODEX, FIRST, FUNCTION_CALL, LAST
from tests.e2e.clis.test_gemini_cli import GEMINI, answer_router
from tests.e2e.providers.test_anthropic_sdk_stub import hermes
from tests.support.stub_vllm import StubPolicy


@pytest.fixture
def tap(stub_tap: AgentTap) -> AgentTap:
    return stub_tap


def base_env(workdir: Path, extra: dict[str, str]) -> dict[str, str]:
    home = workdir.parent / f"{workdir.name}-home"
    home.mkdir(exist_ok=True)
    return {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "CLAUDE_CONFIG_DIR": str(home / ".claude"),
        "CODEX_HOME": str(home),
        "DISABLE_AUTOUPDATER": "1",
        **extra,
    }


def run(
    cmd: list[str], workdir: Path, env: dict[str, str], timeout: float = 240
) -> tuple[subprocess.CompletedProcess[str], float]:
    started = time.monotonic()
    done = subprocess.run(
        cmd, cwd=workdir, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip
    return done, time.monotonic() - started


def claude(prompt: str) -> list[str]:
    return [str(CLAUDE), "-p", prompt, "--allowedTools", "Bash,Write"]


def codex(prompt: str, *extra: str) -> list[str]:
    return [
        str(CODEX), "exec", "--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox",
        "--json", *extra, prompt,
    ]  # fmt: skip


def workdir_of(tmp_path: Path) -> Path:
    workdir = tmp_path / "work"
    workdir.mkdir()
    return workdir


def check_stopped_by_limit(sess: Session, tap: AgentTap, elapsed: float) -> list[dict[str, Any]]:
    """The session's second call was refused once (the client did not retry) and its rows say
    why it ended."""
    live = {s["id"]: s for s in tap.sessions()}[sess.id]
    assert live["metrics"]["refused"] == 1, live
    assert live["metrics"]["calls"] == 1, live
    rows = sess.close(reward=0.0).to_pylist()
    assert sess.end_reason == "max_calls"
    assert rows and all(r["end_reason"] == "max_calls" for r in rows)
    print(f"{sess.id}: stopped by max_calls after {elapsed:.1f} s, one refusal, no retry")
    return rows


def test_claude_code_in_a_session_env_is_stopped_by_max_calls(
    tap: AgentTap, stub: StubPolicy, tmp_path: Path
) -> None:
    workdir = workdir_of(tmp_path)
    target = workdir / "hello.txt"
    stub.replies.clear()
    stub.script(hermes("Write", {"file_path": str(target), "content": "hi"}), "Done.")
    sess = tap.open_session(metadata={"task_id": "cc-limit"}, limits={"max_calls": 1})
    done, elapsed = run(
        claude("Create hello.txt containing hi"), workdir, base_env(workdir, sess.env)
    )
    # Its one call ran the tool; the next was refused, and Claude Code stopped at once.
    assert target.read_text() == "hi"
    assert done.returncode != 0
    assert "max_calls" in done.stdout + done.stderr, done.stdout + done.stderr
    rows = check_stopped_by_limit(sess, tap, elapsed)
    assert rows[0]["protocol"] == "anthropic.messages"


def test_claude_code_by_base_url(tap: AgentTap, stub: StubPolicy, tmp_path: Path) -> None:
    workdir = workdir_of(tmp_path)
    target = workdir / "hello.txt"
    stub.replies.clear()
    stub.script(hermes("Write", {"file_path": str(target), "content": "hi"}), "Done: written.")
    sess = tap.open_session(metadata={"task_id": "cc-base-url"})
    env = base_env(
        workdir,
        {
            "ANTHROPIC_BASE_URL": sess.base_urls["anthropic"],
            "ANTHROPIC_API_KEY": sess.api_key,
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        },
    )
    done, _ = run(claude("Create hello.txt containing hi"), workdir, env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert target.read_text() == "hi" and "Done: written." in done.stdout
    rows = sess.close(reward=1.0).to_pylist()
    main = max(rows, key=lambda r: r["num_turns"])
    assert main["num_turns"] == 2 and main["reward"] == 1.0
    assert main["protocol"] == "anthropic.messages" and main["user_agent"].startswith("claude-cli/")


def test_codex_in_a_session_env_is_stopped_by_max_calls(
    tap: AgentTap, stub: StubPolicy, tmp_path: Path
) -> None:
    workdir = workdir_of(tmp_path)
    stub.replies.clear()
    stub.script(FIRST, LAST)
    sess = tap.open_session(metadata={"task_id": "codex-limit"}, limits={"max_calls": 1})
    done, elapsed = run(
        codex("Create hello.txt containing hi"), workdir, base_env(workdir, sess.env)
    )
    assert (workdir / "hello.txt").read_text() == "hi"
    assert "max_calls" in done.stdout + done.stderr, done.stdout + done.stderr
    rows = check_stopped_by_limit(sess, tap, elapsed)
    assert rows[0]["protocol"] == "openai.responses"


def test_gemini_cli_by_base_url(tap: AgentTap, stub: StubPolicy, tmp_path: Path) -> None:
    workdir = workdir_of(tmp_path)
    target = workdir / "hello.txt"
    stub.replies.clear()
    stub.script(
        hermes("write_file", {"file_path": str(target), "content": "hi"}), "Done: hello.txt."
    )
    stub.rules.append(answer_router)
    sess = tap.open_session(metadata={"task_id": "gemini-base-url"})
    env = base_env(
        workdir,
        {
            "GOOGLE_GEMINI_BASE_URL": sess.base_urls["gemini"],
            "GEMINI_API_KEY": sess.api_key,
            "GEMINI_CLI_TRUST_WORKSPACE": "true",
        },
    )
    # Its API-key auth, chosen in its settings, keeps the base URL (the env alone picks
    # "gateway" auth, which a headless run refuses).
    settings = Path(env["HOME"]) / ".gemini" / "settings.json"
    settings.parent.mkdir(parents=True, exist_ok=True)
    settings.write_text(json.dumps({"security": {"auth": {"selectedType": "gemini-api-key"}}}))
    try:
        done, _ = run([str(GEMINI), "-p", "Create hello.txt with hi", "--yolo"], workdir, env)
    finally:
        stub.rules.remove(answer_router)
    assert done.returncode == 0, done.stdout + done.stderr
    assert target.read_text() == "hi" and "Done: hello.txt." in done.stdout
    rows = sess.close(reward=1.0).to_pylist()
    main = max(rows, key=lambda r: r["num_turns"])
    assert main["num_turns"] == 2 and main["protocol"] == "gemini.generate_content"
    assert main["user_agent"].startswith("GeminiCLI") and main["reward"] == 1.0


def test_codex_by_base_url(tap: AgentTap, stub: StubPolicy, tmp_path: Path) -> None:
    workdir = workdir_of(tmp_path)
    stub.replies.clear()
    # A provider of its own has no model metadata: Codex sends classic function tools.
    stub.script(FUNCTION_CALL, LAST)
    sess = tap.open_session(metadata={"task_id": "codex-base-url"})
    # Codex 0.169 ignores OPENAI_BASE_URL: a model provider in its config names the base URL.
    env = base_env(workdir, {"AGENTTAP_KEY": sess.api_key})
    (Path(env["CODEX_HOME"]) / "config.toml").write_text(sess.codex_config())
    done, _ = run(codex("Create hello.txt containing hi"), workdir, env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (workdir / "hello.txt").read_text() == "hi"
    rows = sess.close(reward=1.0).to_pylist()
    assert len(rows) == 1 and rows[0]["num_turns"] == 2
    assert rows[0]["protocol"] == "openai.responses" and rows[0]["reward"] == 1.0
