"""Admission by resources (issue 47): limits that promise more memory than the host has do not
all start: an agent waits (``pending``) until its memory fits. Real agenttap under mitmdump, real sandboxed agents; the budget is the default, 80%
of this host's MemTotal, read here the same way."""

from __future__ import annotations

import json
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from capture.client.launcher import AgentTap, AgentTapError
from capture.rollouts.admission import default_budget_mb

PYTHON = str(Path(sys.prefix).resolve() / "bin" / "python")
DISK_MB = 256


def post(tap: AgentTap, body: dict[str, Any]) -> tuple[int, dict[str, Any], str | None]:
    """The raw answer: status, JSON, Retry-After."""
    req = urllib.request.Request(
        tap.api_url + "/rollouts", data=json.dumps(body).encode(), method="POST",
        headers={"Authorization": f"Bearer {tap.token}", "Content-Type": "application/json"},
    )  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, json.loads(resp.read()), resp.headers.get("Retry-After")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read()), exc.headers.get("Retry-After")


def waiting_agent(tmp_path: Path, release: Path) -> dict[str, Any]:
    """An agent that holds its run until ``release`` exists (the test's signal), then exits."""
    script = (
        "import os, sys, time\n"
        f"deadline = time.monotonic() + 120\n"
        f"while not os.path.exists({str(release)!r}) and time.monotonic() < deadline:\n"
        "    time.sleep(0.05)\n"
    )
    return {"command": [PYTHON, "-c", script]}


def test_rollouts_past_the_hosts_memory_wait_or_are_refused(
    stub_tap: AgentTap, tmp_path: Path
) -> None:
    budget = default_budget_mb()
    release = tmp_path / "release"
    # One agent bigger than the whole budget: refused at once, whatever "wait" says.
    huge = {"agent": {"command": ["true"]}, "prompt": "x", "sandbox": "none",
            "limits": {"memory_mb": budget, "disk_mb": DISK_MB}}  # fmt: skip
    status, answer, _ = post(stub_tap, huge)
    assert status == 400 and "agenttap_rollout_memory_mb" in answer["error"]["message"], answer
    # One that holds most of it, running (the agent waits for the test's signal).
    holder_mb = budget - 1024 - DISK_MB
    holder = {"agent": waiting_agent(tmp_path, release), "prompt": "x", "sandbox": "none",
              "limits": {"memory_mb": holder_mb, "disk_mb": DISK_MB}, "wait": False,
              "id": "memory-holder"}  # fmt: skip
    status, answer, _ = post(stub_tap, holder)
    assert status == 202, answer
    # A second that does not fit beside it, asking not to wait: 429, Retry-After.
    second = {"agent": {"command": ["true"]}, "prompt": "x", "sandbox": "none",
              "limits": {"memory_mb": 2048, "disk_mb": DISK_MB}, "wait": False,
              "id": "memory-second"}  # fmt: skip
    status, answer, retry = post(stub_tap, second)
    assert status == 429 and retry is not None, answer
    assert "agenttap_rollout_memory_mb" in answer["error"]["message"]
    # Asking to wait: it starts once the holder's run has ended, not before.
    done: dict[str, Any] = {}

    def wait_for_it() -> None:
        try:
            done["answer"] = stub_tap.client.request(
                "POST", "/rollouts", {**second, "wait": True, "id": "memory-waited"},
                timeout=None,
            )[0]  # fmt: skip
        except AgentTapError as exc:
            done["error"] = exc

    waiter = threading.Thread(target=wait_for_it)
    waiter.start()
    # It waits: its agent is pending while the holder runs.
    deadline = time.monotonic() + 2
    seen = None
    while time.monotonic() < deadline or seen is None:
        assert stub_tap.client.get("/rollouts/memory-holder")["status"] == "running"
        assert time.monotonic() < deadline + 60, "the waiting rollout never appeared"
        try:
            seen = stub_tap.client.get("/rollouts/memory-waited")
        except AgentTapError:  # not created yet
            time.sleep(0.05)
            continue
        assert [r["status"] for r in seen["rollouts"]] == ["pending"], seen
        time.sleep(0.2)
    release.touch()
    waiter.join(120)
    assert "error" not in done, done
    assert done["answer"]["id"] == "memory-waited" and done["answer"]["status"] == "done"
