"""A real vLLM's cold start on this CPU, as the test suite starts its servers (issue 46): how
long until it serves, and how much CPU that takes, by how its processes are laid out and
whether its compile cache is warm.

    .venv/bin/python bench/vllm_start.py [--repeats 1]

Each start is the tiny fp32 Qwen3 with the tests' options (``launcher.start_vllm``, one
unpinned OMP thread: ``tests/support/vllm_servers.py`` ``ONE_FLOATING_THREAD``), timed from
spawn to ``/health`` answering; its CPU is the machine's busy time over that span (every
process it starts, counted: run it on a quiet machine). Layouts:

- ``three processes``: vLLM's CPU default, an API server, an engine core and a worker process
  (``VLLM_ENABLE_V1_MULTIPROCESSING=1``);
- ``two processes``: the model in the engine core's own process (``=0``, vLLM's "uni"
  executor), what the tests use.

Compile caches: ``cold`` is a new, empty ``VLLM_CACHE_ROOT`` (dynamo traces and inductor
compiles the model's graph: C++ kernels built with the host's compiler), ``warm`` one a start of
the same shape filled first. The ratio column compares each row to the first, measured in the
same run. After each start, ``--tokens`` tokens are sampled in one request on the quiet machine,
then again with every core kept busy by a spinning process (as the test suite keeps them).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from policy_server import launcher  # noqa: E402
from tests.support.paths import QWEN3  # noqa: E402
from tests.support.vllm_servers import ONE_FLOATING_THREAD  # noqa: E402

LAYOUTS = {"three processes": "1", "two processes": "0"}


def busy_ticks() -> int:
    """The machine's busy CPU time so far, in clock ticks (user, nice, system, irq, softirq).
    Not the server's own tree (``bench.common.cpu_seconds``): a cold start's compiler
    processes are gone by the time it serves, and their CPU with them."""
    with open("/proc/stat") as stat:
        fields = stat.readline().split()
    return sum(int(fields[i]) for i in (1, 2, 3, 6, 7))


def decode_s(url: str, tokens: int) -> float:
    """Seconds to sample ``tokens`` tokens in one request (no EOS stop)."""
    body = {"model": "agenttap-tiny-qwen3", "prompt": list(range(100, 300)),
            "max_tokens": tokens, "ignore_eos": True, "logprobs": 0}  # fmt: skip
    request = urllib.request.Request(
        f"{url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    started = time.monotonic()
    with urllib.request.urlopen(request, timeout=600) as answer:
        answer.read()
    return time.monotonic() - started


def one_start(
    model: Path, multiprocessing: str, cache: Path, log: Path, tokens: int
) -> tuple[float, float, float, float]:
    """Seconds to serving and CPU seconds spent, for one start; then the seconds to decode
    ``tokens`` tokens on a quiet machine and with every core kept busy beside it."""
    env = {**ONE_FLOATING_THREAD, "VLLM_ENABLE_V1_MULTIPROCESSING": multiprocessing}
    env["VLLM_CACHE_ROOT"] = str(cache)
    port = launcher.free_port()
    url = f"http://127.0.0.1:{port}"
    ticks, started = busy_ticks(), time.monotonic()
    proc = launcher.start_vllm(model, port, log_path=log, env_overrides=env)
    hogs: list[subprocess.Popen[bytes]] = []
    try:
        launcher.wait_ready(url, proc, timeout_s=900)
        wall = time.monotonic() - started
        cpu = (busy_ticks() - ticks) / os.sysconf("SC_CLK_TCK")
        decode_s(url, 8)  # the first request's own costs apart
        quiet = decode_s(url, tokens)
        hogs = [
            subprocess.Popen([sys.executable, "-c", "while True: pass"])
            for _ in range(os.cpu_count() or 1)
        ]
        busy = decode_s(url, tokens)
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)
    return wall, cpu, quiet, busy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=1, help="starts per row (median shown)")
    parser.add_argument("--tokens", type=int, default=256, help="tokens per timed decode")
    args = parser.parse_args()
    model = launcher.ensure_tiny_model(tokenizer=QWEN3)
    root = Path(tempfile.mkdtemp(prefix="agenttap-bench-start-"))
    rows: list[tuple[str, str, list[float]]] = []
    try:
        for layout, multiprocessing in LAYOUTS.items():
            for cache_state in ("cold", "warm"):
                runs = []
                for i in range(args.repeats):
                    cache = root / f"cache-{multiprocessing}"
                    if cache_state == "cold":
                        shutil.rmtree(cache, ignore_errors=True)
                    cache.mkdir(mode=0o700, exist_ok=True)
                    log = root / f"{multiprocessing}-{cache_state}-{i}.log"
                    runs.append(one_start(model, multiprocessing, cache, log, args.tokens))
                    numbers = ", ".join(f"{v:.1f}" for v in runs[-1])
                    print(f"{layout}, {cache_state} cache: {numbers}", flush=True)
                medians = [sorted(c)[len(c) // 2] for c in zip(*runs, strict=True)]
                rows.append((layout, cache_state, medians))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    base = rows[0][2]
    print()
    print(
        f"| layout | compile cache | to serving (s) | CPU (s) | {args.tokens} tokens, quiet (s) "
        f"| {args.tokens} tokens, cores busy (s) | vs first row: serving, CPU, busy decode |"
    )
    print("|---|---|---:|---:|---:|---:|---|")
    for layout, cache_state, (wall, cpu, quiet, busy) in rows:
        print(
            f"| {layout} | {cache_state} | {wall:.1f} | {cpu:.1f} | {quiet:.1f} | {busy:.1f} | "
            f"{wall / base[0]:.2f}x, {cpu / base[1]:.2f}x, {busy / base[3]:.2f}x |"
        )


if __name__ == "__main__":
    main()
