"""Runs commands inside a Harbor trial's sandbox for capture/harbor/env.py.

Harbor's agents need an environment that keeps its processes between commands: Terminus-2
starts a tmux server with one ``exec`` and types into it with the next ones. So the sandbox is
one long-lived bubblewrap process whose first program is this server; each ``exec`` is a
connection to its unix socket (in the control folder the host bound in), which runs one command
with ``bash -c`` inside the sandbox and answers its output and exit status. What a command
leaves running (the tmux server) lives on in the sandbox's PID namespace until the sandbox
stops.

    python3 -I -S execd.py SOCKET

One request per connection, a JSON line: ``{"command", "cwd", "env", "timeout"}``; the answer,
a JSON object: ``{"stdout", "stderr", "return_code", "timed_out"}``. A command past its timeout
is killed with its whole process group. Standard library only: it runs on the system's Python
inside the sandbox, which shows nothing of agenttap's environments.
"""

from __future__ import annotations

import json
import os
import signal
import socketserver
import subprocess
import sys
from typing import Any

# What a command starts with before the request's own variables. SHELL: tmux takes its shell
# from it, else from the user's passwd entry, which for nobody (the sandbox's user when agenttap
# runs as root) is nologin: it exits at once and takes the tmux server with it.
BASE_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME": "/root",
    "LANG": "C.UTF-8",
    "SHELL": "/bin/bash",
}
# Where a request's command runs when it names no cwd (env.py sets it to the workdir).
DEFAULT_CWD = os.environ.get("AGENTTAP_HARBOR_WORKDIR", "/")


def run(request: dict[str, Any]) -> dict[str, Any]:
    env = {**BASE_ENV, **{str(k): str(v) for k, v in (request.get("env") or {}).items()}}
    timeout = request.get("timeout")
    try:
        proc = subprocess.Popen(
            ["bash", "-c", str(request["command"])],
            cwd=request.get("cwd") or DEFAULT_CWD,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
    except OSError as exc:
        return {"stdout": "", "stderr": f"{exc}\n", "return_code": 127, "timed_out": False}
    timed_out = False
    try:
        out, err = proc.communicate(timeout=float(timeout) if timeout else None)
    except subprocess.TimeoutExpired:
        timed_out = True
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        out, err = proc.communicate()
    return {
        "stdout": out.decode(errors="replace"),
        "stderr": err.decode(errors="replace"),
        "return_code": proc.returncode,
        "timed_out": timed_out,
    }


class Handler(socketserver.StreamRequestHandler):
    def handle(self) -> None:
        try:
            request = json.loads(self.rfile.readline())
            answer = run(request)
        except (ValueError, KeyError, TypeError) as exc:
            answer = {"stdout": "", "stderr": f"bad request: {exc}\n", "return_code": 2}
        self.wfile.write(json.dumps(answer).encode())


class Server(socketserver.ThreadingUnixStreamServer):
    daemon_threads = True


def main(path: str) -> None:
    # Commands' children (tmux's server, a background job) are reaped here if they end up ours.
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    with Server(path, Handler) as server:
        os.chmod(path, 0o600)
        print("ready", flush=True)
        server.serve_forever()


if __name__ == "__main__":
    main(sys.argv[1])
