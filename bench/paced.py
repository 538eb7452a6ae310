"""CPU per streamed token at a generation's pace: what bounds how many streams one proxy carries.

    .venv/bin/python bench/paced.py [--clients 48] [--pace-ms 10] [--tokens 64[,512]] [--seconds 20]
        [--only mitmdump,mitmdump-s,agenttap,litellm,rllm] [--baseline REF] [--rounds 1]

``bench/overhead.py`` answers at once, so its streams arrive in a few large reads. A real policy
samples a token every 2 to 50 ms (a GPU serving a batch: every few ms), and each one comes
alone: the proxy handles every token as a read, a parse, an event and a write to the client.
Here the fake OpenAI server (behind plain mitmdump, behind ``mitmdump-s``, plain mitmdump
relaying each chunk as it comes, and behind the peers: LiteLLM's proxy and the rLLM model
gateway, their OpenAI chat route, from ``.venv-peers``, scripts/setup_peers.sh) and the
vLLM-shaped stub (behind agenttap) stream a token every ``--pace-ms`` milliseconds;
``--clients`` conversations stream back to back, each its own session, through each path in
turn (the same client code and checks as bench/overhead.py, reading each stream as it comes).

``--baseline REF[,REF...]`` adds the path ``agenttap@REF``: agenttap as it was at git revision REF (its
tree from ``git archive``, imported ahead of this checkout), run in the same way and the same
run, for an A/B of a change on this noisy machine. ``--rounds N`` runs the paths N times,
interleaved, and adds up each path's rounds (drift in the machine's load then falls on all).

Printed per path: tokens per second streamed, the proxy's CPU microseconds per token (from
/proc, every thread and child process), the ratios to plain mitmdump's and to mitmdump-s's, how
many streams at 50 tokens/s one proxy process (one core) could carry at that cost, the client's
events per token (under 1: tokens that waited went out together), and the time to the first
token's text (median and p95 over the calls).

``--tokens 64,512`` runs every path at each answer length (interleaved in every round) and adds
a table that splits each path's CPU into a cost per call (the request, the session, the record:
what a one-token answer would cost) and a cost per token streamed, a straight line through the
first and last lengths; and the answer length above which agenttap spends less per token than
mitmdump-s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import ssl
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import aiohttp  # noqa: E402

from bench import agent_procs, overhead_client, overhead_servers  # noqa: E402
from bench.common import free_port, pct  # noqa: E402

# The proxies, in the order they run (the first is the 1.00x of the ratio column).
PATHS = ("mitmdump", "mitmdump-s", "agenttap", "litellm", "rllm")
# The generation speed the streams-per-core column assumes, tokens per second per stream.
STREAM_RATE = 50


@dataclass
class Tally:
    """One path's calls, added up over its rounds."""

    tokens: int = 0
    cpu_s: float = 0.0
    seconds: float = 0.0
    events: int = 0
    first_token_s: list[float] = field(default_factory=list)

    def add(self, other: Tally) -> None:
        self.tokens += other.tokens
        self.cpu_s += other.cpu_s
        self.seconds += other.seconds
        self.events += other.events
        self.first_token_s += other.first_token_s


@dataclass
class PeerServer(overhead_servers.Server):
    """A peer, in a process group of its own (LiteLLM's workers): stopped as a group."""

    group: agent_procs.Proc | None = None

    def stop(self) -> None:
        if self.group is not None:
            self.group.stop()


class PeerPath(overhead_client.Path_):
    """A peer called directly over HTTP (no proxy, no TLS to intercept); the rLLM gateway takes
    each conversation's calls at ``/sessions/ID/v1/...``."""

    def __init__(self, server: overhead_servers.Server) -> None:  # no CA: no mitmproxy in the way
        self.server = server
        self.url = server.url + "/v1/chat/completions"
        self.ssl = ssl.create_default_context()
        self.http = None
        self.conversations = {}

    def call_url(self, conv: overhead_client.Conversation) -> str:
        if self.server.name == "rllm":
            return self.server.url + f"/sessions/{conv.session}/v1/chat/completions"
        return self.url


