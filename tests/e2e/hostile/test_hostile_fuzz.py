"""Fuzzed requests for every provider, and the Responses API's WebSocket mode, through a real
mitmdump answered by the stub policy (issues 10 and 14; strategies in ``tests/support/fuzzing.py``).

For every answer: no 5xx, every error in the provider's own format and status, a 200 a real
answer; on the WebSocket, refusals are error events or 1007/1008/1009 closes and the connection
keeps answering. The proxy stays up, a well-formed session recorded before the fuzz keeps exactly
its rows, and one calling all through it is answered and recorded whole.

Bounded for CI: AGENTTAP_FUZZ_EXAMPLES per provider (default 120, about 20 s each on a shared
2-core box), derandomized (the same examples every run). ``bench/fuzz.py`` runs 10,000 and more.
Counts by status are printed by the last test (run with -s)."""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import strategies as st

from tests.support import fuzzing
from tests.support.fuzzing import PROVIDERS, WEBSOCKET, Frame, Raw, Request
from tests.support.hostile import ParallelSession, assert_provider_error, good_body, post, witness
from tests.support.proxies import Proxy, start_proxy
from tests.support.stub_vllm import StubPolicy

EXAMPLES = int(os.environ.get("AGENTTAP_FUZZ_EXAMPLES", "120"))
# A small body limit: huge strings and WebSocket messages cross it cheaply (413 / close 1009).
MAX_BODY = 512 * 1024
COUNTS: dict[str, Counter[str]] = {name: Counter() for name in [*PROVIDERS, WEBSOCKET]}


@pytest.fixture(scope="module")
def fuzz_proxy(
    stub: StubPolicy, confdir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Proxy]:
    out = tmp_path_factory.mktemp("fuzz") / "out"
    proxy = start_proxy(
        stub.url, out, confdir, extra=["--set", f"agenttap_max_body_bytes={MAX_BODY}"]
    )
    yield proxy
    proxy.stop()


def check_witness(proxy: Proxy, protocol: str, before: tuple[str, list[dict], list[dict]]) -> None:
    session, turns, threads = before
    assert proxy.proc.poll() is None, "the proxy died"
    assert proxy.turns(session) == turns
    assert proxy.threads(session) == threads
    again = post(proxy, session, protocol, json.dumps(good_body(protocol, "again")).encode())
    assert again.status == 200, again.body[:300]


@pytest.mark.parametrize("provider", PROVIDERS)
def test_fuzzed_requests(fuzz_proxy: Proxy, provider: str) -> None:
    before = witness(fuzz_proxy, provider)
    parallel = ParallelSession(fuzz_proxy, provider)

    def one(request: Request) -> None:
        answer = fuzzing.post(fuzz_proxy, request)
        COUNTS[provider][str(answer.status)] += 1
        fuzzing.check_http(request, answer)

    with parallel:
        fuzzing.run_examples(fuzzing.requests(provider), one, EXAMPLES)
    parallel.check()
    check_witness(fuzz_proxy, provider, before)


