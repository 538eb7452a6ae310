"""The real Codex CLI (``codex exec``) through the real proxy, over its WebSocket mode and over
HTTP, answered by a scripted policy; against the real vLLM tiny model; and replayed offline from a
recorded flow file. Codex is installed by scripts/install_clients.sh.

Codex runs as it would for a user: HTTPS_PROXY (the session as the proxy username),
SSL_CERT_FILE for the proxy's CA, OPENAI_API_KEY and a fresh CODEX_HOME. Its default model sends
its tools as an ``additional_tools`` input item with a freeform ``exec`` tool (JavaScript that
calls nested tools such as ``tools.exec_command``), which the scripted policy calls.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.providers.test_openai_tools_stub import hermes
from tests.e2e.providers.test_trajectory_vllm import _assert_exact
from tests.support.flows import (
    read_flows,
    recorded_replies,
    recording,
    replay_flows,
    thread_signatures,
)
from tests.support.paths import IM_END, REPO
from tests.support.proxies import Proxy, start_proxy
from tests.support.stub_vllm import StubPolicy

CODEX = REPO / ".cache" / "node" / "node_modules" / ".bin" / "codex"
WEBSOCKET_OFF = ["--set", "agenttap_responses_websocket=false"]
# The first answer thinks, then writes the file through exec -> tools.exec_command.
EXEC_SCRIPT = 'const r = await tools.exec_command({cmd: "printf hi > hello.txt"});\ntext(r.output);'
FIRST = "<think>\nI will write the file.\n</think>\n\n" + hermes("exec", {"input": EXEC_SCRIPT})
LAST = "Created hello.txt."
# With an older model name Codex sends classic function tools and expects function_call items.
FUNCTION_CALL = hermes("exec_command", {"cmd": "printf hi > hello.txt"})


@pytest.fixture(scope="module")
def codex() -> Path:
    assert CODEX.exists(), f"Codex is not installed at {CODEX}: run scripts/install_clients.sh"
    return CODEX


@pytest.fixture(scope="module")
def ws_proxy(
    stub: StubPolicy, confdir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Proxy]:
    proxy = start_proxy(stub.url, tmp_path_factory.mktemp("codex-ws") / "out", confdir)
    yield proxy
    proxy.stop()


@pytest.fixture(scope="module")
def http_proxy(
    stub: StubPolicy, confdir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Proxy]:
    out = tmp_path_factory.mktemp("codex-http") / "out"
    proxy = start_proxy(stub.url, out, confdir, extra=WEBSOCKET_OFF)
    yield proxy
    proxy.stop()


def run_codex(
    codex: Path,
    proxy: Proxy,
    session: str,
    workdir: Path,
    prompt: str,
    timeout: float = 240,
    extra: tuple[str, ...] = (),
) -> subprocess.CompletedProcess[str]:
    home = workdir.parent / f"{workdir.name}-codex-home"
    home.mkdir(exist_ok=True)
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "CODEX_HOME": str(home),
        "OPENAI_API_KEY": "sk-agenttap-codex-test-key",
        "HTTPS_PROXY": f"http://{session}:x@127.0.0.1:{proxy.port}",
        "SSL_CERT_FILE": str(proxy.ca),
    }
    return subprocess.run(
        [
            str(codex),
            "exec",
            "--skip-git-repo-check",
            "--dangerously-bypass-approvals-and-sandbox",
            "--json",
            *extra,
            prompt,
        ],
        cwd=workdir,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def events_of(done: subprocess.CompletedProcess[str]) -> list[dict[str, Any]]:
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def check_file_task(
    done: subprocess.CompletedProcess[str],
    workdir: Path,
    proxy: Proxy,
    session: str,
    tok: Any,
    stub: StubPolicy,
    first_request: int,
    first_text: str = FIRST,
    tool_name: str = "exec",
) -> None:
    assert done.returncode == 0, done.stdout + done.stderr
    assert (workdir / "hello.txt").read_text() == "hi"
    events = events_of(done)
    assert events[-1]["type"] == "turn.completed", done.stdout
    assert any(
        e.get("item", {}).get("type") == "agent_message" and e["item"]["text"] == LAST
        for e in events
    )
    turns = proxy.turns(session, expect=2)
    assert len(turns) == 2 == len(stub.requests) - first_request
    assert [t["protocol"] for t in turns] == ["openai.responses"] * 2
    assert [json.loads(t["metadata"])["assembly"] for t in turns] == ["new", "extend"]
    first, second = turns
    sampled = list(tok.encode(first_text, add_special_tokens=False)) + [IM_END]
    assert first["completion_ids"] == sampled
    # Call 2 is call 1's prompt + the sampled ids (its reasoning came back as our encrypted
    # token, its call with Codex's metadata added) + the tool's output: nothing re-rendered.
    assert second["prompt_ids"][: len(first["prompt_ids"]) + len(sampled)] == (
        first["prompt_ids"] + sampled
    )
    assert "<tool_response>" in tok.decode(second["prompt_ids"][len(first["prompt_ids"]) :])
    assert first["user_agent"].startswith("codex_exec/")
    prompt = tok.decode(first["prompt_ids"])
    assert f'"name": "{tool_name}"' in prompt and "Create hello.txt containing hi" in prompt
    threads = proxy.threads(session, expect=1)
    assert len(threads) == 1 and threads[0]["num_turns"] == 2


def test_codex_writes_a_file_over_websocket(
    codex: Path, ws_proxy: Proxy, stub: StubPolicy, tok: Any, tmp_path: Path
) -> None:
    workdir = tmp_path / "work"
    workdir.mkdir()
    stub.replies.clear()
    stub.script(FIRST, LAST)
    n = len(stub.requests)
    done = run_codex(codex, ws_proxy, "codex-ws", workdir, "Create hello.txt containing hi")
    check_file_task(done, workdir, ws_proxy, "codex-ws", tok, stub, n)
    log = ws_proxy.log.read_text(errors="replace")
    assert "101 Switching Protocols" in log
    assert "POST https://api.openai.com/v1/responses" not in log  # no fallback to HTTP

    # A new Codex process resumes the conversation on a new connection: it sends the whole
    # history, which still extends the exact ids of the written thread.
    stub.script("Bye.")
    resumed = run_codex(
        codex, ws_proxy, "codex-ws", workdir, "Now say bye", extra=("resume", "--last")
    )
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    turns = ws_proxy.turns("codex-ws", expect=3)
    assert len(turns) == 3
    assert json.loads(turns[2]["metadata"])["assembly"] == "extend"
    second = turns[1]
    assert turns[2]["prompt_ids"][: len(second["prompt_ids"]) + len(second["completion_ids"])] == (
        second["prompt_ids"] + second["completion_ids"]
    )


def test_codex_writes_a_file_over_http(
    codex: Path, http_proxy: Proxy, stub: StubPolicy, tok: Any, tmp_path: Path
) -> None:
    workdir = tmp_path / "work"
    workdir.mkdir()
    stub.replies.clear()
    stub.script(FIRST, LAST)
    n = len(stub.requests)
    done = run_codex(codex, http_proxy, "codex-http", workdir, "Create hello.txt containing hi")
    check_file_task(done, workdir, http_proxy, "codex-http", tok, stub, n)
    log = http_proxy.log.read_text(errors="replace")
    assert "101 Switching Protocols" not in log
    # The upgrade was refused with 426 once, and Codex went straight to HTTP.
    assert log.count("<< 426") == 1, log[-3000:]
    assert log.count("POST https://api.openai.com/v1/responses") == 2


def test_codex_with_function_tools(
    codex: Path, ws_proxy: Proxy, stub: StubPolicy, tok: Any, tmp_path: Path
) -> None:
    """``-m gpt-5-codex``: top-level function tools, answered with a function_call."""
    workdir = tmp_path / "work"
    workdir.mkdir()
    stub.replies.clear()
    stub.script(FUNCTION_CALL, LAST)
    n = len(stub.requests)
    done = run_codex(
        codex, ws_proxy, "codex-fn", workdir, "Create hello.txt containing hi",
        extra=("-m", "gpt-5-codex"),
    )  # fmt: skip
    check_file_task(
        done, workdir, ws_proxy, "codex-fn", tok, stub, n, FUNCTION_CALL, "exec_command"
    )
    assert [t["requested_model"] for t in ws_proxy.turns("codex-fn", expect=2)] == [
        "gpt-5-codex"
    ] * 2


@pytest.mark.vllm
def test_codex_against_the_real_policy(
    codex: Path, vllm_proxy: Proxy, vllm_url: str, tmp_path: Path
) -> None:
    workdir = tmp_path / "work"
    workdir.mkdir()
    session = "codex-vllm"
    done = run_codex(codex, vllm_proxy, session, workdir, "Say hello.")
    # The random policy writes text (or something that parses as text): Codex ends cleanly.
    assert done.returncode == 0, done.stdout + done.stderr
    assert events_of(done)[-1]["type"] == "turn.completed", done.stdout
    turns = vllm_proxy.turns(session, expect=1, timeout=60)
    rows = vllm_proxy.threads(session)
    assert rows and turns
    for row in rows:
        # Codex's prompt is ~15k tokens: fp32 at long context, see _assert_exact.
        assert _assert_exact(row, turns, vllm_url, tolerance=1e-5) <= 1e-5


def test_recorded_codex_traffic_replays_offline(
    codex: Path, stub: StubPolicy, confdir: Path, tmp_path: Path
) -> None:
    """Codex's HTTP traffic, recorded once, replayed through the addon with no Codex and no
    network: the same threads come out."""
    workdir = tmp_path / "work"
    workdir.mkdir()
    flow_file, live, replayed = tmp_path / "codex.flows", tmp_path / "live", tmp_path / "replayed"
    session = "codex-replay"
    stub.replies.clear()
    stub.script(FIRST, LAST)
    with recording(stub.url, live, confdir, flow_file, extra=WEBSOCKET_OFF) as proxy:
        done = run_codex(codex, proxy, session, workdir, "Create hello.txt containing hi")
    assert done.returncode == 0, done.stdout + done.stderr
    assert (workdir / "hello.txt").read_text() == "hi"
    flows = read_flows(flow_file)
    posts = [f for f in flows if f.request.method == "POST"]
    assert [f.request.path for f in posts] == ["/v1/responses"] * 2
    assert all(f.request.host == "api.openai.com" for f in flows)

    replies = recorded_replies(live, session)
    assert replies == [FIRST, LAST]
    stub.replies.clear()
    stub.script(*replies)
    replay = replay_flows(flow_file, stub.url, replayed, confdir, extra=WEBSOCKET_OFF)
    assert replay.returncode == 0, replay.log[-4000:]
    assert replay.dials and all(d.startswith("loopback 127.0.0.1:") for d in replay.dials)
    assert not stub.replies, "not every recorded call was replayed"
    want, got = thread_signatures(live, session), thread_signatures(replayed, session)
    assert len(want) == 1 and want[0]["num_turns"] == 2
    assert got == want