async def streamed_call(path: overhead_client.Path_, client: str, tokens: int) -> tuple[float, int]:
    """One streamed call of conversation ``client``, read as it comes: (seconds to the first
    token's text, events carrying text). Raises on any wrong answer, as Path_.call does."""
    conv = path.conversations.get(client)
    if conv is None:
        conv = path.conversations[client] = overhead_client.Conversation(f"bench-{client}")
    body, kwargs = path.request(conv, tokens, True)
    url = path.call_url(conv) if isinstance(path, PeerPath) else path.url
    assert path.http is not None
    began = time.perf_counter()
    first = 0.0
    raw = b""
    texts: list[str] = []
    name = path.server.name
    async with path.http.post(url, data=json.dumps(body).encode(), **kwargs) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{name}: HTTP {resp.status}: {(await resp.read())[:300]!r}")
        async for data in resp.content.iter_any():
            raw += data
            *events, raw = raw.split(b"\n\n")
            for event in events:
                line = event.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                text = path.event_text(json.loads(line[6:]))
                if text:
                    texts.append(text)
                    first = first or time.perf_counter() - began
    content = "".join(texts)
    if raw.strip() or len(content.split()) != tokens:
        raise RuntimeError(f"{name}: {tokens} tokens asked, got {content!r} (+{raw[-200:]!r})")
    conv.answered(content)
    return first, len(texts)


async def run_path(path: overhead_client.Path_, clients: int, tokens: int, seconds: float) -> Tally:
    """``clients`` conversations streaming back to back for ``seconds``, added up."""
    await path.open()
    try:
        await streamed_call(path, "warm", tokens)
        tally = Tally()
        began = time.perf_counter()
        stop_at = began + seconds

        async def worker(i: int) -> None:
            while time.perf_counter() < stop_at:
                first, events = await streamed_call(path, f"paced-{i}", tokens)
                tally.tokens += tokens
                tally.events += events
                tally.first_token_s.append(first)

        cpu0 = path.server.cpu()[0]
        await asyncio.gather(*(worker(i) for i in range(clients)))
        tally.cpu_s = path.server.cpu()[0] - cpu0
        # Until the last call ended (each started before ``seconds`` runs to its end).
        tally.seconds = time.perf_counter() - began
        return tally
    finally:
        await path.close()


def start_peer(name: str, fake_url: str, work: Path) -> PeerServer:
    """LiteLLM's proxy or the rLLM gateway (from .venv-peers) in front of the fake server."""
    if name == "rllm":
        proc, url = agent_procs.start_rllm(fake_url, work)
    else:
        # The fake server is OpenAI's chat API: LiteLLM's openai/ provider, as a user fronting
        # an OpenAI-compatible server configures it.
        config = overhead_servers.litellm_config(fake_url)
        proc, url = agent_procs.start_litellm_peer(config, work)
    return PeerServer(name, proc.proc, proc.log, url, group=proc)


def start_agenttap_at(
    ref: str, stub_url: str, work: Path, confdir: Path
) -> overhead_servers.Server:
    """agenttap as it was at git revision ``ref``: its tree, imported ahead of this checkout
    (PYTHONPATH comes before the editable install's finder)."""
    tree = work / f"tree-{ref.replace('/', '_')}"
    tree.mkdir()
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", ref], check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    name = f"agenttap@{ref}"
    port = free_port()
    log = work / f"agenttap-{tree.name}.log"
    cmd = [
        str(overhead_servers.MITMDUMP), "--listen-host", "127.0.0.1", "--listen-port", str(port),
        "--set", f"confdir={confdir}", "--set", "connection_strategy=lazy",
        "-s", str(tree / "addons" / "capture.py"),
        "--set", f"agenttap_policy_url={stub_url}",
        "--set", f"agenttap_tokenizer={overhead_servers.QWEN3}",
        "--set", f"agenttap_out={work / ('out-' + tree.name)}",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(tree)}
    with open(log, "wb") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=tree, env=env)
    overhead_servers.wait_port(port, proc, name, log, 120)
    return overhead_servers.Server(
        name, proc, log, "https://api.openai.com", f"http://127.0.0.1:{port}"
    )


def client_path(server: overhead_servers.Server, ca: Path) -> overhead_client.Path_:
    if isinstance(server, PeerServer):
        return PeerPath(server)
    return overhead_client.Path_(server, ca)


