"""``scripts/run_proxy.sh`` itself, with its embedded policy (issue 10, items 8 and 9): the
default context fits Claude Code's first call (~11.5k tokens), and stopping the script, while
vLLM is still starting or once it serves, leaves no vLLM server and no mitmdump behind. Issue 18:
the embedded policy prints its progress while it loads, nothing is printed for a client to copy
before the proxy listens, and one ``agenttap ready:`` line ends the start-up once it answers.
Issue 37: the embedded policy serves on a unix socket in the script's private folder (no TCP
listener), calls through the proxy are answered over it, and the folder is gone on exit."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from rewriter.policy_url import urlopen
from tests.e2e.policy.test_policy_private import (
    check_policy_is_private,
    tcp_listeners_of,
    vllm_group,
)
from tests.support.paths import REPO
from tests.support.proxies import Proxy, processes_with
from tests.support.vllm_servers import ONE_FLOATING_THREAD

pytestmark = pytest.mark.vllm

CLAUDE_CODE_FIRST_CALL_TOKENS = 11_500


def _wait_for(
    what: str, check: Callable[[], bool], timeout: float, run: RunProxy | None = None
) -> None:
    """Until ``check``; with ``run``, a run that has exited fails it at once, with its output."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out after {timeout:.0f}s waiting for {what}"
        if run is not None and run.proc.poll() is not None:
            raise AssertionError(
                f"run_proxy.sh exited ({run.proc.returncode}) before {what} was ready:\n"
                + run.output()[-3000:]
            )
        time.sleep(0.2)


def quiet_port() -> int:
    """A free port below the kernel's ephemeral range: run_proxy.sh binds it only once its
    policy is up, minutes later, and a port of that range (what binding port 0 gives) was taken
    by another process's outgoing connection in between (measured: EADDRINUSE after 3 min)."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for _ in range(200):
        port = random.randrange(max(1024, low - 12000), low)
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port below the ephemeral range")


class RunProxy:
    """``scripts/run_proxy.sh`` started as a user would, its output in a log file."""

    def __init__(
        self,
        tmp_path: Path,
        confdir: Path,
        cwd: Path = REPO,
        out: str = "",
        env: dict[str, str] | None = None,
    ) -> None:
        self.cwd, self.token = cwd, (env or {}).get("AGENTTAP_TOKEN", "")
        self.port = quiet_port()
        self.api_port = quiet_port()
        while self.api_port == self.port:
            self.api_port = quiet_port()
        self.log = tmp_path / "run_proxy.log"
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                ["bash", str(REPO / "scripts" / "run_proxy.sh"), "--port", str(self.port),
                 "--api-port", str(self.api_port), "--out", out or str(tmp_path / "out"),
                 "--confdir", str(confdir)],
                stdout=log, stderr=subprocess.STDOUT, cwd=cwd, start_new_session=True,
                # Up to four cold starts at once (the full runs and a stop test) share two
                # cores here: more than the default 300 s to answer (a quiet machine takes
                # about 40 s).
                env={**os.environ, **ONE_FLOATING_THREAD, "AGENTTAP_POLICY_START_S": "840",
                     **(env or {})},
            )  # fmt: skip

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def vllm_socket(self) -> str:
        """The embedded policy's unix socket (issue 37: no TCP port), in the private folder."""
        match = re.search(r"starting vLLM for .* at unix:(\S+) ", self.output())
        return match.group(1) if match else ""

    def vllm_running(self) -> bool:
        sock = self.vllm_socket()
        if not sock:
            return False
        servers = set(processes_with(b"vllm.entrypoints.openai.api_server"))
        return bool(servers & set(processes_with(f"--uds {sock} ".encode())))

    def mitmdump_running(self) -> bool:
        return bool(processes_with(f"--listen-port {self.port}".encode()))

    def stop_and_check_nothing_is_left(self) -> None:
        os.kill(self.proc.pid, signal.SIGTERM)  # the script only, as a supervisor would
        self.proc.wait(60)
        _wait_for("the vLLM server to stop", lambda: not self.vllm_running(), 60)
        _wait_for("mitmdump to stop", lambda: not self.mitmdump_running(), 30)
        self.check_private_folder_is_gone()

    def check_private_folder_is_gone(self) -> None:
        """Issue 37 item 6: the token, the policy's socket and its log went with the script
        (a policy that stopped as asked did not fail: no log is kept)."""
        sock = self.vllm_socket()
        if sock:
            assert not Path(sock).parent.exists(), f"{Path(sock).parent} outlived run_proxy.sh"
        assert "the embedded policy failed" not in self.output()

    def kill_all(self) -> None:
        """After a failure too: nothing of this run may outlive the test."""
        sock = self.vllm_socket()
        leftovers = processes_with(f"--uds {sock} ".encode()) if sock else []
        leftovers += processes_with(f"--listen-port {self.port}".encode())
        for pid in leftovers:
            try:
                os.killpg(pid, signal.SIGKILL)  # vLLM runs in its own session, with its workers
            except (ProcessLookupError, PermissionError):
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def check_start_up_lines(output: str, port: int) -> None:
    """The embedded policy's progress, then the proxy's banner only once it listens, then the
    ready line, last."""
    lines = [
        line.split("] ", 1)[-1] if line.startswith("[") else line for line in output.splitlines()
    ]
    progress = [line for line in lines if line.startswith("agenttap: policy starting (")]
    # vLLM takes about a minute on a CPU: a line every 5 s, each saying what its log says.
    assert len(progress) >= 3, "\n".join(lines[:40])
    assert all(re.fullmatch(r"agenttap: policy starting \(\d+ s\): \S.*", p) for p in progress)
    assert len(set(progress)) > 1
    log = re.search(r"starting vLLM for .* its full log: (\S+)", output)
    assert log and Path(log.group(1)).stat().st_size > 0
    listening = lines.index(f"HTTP(S) proxy listening at 127.0.0.1:{port}.")
    before = lines[:listening]
    assert not [line for line in before if "AGENTTAP_" in line or "export " in line], before
    assert not [line for line in before if "HTTPS_PROXY" in line or "BASE_URL" in line], before
    assert max(i for i, line in enumerate(lines) if line.startswith("POLICY_URL=")) < listening
    ready = [i for i, line in enumerate(lines) if line.startswith("agenttap ready:")]
    assert len(ready) == 1 and listening < ready[0], lines[listening:]
    assert lines[ready[0]].startswith(f"agenttap ready: proxy http://127.0.0.1:{port} answering ")
    startup = ("AGENTTAP_", "export ", "Proxy mode", "Base-URL mode", "agenttap: answering")
    banner = [i for i, line in enumerate(lines) if line.strip().startswith(startup)]
    assert banner and max(banner) < ready[0]
    assert not any("PyTorch was not found" in line for line in lines)


