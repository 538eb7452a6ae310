"""How a gateway is configured (``GatewayConfig``): what the addon reads from its options and
hands to ``capture.gateway.Gateway``; also what the control plane, rollouts and the viewer read
of it (``capture.ports.GatewayCore.config``). Plain data: no HTTP, no mitmproxy."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class GatewayConfig:
    policy_urls: list[str]
    tokenizer_path: Path
    out_dir: Path
    tool_parser: str = "hermes"
    reasoning_parser: str = "qwen3"
    idle_timeout_s: float = 300.0
    max_body_bytes: int = 8 * 1024 * 1024
    sweep_interval_s: float = 5.0
    # Re-score policy tokens whose context a scaffold rewrote, and schema-constrained samples
    # (vLLM prompt_logprobs); off: such tokens are masked out of the loss instead. Option
    # agenttap_recompute_mismatch_logprobs.
    recompute_logprobs: bool = True
    # Wait for each call's journal fsync before its answer ends (agenttap_journal_fsync=
    # before_reply); off: the line is written first, fsynced right after, batched.
    fsync_before_reply: bool = False
    # (pattern, servers): requested model names -> policy servers; see parse_model_map.
    model_map: list[tuple[str, list[str]]] = field(default_factory=list)
    # Extra names GET /v1/models lists (every name is served).
    model_names: list[str] = field(default_factory=list)
    # Provider option values by option name (see ProviderOption); missing ones take defaults.
    provider_options: dict[str, Any] = field(default_factory=dict)
    # Registry names of the providers to serve, in the order they are asked; empty: all.
    providers: list[str] = field(default_factory=list)
    # Longest wait for the policy's next byte; then the client gets its provider's retryable
    # error (OpenAI 503, Anthropic 529) instead of hanging until its own timeout.
    policy_timeout_s: float = 300.0
    # Least time between two events of a stream (agenttap_stream_flush_ms); 0: each read's
    # tokens at once. See VLLMClient's flush_interval_s.
    stream_flush_s: float = 0.2
    # Concurrent policy requests (HTTP connections); a streaming session holds one per call.
    policy_max_connections: int = 1024
    # Generations at once per policy server (0: unbounded) and calls that may wait for one
    # beyond that; then the provider's retryable error (capture/policy/replicas.py).
    replica_max_inflight: int = 0
    replica_queue: int = 256
    # Generations per session at the policy at once (0: unbounded; capture/policy/fair.py).
    session_max_inflight: int = 8
    # Seconds between health checks of the policy servers (a 1-token generation that also
    # compares their weights' fingerprint); 0: only the one at start.
    health_interval_s: float = 5.0
    # Weight checks: the tolerance of probes and fingerprints, and how often fingerprints are
    # checked besides health checks (agenttap_weights_tolerance, agenttap_weights_check_s).
    weights_tolerance: float = 1e-3
    weights_check_s: float = 60.0
    # The control API and per-session base URLs listen here (port 0: a free one); None: not
    # at all (only the proxy's http://agenttap.local serves the control API).
    api_host: str | None = None
    api_port: int = 0
    # The control API's bearer token; empty: a random one.
    token: str = ""
    # Host put into the URLs handed out (empty: the listening address, see advertised_host).
    advertise_host: str = ""
    # Agents that rollouts (POST /rollouts) may run at once.
    max_rollouts: int = 8
    # What rollouts' running agents may be promised together (MiB); None: 80% of MemTotal.
    rollout_memory_mb: int | None = None
    # mitmdump's proxy URL (http://HOST:PORT) and CA certificate, for sessions' environments.
    proxy_url: str = ""
    ca_path: str = ""
    bundle_path: str = ""
    # Calls must name an opened session and carry its secret (agenttap_require_session_secret).
    require_session_secret: bool = False
    # Weight updates a session may fall behind (agenttap_max_staleness); None: any.
    max_staleness: int | None = None
    # Rollouts' sandbox: "bwrap" or "none" (agenttap_sandbox), and what it hides beyond OUT:
    # mitmproxy's confdir (the CA key), the token file, agenttap_sandbox_hide.
    sandbox: str = "bwrap"
    confdir: str = ""
    sandbox_hide: tuple[Path, ...] = ()
    # Shown read-only in every sandbox (agenttap_sandbox_expose).
    sandbox_expose: tuple[Path, ...] = ()
    # Where a sandboxed run sees its folders: "fixed" or "host" (agenttap_sandbox_paths).
    sandbox_paths: str = "fixed"
    # Connections a sandbox may hold to the proxy and the API at once
    # (agenttap_rollout_max_connections).
    rollout_max_connections: int = 64
    extra: dict[str, Any] = field(default_factory=dict)
