"""A sandbox's bridge is a budget and a binding (issue 47, items 4 and 5): real rollouts (the
launcher's mitmdump, the real ``bwrap``, the stub policy) whose agent (tests/support/
bridge_agent.py) floods its own ``/.agenttap/proxy.sock``, or calls under session names not its
own, through the proxy and the base URL.

- A flood of 3,000 connections from inside a rollout: past ``agenttap_rollout_max_connections``
  the host closes them unrelayed; mitmdump's descriptors stay bounded, another session's calls
  all answer meanwhile, the log says so in a bounded number of lines; once the flood is gone,
  the flooding agent's own call answers (the control).
- A never-opened name and another session's opened name (with that session's own secret!),
  from inside a rollout: the provider's 401 in its own format (Anthropic, OpenAI, Gemini),
  through the proxy and the base URL, and nothing recorded under either; the agent's own calls
  answer (the control)."""

from __future__ import annotations

import json
import os
import ssl
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from capture.client.launcher import AgentTap
from capture.storage.reader import load_threads
from tests.support.paths import QWEN3
from tests.support.stub_vllm import StubPolicy

AGENT = Path(__file__).resolve().parents[2] / "support" / "bridge_agent.py"
MAX_CONNECTIONS = 64
FLOOD = 3000
# Descriptors a relayed connection holds in mitmdump (capture/isolation/budget.py), and room for
# what the proxy opens of its own meanwhile (the bystander's calls, the policy's pool).
FDS_PER_CONNECTION = 5
SLACK = 200


