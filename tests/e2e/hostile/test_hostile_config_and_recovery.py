"""Hostile input and faults (issue 10), the proxy's edges: bad options stop it and nothing is ever
forwarded; keys in the query string are stripped before anything stores them; odd usernames and
undecodable header bytes are made safe; a crash at any point of a shard write is recovered with
every row exactly once; one bad journal never stops the others or the proxy; turn indices go on
after a crash."""

from __future__ import annotations

import base64
import http.client
import json
import ssl
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from capture.storage.sessions import SessionStore
from rewriter.canonical import ChatRequest, Message
from rewriter.template import ChatTemplate
from tests.support.flows import read_flows, recording
from tests.support.paths import REPO
from tests.support.proxies import Proxy, processes_with, read_turns, record_turn
from tests.support.stub_vllm import StubPolicy

# -- 8. keys in the query string, odd usernames, undecodable header bytes --------------------


def _raw(
    proxy: Proxy,
    user: bytes,
    path: str,
    body: dict[str, Any],
    headers: dict[str, Any] | None = None,
) -> tuple[int, bytes]:
    ctx = ssl.create_default_context(cafile=str(proxy.ca))
    conn = http.client.HTTPSConnection("127.0.0.1", proxy.port, context=ctx, timeout=60)
    auth = base64.b64encode(user + b":x").decode()
    conn.set_tunnel("api.openai.com", 443, headers={"Proxy-Authorization": f"Basic {auth}"})
    conn.putrequest("POST", path)
    data = json.dumps(body).encode()
    for key, value in {
        "Content-Type": "application/json",
        "Content-Length": str(len(data)),
        **(headers or {}),
    }.items():
        conn.putheader(key, value)
    conn.endheaders(data)
    resp = conn.getresponse()
    out = resp.status, resp.read()
    conn.close()
    return out


CHAT = {"model": "gpt-4o", "messages": [{"role": "user", "content": "Hi"}]}


def test_api_keys_in_the_query_string_are_never_stored(
    stub: StubPolicy, confdir: Path, tmp_path: Path
) -> None:
    flow_file = tmp_path / "keys.flows"
    secret = "AIzaSECRET-in-the-query-0123456789"
    stub.replies.clear()
    stub.script("Hello.")
    with recording(stub.url, tmp_path / "out", confdir, flow_file) as proxy:
        status, _ = _raw(
            proxy, b"keys", f"/v1/chat/completions?key={secret}&api-key={secret}", CHAT
        )
        assert status == 200
        # A refused request (plain HTTP to a host that is not intercepted) is logged and saved
        # too: its keys go before the refusal.
        conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=60)
        conn.request(
            "GET",
            f"http://elsewhere.example/v1/models?key={secret}",
            headers={"Authorization": f"Bearer {secret}", "x-goog-api-key": secret},
        )
        refused = conn.getresponse()
        assert refused.status == 403, refused.read()
        conn.close()
        proxy.flush("keys")
    flows = read_flows(flow_file)
    (flow,) = [f for f in flows if f.request.path.startswith("/v1/chat")]
    assert "key" not in flow.request.query and "api-key" not in flow.request.query
    (other,) = [f for f in flows if f.request.pretty_host == "elsewhere.example"]
    assert other.response is not None and other.response.status_code == 403
    assert "key" not in other.request.query and "authorization" not in other.request.headers
    for path in [flow_file, *(tmp_path / "out").rglob("*"), *tmp_path.glob("*.log")]:
        if path.is_file():
            assert secret.encode() not in path.read_bytes(), path


def test_usernames_with_control_characters_and_undecodable_headers_are_made_safe(
    stub_proxy: Proxy, stub: StubPolicy
) -> None:
    stub.replies.clear()
    stub.script("One.", "Two.")
    user = b"run\r\n7\x00x"
    status, body = _raw(stub_proxy, user, "/v1/chat/completions", CHAT)
    assert status == 200, body
    # A User-Agent with bytes that are not UTF-8: recorded as replacement characters.
    status, body = _raw(
        stub_proxy, b"ua-bytes", "/v1/chat/completions", CHAT, {"User-Agent": b"agent\xff\xfe/1"}
    )
    assert status == 200, body
    turns = stub_proxy.turns("run\r\n7\x00x", expect=1)
    assert turns[0]["completion_text"] == "One."
    (row,) = stub_proxy.turns("ua-bytes", expect=1)
    assert row["user_agent"].startswith("agent") and "\ufffd" in row["user_agent"]
    assert stub_proxy.threads("ua-bytes", expect=1)[0]["user_agent"] == row["user_agent"]
    assert stub_proxy.proc.poll() is None


