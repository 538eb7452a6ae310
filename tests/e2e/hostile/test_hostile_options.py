"""Issue 10 item 1: a bad agenttap option (including one given twice, which mitmproxy's own
loader would answer by skipping the addon) stops mitmdump with a clear error, and the proxy never
forwards a request while it is going down."""

from __future__ import annotations

import http.server
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from policy_server import launcher as policy_server
from tests.support.paths import CAPTURE, MITMDUMP, QWEN3, REPO
from tests.support.proxies import agenttap_options
from tests.support.stub_vllm import StubPolicy


class _Recorder(http.server.BaseHTTPRequestHandler):
    hits: list[str] = []

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        _Recorder.hits.append(self.path)
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"reached")

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture()
def loopback_target() -> tuple[int, list[str]]:
    _Recorder.hits = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1], _Recorder.hits
    server.shutdown()


def _try_forward(proxy_port: int, target_port: int) -> None:
    """A plain-HTTP proxy request for the loopback target, with a client credential."""
    try:
        with socket.create_connection(("127.0.0.1", proxy_port), timeout=2) as sock:
            sock.sendall(
                f"GET http://127.0.0.1:{target_port}/secret HTTP/1.1\r\n"
                f"Host: 127.0.0.1:{target_port}\r\nAuthorization: Bearer sk-live\r\n"
                "Connection: close\r\n\r\n".encode()
            )
            sock.recv(4096)
    except OSError:
        pass


def _options_without_idle_timeout(policy_url: str, out: Path, confdir: Path) -> list[str]:
    options = agenttap_options(policy_url, out, confdir, QWEN3, 300)
    at = options.index("agenttap_idle_timeout=300")
    return options[: at - 1] + options[at + 1 :]


@pytest.mark.parametrize(
    ("setting", "named"),
    [
        ("agenttap_idle_timeout=abc", "agenttap_idle_timeout"),
        ("agenttap_idle_timeout=1.5", "agenttap_idle_timeout"),
        ("agenttap_max_body_bytes=8MB", "agenttap_max_body_bytes"),
        ("agenttap_max_body_bytes=-1", "agenttap_max_body_bytes"),
        ("agenttap_idel_timeout=5", "agenttap_idel_timeout"),
        # zero would turn the policy's read timeout off: a hung policy would hang every client
        ("agenttap_policy_timeout=0", "agenttap_policy_timeout=0 is not allowed"),
        # given twice: mitmproxy's own loader would raise and skip the addon
        ("agenttap_out=a --set agenttap_out=b", "agenttap_out given more than once"),
    ],
)
def test_bad_option_stops_the_proxy_without_forwarding(
    setting: str,
    named: str,
    stub: StubPolicy,
    confdir: Path,
    tmp_path: Path,
    loopback_target: tuple[int, list[str]],
) -> None:
    target_port, hits = loopback_target
    port = policy_server.free_port()
    cmd = [
        str(MITMDUMP), "-s", str(CAPTURE),
        "--listen-host", "127.0.0.1", "--listen-port", str(port),
        *_options_without_idle_timeout(stub.url, tmp_path / "out", confdir),
        *[arg for value in setting.split(" --set ") for arg in ("--set", value)],
    ]  # fmt: skip
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=REPO, text=True
    )
    deadline = time.monotonic() + 30
    while proc.poll() is None and time.monotonic() < deadline:
        _try_forward(port, target_port)
        time.sleep(0.02)
    if proc.poll() is None:
        proc.kill()
        proc.wait()
        pytest.fail(f"mitmdump kept running with --set {setting}")
    output = proc.stdout.read() if proc.stdout else ""
    assert proc.returncode != 0, output
    assert named in output, output
    assert hits == [], f"the proxy forwarded {hits} while misconfigured"


OPEN_WARNING = "with no proxy authentication: anyone who can reach this port"


@pytest.mark.parametrize(
    ("extra", "warned"),
    [
        (["--listen-host", "0.0.0.0"], True),
        (["--listen-host", "0.0.0.0", "--set", "proxyauth=trainer:secret"], False),
        ([], False),  # start_proxy's own --listen-host 127.0.0.1
    ],
    ids=["all-interfaces", "all-interfaces-with-auth", "loopback"],
)
def test_listening_beyond_loopback_without_auth_is_warned(
    stub: StubPolicy, confdir: Path, tmp_path: Path, extra: list[str], warned: bool
) -> None:
    from tests.support.proxies import start_proxy

    proxy = start_proxy(stub.url, tmp_path / "out", confdir, extra=extra)
    try:
        log = proxy.log.read_text(errors="replace")
    finally:
        proxy.stop()
    assert (OPEN_WARNING in log) == warned, log[-2000:]
