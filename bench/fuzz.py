"""Fuzz every provider through a real proxy, many requests each, and print the status table.

    .venv/bin/python bench/fuzz.py [--requests 10000] [--workers 2] [--seed 0]
                                   [--providers openai.chat,anthropic,...]

Starts the scripted stub policy (``tests/support/stub_vllm.py``) and a real mitmdump with the addon, then
sends ``--requests`` fuzzed requests per provider (``openai.chat``, ``openai.responses``,
``anthropic``, ``gemini``; their count routes included) and as many fuzzed message sequences on
the Responses API's WebSocket (``openai.responses.websocket``, one connection each). The requests
come from the CI fuzz tests' strategies (``tests/support/fuzzing.py``), drawn by hypothesis with a seed
per worker process. Every answer is checked as the tests check it (no 5xx, the provider's own
error format, WebSocket refusals as error events or 1007/1008/1009 closes); a failure is counted
and its first examples printed, and the run goes on. After each provider, a well-formed session
recorded before it must still have exactly its rows, and the proxy must still be up.

Exit status: 0 when every answer passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from hypothesis import strategies as st  # noqa: E402

from tests.support import fuzzing  # noqa: E402
from tests.support.hostile import good_body, post  # noqa: E402
from tests.support.paths import QWEN3  # noqa: E402
from tests.support.proxies import Proxy, start_proxy  # noqa: E402
from tests.support.stub_vllm import StubPolicy  # noqa: E402

ALL = [*fuzzing.PROVIDERS, fuzzing.WEBSOCKET]
SHOWN_FAILURES = 5


@dataclass
class Endpoint:
    port: int
    ca: Path


def worker(job: tuple[str, int, int, int, int, Endpoint]) -> tuple[Counter[str], list[str], int]:
    """Run ``examples`` fuzzed requests of one provider (WebSocket: message sequences, one
    connection each): counts by status, failures, requests (messages) sent."""
    provider, examples, seed, max_body, index, proxy = job
    counts: Counter[str] = Counter()
    failures: list[str] = []
    sent = 0

    def failed(what: str) -> None:
        counts["FAILED"] += 1
        if len(failures) < SHOWN_FAILURES:
            failures.append(what[:2000])

    def http_one(request: fuzzing.Request) -> None:
        nonlocal sent
        sent += 1
        try:
            answer = fuzzing.post(proxy, request)
        except Exception as exc:  # a dropped connection is a failure too, not the end of the run
            counts["no answer"] += 1
            failed(f"{request!r}: {exc!r}")
            return
        counts[str(answer.status)] += 1
        try:
            fuzzing.check_http(request, answer)
        except AssertionError as exc:
            failed(f"{exc}")

    def websocket_one(messages: list[fuzzing.Frame]) -> None:
        nonlocal sent
        try:
            exchange = fuzzing.converse(proxy, f"bench-ws-{index}", messages)
        except Exception as exc:
            sent += 1
            counts["no answer"] += 1
            failed(f"{messages!r}: {exc!r}")
            return
        sent += exchange.sent
        counts.update(exchange.outcomes())
        try:
            fuzzing.check_websocket(messages, exchange)
        except AssertionError as exc:
            failed(f"{exc}")

    if provider == fuzzing.WEBSOCKET:
        strategy: Any = st.lists(fuzzing.frames(max_body), min_size=1, max_size=3)
        fuzzing.run_examples(strategy, websocket_one, examples, seed=seed)
    else:
        fuzzing.run_examples(fuzzing.requests(provider), http_one, examples, seed=seed)
    return counts, failures, sent


def witness(proxy: Proxy, provider: str) -> tuple[str, list[dict[str, Any]]]:
    protocol = "openai.responses" if provider == fuzzing.WEBSOCKET else provider
    session = f"bench-witness-{uuid.uuid4().hex[:6]}"
    answer = post(proxy, session, protocol, json.dumps(good_body(protocol)).encode())
    assert answer.status == 200, answer.body[:300]
    return session, proxy.turns(session)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=10_000, help="per provider")
    parser.add_argument("--workers", type=int, default=2, help="client processes per provider")
    parser.add_argument("--seed", type=int, default=0, help="first hypothesis seed")
    parser.add_argument("--providers", default=",".join(ALL), help=f"of {', '.join(ALL)}")
    parser.add_argument("--max-body-bytes", type=int, default=512 * 1024)
    args = parser.parse_args()
    providers = [p for p in args.providers.split(",") if p]
    unknown = [p for p in providers if p not in ALL]
    if unknown:
        parser.error(f"unknown provider(s) {unknown}; known: {ALL}")

    tmp = Path(tempfile.mkdtemp(prefix="agenttap-fuzz-"))
    stub = StubPolicy(str(QWEN3))
    stub.start()
    proxy = start_proxy(
        stub.url,
        tmp / "out",
        tmp / "conf",
        extra=["--set", f"agenttap_max_body_bytes={args.max_body_bytes}"],
    )
    rows: list[tuple[str, int, Counter[str], float]] = []
    ok = True
    try:
        with multiprocessing.get_context("spawn").Pool(args.workers) as pool:
            for provider in providers:
                session, before = witness(proxy, provider)
                share = [args.requests // args.workers] * args.workers
                share[0] += args.requests - sum(share)
                jobs = [
                    (
                        provider,
                        n,
                        args.seed + i,
                        args.max_body_bytes,
                        i,
                        Endpoint(proxy.port, proxy.ca),
                    )
                    for i, n in enumerate(share)
                    if n
                ]
                started = time.monotonic()
                counts: Counter[str] = Counter()
                sent = 0
                for part, failures, n in pool.map(worker, jobs):
                    counts += part
                    sent += n
                    for failure in failures:
                        print(f"FAILED {provider}: {failure}", flush=True)
                seconds = time.monotonic() - started
                if proxy.proc.poll() is not None:
                    print(f"the proxy died during {provider}", flush=True)
                    ok = False
                    break
                if proxy.turns(session) != before:
                    print(f"{provider}: the witness session's rows changed", flush=True)
                    counts["witness changed"] += 1
                ok = ok and not counts["FAILED"] and not counts["witness changed"]
                rows.append((provider, sent, counts, seconds))
                print(
                    f"{provider}: {sent} in {seconds:.0f} s {dict(sorted(counts.items()))}",
                    flush=True,
                )
    finally:
        proxy.stop()
        stub.stop()
    print_table(rows)
    print(f"proxy log: {proxy.log}")
    return 0 if ok else 1


def print_table(rows: list[tuple[str, int, Counter[str], float]]) -> None:
    keys = sorted({k for _, _, counts, _ in rows for k in counts})
    head = ["provider", "requests", *keys, "req/s"]
    lines = [head]
    for provider, sent, counts, seconds in rows:
        rate = f"{sent / seconds:.0f}" if seconds else "-"
        lines.append([provider, str(sent), *(str(counts.get(k, 0)) for k in keys), rate])
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    print()
    for n, line in enumerate(lines):
        print("| " + " | ".join(cell.rjust(w) for cell, w in zip(line, widths, strict=True)) + " |")
        if n == 0:
            print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    print(
        "(WebSocket: requests are fuzzed messages, 1 to 3 per connection; each counted by its "
        "last event, error events by status, and a connection's close by its code)"
    )


if __name__ == "__main__":
    sys.exit(main())