# -- 3. a crash at any point of a shard write: recovered, every row exactly once --------------


def _store_with_turns(root: Path, template: ChatTemplate, n: int) -> SessionStore:
    store = SessionStore(root, template)
    msgs = [Message("system", "s"), Message("user", "q0")]
    for i in range(n):
        ids = template.encode(f"answer {i}") + [template.eos_token_id]
        record_turn(store, "crash", ChatRequest(messages=list(msgs), model="m"), ids, i)
        msgs += [Message("assistant", f"answer {i}"), Message("user", f"q{i + 1}")]
    return store


def test_turn_indices_go_on_after_a_crash(qwen3_dir: Path, tmp_path: Path) -> None:
    """A session recovered from its journal and then continued does not reuse turn indices.
    (Every step of a shard write crashed: tests/unit/storage/test_hostile_recovery.py.)"""
    template = ChatTemplate(qwen3_dir)
    _store_with_turns(tmp_path, template, 6)  # never closed: as after kill -9
    restarted = SessionStore(tmp_path, template)
    restarted.recover()
    assert [t["turn_index"] for t in read_turns(tmp_path)] == list(range(6))
    assert restarted.next_turn_index("crash") == 6


def test_turn_indices_go_on_for_a_session_written_before_a_restart(
    qwen3_dir: Path, tmp_path: Path
) -> None:
    """A session whose turns were written to shards (an idle or explicit flush) before the
    proxy restarted goes on counting after the restart: its shards already hold 0..3."""
    template = ChatTemplate(qwen3_dir)
    store = _store_with_turns(tmp_path, template, 4)
    store.end_session("crash")
    assert [t["turn_index"] for t in read_turns(tmp_path)] == list(range(4))
    restarted = SessionStore(tmp_path, template)
    restarted.recover()  # nothing to recover; the shards are read for their turn indices
    assert restarted.next_turn_index("crash") == 4
    assert restarted.next_turn_index("someone-else") == 0


def test_one_bad_journal_does_not_stop_recovery_or_the_proxy(
    qwen3_dir: Path, tmp_path: Path
) -> None:
    template = ChatTemplate(qwen3_dir)
    good = _store_with_turns(tmp_path, template, 2)  # never closed: its journal is left
    bad_journal = tmp_path / "journal" / "broken-0000.jsonl"
    (good_journal,) = (tmp_path / "journal").glob("*.jsonl")
    # A well-formed line whose thread delta cannot be applied (a corrupted base). The first
    # line: it holds its prompt whole (a later one names an earlier call of its own journal).
    line = json.loads(good_journal.read_text().splitlines()[0])
    line["turn"]["session_id"] = "other"
    line["call"]["parent"] = None
    line["call"]["base"] = 10**6
    bad_journal.write_text(json.dumps(line) + "\n")
    del good
    written = SessionStore(tmp_path, template).recover()
    assert written, "the good journal was recovered"
    assert [t["request_id"] for t in read_turns(tmp_path)] == ["r0", "r1"]
    assert (tmp_path / "journal" / "broken-0000.bad").exists()
    assert not list((tmp_path / "journal").glob("*.jsonl"))


