"""The host's side of a sandbox's network: unix sockets that lead to the proxy and the API.

A sandboxed agent has a network namespace of its own, with no route anywhere. What it may
reach is handed in as unix sockets: this module listens on ``proxy.sock`` and ``api.sock`` in a
folder of its own (bound read-only into each sandbox at ``/.agenttap``) and relays every
connection to the proxy's or the API listener's TCP port on this host. Inside, the forwarder
(capture/isolation/bridge.py, copied into the same folder) listens on loopback at the same port
numbers, so the session's ``HTTPS_PROXY`` and base URLs stay as they are, with ``127.0.0.1``
as their host. Nothing else the host listens on (the policy servers, other instances, vLLM's
workers, every other port) can be reached from inside, as Anthropic's sandbox-runtime bridges
its proxy into bwrap.

Each sandboxed agent gets a bridge of its own (a folder, its sockets), so every connection is
known to come from that sandbox: it is bound to the run's session (capture/control/bindings.py)
and counted against the run's budget and the process's descriptor reserve
(capture/isolation/budget.py). The folder is removed when the agent ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import shutil
import socket
import sys
import tempfile
from collections.abc import Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit

from capture.isolation.budget import ConnectionBudget, Descriptors, raise_nofile
from capture.logs.ratelimit import RateLimitedLog

logger = logging.getLogger(__name__)

# Where the bridge's folder appears inside a sandbox.
INSIDE = Path("/.agenttap")
BRIDGE_SCRIPT = Path(__file__).with_name("bridge.py")
CHUNK = 65536
# agenttap_rollout_max_connections' default.
DEFAULT_MAX_CONNECTIONS = 64
LISTEN_BACKLOG = 128
# accept() failing for want of descriptors or memory: the listener waits this long.
RESOURCE_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
ACCEPT_PAUSE_S = 0.1


class Binder(Protocol):
    """Where each relayed connection is bound to its run's session while it lasts (the proxy's
    side: capture/control/bindings.py), so a call on it naming another session is refused."""

    def bind(self, source: Any, destination: Any, session_id: str) -> None: ...

    def unbind(self, source: Any, destination: Any) -> None: ...


@dataclass(frozen=True)
class Route:
    """One port handed into sandboxes: ``name`` (its socket is ``NAME.sock``), the port the
    forwarder inside listens on (loopback), and where its connections go on the host."""

    name: str
    port: int
    target_host: str
    target_port: int


def route_for(name: str, url: str) -> Route:
    """The route for a listener advertised at ``url`` (``http://HOST:PORT``); ValueError if it
    names no port."""
    parts = urlsplit(url)
    if parts.hostname is None or parts.port is None:
        raise ValueError(f"agenttap: cannot hand {url!r} into a sandbox: it names no host:port")
    host = parts.hostname
    if host in ("0.0.0.0", "", "*"):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    return Route(name, parts.port, host, parts.port)


def inside_url(url: str) -> str:
    """``url`` as an agent inside a sandbox reaches it: the same scheme, credentials, port and
    path, with ``127.0.0.1`` as its host (the forwarder listens there)."""
    parts = urlsplit(url)
    if parts.port is None:
        return url
    netloc = parts.netloc.rpartition("@")
    userinfo = f"{netloc[0]}@" if netloc[1] else ""
    return parts._replace(netloc=f"{userinfo}127.0.0.1:{parts.port}").geturl()


class NetBridge:
    """One sandbox's way out: the unix-socket listeners of every route, in a folder of its own
    (bound at ``/.agenttap`` in that sandbox only), so each connection is known to come from
    that sandbox. Each relayed connection is bound to the run's session in ``bindings`` while
    it lasts; at most ``budget``'s connections at once (proxy and API together), and none
    when the process's ``descriptors`` would eat into their reserve: past either, a new
    connection is accepted and closed at once, unrelayed, and counted."""

    def __init__(
        self,
        routes: list[Route],
        session_id: str = "",
        bindings: Binder | None = None,
        budget: ConnectionBudget | None = None,
        descriptors: Descriptors | None = None,
        log: RateLimitedLog | None = None,
    ) -> None:
        self.routes = routes
        self.session_id = session_id
        self.bindings = bindings
        self.budget = budget or ConnectionBudget(DEFAULT_MAX_CONNECTIONS)
        self.descriptors = descriptors
        self.log = log or RateLimitedLog(logger)
        self.folder: Path | None = None
        self._listeners: list[socket.socket] = []
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        folder = Path(tempfile.mkdtemp(prefix="agenttap-net-"))
        # Traversable by the sandbox's user, listable by nobody but us; no file in it is
        # secret (the sockets lead where the TCP ports already do).
        folder.chmod(0o711)
        shutil.copyfile(BRIDGE_SCRIPT, folder / "bridge.py")
        (folder / "bridge.py").chmod(0o644)
        self.folder = folder
        try:
            for route in self.routes:
                path = folder / f"{route.name}.sock"
                listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                self._listeners.append(listener)
                listener.bind(str(path))
                path.chmod(0o666)
                listener.listen(LISTEN_BACKLOG)
                listener.setblocking(False)
                self._spawn(self._accept(listener, route))
        except BaseException:
            await self.close()
            raise

    def forwards(self, at: Path = INSIDE) -> list[str]:
        """The forwarder's arguments: ``127.0.0.1:PORT=AT/NAME.sock`` per route (``at``: where
        the forwarder sees this bridge's folder: ``/.agenttap`` in a sandbox, the folder
        itself for one on the host)."""
        return [f"127.0.0.1:{r.port}={at / f'{r.name}.sock'}" for r in self.routes]

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _accept(self, listener: socket.socket, route: Route) -> None:
        """Our own accept loop, not asyncio's server: a failing ``accept`` (EMFILE) is logged
        once per interval with a count, and a connection past the budget is closed before
        anything is made of it."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, _ = await loop.sock_accept(listener)
            except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                continue
            except OSError as exc:
                if exc.errno not in RESOURCE_ERRNOS:
                    return  # the listener closed
                self.log.note(
                    "accept",
                    f"agenttap: the bridge of rollout session {self.session_id} cannot accept "
                    f"a connection: {exc.strerror} (this process is out of descriptors or "
                    f"memory); new connections wait {ACCEPT_PAUSE_S:g} s",
                )
                await asyncio.sleep(ACCEPT_PAUSE_S)
                continue
            refused = self._admit()
            if refused is not None:
                conn.close()
                self.log.note(refused, self._refusal_words(refused))
                continue
            self._spawn(self._relay(conn, route))

    def _admit(self) -> str | None:
        """None: the connection may be relayed (its share taken); else why not."""
        if not self.budget.take():
            return "budget"
        if self.descriptors is not None and not self.descriptors.take():
            self.budget.give_back()
            self.budget.refused += 1
            return "descriptors"
        return None

    def _release(self) -> None:
        self.budget.give_back()
        if self.descriptors is not None:
            self.descriptors.give_back()

    def _refusal_words(self, why: str) -> str:
        if why == "budget":
            return (
                f"agenttap: rollout session {self.session_id} holds "
                f"{self.budget.max_connections} connections to the proxy and the API at once, "
                f"its limit (agenttap_rollout_max_connections): new ones are closed unrelayed"
            )
        assert self.descriptors is not None
        return (
            f"agenttap: rollout session {self.session_id}: a new connection is closed "
            f"unrelayed, the sandboxes' connections would eat into the "
            f"{self.descriptors.reserve} descriptors kept for the proxy and other sessions "
            f"(limit {self.descriptors.limit}, {self.descriptors.relayed} relayed now)"
        )

    async def _relay(self, conn: socket.socket, route: Route) -> None:
        bound: tuple[Any, Any] | None = None
        up_writer: asyncio.StreamWriter | None = None
        writer: asyncio.StreamWriter | None = None
        try:
            try:
                reader, writer = await asyncio.open_unix_connection(sock=conn)
                up_reader, up_writer = await asyncio.open_connection(
                    route.target_host, route.target_port
                )
            except OSError as exc:
                self.log.note(
                    f"connect-{route.name}",
                    f"agenttap: a sandbox's connection to {route.name} ({route.target_host}:"
                    f"{route.target_port}) failed: {exc}",
                )
                return
            if self.bindings is not None:
                # Before a byte is relayed: the proxy reads nothing of it unbound.
                ends = up_writer.get_extra_info("sockname"), up_writer.get_extra_info("peername")
                self.bindings.bind(*ends, self.session_id)
                bound = ends
            await asyncio.gather(_pump(reader, up_writer), _pump(up_reader, writer))
        finally:
            if bound is not None and self.bindings is not None:
                self.bindings.unbind(*bound)
            for end in (up_writer, writer):
                if end is not None:
                    end.close()
            if writer is None:
                conn.close()
            self._release()

    def usage(self) -> dict[str, int]:
        """What the run's sandbox did with its connections (for the run's ``usage``)."""
        return {
            "connections_peak": self.budget.peak,
            "connections_refused": self.budget.refused,
        }

    async def close(self) -> None:
        # The accept loops and relays end first, the listeners after: a listener closed under
        # its pending accept frees its descriptor number while the event loop still has it
        # registered, and the number's next owner (any socket of this process: another run's
        # bridge, the API's next connection) is then entered in asyncio's map but never in the
        # kernel's epoll set, so it is never read.
        pending = set(self._tasks)
        while pending:
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            pending = {task for task in self._tasks if not task.done()}
        for listener in self._listeners:
            listener.close()
        self._listeners.clear()
        self.log.flush()
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder = None


