"""Issue 10 item 5 regression, through the real proxy: a 400 MB body is refused with the
provider's 413 without the proxy buffering it (peak RSS of mitmdump measured)."""

from __future__ import annotations

import base64
import json
import socket
import ssl
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.hostile import Answer, assert_provider_error, good_body, post
from tests.support.proxies import Proxy, start_proxy
from tests.support.stub_vllm import StubPolicy

BODY_BYTES = 400 * 1024 * 1024
MEASURED: dict[str, int] = {}


def peak_rss(pid: int) -> int:
    """VmHWM: the most resident memory the process has had, in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM in /proc status")


@pytest.fixture(scope="module")
def fresh_proxy(
    stub: StubPolicy, confdir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Proxy]:
    proxy = start_proxy(stub.url, tmp_path_factory.mktemp("memory-proxy") / "out", confdir)
    yield proxy
    proxy.proc.terminate()
    proxy.proc.wait(timeout=30)


def send_huge(proxy: Proxy, session: str, host: str, path: str, size: int) -> Answer:
    """Declare ``size`` bytes and send them in 1 MiB pieces (until the proxy hangs up)."""
    raw = socket.create_connection(("127.0.0.1", proxy.port), timeout=60)
    auth = base64.b64encode(f"{session}:x".encode()).decode()
    raw.sendall(
        f"CONNECT {host}:443 HTTP/1.1\r\nHost: {host}:443\r\n"
        f"Proxy-Authorization: Basic {auth}\r\n\r\n".encode()
    )
    assert b" 200 " in raw.recv(4096)
    ctx = ssl.create_default_context(cafile=str(proxy.ca))
    sock = ctx.wrap_socket(raw, server_hostname=host)
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"anthropic-version: 2023-06-01\r\nContent-Length: {size}\r\n\r\n"
    )
    sock.sendall(head.encode())
    piece = b"x" * (1 << 20)
    sent = 0
    try:
        while sent < size:
            sock.sendall(piece)
            sent += len(piece)
    except (BrokenPipeError, ConnectionResetError, ssl.SSLError):
        pass
    data = b""
    try:
        while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < _length(data):
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    finally:
        sock.close()
    MEASURED["sent_bytes"] = sent
    head_part, _, body = data.partition(b"\r\n\r\n")
    lines = head_part.decode().split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:] if ": " in line)
    return Answer(int(lines[0].split()[1]), headers.get("content-type", ""), body)


def _length(data: bytes) -> int:
    for line in data.split(b"\r\n\r\n", 1)[0].split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return int(line.split(b":", 1)[1])
    return 0


@pytest.mark.parametrize(
    ("protocol", "host", "path"),
    [
        ("openai.chat", "api.openai.com", "/v1/chat/completions"),
        ("anthropic", "api.anthropic.com", "/v1/messages"),
    ],
)
def test_400mb_body_is_refused_without_buffering_it(
    fresh_proxy: Proxy, protocol: str, host: str, path: str
) -> None:
    session = f"huge-{uuid.uuid4().hex[:6]}"
    # Warm the proxy first: the baseline includes a served call.
    ok = post(fresh_proxy, session, protocol, json.dumps(good_body(protocol)).encode())
    assert ok.status == 200, ok.body[:300]
    before = peak_rss(fresh_proxy.proc.pid)
    answer = send_huge(fresh_proxy, session, host, path, BODY_BYTES)
    after = peak_rss(fresh_proxy.proc.pid)
    print(
        f"mitmdump peak RSS {before / 2**20:.0f} MiB -> {after / 2**20:.0f} MiB for a 400 MB body"
    )
    assert answer.status == 413, answer.body[:300]
    err = assert_provider_error(protocol, answer)
    assert str(BODY_BYTES) in err["message"], err
    assert after - before < 64 * 2**20, f"the proxy grew {(after - before) / 2**20:.0f} MiB"
    assert fresh_proxy.proc.poll() is None
    again = post(fresh_proxy, session, protocol, json.dumps(good_body(protocol)).encode())
    assert again.status == 200, again.body[:300]
