"""Issue 37, items 2 and 6: the policy agenttap starts is reached by agenttap alone.

``python -m policy_server`` (the embedded policy of ``scripts/run_proxy.sh``) serves a
real vLLM on a unix socket in a folder only its owner may open, with no TCP listener on the
host's network (its torch listeners live in a network namespace of their own), its
dev-mode routes reached over the socket by agenttap's weight update, and its folder is gone
once it stops: ``check_policy_is_private``, run on the policy of run_proxy.sh's "serve" run
(tests/e2e/policy/test_run_proxy.py, which checks the folder is gone when it stops), so this
module starts no vLLM of its own; what ``python -m policy_server`` does around its vLLM (the
folder it makes, removed on SIGTERM, exit 0) with a stand-in (tests/support/fake_vllm.py). A
policy on TCP whose dev-mode ``/pause`` answers anyone is named in a warning at start. ``run_proxy.sh`` removes its private folder on exit, keeping the
policy's log (its path printed) only where the policy failed."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from capture.client.launcher import AgentTap
from capture.policy.pools import PolicyPools
from capture.policy.startup import exposure_warning
from policy_server.launcher import DEFAULT_MODEL_DIR, ensure_tiny_model
from rewriter.canonical import SamplingParams
from rewriter.policy_url import parse_policy_url, urlopen
from rewriter.vllm_answers import Completion
from tests.support.paths import QWEN3, REPO
from tests.support.proxies import start_proxy
from tests.support.stub_vllm import StubPolicy

# Run as another uid: the system's, which any user may execute (the checkout may not be).
SYSTEM_PYTHON = "/usr/bin/python3"


def _wait_for(what: str, check: Callable[[], object], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out after {timeout:.0f}s waiting for {what}"
        time.sleep(0.2)


def process_group(pgid: int) -> list[int]:
    """Every live process of the process group ``pgid`` (vLLM, its engine core, its workers)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        # Fields after the command's closing parenthesis: state, ppid, pgrp, ...
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            found.append(int(pid))
    return found


def vllm_group(sock: str) -> list[int]:
    """The processes of the vLLM serving on ``sock``: bwrap (where it makes its network
    namespace), the API server, the engine core and the workers, one process group."""
    starters = [
        p
        for p in map(int, filter(str.isdigit, os.listdir("/proc")))
        if f"--uds {sock} ".encode() in _cmdline(p)
        and b"vllm.entrypoints.openai.api_server" in _cmdline(p)
    ]
    (pgid,) = {os.getpgid(p) for p in starters}
    return process_group(pgid)


def socket_inodes(pids: list[int]) -> set[int]:
    inodes = set()
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(int(target[8:-1]))
    return inodes


def host_tcp_listeners() -> dict[int, str]:
    """The TCP sockets listening on this host's network (this process's namespace): inode ->
    local address, from /proc/net/tcp and tcp6 (state 0A: LISTEN)."""
    out = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            cols = line.split()
            if cols[3] == "0A":
                out[int(cols[9])] = cols[1]
    return out


def tcp_listeners_of(pids: list[int]) -> dict[int, str]:
    mine = socket_inodes(pids)
    return {inode: addr for inode, addr in host_tcp_listeners().items() if inode in mine}


def connect_as_nobody(path: str) -> subprocess.CompletedProcess[str]:
    """Connect to the unix socket ``path`` as uid/gid 65534 (nobody)."""
    probe = (
        "import socket, sys\n"
        "s = socket.socket(socket.AF_UNIX)\n"
        "try:\n"
        "    s.connect(sys.argv[1])\n"
        "except OSError as exc:\n"
        "    print(type(exc).__name__, exc.errno); sys.exit(3)\n"
        "print('connected')\n"
    )
    return subprocess.run(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
         SYSTEM_PYTHON, "-c", probe, path],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip


async def update_and_generate(url: str) -> tuple[list[dict[str, Any]], Completion]:
    """Over the socket, as the gateway does: new weights (the same folder, reloaded) served as
    ``step-1``, then a generation."""
    pools = PolicyPools([url], [], [], timeout_s=120, max_connections=4)
    pools.open(lambda ids: "")
    try:
        assert pools.default is not None
        outcomes = await pools.weights.update(
            pools.http, pools.default, DEFAULT_MODEL_DIR, "step-1"
        )
        completion = await pools.client_for("s").complete([1, 2, 3], SamplingParams(max_tokens=4))
        return outcomes, completion
    finally:
        await pools.close()


