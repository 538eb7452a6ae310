"""Issue 14 item 1, fail closed: whatever is wrong with agenttap's options (bad value, no value,
repeated, misspelled, a list; from --set or from config.yaml) or with loading the addon itself, a
real mitmdump exits non-zero naming the option, and no request ever leaves it.

The full matrix (every option x every mistake x both sources, ~280 cases, from
``tests/support/fail_closed_cases.py``) is decided in-process, through mitmproxy's own script loader and
startup error check, in ``tests/unit/addons/test_fail_closed_matrix.py``: a real mitmdump per
case costs over a second of CPU just to import. The real processes here keep one case per source
and kind of mistake, each with an option of another kind: they show that the in-process verdict
is the one mitmdump reaches (it exits, it names the option, nothing arrives at the listener).
What needs a process stays here too: an addon that cannot be imported, and values users
naturally write read by a proxy that then answers.

mitmdump runs in upstream mode towards a stand-in listener that plays the internet: anything
mitmdump forwards (a CONNECT to api.openai.com, a plain-HTTP request) arrives there. The control
case proves that plain mitmdump's traffic does arrive, so an empty listener means something."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from policy_server import launcher as policy_server
from tests.support.fail_closed_cases import Case, cases, good_options, startup_inputs
from tests.support.paths import CAPTURE, MITMDUMP, REPO
from tests.support.stub_vllm import StubPolicy

# A deadline, not a wait: mitmdump exits within seconds (on a loaded 2-core machine, three at
# once beside another worker's vLLM boots, well past 30).
EXIT_WITHIN_S = 120


class StandInInternet:
    """A TCP listener that records the first line of whatever connects to it."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.hits: list[str] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._read, args=(conn,), daemon=True).start()

    def _read(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(5)
            try:
                data = conn.recv(4096)
            except OSError:
                data = b""
            with self._lock:
                self.hits.append(data.split(b"\r\n", 1)[0].decode(errors="replace"))

    def close(self) -> None:
        self.sock.close()


@pytest.fixture(scope="module")
def internet() -> Iterator[StandInInternet]:
    listener = StandInInternet()
    yield listener
    listener.close()


def _poke(port: int) -> None:
    """What an agent sends through the proxy: a CONNECT to an API host (with its key on the
    CONNECT, as some clients put it) and a plain-HTTP request with a key."""
    for request in (
        b"CONNECT api.openai.com:443 HTTP/1.1\r\nHost: api.openai.com:443\r\n"
        b"Proxy-Authorization: Basic c2Vzczp4\r\n\r\n",
        b"GET http://api.openai.com/v1/models HTTP/1.1\r\nHost: api.openai.com\r\n"
        b"Authorization: Bearer sk-live-key\r\nConnection: close\r\n\r\n",
    ):
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as sock:
                sock.sendall(request)
                sock.settimeout(1)
                sock.recv(1024)
        except OSError:
            pass


@dataclass
class Outcome:
    returncode: int | None  # None: still running after EXIT_WITHIN_S
    output: str
    hits: list[str]


def _run(
    args: list[str], internet: StandInInternet, confdir: Path, env: dict[str, str] | None = None
) -> Outcome:
    """mitmdump in upstream mode towards ``internet``, poked until it exits."""
    port = policy_server.free_port()
    before = len(internet.hits)
    cmd = [
        str(MITMDUMP), "--listen-host", "127.0.0.1", "--listen-port", str(port),
        "--mode", f"upstream:http://127.0.0.1:{internet.port}",
        "--set", f"confdir={confdir}", *args,
    ]  # fmt: skip
    # Its output to a file, not a pipe: a pipe nobody reads until it exits fills (64 kB) with
    # a line per poke on a slow start, and mitmdump then blocks writing and never exits.
    with tempfile.TemporaryFile() as output:
        proc = subprocess.Popen(cmd, stdout=output, stderr=subprocess.STDOUT, cwd=REPO, env=env)
        deadline = time.monotonic() + EXIT_WITHIN_S
        while proc.poll() is None and time.monotonic() < deadline:
            _poke(port)
            time.sleep(0.01)
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        output.seek(0)
        out = output.read()
    time.sleep(0.05)  # a forwarded request still in flight reaches the listener
    returncode = None if proc.returncode in (-9, 137) else proc.returncode
    return Outcome(returncode, out.decode(errors="replace"), internet.hits[before:])


@pytest.fixture(scope="module")
def base_confdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A confdir with a CA already made (each run copies it; making one costs time)."""
    from mitmproxy.certs import CertStore

    confdir = tmp_path_factory.mktemp("fail-closed-conf")
    CertStore.from_store(confdir, "mitmproxy", 2048)
    assert (confdir / "mitmproxy-ca.pem").exists()
    return confdir


def test_plain_mitmdump_does_reach_the_stand_in(
    internet: StandInInternet, base_confdir: Path
) -> None:
    """The control: without agenttap, the agent's CONNECT goes out (what a skipped addon means)."""
    port = policy_server.free_port()
    before = len(internet.hits)
    proc = subprocess.Popen(
        [
            str(MITMDUMP),
            "--listen-host",
            "127.0.0.1",
            "--listen-port",
            str(port),
            "--mode",
            f"upstream:http://127.0.0.1:{internet.port}",
            "--set",
            f"confdir={base_confdir}",
        ],  # fmt: skip
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not internet.hits[before:]:
            _poke(port)
            time.sleep(0.1)
    finally:
        proc.kill()
        proc.wait()
    assert any("api.openai.com" in hit for hit in internet.hits[before:]), internet.hits


# One real mitmdump per source and kind of mistake, each on an option of another kind (a URL, a
# text list, a number, a path, a bool, a path list): (source, mistake) -> option.
REAL_PROCESS_CASES = {
    ("--set", "bad value"): "agenttap_policy_url",
    ("--set", "no value"): "agenttap_hosts",
    ("--set", "repeated"): "agenttap_idle_timeout",
    ("--set", "misspelled"): "agenttap_tokenizer",
    ("yaml", "bad value"): "agenttap_responses_websocket",
    ("yaml", "no value"): "agenttap_out",
    ("yaml", "a list"): "agenttap_max_body_bytes",
    ("yaml", "misspelled"): "agenttap_sandbox_hide",
}


def test_each_kind_of_mistake_stops_mitmdump_and_nothing_leaves(
    internet: StandInInternet, base_confdir: Path, stub: StubPolicy, tmp_path: Path
) -> None:
    """One case of the matrix per source and kind of mistake, through a real mitmdump: it exits
    non-zero naming the option, and nothing reaches the listener. The in-process matrix reads
    the same verdict off an ERROR logged at startup and the addon's refusals."""
    a_file = tmp_path / "a-file"
    a_file.write_text("not a folder")
    good = good_options(stub.url, tmp_path / "out")

    def one(case: Case, index: int) -> tuple[str, str, str, str]:
        confdir = tmp_path / f"conf-{index}"
        shutil.copytree(base_confdir, confdir)
        sets, yaml_text = startup_inputs(case, good)
        if yaml_text is not None:
            (confdir / "config.yaml").write_text(yaml_text)
        args = [arg for spec in sets for arg in ("--set", spec)]
        outcome = _run(["-s", str(CAPTURE), *args], internet, confdir)
        if outcome.hits:
            verdict = f"FORWARDED {outcome.hits}"
        elif outcome.returncode is None:
            verdict = "kept running"
        elif outcome.returncode == 0:
            verdict = "exit 0"
        elif case.expected not in outcome.output:
            verdict = f"exit {outcome.returncode} without naming it: {outcome.output[-600:]}"
        else:
            verdict = "ok"
        return case.source, case.mistake, case.option, verdict

    chosen = [c for c in cases(a_file) if REAL_PROCESS_CASES.get((c.source, c.mistake)) == c.option]
    assert len(chosen) == len(REAL_PROCESS_CASES), chosen  # each one is in the matrix
    with ThreadPoolExecutor(max_workers=3) as pool:
        results = list(pool.map(one, chosen, range(len(chosen))))
    print(f"\n{'source':<7} {'mistake':<11} {'option':<30} result")
    for source, mistake, option, verdict in results:
        print(f"{source:<7} {mistake:<11} {option:<30} {verdict[:100]}")
    failed = [r for r in results if r[3] != "ok"]
    assert not failed, "\n".join(" | ".join(r) for r in failed)


def test_an_addon_that_cannot_load_stops_mitmdump(
    internet: StandInInternet, base_confdir: Path, stub: StubPolicy, tmp_path: Path
) -> None:
    """A dependency that fails to import (here pyarrow, shadowed) is an error at startup."""
    shadow = tmp_path / "shadow" / "pyarrow"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('pyarrow is broken here')\n")
    env = {**__import__("os").environ, "PYTHONPATH": str(shadow.parent)}
    args = ["-s", str(CAPTURE)]
    for name, value in good_options(stub.url, tmp_path / "out").items():
        args += ["--set", f"{name}={value}"]
    outcome = _run(args, internet, base_confdir, env=env)
    assert outcome.hits == []
    assert outcome.returncode not in (None, 0), outcome.output[-2000:]
    assert "pyarrow is broken here" in outcome.output


def test_values_users_naturally_write_are_read(
    internet: StandInInternet, base_confdir: Path, stub: StubPolicy, tmp_path: Path
) -> None:
    """YAML numbers and booleans in config.yaml, and yes/no/on/off/1/0 switches: read, and the
    proxy answers a call."""
    from tests.support.proxies import _wait_port

    confdir = tmp_path / "conf"
    shutil.copytree(base_confdir, confdir)
    (confdir / "config.yaml").write_text(
        "agenttap_idle_timeout: 30\n"
        "agenttap_max_body_bytes: 1048576\n"
        "agenttap_responses_websocket: false\n"
        "agenttap_responses_stored: 10\n"
    )
    port = policy_server.free_port()
    log = tmp_path / "mitmdump.log"
    args = [str(MITMDUMP), "-s", str(CAPTURE), "--listen-host", "127.0.0.1",
            "--listen-port", str(port), "--set", f"confdir={confdir}",
            "--set", "agenttap_responses_websocket=off"]  # fmt: skip
    for name, value in good_options(stub.url, tmp_path / "out").items():
        args += ["--set", f"{name}={value}"]
    with open(log, "wb") as fh:
        proc = subprocess.Popen(args, stdout=fh, stderr=subprocess.STDOUT, cwd=REPO)
    try:
        _wait_port(port, proc, log)
        from tests.support.hostile import post
        from tests.support.proxies import Proxy

        proxy = Proxy(port, tmp_path / "out", confdir / "mitmproxy-ca-cert.pem", log, proc)
        body = b'{"model": "m", "messages": [{"role": "user", "content": "Hi"}]}'
        answer = post(proxy, "natural", "openai.chat", body)
        assert answer.status == 200, answer.body
    finally:
        proc.terminate()
        proc.wait(30)