class Bridges:
    """Every run's bridge: one per sandboxed agent, opened before it starts and closed when it
    ends. Raises the descriptor limit when made, and shares one reserve among them."""

    def __init__(self, bindings: Binder, max_connections: int, max_running: int) -> None:
        self.bindings = bindings
        self.max_connections = max_connections
        self.descriptors = Descriptors(raise_nofile())
        self.log = RateLimitedLog(logger)
        self._open: dict[str, NetBridge] = {}
        d = self.descriptors
        words = (
            f"agenttap: sandboxes may hold {max_connections} connections each to the proxy and "
            f"the API (agenttap_rollout_max_connections), {d.max_relayed} in all, keeping "
            f"{d.reserve} of this process's {d.limit} descriptors for the proxy and the "
            f"sessions that are not sandboxed"
        )
        if max_connections * max_running > d.max_relayed:
            logger.warning(
                "%s: %d agents (agenttap_max_rollouts) at their limit would need %d; past %d "
                "a sandbox's new connections are refused (raise the hard RLIMIT_NOFILE, or "
                "lower one of the options)",
                words, max_running, max_connections * max_running, d.max_relayed,
            )  # fmt: skip
        else:
            logger.info("%s", words)

    async def open(self, session_id: str, routes: list[Route]) -> NetBridge:
        """The bridge of the run of ``session_id`` (started if it is not yet)."""
        bridge = self._open.get(session_id)
        if bridge is None:
            bridge = NetBridge(
                routes,
                session_id,
                self.bindings,
                ConnectionBudget(self.max_connections),
                self.descriptors,
                self.log,
            )
            await bridge.start()
            self._open[session_id] = bridge
        return bridge

    async def close(self, session_id: str) -> dict[str, int] | None:
        """Close the run's bridge; what it counted (None: it had none)."""
        bridge = self._open.pop(session_id, None)
        if bridge is None:
            return None
        await bridge.close()
        return bridge.usage()

    async def close_all(self) -> None:
        for session_id in list(self._open):
            await self.close(session_id)


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(CHUNK):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        with contextlib.suppress(OSError, RuntimeError):
            if writer.can_write_eof():
                writer.write_eof()


def interpreter() -> str:
    """The Python that runs the forwarder inside: the system's (under ``/usr``, which every
    sandbox shows), else the one running this process."""
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.access(candidate, os.X_OK):
            return candidate
    return os.path.realpath(sys.executable)