def test_damaged_lines_cost_only_themselves(qwen3_dir: Path, tmp_path: Path) -> None:
    """Lines of a journal that are damaged in other ways than a torn end (a wrong type, bytes
    that are not UTF-8, a thread placement that cannot be read) are skipped one by one: the
    journal's good calls are recovered, nothing is quarantined, recovery does not stop."""
    template = ChatTemplate(qwen3_dir)
    good = _store_with_turns(tmp_path, template, 3)  # never closed: its journal is left
    (journal,) = (tmp_path / "journal").glob("*.jsonl")
    lines = journal.read_bytes().splitlines()
    last = json.loads(lines[2])
    last["call"] = {"parent": 5}  # its placement cannot be read; the turn itself can
    damaged = [
        lines[0],
        b'{"turn": "x"}',
        b'{"turn": {"request_id": "\xff\xfe"}}',
        lines[1],
        json.dumps(last).encode(),
    ]
    journal.write_bytes(b"\n".join(damaged) + b"\n")
    del good
    written = SessionStore(tmp_path, template).recover()
    assert written
    assert [t["request_id"] for t in read_turns(tmp_path)] == ["r0", "r1", "r2"]
    assert not list((tmp_path / "journal").glob("*.bad")) and not list(
        (tmp_path / "journal").glob("*.jsonl")
    )


def test_the_proxy_starts_over_a_folder_with_a_bad_journal(
    stub: StubPolicy, confdir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.support.proxies import start_proxy

    out = tmp_path / "out"
    (out / "journal").mkdir(parents=True)
    (out / "journal" / "junk-1.jsonl").write_text(
        '{"turn": {"session_id": "\\ud800", "request_id": 5}, "call": {"parent": "nope", "base": -1}}\n'
    )
    proxy = start_proxy(stub.url, out, confdir)
    try:
        stub.replies.clear()
        stub.script("Still serving.")
        status, _ = _raw(proxy, b"after-junk", "/v1/chat/completions", CHAT)
        assert status == 200
        assert proxy.turns("after-junk", expect=1)[0]["completion_text"] == "Still serving."
    finally:
        proxy.stop()
    # The unreadable journal was dealt with (skipped or kept aside), not left to fail every start.
    assert not (out / "journal" / "junk-1.jsonl").exists()


# -- 8/9. stopping the embedded policy while vLLM starts leaves nothing running ---------------


def test_stopping_the_embedded_policy_while_vllm_starts_leaves_no_orphan(tmp_path: Path) -> None:
    import re
    import signal
    import sys

    proc = subprocess.Popen(
        [sys.executable, "-m", "policy_server", "--log", str(tmp_path / "vllm.log")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=REPO,
    )  # fmt: skip
    assert proc.stdout is not None
    line = proc.stdout.readline().decode()
    # It serves on a unix socket of its own (policy_server/launcher.py): the socket names it.
    match = re.search(r"at unix:(\S+)", line)
    assert match, line
    socket_path = match.group(1)

    def vllm_running() -> bool:
        servers = set(processes_with(b"vllm.entrypoints.openai.api_server"))
        return bool(servers & set(processes_with(socket_path.encode())))

    deadline = time.monotonic() + 60
    while not vllm_running() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert vllm_running(), "vLLM never started"
    proc.send_signal(signal.SIGTERM)  # as run_proxy.sh's trap does on Ctrl-C
    proc.wait(60)
    deadline = time.monotonic() + 30
    while vllm_running() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not vllm_running(), "the vLLM server was left running"


def test_a_tunnel_carrying_raw_bytes_is_closed_not_relayed(
    stub: StubPolicy, confdir: Path, tmp_path: Path
) -> None:
    """CONNECT api.openai.com:443, then plain bytes instead of TLS: nothing is dialed out."""
    from tests.support.proxies import start_proxy

    proxy = start_proxy(stub.url, tmp_path / "out", confdir)
    try:
        import socket

        with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as sock:
            sock.sendall(b"CONNECT api.openai.com:443 HTTP/1.1\r\nHost: api.openai.com:443\r\n\r\n")
            assert b" 200 " in sock.recv(4096)
            sock.sendall(b"\x00\x01RAW-NOT-TLS-" * 20 + b"\r\n\r\n")
            sock.settimeout(10)
            try:
                while sock.recv(4096):
                    pass
            except (TimeoutError, ConnectionResetError):
                pass
        time.sleep(0.5)  # let mitmdump write its log lines
    finally:
        proxy.stop()
    log = proxy.log.read_text(errors="replace")
    assert "not TLS or HTTP" in log
    assert "server connect api.openai.com" not in log, "a connection to the real host was opened"
    assert "api.openai.com:443 is not dialed" in log
