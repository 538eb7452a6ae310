"""Throughput of the Ray proxy pool with 1, 2 and 4 proxy actors (issue 19 item 4's closing note).

    .venv/bin/python bench/ray_pool.py [--actors 1,2,4] [--sessions 64] [--calls 16] [--replicas 2]
        [--pace-ms 2 --tokens 64]

A local Ray cluster; a pool of proxy actors (capture/client/ray_pool.py: each a real mitmdump started
by the launcher) in front of --replicas scripted stub policies, each in its own process (a fast
policy: a short fixed answer). For each pool size: --sessions sessions opened through the pool
(least-loaded placement), each sending --calls chat calls one after another through its base
URL (plain HTTP from one asyncio client; a session's history grows with its calls), all sessions
at once; then each closed with a reward. Prints calls per second, call latency (p50, p95),
closes per second, the ratio of calls per second to 1 actor, and the cores busy while the calls
ran: the proxies' mitmdumps, and the rest (the client and the stubs; Ray's own not counted). Every process (the clients,
the stubs, Ray and the proxies) shares this host's cores: past the cores there is nothing to
gain, and the output says how many there are.

``--pace-ms P`` (issue 41): the stubs stream ``--tokens`` tokens a call, one every P ms as a GPU
policy samples them, and the clients stream the answers (``stream_options.include_usage``):
the table gains the tokens per second streamed through the pool, and its ratio to 1 actor.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.common import cpu_seconds, rank_pct, serve_stub  # noqa: E402
from capture.client.ray_pool import ProxyPool  # noqa: E402
from tests.support.paths import QWEN3  # noqa: E402


def cpu_s(pids: list[int]) -> float:
    """CPU seconds (user + system) the processes themselves used so far (this host's /proc)."""
    return sum(cpu_seconds(pid, children=False) for pid in pids)


# Tokens streamed by all clients of the run going on (--pace-ms), from the answers' usage.
STREAMED = [0]


async def streamed_answer(resp: Any) -> str:
    """The text of a streamed chat answer; its completion tokens counted in ``STREAMED``."""
    text = []
    async for line in resp.content:
        if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        if chunk.get("usage"):
            STREAMED[0] += chunk["usage"]["completion_tokens"]
        for choice in chunk.get("choices") or []:
            text.append(choice.get("delta", {}).get("content") or "")
    return "".join(text)


async def session_calls(
    http: Any, base_url: str, sid: str, key: str, calls: int, stream: bool = False
) -> list[float]:
    times = []
    history: list[dict[str, str]] = []
    for i in range(calls):
        history.append({"role": "user", "content": f"step {i} of {sid}"})
        start = time.perf_counter()
        body: dict[str, Any] = {"model": "m", "messages": history}
        if stream:
            body.update(stream=True, stream_options={"include_usage": True})
        async with http.post(
            f"{base_url}/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}
        ) as resp:
            assert resp.status == 200, await resp.text()
            if stream:
                answer = await streamed_answer(resp)
            else:
                answer = (await resp.json())["choices"][0]["message"]["content"]
        times.append(time.perf_counter() - start)
        history.append({"role": "assistant", "content": answer})
    return times


async def drive(
    base_urls: list[tuple[str, str, str]], calls: int, stream: bool = False
) -> tuple[float, list[float]]:
    import aiohttp

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as http:
        start = time.perf_counter()
        per_session = await asyncio.gather(
            *(session_calls(http, url, sid, key, calls, stream) for sid, url, key in base_urls)
        )
        wall = time.perf_counter() - start
    return wall, [t for times in per_session for t in times]


def run(
    n: int, urls: list[str], stub_pids: list[int], args: argparse.Namespace, root: Path
) -> dict[str, Any]:
    pool = ProxyPool.start(urls, QWEN3, root / f"pool-{n}", num_proxies=n, num_cpus=0.5)
    try:
        # Warm-up: one call through every actor (connections, first tokenizer use).
        warm = [pool.open_session(session_id=f"warm-{n}-{i}") for i in range(n)]
        asyncio.run(drive([(s.id, s.base_urls["openai"], s.api_key) for s in warm], 1))
        for sess in warm:
            sess.close(reward=0.0)
        sessions = [pool.open_session(session_id=f"b{n}-{i}") for i in range(args.sessions)]
        per_actor = [0] * n
        for sess in sessions:
            per_actor[sess.proxy] += 1
        proxies = [info["mitmdump_pid"] for info in pool.stats()]
        others = [os.getpid(), *stub_pids]
        before = cpu_s(proxies), cpu_s(others)
        STREAMED[0] = 0
        wall, times = asyncio.run(
            drive(
                [(s.id, s.base_urls["openai"], s.api_key) for s in sessions],
                args.calls,
                stream=args.pace_ms > 0,
            )
        )
        tokens = STREAMED[0]
        proxy_cpu, other_cpu = cpu_s(proxies) - before[0], cpu_s(others) - before[1]
        start = time.perf_counter()
        rows = sum(sess.close(reward=1.0).num_rows for sess in sessions)
        close_wall = time.perf_counter() - start
        read = pool.dataset().count_rows()
        assert read == rows + n, (read, rows)  # the warm-up sessions' rows too
    finally:
        pool.shutdown()
    return {
        "actors": n,
        "calls": len(times),
        "wall": wall,
        "calls_s": len(times) / wall,
        "tokens_s": tokens / wall,
        "p50": statistics.median(times),
        "p95": rank_pct(times, 0.95),
        "closes_s": len(sessions) / close_wall,
        "rows": rows,
        "read": read,
        "per_actor": per_actor,
        "proxy_cores": proxy_cpu / wall,
        "other_cores": other_cpu / wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--actors", default="1,2,4")
    parser.add_argument("--sessions", type=int, default=64)
    parser.add_argument("--calls", type=int, default=16)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3, help="rounds over the sizes (median)")
    parser.add_argument(
        "--pace-ms", type=float, default=0.0, help="stream answers, a token every PACE ms"
    )
    parser.add_argument("--tokens", type=int, default=64, help="tokens per answer (--pace-ms)")
    args = parser.parse_args()
    sizes = [int(n) for n in args.actors.split(",")]
    import ray

    ctx = mp.get_context("spawn")
    stubs = []
    # With --pace-ms: answers of about --tokens tokens, one streamed every PACE ms.
    paced = args.pace_ms > 0
    reply = " ".join(["word"] * args.tokens) if paced else "A short answer of a few tokens."
    delay = args.pace_ms / 1000 if paced else 0.0
    for _ in range(args.replicas):
        parent, child = ctx.Pipe()
        proc = ctx.Process(
            target=serve_stub, args=(QWEN3, reply, delay), kwargs={"conn": child}, daemon=True
        )
        proc.start()
        stubs.append((proc, parent))
    urls = [parent.recv() for _, parent in stubs]
    cores = os.cpu_count() or 1
    # Logical CPUs: each actor takes 0.5, so 4 actors fit and Ray Data keeps some.
    ray.init(
        num_cpus=max(4, cores), include_dashboard=False, log_to_driver=False, logging_level="error"
    )
    root = Path(tempfile.mkdtemp(prefix="agenttap-bench-ray-pool-"))
    rounds: dict[int, list[dict[str, Any]]] = {n: [] for n in sizes}
    try:
        for k in range(args.repeat):  # sizes interleaved: a noisy host hits every size alike
            for n in sizes:
                r = run(n, urls, [p.pid or 0 for p, _ in stubs], args, root / f"round-{k}")
                rounds[n].append(r)
                print(f"round {k + 1}: {n} actor(s): {r['calls_s']:.0f} calls/s", flush=True)
    finally:
        ray.shutdown()
        for proc, parent in stubs:
            parent.close()
            proc.join(10)
    # Per size, the round with the median calls/s.
    results = [sorted(rounds[n], key=lambda r: r["calls_s"])[len(rounds[n]) // 2] for n in sizes]
    base = results[0]["calls_s"]
    paced = args.pace_ms > 0
    if paced:
        print(
            f"\nstreamed: {args.tokens}-token answers, a token every {args.pace_ms:g} ms; "
            "tokens/s through the pool (vs 1 actor):"
        )
        for r in results:
            print(
                f"  {r['actors']} actor(s): {r['tokens_s']:.0f} tokens/s "
                f"({r['tokens_s'] / max(results[0]['tokens_s'], 1e-9):.2f}x)"
            )
    print(
        f"\n{args.sessions} sessions at once, {args.calls} chat calls each (base URL, plain HTTP), "
        f"{args.replicas} stub policy replicas; this host has {cores} core(s); per size the "
        f"median of {args.repeat} round(s)"
    )
    head = (
        f"{'actors':>6} {'calls':>6} {'wall s':>7} {'calls/s':>8} {'vs 1':>6} "
        f"{'p50 ms':>7} {'p95 ms':>7} {'closes/s':>9} {'proxy cores':>11} {'other cores':>11} "
        f"{'sessions per actor':>19}"
    )
    print(head)
    for r in results:
        print(
            f"{r['actors']:>6} {r['calls']:>6} {r['wall']:>7.2f} {r['calls_s']:>8.1f} "
            f"{r['calls_s'] / base:>5.2f}x {r['p50'] * 1e3:>7.1f} {r['p95'] * 1e3:>7.1f} "
            f"{r['closes_s']:>9.1f} {r['proxy_cores']:>11.2f} {r['other_cores']:>11.2f} "
            f"{'/'.join(map(str, r['per_actor'])):>19}"
        )
    if max(sizes) > cores:
        print(
            f"note: {max(sizes)} actors on {cores} core(s): each mitmdump is one process using "
            f"up to one core, and the clients, the stub policies and Ray share the same cores, "
            f"so pools past {cores} actor(s) cannot scale here; on a host with a core per actor "
            f"(and a policy that keeps up) throughput grows with the actors."
        )


if __name__ == "__main__":
    main()
