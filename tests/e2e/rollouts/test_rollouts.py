"""Rollouts: agenttap runs the real CLIs itself (POST /rollouts, through the launcher), each in a
fresh copy of the task's workdir, scores them with a verifier, and returns the rows with the
reward and the finish reason. The policy is the stub, answering by rule: a tool call that writes
hello.txt first, then "Done." once the tool's result is in the prompt."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from capture.client.launcher import AgentTap, AgentTapError, AsyncAgentTap
from tests.e2e.clis.test_gemini_cli import answer_router
from tests.e2e.providers.test_anthropic_sdk_stub import hermes
from tests.support.paths import QWEN3
from tests.support.proxies import processes_with
from tests.support.stub_vllm import StubPolicy

WRITE_FILE = "printf hi > hello.txt"
# The verifier: 1 if the agent wrote hello.txt holding "hi", else 0 (its last line is the reward).
VERIFIER = [
    "sh",
    "-c",
    'echo checking; if [ "$(cat hello.txt 2>/dev/null)" = hi ]; then echo 1; else echo 0; fi',
]
FIRST_CALL = {
    "claude-code": hermes("Bash", {"command": WRITE_FILE, "description": "Write hello.txt"}),
    "codex": "<think>\nWrite it.\n</think>\n\n"
    + hermes(
        "exec",
        {"input": f'const r = await tools.exec_command({{cmd: "{WRITE_FILE}"}});\ntext(r.output);'},
    ),
    "gemini": hermes("run_shell_command", {"command": WRITE_FILE, "description": "write"}),
}


def agent_rule(stub: StubPolicy, first: str) -> Callable[[dict[str, Any]], str | None]:
    """The tool call until a tool's result is in the prompt, then a final answer; Gemini CLI's
    router call gets a schema-valid answer."""

    def rule(body: dict[str, Any]) -> str | None:
        routed = answer_router(body)
        if routed is not None:
            return routed
        return "Done." if "<tool_response>" in stub.tok.decode(body["prompt"]) else first

    return rule


@pytest.fixture
def scripted(stub: StubPolicy) -> Iterator[Callable[[str], None]]:
    rules: list[Any] = []

    def use(agent: str) -> None:
        rule = agent_rule(stub, FIRST_CALL[agent])
        rules.append(rule)
        stub.rules.insert(0, rule)

    yield use
    for rule in rules:
        stub.rules.remove(rule)


def agent_processes(root: Path) -> list[str]:
    """Processes of the rollout whose folder is ``root`` (OUT/rollouts/ID): an agent or its
    children, found by the ``AGENTTAP_ROLLOUT`` its environment carries (a sandbox shows its
    working folder at /workdir, so the working directory no longer names the rollout), or by a
    working directory under ``root`` (an unsandboxed run)."""
    found = []
    mark = f"AGENTTAP_ROLLOUT={root.name}".encode()
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        try:
            cwd = os.readlink(f"/proc/{pid}/cwd")
            with open(f"/proc/{pid}/environ", "rb") as fh:
                env = fh.read().split(b"\0")
        except OSError:
            continue
        if cwd.startswith(str(root)) or mark in env:
            found.append(pid)
    return found


@pytest.mark.parametrize("agent", ["claude-code", "codex", "gemini"])
def test_a_rollout_of_each_cli_is_scored_into_its_rows(
    stub_tap: AgentTap, scripted: Callable[[str], None], agent: str, tmp_path: Path
) -> None:
    task = tmp_path / "task"
    task.mkdir()
    (task / "README").write_text("write hello.txt")
    scripted(agent)
    result = stub_tap.rollout(
        agent, "Create hello.txt containing hi", n=2, workdir=task, verifier=VERIFIER,
        metadata={"task_id": "hello", "split": "train"},
    )  # fmt: skip
    assert result["status"] == "done" and result["n"] == 2
    assert result["sandbox"] == "bwrap"  # the default: each CLI runs in its sandbox
    for run in result["rollouts"]:
        assert run["status"] == "ok", run
        assert run["finish_reason"] == "stop" and run["reward"] == 1.0
        work = Path(run["workdir"])
        assert (work / "hello.txt").read_text() == "hi" and (work / "README").exists()
        assert run["verifier_output"].splitlines()[0] == "checking"
        assert run["metrics"]["calls"] >= 2 and run["metrics"]["rollout_wall_time_s"] > 0
        main = max(run["rows"], key=lambda r: r["num_turns"])
        assert main["reward"] == 1.0 and main["end_reason"] == "stop"
        meta = json.loads(main["metadata"])
        assert meta["group_id"] == result["id"] and meta["task_id"] == "hello"
        assert meta["agent"] == agent  # which scaffold made the row (issue 51)
    # The task's own folder is untouched: each agent worked in its own copy.
    assert not (task / "hello.txt").exists()
    assert not agent_processes(stub_tap.out / "rollouts" / result["id"])


def test_a_rollout_stopped_by_its_limit(
    stub_tap: AgentTap, scripted: Callable[[str], None]
) -> None:
    scripted("claude-code")
    result = stub_tap.rollout(
        "claude-code", "Create hello.txt containing hi", limits={"max_calls": 1}, verifier=VERIFIER
    )
    (run,) = result["rollouts"]
    # Its one call wrote the file; the next was refused and Claude Code stopped.
    assert run["finish_reason"] == "max_calls" and run["reward"] == 1.0, run
    assert run["metrics"]["calls"] == 1 and run["metrics"]["refused"] == 1
    assert all(r["end_reason"] == "max_calls" for r in run["rows"])
    # The same rollout's answer without its rows: the summaries alone, a fraction of the size.
    full = stub_tap.client.get(f"/rollouts/{result['id']}")
    bare = stub_tap.client.get(f"/rollouts/{result['id']}?rows=0")
    assert [r.get("rows") for r in bare["rollouts"]] == [None]
    assert bare["rollouts"][0]["reward"] == 1.0
    assert len(json.dumps(bare)) * 3 < len(json.dumps(full))


def test_a_rollout_answered_without_its_rows(
    stub_tap: AgentTap, scripted: Callable[[str], None]
) -> None:
    scripted("claude-code")
    result = stub_tap.rollout(
        "claude-code", "Create hello.txt containing hi", verifier=VERIFIER, rows=False
    )
    (run,) = result["rollouts"]
    assert "rows" not in run and run["reward"] == 1.0 and run["metrics"]["calls"] >= 1


def test_delete_stops_a_rollout_and_leaves_no_process(stub_tap: AgentTap) -> None:
    # An agent that would run for minutes, with a child of its own.
    sleeper = {"command": ["sh", "-c", "sleep 300 & sleep 300"]}
    started = stub_tap.rollout(sleeper, "wait", n=2, wait=False, id="to-stop")
    assert started["status"] == "running"
    root = stub_tap.out / "rollouts" / "to-stop"
    deadline = time.monotonic() + 30
    while len(agent_processes(root)) < 4:
        assert time.monotonic() < deadline, "the agents did not start"
        time.sleep(0.1)
    assert stub_tap.get_rollout("to-stop")["rollouts"][0]["status"] == "running"
    stopped = stub_tap.cancel_rollout("to-stop")
    assert stopped["cancelled"] and stopped["status"] == "done"
    assert {r["finish_reason"] for r in stopped["rollouts"]} == {"cancelled"}
    assert not agent_processes(root)


def test_the_cap_refuses_with_429_and_retry_after(stub_tap: AgentTap) -> None:
    sleeper = {"command": ["sh", "-c", "sleep 300"]}  # the prompt is its $0
    stub_tap.rollout(sleeper, "wait", n=8, wait=False, id="fills-the-cap")
    try:
        with pytest.raises(AgentTapError) as refused:
            stub_tap.rollout(sleeper, "one more", wait=False)
        assert refused.value.status == 429 and "agenttap_max_rollouts" in str(refused.value)
    finally:
        stub_tap.cancel_rollout("fills-the-cap")
    assert not agent_processes(stub_tap.out / "rollouts" / "fills-the-cap")


def test_a_verifier_that_prints_no_number_is_an_error_with_its_output(
    stub_tap: AgentTap,
) -> None:
    result = stub_tap.rollout(
        {"command": ["true"]},
        "nothing to do",
        verifier={"command": ["sh", "-c", "echo looks fine to me"], "on_error": "score"},
    )
    (run,) = result["rollouts"]
    assert run["status"] == "error" and run["finish_reason"] == "error"
    assert run["reward"] is None and "looks fine to me" in run["verifier_output"]
    assert "not one number: 'looks fine to me'" in run["error"], run["error"]


def test_bad_requests_are_refused_with_the_reason(stub_tap: AgentTap, tmp_path: Path) -> None:
    for body, words in [
        ({"agent": "cursor", "prompt": "x"}, "unknown agent"),
        ({"agent": "codex"}, '"prompt"'),
        ({"agent": "codex", "prompt": "x", "n": 0}, '"n"'),
        ({"agent": "codex", "prompt": "x", "workdir": str(tmp_path / "nope")}, "not a folder"),
        ({"agent": "codex", "prompt": "x", "verifier": "check.sh"}, '"verifier"'),
        ({"agent": "codex", "prompt": "x\u0000y"}, "NUL"),
        ({"agent": {"command": ["a\u0000b"]}, "prompt": "x"}, "NUL"),
        ({"agent": "codex", "prompt": "x", "verifier": {"command": ["t"], "on_error": 1}}, "on_"),
        ({"agent": "codex", "prompt": "x", "id": "nl\n"}, '"id"'),
        ({"agent": "codex", "prompt": "x", "rows": "no"}, '"rows"'),
    ]:
        with pytest.raises(AgentTapError, match=words) as err:
            stub_tap.client.post("/rollouts", body)
        assert err.value.status == 400


def test_rollouts_from_asyncio(stub: StubPolicy, confdir: Path, tmp_path: Path) -> None:
    async def main() -> dict[str, Any]:
        async with await AsyncAgentTap.start(
            stub.url, QWEN3, tmp_path / "out", confdir=confdir
        ) as tap:
            return await tap.rollout(
                {"command": ["sh", "-c", "echo hi > hello.txt; echo done"]}, "go", n=2,
                verifier={"command": VERIFIER, "on_error": "score"},
            )  # fmt: skip

    result = asyncio.run(main())
    # An agent that made no model call failed its task, whatever it left: an error with its
    # output, scored here only because the verifier asked to be run on errors too.
    assert [r["reward"] for r in result["rollouts"]] == [1.0, 1.0]
    for run in result["rollouts"]:
        assert run["status"] == "error" and run["finish_reason"] == "error", run
        assert "no model call" in run["error"] and "done" in run["agent_output"]
        assert run["rows"] == [] and run["metrics"]["calls"] == 0


def test_a_failed_agent_is_an_error_with_no_reward(stub_tap: AgentTap) -> None:
    """Exited non-zero (and no call): status error, its exit code and output, reward null:
    never the verifier's 0 on an empty run (the verifier does not run unless asked)."""
    result = stub_tap.rollout(
        {"command": ["sh", "-c", "echo CODEX_HOME does not exist >&2; exit 3"]},
        "go",
        verifier=["sh", "-c", "echo 0"],
    )
    (run,) = result["rollouts"]
    assert run["status"] == "error" and run["finish_reason"] == "error", run
    assert run["exit_code"] == 3 and "exited with code 3" in run["error"]
    assert "CODEX_HOME does not exist" in run["agent_output"]
    assert run["reward"] is None and run["verifier_output"] == ""


