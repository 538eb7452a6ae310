"""Issue 18: what the proxy's log shows. One ``agenttap call:`` line per policy call (and one
``agenttap call failed:`` line per failed one), not a line per WebSocket message: mitmproxy's
dumper prints those only from ``flow_detail=3`` on. At start, the banner, then one
``agenttap ready:`` line once the listeners accept connections, and no transformers notice."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import ssl
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.proxies import Proxy, start_proxy
from tests.support.stub_vllm import StubPolicy

CALL = re.compile(
    r"agenttap call: session=(\S+) (\S+) (\S+) (\d+)\+(\d+) tokens (\S+) (\d+\.\d\d) s via (\S+)"
)
WS_MESSAGE = "WebSocket text message"


@pytest.fixture(scope="module")
def quiet_proxy(
    stub: StubPolicy, confdir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Proxy]:
    """At mitmdump's default flow_detail (1)."""
    proxy = start_proxy(stub.url, tmp_path_factory.mktemp("call-log") / "out", confdir)
    yield proxy
    proxy.stop()


def _log(proxy: Proxy) -> str:
    return proxy.log.read_text(errors="replace")


def _lines(proxy: Proxy, session: str, pattern: re.Pattern[str] = CALL) -> list[re.Match[str]]:
    found = (pattern.search(line) for line in _log(proxy).splitlines())
    return [m for m in found if m and m.group(1) == session]


def _wait_lines(proxy: Proxy, session: str, n: int) -> list[re.Match[str]]:
    deadline = time.monotonic() + 10
    while len(found := _lines(proxy, session)) < n and time.monotonic() < deadline:
        time.sleep(0.1)
    return found


def _websocket_conversation(proxy: Proxy, session: str) -> list[str]:
    """Codex's way: a warm-up (no policy call), then two turns on one connection; the ids of
    the two responses."""
    import aiohttp

    async def converse() -> list[str]:
        context = ssl.create_default_context(cafile=str(proxy.ca))
        ids: list[str] = []
        async with aiohttp.ClientSession() as http:
            async with http.ws_connect(
                "wss://api.openai.com/v1/responses",
                proxy=f"http://{session}:x@127.0.0.1:{proxy.port}",
                ssl=context,
            ) as ws:
                previous = None
                for message in (
                    {"input": None, "generate": False},
                    {"input": "Hello?"},
                    {"input": "And again?"},
                ):
                    body: dict[str, Any] = {"type": "response.create", "model": "gpt-5"}
                    body.update(message, store=False, previous_response_id=previous)
                    await ws.send_str(json.dumps(body))
                    while True:
                        event = json.loads(await ws.receive_str(timeout=30))
                        if event["type"] in ("response.completed", "error", "response.failed"):
                            break
                    assert event["type"] == "response.completed", event
                    previous = event["response"]["id"]
                    if message.get("generate") is not False:
                        ids.append(previous)
        return ids

    return asyncio.run(converse())


def test_one_line_per_websocket_call_and_no_message_lines(
    quiet_proxy: Proxy, stub: StubPolicy
) -> None:
    n = len(stub.requests)
    ids = _websocket_conversation(quiet_proxy, "log-ws")
    calls = _wait_lines(quiet_proxy, "log-ws", 2)
    assert [m.group(3) for m in calls] == ids, calls
    for call, request in zip(calls, stub.requests[n:], strict=True):
        _, protocol, _, prompt, sampled, finish, latency, backend = call.groups()
        assert protocol == "openai.responses"
        assert int(prompt) == len(request["prompt"]) and int(sampled) > 0
        assert finish == "stop" and float(latency) < 30 and backend == stub.url
    log = _log(quiet_proxy)
    # Dozens of WebSocket messages went by; none has a line of its own.
    assert WS_MESSAGE not in log and "WebSocket binary message" not in log, log[-3000:]


