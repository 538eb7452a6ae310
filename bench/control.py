"""What driving sessions through the control API costs (issue 16's closing numbers).

    .venv/bin/python bench/control.py [--sessions 400] [--calls 3] [--workers 32]

A real mitmdump started by the launcher (capture/client/launcher.py) with the scripted stub policy.
Opens --sessions sessions at once (all open together), makes --calls chat calls in each through
its base URL, then closes half of them with a reward (POST /sessions/ID/close, rows returned as
Arrow) and writes the other half with the plain POST /flush?session=ID (the baseline: the same
rows written, nothing returned). Prints open / close / flush latencies (p50, p95), rows per
second at close, and close's cost as a ratio of flush's.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.common import rank_pct  # noqa: E402
from capture.client.launcher import AgentTap, Session  # noqa: E402
from tests.support.paths import QWEN3  # noqa: E402
from tests.support.stub_vllm import StubPolicy  # noqa: E402


def timed(fn, *args):  # type: ignore[no-untyped-def]
    start = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - start, out


def calls(sess: Session, n: int) -> None:
    import openai

    client = openai.OpenAI(base_url=sess.base_urls["openai"], api_key=sess.api_key, max_retries=0)
    history: list[dict[str, str]] = []
    for i in range(n):
        history.append({"role": "user", "content": f"step {i} of {sess.id}"})
        answer = client.chat.completions.create(model="m", messages=history)  # type: ignore[arg-type]
        history.append({"role": "assistant", "content": answer.choices[0].message.content or ""})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sessions", type=int, default=400)
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--workers", type=int, default=32)
    args = parser.parse_args()
    stub = StubPolicy(str(QWEN3))
    stub.default_reply = "A short answer of a few tokens."
    stub.start()
    tmp = Path(tempfile.mkdtemp(prefix="agenttap-bench-control-"))
    tap = AgentTap.start(stub.url, QWEN3, tmp / "out", confdir=tmp / "conf")
    try:
        with ThreadPoolExecutor(args.workers) as pool:
            opened = list(
                pool.map(
                    lambda i: timed(tap.open_session, f"b{i}", {"task_id": i}), range(args.sessions)
                )
            )
            sessions = [s for _, s in opened]
            list(pool.map(lambda s: calls(s, args.calls), sessions))
            live = len(tap.sessions())
            half = len(sessions) // 2
            closed = list(pool.map(lambda s: timed(s.close, 1.0), sessions[:half]))
            flushed = list(pool.map(lambda s: timed(tap.flush, s.id), sessions[half:]))
        close_t = [t for t, _ in closed]
        flush_t = [t for t, _ in flushed]
        rows = sum(table.num_rows for _, table in closed)
        print(f"\nsessions open at once: {live} (each {args.calls} calls through its base URL)")
        print(f"{'step':<28} {'p50 ms':>8} {'p95 ms':>8}")
        for name, times in [
            ("open (POST /sessions)", [t for t, _ in opened]),
            ("close with reward (Arrow)", close_t),
            ("flush (baseline)", flush_t),
        ]:
            print(
                f"{name:<28} {statistics.median(times) * 1e3:>8.1f} {rank_pct(times, 0.95) * 1e3:>8.1f}"
            )
        print(
            f"close / flush (p50): {statistics.median(close_t) / statistics.median(flush_t):.2f}x"
        )
        print(f"rows returned at close: {rows}, {rows / sum(close_t) * args.workers:.0f} rows/s "
              f"({args.workers} closes in parallel)")  # fmt: skip
    finally:
        tap.close()
        stub.stop()


if __name__ == "__main__":
    main()
