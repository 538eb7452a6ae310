"""Where a policy server listens: a TCP URL (``http://HOST:PORT``) or a unix socket
(``unix:/PATH/vllm.sock``, vLLM's ``--uds PATH``).

A unix socket in a folder only its owner may open is the one way to serve vLLM's dev-mode
routes (``/pause``, ``/sleep``, ``/collective_rpc`` reload_weights, ``/update_weight_version``)
to agenttap alone: vLLM's ``--api-key`` guards only ``/v1``, ``/v2``, ``/inference`` and
``/cohere``, and anything on the host that can open a TCP connection can reach a loopback port.

The spelling is one: ``unix:`` then the socket's absolute path. The URL names the server (in
logs, replicas, metrics); the HTTP requests to it go to ``http://localhost/...`` over the socket.
"""

from __future__ import annotations

import http.client
import socket
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any

import aiohttp

UNIX_SCHEME = "unix:"
# The Host of HTTP requests sent over a unix socket (vLLM answers whatever it is).
UNIX_HTTP_BASE = "http://localhost"
# sun_path holds 108 bytes, the final NUL among them.
MAX_SOCKET_PATH_BYTES = 107
# Characters that separate URLs in the options (agenttap_policy_url, agenttap_model_map).
_SEPARATORS = ",|"
EXAMPLES = "http://127.0.0.1:8000 or unix:/path/to/vllm.sock"


@dataclass(frozen=True)
class PolicyAddress:
    """A parsed policy URL: ``url`` as given (its name everywhere), ``socket_path`` for a unix
    socket (None: TCP) and ``http_base``, what HTTP requests to it are addressed to."""

    url: str
    socket_path: str | None
    http_base: str

    def http_url(self, path: str) -> str:
        return f"{self.http_base}{path}"


def is_unix(url: str) -> bool:
    return url.strip().startswith(UNIX_SCHEME)


def unix_url(path: str) -> str:
    """The policy URL of a socket at ``path``."""
    return f"{UNIX_SCHEME}{path}"


def parse_policy_url(text: str) -> PolicyAddress:
    """``http(s)://HOST[:PORT]`` or ``unix:/ABSOLUTE/PATH``; ValueError says what is wrong."""
    url = text.strip()
    if is_unix(url):
        path = url[len(UNIX_SCHEME) :]
        if not path.startswith("/") or path.startswith("//"):
            raise ValueError(
                f"{text!r} is not a unix socket URL: write unix: then the socket's absolute "
                "path, such as unix:/tmp/agenttap-x/vllm.sock"
            )
        if any(c in path for c in _SEPARATORS) or not path.isprintable():
            raise ValueError(
                f"{text!r}: a socket path with a comma, a | or an unprintable character cannot "
                "be listed in an option; move the socket"
            )
        if len(path.encode()) > MAX_SOCKET_PATH_BYTES:
            raise ValueError(
                f"{text!r}: the socket path is {len(path.encode())} bytes, more than the "
                f"{MAX_SOCKET_PATH_BYTES} a unix socket's path may hold; use a shorter one"
            )
        return PolicyAddress(url=url, socket_path=path, http_base=UNIX_HTTP_BASE)
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{text!r} is not a policy URL such as {EXAMPLES}")
    try:
        parts.port  # noqa: B018 (a bad port raises here)
    except ValueError:
        raise ValueError(f"{text!r} has a bad port") from None
    return PolicyAddress(url=url, socket_path=None, http_base=url.rstrip("/"))


# -- aiohttp ----------------------------------------------------------------------------------
# How long an idle connection to a policy server is kept for reuse: under the server's own
# (uvicorn's --timeout-keep-alive, 5 s by default), so a request is never written to a
# connection the server is closing (a broken pipe, found in a weight update's /pause).
KEEPALIVE_S = 4.0


def tcp_connector(limit: int = 100) -> aiohttp.TCPConnector:
    """A connection pool to policy servers over TCP (one pool may serve several)."""
    return aiohttp.TCPConnector(limit=limit, keepalive_timeout=KEEPALIVE_S)


def connector(url: str, limit: int = 100) -> aiohttp.BaseConnector:
    """A connection pool to the server at ``url``: TCP, or its unix socket."""
    addr = parse_policy_url(url)
    if addr.socket_path is not None:
        return aiohttp.UnixConnector(
            path=addr.socket_path, limit=limit, keepalive_timeout=KEEPALIVE_S
        )
    return tcp_connector(limit)


def serves(session: Any, url: str) -> bool:
    """Whether ``session`` reaches the server at ``url``: a unix socket's server only through
    a connector to that socket (a TCP pool would send its requests to localhost's port 80)."""
    path = parse_policy_url(url).socket_path
    conn = getattr(session, "connector", None)
    if path is None:
        return not isinstance(conn, aiohttp.UnixConnector)
    return isinstance(conn, aiohttp.UnixConnector) and conn.path == path


# -- the standard library (start-up checks, waiting for a server) -----------------------------
class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, socket_path: str, host: str, timeout: float | None = None) -> None:
        super().__init__(host, timeout=timeout)
        self._socket_path = socket_path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(self.timeout)
            sock.connect(self._socket_path)
        except OSError:
            sock.close()
            raise
        self.sock = sock


class _UnixHandler(urllib.request.HTTPHandler):
    def __init__(self, socket_path: str) -> None:
        super().__init__()
        self._socket_path = socket_path

    def http_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        def connection(host: str, timeout: float | None = None, **_: Any) -> _UnixConnection:
            return _UnixConnection(self._socket_path, host, timeout)

        return self.do_open(connection, req)  # type: ignore[arg-type]


def urlopen(
    url: str,
    path: str,
    data: bytes | None = None,
    headers: dict[str, str] | None = None,
    timeout: float = 10.0,
    method: str | None = None,
) -> Any:
    """``urllib.request.urlopen`` of ``path`` on the server at ``url``; the same errors
    (HTTPError for a status of 400 or more, URLError or OSError for no answer)."""
    addr = parse_policy_url(url)
    req = urllib.request.Request(
        addr.http_url(path), data=data, headers=headers or {}, method=method
    )
    if addr.socket_path is None:
        return urllib.request.urlopen(req, timeout=timeout)
    # No proxy from the environment: the request never leaves this host.
    opener = urllib.request.build_opener(
        urllib.request.ProxyHandler({}), _UnixHandler(addr.socket_path)
    )
    return opener.open(req, timeout=timeout)
