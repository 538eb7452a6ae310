"""Where a sandboxed agent may go beyond the policy: a rollout's ``"egress"``.

``none`` (the default): nowhere; the proxy refuses every host but the API hosts (and
``agenttap_passthrough``). ``public``: a session of such a rollout may also open HTTPS tunnels
(CONNECT) to hosts whose every address is public, as a package index or the web. Never to
loopback, private, shared (CGNAT), link-local, multicast or unspecified addresses: the policy
servers, the control API, other instances and the host's own services all live there. The
address checked is the address dialled (the tunnel is pinned to it), so a name that resolves
elsewhere a moment later (DNS rebinding) gains nothing.

By number, not by spelling: a host is an address only as ``ipaddress`` reads it, dialled in its
canonical form; any other spelling (``2130706433``, ``0177.0.0.1``, ``0x7f.1``) is a name, and
the numbers the resolver makes of it are what is checked and dialled. An IPv6 address that
carries an IPv4 one (``::ffff:127.0.0.1``, ``::127.0.0.1``, ``64:ff9b::10.0.0.1``, 6to4,
Teredo, ISATAP: ``embedded_ipv4``) is closed if any IPv4 address it carries is. A zone id
(``fe80::1%eth0``) names an interface, never needed for a public host: refused.

Pure: no mitmproxy here (addons/capture.py asks ``public_address``).
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket

from capture.logs.escape import printable

EGRESS_NONE = "none"
EGRESS_PUBLIC = "public"

# Never dialled for an agent, whatever the rollout asks.
CLOSED_NETWORKS = tuple(
    ipaddress.ip_network(net)
    for net in (
        "0.0.0.0/8", "10.0.0.0/8", "100.64.0.0/10", "127.0.0.0/8", "169.254.0.0/16",
        "172.16.0.0/12", "192.0.0.0/24", "192.168.0.0/16", "198.18.0.0/15", "224.0.0.0/4",
        "240.0.0.0/4", "::/128", "::1/128", "fc00::/7", "fe80::/10", "fec0::/10", "ff00::/8",
    )
)  # fmt: skip

# IPv6 prefixes whose last 32 bits are an IPv4 address a host may end up dialling: IPv4-mapped
# (a dual-stack socket dials the IPv4 address itself), IPv4-compatible (deprecated; a host with
# the sit tunnel reaches it), SIIT's IPv4-translated, NAT64's well-known prefix (RFC 6052).
_LAST_32_BITS = tuple(
    ipaddress.IPv6Network(net)
    for net in ("::ffff:0:0/96", "::/96", "::ffff:0:0:0/96", "64:ff9b::/96")
)
# NAT64's local-use prefix (RFC 8215): an operator's prefix inside it is /48 to /96, and the
# IPv4 address sits where RFC 6052 puts it for that length. Every placement is read.
_LOCAL_NAT64 = ipaddress.IPv6Network("64:ff9b:1::/48")
_RFC6052_LENGTHS = (48, 56, 64, 96)
_MASK32 = 0xFFFFFFFF


def _rfc6052(value: int, length: int) -> int:
    """The IPv4 address RFC 6052 embeds after a ``length``-bit prefix (bits 64-71, the "u"
    octet, are skipped)."""
    if length == 96:
        return value & _MASK32
    # The 120 bits left without the u octet; the address follows the prefix in them.
    packed = ((value >> 64) << 56) | (value & ((1 << 56) - 1))
    return (packed >> (120 - length - 32)) & _MASK32


def embedded_ipv4(ip: ipaddress.IPv6Address) -> list[ipaddress.IPv4Address]:
    """Every IPv4 address ``ip`` carries in a form some host, relay or translator dials.

    Beyond the RFC prefixes above: 6to4 (``2002:AABB:CCDD::/48``), Teredo (``2001::/32``: its
    server, bits 32-63, and its client, the last 32 bits inverted) and ISATAP interface ids
    (``...:0:5efe:a.b.c.d`` and ``...:200:5efe:a.b.c.d``, under any prefix). A network-specific
    NAT64 prefix an operator chose elsewhere cannot be known here (docs/SECURITY.md)."""
    value = int(ip)
    found = [ipaddress.IPv4Address(value & _MASK32) for net in _LAST_32_BITS if ip in net]
    if ip in _LOCAL_NAT64:
        found += [ipaddress.IPv4Address(_rfc6052(value, n)) for n in _RFC6052_LENGTHS]
    if ip.sixtofour is not None:
        found.append(ip.sixtofour)
    if ip.teredo is not None:
        found += ip.teredo
    # ISATAP: 0000:5efe or 0200:5efe (the u/l bit), the group bit ignored too.
    if (value >> 32) & 0xFCFFFFFF == 0x00005EFE:
        found.append(ipaddress.IPv4Address(value & _MASK32))
    return found


class EgressRefused(Exception):
    """Why a public-egress tunnel is refused, in words for the log and the agent."""


def is_open(address: str) -> bool:
    """``address`` (an IP, as ``ipaddress`` reads it) may be dialled for a public-egress
    session: it is in no closed network, nor is any IPv4 address it carries."""
    ip = ipaddress.ip_address(address)
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.scope_id is not None:
            return False  # a zone is for link-local addresses, closed anyway
        if not all(is_open(str(inner)) for inner in embedded_ipv4(ip)):
            return False
    return not any(ip in net for net in CLOSED_NETWORKS)


async def public_address(host: str, port: int) -> str:
    """The address to dial for ``host:port``: its first address, canonical, if every address
    it resolves to is open (``is_open``); else EgressRefused, naming the closed one."""
    shown = printable(host)
    if "%" in host:
        raise EgressRefused(
            f"{shown} names a network interface (a zone id after %): public hosts need none"
        )
    try:
        addresses = [str(ipaddress.ip_address(host))]
    except ValueError:
        # A name, or a number spelled otherwise (2130706433, 0177.0.0.1): the resolver's
        # numbers are what is checked, and dialled.
        loop = asyncio.get_running_loop()
        try:
            infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except (OSError, UnicodeError) as exc:
            raise EgressRefused(f"{shown} does not resolve ({printable(str(exc))})") from None
        addresses = list(dict.fromkeys(str(info[4][0]) for info in infos))
    if not addresses:
        raise EgressRefused(f"{shown} resolves to no address")
    for address in addresses:
        if not is_open(address):
            raise EgressRefused(
                f"{shown} resolves to {printable(address)}{_carried(address)}, a loopback, "
                "private or link-local address an agent may never reach "
                '("egress": "public" opens public hosts only)'
            )
    return addresses[0]


def _carried(address: str) -> str:
    """`` (which carries 127.0.0.1)``: the closed IPv4 address inside an IPv6 one, if any."""
    ip = ipaddress.ip_address(address)
    if not isinstance(ip, ipaddress.IPv6Address) or ip.scope_id is not None:
        return ""
    closed = [str(inner) for inner in embedded_ipv4(ip) if not is_open(str(inner))]
    return f" (which carries {closed[0]})" if closed else ""
