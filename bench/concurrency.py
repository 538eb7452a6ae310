"""Many streaming clients at once through one proxy: does every one get its whole answer?

    .venv/bin/python bench/concurrency.py [--clients 1200] [--runs 5] [--timeout 240] [--proxies N]

Starts the scripted stub policy (tests/support/stub_vllm.py, in a process of its own, with vLLM's
listen backlog) and a real mitmdump with the addon, then, per run, opens ``--clients`` streaming
chat-completions calls at once, each its own session, over HTTPS through the proxy (CONNECT,
TLS trusting the proxy's CA) on loopback, and reads each stream to its end. A call is ``ok``
when its status is 200 and its stream ends with ``data: [DONE]`` after a finish_reason. Prints a
table per run (status / outcome counts, latency percentiles) and exits non-zero if any call was
not ok. Each run is bounded by ``--timeout`` seconds; the file-descriptor soft limit is raised to
the hard one first (each call holds about five descriptors across the three processes).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import resource
import ssl
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import aiohttp  # noqa: E402

from bench.common import rank_pct, serve_stub  # noqa: E402
from tests.support.paths import QWEN3  # noqa: E402
from tests.support.proxies import Proxy, start_proxy  # noqa: E402

REPLY = "one two three four five six seven eight nine ten eleven twelve"


def raise_fd_limit() -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


async def one_call(
    http: aiohttp.ClientSession, proxy: Proxy, i: int, run: int, timeout: float
) -> tuple[str, float]:
    """(outcome, seconds): outcome is ``ok``, ``HTTP <status>``, ``200 error event``,
    ``200 cut short`` or the exception's type."""
    body = {
        "model": "gpt-4o",
        "messages": [{"role": "user", "content": f"Count for client {i}."}],
        "stream": True,
    }
    began = time.monotonic()
    try:
        async with http.post(
            "https://api.openai.com/v1/chat/completions",
            json=body,
            headers={"Authorization": "Bearer sk-bench"},
            proxy=f"http://127.0.0.1:{proxy.port}",
            proxy_auth=aiohttp.BasicAuth(f"bench-{run}-{i}", "x"),
            timeout=aiohttp.ClientTimeout(total=timeout),
        ) as resp:
            raw = await resp.read()
            took = time.monotonic() - began
            if resp.status != 200:
                return f"HTTP {resp.status}", took
    except Exception as exc:  # every failure is counted by kind, none ends the run
        return type(exc).__name__, time.monotonic() - began
    events = [e[6:] for e in raw.split(b"\n\n") if e.startswith(b"data: ")]
    if not events or events[-1] != b"[DONE]":
        return "200 cut short", took
    chunks = [json.loads(e) for e in events[:-1]]
    if any("error" in c for c in chunks):
        return "200 error event", took
    if not any(ch.get("finish_reason") for c in chunks for ch in c.get("choices", [])):
        return "200 cut short", took
    return "ok", took


def rss_mib(pid: int) -> float:
    """Resident memory of a process (Linux /proc), MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


async def peak_rss(pid: int, peak: list[float]) -> None:
    """Sample ``pid``'s resident memory until cancelled; ``peak[0]`` holds the highest."""
    while True:
        peak[0] = max(peak[0], rss_mib(pid))
        await asyncio.sleep(0.05)


async def one_run(
    proxies: list[Proxy], clients: int, run: int, timeout: float
) -> dict[str, object]:
    """``clients`` calls at once, client i through proxy ``i % len(proxies)`` (all proxies
    share one CA: one confdir)."""
    ctx = ssl.create_default_context(cafile=str(proxies[0].ca))
    # No pool limit: every call its own connection (its own CONNECT), all at once.
    connector = aiohttp.TCPConnector(limit=0, ssl=ctx)
    idle = [rss_mib(p.proc.pid) for p in proxies]
    peaks = [[m] for m in idle]
    loop = asyncio.get_running_loop()
    samplers = [
        loop.create_task(peak_rss(p.proc.pid, k)) for p, k in zip(proxies, peaks, strict=True)
    ]
    async with aiohttp.ClientSession(connector=connector) as http:
        began = time.monotonic()
        results = await asyncio.gather(
            *(one_call(http, proxies[i % len(proxies)], i, run, timeout) for i in range(clients))
        )
        wall = time.monotonic() - began
    for sampler in samplers:
        sampler.cancel()
    idle_total, peak_total = sum(idle), sum(k[0] for k in peaks)
    outcomes = collections.Counter(o for o, _ in results)
    times = sorted(t for _, t in results)

    return {
        "run": run,
        "outcomes": dict(outcomes),
        "wall_s": round(wall, 1),
        "p50_s": round(rank_pct(times, 0.5), 2),
        "p99_s": round(rank_pct(times, 0.99), 2),
        "max_s": round(times[-1], 2),
        "rss_idle_mib": round(idle_total, 1),
        "rss_peak_mib": round(peak_total, 1),
        # What the proxy processes held per session in flight, at their peaks.
        "kib_per_session": round((peak_total - idle_total) * 1024 / clients, 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=1200)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=240, help="seconds per run, at most")
    parser.add_argument(
        "--proxies", type=int, default=1, help="proxy processes the clients are spread over"
    )
    parser.add_argument("--chunk-delay", type=float, default=0.02, help="stub: s between tokens")
    parser.add_argument("--serve-stub", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    limit = raise_fd_limit()
    if args.serve_stub:
        serve_stub(QWEN3, REPLY, args.chunk_delay)  # until stdin closes
        return 0
    print(f"file descriptors: soft limit {limit}", flush=True)
    stub = subprocess.Popen(
        [sys.executable, __file__, "--serve-stub", "--chunk-delay", str(args.chunk_delay)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert stub.stdout is not None
    url = stub.stdout.readline().strip()
    tmp = Path(tempfile.mkdtemp(prefix="agenttap-concurrency-"))
    proxies = [start_proxy(url, tmp / f"out-{n}", tmp / "conf", QWEN3) for n in range(args.proxies)]
    rows = []
    try:
        for run in range(1, args.runs + 1):
            row = asyncio.run(one_run(proxies, args.clients, run, args.timeout))
            rows.append(row)
            print(json.dumps(row), flush=True)
            for proxy in proxies:
                proxy.flush()  # write the run's sessions, as a trainer's idle flush would
    finally:
        for proxy in proxies:
            proxy.stop()
        stub.communicate("", timeout=30)
    bad = sum(n for r in rows for o, n in r["outcomes"].items() if o != "ok")  # type: ignore[attr-defined]
    print(
        f"\n{'run':>4} {'ok':>6} {'not ok':>7} {'wall s':>7} {'p50 s':>6} {'p99 s':>6} "
        f"{'RSS idle MiB':>12} {'RSS peak MiB':>12} {'KiB/session':>11}  other"
    )
    for r in rows:
        outcomes = dict(r["outcomes"])  # type: ignore[call-overload]
        ok = outcomes.pop("ok", 0)
        print(
            f"{r['run']:>4} {ok:>6} {sum(outcomes.values()):>7} {r['wall_s']:>7} "
            f"{r['p50_s']:>6} {r['p99_s']:>6} {r['rss_idle_mib']:>12} {r['rss_peak_mib']:>12} "
            f"{r['kib_per_session']:>11}  {outcomes or ''}"
        )
    print(
        f"\n{args.clients} clients over {args.proxies} proxy process(es) x {args.runs} runs: "
        f"{bad} calls not ok; logs: {', '.join(str(p.log) for p in proxies)}"
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
