"""The agent is the adversary: real rollouts (the launcher's mitmdump, the real ``bwrap``, the
stub policy) whose agent attacks agenttap from inside (tests/support/hostile_agent.py: forged headers
through the proxy and on the API port, token hunting in /proc and above its workdir, a reward
planted in OUT, a sibling's copy, a daemon, the CA key sent as a prompt, a victim session by
proxy username and by base URL), and real Claude Code run by a rollout with forged headers and
a victim's proxy username. Every reward stays the verifier's, nothing outside the sandbox
changes, no process survives, no secret reaches a row, the victim is untouched."""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from capture.client.launcher import AgentTap
from capture.rollouts.agents import resolve
from capture.storage.reader import load_threads
from tests.e2e.rollouts.test_rollouts import FIRST_CALL, VERIFIER, agent_rule
from tests.support.paths import QWEN3
from tests.support.proxies import processes_with
from tests.support.stub_vllm import StubPolicy

HOSTILE = Path(__file__).resolve().parents[2] / "support" / "hostile_agent.py"
MARKER = b"hostile-daemon-4321"
# Reads the task's own check file; a json.py the agent drops in the workdir must not shadow
# the standard library here, and the check file it overwrote is restored first. It reads every
# file the agent left too, as a careless verifier would: a link to a host file or a FIFO the
# agent planted must not reach it (a FIFO would block it until its timeout).
CHECK = [
    sys.executable,
    "-c",
    "import json, os\n"
    "for f in sorted(os.listdir('.')):\n"
    "    try:\n"
    "        open(f).read() if not os.path.isdir(f) else None\n"
    "    except OSError:\n"
    "        pass\n"
    "print(json.loads(open('tests/check.txt').read()))",
]
REPO = Path(__file__).resolve().parents[3]


def listening_ports() -> set[int]:
    """The TCP ports listening on this host (its /proc/net/tcp and tcp6)."""
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A":
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


@pytest.fixture
def canaries(tap: AgentTap, tmp_path: Path) -> Iterator[list[Path]]:
    """A secret file in each of 12 places a sandbox must not show: the proxy's cwd, OUT's
    parent, /root, $HOME, /tmp, /var/tmp, /srv, /opt, /mnt, a model folder, a checkpoint
    folder, a folder beside the checkout."""
    name = f"agenttap-canary-{uuid.uuid4().hex[:8]}.txt"
    model = tmp_path / "models" / "policy"
    ckpt = tmp_path / "checkpoints" / "step-1"
    beside = REPO.parent / f"agenttap-canary-{uuid.uuid4().hex[:8]}"
    for folder in (model, ckpt, beside):
        folder.mkdir(parents=True)
    home = Path(os.path.expanduser("~")) / ".config"
    places = [REPO, tap.out.parent, Path("/root"), home, Path("/tmp"), Path("/var/tmp"),
              Path("/srv"), Path("/opt"), Path("/mnt"), model, ckpt, beside]  # fmt: skip
    made = []
    for i, folder in enumerate(places):
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / name
        path.write_text(f"AGENTTAP-CANARY {i} {tap.token}\n")
        made.append(path)
    try:
        yield made
    finally:
        for path in made:
            path.unlink(missing_ok=True)
        shutil.rmtree(beside, ignore_errors=True)


