"""Can one agent starve another's calls to the policy? (issue 47 item 6)

    .venv/bin/python bench/fairness.py [--calls 100] [--hog-streams 32] [--slots 4] [--call-s 0.25]
                                       [--policy-url URL --tokenizer DIR]

A real mitmdump with the addon, and a policy whose engine is saturated: by default the scripted
stub (tests/support/stub_vllm.py) with an engine that runs at most --slots generations at once,
each taking --call-s seconds, the rest queued first come first served as vLLM queues past its
``max_num_seqs`` (tests/support/stub_engine.py); --policy-url runs against a policy you started
instead (its own capacity then; give its tokenizer). Session "victim" sends --calls chat calls
one after another and times each: first alone (the baseline), then while session "hog" keeps
--hog-streams calls in flight at once (each stream sends its next call when one ends).

Fair share: the latency the victim would get if the policy's capacity were split evenly between
the two sessions. With --slots K >= 2 each session's half is at least one generation at a time;
the victim never has more than one call in flight, so its half serves it as the whole engine
does: its fair-share latency is its latency alone, measured in the same run. The issue's goal is
a victim p99 beside the hog within 1.5x of that.

Three configurations, one proxy each (same stub): no fairness (``agenttap_session_max_inflight=0``,
every call of the hog reaches the engine's queue, as before this option); the per-session bound
alone (the default 8: the hog has 8 at the engine, the victim's call queues behind at most the
hog's extra ones there); and the bound with ``agenttap_replica_max_inflight`` = the engine's
slots (agenttap knows when the server is saturated and gives the next free slot to the session
with fewest calls running: the victim). Prints p50 / p99 alone and beside the hog, their ratio,
and the calls the hog got answered meanwhile.
"""

from __future__ import annotations

import argparse
import base64
import http.client
import json
import ssl
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.support.hostile import good_body  # noqa: E402
from tests.support.paths import QWEN3  # noqa: E402
from tests.support.proxies import Proxy, start_proxy  # noqa: E402
from tests.support.stub_engine import StubEngine  # noqa: E402
from tests.support.stub_vllm import StubPolicy  # noqa: E402

BODY = json.dumps(good_body("openai.chat", "Say OK.")).encode()


class Client:
    """One agent's connection through the proxy (CONNECT, TLS trusting the proxy's CA), kept
    open between calls as the SDKs keep theirs."""

    def __init__(self, proxy: Proxy, session: str) -> None:
        self.proxy, self.session = proxy, session
        self.conn: http.client.HTTPSConnection | None = None

    def chat(self) -> int:
        if self.conn is None:
            ctx = ssl.create_default_context(cafile=str(self.proxy.ca))
            self.conn = http.client.HTTPSConnection(
                "127.0.0.1", self.proxy.port, context=ctx, timeout=300
            )
            auth = base64.b64encode(f"{self.session}:x".encode()).decode()
            self.conn.set_tunnel(
                "api.openai.com", 443, headers={"Proxy-Authorization": f"Basic {auth}"}
            )
        headers = {"Content-Type": "application/json", "Authorization": "Bearer sk-bench"}
        try:
            self.conn.request("POST", "/v1/chat/completions", body=BODY, headers=headers)
            resp = self.conn.getresponse()
            resp.read()
            return resp.status
        except (OSError, http.client.HTTPException):
            self.conn.close()
            self.conn = None
            raise


def victim_calls(client: Client, n: int) -> list[float]:
    times = []
    for _ in range(n):
        start = time.perf_counter()
        status = client.chat()
        times.append(time.perf_counter() - start)
        assert status == 200, status
    return times


def percentiles(times: list[float]) -> tuple[float, float]:
    ordered = sorted(times)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return statistics.median(ordered), p99


def measure(proxy: Proxy, calls: int, streams: int) -> tuple[list[float], list[float], int]:
    """(victim alone, victim beside the hog, hog calls answered meanwhile)."""
    victim = Client(proxy, "victim")
    victim_calls(victim, 3)  # warm-up: the session's first call, its connection
    alone = victim_calls(victim, calls)
    stop = threading.Event()
    answered: list[int] = []

    def stream() -> None:
        hog = Client(proxy, "hog")
        while not stop.is_set():
            answered.append(hog.chat())

    hogs = [threading.Thread(target=stream) for _ in range(streams)]
    for t in hogs:
        t.start()
    # The hog's streams are all in flight before the victim's first timed call.
    while len(answered) < streams:
        time.sleep(0.05)
    beside = victim_calls(victim, calls)
    stop.set()
    for t in hogs:
        t.join()
    assert set(answered) == {200}, sorted(set(answered))
    return alone, beside, len(answered)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=100, help="victim calls per phase")
    parser.add_argument("--hog-streams", type=int, default=32)
    parser.add_argument("--slots", type=int, default=4, help="the stub engine's generations")
    parser.add_argument("--call-s", type=float, default=0.25, help="seconds per generation")
    parser.add_argument("--policy-url", default="", help="a running policy instead of the stub")
    parser.add_argument("--tokenizer", type=Path, default=QWEN3)
    parser.add_argument(
        "--configs", default="0,1,2", help="which configurations to run (0, 1, 2: as printed)"
    )
    parser.add_argument("--dump", type=Path, help="write every victim latency here (JSON)")
    args = parser.parse_args()

    stub = None
    url = args.policy_url
    if not url:
        stub = StubPolicy(str(QWEN3))
        stub.engine = StubEngine(slots=args.slots, call_s=args.call_s)
        url = stub.start()
    configs = [
        ("no fairness (session bound 0)", {"agenttap_session_max_inflight": "0"}),
        ("session bound 8 (default)", {}),
        (
            f"bound 8 + server bound {args.slots}",
            {"agenttap_replica_max_inflight": str(args.slots)},
        ),
    ]
    work = Path(tempfile.mkdtemp(prefix="agenttap-fairness-"))
    results = []
    try:
        chosen = [int(c) for c in args.configs.split(",")]
        for i, (name, options) in enumerate(configs):
            if i not in chosen:
                continue
            extra = [a for k, v in options.items() for a in ("--set", f"{k}={v}")]
            proxy = start_proxy(url, work / f"out{i}", work / "conf", args.tokenizer, extra=extra)
            try:
                results.append((name, *measure(proxy, args.calls, args.hog_streams)))
            finally:
                proxy.stop()
    finally:
        if stub is not None:
            stub.stop()

    if args.dump:
        args.dump.write_text(json.dumps({name: [a, b] for name, a, b, _ in results}))
    policy = (
        f"stub engine: {args.slots} generations at once, {args.call_s:g} s each"
        if stub is not None
        else f"policy {url}"
    )
    print(f"\nvictim's calls, alone and beside {args.hog_streams} hog streams ({policy})")
    print(
        f"{'configuration':<32} {'alone p50':>9} {'p99':>7} {'beside p50':>10} {'p99':>7} "
        f"{'x p50':>6} {'x p99':>6} {'hog calls':>9}"
    )
    for name, alone, beside, hog in results:
        a50, a99 = percentiles(alone)
        b50, b99 = percentiles(beside)
        print(
            f"{name:<32} {a50 * 1e3:7.0f}ms {a99 * 1e3:5.0f}ms {b50 * 1e3:8.0f}ms "
            f"{b99 * 1e3:5.0f}ms {b50 / a50:6.2f} {b99 / a99:6.2f} {hog:9d}"
        )
    print("x: beside / alone; the goal is x p99 <= 1.5 (alone is the victim's fair share)")


if __name__ == "__main__":
    main()