def report(tallies: dict[str, Tally], tokens: int) -> None:
    first_name = next(iter(tallies), "")
    # When mitmdump-s runs first, its column is the first path's: printed once.
    vs_s_header = "" if first_name == "mitmdump-s" else " × mitmdump-s |"
    print(f"\n{tokens}-token answers:")
    print(
        f"\n| path | tokens/s | proxy CPU µs/token | × {first_name} |{vs_s_header} "
        f"streams at {STREAM_RATE} tok/s per core | events/token | first token p50 / p95 ms |"
        f"\n|---|---:|---:|---:|{'---:|' if vs_s_header else ''}---:|---:|---:|"
    )
    per_token = {n: 1e6 * t.cpu_s / max(t.tokens, 1) for n, t in tallies.items()}
    ref = next(iter(per_token.values()), 0.0)
    ref_s = per_token.get("mitmdump-s")
    for name, tally in tallies.items():
        cost = per_token[name]
        vs_s = (f" {cost / ref_s:.2f}× |" if ref_s else " - |") if vs_s_header else ""
        first = [1e3 * s for s in tally.first_token_s]
        print(
            f"| {name} | {tally.tokens / max(tally.seconds, 1e-9):.0f} | {cost:.1f} | "
            f"{cost / ref:.2f}× |{vs_s} {1e6 / (max(cost, 1e-9) * STREAM_RATE):.0f} | "
            f"{tally.events / max(tally.tokens, 1):.2f} | "
            f"{pct(first, 0.5, empty=0.0):.0f} / {pct(first, 0.95, empty=0.0):.0f} |"
        )


