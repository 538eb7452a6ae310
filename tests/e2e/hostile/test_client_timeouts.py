"""Issue 14 item 3: client timeouts. A connection that sends nothing, or a header or body a byte
at a time, is closed after agenttap_client_timeout; so is a keep-alive connection idle after its
answer. An answer that takes longer than the timeout is never cut."""

from __future__ import annotations

import json
import socket
import ssl
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.hostile import good_body, post
from tests.support.proxies import Proxy, start_proxy
from tests.support.stub_vllm import StubPolicy

TIMEOUT_S = 2
CLOSED_WITHIN_S = 20  # generous on a loaded machine; mitmproxy's own timeout is 600 s


@pytest.fixture(scope="module")
def strict_proxy(
    stub: StubPolicy, confdir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Proxy]:
    out = tmp_path_factory.mktemp("strict-proxy") / "out"
    proxy = start_proxy(
        stub.url, out, confdir, extra=["--set", f"agenttap_client_timeout={TIMEOUT_S}"]
    )
    yield proxy
    proxy.stop()


def _closed_after(sock: socket.socket | ssl.SSLSocket, trickle: bytes = b"") -> float:
    """Seconds until the proxy closes ``sock``, sending ``trickle`` a byte every 0.5 s; fails
    if it is still open after CLOSED_WITHIN_S."""
    start = time.monotonic()
    sock.settimeout(0.5)
    sent = 0
    while time.monotonic() - start < CLOSED_WITHIN_S:
        try:
            if sock.recv(65536) == b"":
                return time.monotonic() - start
        except (TimeoutError, ssl.SSLWantReadError):
            pass
        except (ConnectionResetError, ssl.SSLError, OSError):
            return time.monotonic() - start
        if sent < len(trickle):
            try:
                sock.sendall(trickle[sent : sent + 1])
            except OSError:
                return time.monotonic() - start
            sent += 1
    pytest.fail(f"the connection was still open after {CLOSED_WITHIN_S} s")


def test_a_connection_that_sends_nothing_is_closed(strict_proxy: Proxy) -> None:
    with socket.create_connection(("127.0.0.1", strict_proxy.port)) as sock:
        assert _closed_after(sock) >= TIMEOUT_S - 0.5


def test_a_header_sent_a_byte_at_a_time_is_cut_off(strict_proxy: Proxy) -> None:
    header = (
        b"POST http://api.openai.com/v1/chat/completions HTTP/1.1\r\n" + b"X-Slow: " + b"a" * 200
    )
    with socket.create_connection(("127.0.0.1", strict_proxy.port)) as sock:
        _closed_after(sock, trickle=header)


def _tunnel(proxy: Proxy) -> ssl.SSLSocket:
    raw = socket.create_connection(("127.0.0.1", proxy.port), timeout=10)
    raw.sendall(b"CONNECT api.openai.com:443 HTTP/1.1\r\nHost: api.openai.com:443\r\n\r\n")
    assert b" 200 " in raw.recv(4096)
    context = ssl.create_default_context(cafile=str(proxy.ca))
    return context.wrap_socket(raw, server_hostname="api.openai.com")


def test_a_tunnel_with_no_request_is_closed(strict_proxy: Proxy) -> None:
    with _tunnel(strict_proxy) as sock:
        _closed_after(sock)


def test_a_body_sent_a_byte_at_a_time_is_cut_off(strict_proxy: Proxy) -> None:
    body = json.dumps(good_body("openai.chat")).encode()
    with _tunnel(strict_proxy) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: api.openai.com\r\n"
            b"Content-Type: application/json\r\n" + f"Content-Length: {len(body)}\r\n\r\n".encode()
        )
        _closed_after(sock, trickle=body)


def test_an_idle_keep_alive_connection_is_closed_after_its_answer(strict_proxy: Proxy) -> None:
    body = json.dumps(good_body("openai.chat")).encode()
    with _tunnel(strict_proxy) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: api.openai.com\r\n"
            b"Content-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        sock.settimeout(30)
        answer = b""
        while b'"finish_reason"' not in answer:
            chunk = sock.recv(65536)
            assert chunk, answer
            answer += chunk
        assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
        _closed_after(sock)


def test_an_answer_slower_than_the_timeout_is_not_cut(
    strict_proxy: Proxy, stub: StubPolicy
) -> None:
    """The clock stops while the proxy answers: a stream that lasts 3x the timeout completes."""
    stub.script("one two three four five six seven eight nine ten eleven twelve")
    stub.chunk_delay_s = TIMEOUT_S * 3 / 12
    try:
        body = json.dumps(good_body("openai.chat", stream=True)).encode()
        start = time.monotonic()
        answer = post(strict_proxy, "slow-answer", "openai.chat", body, timeout=120)
        took = time.monotonic() - start
    finally:
        stub.chunk_delay_s = 0.0
    assert answer.status == 200
    assert b"[DONE]" in answer.body, answer.body[-300:]
    assert took > TIMEOUT_S, f"the answer took only {took:.1f} s: nothing was tested"
