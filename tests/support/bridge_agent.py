"""A rollout agent that attacks its own bridge out of the sandbox (issue 47, items 4 and 5): run
by ``POST /rollouts`` as ``{"command": [python, this]}`` with the task as its last argument (JSON,
``"mode"``: ``flood`` or ``names``). Standard library only. It writes what it saw into
``report.json`` in its working directory; ``tests/e2e/hostile/test_bridge_budget.py`` judges.

- ``flood``: opens ``flood`` connections straight to ``/.agenttap/proxy.sock`` and holds them,
  counts those the host closed unrelayed, writes ``flooding.json`` (the test's cue), waits for
  the test's ``release`` file, closes them all, then makes its own honest call.
- ``names``: calls under a name nobody opened and under another session's name (with that
  session's own secret), through the proxy and the base URL, in the three providers' formats;
  and its own session's calls (the control).
"""

from __future__ import annotations

import base64
import http.client
import json
import os
import resource
import select
import socket
import ssl
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

TASK: dict[str, Any] = json.loads(sys.argv[-1])
PROXY = urlsplit(os.environ["HTTPS_PROXY"])
SESSION, SECRET = PROXY.username or "", PROXY.password or ""
report: dict[str, Any] = {"session": SESSION}
BODIES = {
    "anthropic": (
        "api.anthropic.com",
        "/v1/messages",
        {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]},
    ),
    "openai": (
        "api.openai.com",
        "/v1/chat/completions",
        {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
    ),
    "gemini": (
        "generativelanguage.googleapis.com",
        "/v1beta/models/m:generateContent",
        {"contents": [{"role": "user", "parts": [{"text": "hi"}]}]},
    ),
}
BASE_PREFIX = {"anthropic": "/anthropic", "openai": "/openai", "gemini": "/gemini"}


def answer(conn: http.client.HTTPConnection, path: str, body: Any, headers: dict[str, str]) -> Any:
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json", **headers})
    resp = conn.getresponse()
    raw = resp.read()
    try:
        parsed = json.loads(raw)
    except ValueError:
        parsed = raw.decode(errors="replace")[:500]
    return {"status": resp.status, "body": parsed}


def via_proxy(provider: str, user: str, password: str) -> Any:
    """One call through the proxy as ``user``:``password`` (empty: no password)."""
    host, path, body = BODIES[provider]
    context = ssl.create_default_context(cafile=os.environ["SSL_CERT_FILE"])
    conn = http.client.HTTPSConnection(PROXY.hostname, PROXY.port, context=context, timeout=60)
    credentials = f"{user}:{password}" if password else user
    auth = "Basic " + base64.b64encode(credentials.encode()).decode()
    conn.set_tunnel(host, 443, headers={"Proxy-Authorization": auth})
    try:
        return answer(conn, path, body, {})
    finally:
        conn.close()


def via_base_url(provider: str, session: str, key: str) -> Any:
    """One call to the API listener's base URL of ``session``, with ``key`` as its API key."""
    _, path, body = BODIES[provider]
    api = urlsplit(TASK["api"])
    conn = http.client.HTTPConnection(api.hostname, api.port, timeout=60)
    keys = {"x-api-key": key, "Authorization": f"Bearer {key}", "x-goog-api-key": key}
    try:
        return answer(conn, f"/sess/{session}{BASE_PREFIX[provider]}{path}", body, keys)
    finally:
        conn.close()


def attempt(name: str, fn: Any, *args: str) -> None:
    try:
        report[name] = fn(*args)
    except Exception as exc:  # a refusal as a closed connection is a result too
        report[name] = {"status": None, "error": f"{type(exc).__name__}: {exc}"[:300]}


def names() -> None:
    ghost, victim, victim_secret = TASK["ghost"], TASK["victim"], TASK["victim_secret"]
    for provider in BODIES:
        attempt(f"own_proxy_{provider}", via_proxy, provider, SESSION, SECRET)
        attempt(f"own_base_{provider}", via_base_url, provider, SESSION, SECRET)
        attempt(f"ghost_proxy_{provider}", via_proxy, provider, ghost, "")
        attempt(f"ghost_base_{provider}", via_base_url, provider, ghost, "sk-any")
        attempt(f"victim_proxy_{provider}", via_proxy, provider, victim, victim_secret)
        attempt(f"victim_base_{provider}", via_base_url, provider, victim, victim_secret)


def flood() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    count, allowed = int(TASK["flood"]), int(TASK["allowed"])
    held: list[socket.socket] = []
    report["connect_errors"] = 0
    for _ in range(count):
        # Blocking: a connect waits while the host's accept queue is full (a non-blocking one
        # would fail at once, and the flood would never reach the host).
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect("/.agenttap/proxy.sock")
        except OSError:
            report["connect_errors"] += 1
            sock.close()
            continue
        held.append(sock)
    # The host closes every connection past its budget at once (an EOF here); those it relays
    # stay open and idle. Wait until all but `allowed` have seen their EOF (or 60 s).
    poller = select.poll()
    by_fd = {s.fileno(): s for s in held}
    for fd in by_fd:
        poller.register(fd, select.POLLIN | select.POLLHUP)
    closed: set[int] = set()
    deadline = time.monotonic() + 60
    while len(closed) < len(held) - allowed and time.monotonic() < deadline:
        for fd, _event in poller.poll(1000):
            if fd not in closed and by_fd[fd].recv(1) == b"":
                closed.add(fd)
                poller.unregister(fd)
    report["held"] = len(held)
    report["closed_by_host"] = len(closed)
    report["open"] = len(held) - len(closed)
    Path("flooding.json").write_text(json.dumps(report))
    release = Path(TASK["release"])  # written into the workdir by the test
    deadline = time.monotonic() + 300
    while not release.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    for sock in held:
        sock.close()
    # The honest call once the flood is gone: the bridge frees the slots as it sees each close,
    # so the first tries may still find the budget full (a closed connection).
    report["tries_after_flood"] = 0
    while report["tries_after_flood"] < 100:
        report["tries_after_flood"] += 1
        attempt("own_after_flood", via_proxy, "anthropic", SESSION, SECRET)
        if report["own_after_flood"].get("status") is not None:
            break
        time.sleep(0.1)


if TASK["mode"] == "flood":
    flood()
else:
    names()
Path("report.json").write_text(json.dumps(report))
