"""capture/isolation/netbridge.py: a run's bridge relays at most its budget of connections at
once, each bound to the run's session while it lasts (a real bridge, real sockets, a loopback
server standing in for the proxy)."""

from __future__ import annotations

import asyncio
import logging
import resource
import sys
from pathlib import Path

import pytest

from capture.control.bindings import Bindings
from capture.isolation.budget import ConnectionBudget, Descriptors, open_descriptors
from capture.isolation.netbridge import Bridges, NetBridge, Route
from capture.logs.ratelimit import RateLimitedLog


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


async def _out_of_descriptors() -> dict[str, int]:
    server, _ = await _echo_server()
    port = server.sockets[0].getsockname()[1]
    log = RateLimitedLog(logging.getLogger("netbridge-test"), interval_s=3600)
    bridge = NetBridge(
        [Route("proxy", port, "127.0.0.1", port)], "r-2", Bindings(), ConnectionBudget(64),
        log=log,
    )  # fmt: skip
    await bridge.start()
    assert bridge.folder is not None
    # Connections from another process, which keeps its own descriptors.
    clients = await asyncio.create_subprocess_exec(
        sys.executable, "-c",
        "import socket, sys\n"
        "held = []\n"
        "for _ in range(20):\n"
        "    s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1]); held.append(s)\n"
        "sys.stdin.read()\n",
        str(Path(bridge.folder) / "proxy.sock"), stdin=asyncio.subprocess.PIPE,
    )  # fmt: skip
    before = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        # This process is out of descriptors: every accept fails with EMFILE.
        resource.setrlimit(resource.RLIMIT_NOFILE, (open_descriptors() or 0, before[1]))
        while log.counts.get("accept", 0) < 5:
            await asyncio.sleep(0.01)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, before)
        assert clients.stdin is not None
        clients.stdin.close()
        await clients.wait()
        await bridge.close()
        server.close()
    return log.counts


def test_a_failing_accept_is_logged_once_per_interval_with_a_count(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, "netbridge-test"):
        counts = asyncio.run(asyncio.wait_for(_out_of_descriptors(), 30))
    lines = [r.getMessage() for r in caplog.records if "cannot accept" in r.getMessage()]
    assert counts["accept"] >= 5
    # The first at once; the rest counted, told once when the bridge closed.
    assert len(lines) == 2, lines
    assert "Too many open files" in lines[0] and "r-2" in lines[0]
    assert f"({counts['accept'] - 1} more like it" in lines[1]


def test_a_closed_bridge_leaves_the_next_owner_of_its_descriptors_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A bridge closing while its accept loop waits on its listener: the listener's descriptor
    number goes to whoever opens the next socket (here at once, as when one run's end and
    another's connections meet), and that socket must still be heard. Closed before its accept
    loop was cancelled, the listener left the event loop's registration of the number behind:
    the next owner's reader replaced it in asyncio's map but was never added to the kernel's
    epoll set, so it never fired (found in a training run, where the control API's connection
    on the reused number hung the trainer)."""
    import socket

    async def main() -> None:
        loop = asyncio.get_running_loop()
        bridge = NetBridge([Route("proxy", 1, "127.0.0.1", 1)], "r-0")
        await bridge.start()
        await asyncio.sleep(0)  # its accept loop waits on the listener
        (listener,) = bridge._listeners
        number = listener.fileno()
        pairs: list[tuple[socket.socket, socket.socket]] = []
        heard = asyncio.Event()
        close = socket.socket.close

        def close_and_reuse(sock: socket.socket) -> None:
            close(sock)
            if sock is listener:  # the number's next owner, watched by the loop
                mine, peer = socket.socketpair()
                pairs.append((mine, peer))
                assert mine.fileno() == number
                loop.add_reader(number, heard.set)

        monkeypatch.setattr(socket.socket, "close", close_and_reuse)
        await bridge.close()
        monkeypatch.undo()
        assert pairs, "the listener was never closed"
        mine, peer = pairs[0]
        peer.send(b"x")
        try:
            await asyncio.wait_for(heard.wait(), 5)
        finally:
            loop.remove_reader(number)
            mine.close()
            peer.close()

    asyncio.run(main())
