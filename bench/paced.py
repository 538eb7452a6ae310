"""CPU per streamed token at a generation's pace: what bounds how many streams one proxy carries.

    .venv/bin/python bench/paced.py [--clients 48] [--pace-ms 10] [--tokens 64] [--seconds 20]

``bench/overhead.py`` answers at once, so its streams arrive in a few large reads. A real policy
samples a token every 10 to 50 ms, and each one comes alone: the proxy handles every token as a
read, a parse, an event and a write to the client. Here the fake OpenAI server (behind plain
mitmdump, and behind ``mitmdump-s``, plain mitmdump relaying each chunk as it comes) and the
vLLM-shaped stub (behind agenttap) stream a token every ``--pace-ms``
milliseconds; ``--clients`` conversations stream back to back, each its own session, through each
proxy in turn (the same client code and checks as bench/overhead.py). Printed per path: tokens
per second streamed, the proxy's CPU microseconds per token (from /proc, every thread), the
ratio to plain mitmdump's, and how many streams at 50 tokens/s one proxy process (one core)
could carry at that cost.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench import overhead  # noqa: E402

# The proxies, in the order they run (the first is the 1.00x of the ratio column).
PATHS = ("mitmdump", "mitmdump-s", "agenttap")
# The generation speed the last column assumes, tokens per second per stream.
STREAM_RATE = 50


async def run_path(
    path: overhead.Path_, clients: int, tokens: int, seconds: float
) -> tuple[int, float]:
    """(tokens streamed, proxy CPU seconds) with ``clients`` streaming back to back."""
    await path.open()
    try:
        await path.call("warm", tokens, True)
        stop_at = time.perf_counter() + seconds
        done = 0

        async def worker(i: int) -> None:
            nonlocal done
            while time.perf_counter() < stop_at:
                await path.call(f"paced-{i}", tokens, True)
                done += 1

        cpu0 = path.server.cpu()[0]
        await asyncio.gather(*(worker(i) for i in range(clients)))
        return done * tokens, path.server.cpu()[0] - cpu0
    finally:
        await path.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=48)
    parser.add_argument("--pace-ms", type=float, default=10.0)
    parser.add_argument("--tokens", type=int, default=64, help="tokens per streamed answer")
    parser.add_argument("--seconds", type=float, default=20.0, help="per path")
    parser.add_argument(
        "--only",
        default="",
        help=f"comma-separated paths to run, among {', '.join(PATHS)} (default: all; the first "
        "is 1.00x)",
    )
    args = parser.parse_args()
    only = set(args.only.split(",")) if args.only else set(PATHS)
    if only - set(PATHS):
        parser.error(f"--only takes paths among {', '.join(PATHS)}")
    wanted = [p for p in PATHS if p in only]
    os.environ[overhead.PACE_ENV] = str(args.pace_ms)  # read by the servers' processes
    work = Path(tempfile.mkdtemp(prefix="agenttap-paced-"))
    confdir = work / "conf"
    children: list[subprocess.Popen[bytes]] = []
    proxies: list[overhead.Server] = []
    try:
        if "mitmdump" in wanted or "mitmdump-s" in wanted:
            fake, fake_url = overhead.spawn_child("--serve-fake", work)
            children.append(fake)
            for name in ("mitmdump", "mitmdump-s"):
                if name in wanted:
                    proxies.append(
                        overhead.start_plain_mitmdump(
                            name, fake_url, work, confdir, streaming=name == "mitmdump-s"
                        )
                    )
        if "agenttap" in wanted:
            stub, stub_url = overhead.spawn_child("--serve-stub", work)
            children.append(stub)
            proxies.append(
                overhead.start_agenttap("agenttap", stub_url, work / "out", work, confdir)
            )
        ca = confdir / "mitmproxy-ca-cert.pem"
        print(
            f"{args.clients} clients, a token every {args.pace_ms:g} ms, {args.tokens}-token "
            f"answers, {args.seconds:g} s per path; logs in {work}",
            flush=True,
        )
        results: dict[str, tuple[int, float]] = {}
        for server in proxies:
            path = overhead.Path_(server, ca)
            results[server.name] = asyncio.run(
                run_path(path, args.clients, args.tokens, args.seconds)
            )
        print(
            f"\n{'path':<10} | {'tokens/s':>9} | {'proxy CPU us/token':>18} | {'x mitm':>6} | "
            f"{f'streams at {STREAM_RATE} tok/s per core':>30}"
        )
        ref = None
        for name, (streamed, cpu) in results.items():
            per_token = 1e6 * cpu / max(streamed, 1)
            ref = ref or per_token
            streams = 1e6 / (per_token * STREAM_RATE)
            print(
                f"{name:<10} | {streamed / args.seconds:>9.0f} | {per_token:>18.1f} | "
                f"{per_token / ref:>5.2f}x | {streams:>30.0f}"
            )
    finally:
        for server in proxies:
            server.stop()
        for child in children:
            overhead.stop_child(child)
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