@pytest.fixture(scope="module")
def tap(
    stub: StubPolicy, confdir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[AgentTap]:
    options = {"agenttap_rollout_max_connections": str(MAX_CONNECTIONS)}
    with AgentTap.start(
        stub.url, QWEN3, tmp_path_factory.mktemp("bridge") / "out", confdir=confdir,
        options=options,
    ) as instance:  # fmt: skip
        yield instance


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def wait_for(check: Any, what: str, timeout_s: float = 120.0) -> Any:
    """Poll ``check`` (a file the agent writes, a state the API reports) until it is truthy."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(0.05)
    raise AssertionError(f"{what} did not happen within {timeout_s:g} s")


def bystander_call(tap: AgentTap, env: dict[str, str]) -> int:
    """One call of a session the trainer opened, through the proxy, from the host."""
    verify = ssl.create_default_context(cafile=env["SSL_CERT_FILE"])
    with httpx.Client(proxy=env["HTTPS_PROXY"], verify=verify, timeout=30) as c:
        answer = c.post(
            "https://api.openai.com/v1/chat/completions",
            json={"model": "m", "messages": [{"role": "user", "content": "bystander"}]},
        )
    return answer.status_code


def test_a_flood_of_connections_is_refused_past_the_budget(tap: AgentTap) -> None:
    bystander = tap.open_session(id="bystander")
    pid = tap.proc.pid
    fds_before = open_fds(pid)
    log_before = tap.log.read_text(errors="replace").count("\n")
    # The agent waits for "release" in its workdir (the host writes it there: the test's cue).
    task = {"mode": "flood", "flood": FLOOD, "allowed": MAX_CONNECTIONS, "release": "release"}
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(
            tap.rollout,
            {"command": [sys.executable, str(AGENT)]},
            json.dumps(task),
            id="flood",
            timeout_s=300,
            verifier=["sh", "-c", "echo 1"],
            rows=False,
        )
        work = wait_for(lambda: _workdir(tap, "flood"), "the flood rollout's start")
        try:
            flooding = json.loads(
                wait_for(lambda: _read(work / "flooding.json"), "the flood", timeout_s=180)
            )
            # While the flood is held: mitmdump's descriptors bounded, the bystander served.
            fds_during = open_fds(pid)
            statuses = [bystander_call(tap, bystander.env) for _ in range(20)]
        finally:
            (work / "release").write_text("go")
        result = running.result(timeout=300)
    (run,) = result["rollouts"]
    assert flooding["held"] == FLOOD and flooding["connect_errors"] == 0, flooding
    # Every connection past the budget was closed by the host, unrelayed; the budget's worth
    # stayed open (relayed to the proxy, idle).
    assert flooding["open"] == MAX_CONNECTIONS, flooding
    assert flooding["closed_by_host"] == flooding["held"] - MAX_CONNECTIONS, flooding
    assert run["usage"]["bridge"]["connections_peak"] == MAX_CONNECTIONS, run["usage"]
    assert run["usage"]["bridge"]["connections_refused"] >= FLOOD - MAX_CONNECTIONS - 1
    assert fds_during < fds_before + MAX_CONNECTIONS * FDS_PER_CONNECTION + SLACK, (
        fds_before, fds_during,
    )  # fmt: skip
    assert statuses == [200] * 20, statuses
    # The control: once the flood is gone, the flooding agent's own call answers.
    report = json.loads((Path(run["workdir"]) / "report.json").read_text())
    assert report["own_after_flood"]["status"] == 200, report
    assert run["status"] == "ok" and run["reward"] == 1.0, run
    # The log: a bounded number of lines about it, no EMFILE anywhere.
    log = tap.log.read_text(errors="replace")
    new_lines = log.splitlines()[log_before:]
    about = [line for line in new_lines if "flood-0" in line and "connection" in line]
    assert 1 <= len(about) <= 5, about
    assert "Too many open files" not in log and "EMFILE" not in log
    # Beyond mitmproxy's line per relayed connection's start and end (the budget's worth and
    # the bystander's), a few lines: nothing grows with the flood.
    rest = [line for line in new_lines if "client connect" not in line
            and "client disconnect" not in line]  # fmt: skip
    assert len(rest) < 100, rest[:200]
    assert len(new_lines) < 2 * (MAX_CONNECTIONS + 100) + 100, len(new_lines)


def test_calls_under_names_not_its_own_are_refused(tap: AgentTap) -> None:
    victim = tap.open_session(id="victim-bound")
    ghost = "ghost-never-opened"
    task = {
        "mode": "names", "api": tap.api_url, "ghost": ghost, "victim": victim.id,
        "victim_secret": victim.api_key,
    }  # fmt: skip
    result = tap.rollout(
        {"command": [sys.executable, str(AGENT)]},
        json.dumps(task),
        id="names",
        verifier=["sh", "-c", "echo 1"],
    )
    (run,) = result["rollouts"]
    report = json.loads((Path(run["workdir"]) / "report.json").read_text())
    for route in ("proxy", "base"):
        # The control: its own session's calls answer, in each format.
        for provider in ("anthropic", "openai", "gemini"):
            assert report[f"own_{route}_{provider}"]["status"] == 200, (route, provider, report)
        # Any other name, opened or not, with its secret or not: the provider's 401.
        for who in ("ghost", "victim"):
            anthropic = report[f"{who}_{route}_anthropic"]
            assert anthropic["status"] == 401, (who, route, anthropic)
            assert anthropic["body"]["type"] == "error", anthropic
            assert anthropic["body"]["error"]["type"] == "authentication_error", anthropic
            openai = report[f"{who}_{route}_openai"]
            assert openai["status"] == 401 and "message" in openai["body"]["error"], openai
            gemini = report[f"{who}_{route}_gemini"]
            assert gemini["status"] == 401, gemini
            assert gemini["body"]["error"]["status"] == "UNAUTHENTICATED", gemini
    message = report["victim_proxy_anthropic"]["body"]["error"]["message"]
    assert "rollout session 'names-0'" in message and "only as itself" in message, message
    # Its own calls are its session's: 6 answered (3 formats x 2 routes).
    assert run["metrics"]["calls"] == 6, run["metrics"]
    assert {r["session_id"] for r in run["rows"]} == {run["session_id"]}
    # Nothing recorded under either name: no calls, no rows, no journal, no session.
    summary = tap.client.get(f"/sessions/{victim.id}")
    assert summary["metrics"]["calls"] == 0 and summary["metrics"]["refused"] == 0, summary
    assert summary["rows"] == [] and not summary["closed"]
    assert ghost not in {s["id"] for s in tap.sessions()}
    tap.flush()
    assert not [r for r in load_threads(tap.out) if r["session_id"] in (ghost, victim.id)]
    assert not [p for p in tap.out.rglob("*") if ghost in p.name or victim.id in p.name]


def _workdir(tap: AgentTap, rollout_id: str) -> Path | None:
    try:
        answer = tap.client.get(f"/rollouts/{rollout_id}")
    except Exception:  # not started yet
        return None
    runs = answer.get("rollouts") or []
    return Path(runs[0]["workdir"]) if runs and runs[0]["status"] == "running" else None


def _read(path: Path) -> str | None:
    try:
        text = path.read_text()
    except OSError:
        return None
    return text if text.endswith("}") else None