def test_one_line_per_http_call_and_per_failed_call(
    quiet_proxy: Proxy, stub: StubPolicy, monkeypatch: pytest.MonkeyPatch
) -> None:
    import openai

    client = quiet_proxy.openai("log-http", monkeypatch)
    answer = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Hi"}], max_tokens=8, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in answer if c.choices)
    (call,) = _wait_lines(quiet_proxy, "log-http", 1)
    assert call.group(2) == "openai.chat" and call.group(3).startswith("chatcmpl-")

    stub.fault, stub.fault_after = "garbage", 0
    try:
        with pytest.raises(openai.APIStatusError):
            client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "Hi"}], max_tokens=8
            )
    finally:
        stub.fault, stub.fault_after, stub.garbage = None, 0, b"{not json"
    failed = re.compile(r"agenttap call failed: session=(\S+) openai\.chat \S+ \d+\+0 tokens")
    deadline = time.monotonic() + 10
    while not _lines(quiet_proxy, "log-http", failed) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(_lines(quiet_proxy, "log-http", failed)) == 1, _log(quiet_proxy)[-3000:]
    assert len(_lines(quiet_proxy, "log-http")) == 1  # the failure is no `agenttap call:` line


def test_websocket_messages_are_printed_at_flow_detail_3(
    stub: StubPolicy, confdir: Path, tmp_path: Path
) -> None:
    proxy = start_proxy(stub.url, tmp_path / "out", confdir, extra=["--set", "flow_detail=3"])
    try:
        ids = _websocket_conversation(proxy, "log-ws-loud")
        assert [m.group(3) for m in _wait_lines(proxy, "log-ws-loud", 2)] == ids
        log = _log(proxy)
        # Each response.create and each event answering it: a line and the message's text.
        assert log.count(WS_MESSAGE) >= 3 + 2 * 4, log[-3000:]
        assert '"response.output_text.delta"' in log
    finally:
        proxy.stop()


def test_start_up_ends_with_one_ready_line_once_the_listeners_accept(quiet_proxy: Proxy) -> None:
    lines = [line.split("] ", 1)[-1] for line in _log(quiet_proxy).splitlines()]
    (ready,) = [i for i, line in enumerate(lines) if line.startswith("agenttap ready:")]
    assert lines[ready] == (
        f"agenttap ready: proxy http://127.0.0.1:{quiet_proxy.port} answering api.anthropic.com, "
        f"api.openai.com, generativelanguage.googleapis.com from {_policy(lines)}"
    )
    listening = lines.index(f"HTTP(S) proxy listening at 127.0.0.1:{quiet_proxy.port}.")
    banner = [i for i, line in enumerate(lines) if line.startswith("AGENTTAP_")]
    exports = [i for i, line in enumerate(lines) if line.strip().startswith("export ")]
    assert banner and exports and listening < min(banner) and max(banner + exports) < ready
    # Nothing of the start-up comes after it.
    startup = ("AGENTTAP_", "agenttap: answering", "HTTP(S) proxy listening", "Proxy mode")
    assert not [line for line in lines[ready + 1 :] if line.strip().startswith(startup)]
    assert not [line for line in lines[ready + 1 :] if line.strip().startswith("export ")]
    assert not any("PyTorch was not found" in line for line in lines)
    # The start-up check's own connections left no line.
    assert not any("client connect" in line for line in lines[: ready + 1])
    # Per client family: the CA each reads, and a key.
    text = "\n".join(lines)
    assert re.search(r"export HTTPS_PROXY=\S+ NODE_EXTRA_CA_CERTS=\S+ ANTHROPIC_API_KEY=", text)
    assert re.search(r"export HTTPS_PROXY=\S+ SSL_CERT_FILE=\S+agenttap-ca-bundle\.pem ", text)
    with socket.create_connection(("127.0.0.1", quiet_proxy.port), timeout=5):
        pass


def _policy(lines: list[str]) -> str:
    found = [line for line in lines if line.startswith("agenttap: answering")]
    match = re.search(r" from (\S+);", found[0])
    assert match, found
    return match.group(1)
