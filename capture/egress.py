"""Where a sandboxed agent may go beyond the policy: a rollout's ``"egress"``.

``none`` (the default): nowhere; the proxy refuses every host but the API hosts (and
``agenttap_passthrough``). ``public``: a session of such a rollout may also open HTTPS tunnels
(CONNECT) to hosts whose every address is public, as a package index or the web. Never to
loopback, private, shared (CGNAT), link-local, multicast or unspecified addresses (nor their
IPv6 and IPv4-mapped forms): the policy servers, the control API, other instances and the
host's own services all live there. The address checked is the address dialled (the tunnel is
pinned to it), so a name that resolves elsewhere a moment later (DNS rebinding) gains nothing.

Pure: no mitmproxy here (addons/capture.py asks ``public_address``).
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket

EGRESS_NONE = "none"
EGRESS_PUBLIC = "public"

# Never dialled for an agent, whatever the rollout asks.
CLOSED_NETWORKS = tuple(
    ipaddress.ip_network(net)
    for net in (
        "0.0.0.0/8", "10.0.0.0/8", "100.64.0.0/10", "127.0.0.0/8", "169.254.0.0/16",
        "172.16.0.0/12", "192.0.0.0/24", "192.168.0.0/16", "198.18.0.0/15", "224.0.0.0/4",
        "240.0.0.0/4", "::/128", "::1/128", "fc00::/7", "fe80::/10", "ff00::/8",
    )
)  # fmt: skip


class EgressRefused(Exception):
    """Why a public-egress tunnel is refused, in words for the log and the agent."""


def is_open(address: str) -> bool:
    """``address`` (an IP) may be dialled for a public-egress session."""
    ip = ipaddress.ip_address(address)
    if isinstance(ip, ipaddress.IPv6Address):
        inner = ip.ipv4_mapped or ip.sixtofour
        if inner is not None:
            return is_open(str(inner))
    return not any(ip in net for net in CLOSED_NETWORKS)


async def public_address(host: str, port: int) -> str:
    """The address to dial for ``host:port``: its first address, if every address it resolves
    to is open (``is_open``); else EgressRefused, naming the closed one."""
    try:
        ipaddress.ip_address(host)
        addresses = [host]
    except ValueError:
        loop = asyncio.get_running_loop()
        try:
            infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError as exc:
            raise EgressRefused(f"{host} does not resolve ({exc})") from None
        addresses = list(dict.fromkeys(str(info[4][0]) for info in infos))
    if not addresses:
        raise EgressRefused(f"{host} resolves to no address")
    for address in addresses:
        if not is_open(address):
            raise EgressRefused(
                f"{host} resolves to {address}, a loopback, private or link-local address an "
                'agent may never reach ("egress": "public" opens public hosts only)'
            )
    return addresses[0]
