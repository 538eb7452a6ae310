"""capture/rollouts/netbridge.py: a run's bridge relays at most its budget of connections at
once, each bound to the run's session while it lasts (a real bridge, real sockets, a loopback
server standing in for the proxy)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from capture.control.bindings import Bindings
from capture.rollouts.budget import ConnectionBudget, Descriptors
from capture.rollouts.netbridge import Bridges, NetBridge, Route


async def _echo_server() -> tuple[asyncio.Server, list[tuple[object, object]]]:
    """A loopback server that echoes; it notes each client's (peername, sockname)."""
    seen: list[tuple[object, object]] = []

    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.append((writer.get_extra_info("peername"), writer.get_extra_info("sockname")))
        while data := await reader.read(1024):
            writer.write(data)
            await writer.drain()
        writer.close()

    return await asyncio.start_server(echo, "127.0.0.1", 0), seen


async def _flood_and_check(bindings: Bindings) -> None:
    server, seen = await _echo_server()
    port = server.sockets[0].getsockname()[1]
    bridge = NetBridge(
        [Route("proxy", port, "127.0.0.1", port)], "r-0", bindings, ConnectionBudget(2)
    )
    await bridge.start()
    assert bridge.folder is not None
    path = str(Path(bridge.folder) / "proxy.sock")
    try:
        held = [await asyncio.open_unix_connection(path) for _ in range(5)]
        # Two are relayed (they echo), bound to the run's session from the proxy's side.
        for reader, writer in held[:2]:
            writer.write(b"ping")
            await writer.drain()
            assert await reader.readexactly(4) == b"ping"
        assert len(seen) == 2 and len(bindings) == 2
        assert {bindings.session_for(peer, local) for peer, local in seen} == {"r-0"}
        # The three past the budget are closed at once, unrelayed.
        for reader, _ in held[2:]:
            assert await reader.read() == b""
        assert len(seen) == 2
        # One ends: its slot and its binding go, and a new connection is relayed.
        held[0][1].close()
        assert await held[0][0].read() == b""
        while bridge.budget.open == 2:  # the relay sees the close on its next read
            await asyncio.sleep(0)
        assert len(bindings) == 1
        reader, writer = await asyncio.open_unix_connection(path)
        writer.write(b"again")
        assert await reader.readexactly(5) == b"again"
        assert bridge.usage() == {"connections_peak": 2, "connections_refused": 3}
    finally:
        await bridge.close()
        server.close()
    assert len(bindings) == 0 and not Path(path).exists()


def test_a_bridge_relays_its_budget_bound_to_its_session_and_closes_the_rest() -> None:
    asyncio.run(asyncio.wait_for(_flood_and_check(Bindings()), 30))


async def _reserve_refuses() -> None:
    server, seen = await _echo_server()
    port = server.sockets[0].getsockname()[1]
    # The process is at its usable descriptors already: nothing is relayed, whatever the
    # sandbox's own budget.
    full = Descriptors(10_000, reserve=2_500, count=lambda: 7_500)
    bridge = NetBridge(
        [Route("proxy", port, "127.0.0.1", port)], "r-1", Bindings(), ConnectionBudget(64), full
    )
    await bridge.start()
    assert bridge.folder is not None
    try:
        reader, _ = await asyncio.open_unix_connection(str(Path(bridge.folder) / "proxy.sock"))
        assert await reader.read() == b""
        assert seen == [] and full.refused == 1 and bridge.usage()["connections_refused"] == 1
    finally:
        await bridge.close()
        server.close()


def test_a_bridge_refuses_what_would_eat_into_the_descriptor_reserve() -> None:
    asyncio.run(asyncio.wait_for(_reserve_refuses(), 30))


async def _each_run_its_own() -> None:
    bridges = Bridges(Bindings(), max_connections=4, max_running=2)
    routes = [Route("api", 1, "127.0.0.1", 1)]
    a = await bridges.open("r-0", routes)
    b = await bridges.open("r-1", routes)
    assert a is not b and a.folder != b.folder and await bridges.open("r-0", routes) is a
    folders = [a.folder, b.folder]
    assert await bridges.close("r-0") == {"connections_peak": 0, "connections_refused": 0}
    assert await bridges.close("r-0") is None
    await bridges.close_all()
    assert not any(Path(f).exists() for f in folders if f is not None)


def test_each_run_gets_a_bridge_of_its_own() -> None:
    asyncio.run(asyncio.wait_for(_each_run_its_own(), 30))