def test_stopping_the_proxy_ends_every_agent_and_keeps_the_rows(
    stub: StubPolicy, confdir: Path, tmp_path: Path
) -> None:
    tap = AgentTap.start(stub.url, QWEN3, tmp_path / "out", confdir=confdir)
    try:
        tap.rollout(
            {"command": ["sh", "-c", "sleep 300 & sleep 300"]}, "wait", n=2, wait=False, id="orphan"
        )
        root = tmp_path / "out" / "rollouts" / "orphan"
        deadline = time.monotonic() + 30
        while len(agent_processes(root)) < 4:
            assert time.monotonic() < deadline, "the agents did not start"
            time.sleep(0.1)
    finally:
        tap.close()
    assert tap.proc.returncode == 0
    assert not agent_processes(root)


# -- the sandbox ---------------------------------------------------------------------------------
# An agent that tries what an agent under RL might once cheating pays: it reports what it could
# read, write and see into report.json in its workdir, leaves a daemon behind, and tampers with
# what the verifier reads. Its task (the prompt, its last argument) names the paths to try.
PROBE = r"""
import json, os, pathlib, subprocess, sys, tempfile, time

task = json.loads(sys.argv[-1])
out, conf = pathlib.Path(task["out"]), pathlib.Path(task["confdir"])
work = pathlib.Path.cwd()
# Its run's folder and its sibling's on the host (OUT/rollouts/ID/I): the task names them, as an
# attacker may know them; the sandbox shows no host path (its workdir is /workdir).
index = int(os.environ["AGENTTAP_SESSION"].rsplit("-", 1)[1])
sibling = pathlib.Path(task["rollout"]) / str(1 - index)


def read(path):
    try:
        return pathlib.Path(path).read_text()
    except OSError as exc:
        return type(exc).__name__


def write(path):
    try:
        pathlib.Path(path).write_text("pwned")
        return "written"
    except OSError as exc:
        return type(exc).__name__


def listing(path):
    try:
        return sorted(os.listdir(path))
    except OSError as exc:
        return type(exc).__name__


def cmdline(pid):
    try:
        return pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


pids = [p for p in os.listdir("/proc") if p.isdigit()]
report = {
    "cwd": str(work),
    "out_listing": listing(out),
    "rollouts_listing": listing(out / "rollouts"),
    "other_rollout": read(task["other_rollout_file"]),
    "conf_listing": sorted(os.listdir(conf)),
    "ca_key": read(conf / "mitmproxy-ca.pem"),
    "ca_cert": read(conf / "mitmproxy-ca-cert.pem"),
    "sibling_visible": sibling.exists(),
    "writes": {
        "work": write(work / "mine.txt"),
        "home": write(pathlib.Path(os.environ["HOME"]) / "h.txt"),
        "tmp": write(pathlib.Path(tempfile.gettempdir()) / "t.txt"),
        "sibling": write(sibling / "work" / "pwned.txt"),
        "outside": write(task["outside"]),
        "etc": write("/etc/agenttap-pwned"),
        "out": write(out / "pwned.txt"),
        "seed": write(pathlib.Path(task["seed"]) / "pwned.txt"),
    },
    "pids": len(pids),
    "cmdlines": [cmdline(p) for p in pids],
    "proxy_pid_visible": os.path.exists(f"/proc/{task['proxy_pid']}/cmdline")
    and "mitmdump" in cmdline(task["proxy_pid"]),
    "env_keys": sorted(os.environ),
    "tmpdir": tempfile.gettempdir(),
}
# A daemon in a session of its own, as a tool's server would be, that keeps rewriting the tests:
# it must be gone before they are restored and scored.
daemon = (
    "import pathlib, time\n"
    "for _ in range(6000):\n"
    "    pathlib.Path('tests/check.txt').write_text('100\\n'); time.sleep(0.01)\n"
    f"# {task['marker']}"
)
subprocess.Popen(
    ["setsid", sys.executable, "-c", daemon],
    start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
)
# What the verifier reads: a json module to shadow the standard library, tests rewritten.
(work / "json.py").write_text("print(1000.0)\nraise SystemExit(0)\n")
(work / "tests" / "check.txt").write_text("100\n")
(work / "report.json").write_text(json.dumps(report))
time.sleep(0.3)  # the daemon has started
print("probe done")
"""
# The reward is the seed's tests/check.txt, read with the json module: 0.25 if the seed's tests
# were restored and the standard library's json was imported.
CHECK = [
    sys.executable,
    "-c",
    "import json, pathlib; print(json.dumps(float(pathlib.Path('tests/check.txt').read_text())))",
]