def split_costs(runs: dict[int, dict[str, Tally]]) -> None:
    """Each path's CPU as a cost per call plus a cost per token: the line through its CPU per
    call at the shortest and the longest answers run."""
    short, long = min(runs), max(runs)
    lines: dict[str, tuple[float, float]] = {}
    for name, at_short in runs[short].items():
        at_long = runs[long].get(name)
        if at_long is None or not at_short.tokens or not at_long.tokens:
            continue
        per_call = [t.cpu_s / (t.tokens / n) for n, t in ((short, at_short), (long, at_long))]
        per_token = (per_call[1] - per_call[0]) / (long - short)
        lines[name] = (per_call[0] - per_token * short, per_token)
    print(
        f"\nSplit from the {short}- and {long}-token answers:\n"
        "\n| path | CPU per call, ms | CPU per token, µs | per token × mitmdump-s | "
        "less per token than mitmdump-s from |\n|---|---:|---:|---:|---:|"
    )
    ref = lines.get("mitmdump-s")
    for name, (fixed, slope) in lines.items():
        vs = f"{slope / ref[1]:.2f}×" if ref and ref[1] > 0 else "-"
        # fixed + slope * n < ref_fixed + ref_slope * n  <=>  n > (fixed - ref_fixed) / (ref_slope - slope)
        above = "-"
        if ref and name != "mitmdump-s":
            if slope < ref[1]:
                above = f"{max(0.0, (fixed - ref[0]) / (ref[1] - slope)):.0f} tokens"
            else:
                above = "never"
        print(f"| {name} | {1e3 * fixed:.2f} | {1e6 * slope:.1f} | {vs} | {above} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=48)
    parser.add_argument("--pace-ms", type=float, default=10.0)
    parser.add_argument(
        "--tokens",
        default="64",
        metavar="N[,N...]",
        help="tokens per streamed answer; several: each path runs at each, and the CPU is split "
        "into a cost per call and a cost per token",
    )
    parser.add_argument("--seconds", type=float, default=20.0, help="per path and round")
    parser.add_argument("--rounds", type=int, default=1, help="runs of every path, interleaved")
    parser.add_argument(
        "--only",
        default="",
        help=f"comma-separated paths to run, among {', '.join(PATHS)} (default: all; the first "
        "is 1.00x)",
    )
    parser.add_argument(
        "--flush-ms",
        default="",
        metavar="MS[,MS...]",
        help="run agenttap with agenttap_stream_flush_ms set to each (paths agenttap-flushMS; "
        "default: agenttap's own default, one path)",
    )
    parser.add_argument(
        "--baseline",
        default="",
        metavar="REF",
        help="also run agenttap as of these git revisions (comma-separated; path agenttap@REF "
        "each), for an A/B",
    )
    args = parser.parse_args()
    only = set(args.only.split(",")) if args.only else set(PATHS)
    if only - set(PATHS):
        parser.error(f"--only takes paths among {', '.join(PATHS)}")
    if args.pace_ms < 0 or args.clients < 1 or args.rounds < 1:
        parser.error("--pace-ms must be >= 0, --clients and --rounds >= 1")
    try:
        lengths = sorted({int(n) for n in args.tokens.split(",")})
    except ValueError:
        parser.error(f"--tokens takes whole numbers, comma-separated, not {args.tokens!r}")
    if lengths[0] < 1:
        parser.error("--tokens must be 1 or more")
    wanted = [p for p in PATHS if p in only]
    os.environ[overhead_servers.PACE_ENV] = str(args.pace_ms)  # read by the servers' processes
    os.environ[overhead_servers.REPLY_ENV] = str(lengths[-1])
    work = Path(tempfile.mkdtemp(prefix="agenttap-paced-"))
    confdir = work / "conf"
    children: list[subprocess.Popen[bytes]] = []
    proxies: list[overhead_servers.Server] = []
    skipped: dict[str, str] = {}
    try:
        fake_url = ""
        if {"mitmdump", "mitmdump-s", "litellm", "rllm"} & set(wanted):
            fake, fake_url = overhead_servers.spawn_child("--serve-fake", work)
            children.append(fake)
        for name in wanted:
            if name in ("mitmdump", "mitmdump-s"):
                proxies.append(
                    overhead_servers.start_plain_mitmdump(
                        name, fake_url, work, confdir, streaming=name == "mitmdump-s"
                    )
                )
            elif name in ("litellm", "rllm"):
                try:
                    proxies.append(start_peer(name, fake_url, work))
                except RuntimeError as exc:
                    skipped[name] = str(exc)[:300]
            elif name == "agenttap":
                stub, stub_url = overhead_servers.spawn_child("--serve-stub", work)
                children.append(stub)
                for ref in filter(None, args.baseline.split(",")):
                    proxies.append(start_agenttap_at(ref, stub_url, work, confdir))
                flushes = [int(ms) for ms in filter(None, args.flush_ms.split(","))]
                for ms in flushes or [None]:
                    name = "agenttap" if ms is None else f"agenttap-flush{ms}"
                    options = [] if ms is None else [f"agenttap_stream_flush_ms={ms}"]
                    out = work / f"out-{ms}"
                    proxies.append(
                        overhead_servers.start_agenttap(name, stub_url, out, work, confdir, options)
                    )
        ca = confdir / "mitmproxy-ca-cert.pem"
        print(
            f"{args.clients} clients, a token every {args.pace_ms:g} ms, "
            f"{'/'.join(map(str, lengths))}-token answers, {args.seconds:g} s per path x "
            f"{args.rounds} round(s); logs in {work}",
            flush=True,
        )
        for name, why in skipped.items():
            print(f"  {name}: left out ({why})", flush=True)
        runs = {n: {server.name: Tally() for server in proxies} for n in lengths}
        for _ in range(args.rounds):
            for n in lengths:
                for server in proxies:
                    if server.name in skipped:
                        continue
                    try:
                        tally = asyncio.run(
                            run_path(client_path(server, ca), args.clients, n, args.seconds)
                        )
                    except (RuntimeError, OSError, aiohttp.ClientError) as exc:
                        # A path that fails is left out of the tables, with why and its log's end.
                        tail = server.log.read_text(errors="replace")[-1500:]
                        skipped[server.name] = f"{exc}"[:300]
                        for tallies in runs.values():
                            tallies.pop(server.name, None)
                        print(f"  {server.name}: failed ({exc}); its log ends:\n{tail}", flush=True)
                        continue
                    runs[n][server.name].add(tally)
                    print(
                        f"  {server.name}, {n} tokens: {tally.tokens / tally.seconds:.0f} "
                        f"tokens/s, {1e6 * tally.cpu_s / max(tally.tokens, 1):.1f} µs/token",
                        flush=True,
                    )
        for n, tallies in runs.items():
            report(tallies, n)
        if len(lengths) > 1:
            split_costs(runs)
        for name, why in skipped.items():
            print(f"left out: {name} ({why})")
    finally:
        for server in proxies:
            server.stop()
        for child in children:
            overhead_servers.stop_child(child)
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
