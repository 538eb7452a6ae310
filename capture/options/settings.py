"""The typed configuration: every agenttap option parsed into one ``Settings``, with the checks
that span several options (a provider's own, a token given twice, a passthrough pattern that
would let an API host through)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from capture.options.declared import all_options
from capture.options.reading import parse_value
from capture.options.values import passes_through
from rewriter.providers import registered


@dataclass(frozen=True)
class Settings:
    """Every agenttap option, parsed."""

    policy_urls: list[str]
    tokenizer: Path | None
    out: Path
    tool_parser: str
    reasoning_parser: str
    hosts: frozenset[str]
    idle_timeout_s: float
    max_body_bytes: int
    policy_timeout_s: float
    stream_flush_ms: int
    policy_connections: int
    replica_max_inflight: int
    replica_queue: int
    client_timeout_s: int
    session_max_inflight: int
    model_map: list[tuple[str, list[str]]]
    model_names: list[str]
    # Re-score policy tokens whose logprobs no longer match their context; off: masked instead.
    recompute_logprobs: bool
    provider_options: dict[str, Any] = field(default_factory=dict)
    # Weight checks of the policy servers (agenttap_weights_tolerance, _check_s).
    weights_tolerance: float = 1e-3
    weights_check_s: float = 60.0
    # The control API and base-URL listener (capture/control/api.py).
    api_host: str = "127.0.0.1"
    api_port: int = 0
    token: str = ""
    advertise_host: str = ""
    max_rollouts: int = 8
    rollout_memory_mb: int | None = None
    passthrough: tuple[str, ...] = ()
    check_policy: bool = True
    fsync_before_reply: bool = False
    require_session_secret: bool = False
    max_staleness: int | None = None
    sandbox: str = "bwrap"
    sandbox_hide: tuple[Path, ...] = ()
    sandbox_expose: tuple[Path, ...] = ()
    sandbox_paths: str = "fixed"
    rollout_max_connections: int = 64
    token_file: Path | None = None


def parse_settings(texts: Mapping[str, str]) -> Settings:
    """All options from their texts (a missing one takes its default). Raises ValueError naming
    the option and what it accepts."""
    values = {o.name: parse_value(o, texts.get(o.name, o.default)) for o in all_options()}
    for provider in registered().values():
        own = {o.name: values[o.name] for o in provider.options}
        try:
            provider.check_options(own)
        except ValueError as exc:
            names = ", ".join(f"--set {name}" for name in own)
            raise ValueError(f"agenttap: {names}: {exc}") from None
    overlap = sorted(
        h for h in values["agenttap_hosts"] if passes_through(h, values["agenttap_passthrough"])
    )
    if values["agenttap_token"] and values["agenttap_token_file"]:
        raise ValueError(
            "agenttap: --set agenttap_token and --set agenttap_token_file are both set; give "
            "the token once (the file keeps it off the command line)"
        )
    if overlap:
        raise ValueError(
            f"agenttap: --set agenttap_passthrough would let {', '.join(overlap)} through: API "
            f"calls, keys included, would reach the real provider. Remove the pattern(s) that "
            f"match it (the API hosts are answered by the policy, never passed through)."
        )
    return Settings(
        policy_urls=values["agenttap_policy_url"],
        tokenizer=values["agenttap_tokenizer"],
        out=values["agenttap_out"],
        tool_parser=values["agenttap_tool_parser"],
        reasoning_parser=values["agenttap_reasoning_parser"],
        hosts=values["agenttap_hosts"],
        idle_timeout_s=values["agenttap_idle_timeout"],
        max_body_bytes=values["agenttap_max_body_bytes"],
        policy_timeout_s=values["agenttap_policy_timeout"],
        stream_flush_ms=values["agenttap_stream_flush_ms"],
        policy_connections=values["agenttap_policy_connections"],
        replica_max_inflight=values["agenttap_replica_max_inflight"],
        replica_queue=values["agenttap_replica_queue"],
        session_max_inflight=values["agenttap_session_max_inflight"],
        weights_tolerance=values["agenttap_weights_tolerance"],
        weights_check_s=values["agenttap_weights_check_s"],
        client_timeout_s=values["agenttap_client_timeout"],
        model_map=values["agenttap_model_map"],
        model_names=values["agenttap_model_names"],
        recompute_logprobs=values["agenttap_recompute_mismatch_logprobs"],
        api_host=values["agenttap_api_host"] or "127.0.0.1",
        api_port=values["agenttap_api_port"],
        token=values["agenttap_token"] or values["agenttap_token_file"],
        advertise_host=values["agenttap_advertise_host"],
        max_rollouts=values["agenttap_max_rollouts"],
        rollout_memory_mb=values["agenttap_rollout_memory_mb"],
        passthrough=values["agenttap_passthrough"],
        check_policy=values["agenttap_check_policy"],
        fsync_before_reply=values["agenttap_journal_fsync"] == "before_reply",
        require_session_secret=values["agenttap_require_session_secret"],
        max_staleness=values["agenttap_max_staleness"],
        sandbox=values["agenttap_sandbox"],
        sandbox_hide=values["agenttap_sandbox_hide"],
        sandbox_expose=values["agenttap_sandbox_expose"],
        sandbox_paths=values["agenttap_sandbox_paths"],
        rollout_max_connections=values["agenttap_rollout_max_connections"],
        token_file=(
            Path(texts["agenttap_token_file"].strip()).expanduser().absolute()
            if texts.get("agenttap_token_file", "").strip()
            else None
        ),
        provider_options={o.name: values[o.name] for p in registered().values() for o in p.options},
    )
