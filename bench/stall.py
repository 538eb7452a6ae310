"""Does one session's huge prompt stall the others? (issue 14 item 3)

    .venv/bin/python bench/stall.py [--calls 40] [--prompt-kb 900] [--huge 10]

A real mitmdump with the addon and the scripted stub policy (context 32,768 tokens). Session
"small" sends short chat calls one after another and times each. First alone (the baseline),
then while session "huge" keeps sending prompts (until at least --huge were answered) of --prompt-kb kB of text (over the context:
each is tokenized, then refused with the provider's 400). Prints p50 / p95 / max of the small
calls in both phases and their ratio, and how the huge prompts were answered.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.support.hostile import good_body, post  # noqa: E402
from tests.support.paths import QWEN3  # noqa: E402
from tests.support.proxies import start_proxy  # noqa: E402
from tests.support.stub_vllm import StubPolicy  # noqa: E402


def huge_text(kb: int) -> str:
    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghij klmnop") for _ in range(8)) for _ in range(1000)]
    return " ".join(rng.choice(words) for _ in range(kb * 120))[: kb * 1000]


def small_calls(proxy, n: int) -> list[float]:  # type: ignore[no-untyped-def]
    times = []
    body = json.dumps(good_body("openai.chat")).encode()
    for _ in range(n):
        start = time.perf_counter()
        answer = post(proxy, "small", "openai.chat", body)
        times.append(time.perf_counter() - start)
        assert answer.status == 200, answer.body[:300]
    return times


def summary(times: list[float]) -> tuple[float, float, float]:
    ordered = sorted(times)
    return (
        statistics.median(ordered),
        ordered[min(len(ordered) - 1, int(len(ordered) * 0.95))],
        ordered[-1],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=40)
    parser.add_argument("--prompt-kb", type=int, default=900)
    parser.add_argument("--huge", type=int, default=10, help="huge prompts answered, at least")
    args = parser.parse_args()

    stub = StubPolicy(str(QWEN3))
    stub.start()
    work = Path(tempfile.mkdtemp(prefix="agenttap-stall-"))
    proxy = start_proxy(stub.url, work / "out", work / "conf", QWEN3)
    try:
        small_calls(proxy, 5)  # warm-up
        alone = small_calls(proxy, args.calls)

        huge = json.dumps(good_body("openai.chat", huge_text(args.prompt_kb))).encode()
        statuses: list[int] = []
        huge_times: list[float] = []
        stop = threading.Event()

        def flood() -> None:
            while not stop.is_set():
                start = time.perf_counter()
                statuses.append(post(proxy, "huge", "openai.chat", huge, timeout=120).status)
                huge_times.append(time.perf_counter() - start)

        flooder = threading.Thread(target=flood)
        flooder.start()
        time.sleep(0.5)  # the first huge prompt is being processed
        loaded: list[float] = []
        while len(loaded) < args.calls or len(statuses) < args.huge:
            loaded += small_calls(proxy, 1)
        stop.set()
        flooder.join()
    finally:
        proxy.stop()
        stub.stop()

    a, b = summary(alone), summary(loaded)
    print(f"\nsmall calls of one session while another sends {args.prompt_kb} kB prompts")
    print(f"{'phase':<28} {'p50 ms':>8} {'p95 ms':>8} {'max ms':>8}")
    print(f"{'alone (baseline)':<28} {a[0] * 1e3:8.1f} {a[1] * 1e3:8.1f} {a[2] * 1e3:8.1f}")
    print(f"{'beside huge prompts':<28} {b[0] * 1e3:8.1f} {b[1] * 1e3:8.1f} {b[2] * 1e3:8.1f}")
    print(f"{'ratio':<28} {b[0] / a[0]:8.2f} {b[1] / a[1]:8.2f} {b[2] / a[2]:8.2f}")
    print(
        f"huge prompts: {len(statuses)} sent, statuses {sorted(set(statuses))}, "
        f"median {statistics.median(huge_times) * 1e3:.0f} ms each"
    )


if __name__ == "__main__":
    main()
