"""The real Claude Code CLI through the real proxy, answered by a scripted policy and by the real
vLLM tiny model. Claude Code is installed by scripts/install_clients.sh (scripts/setup.sh runs it).

Claude Code runs as it would for a user: only HTTPS_PROXY (with the session as the proxy
username), NODE_EXTRA_CA_CERTS and an API key are set; HOME and its config folder are fresh.
"""

from __future__ import annotations

import json
import os
import pty
import select
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.providers.test_anthropic_sdk_stub import hermes
from tests.e2e.providers.test_trajectory_vllm import _assert_exact
from tests.support.flows import (
    read_flows,
    recorded_replies,
    recording,
    replay_flows,
    thread_signatures,
)
from tests.support.paths import IM_END, REPO
from tests.support.proxies import Proxy, read_turns
from tests.support.stub_vllm import StubPolicy

CLAUDE = REPO / ".cache" / "node" / "node_modules" / ".bin" / "claude"
TUI_KEY = "sk-ant-agenttap-tui-test-key"


@pytest.fixture(scope="module")
def claude() -> Path:
    assert CLAUDE.exists(), f"Claude Code is not installed at {CLAUDE}: run scripts/setup.sh"
    return CLAUDE


def run_claude(
    claude: Path,
    proxy: Proxy,
    session: str | None,
    workdir: Path,
    prompt: str,
    timeout: float = 180,
) -> subprocess.CompletedProcess[str]:
    creds = f"{session}:x@" if session else ""
    home = workdir.parent / f"{workdir.name}-home"
    home.mkdir(exist_ok=True)
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "CLAUDE_CONFIG_DIR": str(home / ".claude"),
        "ANTHROPIC_API_KEY": "sk-ant-agenttap-test-key",
        "HTTPS_PROXY": f"http://{creds}127.0.0.1:{proxy.port}",
        "NODE_EXTRA_CA_CERTS": str(proxy.ca),
        "DISABLE_AUTOUPDATER": "1",
    }
    return subprocess.run(
        [str(claude), "-p", prompt, "--allowedTools", "Bash,Write"],
        cwd=workdir,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _main_thread(rows: list[dict[str, Any]]) -> dict[str, Any]:
    return max(rows, key=lambda r: (r["num_turns"], len(r["input_ids"])))


def test_file_writing_task_with_scripted_policy(
    claude: Path,
    stub_proxy: Proxy,
    stub: StubPolicy,
    tok: Any,
    tmp_path: Path,
) -> None:
    workdir = tmp_path / "work"
    workdir.mkdir()
    target = workdir / "hello.txt"
    call = "I'll create the file.\n" + hermes("Write", {"file_path": str(target), "content": "hi"})
    stub.replies.clear()
    stub.script(call, "Done: hello.txt holds hi.")
    n = len(stub.requests)
    session = "cc-stub"
    done = run_claude(claude, stub_proxy, session, workdir, "Create hello.txt containing hi")
    assert done.returncode == 0, done.stdout + done.stderr
    assert target.read_text() == "hi"
    assert "Done: hello.txt holds hi." in done.stdout

    turns = stub_proxy.turns(session, expect=2)
    assert len(turns) == len(stub.requests) - n
    rows = stub_proxy.threads(session)
    main = _main_thread(rows)
    assert main["num_turns"] == 2
    assert main["protocol"] == "anthropic.messages"
    assert main["user_agent"].startswith("claude-cli/")
    main_turns = [t for t in turns if t["thread_id"] == main["thread_id"]]
    assert [json.loads(t["metadata"])["assembly"] for t in main_turns] == ["new", "extend"]
    # Normalization removed the per-call noise (billing header, moving cache_control, a
    # system message flipping from blocks to a string): call 2's prompt is call 1's prompt plus
    # the sampled ids, exactly; nothing was recomputed.
    first, second = main_turns[0], main_turns[1]
    sampled = list(tok.encode(call, add_special_tokens=False)) + [IM_END]
    assert first["completion_ids"] == sampled
    assert second["prompt_ids"][: len(first["prompt_ids"]) + len(sampled)] == (
        first["prompt_ids"] + sampled
    )
    assert 2 not in main["provenance"] and 3 not in main["provenance"]
    assert "x-anthropic-billing-header" not in tok.decode(first["prompt_ids"])
    assert "File created successfully" in tok.decode(second["prompt_ids"])
    # Any side call Claude Code makes is a thread of its own, never spliced into the main one.
    for row in rows:
        if row is not main:
            assert row["thread_id"] != main["thread_id"]
            assert row["input_ids"][:20] != main["input_ids"][:20] or row["num_turns"] == 1


def test_runs_without_a_proxy_username(
    claude: Path, stub_proxy: Proxy, stub: StubPolicy, tmp_path: Path
) -> None:
    """A plain HTTPS_PROXY=http://host:port works; Claude Code's session header names the
    session."""
    workdir = tmp_path / "work"
    workdir.mkdir()
    stub.replies.clear()
    stub.script("Hello from the policy.")
    done = run_claude(claude, stub_proxy, None, workdir, "Say hello.")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Hello from the policy." in done.stdout
    stub_proxy.flush()  # its session is named by Claude Code's own header: write them all
    rows = [
        r for r in read_turns(stub_proxy.out) if r["completion_text"] == "Hello from the policy."
    ]
    assert len(rows) == 1
    # Named by Claude Code's X-Claude-Code-Session-Id (a UUID), not "anonymous".
    session = rows[0]["session_id"]
    assert session.startswith("claude-code:") and len(session) == len("claude-code:") + 36


def test_sub_agent_is_its_own_thread(
    claude: Path, stub_proxy: Proxy, stub: StubPolicy, tmp_path: Path
) -> None:
    workdir = tmp_path / "work"
    workdir.mkdir()
    target = workdir / "note.txt"
    task = f"Write the word hello into {target}."
    spawn = hermes(
        "Agent",
        {"description": "Write the note", "prompt": task, "subagent_type": "general-purpose"},
    )
    write = hermes("Write", {"file_path": str(target), "content": "hello"})

    def sub_agent(body: dict[str, Any]) -> str | None:
        # Claude Code runs the sub-agent concurrently with the main agent: answer by context.
        text = stub.tok.decode(body["prompt"])
        if task not in text or '<tool_call>\n{"name": "Agent"' in text:
            return None  # the main agent's calls take the script
        return "Wrote the note." if "File created successfully" in text else write

    stub.replies.clear()
    stub.rules.append(sub_agent)
    stub.script(spawn)
    stub.default_reply = "The sub-agent is writing the note."
    session = "cc-subagent"
    try:
        done = run_claude(claude, stub_proxy, session, workdir, "Use a sub-agent to write note.txt")
    finally:
        stub.rules.remove(sub_agent)
        stub.default_reply = "OK."
    assert done.returncode == 0, done.stdout + done.stderr
    assert target.read_text() == "hello"
    rows = stub_proxy.threads(session, expect=2)
    by_id = {r["thread_id"]: r for r in rows}
    subs = [r for r in rows if r["parent_thread_id"] in by_id]
    assert len(subs) == 1, [(r["thread_id"], r["parent_thread_id"], r["num_turns"]) for r in rows]
    sub = subs[0]
    parent = by_id[sub["parent_thread_id"]]
    assert sub["num_turns"] == 2 and parent["num_turns"] >= 2
    # The parent link names the Agent call by the id Claude Code was given for it.
    turns = stub_proxy.turns(session, expect=parent["num_turns"] + 2)
    first_main = min(
        (t for t in turns if t["thread_id"] == parent["thread_id"]), key=lambda t: t["turn_index"]
    )
    assert "Agent" in first_main["completion_text"]
    assert sub["parent_tool_call_id"].startswith("toolu_")


@pytest.mark.vllm
def test_claude_code_against_the_real_policy(
    claude: Path, vllm_proxy: Proxy, vllm_url: str, tmp_path: Path
) -> None:
    workdir = tmp_path / "work"
    workdir.mkdir()
    session = "cc-vllm"
    done = run_claude(claude, vllm_proxy, session, workdir, "Say hello.")
    # The random policy answers text (or something that parses as text): Claude Code prints it
    # and ends cleanly.
    assert done.returncode == 0, done.stdout + done.stderr
    turns = vllm_proxy.turns(session, expect=1, timeout=60)
    rows = vllm_proxy.threads(session)
    assert rows
    for row in rows:
        # Claude Code's prompt is ~11.5k tokens: see _assert_exact on fp32 at long context.
        assert _assert_exact(row, turns, vllm_url, tolerance=1e-5) <= 1e-5


def test_recorded_claude_code_traffic_replays_offline(
    claude: Path, stub: StubPolicy, confdir: Path, tmp_path: Path
) -> None:
    """Claude Code's own traffic, recorded once as a flow file, replayed through the addon with
    no Claude Code and no network: the same threads come out."""
    workdir = tmp_path / "work"
    workdir.mkdir()
    target = workdir / "hello.txt"
    call = hermes("Write", {"file_path": str(target), "content": "hi"})
    flow_file, live, replayed = tmp_path / "cc.flows", tmp_path / "live", tmp_path / "replayed"
    session = "cc-replay"
    stub.replies.clear()
    stub.script(call, "Done.")
    with recording(stub.url, live, confdir, flow_file) as proxy:
        done = run_claude(claude, proxy, session, workdir, "Create hello.txt containing hi")
    assert done.returncode == 0, done.stdout + done.stderr
    assert target.read_text() == "hi"
    flows = read_flows(flow_file)
    paths = [f.request.path.split("?")[0] for f in flows]
    assert paths.count("/v1/messages") == 2
    assert all(f.request.host == "api.anthropic.com" for f in flows)
    # Claude Code's non-model calls were answered locally, never refused or sent out.
    assert "REFUSED" not in proxy.log.read_text(errors="replace")

    replies = recorded_replies(live, session)
    assert replies == [call, "Done."]
    stub.replies.clear()
    stub.script(*replies)
    replay = replay_flows(flow_file, stub.url, replayed, confdir)
    assert replay.returncode == 0, replay.log[-4000:]
    assert replay.dials and all(d.startswith("loopback 127.0.0.1:") for d in replay.dials)
    assert not stub.replies, "not every recorded call was replayed"
    want, got = thread_signatures(live, session), thread_signatures(replayed, session)
    assert len(want) == 1 and want[0]["num_turns"] == 2
    assert got == want


def _drive_tui(
    claude: Path, proxy: Proxy, session: str, workdir: Path, prompt: str, done: Any
) -> str:
    """Run interactive Claude Code in a pseudo-terminal, type ``prompt`` once its UI is up, and
    stop it once ``done()`` holds. Returns the screen output (for failure messages)."""
    home = workdir.parent / f"{workdir.name}-home"
    config = home / ".claude"
    config.mkdir(parents=True, exist_ok=True)
    # What a first interactive run would ask: onboarding done, the key and the folder trusted.
    (config / ".claude.json").write_text(
        json.dumps(
            {
                "hasCompletedOnboarding": True,
                "theme": "dark",
                # Claude Code remembers approved keys by their last 20 characters.
                "customApiKeyResponses": {"approved": [TUI_KEY[-20:]], "rejected": []},
                "projects": {str(workdir): {"hasTrustDialogAccepted": True, "allowedTools": []}},
            }
        )
    )
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "CLAUDE_CONFIG_DIR": str(config),
        "ANTHROPIC_API_KEY": TUI_KEY,
        "HTTPS_PROXY": f"http://{session}:x@127.0.0.1:{proxy.port}",
        "NODE_EXTRA_CA_CERTS": str(proxy.ca),
        "DISABLE_AUTOUPDATER": "1",
        "TERM": "xterm",
    }
    pid, fd = pty.fork()
    if pid == 0:  # the child: becomes Claude Code
        os.chdir(workdir)
        os.execve(str(claude), [str(claude), "--allowedTools", "Bash,Write"], env)
    screen = b""
    typed = False
    deadline = time.monotonic() + 90
    try:
        while time.monotonic() < deadline and not done():
            ready, _, _ = select.select([fd], [], [], 0.3)
            if ready:
                try:
                    screen += os.read(fd, 65536)
                except OSError:
                    break
            text = screen.decode("utf-8", "replace")
            if not typed and "effort" in text:  # the prompt box's status line is drawn
                time.sleep(1.0)
                for ch in prompt:
                    os.write(fd, ch.encode())
                    time.sleep(0.02)
                time.sleep(0.5)
                os.write(fd, b"\r")
                typed = True
        time.sleep(2.0)  # let the last response finish streaming and be recorded
    finally:
        os.kill(pid, signal.SIGTERM)
        os.waitpid(pid, 0)
        os.close(fd)
    return screen.decode("utf-8", "replace")


