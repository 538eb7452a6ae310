"""Which rollout session a connection relayed out of a sandbox belongs to.

A sandboxed agent reaches the proxy and the API listener only through its own run's bridge
(capture/isolation/netbridge.py), which relays each of its connections over a loopback TCP
connection of this same process. The bridge registers that connection's two ends here,
under the run's session, before relaying a byte; the addon (by mitmproxy's client address)
and the API listener (by its peer address) look the connection up, and a call on it that
names any other session is refused with the provider's 401 (``binding_refusal``), before
anything is counted, journaled or recorded.

The agent cannot forge the mark: it has no route to the host's loopback (its own network
namespace), so every byte it sends arrives on a connection the bridge opened and registered.
The key is the whole address pair, so a host process reusing the same source port towards
another destination is never taken for it.
"""

from __future__ import annotations

import ipaddress
from typing import Any

Key = tuple[str, int, str, int]


def _host(host: Any) -> str:
    """An address as one text for both families (``::ffff:127.0.0.1`` is ``127.0.0.1``)."""
    text = str(host)
    try:
        address = ipaddress.ip_address(text.partition("%")[0])
    except ValueError:
        return text
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return str(address.ipv4_mapped)
    return str(address)


def connection_key(peer: Any, local: Any) -> Key | None:
    """The key of a TCP connection seen from the side that accepted it: the client's address
    (``peer``) and the listener's (``local``), each a socket address tuple. None when either
    is unknown (a replayed flow, a connection already gone)."""
    if not isinstance(peer, tuple) or not isinstance(local, tuple):
        return None
    if len(peer) < 2 or len(local) < 2:
        return None
    return (_host(peer[0]), int(peer[1]), _host(local[0]), int(local[1]))


class Bindings:
    """The bridges' relayed connections and the session each is bound to."""

    def __init__(self) -> None:
        self._sessions: dict[Key, str] = {}

    def bind(self, source: Any, destination: Any, session_id: str) -> None:
        """The bridge's outgoing connection from ``source`` to ``destination`` (its own
        ``sockname`` and ``peername``) carries ``session_id``'s calls only."""
        key = connection_key(source, destination)
        if key is None:
            raise ValueError(f"not a TCP connection's addresses: {source!r} -> {destination!r}")
        self._sessions[key] = session_id

    def unbind(self, source: Any, destination: Any) -> None:
        key = connection_key(source, destination)
        if key is not None:
            self._sessions.pop(key, None)

    def session_for(self, peer: Any, local: Any) -> str | None:
        """The session the connection accepted from ``peer`` on ``local`` is bound to; None:
        it did not come through a bridge."""
        key = connection_key(peer, local)
        return self._sessions.get(key) if key is not None else None

    def __len__(self) -> int:
        return len(self._sessions)


def binding_refusal(bound: str | None, session_id: str) -> str | None:
    """Why a call naming ``session_id`` on a connection bound to ``bound`` must be refused, or
    None (not bound, or its own session). Opened or not, secret or not: a sandbox calls as its
    own session only."""
    if bound is None or session_id == bound:
        return None
    return (
        f"agenttap: this connection comes from the sandbox of rollout session {bound!r}, which "
        f"may call only as itself, not as {session_id[:200]!r}. Use the proxy URL and API keys "
        f"the rollout put in the agent's environment."
    )