# The full runs (below) start first and boot meanwhile.
@pytest.mark.usefixtures("full_runs")
@pytest.mark.parametrize("loading_s", [0.0, 8.0], ids=["just-spawned", "loading"])
def test_stopping_run_proxy_while_the_embedded_policy_starts_leaves_nothing(
    confdir: Path, tmp_path: Path, loading_s: float
) -> None:
    """Stopped the moment vLLM's process exists, and while it loads (cold start ~60 s)."""
    run = RunProxy(tmp_path, confdir)
    try:
        _wait_for("vLLM to be started", run.vllm_running, 300)
        time.sleep(loading_s)
        assert "POLICY_URL=" not in run.output(), "vLLM was ready already: stop it sooner"
        run.stop_and_check_nothing_is_left()
    finally:
        run.kill_all()


# The full runs, each ended its own way. Their embedded policies' cold starts (about a minute of
# CPU each) overlap when they start together, instead of queueing one after another.
FULL_RUNS = ("serve", "ctrl-c", "mitmdump-exits-first")


@pytest.fixture(scope="module")
def full_runs(
    confdir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, RunProxy]]:
    """``run_proxy.sh`` started three times at once. "serve" as a user first runs it; the two
    stop tests with a token given in the environment, started from another folder with a
    relative --out (OUT is there, as the user meant)."""
    # Each run first brings the environments up to date (scripts/setup.sh): once here, so three
    # runs at once never install into .venv together (a changed pyproject.toml would).
    subprocess.run(
        ["bash", str(REPO / "scripts" / "setup.sh")], check=True, capture_output=True,
        env={**os.environ, "AGENTTAP_SKIP_CLIENTS": "1", "AGENTTAP_SKIP_BROWSER": "1",
             "AGENTTAP_SKIP_PEERS": "1", "AGENTTAP_SKIP_TRAIN": "1",
             "AGENTTAP_SKIP_IMAGES": "1"},
    )  # fmt: skip
    runs: dict[str, RunProxy] = {}
    try:
        for name in FULL_RUNS:
            tmp_path = tmp_path_factory.mktemp(f"run-proxy-{name}")
            if name == "serve":
                runs[name] = RunProxy(tmp_path, confdir)
                continue
            token = "env-token-" + os.urandom(12).hex()
            elsewhere = tmp_path / "elsewhere"
            elsewhere.mkdir()
            runs[name] = RunProxy(
                tmp_path, confdir, cwd=elsewhere, out="rel-out", env={"AGENTTAP_TOKEN": token}
            )
        yield runs
    finally:
        for run in runs.values():
            run.kill_all()


