"""The forwarder inside a rollout's network namespace: the only way out of the sandbox.

A sandboxed agent has a network of its own (``bwrap --unshare-net``): its loopback and nothing
else. This script is the sandbox's first process. It listens on each ``HOST:PORT`` it is given,
on that loopback (the proxy's port, the control API's port: the same numbers the agent's
``HTTPS_PROXY`` and base URLs name), relays each connection to a unix socket bound into the
sandbox read-only (capture/isolation/netbridge.py serves those outside and connects them to the
proxy), then runs the agent and exits with its status. The ports listen before the agent
starts, so its first call never races them.

Run by the host's own Python with ``-I -S`` and nothing but the standard library: it must work
with whatever the sandbox shows, and no module of the agent's workdir may shadow one of it.
The agent may kill it; then it has cut its own network, nothing else.

    python3 -I -S bridge.py 127.0.0.1:8080=/.agenttap/proxy.sock [...] -- PROGRAM ARGS...
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading

CHUNK = 65536


def _parse(mapping: str) -> tuple[tuple[str, int], str]:
    address, sep, path = mapping.partition("=")
    host, _, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not path:
        raise SystemExit(f"agenttap bridge: bad mapping {mapping!r} (want HOST:PORT=SOCKET)")
    return (host, int(port)), path


def _pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(CHUNK):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        # The other direction may still be answering: only this half ends.
        try:
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass


def _relay(client: socket.socket, path: str) -> None:
    upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        upstream.connect(path)
    except OSError:
        client.close()
        upstream.close()
        return
    back = threading.Thread(target=_pump, args=(upstream, client), daemon=True)
    back.start()
    _pump(client, upstream)
    back.join()
    client.close()
    upstream.close()


def _serve(listener: socket.socket, path: str) -> None:
    while True:
        try:
            client, _ = listener.accept()
        except OSError:
            return
        client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        threading.Thread(target=_relay, args=(client, path), daemon=True).start()


def main(argv: list[str]) -> int:
    if "--" not in argv:
        raise SystemExit("agenttap bridge: usage: bridge.py HOST:PORT=SOCKET ... -- PROGRAM ...")
    split = argv.index("--")
    mappings, command = [_parse(m) for m in argv[:split]], argv[split + 1 :]
    if not command:
        raise SystemExit("agenttap bridge: no program to run after --")
    for (host, port), path in mappings:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, port))
        listener.listen(128)
        threading.Thread(target=_serve, args=(listener, path), daemon=True).start()
    try:
        child = subprocess.Popen(command)
    except OSError as exc:
        print(f"agenttap: the agent could not start: {exc}", file=sys.stderr, flush=True)
        return 127

    def forward(signum: int, _frame: object) -> None:
        try:
            child.send_signal(signum)
        except OSError:
            pass

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, forward)
    code = child.wait()
    return 128 - code if code < 0 else code


if __name__ == "__main__":
    status = main(sys.argv[1:])
    sys.stdout.flush()
    # Not sys.exit: the relays' threads may still be blocked in a read.
    os._exit(status)
