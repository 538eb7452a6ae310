"""What each proxy adds to a chat call, side by side: direct, plain mitmdump, agenttap, LiteLLM.

    .venv/bin/python bench/overhead.py [--quick] [--calls 200] [--seconds 5] [--rounds 3]
                                       [--no-litellm] [--only direct,mitmdump,agenttap]
                                       [--system-tokens 20000] [--tools 20] [--pool 2]

Paths, all in one run, interleaved (each round rotates which path goes first):

- ``direct``: an OpenAI-compatible fake server (aiohttp, its own process) answering chat
  completions at once: ``max_tokens`` words, whole or as an SSE stream of one chunk per word.
- ``mitmdump``: plain mitmdump (no script) in regular mode; the client calls
  ``https://api.openai.com`` through ``HTTPS_PROXY``-style CONNECT, TLS intercepted with the
  mitmproxy CA, and mitmproxy's own ``map_remote`` sends it to the fake server over HTTP.
  As mitmproxy does by default, it holds each answer whole before sending it on: a stream
  reaches the client all at once, when it has ended.
- ``mitmdump-s``: the same with ``bench/stream_responses.py``: streams relayed as they come,
  chunk by chunk, which is what agenttap does (and what a user forwarding SSE would set up).
- ``agenttap``: mitmdump + addons/capture.py, same mode, same client, same CA; answered by the
  vLLM-shaped stub (tests/support/stub_vllm.py, real Qwen3 tokenizer, its decoding cached so it answers
  at once), prompts rendered and calls recorded as in real use.
- ``agenttap-2``: the same, as a pool of ``--pool`` agenttap processes (default 2), each
  conversation's session on one of them (by a hash of its name), as ``capture/client/ray_pool.py``
  and ``bench/concurrency.py --proxies`` place sessions: one Python process uses one core, and
  the pool is how agenttap uses more. Its CPU is the whole pool's.
- ``policy``: the stub alone, called as agenttap calls it (the conversation rendered to token
  ids before the clock starts, ``POST /v1/completions``): the policy's own time, so agenttap's
  latency minus this one is what agenttap itself adds (a second table).
- ``litellm``: LiteLLM's proxy (``litellm --config``) in front of the fake server, called at its
  base URL (plain HTTP, as its users do). Installed on first use into ``.cache/litellm-venv``
  (never into ``.venv``); the column is skipped with a note if that fails.

Each client is an agent-like conversation: every call resends the history plus the reply it got
and a new user message, eight calls, then it starts over (agenttap: one proxy session per client,
extending its calls); ``--system-tokens N`` makes its system prompt N tokens longer, ``--tools N``
makes every call offer N agent-sized function tools. Reported
per path: the latency it adds over ``direct`` at concurrency 1 (p50, p95 of the path's latencies
minus direct's), non-streamed 1 token and a 64-token stream;
calls per second with 32 and 64 clients at once (each its own keep-alive connection); and the
ratios to plain mitmdump; and, from the throughput runs at 32 clients, the CPU milliseconds each
call costs the path's proxy (or server), the server behind it and the bench client (from
/proc: every thread and child process counted), which says where a shared machine's cores go.
Every answer is checked (status, whole stream, content).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # as a script: bench.* and the project's packages

from bench import overhead_client as client  # noqa: E402
from bench.common import pct  # noqa: E402
from bench.overhead_client import (  # noqa: E402
    KINDS,
    Path_,
    PolicyPath,
    PoolPath,
    bench_tools,
    measure,
)
from bench.overhead_servers import (  # noqa: E402
    WORDS,
    Server,
    serve_fake,
    serve_stub,
    spawn_child,
    start_agenttap,
    start_litellm,
    start_plain_mitmdump,
    stop_child,
)

PATHS = ("direct", "mitmdump", "mitmdump-s", "agenttap", "agenttap-2", "policy", "litellm")
# The pool path: this many agenttap processes, sessions spread over them (--pool sets it).
POOL = 2


def ratio(value: float, ref: float) -> str:
    """``value`` as a multiple of ``ref`` for the tables ("-" where there is no reference)."""
    return f"{value / ref:.2f}x" if ref > 0 else "-"


def bound(ms: list[float], processes: int, cores: int) -> float:
    """Calls/s a path's CPU per call (proxy, server behind it, client) allows: its proxy's
    processes use a core each at most, and everything shares the machine's cores."""
    own, total = ms[0], sum(ms)
    limits = [1000.0 * cores / total] if total > 0 else []
    if own > 0:
        limits.append(1000.0 * processes / own)
    return min(limits) if limits else float("inf")


