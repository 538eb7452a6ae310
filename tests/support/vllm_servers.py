"""The real vLLM servers of a test session: one per configuration, started in the background as
soon as the session has collected a test that needs it, and handed to every test that asks.

A vLLM's cold start on this CPU is about a minute, nearly all of it CPU: importing torch and
vLLM in three processes, then compiling the model. Started when collection ends, the servers
boot while the unit tests run (they come first, ``testpaths``), so the first e2e test that
needs one finds it ready. One compile cache serves the whole session (``VLLM_CACHE_ROOT``, set
in ``tests/conftest.py``): a second server of the same shape reuses the C++ kernels the first
one built.

Under pytest-xdist every worker is a session of its own; the servers are still one per
configuration for the whole run. ``root`` is then a folder all workers share (made by the
controller, ``AGENTTAP_TEST_RUN_DIR``): the first worker to ask starts a server under a file
lock and writes where it listens; the others attach to it. The controller stops them all when
the run ends (``stop_all(everything=True)``): a worker that is done must not take a server from
one still running.

A test that changes a shared server for everyone (pauses it, pushes new weights: marked
``policy_exclusive``) must not overlap another worker's test on that server: a pause cuts the
other's stream, new weights change what it samples. ``using`` is a readers-writer lock across
workers: tests on the server share it, an exclusive one waits for them and holds it alone."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from policy_server import launcher


@dataclass(frozen=True)
class ServerConfig:
    """How one server is started (``launcher.start_vllm``'s options)."""

    name: str
    max_model_len: int = 32768
    extra_args: tuple[str, ...] = ()
    max_lora_rank: int = 0


# The session's server: most real-vLLM tests share it (fixture ``vllm_url``).
SESSION = ServerConfig("session")
# /inference/v1/generate, with weight versions per token span (fixture ``generate_vllm_url``).
SCALE_OUT = ServerConfig("scale-out", max_model_len=8192, extra_args=("--enable-scale-out",))
# Runtime LoRA loading (fixture ``lora_vllm``).
LORA = ServerConfig("lora", max_model_len=4096, max_lora_rank=8)
# The session server's twin that the failover test kills mid-stream (fixture ``doomed_vllm``):
# its own process, as nobody else may lose it.
DOOMED = ServerConfig("failover-doomed")

# Which fixture wants which server: what collection looks for to start them early.
BY_FIXTURE: dict[str, ServerConfig] = {
    "vllm_url": SESSION,
    "generate_vllm_url": SCALE_OUT,
    "lora_vllm": LORA,
    "doomed_vllm": DOOMED,
}
# Started when collection ends, not when first asked for. The session's server only: each
# server holds about 3.5 GB, and the others live for one module each.
PRESTARTED = frozenset({SESSION})


# vLLM on a CPU pins its one compute thread to core 0 (it keeps the other for the rest): every
# server of the run, and their compiles, would queue on that core while the tests use the other.
# One thread still (the same arithmetic), left to the scheduler. Unpinned, the model runs in the
# engine core's process (VLLM_ENABLE_V1_MULTIPROCESSING=0: vLLM's CPU platform then keeps its
# "uni" executor): one process fewer to import torch and vLLM (38 against 55 CPU-s a start,
# compile cache warm: bench/vllm_start.py), the same logprobs, and no worker process spinning
# for a second after each step on vLLM's shared-memory queue while other tests want the core.
ONE_FLOATING_THREAD = {
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "OMP_NUM_THREADS": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
}


class _Attached:
    """A server another worker started: enough of ``Popen`` for ``wait_ready`` (is it alive)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            self.returncode = 1
        return self.returncode


@dataclass
class Server:
    url: str
    log: Path
    proc: subprocess.Popen[bytes] | _Attached
    ready: bool = False


@dataclass
class VllmServers:
    """The run's servers by configuration; ``root`` holds their logs and where they listen."""

    root: Path
    tokenizer: Path
    _servers: dict[ServerConfig, Server] = field(default_factory=dict)

    @contextmanager
    def _locked(self, config: ServerConfig) -> Iterator[Path]:
        with open(self.root / f"vllm-{config.name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield self.root / f"vllm-{config.name}.json"
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    @contextmanager
    def using(self, config: ServerConfig, exclusive: bool) -> Iterator[None]:
        """Hold ``config``'s server for one test: shared, or alone (``exclusive``). Every new
        holder passes a turnstile first, which an exclusive one keeps while it waits: the tests
        after it wait too, so the other worker cannot keep the server to itself."""
        mode = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
        with (
            open(self.root / f"vllm-{config.name}.turnstile", "w") as turnstile,
            open(self.root / f"vllm-{config.name}.use", "w") as use,
        ):
            fcntl.flock(turnstile, mode)
            try:
                fcntl.flock(use, mode)
            finally:
                fcntl.flock(turnstile, fcntl.LOCK_UN)
            try:
                yield
            finally:
                fcntl.flock(use, fcntl.LOCK_UN)

    def start(self, config: ServerConfig) -> Server:
        """Start ``config``'s server unless it is running (here or in another worker): returns
        at once, it boots meanwhile."""
        server = self._servers.get(config)
        if server is not None and server.proc.poll() is None:
            return server
        with self._locked(config) as record:
            if record.exists():
                known = json.loads(record.read_text())
                attached = _Attached(known["pid"])
                if attached.poll() is None:
                    server = Server(known["url"], Path(known["log"]), attached)
                    self._servers[config] = server
                    return server
            model = launcher.ensure_tiny_model(tokenizer=self.tokenizer)
            port = launcher.free_port()
            log = self.root / f"vllm-{config.name}.log"
            proc = launcher.start_vllm(
                model, port, log_path=log, max_model_len=config.max_model_len,
                extra_args=list(config.extra_args), max_lora_rank=config.max_lora_rank,
                env_overrides=ONE_FLOATING_THREAD,
            )  # fmt: skip
            server = Server(f"http://127.0.0.1:{port}", log, proc)
            record.write_text(json.dumps({"url": server.url, "log": str(log), "pid": proc.pid}))
            self._servers[config] = server
            return server

    def ready(self, config: ServerConfig, timeout_s: float = 900) -> Server:
        """``config``'s server, serving (started now if it was not)."""
        server = self.start(config)
        if not server.ready:
            try:
                launcher.wait_ready(server.url, server.proc, timeout_s=timeout_s)  # type: ignore[arg-type]
            except launcher.PolicyServerError:
                print(server.log.read_text(errors="replace")[-5000:])
                self.stop(config)
                raise
            server.ready = True
        return server

    def stop(self, config: ServerConfig) -> None:
        """Stop ``config``'s server: a module's own (one worker uses it). The session's server,
        shared by workers, is left to ``stop_all(everything=True)`` at the end of the run."""
        if config == SESSION and os.environ.get("PYTEST_XDIST_WORKER"):
            return
        self._servers.pop(config, None)
        with self._locked(config) as record:
            if record.exists():
                _kill_group(json.loads(record.read_text())["pid"])
                record.unlink()

    def stop_all(self, everything: bool = False) -> None:
        """This process's servers; with ``everything``, every server any worker started."""
        for config in list(self._servers):
            self.stop(config)
        if everything:
            for record in self.root.glob("vllm-*.json"):
                _kill_group(json.loads(record.read_text())["pid"])
                record.unlink()


def _kill_group(pid: int) -> None:
    """vLLM runs in a session of its own (its API server, engine core and workers): all of it
    goes, also when another process started it (and reaps it)."""
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    for _ in range(300):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        try:  # our own child: reap it, or it stays a zombie that kill(0) still finds
            if os.waitpid(pid, os.WNOHANG) != (0, 0):
                return
        except ChildProcessError:
            pass
        time.sleep(0.1)
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