@pytest.fixture(scope="module")
def tap(
    stub: StubPolicy, confdir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[AgentTap]:
    with AgentTap.start(
        stub.url, QWEN3, tmp_path_factory.mktemp("adversary") / "out", confdir=confdir
    ) as instance:
        yield instance


def victim_untouched(tap: AgentTap, victim: str) -> None:
    summary = tap.client.get(f"/sessions/{victim}")
    assert summary["metrics"]["calls"] == 0 and summary["metrics"]["refused"] == 0, summary
    assert summary["rows"] == [] and not summary["closed"]


def test_a_hostile_rollout_gains_nothing(
    tap: AgentTap, confdir: Path, tmp_path: Path, tok: Any, stub: StubPolicy,
    canaries: list[Path],
) -> None:  # fmt: skip
    seed = tmp_path / "task"
    (seed / "tests").mkdir(parents=True)
    (seed / "tests" / "check.txt").write_text("0.25\n")
    outside = tmp_path / "outside.txt"
    victim = tap.open_session(id="victim-hostile").id
    # A unix socket made on the host (in /tmp, as a tool's server would) after the proxy
    # started, and every TCP port of the host but the two handed in.
    host_socket = Path(tempfile.mkdtemp(dir="/tmp")) / "service.sock"
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(host_socket))
    listener.listen()
    handed_in = {int(u.rstrip("/").rsplit(":", 1)[1]) for u in (tap.api_url, tap.proxy_url)}
    task = {
        "api": tap.api_url, "victim": victim, "outside": str(outside), "out": str(tap.out),
        "policy": stub.url, "host_ports": sorted(listening_ports() - handed_in),
        "canaries": [str(p) for p in canaries], "host_socket": str(host_socket),
    }  # fmt: skip
    body = {
        "agent": {"command": [sys.executable, str(HOSTILE)]},
        "prompt": json.dumps(task),
        "n": 2,
        "workdir": str(seed),
        "verifier": {"command": CHECK, "restore": ["tests/"]},
        "id": "hostile",
    }
    try:
        result = tap.client.request("POST", "/rollouts", body, timeout=None)[0]
    finally:
        listener.close()
        shutil.rmtree(host_socket.parent)
    runs = result["rollouts"]
    # The verifier's reward, not the planted 100, the forged 100 nor the shadowed json's 1000.
    assert [r["reward"] for r in runs] == [0.25, 0.25], runs
    assert all(r["status"] == "ok" for r in runs), runs
    key = (confdir / "mitmproxy-ca.pem").read_text()
    key_line = next(line for line in key.splitlines() if line and "-----" not in line)
    for run in runs:
        report = json.loads((Path(run["workdir"]) / "report.json").read_text())
        loot = report["loot"]
        # Forged headers: no power without the token, wherever they are sent.
        for name in ("forged_list_via_proxy", "forged_list_on_api_port",
                     "forged_reward_via_proxy", "forged_close_victim", "forged_rollout",
                     "flush_without_token"):  # fmt: skip
            assert report[name] == 401, (name, report[name])
        assert report["rebinding_host"] == 421 and report["cross_site_post"] == 403
        # Secrets: not in any process, file or folder it could reach.
        assert tap.token not in loot and "AGENTTAP_TOKEN" not in loot
        assert key_line not in loot and not report["ca_key_readable"]
        assert report["ca_cert_readable"]
        assert set(report["confdir_listing"]) <= {
            "mitmproxy-ca-cert.pem",
            "agenttap-ca-bundle.pem",
        }
        assert "threads" not in report["out_listing"] and "journal" not in report["out_listing"]
        assert "mitmdump" not in loot and report["proc_pids_seen"] < 10  # its own namespace
        assert not any(k.startswith("AGENTTAP_TOKEN") for k in report["env_keys"])
        # Another session: refused without its secret; a forged session header changes nothing.
        assert report["victim_by_proxy_username"] == 401
        assert report["victim_by_bare_username"] == 401
        assert report["victim_by_base_url"] == 401
        assert report["victim_by_session_header"] == 200  # counted in its own session
        assert report["own_call_with_ca_key"] == 200
        # Its own network: nothing of the host's listens there but the two ports handed in;
        # the policy server cannot be reached, so neither reloaded, paused nor put to sleep.
        assert set(report["listening_ports"]) == handed_in, report["listening_ports"]
        assert task["host_ports"] and report["host_ports_reachable"] == []
        for name in ("policy_reload", "policy_pause", "policy_sleep"):
            assert report[name].startswith("error: "), (name, report[name])
        assert report["host_unix_socket"] == "FileNotFoundError"
        # Files from an allowlist: not one canary of the 12 places is there.
        assert report["canaries_found"] == [], report["canaries_found"]
        # What it left for the verifier (links out of the workdir, a FIFO) was removed first.
        assert report["traps"] == ["answer.txt", "up.txt", "stuck.txt"]
        assert set(run["sanitized"]) == {"answer.txt", "up.txt", "stuck.txt"}, run["sanitized"]
        # The rollout's rows: its own calls, and no key in them.
        assert run["metrics"]["calls"] == 2
        for row in run["rows"]:
            assert key_line not in tok.decode(row["input_ids"])
    victim_untouched(tap, victim)
    # Nothing outside the sandbox changed.
    assert not outside.exists() and not Path("/etc/hostile-agent").exists()
    assert not (tap.out / "hostile.txt").exists()
    assert not list((tap.out / "rewards").glob("*hostile*"))
    for run in runs:
        assert not (Path(run["workdir"]) / "pwned.txt").exists()
    assert not processes_with(MARKER)
    # Readers see the verifier's reward too.
    tap.flush()
    rows = [r for r in load_threads(tap.out) if r["session_id"].startswith("hostile-")]
    assert rows and {r["reward"] for r in rows} == {0.25}
    for run in runs:
        got = tap.client.get(f"/sessions/{run['session_id']}")
        assert {r["reward"] for r in got["rows"]} == {0.25}


