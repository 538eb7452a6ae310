"""Starting the gateway and saying so: its ``GatewayConfig`` from the parsed settings (the CA
bundle written beside mitmproxy's CA), the start-up lines and the ``export`` line a shell
sources, then the ``agenttap ready:`` line once the proxy's listener and the API listener each
accept a connection (the start-up check's own connections left out of mitmproxy's log)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import socket
from pathlib import Path
from typing import Any

from mitmproxy import ctx

from capture.control.api import ControlAPI, banner_lines
from capture.control.api import build as build_control_api
from capture.control.banner import export_line, ready_line, start_lines
from capture.control.endpoints import write_ca_bundle
from capture.gateway import Gateway, GatewayConfig
from capture.listeners import advertised_host, url_host
from capture.options import Settings
from rewriter.template import ChatTemplate

logger = logging.getLogger(__name__)

# How long the start-up check waits for both listeners to accept a connection.
READY_WAIT_S = 10.0


class _ProbeQuiet(logging.Filter):
    """Drops mitmproxy's ``client connect`` / ``client disconnect`` lines of the start-up
    check's own connections (known by their local port) and nothing else."""

    MESSAGES = ("client connect", "client disconnect")

    def __init__(self) -> None:
        super().__init__()
        self.ports: set[int] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        client = getattr(record, "client", None)
        if not client or len(client) < 2 or client[1] not in self.ports:
            return True
        message = record.getMessage()
        if message not in self.MESSAGES:
            return True
        if message == "client disconnect":
            self.ports.discard(client[1])
        return False


_PROBE_QUIET = _ProbeQuiet()
logging.getLogger("mitmproxy.proxy.server").addFilter(_PROBE_QUIET)


def _loopback(host: str) -> str:
    """Where to reach a listener bound to ``host`` from this machine."""
    if host in ("", "0.0.0.0", "*"):
        return "127.0.0.1"
    return "::1" if host == "::" else host


async def accepts(host: str, port: int, timeout: float = 2.0) -> bool:
    """A TCP connection to ``host:port`` opens (then it is closed at once)."""
    loop = asyncio.get_running_loop()
    host = _loopback(host)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setblocking(False)
        try:
            sock.bind((host, 0))  # the local port is known before mitmproxy logs the connect
        except OSError:
            return False
        local_port = sock.getsockname()[1]
        _PROBE_QUIET.ports.add(local_port)
        try:
            await asyncio.wait_for(loop.sock_connect(sock, (host, port)), timeout)
        except (OSError, TimeoutError):
            _PROBE_QUIET.ports.discard(local_port)
            return False
    return True


async def start_gateway(settings: Settings, template: ChatTemplate | None) -> Gateway:
    """The gateway configured from ``settings`` (a policy and a tokenizer given: the caller
    checked), started (both its listeners bound)."""
    assert settings.tokenizer is not None
    ca = Path(ctx.options.confdir).expanduser() / "mitmproxy-ca-cert.pem"
    try:
        bundle = write_ca_bundle(ca)
    except OSError as exc:
        logger.warning("agenttap: could not write the CA bundle beside %s (%s)", ca, exc)
        bundle = ca
    config = GatewayConfig(
        policy_urls=settings.policy_urls,
        tokenizer_path=settings.tokenizer,
        out_dir=settings.out,
        tool_parser=settings.tool_parser,
        reasoning_parser=settings.reasoning_parser,
        idle_timeout_s=settings.idle_timeout_s,
        max_body_bytes=settings.max_body_bytes,
        policy_timeout_s=settings.policy_timeout_s,
        stream_flush_s=settings.stream_flush_ms / 1000,
        policy_max_connections=settings.policy_connections,
        replica_max_inflight=settings.replica_max_inflight,
        replica_queue=settings.replica_queue,
        session_max_inflight=settings.session_max_inflight,
        weights_tolerance=settings.weights_tolerance,
        weights_check_s=settings.weights_check_s,
        model_map=settings.model_map,
        model_names=settings.model_names,
        recompute_logprobs=settings.recompute_logprobs,
        fsync_before_reply=settings.fsync_before_reply,
        provider_options=settings.provider_options,
        api_host=settings.api_host,
        api_port=settings.api_port,
        token=settings.token,
        advertise_host=settings.advertise_host,
        max_rollouts=settings.max_rollouts,
        rollout_memory_mb=settings.rollout_memory_mb,
        proxy_url=await proxy_url(settings.advertise_host),
        ca_path=str(ca),
        bundle_path=str(bundle),
        require_session_secret=settings.require_session_secret,
        max_staleness=settings.max_staleness,
        sandbox=settings.sandbox,
        confdir=str(ca.parent),
        sandbox_hide=settings.sandbox_hide
        + ((settings.token_file,) if settings.token_file is not None else ()),
        sandbox_expose=settings.sandbox_expose,
        sandbox_paths=settings.sandbox_paths,
        rollout_max_connections=settings.rollout_max_connections,
    )
    gateway = Gateway(config, template, control_plane=build_control_api)
    await gateway.start()
    return gateway