def test_a_sandboxed_agent_sees_and_changes_only_its_own_copy(
    stub_tap: AgentTap, confdir: Path, tmp_path: Path
) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    seed = tmp_path / "seed"
    (seed / "tests").mkdir(parents=True)
    (seed / "tests" / "check.txt").write_text("0.25\n")
    # Another rollout's folder with a file in it, on the host.
    other = stub_tap.out / "rollouts" / "someone-else" / "0" / "work" / "answer.txt"
    other.parent.mkdir(parents=True)
    other.write_text("the answer")
    marker = f"agenttap-daemon-{uuid.uuid4().hex}"
    rollout_id = f"probe-{uuid.uuid4().hex[:8]}"
    task = {
        "out": str(stub_tap.out), "rollout": str(stub_tap.out / "rollouts" / rollout_id),
        "confdir": str(confdir), "other_rollout_file": str(other),
        "outside": str(tmp_path / "outside.txt"), "seed": str(seed), "marker": marker,
        "proxy_pid": stub_tap.proc.pid,
    }  # fmt: skip
    body = {
        "agent": {"command": [sys.executable, str(probe)]}, "prompt": json.dumps(task), "n": 2,
        "workdir": str(seed),
        "verifier": {"command": CHECK, "restore": ["tests/"], "on_error": "score"},
        "id": rollout_id,
    }  # fmt: skip
    result = stub_tap.client.request("POST", "/rollouts", body, timeout=None)[0]
    assert result["sandbox"] == "bwrap"
    runs = result["rollouts"]
    # Every process of each agent, its setsid daemon included, is gone once the rollout is.
    assert not processes_with(marker.encode())
    assert not agent_processes(stub_tap.out / "rollouts" / result["id"])
    # The verifier scored the seed's tests with the standard library's json (not 100, not 1000).
    assert [r["reward"] for r in runs] == [0.25, 0.25], runs
    assert all(r["verifier_output"].strip() == "0.25" for r in runs)
    for run in runs:
        folder = Path(run["workdir"]).parent
        report = json.loads((folder / "work" / "report.json").read_text())
        # Its folders at fixed places (agenttap_sandbox_paths): OUT is not there at all, not
        # even the mount points of its own folders, and no other rollout's.
        assert report["cwd"] == "/workdir"
        assert report["out_listing"] == report["rollouts_listing"] == "FileNotFoundError"
        assert report["other_rollout"] == "FileNotFoundError" and not report["sibling_visible"]
        # The CA key is hidden, the certificate readable.
        assert report["conf_listing"] == ["agenttap-ca-bundle.pem", "mitmproxy-ca-cert.pem"]
        assert report["ca_key"] == "FileNotFoundError"
        assert report["ca_cert"] == (confdir / "mitmproxy-ca-cert.pem").read_text()
        # Writable: its copy, its HOME, its TMPDIR; nothing else.
        writes = report["writes"]
        assert {k: writes.pop(k) for k in ("work", "home", "tmp")} == dict.fromkeys(
            ("work", "home", "tmp"), "written"
        )
        # Elsewhere a write fails, or (a path under /tmp, where these tests keep OUT) lands in
        # the sandbox's own fresh /tmp, gone with it: the host is checked below.
        kept_in_tmp = {"outside", "out", "seed", "sibling"}
        assert all(
            v in ("OSError", "FileNotFoundError") or k in kept_in_tmp for k, v in writes.items()
        ), writes
        assert writes["etc"] == "OSError" and writes["sibling"] == "FileNotFoundError"
        assert report["tmpdir"] == "/tmp/agent"  # folder/box/tmp: the disk limit's tmpfs
        # Its own PID namespace: bwrap's init and itself (and `setsid` not started yet).
        assert report["pids"] <= 3 and not report["proxy_pid_visible"]
        assert not any("mitmdump" in c for c in report["cmdlines"])
        assert "AGENTTAP_TOKEN" not in report["env_keys"] and "TMPDIR" in report["env_keys"]
        assert (folder / "home" / "h.txt").exists() and not (folder / "tmp").exists()
        assert not (folder / "work" / "pwned.txt").exists()
        assert (folder / "work" / "tests" / "check.txt").read_text() == "0.25\n"
    assert not (tmp_path / "outside.txt").exists() and not Path("/etc/agenttap-pwned").exists()
    assert not (stub_tap.out / "pwned.txt").exists() and not (seed / "pwned.txt").exists()