def report(
    names: list[str],
    latency: dict[tuple[str, str], list[float]],
    rates: dict[tuple[str, str, int], list[float]],
    cpu: dict[tuple[str, str, int], list[tuple[float, float, float]]],
    notes: dict[str, str],
    processes: dict[str, int],
) -> None:
    """The tables; ``processes``: proxy processes per path where more than one."""
    kinds = [k for k, _, _ in KINDS]
    print("\nAdded latency per call at concurrency 1, ms (the path's p50/p95 minus direct's):")
    head = f"{'path':<10}"
    for kind in kinds:
        head += f" | {kind + ' p50':>20} {'p95':>6} {'x mitm':>7}"
    print(head)
    added: dict[tuple[str, str], tuple[float, float]] = {}
    for name in names:
        for kind in kinds:
            own, base = latency[(name, kind)], latency[("direct", kind)]
            added[(name, kind)] = (pct(own, 0.5) - pct(base, 0.5), pct(own, 0.95) - pct(base, 0.95))
    for name in names:
        line = f"{name:<10}"
        for kind in kinds:
            p50, p95 = added[(name, kind)]
            if name == "direct":
                p50, p95 = pct(latency[(name, kind)], 0.5), pct(latency[(name, kind)], 0.95)
                line += f" | {'(own) ' + f'{p50:.2f}':>20} {p95:>6.2f} {'':>7}"
                continue
            ref = added.get(("mitmdump", kind), (0.0, 0.0))[0]
            line += f" | {p50:>20.2f} {p95:>6.2f} {ratio(p50, ref):>7}"
        print(line)
    if ("agenttap", kinds[0]) in latency and ("policy", kinds[0]) in latency:
        # What agenttap itself adds: its latency over its policy's own (the stub called as
        # agenttap calls it), against what plain mitmdump adds over its server (the fake).
        print("\nagenttap over its policy, ms (agenttap's p50/p95 minus the policy path's):")
        print(
            f"{'path':<10}"
            + "".join(f" | {k + ' p50':>20} {'p95':>6} {'x mitm':>7}" for k in kinds)
        )
        line = f"{'agenttap':<10}"
        for kind in kinds:
            own, base = latency[("agenttap", kind)], latency[("policy", kind)]
            p50, p95 = pct(own, 0.5) - pct(base, 0.5), pct(own, 0.95) - pct(base, 0.95)
            ref = added.get(("mitmdump", kind), (0.0, 0.0))[0]
            line += f" | {p50:>20.2f} {p95:>6.2f} {ratio(p50, ref):>7}"
        print(line)
    print("\nThroughput, calls/s (median of rounds; x mitm: / plain mitmdump's):")
    cols = [(kind, c) for c in (32, 64) for kind in kinds]
    print(
        f"{'path':<10}"
        + "".join(f" | {f'{kind}, {c} clients':>27} {'x mitm':>6}" for kind, c in cols)
    )
    for name in names:
        line = f"{name:<10}"
        for kind, c in cols:
            value = statistics.median(rates[(name, kind, c)])
            ref = statistics.median(rates.get(("mitmdump", kind, c), [0.0]))
            line += f" | {value:>27.1f} {ratio(value, ref):>6}"
        print(line)
    print(
        f"\nCPU per call at 32 clients, ms (median of rounds; this machine has {os.cpu_count()} "
        "cores shared by every process): the path's server or proxy | the server behind the "
        "proxy | the bench client | all"
    )
    print(f"{'path':<10}" + "".join(f" | {kind:>34} {'bound':>7}" for kind in kinds))
    cores = os.cpu_count() or 1
    for name in names:
        line = f"{name:<10}"
        for kind in kinds:
            samples = cpu[(name, kind, 32)]
            ms = [statistics.median(s[i] for s in samples) for i in range(3)]
            cell = " | ".join(f"{v:.2f}" for v in (*ms, sum(ms)))
            line += f" | {cell:>34} {bound(ms, processes.get(name, 1), cores):>7.0f}"
        print(line)
    print(
        "bound: the most calls/s this CPU per call allows: each proxy process at most one core "
        "(Python), all processes together at most this machine's cores"
    )
    if "mitmdump-s" in names:
        streaming_ratios(names, kinds, added, rates)
    for name, note in notes.items():
        print(f"{name}: skipped ({note})")


def streaming_ratios(
    names: list[str],
    kinds: list[str],
    added: dict[tuple[str, str], tuple[float, float]],
    rates: dict[tuple[str, str, int], list[float]],
) -> None:
    """The ratios again, against mitmdump-s: a proxy that streams, as agenttap does (plain
    mitmdump sends a stream on only once it has ended)."""
    print("\nRatios to mitmdump-s (plain mitmdump relaying streams as they come):")
    cols = [(kind, c) for c in (32, 64) for kind in kinds]
    print(
        f"{'path':<10}"
        + "".join(f" | {f'added p50, {kind}':>27}" for kind in kinds)
        + "".join(f" | {f'calls/s, {kind}, {c}':>30}" for kind, c in cols)
    )
    for name in names:
        if name in ("direct", "mitmdump-s"):
            continue
        line = f"{name:<10}"
        for kind in kinds:
            ref = added.get(("mitmdump-s", kind), (0.0, 0.0))[0]
            line += f" | {ratio(added[(name, kind)][0], ref):>27}"
        for kind, c in cols:
            ref = statistics.median(rates[("mitmdump-s", kind, c)])
            line += f" | {ratio(statistics.median(rates[(name, kind, c)]), ref):>30}"
        print(line)