def check_policy_is_private(url: str) -> None:
    """The embedded policy serving at ``url`` (``python -m policy_server``, as run_proxy.sh
    starts it; its "serve" run calls this: tests/e2e/policy/test_run_proxy.py) is reached by
    its owner alone: a unix socket in a folder only its owner may open, no TCP listener on this
    host's network, vLLM's ipc sockets in that folder too, and the dev-mode routes answering
    over the socket (a weight update, as agenttap's gateway makes it, and a generation
    labelled with it). Leaves its weights relabelled ``step-1``: call it last."""
    sock = parse_policy_url(url).socket_path
    assert sock is not None, f"the default is a unix socket, not {url}"
    folder = Path(sock).parent
    info = folder.stat()
    assert info.st_uid == os.getuid() and info.st_mode & 0o777 == 0o700, oct(info.st_mode)
    # vLLM (started in a session of its own, bwrap first where it runs in a network
    # namespace): its API server and engine core, which holds the model (tests run it in one
    # process: VLLM_ENABLE_V1_MULTIPROCESSING=0), else a worker process too.
    group = vllm_group(sock)
    assert len(group) >= 3, group  # bwrap, the API server, the engine core
    # None of them listens on TCP on this host's network: every dev-mode route is behind
    # the socket. (Without a network namespace of its own, the model's torch gloo process
    # groups would listen on a dozen loopback ports here.)
    assert tcp_listeners_of(group) == {}
    # The scan itself finds what listens: a listener of this process appears in it (beside
    # those of the stubs other tests of this session started in this process).
    before = tcp_listeners_of([os.getpid()])
    with socket.socket() as tcp:
        tcp.bind(("127.0.0.1", 0))
        tcp.listen()
        port = tcp.getsockname()[1]
        added = set(tcp_listeners_of([os.getpid()]).values()) - set(before.values())
        assert any(a.endswith(f":{port:04X}") for a in added), ("the scan missed it", added)
    # vLLM's ipc sockets and the workers' file store are in the private folder too.
    assert any(p.is_socket() and p.name != "vllm.sock" for p in folder.iterdir())
    # Through the socket, the dev-mode routes answer their owner (agenttap): a weight
    # update (pause, reload_weights, label, resume) and a generation labelled with it.
    outcomes, completion = asyncio.run(update_and_generate(url))
    assert [o["ok"] for o in outcomes] == [True], outcomes
    assert completion.token_ids and completion.weight_versions[0][0] == "step-1"
    with urlopen(url, "/is_paused", timeout=30) as resp:
        assert resp.status == 200 and b'"is_paused":false' in resp.read()
    if os.getuid() == 0:
        # Another uid cannot even reach the socket (root here could: it overrides modes).
        other = connect_as_nobody(sock)
        assert other.returncode == 3 and "PermissionError 13" in other.stdout, other


