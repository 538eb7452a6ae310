"""Issue 14 item 1, fail closed: whatever is wrong with agenttap's options (bad value, no value,
repeated, misspelled; from --set or from config.yaml) or with loading the addon itself, a real
mitmdump exits non-zero naming the option, and no request ever leaves it.

mitmdump runs in upstream mode towards a stand-in listener that plays the internet: anything
mitmdump forwards (a CONNECT to api.openai.com, a plain-HTTP request) arrives there. The control
case proves that plain mitmdump's traffic does arrive, so an empty listener means something."""

from __future__ import annotations

import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from rewriter import policy_server
from tests.conftest import CAPTURE, MITMDUMP, QWEN3, REPO
from tests.stub_vllm import StubPolicy

EXIT_WITHIN_S = 30


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
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=REPO, env=env
    )
    deadline = time.monotonic() + EXIT_WITHIN_S
    while proc.poll() is None and time.monotonic() < deadline:
        _poke(port)
        time.sleep(0.01)
    if proc.poll() is None:
        proc.kill()
    out, _ = proc.communicate()
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


# option -> a value it refuses (None: every text is a valid value for it)
BAD_VALUES: dict[str, str | None] = {
    "agenttap_policy_url": "ftp://policy",
    "agenttap_tokenizer": "/nonexistent/tokenizer",
    "agenttap_out": "{a_file}",
    "agenttap_tool_parser": "nope",
    "agenttap_reasoning_parser": "nope",
    "agenttap_hosts": "api openai com",
    "agenttap_idle_timeout": "soon",
    "agenttap_max_body_bytes": "8MB",
    "agenttap_policy_timeout": "0",
    "agenttap_policy_connections": "-1",
    "agenttap_stream_flush_ms": "20ms",
    "agenttap_replica_max_inflight": "-3",
    "agenttap_replica_queue": "lots",
    "agenttap_client_timeout": "1m",
    "agenttap_model_map": "claude-*",
    "agenttap_model_names": None,
    "agenttap_recompute_mismatch_logprobs": "maybe",
    "agenttap_drop_system_blocks": "([",
    "agenttap_responses_stored": "-5",
    "agenttap_responses_websocket": "maybe",
    "agenttap_api_host": "not a host!",
    "agenttap_api_port": "http",
    "agenttap_token": "short",
    "agenttap_token_file": "/nonexistent/token",
    "agenttap_require_session_secret": "maybe",
    "agenttap_sandbox": "docker",
    "agenttap_sandbox_hide": None,
    "agenttap_sandbox_expose": None,
    "agenttap_weights_tolerance": "-0.1",
    "agenttap_weights_check_s": "soon",
    "agenttap_advertise_host": "not a host!",
    "agenttap_max_rollouts": "0",
    "agenttap_max_staleness": "-1",
    "agenttap_passthrough": "*.openai.com",
    "agenttap_check_policy": "maybe",
    "agenttap_journal_fsync": "sometimes",
}


def test_every_option_is_in_the_matrix() -> None:
    from capture.options import all_options

    assert sorted(BAD_VALUES) == sorted(o.name for o in all_options())


def _good_options(stub_url: str, out: Path) -> dict[str, str]:
    return {
        "agenttap_policy_url": stub_url,
        "agenttap_tokenizer": str(QWEN3),
        "agenttap_out": str(out),
    }


def _cases(a_file: Path) -> list[tuple[str, str, str, str, str]]:
    """(source, mistake, option, --set arguments or config.yaml text, expected words)."""
    cases = []
    for option, bad in BAD_VALUES.items():
        typo = option.replace("agenttap_", "agenttap_x")
        if bad is not None:
            bad = bad.format(a_file=a_file)
            cases.append(("--set", "bad value", option, f"--set\0{option}={bad}", option))
            cases.append(("yaml", "bad value", option, f'{option}: "{bad}"\n', option))
        cases.append(("--set", "no value", option, f"--set\0{option}", f"{option} has no value"))
        cases.append(
            ("--set", "repeated", option,
             f"--set\0{option}=a\0--set\0{option}=b", f"{option} given more than once")
        )  # fmt: skip
        cases.append(("--set", "misspelled", option, f"--set\0{typo}=1", typo))
        cases.append(("yaml", "no value", option, f"{option}:\n", f"{option} has no value"))
        cases.append(("yaml", "a list", option, f"{option}: [a, b]\n", option))
        cases.append(("yaml", "misspelled", option, f"{typo}: 1\n", typo))
    return cases


