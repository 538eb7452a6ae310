"""The real vLLM servers of a test session: one per configuration, started in the background as
soon as the session has collected a test that needs it, and handed to every test that asks.

A vLLM's cold start on this CPU is about a minute, nearly all of it CPU: importing torch and
vLLM in three processes, then compiling the model. Started when collection ends, the servers
boot while the unit tests run (they come first, ``testpaths``), so the first e2e test that
needs one finds it ready. One compile cache serves the whole session (``VLLM_CACHE_ROOT``, set
in ``tests/conftest.py``): a second server of the same shape reuses the C++ kernels the first
one built."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from rewriter import policy_server


@dataclass(frozen=True)
class ServerConfig:
    """How one server is started (``policy_server.start_vllm``'s options)."""

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


@dataclass
class Server:
    url: str
    log: Path
    proc: subprocess.Popen[bytes]
    ready: bool = False


@dataclass
class VllmServers:
    """The session's servers by configuration; ``root`` holds their logs."""

    root: Path
    tokenizer: Path
    _servers: dict[ServerConfig, Server] = field(default_factory=dict)

    def start(self, config: ServerConfig) -> Server:
        """Start ``config``'s server unless it is running: returns at once, it boots meanwhile."""
        server = self._servers.get(config)
        if server is not None and server.proc.poll() is None:
            return server
        model = policy_server.ensure_tiny_model(tokenizer=self.tokenizer)
        port = policy_server.free_port()
        log = self.root / f"vllm-{config.name}.log"
        proc = policy_server.start_vllm(
            model, port, log_path=log, max_model_len=config.max_model_len,
            extra_args=list(config.extra_args), max_lora_rank=config.max_lora_rank,
        )  # fmt: skip
        server = Server(f"http://127.0.0.1:{port}", log, proc)
        self._servers[config] = server
        return server

    def ready(self, config: ServerConfig, timeout_s: float = 900) -> Server:
        """``config``'s server, serving (started now if it was not)."""
        server = self.start(config)
        if not server.ready:
            try:
                policy_server.wait_ready(server.url, server.proc, timeout_s=timeout_s)
            except policy_server.PolicyServerError:
                print(server.log.read_text(errors="replace")[-5000:])
                self.stop(config)
                raise
            server.ready = True
        return server

    def stop(self, config: ServerConfig) -> None:
        server = self._servers.pop(config, None)
        if server is None:
            return
        try:
            policy_server.stop(server.proc)
        except ProcessLookupError:  # a test killed it (failover): reap what is left
            server.proc.wait()

    def stop_all(self) -> None:
        for config in list(self._servers):
            self.stop(config)
