"""``agenttap_stream_flush_ms`` (``VLLMClient.flush_interval_s``): tokens that come within the
interval of the last piece handed on wait, and go on with the next, so that one event (one relay
through mitmproxy, one TLS record) carries several tokens. The first token and the end of an
answer are never held; nothing read is ever lost, not even when the policy stalls or is
abandoned while tokens wait. The client alone against the vLLM-shaped stub, pacing its tokens.
"""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest

from rewriter.canonical import SamplingParams
from rewriter.vllm_client import Completion, CompletionDelta, PolicyError, VLLMClient
from tests.support.stub_vllm import StubPolicy

PROMPT = [9707, 11, 1879, 0]
PACE_S = 0.05  # a token every 50 ms: a reader keeps up, each token comes alone
# Longer than any answer asked for here: every generation ends by its length.
REPLY = " ".join(["count"] * 100)


async def streamed(
    client: VLLMClient, tokens: int
) -> tuple[list[CompletionDelta], list[float], float]:
    """The pieces of one generation, the time each came (from the call's start) and the
    call's whole time."""
    began = time.monotonic()
    pieces: list[CompletionDelta] = []
    times: list[float] = []
    async for piece in client.stream(PROMPT, SamplingParams(max_tokens=tokens, ignore_eos=True)):
        pieces.append(piece)
        times.append(time.monotonic() - began)
    return pieces, times, time.monotonic() - began


def whole(pieces: list[CompletionDelta]) -> Completion:
    out = Completion()
    for piece in pieces:
        out.extend(piece)
    return out


@pytest.fixture
def paced(stub: StubPolicy):  # type: ignore[no-untyped-def]
    before = stub.default_reply
    stub.chunk_delay_s, stub.default_reply = PACE_S, REPLY
    yield stub
    stub.chunk_delay_s, stub.default_reply = 0.0, before
    stub.fault, stub.fault_after = None, 0


async def test_without_an_interval_each_token_goes_on_as_it_comes(paced: StubPolicy) -> None:
    async with aiohttp.ClientSession() as http:
        client = VLLMClient(paced.url, http, progress_timeout_s=30, flush_interval_s=0)
        pieces, _, _ = await streamed(client, 8)
    # Each token as it comes (a loaded machine may read two that came together as one piece).
    assert len(pieces) > 8 // 2, [p.text for p in pieces]
    assert sum(len(p.token_ids) for p in pieces) == 8
    assert pieces[-1].finish_reason == "length"


async def test_a_long_interval_holds_neither_the_first_token_nor_the_end(paced: StubPolicy) -> None:
    """An interval far longer than the answer: the first token goes at once, alone; the rest
    waits, and goes with the finish the moment it is read, not when the interval ends. The
    completion is token for token the one sent piece by piece."""
    async with aiohttp.ClientSession() as http:
        each = VLLMClient(paced.url, http, progress_timeout_s=30, flush_interval_s=0)
        held = VLLMClient(paced.url, http, progress_timeout_s=30, flush_interval_s=60)
        one_by_one, _, _ = await streamed(each, 12)
        pieces, times, took = await streamed(held, 12)
    assert len(pieces) == 2, [p.text for p in pieces]
    assert sum(len(p.token_ids) for p in pieces) == 12
    assert len(pieces[0].token_ids) < 6  # the first token(s) did not wait for the rest
    assert times[0] < times[1] / 2
    assert took < 10, took  # the end did not wait for the 60 s interval
    assert pieces[-1].finish_reason == "length"
    got, want = whole(pieces), whole(one_by_one)
    assert (got.text, got.token_ids, got.logprobs) == (want.text, want.token_ids, want.logprobs)


async def test_pieces_go_on_no_more_often_than_the_interval(paced: StubPolicy) -> None:
    interval = 0.2
    async with aiohttp.ClientSession() as http:
        client = VLLMClient(paced.url, http, progress_timeout_s=30, flush_interval_s=interval)
        pieces, times, took = await streamed(client, 24)
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    # Every piece but the last (the finish, never held) came an interval or more after the one
    # before it.
    assert all(gap >= interval - 0.01 for gap in gaps[:-1]), gaps
    assert 3 <= len(pieces) <= 2 + took / interval, (len(pieces), took)
    assert sum(len(p.token_ids) for p in pieces) == 24


async def test_tokens_waiting_when_the_policy_stalls_go_on_before_the_error(
    paced: StubPolicy,
) -> None:
    """The policy stalls after 5 tokens while all but the first wait for a 60 s interval: the
    stall is found at the policy timeout, and they go on first (a failover would resume after
    them)."""
    paced.fault, paced.fault_after = "stall", 5
    pieces: list[CompletionDelta] = []
    async with aiohttp.ClientSession() as http:
        client = VLLMClient(paced.url, http, progress_timeout_s=1, flush_interval_s=60)
        began = time.monotonic()
        with pytest.raises(PolicyError, match="did not answer in time") as err:
            async for piece in client.stream(PROMPT, SamplingParams(max_tokens=32)):
                pieces.append(piece)
        took = time.monotonic() - began
    assert err.value.unavailable  # retryable: another replica may go on from here
    assert len(pieces) == 2 and sum(len(p.token_ids) for p in pieces) == 5
    assert took < 10, took


async def test_an_abandoned_server_ends_a_wait_for_the_interval(paced: StubPolicy) -> None:
    """A replica found paused (``abandon``) while its stream waits out an interval: the wait
    ends at once as a stall, with the waiting tokens handed on first."""
    pieces: list[CompletionDelta] = []
    async with aiohttp.ClientSession() as http:
        client = VLLMClient(paced.url, http, progress_timeout_s=300, flush_interval_s=60)

        async def read() -> None:
            async for piece in client.stream(PROMPT, SamplingParams(max_tokens=64)):
                pieces.append(piece)

        task = asyncio.ensure_future(read())
        while not pieces:
            await asyncio.sleep(0.01)
        await asyncio.sleep(4 * PACE_S)  # tokens come and wait for the interval
        assert client.abandon() == 1
        began = time.monotonic()
        with pytest.raises(PolicyError, match="did not answer in time"):
            await asyncio.wait_for(task, 10)
        assert time.monotonic() - began < 5
    assert len(pieces) == 2 and pieces[0].token_ids and pieces[1].token_ids
    assert pieces[-1].finish_reason is None