def test_every_mistake_stops_mitmdump_and_nothing_leaves(
    internet: StandInInternet, base_confdir: Path, stub: StubPolicy, tmp_path: Path
) -> None:
    a_file = tmp_path / "a-file"
    a_file.write_text("not a folder")
    good = _good_options(stub.url, tmp_path / "out")

    def one(case: tuple[str, str, str, str, str], index: int) -> tuple[str, str, str, str]:
        source, mistake, option, spec, expected = case
        confdir = tmp_path / f"conf-{index}"
        shutil.copytree(base_confdir, confdir)
        settings = dict(good)
        args: list[str] = []
        if source == "--set":
            args = spec.split("\0")
            for arg in args:
                settings.pop(arg.split("=", 1)[0], None)
        else:
            (confdir / "config.yaml").write_text(spec)
            settings.pop(spec.split(":", 1)[0], None)
        for name, value in settings.items():
            args += ["--set", f"{name}={value}"]
        outcome = _run(["-s", str(CAPTURE), *args], internet, confdir)
        if outcome.hits:
            verdict = f"FORWARDED {outcome.hits}"
        elif outcome.returncode is None:
            verdict = "kept running"
        elif outcome.returncode == 0:
            verdict = "exit 0"
        elif expected not in outcome.output:
            verdict = f"exit {outcome.returncode} without naming it: {outcome.output[-600:]}"
        else:
            verdict = "ok"
        return source, mistake, option, verdict

    cases = _cases(a_file)
    with ThreadPoolExecutor(max_workers=3) as pool:
        results = list(pool.map(one, cases, range(len(cases))))
    print(f"\n{'source':<7} {'mistake':<11} {'option':<30} result")
    for source, mistake, option, verdict in results:
        print(f"{source:<7} {mistake:<11} {option:<30} {verdict[:100]}")
    failed = [r for r in results if r[3] != "ok"]
    assert not failed, "\n".join(" | ".join(r) for r in failed)
    assert len(results) >= 100


def test_an_addon_that_cannot_load_stops_mitmdump(
    internet: StandInInternet, base_confdir: Path, stub: StubPolicy, tmp_path: Path
) -> None:
    """A dependency that fails to import (here pyarrow, shadowed) is an error at startup."""
    shadow = tmp_path / "shadow" / "pyarrow"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('pyarrow is broken here')\n")
    env = {**__import__("os").environ, "PYTHONPATH": str(shadow.parent)}
    args = ["-s", str(CAPTURE)]
    for name, value in _good_options(stub.url, tmp_path / "out").items():
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
    from tests.conftest import _wait_port

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
    for name, value in _good_options(stub.url, tmp_path / "out").items():
        args += ["--set", f"{name}={value}"]
    with open(log, "wb") as fh:
        proc = subprocess.Popen(args, stdout=fh, stderr=subprocess.STDOUT, cwd=REPO)
    try:
        _wait_port(port, proc, log)
        from tests.conftest import Proxy
        from tests.hostile import post

        proxy = Proxy(port, tmp_path / "out", confdir / "mitmproxy-ca-cert.pem", log, proc)
        body = b'{"model": "m", "messages": [{"role": "user", "content": "Hi"}]}'
        answer = post(proxy, "natural", "openai.chat", body)
        assert answer.status == 200, answer.body
    finally:
        proc.terminate()
        proc.wait(30)