def test_a_seed_link_out_of_the_workdir_is_refused_and_one_inside_copied(
    stub_tap: AgentTap, tmp_path: Path
) -> None:
    seed = tmp_path / "seed"
    (seed / "src").mkdir(parents=True)
    (seed / "src" / "main.py").write_text("print('hi')\n")
    (seed / "main.py").symlink_to("src/main.py")
    (seed / "lib").symlink_to("src")
    result = stub_tap.rollout(
        {"command": ["sh", "-c", "test -L main.py || test -L lib || echo copied > ok.txt"]},
        "go", workdir=seed,
        verifier={"command": ["sh", "-c", "cat ok.txt >/dev/null && echo 1"], "on_error": "score"},
    )  # fmt: skip
    (run,) = result["rollouts"]
    assert run["reward"] == 1.0, run
    work = Path(run["workdir"])
    assert not (work / "main.py").is_symlink() and (work / "main.py").read_text() == "print('hi')\n"
    assert (work / "lib" / "main.py").is_file() and not (work / "lib").is_symlink()
    secret = tmp_path / "secret.txt"
    secret.write_text("s")
    (seed / "leak").symlink_to(secret)
    with pytest.raises(AgentTapError, match="symlink .*leak.* points outside") as err:
        stub_tap.rollout({"command": ["true"]}, "go", workdir=seed, id="leaky")
    assert err.value.status == 400
    # Refused before anything started: no rollout, no session.
    with pytest.raises(AgentTapError) as unknown:
        stub_tap.get_rollout("leaky")
    assert unknown.value.status == 404


