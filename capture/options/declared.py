"""Every agenttap option declared once: its name, its default as a user writes it, its help
text (what mitmproxy shows, and docs/OPTIONS.md) and the pure parser that reads it; the
registered providers' own options beside them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from capture.options.values import (
    parse_bool,
    parse_choice,
    parse_folder,
    parse_host,
    parse_hosts,
    parse_list,
    parse_max_connections,
    parse_model_map,
    parse_out_folder,
    parse_passthrough,
    parse_paths,
    parse_port,
    parse_seconds,
    parse_text,
    parse_token,
    parse_token_file,
    parse_tolerance,
    parse_urls,
    parse_whole,
)
from rewriter.parsers import check_parser_names
from rewriter.providers import registered

PREFIX = "agenttap_"
DEFAULT_HOSTS = "api.openai.com,api.anthropic.com,generativelanguage.googleapis.com"
DEFAULT_MODEL_NAMES = "claude-opus-5-5,claude-sonnet-4-5,claude-haiku-5-5"
# Options whose value is a secret: errors name them, never their value.
SECRET_OPTIONS = frozenset({"agenttap_token"})


def _parser_name(kind: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        name = text.strip()
        if kind == "tool":
            check_parser_names(name, "none")
        else:
            check_parser_names("none", name)
        return name

    return parse


# -- the declarations -------------------------------------------------------------------------
@dataclass(frozen=True)
class Option:
    """One option: its name, its default as a user writes it, what it means and its format
    (the help text mitmproxy shows), and the pure function that reads it."""

    name: str
    default: str
    help: str
    parse: Callable[[str], Any]


CORE_OPTIONS: tuple[Option, ...] = (
    Option(
        "agenttap_policy_url",
        "",
        "vLLM server URL(s), comma-separated: http://HOST:PORT, or unix:/PATH for one served on a "
        "unix socket (vllm serve --uds PATH: only the socket folder's owner reaches its dev-mode "
        "routes; a TCP one whose /pause answers anyone is warned of at start). A session sticks "
        "to one.",
        parse_urls,
    ),
    Option(
        "agenttap_tokenizer",
        "",
        "Folder of the policy's tokenizer (tokenizer.json, tokenizer_config.json).",
        parse_folder,
    ),
    Option(
        "agenttap_out",
        "agenttap-out",
        "Folder for journals and shards (created if missing).",
        parse_out_folder,
    ),
    Option(
        "agenttap_tool_parser",
        "hermes",
        "Tool-call parser, named as vLLM's --tool-call-parser (hermes, none).",
        _parser_name("tool"),
    ),
    Option(
        "agenttap_reasoning_parser",
        "qwen3",
        "Reasoning parser, named as vLLM's --reasoning-parser (qwen3, deepseek_r1, none).",
        _parser_name("reasoning"),
    ),
    Option(
        "agenttap_hosts",
        DEFAULT_HOSTS,
        "API hosts answered by the policy, comma-separated; every other host is refused.",
        parse_hosts,
    ),
    Option(
        "agenttap_idle_timeout",
        "300",
        "Seconds without a call after which a session is written as a shard (a whole number, "
        "0 or more).",
        parse_whole,
    ),
    # Zero would mean "refuse every body", "never time out" (a hung policy hangs its clients)
    # and "no limit": never what a user means, so these take positive numbers only.
    Option(
        "agenttap_max_body_bytes",
        str(8 * 1024 * 1024),
        "Largest request body accepted, in bytes (a whole number above 0).",
        lambda text: parse_whole(text, positive=True),
    ),
    Option(
        "agenttap_policy_timeout",
        "300",
        "Seconds the policy may go without sending a new token before the call fails (a whole "
        "number above 0).",
        lambda text: parse_whole(text, positive=True),
    ),
    Option(
        "agenttap_stream_flush_ms",
        "200",
        "Least milliseconds between two events of a streamed answer (a whole number; 0: every "
        "token as soon as it is read). Tokens that come sooner go with the next event; the "
        "first token and the end of an answer are never held.",
        parse_whole,
    ),
    Option(
        "agenttap_policy_connections",
        "1024",
        "Concurrent policy requests (a whole number above 0).",
        lambda text: parse_whole(text, positive=True),
    ),
    Option(
        "agenttap_replica_max_inflight",
        "0",
        "Generations at once per policy server (a whole number; 0: unbounded). Calls beyond it "
        "wait (agenttap_replica_queue).",
        parse_whole,
    ),
    Option(
        "agenttap_weights_tolerance",
        "1e-3",
        "Largest |logprob difference| between a policy server and the trainer (a weight "
        "update's probe) or its own fingerprint (later checks) that still counts as the same "
        "weights (a number above 0). 1e-3 fits fp32 servers; bf16 servers differ from a fp32 "
        "trainer by about 1e-2 to 5e-2 on the same weights: set 0.1 there.",
        parse_tolerance,
    ),
    Option(
        "agenttap_weights_check_s",
        "60",
        "Seconds between checks of each policy server's weight fingerprint besides its health "
        "checks (a number, 0 or more; 0: at health checks only). A server whose answers "
        "changed without a weight update leaves rotation.",
        parse_seconds,
    ),
    Option(
        "agenttap_replica_queue",
        "256",
        "Calls that may wait per policy server when agenttap_replica_max_inflight are running "
        "(a whole number, 0 or more); beyond it a call gets its provider's retryable error.",
        parse_whole,
    ),
    Option(
        "agenttap_session_max_inflight",
        "8",
        "Generations one session may have at the policy at once (a whole number; 0: "
        "unbounded). Its other calls wait their turn in its own queue, in order (at most "
        "agenttap_replica_queue of them); a busy server's free slots go to the waiting "
        "sessions in turn.",
        parse_whole,
    ),
    Option(
        "agenttap_client_timeout",
        "60",
        "Seconds a client connection may take to send a whole request (headers and body) after "
        "it opens or after its previous answer ended; then it is closed (a whole number above "
        "0). Answers and WebSocket sessions are not bounded by it.",
        lambda text: parse_whole(text, positive=True),
    ),
    Option(
        "agenttap_model_map",
        "",
        "Requested model names to policy servers: PATTERN=URL[|URL],... (fnmatch patterns; "
        "unmatched names go to agenttap_policy_url).",
        parse_model_map,
    ),
    Option(
        "agenttap_model_names",
        DEFAULT_MODEL_NAMES,
        "Model names GET /v1/models lists, comma-separated (any name is served).",
        parse_list,
    ),
    Option(
        "agenttap_recompute_mismatch_logprobs",
        "true",
        "Re-score with vLLM prompt_logprobs the policy's tokens whose context a scaffold "
        "rewrote, and those sampled under a JSON schema (true/false; false masks them out of "
        "the loss instead).",
        parse_bool,
    ),
    Option(
        "agenttap_journal_fsync",
        "after_reply",
        "When a call's journal line is fsynced: after_reply (written before the answer ends, so "
        "a crash of agenttap loses nothing; fsynced right after, batched: a crash of the host "
        "may lose the last milliseconds of calls) or before_reply (the answer ends only once "
        "the line is on disk; a disk flush per call).",
        lambda text: parse_choice(text, ("after_reply", "before_reply")),
    ),
    Option(
        "agenttap_api_host",
        "127.0.0.1",
        "Address the control API and the per-session base URLs (http://HOST:PORT/sess/ID/v1) "
        "listen on; 0.0.0.0 for every interface (then sandboxes elsewhere can reach it).",
        parse_host,
    ),
    Option(
        "agenttap_api_port",
        "0",
        "Port of the control API and the per-session base URLs (a whole number; 0: a free port, "
        "printed at start as AGENTTAP_API=http://HOST:PORT).",
        parse_port,
    ),
    Option(
        "agenttap_token",
        "",
        "Bearer token the control API wants (24 or more letters, digits, - . _ ~, not one "
        "character repeated); empty: agenttap_token_file's, else a random one, printed at "
        "start as AGENTTAP_TOKEN=... Prefer agenttap_token_file: a command line is public.",
        parse_token,
    ),
    Option(
        "agenttap_token_file",
        "",
        "File holding the control API's bearer token (mode 0600: readable by its owner only). "
        "Use it instead of agenttap_token, whose value every local user can read on mitmdump's "
        "command line (scripts/run_proxy.sh and the launcher do).",
        parse_token_file,
    ),
    Option(
        "agenttap_require_session_secret",
        "false",
        "true: every API call must name a session opened through the control API (POST "
        "/sessions or /rollouts) and carry its secret (the proxy password, or the API key in "
        "base-URL mode); false: calls under a proxy username (or base URL) never opened keep "
        "working. Either way an opened session always wants its secret, and what calls "
        "recorded under its id before it was opened is kept apart, never joined to it "
        "(true/false).",
        parse_bool,
    ),
    Option(
        "agenttap_sandbox",
        "bwrap",
        "How rollouts (POST /rollouts) run their agent and verifier: bwrap (a bubblewrap "
        "sandbox per rollout: its own network, PID and user namespaces, a tree built from an "
        "allowlist (the system's programs, the agent's install, its workdir, HOME and TMPDIR), "
        "kernel limits; needs apt-get install bubblewrap) or none (as plain child "
        "processes, which can read and write everything this user can; logged as a warning). "
        'A rollout request may ask for "sandbox": "none" itself.',
        lambda text: parse_choice(text, ("bwrap", "none")),
    ),
    Option(
        "agenttap_sandbox_hide",
        "",
        "Paths (comma-separated) a rollout's sandbox never shows, beyond OUT, mitmproxy's "
        "confdir (the CA key) and agenttap_token_file. The sandbox's tree is an allowlist "
        "already; these are hidden again where they lie inside a folder it shows (an exposed "
        "checkout holding your private logs), and no rollout may expose them.",
        parse_paths,
    ),
    Option(
        "agenttap_sandbox_expose",
        "",
        "Paths (comma-separated) every rollout's sandbox shows read-only beyond the system's "
        "programs, the agent's own install and the CA: a toolchain in /opt, a dataset. A "
        'rollout request adds its own with "expose". Never expose OUT, the token or a model '
        "folder: what a sandbox shows, its agent can read.",
        parse_paths,
    ),
    Option(
        "agenttap_sandbox_paths",
        "fixed",
        "Where a rollout's bubblewrap sandbox shows the agent its folders: fixed (its working "
        "folder at /workdir, HOME at /home/agent, TMPDIR at /tmp/agent, on every host: the "
        "scaffolds write their working folder into the prompt, so the same seed then samples "
        "the same run wherever OUT is, and a group's prompts share the policy's prefix cache) "
        "or host (at their paths under OUT, as before). A container shows the image's WORKDIR "
        "either way.",
        lambda text: parse_choice(text, ("fixed", "host")),
    ),
    Option(
        "agenttap_rollout_max_connections",
        "64",
        "Connections each sandboxed rollout agent may hold at once to the proxy and the API "
        "listener together (its bridge counts both); past it a new one is closed unrelayed "
        "and counted, and the log says so once per interval. The sandboxes together also "
        "leave a quarter of mitmdump's descriptors to everything else (a whole number above "
        "0).",
        parse_max_connections,
    ),
    Option(
        "agenttap_check_policy",
        "true",
        "At start, check that every policy server answers, serves a model, and tokenizes and "
        "decodes (special tokens, ids over the whole vocabulary) as agenttap_tokenizer does; "
        "else stop with what to fix (true/false; false starts anyway, and calls get the "
        "provider's retryable error until the policy answers).",
        parse_bool,
    ),
    Option(
        "agenttap_passthrough",
        "",
        "Hosts (comma-separated, fnmatch patterns such as *.pypi.org) whose traffic is tunnelled "
        "or forwarded unchanged, never answered nor recorded: for the agent's own tools (package "
        "indexes, git hosts). Empty: every host but the API hosts is refused. May not match an "
        "API host.",
        parse_passthrough,
    ),
    Option(
        "agenttap_max_staleness",
        "",
        "Weight versions a session may fall behind: a session whose first call was answered "
        "more than this many updates (POST /policy/weights or /policy/version) ago gets its "
        "next call answered as final, and ends with end_reason stale. Empty: no limit (a whole "
        "number, 0 or more).",
        lambda text: parse_whole(text) if text.strip() else None,
    ),
    Option(
        "agenttap_max_rollouts",
        "8",
        "Agents that rollouts (POST /rollouts) may run at once; past it a rollout is refused "
        "with 429 and Retry-After (a whole number above 0).",
        lambda text: parse_whole(text, positive=True),
    ),
    Option(
        "agenttap_rollout_memory_mb",
        "",
        "Memory (MiB) that rollouts' running agents and verifiers may be promised together "
        "(each run: its memory_mb plus its disk_mb tmpfs); past it a rollout waits, or gets 429 "
        "with Retry-After when it asked not to wait. Also the cap of the rollouts' parent "
        "cgroup. Empty: 80% of this host's memory (a whole number above 0).",
        lambda text: parse_whole(text, positive=True) if text.strip() else None,
    ),
    Option(
        "agenttap_advertise_host",
        "",
        "Host name or address put in the URLs handed to clients (proxy URL, base URLs); empty: "
        "the listening address, or this machine's address when listening on every interface.",
        parse_host,
    ),
)

_KIND_PARSERS: dict[type, Callable[[str], Any]] = {
    int: parse_whole,
    float: parse_seconds,
    bool: parse_bool,
    str: parse_text,
}


def provider_options() -> tuple[Option, ...]:
    """Each registered provider's own options, read by the parser of their declared type."""
    out = []
    for provider in registered().values():
        for option in provider.options:
            default = option.default
            text = ("true" if default else "false") if isinstance(default, bool) else str(default)
            out.append(Option(option.name, text, option.help, _KIND_PARSERS[option.type]))
    return tuple(out)


def all_options() -> tuple[Option, ...]:
    return CORE_OPTIONS + provider_options()
