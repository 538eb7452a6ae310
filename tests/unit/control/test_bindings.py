"""capture/control/bindings.py: a relayed connection's session, found by its two addresses."""

from __future__ import annotations

import pytest

from capture.control.bindings import Bindings, binding_refusal, connection_key

BRIDGE_END = ("127.0.0.1", 40001)
PROXY = ("127.0.0.1", 8080)


def test_a_bound_connection_is_found_from_the_accepting_side_only_while_bound() -> None:
    bindings = Bindings()
    bindings.bind(BRIDGE_END, PROXY, "r-0")
    # mitmproxy sees the bridge's end as its client's peername, its own as sockname; a
    # dual-stack listener writes the IPv4 address mapped into IPv6, with flow info and scope.
    assert bindings.session_for(BRIDGE_END, PROXY) == "r-0"
    assert bindings.session_for(("::ffff:127.0.0.1", 40001, 0, 0), PROXY) == "r-0"
    # The same source port to another destination (a host process) is another connection.
    assert bindings.session_for(BRIDGE_END, ("127.0.0.1", 9090)) is None
    assert bindings.session_for(("127.0.0.1", 40002), PROXY) is None
    # A replayed flow or a connection already gone has no address.
    assert bindings.session_for(None, PROXY) is None
    assert bindings.session_for(BRIDGE_END, None) is None
    bindings.unbind(BRIDGE_END, PROXY)
    assert bindings.session_for(BRIDGE_END, PROXY) is None and len(bindings) == 0
    bindings.unbind(BRIDGE_END, PROXY)  # twice: nothing happens


def test_only_a_tcp_connection_can_be_bound() -> None:
    with pytest.raises(ValueError, match="not a TCP connection"):
        Bindings().bind("/.agenttap/proxy.sock", PROXY, "r-0")
    assert connection_key(("::1", 5, 0, 0), ("::1", 6, 0, 0)) == ("::1", 5, "::1", 6)


def test_a_bound_connection_calls_as_its_own_session_only() -> None:
    assert binding_refusal(None, "anyone") is None  # not through a bridge
    assert binding_refusal("r-0", "r-0") is None
    for other in ("r-1", "ghost", "anonymous", "r-0 ", "R-0"):
        refused = binding_refusal("r-0", other)
        assert refused is not None and "'r-0'" in refused and "only as itself" in refused