def test_sandbox_none_runs_the_agent_unsandboxed_with_a_warning(
    stub_tap: AgentTap, tmp_path: Path
) -> None:
    body = {
        "agent": {"command": ["sh", "-c", f"ls {stub_tap.out} > seen.txt; echo 'print(9)' > json.py"]},
        "prompt": "x", "sandbox": "none", "id": f"plain-{uuid.uuid4().hex[:8]}",
        "verifier": {"command": [sys.executable, "-c", "import json; print(json.dumps(1))"],
                     "on_error": "score"},
    }  # fmt: skip
    result = stub_tap.client.request("POST", "/rollouts", body, timeout=None)[0]
    (run,) = result["rollouts"]
    assert result["sandbox"] == "none" and run["reward"] == 1.0, run
    # It saw OUT as it is (journal, every rollout); the verifier's json is still the stdlib's.
    seen = (Path(run["workdir"]) / "seen.txt").read_text().split()
    assert seen == sorted(os.listdir(stub_tap.out)) and len(seen) > 1
    log = stub_tap.log.read_text()
    assert f"rollout {result['id']} runs its agents and verifier unsandboxed" in log
    assert "can read and write everything this user can" in log


def test_without_bwrap_a_rollout_is_refused_with_the_install_command(
    stub: StubPolicy, confdir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bin_dir = tmp_path / "bin"  # a PATH with sh, no bwrap
    bin_dir.mkdir()
    (bin_dir / "sh").symlink_to("/bin/sh")
    monkeypatch.setenv("PATH", str(bin_dir))
    with AgentTap.start(stub.url, QWEN3, tmp_path / "out", confdir=confdir) as tap:
        with pytest.raises(AgentTapError, match="apt-get install bubblewrap") as err:
            tap.rollout({"command": ["true"]}, "x")
        assert err.value.status == 400 and "scripts/setup.sh" in str(err.value)
        body = {"agent": {"command": ["sh", "-c", "echo ran"]}, "prompt": "x", "sandbox": "none"}
        (run,) = tap.client.request("POST", "/rollouts", body, timeout=None)[0]["rollouts"]
        assert "ran" in run["agent_output"] and "no model call" in run["error"], run


# An agent that keeps calling (the prompt: a chat body), as a scaffold retrying refused calls
# does, and one that makes a call and then idles.
CALL = (
    "curl -sS https://api.openai.com/v1/chat/completions "
    '-H "Authorization: Bearer $OPENAI_API_KEY" -H "Content-Type: application/json" '
    '-d "$1" >> calls.log; echo >> calls.log'
)
RETRIES = {"command": ["sh", "-c", f"for i in $(seq 40); do {CALL}; sleep 0.2; done", "agent"]}
IDLES = {"command": ["sh", "-c", f"{CALL}; sleep 60", "agent"]}


def test_an_agent_past_its_sessions_limit_is_stopped_at_once(stub_tap: AgentTap) -> None:
    """Past ``max_calls`` (its first refused call) or ``deadline_s``, the rollout's agent is
    stopped within a poll (0.2 s), not left to retry refused calls or idle until its timeout:
    40 calls 0.2 s apart would take 8 s and 38 refusals; the idle agent a minute."""
    body = json.dumps(
        {"model": "gpt-4o", "max_tokens": 4, "messages": [{"role": "user", "content": "go"}]}
    )
    result = stub_tap.rollout(RETRIES, body, limits={"max_calls": 2})
    (run,) = result["rollouts"]
    assert {json.loads(r["metadata"])["agent"] for r in run["rows"]} == {"command:sh"}
    assert run["status"] == "ok" and run["finish_reason"] == "max_calls", run
    assert run["metrics"]["calls"] == 2 and 1 <= run["metrics"]["refused"] <= 2, run["metrics"]
    assert run["metrics"]["rollout_wall_time_s"] < 5, run["metrics"]
    result = stub_tap.rollout(IDLES, body, limits={"deadline_s": 2})
    (run,) = result["rollouts"]
    assert run["status"] == "ok" and run["finish_reason"] == "deadline", run
    assert run["metrics"]["calls"] == 1
    assert 2 <= run["metrics"]["rollout_wall_time_s"] < 8, run["metrics"]
