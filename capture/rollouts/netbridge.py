"""The host's side of a sandbox's network: unix sockets that lead to the proxy and the API.

A sandboxed agent has a network namespace of its own, with no route anywhere. What it may
reach is handed in as unix sockets: this module listens on ``proxy.sock`` and ``api.sock`` in a
folder of its own (bound read-only into each sandbox at ``/.agenttap``) and relays every
connection to the proxy's or the API listener's TCP port on this host. Inside, the forwarder
(capture/rollouts/bridge.py, copied into the same folder) listens on loopback at the same port
numbers, so the session's ``HTTPS_PROXY`` and base URLs stay as they are, with ``127.0.0.1``
as their host. Nothing else the host listens on (the policy servers, other instances, vLLM's
workers, every other port) can be reached from inside, as Anthropic's sandbox-runtime bridges
its proxy into bwrap.

One bridge serves every sandbox of this process; the folder is removed when it closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

logger = logging.getLogger(__name__)

# Where the bridge's folder appears inside a sandbox.
INSIDE = Path("/.agenttap")
BRIDGE_SCRIPT = Path(__file__).with_name("bridge.py")
CHUNK = 65536


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
    """The unix-socket listeners of every route, in a folder of their own."""

    def __init__(self, routes: list[Route]) -> None:
        self.routes = routes
        self.folder: Path | None = None
        self._servers: list[asyncio.AbstractServer] = []
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
                server = await asyncio.start_unix_server(
                    functools.partial(self._relay, route=route), path=str(path)
                )
                path.chmod(0o666)
                self._servers.append(server)
        except BaseException:
            await self.close()
            raise

    def forwards(self) -> list[str]:
        """The forwarder's arguments: ``127.0.0.1:PORT=/.agenttap/NAME.sock`` per route."""
        return [f"127.0.0.1:{r.port}={INSIDE / f'{r.name}.sock'}" for r in self.routes]

    async def _relay(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, route: Route
    ) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        try:
            try:
                up_reader, up_writer = await asyncio.open_connection(
                    route.target_host, route.target_port
                )
            except OSError as exc:
                logger.warning(
                    "agenttap: a sandbox's connection to %s (%s:%d) failed: %s",
                    route.name, route.target_host, route.target_port, exc,
                )  # fmt: skip
                return
            try:
                await asyncio.gather(_pump(reader, up_writer), _pump(up_reader, writer))
            finally:
                up_writer.close()
        finally:
            writer.close()
            if task is not None:
                self._tasks.discard(task)

    async def close(self) -> None:
        for server in self._servers:
            server.close()
        for task in list(self._tasks):
            task.cancel()
        for server in self._servers:
            with contextlib.suppress(Exception):
                await server.wait_closed()
        self._servers.clear()
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder = None


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