def test_run_proxy_serves_a_claude_code_sized_prompt_and_stops_cleanly(
    full_runs: dict[str, RunProxy], confdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = full_runs["serve"]
    tmp_path = run.log.parent
    _wait_for("the proxy", lambda: "agenttap ready:" in run.output(), 900, run)
    # The moment the ready line is out, both listeners take a connection (no retry).
    for port in (run.port, run.api_port):
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    check_start_up_lines(run.output(), run.port)
    policy_url = re.search(r"POLICY_URL=(\S+)", run.output())
    assert policy_url, run.output()[-3000:]
    # The embedded policy is on a unix socket in the private folder, with no TCP listener
    # on this host's network (issue 37 item 2; tests/e2e/policy/test_policy_private.py).
    assert policy_url.group(1) == f"unix:{run.vllm_socket()}"
    private = Path(run.vllm_socket()).parent
    assert {p.name for p in private.iterdir()} >= {"token", "policy.log", "vllm.sock"}
    group = vllm_group(run.vllm_socket())
    assert len(group) >= 3 and tcp_listeners_of(group) == {}
    with urlopen(policy_url.group(1), "/v1/models", timeout=30) as resp:
        (model,) = json.load(resp)["data"]
    assert model["max_model_len"] >= 32768, model

    proxy = Proxy(
        port=run.port,
        out=tmp_path / "out",
        ca=confdir / "mitmproxy-ca-cert.pem",
        log=run.log,
        proc=run.proc,
    )  # type: ignore[arg-type]
    client = proxy.openai("run-proxy", monkeypatch)
    # About as long as Claude Code's first call (its system prompt and tools): ~12.2k tokens.
    words = " ".join(f"rule{i}" for i in range(2600))
    resp = client.chat.completions.create(
        model="claude-sonnet-4-5",
        messages=[{"role": "system", "content": words}, {"role": "user", "content": "Hi"}],
        max_tokens=8,
    )
    assert resp.usage is not None
    print(f"run_proxy.sh embedded policy: a {resp.usage.prompt_tokens}-token prompt served")
    assert resp.usage.prompt_tokens >= CLAUDE_CODE_FIRST_CALL_TOKENS

    # The lines printed for base-URL mode work as printed, SESSION replaced by a name.
    base_url = f"http://127.0.0.1:{run.api_port}/sess/SESSION/v1"
    assert f"OPENAI_BASE_URL={base_url}" in run.output()
    import openai

    direct = openai.OpenAI(
        base_url=base_url.replace("SESSION", "run-proxy-base"), api_key="k", max_retries=0
    )
    monkeypatch.delenv("HTTPS_PROXY", raising=False)
    answer = direct.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Hi"}], max_tokens=4
    )
    assert answer.usage is not None and answer.usage.completion_tokens > 0
    token = re.search(r"AGENTTAP_TOKEN=(\S+)", run.output())
    assert token, run.output()[-3000:]
    req = urllib.request.Request(
        f"http://127.0.0.1:{run.api_port}/sessions",
        headers={"Authorization": f"Bearer {token.group(1)}"},
    )
    with urllib.request.urlopen(req, timeout=30) as resp:
        live = {s["id"]: s for s in json.load(resp)["sessions"]}
    assert live["run-proxy-base"]["metrics"]["calls"] == 1
    # The token is on no command line and in no environment (/proc is readable by all).
    assert not processes_with(token.group(1).encode())
    assert not processes_with(b"agenttap_token=")
    # Last, as it relabels the policy's weights behind the proxy's back: the policy is its
    # owner's alone (issue 37), and its dev-mode routes answer over its socket.
    check_policy_is_private(policy_url.group(1))
    run.stop_and_check_nothing_is_left()


def environ_holds(secret: bytes) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if secret in Path(f"/proc/{pid}/environ").read_bytes():
                found.append(int(pid))
        except OSError:
            continue
    return found


@pytest.mark.parametrize("how", ["ctrl-c", "mitmdump-exits-first"])
def test_run_proxy_stops_everything_it_started_whatever_ends_first(
    full_runs: dict[str, RunProxy], how: str
) -> None:
    """Ctrl-C (SIGINT to the script's process group, as a terminal sends it), or mitmdump
    ending on its own: the embedded vLLM and mitmdump are gone, no listener is left, and a
    token given in the environment reached no child's environment."""
    run = full_runs[how]
    token, elsewhere = run.token, run.cwd
    _wait_for("the proxy", lambda: "agenttap ready:" in run.output(), 900, run)
    assert f"AGENTTAP_TOKEN={token}" in run.output()
    assert f"shards in {elsewhere / 'rel-out'}" in run.output()
    # The script's own environment was given it; no process it started holds it.
    assert set(environ_holds(token.encode())) <= {run.proc.pid}
    if how == "ctrl-c":
        os.killpg(run.proc.pid, signal.SIGINT)
    else:
        (mitmdump,) = processes_with(f"--listen-port {run.port}".encode())
        os.kill(mitmdump, signal.SIGTERM)
    run.proc.wait(60)
    _wait_for("the vLLM server to stop", lambda: not run.vllm_running(), 60)
    _wait_for("mitmdump to stop", lambda: not run.mitmdump_running(), 30)
    run.check_private_folder_is_gone()
    for port in (run.port, run.api_port):
        with socket.socket() as sock:
            assert sock.connect_ex(("127.0.0.1", port)) != 0, f"port {port} still listens"