def test_fuzzed_websocket_messages(fuzz_proxy: Proxy) -> None:
    before = witness(fuzz_proxy, "openai.responses")

    def one(messages: list[Frame]) -> None:
        exchange = fuzzing.converse(fuzz_proxy, "fuzz-ws", messages)
        COUNTS[WEBSOCKET].update(exchange.outcomes())
        fuzzing.check_websocket(messages, exchange)

    frames = st.lists(fuzzing.frames(MAX_BODY), min_size=1, max_size=3)
    fuzzing.run_examples(frames, one, EXAMPLES // 2)
    check_witness(fuzz_proxy, "openai.responses", before)


# -- every number every provider reads ----------------------------------------------------------


def _body_with(provider: str, path: tuple[Any, ...], literal: str) -> bytes:
    body = fuzzing.replaced(fuzzing.SEEDS[provider], path, Raw(literal))
    if provider != "gemini":
        body["stream"] = False
    return fuzzing.dumps(body).encode()


CASES = [(p, path) for p in PROVIDERS for path in fuzzing.NUMBERS[p]]


@pytest.mark.parametrize("provider, path", CASES, ids=[f"{p}:{'.'.join(x)}" for p, x in CASES])
def test_numbers_out_of_range_are_the_clients_error(
    fuzz_proxy: Proxy, provider: str, path: tuple[Any, ...]
) -> None:
    """1e999 (JSON's infinity), NaN, Infinity and integers past 64 bits in any number a provider
    reads: a 400 in its format naming the value (Gemini topK 1e999 was a 500); the edges of
    what is fine are never a 5xx."""
    target = fuzzing.ROUTES[provider][1][0]
    for literal in fuzzing.NON_FINITE + fuzzing.HUGE_INTEGERS:
        request = Request(provider, target, _body_with(provider, path, literal), what=literal)
        answer = fuzzing.post(fuzz_proxy, request)
        assert answer.status == 400, (literal, answer.status, answer.body[:300])
        error = assert_provider_error(provider, answer)
        assert literal[:20] in error["message"], error
    for literal in fuzzing.EDGE_NUMBERS:
        request = Request(provider, target, _body_with(provider, path, literal), what=literal)
        answer = fuzzing.post(fuzz_proxy, request)
        fuzzing.check_http(request, answer)


def test_bad_websocket_messages_get_error_events_on_a_live_connection(fuzz_proxy: Proxy) -> None:
    """A lone surrogate or deep nesting in a Responses WebSocket message closed the socket with
    1002 (an HTTP 500 written into the WebSocket stream); now each bad message gets an error
    event in OpenAI's format and the same connection answers the next one. A message over the
    body limit is refused with close 1009, invalid UTF-8 in a text frame with 1007."""
    seed = {"type": "response.create", **fuzzing.SEEDS[WEBSOCKET], "stream": True}
    bad = [
        Frame(text=json.dumps({**seed, "instructions": "\ud800"}), what="lone surrogate"),
        Frame(text=json.dumps({**seed, "input": [{"\udfff": 1}]}), what="surrogate key"),
        Frame(text=fuzzing.dumps({**seed, "input": fuzzing.nesting(5_000, "list")}), what="deep"),
        Frame(text=fuzzing.dumps({**seed, "input": fuzzing.nesting(101, "dict")}), what="101"),
        Frame(text=fuzzing.dumps({**seed, "temperature": Raw("1e999")}), what="1e999"),
        Frame(text=fuzzing.dumps({**seed, "max_output_tokens": Raw("NaN")}), what="NaN"),
        Frame(text=json.dumps({**seed, "input": [{"role": "user", "content": 5}]}), what="type"),
        Frame(data=b'{"type": "response.create"}', binary=True, what="binary"),
        Frame(text="[1, 2", what="not JSON"),
    ]
    exchange = fuzzing.converse(fuzz_proxy, "ws-bad", bad)
    fuzzing.check_websocket(bad, exchange)
    assert exchange.close is None and exchange.alive
    for frame, events in zip(bad, exchange.events, strict=False):
        assert [e["type"] for e in events] == ["error"], (frame, events)
        assert events[0]["status"] == 400, (frame, events)
    assert "lone UTF-16 surrogate" in exchange.events[0][0]["error"]["message"]
    assert "deeper than 100 levels" in exchange.events[2][0]["error"]["message"]
    assert "1e999" in exchange.events[4][0]["error"]["message"]

    too_big = '{"type": "response.create", "input": "' + "x" * MAX_BODY + '"}'
    assert fuzzing.converse(fuzz_proxy, "ws-big", [Frame(text=too_big)]).close == 1009
    invalid = Frame(data=b'{"type": "response.create", "input": "\xff"}', what="bad UTF-8")
    assert fuzzing.converse(fuzz_proxy, "ws-utf8", [invalid]).close == 1007


def test_websocket_events_keep_unicode_line_separators_inside_their_json(
    fuzz_proxy: Proxy,
) -> None:
    """Events were split into WebSocket messages with str.splitlines, which also breaks at
    U+2028, U+2029 and U+0085: JSON leaves them raw inside strings, so an event echoing them
    (the response's instructions, metadata) went out as two halves that are not JSON."""
    text = "line\u2028separator\u2029paragraph\x85next"
    message = {
        "type": "response.create",
        "model": "gpt-5",
        "store": False,
        "input": "Hi",
        "instructions": text,
        "metadata": {"note": text},
    }
    exchange = fuzzing.converse(fuzz_proxy, "ws-lines", [Frame(text=json.dumps(message))])
    fuzzing.check_websocket([], exchange)
    completed = exchange.events[0][-1]
    assert completed["type"] == "response.completed"
    assert completed["response"]["instructions"] == text
    assert completed["response"]["metadata"] == {"note": text}


def test_zz_report_fuzz_counts() -> None:
    """The closing note's numbers: fuzzed requests by provider and status."""
    assert any(COUNTS.values()), "no fuzzed request ran"
    for name, counts in COUNTS.items():
        print(f"fuzz {name}: {sum(counts.values())} answers, {dict(sorted(counts.items()))}")
        assert not [k for k in counts if k[:1] == "5"], counts


def test_an_empty_gemini_count_is_zero_tokens(fuzz_proxy: Proxy) -> None:
    """countTokens takes an empty request; the chat template takes no empty conversation. Found
    fuzzing with bad input no longer hidden as a 400: it was a 500 (a ValueError in rendering)."""
    path = f"{fuzzing.GEMINI_MODEL}:countTokens"
    answer = post(fuzz_proxy, "empty-count", "gemini", b"{}", path=path)
    assert answer.status == 200, answer.body[:300]
    assert json.loads(answer.body)["totalTokens"] == 0
