"""Policy replicas (capture/policy/replicas.py, capture/policy/pools.py): placement, health, bounded slots
and failover mid-generation, against vLLM-shaped stub servers in this process."""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from capture.policy.pools import PolicyPools
from capture.policy.replicas import ReplicasBusy, ReplicaSet
from rewriter.canonical import SamplingParams
from rewriter.vllm_client import Completion, PolicyError, VLLMClient
from rewriter.vllm_rotation import Rotation
from tests.support.paths import QWEN3
from tests.support.stub_vllm import StubPolicy


class FakeClient:
    def __init__(self, url: str) -> None:
        self.base_url = url


def replica_set(n: int = 3, **kw: Any) -> ReplicaSet:
    urls = [f"http://r{i}" for i in range(n)]
    return ReplicaSet(urls, FakeClient, **kw)  # type: ignore[arg-type]


def sid_hashing_to(index: int, n: int) -> str:
    return next(f"s{i}" for i in range(1000) if zlib.crc32(f"s{i}".encode()) % n == index)


def test_idle_replicas_place_a_session_by_its_hash_and_it_sticks() -> None:
    reps = replica_set(3)
    for index in range(3):
        sid = sid_hashing_to(index, 3)
        assert reps.pick(sid).url == f"http://r{index}"
    sid = sid_hashing_to(1, 3)
    reps.replicas["http://r1"].in_flight = 5  # busy now, but the session stays
    assert reps.pick(sid).url == "http://r1"


def test_new_sessions_go_to_the_least_loaded_healthy_replica() -> None:
    reps = replica_set(3)
    reps.replicas["http://r0"].in_flight = 2
    reps.replicas["http://r1"].in_flight = 1
    reps.replicas["http://r2"].in_flight = 1
    reps.replicas["http://r2"].healthy = False
    assert reps.pick("new-session").url == "http://r1"
    # Its replica unhealthy, a session moves to a healthy one and stays there.
    reps.replicas["http://r1"].healthy = False
    assert reps.pick("new-session").url == "http://r0"
    reps.replicas["http://r1"].healthy = True
    assert reps.pick("new-session").url == "http://r0"
    assert reps.replicas["http://r0"].sessions == 1 and reps.replicas["http://r1"].sessions == 0


def test_replicas_are_added_and_removed_while_sessions_run() -> None:
    reps = replica_set(2)
    sid = sid_hashing_to(0, 2)
    assert reps.pick(sid).url == "http://r0"
    reps.add("http://r9/")
    assert "http://r9" in reps.urls()
    reps.remove("http://r0")
    moved = reps.pick(sid)
    assert moved.url in ("http://r1", "http://r9")
    with pytest.raises(KeyError):
        reps.remove("http://nowhere")
    reps.remove("http://r1" if moved.url == "http://r9" else "http://r9")
    with pytest.raises(ValueError, match="last policy server"):
        reps.remove(reps.urls()[0])


async def test_slots_are_bounded_with_a_bounded_queue_then_refused() -> None:
    reps = replica_set(1, max_in_flight=2, max_queue=1)
    r = reps.replicas["http://r0"]
    await reps.acquire(r)
    await reps.acquire(r)
    waiter = asyncio.create_task(reps.acquire(r))
    await asyncio.sleep(0.01)
    assert r.waiting == 1 and not waiter.done()
    with pytest.raises(ReplicasBusy, match="agenttap_replica_queue") as refused:
        await reps.acquire(r)
    assert refused.value.status == 503 and refused.value.unavailable
    await reps.release(r)
    await asyncio.wait_for(waiter, 5)
    assert r.in_flight == 2 and r.waiting == 0


@pytest.fixture
async def stubs() -> AsyncIterator[list[StubPolicy]]:
    servers = [StubPolicy(str(QWEN3)) for _ in range(2)]
    for s in servers:
        await asyncio.to_thread(s.start)
    yield servers
    for s in servers:
        await asyncio.to_thread(s.stop)


async def test_health_checks_take_a_replica_out_and_bring_it_back(stubs: list[StubPolicy]) -> None:
    pools = PolicyPools([s.url for s in stubs], [], [], timeout_s=30, max_connections=8)
    pools.open(lambda ids: "")
    try:
        assert await pools.check_health() == {stubs[0].url: True, stubs[1].url: True}
        stubs[0].healthy = False
        assert (await pools.check_health())[stubs[0].url] is False
        assert pools.default is not None
        sid = sid_hashing_to(0, 2)
        assert pools.client_for(sid).base_url == stubs[1].url
        assert "503" in pools.default.replicas[stubs[0].url].last_error
        stubs[0].healthy = True
        assert (await pools.check_health())[stubs[0].url] is True
    finally:
        await pools.close()