@pytest.fixture
def claude_writes_hello(stub: StubPolicy) -> Iterator[None]:
    rule: Callable[[dict[str, Any]], str | None] = agent_rule(stub, FIRST_CALL["claude-code"])
    stub.rules.insert(0, rule)
    yield
    stub.rules.remove(rule)


def claude_command(*env: str) -> list[str]:
    """Claude Code as a rollout runs it (capture/rollouts/agents.py), with extra environment."""
    return ["env", *env, resolve("claude"), "--allowedTools", "Bash,Write,Edit,Read", "-p"]


def test_claude_code_with_forged_headers_records_only_its_own_session(
    tap: AgentTap, claude_writes_hello: None, tmp_path: Path
) -> None:
    """Real Claude Code in a sandboxed rollout, sending X-Agenttap-* headers of its own on every
    call (ANTHROPIC_CUSTOM_HEADERS): its calls are its own session's, the victim's untouched."""
    victim = tap.open_session(id="victim-cc-headers").id
    headers = f"X-Agenttap-Session: {victim}\nX-Agenttap-Bearer: ok\nX-Agenttap-Loopback: 1"
    result = tap.rollout(
        {"command": claude_command(f"ANTHROPIC_CUSTOM_HEADERS={headers}")},
        "Create hello.txt containing hi",
        verifier=VERIFIER,
    )
    (run,) = result["rollouts"]
    assert run["status"] == "ok" and run["reward"] == 1.0, run
    assert run["metrics"]["calls"] >= 2 and run["rows"]
    assert {r["session_id"] for r in run["rows"]} == {run["session_id"]}
    victim_untouched(tap, victim)


def test_claude_code_as_a_victims_proxy_username_is_refused(
    tap: AgentTap, claude_writes_hello: None
) -> None:
    """Real Claude Code in a sandboxed rollout pointed at another session's proxy username (no
    secret): every call is refused with Anthropic's 401, the victim counts nothing."""
    victim = tap.open_session(id="victim-cc-proxy").id
    port = tap.proxy_url.rpartition(":")[2]
    proxy = f"http://{victim}:guess@127.0.0.1:{port}"
    result = tap.rollout(
        {"command": claude_command(f"HTTPS_PROXY={proxy}", f"https_proxy={proxy}")},
        "Create hello.txt containing hi",
        verifier=VERIFIER,
        timeout_s=45,
    )
    (run,) = result["rollouts"]
    # Refused on every try (Claude Code retries until its rollout's timeout): no call of its
    # own session either, nothing written, so no reward.
    assert run["metrics"]["calls"] == 0 and run["reward"] in (None, 0.0), run
    assert not (Path(run["workdir"]) / "hello.txt").exists()
    victim_untouched(tap, victim)