def main() -> int:
    global POOL
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short run: 40 calls, 2 s, 1 round")
    parser.add_argument("--calls", type=int, default=200, help="latency calls per path and kind")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--seconds", type=float, default=5.0, help="per throughput measurement")
    parser.add_argument("--rounds", type=int, default=3, help="throughput rounds (median)")
    parser.add_argument("--no-litellm", action="store_true")
    parser.add_argument(
        "--pool",
        type=int,
        default=POOL,
        help="agenttap processes in the agenttap-2 path (0: no such path)",
    )
    parser.add_argument("--only", default="", help="comma-separated paths (direct always runs)")
    parser.add_argument(
        "--system-tokens",
        type=int,
        default=0,
        help="a system prompt this many tokens longer (agents send 10,000 and more)",
    )
    parser.add_argument(
        "--tools", type=int, default=0, help="function tools every call offers (agents: 10-40)"
    )
    parser.add_argument("--serve-fake", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--serve-stub", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_fake:
        serve_fake()
        return 0
    if args.serve_stub:
        serve_stub()
        return 0
    if args.quick:
        args.calls, args.warmup, args.seconds, args.rounds = 40, 5, 2.0, 1
    # What every conversation sends (overhead_client's Conversation reads them).
    client.SYSTEM += "".join(" " + WORDS[i % len(WORDS)] for i in range(args.system_tokens))
    client.TOOLS = bench_tools(args.tools)
    wanted = [p for p in PATHS if not args.only or p == "direct" or p in args.only.split(",")]
    if args.no_litellm and "litellm" in wanted:
        wanted.remove("litellm")
    POOL = args.pool
    if POOL < 2 and "agenttap-2" in wanted:
        wanted.remove("agenttap-2")
    work = Path(tempfile.mkdtemp(prefix="agenttap-overhead-"))
    confdir = work / "conf"
    children: list[subprocess.Popen[bytes]] = []
    servers: dict[str, Server] = {}
    notes: dict[str, str] = {}
    try:
        fake, fake_url = spawn_child("--serve-fake", work)
        children.append(fake)
        servers["direct"] = Server("direct", fake, work / "serve-fake.log", fake_url)
        if "mitmdump" in wanted:
            servers["mitmdump"] = start_plain_mitmdump("mitmdump", fake_url, work, confdir)
            servers["mitmdump"].upstream = servers["direct"]
        if "mitmdump-s" in wanted:
            servers["mitmdump-s"] = start_plain_mitmdump(
                "mitmdump-s", fake_url, work, confdir, streaming=True
            )
            servers["mitmdump-s"].upstream = servers["direct"]
        if "agenttap" in wanted or "agenttap-2" in wanted:
            stub, stub_url = spawn_child("--serve-stub", work)
            children.append(stub)
            # The stub alone, called as agenttap calls it: agenttap's own share of its latency.
            servers["policy"] = Server("policy", stub, work / "serve-stub.log", stub_url)

            def agenttap(name: str) -> Server:
                server = start_agenttap(name, stub_url, work / "out" / name, work, confdir)
                server.upstream = servers["policy"]
                return server

            if "agenttap" in wanted:
                servers["agenttap"] = agenttap("agenttap")
            if "agenttap-2" in wanted and POOL > 1:
                pool = [agenttap(f"agenttap-2.{i}") for i in range(POOL)]
                pool[0].name, pool[0].members = "agenttap-2", pool[1:]
                servers["agenttap-2"] = pool[0]
        if "litellm" in wanted:
            started = start_litellm(fake_url, work)
            if isinstance(started, str):
                notes["litellm"] = started
            else:
                servers["litellm"] = started
                started.upstream = servers["direct"]
        names = [p for p in PATHS if p in servers]
        ca = confdir / "mitmproxy-ca-cert.pem"
        deadline = time.monotonic() + 30
        while not ca.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        kinds = {"policy": PolicyPath, "agenttap-2": PoolPath}
        paths = {name: kinds.get(name, Path_)(servers[name], ca) for name in names}
        print(
            f"paths: {', '.join(names)}; system prompt {len(client.SYSTEM.split())} words, "
            f"{len(client.TOOLS)} tools; "
            f"{args.calls} latency calls per path and kind after "
            f"{args.warmup} warm-up, throughput {args.seconds:g} s x {args.rounds} round(s); "
            f"logs in {work}",
            flush=True,
        )
        latency, rates, cpu = asyncio.run(
            measure(paths, args.calls, args.warmup, args.seconds, args.rounds)
        )
        report(
            names,
            latency,
            rates,
            cpu,
            notes,
            {name: 1 + len(server.members) for name, server in servers.items()},
        )
    finally:
        for server in servers.values():
            if server.name not in ("direct", "policy"):  # children, stopped below
                for member in (server, *server.members):
                    member.stop()
        for child in children:
            stop_child(child)
    return 0


if __name__ == "__main__":
    sys.exit(main())