@pytest.mark.parametrize("fault", ["truncate", "stall"])
async def test_a_generation_goes_on_on_another_replica_when_its_own_fails(
    stubs: list[StubPolicy], tok: Any, fault: str
) -> None:
    """The first replica cuts (or stalls) its stream after 3 tokens: the rest is sampled by
    the second from the tokens so far, and the caller sees one completion."""
    first, second = stubs
    text = "one two three four five six seven eight nine ten"
    for s in stubs:
        s.replies.clear()
        s.script(text)
    first.fault, first.fault_after = fault, 3
    timeout = 1 if fault == "stall" else 30
    pools = PolicyPools([first.url, second.url], [], [], timeout_s=timeout, max_connections=8)
    pools.open(lambda ids: tok.decode(ids, skip_special_tokens=True))
    sid = sid_hashing_to(0, 2)
    prompt = list(tok.encode("count", add_special_tokens=False))
    try:
        client = pools.client_for(sid)
        assert client.base_url == first.url
        pieces = []
        async with pools.generation(sid, "", client) as gen:
            async for delta in client.stream_resuming(
                prompt, SamplingParams(max_tokens=64), failover=gen.failover
            ):
                pieces.append(delta)
            assert gen.replica.url == second.url and gen.replica.in_flight == 1
        assert pools.default is not None
        assert pools.default.replicas[first.url].in_flight == 0
        assert pools.default.replicas[second.url].in_flight == 0
        ids = [t for p in pieces for t in p.token_ids]
        # The second replica was sent the prompt plus the 3 tokens the first had streamed.
        resumed = second.requests[-1]["prompt"]
        assert resumed[: len(prompt)] == prompt and len(resumed) == len(prompt) + 3
        assert resumed[len(prompt) :] == ids[:3]
        # Pieces may hold several tokens (those that came in one read): by token, then.
        whole = Completion()
        for piece in pieces:
            whole.extend(piece)
        assert whole.backends[0] == (first.url, 0, 3)
        assert pieces[-1].backend == second.url and pieces[-1].finish_reason == "stop"
        assert pools.default.replicas[first.url].healthy is False
        # The session now sticks to the replica that finished its generation.
        assert pools.client_for(sid).base_url == second.url
    finally:
        first.fault = None
        await pools.close()


async def test_a_refusal_is_not_failed_over(stubs: list[StubPolicy], tok: Any) -> None:
    """A request the server refuses as such (400: a prompt over the context) fails as it is."""
    first, second = stubs
    http = aiohttp.ClientSession()
    client = VLLMClient(first.url, http)
    asked: list[str] = []

    async def failover(c: VLLMClient, exc: BaseException) -> VLLMClient | None:
        asked.append(c.base_url)
        return VLLMClient(second.url, http)

    try:
        with pytest.raises(PolicyError) as err:
            async for _ in client.stream_resuming(
                [1] * (first.max_model_len + 5), SamplingParams(max_tokens=4), failover=failover
            ):
                pass
        assert err.value.status == 400 and asked == []
    finally:
        await http.close()


async def test_a_servers_rotation_state_is_one_its_replicas_hold_and_its_client_reads() -> None:
    """Pools listing the same server share its replica's rotation state, and that server's
    client reads it: a weight update that holds, relabels or refuses on one pool's replica
    does so for every generation the server runs."""
    rotations: dict[str, Rotation] = {}
    async with aiohttp.ClientSession() as http:
        clients: dict[str, VLLMClient] = {}

        def client_of(url: str) -> VLLMClient:
            return clients.setdefault(url, VLLMClient(url, http))

        default = ReplicaSet(["http://r0"], client_of, rotations=rotations)
        mapped = ReplicaSet(["http://r0", "http://r1"], client_of, rotations=rotations)
        replica = default.replicas["http://r0"]
        assert replica.rotation is mapped.replicas["http://r0"].rotation
        assert replica.rotation is not mapped.replicas["http://r1"].rotation
        replica.rotation.weight_version, replica.rotation.lora = "step-1", "lora-1"
        replica.rotation.incoming_version = "step-2"
        client = clients["http://r0"]
        assert (client.weight_version, client.lora, client.sampling_version()) == (
            "step-1",
            "lora-1",
            "step-2",
        )
        replica.rotation.refuse = "failed its probe"
        with pytest.raises(PolicyError, match="out of rotation: failed its probe"):
            await client.rotation.admitted(client.base_url)
    # Without shared states, each set's replica has its own.
    alone = ReplicaSet(["http://r0"], FakeClient)  # type: ignore[arg-type]
    assert alone.replicas["http://r0"].rotation is not replica.rotation