def announce_start(gateway: Gateway, hosts: frozenset[str]) -> None:
    """The start-up lines for a person, and the ``export`` line on stdout."""
    config = gateway.config
    warn_if_open()
    logger.info(
        "agenttap: answering %s from %s; shards in %s",
        ", ".join(sorted(hosts)),
        ", ".join(config.policy_urls),
        os.path.abspath(config.out_dir),
    )
    assert isinstance(gateway.api, ControlAPI)
    endpoints = gateway.api.endpoints
    if not ctx.options.server:  # mitmdump -n: no proxy to point a client at
        endpoints = dataclasses.replace(endpoints, proxy_url="")
    for line in start_lines(banner_lines(gateway.api), endpoints):
        logger.info("%s", line)
    # The line a shell sources, on stdout without the log's prefix (whoever started
    # mitmdump holds its stdout: a terminal, the launcher's private log).
    print(
        export_line(
            endpoints.api_url,
            gateway.api_token,
            str(config.tokenizer_path),
            ",".join(config.policy_urls),
        ),
        flush=True,
    )


async def announce_ready(gateway: Gateway, hosts: frozenset[str]) -> None:
    """The last start-up line, once the proxy's listener (unless mitmdump runs without one,
    -n) and the API listener each accept a connection."""
    listeners = []
    if ctx.options.server:
        listeners = [(h, p) for h, p, *_ in listen_addrs()] or [("", 0)]
    api_host = gateway.config.api_host
    if api_host is not None:
        listeners.append((api_host, gateway.api_port))
    loop = asyncio.get_running_loop()
    deadline = loop.time() + READY_WAIT_S
    waiting = list(listeners)
    while waiting and loop.time() < deadline:
        waiting = [(h, p) for h, p in waiting if not (p and await accepts(h, p))]
        if waiting:
            await asyncio.sleep(0.1)
    if waiting:
        logger.error(
            "agenttap: not ready: nothing accepts connections at %s after %.0f s",
            ", ".join(f"{_loopback(h)}:{p}" for h, p in waiting),
            READY_WAIT_S,
        )
        return
    proxy = gateway.config.proxy_url if ctx.options.server else "(none: mitmdump -n)"
    logger.info("%s", ready_line(proxy, hosts, gateway.config.policy_urls))


def listen_addrs() -> list[Any]:
    server: Any = ctx.master.addons.get("proxyserver")
    return list(server.listen_addrs()) if server is not None else []


async def proxy_url(advertise: str) -> str:
    """mitmdump's own listener as clients elsewhere reach it (its port may be 0: a free
    one, known once its server listens)."""
    addrs: list[Any] = []
    for _ in range(100):
        addrs = listen_addrs()
        if addrs:
            break
        await asyncio.sleep(0.05)
    host = ctx.options.listen_host
    port = addrs[0][1] if addrs else ctx.options.listen_port or 8080
    return f"http://{url_host(advertised_host(host, advertise))}:{port}"


def warn_if_open() -> None:
    host = ctx.options.listen_host
    if host not in ("127.0.0.1", "localhost", "::1") and not ctx.options.proxyauth:
        logger.warning(
            "agenttap: listening on %s with no proxy authentication: anyone who can reach "
            "this port can use the policy and write shards. Pass --listen-host 127.0.0.1 "
            "(scripts/run_proxy.sh does), or --set proxyauth=USER:PASS.",
            host or "all interfaces",
        )