def test_the_policy_server_removes_the_folder_it_made_and_exits_0_on_sigterm(
    tmp_path: Path,
) -> None:
    """``python -m policy_server`` without ``--socket`` makes a folder only its owner may open
    for its socket; on SIGTERM (what run_proxy.sh sends it) it stops its vLLM's process group,
    removes that folder and exits 0. Its vLLM here is tests/support/fake_vllm.py (what a real
    one serves there: tests/e2e/policy/test_run_proxy.py)."""
    fake = tmp_path / "fake-vllm-python"
    fake.write_text(
        f'#!/bin/sh\nexec {sys.executable} {REPO / "tests" / "support" / "fake_vllm.py"} "$@"\n'
    )
    fake.chmod(0o755)
    log = tmp_path / "policy_server.out"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "policy_server", "--max-model-len", "4096",
             "--log", str(tmp_path / "vllm.log")],
            stdout=out, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True,
            env={**os.environ, "AGENTTAP_VLLM_PYTHON": str(fake)},
        )  # fmt: skip
    vllm_pgid = 0
    try:
        _wait_for(
            "POLICY_URL=",
            lambda: "POLICY_URL=" in log.read_text() or proc.poll() is not None,
            120,
        )
        found = re.search(r"^POLICY_URL=unix:(\S+)$", log.read_text(), re.M)
        assert found, log.read_text()[-3000:]
        folder = Path(found.group(1)).parent
        info = folder.stat()
        assert info.st_uid == os.getuid() and info.st_mode & 0o777 == 0o700, oct(info.st_mode)
        # Its "vLLM" (the stand-in, with vLLM's command line), bwrap first where it runs in a
        # network namespace: one process group of its own.
        vllm_pgid = os.getpgid(vllm_group(found.group(1))[0])
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(60) == 0, log.read_text()[-3000:]
        _wait_for("vLLM's processes to end", lambda: not process_group(vllm_pgid), 60)
        assert not folder.exists(), "the socket's private folder outlived the server"
    finally:
        for pgid in (proc.pid, vllm_pgid):
            if pgid:
                try:
                    os.killpg(pgid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
    except OSError:
        return b""


def test_a_tcp_policy_whose_pause_answers_anyone_is_warned_of(
    confdir: Path, tmp_path: Path
) -> None:
    """A real mitmdump started on a TCP policy in vLLM's dev mode (the stub with its dev-mode
    routes, vLLM's shapes) logs the warning naming it; on one without them, nothing."""
    dev = StubPolicy(str(QWEN3))
    dev.dev_mode = True
    dev.start()
    plain = StubPolicy(str(QWEN3))
    plain.start()
    proxies = []
    try:
        for stub, name in ((dev, "dev"), (plain, "plain")):
            (tmp_path / name).mkdir()
            proxies.append(start_proxy(stub.url, tmp_path / name / "out", confdir))
        for proxy in proxies:  # the check runs before this line, at start
            log = proxy.log
            _wait_for("the ready line", lambda log=log: "agenttap ready:" in log.read_text(), 60)
        dev_log, plain_log = (p.log.read_text() for p in proxies)
        routes = ["POST /pause (GET /pause: 405)", "GET /is_paused (200)"]
        assert exposure_warning(dev.url, routes) in dev_log, dev_log[-3000:]
        assert "dev-mode routes" not in plain_log
        assert dev.paused is False  # the probe paused nothing
    finally:
        for proxy in proxies:
            proxy.proc.terminate()
            proxy.proc.wait(30)
        dev.stop()
        plain.stop()


def test_ready_names_the_policy_socket_to_the_token_holder_only(confdir: Path) -> None:
    """Issue 47: ``GET /ready`` answers anyone (a probe), so without the token it says ready
    and no more: the private folder of the policy's socket stays unnamed (real mitmdump, the
    stub on a unix socket as vLLM's --uds)."""
    # Short, under /tmp: a socket path past 107 bytes cannot be bound.
    folder = Path(tempfile.mkdtemp(prefix="agenttap-ready-"))
    sock = str(folder / "vllm.sock")
    stub = StubPolicy(str(QWEN3))
    stub.start(socket_path=sock)
    tap = AgentTap.start(stub.url, QWEN3, folder / "out", confdir=confdir)
    try:

        def ready(token: str | None) -> tuple[int, str]:
            headers = {"Authorization": f"Bearer {token}"} if token else {}
            req = urllib.request.Request(f"{tap.api_url}/ready", headers=headers)
            with urllib.request.urlopen(req, timeout=60) as resp:
                return resp.status, resp.read().decode()

        for token in (None, "wrong-token-0123456789"):
            status, text = ready(token)
            assert (status, text) == (200, '{"ready": true}'), text
            assert str(folder) not in text
        status, text = ready(tap.token)
        assert status == 200 and f"unix:{sock}" in text, text
    finally:
        tap.close()
        stub.stop()
        shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.vllm
def test_run_proxy_keeps_the_log_of_a_policy_that_failed_and_removes_its_folder(
    tmp_path: Path, confdir: Path
) -> None:
    """The embedded policy fails to start (a vLLM that exits at once, after one line): the
    script says where its log was kept, readable by this user alone, and its private folder
    (token, socket, log) is gone."""
    ensure_tiny_model(tokenizer=QWEN3)  # built by the real vLLM environment, not the broken one
    broken = tmp_path / "broken-vllm"
    broken.write_text("#!/bin/sh\necho 'vLLM (broken on purpose): no engine'\nexit 3\n")
    broken.chmod(0o755)
    env = dict(os.environ, AGENTTAP_VLLM_PYTHON=str(broken))
    run = subprocess.run(
        ["bash", str(REPO / "scripts" / "run_proxy.sh"), "--port", "0", "--confdir",
         str(confdir), "--out", str(tmp_path / "out")],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600,
    )  # fmt: skip
    output = run.stdout + run.stderr
    assert run.returncode == 1, output[-3000:]
    socket_at = re.search(r"starting vLLM for .* at unix:(\S+) ", output)
    assert socket_at, output[-3000:]
    private = Path(socket_at.group(1)).parent
    assert not private.exists(), f"{private} outlived run_proxy.sh"
    kept = re.search(r"the embedded policy failed; its log: (\S+)", output)
    assert kept, output[-3000:]
    log = Path(kept.group(1))
    try:
        assert "broken on purpose" in log.read_text()
        assert log.stat().st_mode & 0o077 == 0 and log.stat().st_uid == os.getuid()
        assert private not in log.parents
    finally:
        log.unlink(missing_ok=True)


def test_bwrap_is_here_for_the_policys_network_namespace() -> None:
    """The namespace the policy server runs vLLM in needs bwrap (as the rollouts' sandbox)."""
    from policy_server.launcher import own_network

    assert shutil.which("bwrap"), "apt-get install bubblewrap"
    assert own_network()[:1] == ["bwrap"]
