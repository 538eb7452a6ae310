"""Each kernel limit of a rollout (capture/isolation/: a cgroup per run, a size-capped
tmpfs, rlimits, its output kept to a cap) ends the rollout that goes past it, with
``finish_reason`` "limit" naming which, while an honest rollout beside them finishes ``ok``.
Real mitmdump, real bwrap, real processes that go past each limit."""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from capture.client.launcher import AgentTap

# One model call through the session's proxy (no SDK: its import would dominate the time).
HONEST = r"""
import base64, http.client, json, os, ssl, urllib.parse
proxy = urllib.parse.urlsplit(os.environ["HTTPS_PROXY"])
auth = base64.b64encode(f"{proxy.username}:{proxy.password}".encode()).decode()
context = ssl.create_default_context(cafile=os.environ["SSL_CERT_FILE"])
conn = http.client.HTTPSConnection(proxy.hostname, proxy.port, context=context, timeout=60)
conn.set_tunnel("api.openai.com", 443, headers={"Proxy-Authorization": f"Basic {auth}"})
body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8})
conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json",
             "Authorization": "Bearer " + os.environ["OPENAI_API_KEY"]})
print(conn.getresponse().status)
"""
# What goes past each limit (each set far below what it does).
HOGS: dict[str, tuple[dict[str, Any], str]] = {
    "memory": ({"memory_mb": 128}, "x = bytearray(1 << 30)\nx[::4096] = b'1' * len(x[::4096])"),
    "pids": (
        {"pids": 32},
        "import os, time\nfor _ in range(200):\n    try:\n        if os.fork() == 0:\n"
        "            time.sleep(30)\n            os._exit(0)\n    except OSError:\n        pass\n"
        "time.sleep(30)",
    ),
    "disk": (
        {"disk_mb": 16},
        "import os\nwith open(os.path.join(os.environ['TMPDIR'], 'big'), 'wb') as f:\n"
        "    for _ in range(64):\n        f.write(b'0' * (1 << 20))",
    ),
    "cpu_s": ({"cpu_s": 1}, "while True:\n    pass"),
    "output": (
        {"output_mb": 1},
        "import sys\nfor _ in range(8):\n    sys.stdout.write('y' * (1 << 20))",
    ),
}


# What each rollout here asks beside the limit it tests. Six at once with the defaults (4096
# MiB + a 2048 MiB tmpfs each) would be promised 36 GiB, more than this host lends rollouts
# (agenttap_rollout_memory_mb): the last ones would be refused, as they ask not to wait.
MODEST = {"memory_mb": 512, "disk_mb": 128}


def start(tap: AgentTap, script: str, limits: dict[str, Any], rid: str) -> None:
    body = {
        "agent": {"command": [sys.executable, "-c", script]},
        "prompt": "go",
        "limits": {**MODEST, **limits},
        "id": rid,
        "wait": False,
        "timeout_s": 120,
    }
    tap.client.request("POST", "/rollouts", body)


def wait_done(tap: AgentTap, rid: str, timeout: float = 180.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = tap.client.get(f"/rollouts/{rid}")
        if got["status"] == "done":
            return dict(got["rollouts"][0])
        time.sleep(0.2)
    raise AssertionError(f"rollout {rid} did not end in {timeout:g} s")


def test_each_limit_ends_its_rollout_and_an_honest_one_finishes(stub_tap: AgentTap) -> None:
    solo_start = time.monotonic()
    start(stub_tap, HONEST, {}, "honest-alone")
    alone = wait_done(stub_tap, "honest-alone")
    solo_s = time.monotonic() - solo_start
    assert alone["status"] == "ok", alone
    for name, (limits, script) in HOGS.items():
        start(stub_tap, script, limits, f"hog-{name}")
    honest_start = time.monotonic()
    start(stub_tap, HONEST, {}, "honest-beside")
    honest = wait_done(stub_tap, "honest-beside")
    beside_s = time.monotonic() - honest_start
    ended = {name: wait_done(stub_tap, f"hog-{name}") for name in HOGS}
    # The honest rollout beside them: its call answered, scored ok, not slowed to a crawl.
    assert honest["status"] == "ok" and honest["limit"] is None, honest
    assert honest["agent_output"].strip() == "200"
    assert beside_s < max(10 * solo_s, 15.0), (beside_s, solo_s)
    for name, run in ended.items():
        assert run["status"] == "error" and run["finish_reason"] == "limit", (name, run)
        assert run["limit"] == name, (name, run["limit"], run["error"])
        key = next(iter(HOGS[name][0]))
        assert f"limits.{key}" in run["error"], run["error"]
    # The output limit kept the log bounded, its head and its tail.
    assert len(ended["output"]["agent_output"]) <= 4000
    assert ended["memory"]["usage"]["agent"]["memory_peak_bytes"] <= 140 * (1 << 20)
    # The proxy is untouched: it answers, and serves a new session.
    assert stub_tap.client.get("/healthz")
    start(stub_tap, HONEST, {}, "honest-after")
    assert wait_done(stub_tap, "honest-after")["status"] == "ok"


def test_bad_limits_are_refused_with_the_known_keys(stub_tap: AgentTap) -> None:
    for limits, words in (
        ({"memory_gb": 1}, "memory_mb"),
        ({"pids": 0}, "limits.pids"),
        ({"cpu_s": "a lot"}, "limits.cpu_s"),
    ):
        body = {"agent": {"command": ["true"]}, "prompt": "x", "limits": limits}
        try:
            stub_tap.client.request("POST", "/rollouts", body)
        except Exception as exc:  # AgentTapError: the 400 and its words
            assert "400" in str(exc) and words in str(exc), str(exc)
        else:
            raise AssertionError(json.dumps(limits))