# pty.fork in a process with threads (the stub's server): the child only execs Claude Code.
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_interactive_session_keeps_the_title_call_apart(
    claude: Path, stub_proxy: Proxy, stub: StubPolicy, tmp_path: Path
) -> None:
    """Interactive Claude Code also asks a small model for a session title (JSON schema output,
    no tools) while the main call runs: that call is a thread of its own."""
    workdir = tmp_path / "work"
    workdir.mkdir()
    target = workdir / "hello.txt"
    call = hermes("Write", {"file_path": str(target), "content": "hi"})

    def title(body: dict[str, Any]) -> str | None:
        return '{"title": "Hello file"}' if "structured_outputs" in body else None

    stub.replies.clear()
    stub.rules.append(title)
    stub.script(call, "Done: hello.txt holds hi.")
    session = "cc-tui"

    def finished() -> bool:
        # Both main replies handed out and the file written: the conversation is over.
        return target.exists() and not stub.replies

    try:
        screen = _drive_tui(
            claude, stub_proxy, session, workdir, "Create hello.txt containing hi", finished
        )
    finally:
        stub.rules.remove(title)
    assert target.exists() and target.read_text() == "hi", screen[-3000:]
    turns = stub_proxy.turns(session, expect=3, timeout=30)
    titles = [t for t in turns if t["completion_text"] == '{"title": "Hello file"}']
    assert titles, [(t["requested_model"], t["completion_text"][:40]) for t in turns]
    assert all("haiku" in t["requested_model"] for t in titles)
    rows = stub_proxy.threads(session, expect=2)
    main = _main_thread(rows)
    assert main["num_turns"] == 2
    assert 2 not in main["provenance"]
    assert {t["thread_id"] for t in titles}.isdisjoint({main["thread_id"]})
