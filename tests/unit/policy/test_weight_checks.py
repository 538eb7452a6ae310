"""Weights the policy serves are checked (capture/policy/weights.py, replicas.py, pools.py),
against two vLLM-shaped stubs in dev mode (tests/support/stub_vllm.py: a reload of a folder shifts
every logprob it gives by that folder's ``folders`` entry, as other weights would):

- an update's probe passes on a replica that serves the trainer's weights and fails, with the
  difference named, on one that serves others; that one leaves rotation and a generation held
  for it through the update goes to the other;
- without a probe the update says nothing was checked;
- a reload nobody pushed through agenttap is found by the next check (fingerprint), the
  replica leaves rotation, the window is kept and the metric hook told;
- a paused (or sleeping) server is unhealthy and says so, and calls go elsewhere at once.
The real vLLM: tests/e2e/policy/test_weights_exact_vllm.py.
"""

from __future__ import annotations

import asyncio
import time
import zlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from capture.policy import replicas as replicas_module
from capture.policy.pools import PolicyPools
from capture.policy.replicas import OWN_FINGERPRINT_IDS, PAUSED, SERVING, SLEEPING, UNVERIFIED
from capture.policy.weights import Probe, WeightUpdateError, check_probe
from rewriter.canonical import SamplingParams
from tests.support.paths import QWEN3
from tests.support.stub_vllm import StubPolicy

PROBE_IDS = [9707, 11, 1246, 525, 498, 30, 358, 2776, 6915]


def sid_hashing_to(index: int, n: int) -> str:
    return next(f"s{i}" for i in range(1000) if zlib.crc32(f"s{i}".encode()) % n == index)


def trainer_logprobs(ids: list[int], shift: float = 0.0) -> list[float | None]:
    """What the trainer's model gives ``ids``: the stub's own function of position and token
    (the weights a replica serves after reloading a folder of shift 0)."""
    return [None] + [StubPolicy._logprob_of(i, t, shift) for i, t in enumerate(ids) if i > 0]


@pytest.fixture
async def stubs() -> AsyncIterator[list[StubPolicy]]:
    servers = [StubPolicy(str(QWEN3)) for _ in range(2)]
    for s in servers:
        s.dev_mode = True
        await asyncio.to_thread(s.start)
    yield servers
    for s in servers:
        await asyncio.to_thread(s.stop)


def weights_dir(tmp_path: Path, name: str) -> Path:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"x")
    return folder


def pools_of(stubs: list[StubPolicy]) -> PolicyPools:
    pools = PolicyPools([s.url for s in stubs], [], [], timeout_s=30, max_connections=8)
    pools.open(lambda ids: "")
    return pools


def test_probe_bodies_are_checked() -> None:
    assert check_probe(None) is None
    probe = check_probe({"ids": [1, 2, 3], "logprobs": [None, -1.5, -0.25]})
    assert probe == Probe([1, 2, 3], [None, -1.5, -0.25])
    # A number first is accepted and ignored (nothing comes before the first token).
    assert check_probe({"ids": [1, 2], "logprobs": [0.0, -1]}) == Probe([1, 2], [None, -1.0])
    for bad, says in [
        ([1, 2], "must be"),
        ({"ids": [1, 2]}, "must be"),
        ({"ids": [1], "logprobs": [None]}, "2 to 4096"),
        ({"ids": [1, 2, 3], "logprobs": [None, -1]}, "one logprob per id"),
        ({"ids": [1, -2], "logprobs": [None, -1]}, "token ids"),
        ({"ids": [1, True], "logprobs": [None, -1]}, "token ids"),
        ({"ids": [1, 2], "logprobs": [None, 0.5]}, "0 or less"),
        ({"ids": [1, 2], "logprobs": [None, "x"]}, "0 or less"),
        ({"ids": [1, 2], "logprobs": [None, -1], "extra": 1}, "must be"),
    ]:
        with pytest.raises(ValueError, match=says):
            check_probe(bad)


async def test_a_replica_failing_the_probe_leaves_rotation_and_its_held_call_moves(
    stubs: list[StubPolicy], tmp_path: Path
) -> None:
    good, bad = stubs
    folder = weights_dir(tmp_path, "step-1")
    # The bad replica reads another folder at the same path: its logprobs are 0.25 off.
    bad.folders[str(folder)] = 0.25
    pools = pools_of(stubs)
    assert pools.default is not None
    replicas = pools.default
    probe = Probe(PROBE_IDS, trainer_logprobs(PROBE_IDS))
    sid = sid_hashing_to(1, 2)
    try:
        assert pools.client_for(sid).base_url == bad.url
        # A generation that reaches the bad replica while it loads waits in agenttap's hold,
        # then goes to the replica that passed.
        update = asyncio.create_task(
            pools.weights.update(pools.http, replicas, folder, "step-1", probe)
        )
        while not replicas.replicas[bad.url].loading:
            await asyncio.sleep(0.001)
        held = asyncio.create_task(
            pools.client_for(sid).complete(
                [1, 2, 3],
                SamplingParams(max_tokens=4),
                failover=pools.generation(sid, "", replicas.replicas[bad.url].client).failover,
            )
        )
        with pytest.raises(WeightUpdateError) as caught:
            await update
        done = await asyncio.wait_for(held, 10)
    finally:
        await pools.close()
    message = str(caught.value)
    assert bad.url in message and "0.25" in message, message
    outcomes = {o["url"]: o for o in caught.value.replicas}
    assert outcomes[good.url]["ok"] is True and outcomes[good.url]["checked"] is True
    assert outcomes[good.url]["max_diff"] < 1e-9
    assert outcomes[bad.url]["ok"] is False and abs(outcomes[bad.url]["max_diff"] - 0.25) < 1e-9
    out = replicas.replicas[bad.url]
    assert out.state == UNVERIFIED and not out.serving and "0.25" in out.unverified
    summary = {r["url"]: r for r in replicas.summary()}
    assert summary[bad.url]["state"] == "unverified" and summary[bad.url]["in_rotation"] is False
    assert summary[good.url]["state"] == "serving"
    # New calls go to the replica that passed; the held one ran there too.
    assert pools.client_for(sid).base_url == good.url
    assert {b for b, _, _ in done.backends} == {good.url} and len(done.token_ids) >= 1
    assert done.weight_versions[0][0] == "step-1"
    # Both replicas were asked for the probe; the held call never reached the bad one.
    assert [c["prompt"] for c in bad.checks if c["prompt"] == PROBE_IDS]
    assert [r["prompt"][:3] for r in bad.requests] == []
    assert pools.weights.history.current == "step-1"


async def test_an_update_without_a_probe_says_nothing_was_checked(
    stubs: list[StubPolicy], tmp_path: Path
) -> None:
    stubs[1].extension = False  # plain vLLM: its own reload_weights is used
    pools = pools_of(stubs)
    assert pools.default is not None
    try:
        outcomes = await pools.weights.update(
            pools.http, pools.default, weights_dir(tmp_path, "s1"), "s1"
        )
    finally:
        await pools.close()
    assert [o["ok"] for o in outcomes] == [True, True]
    assert [o["checked"] for o in outcomes] == [False, False]
    assert [s.reloads for s in stubs] == [[str(tmp_path / "s1")]] * 2
    # Fingerprinted with agenttap's own sequence for the later checks.
    for replica in pools.default.replicas.values():
        assert replica.fingerprint_ids == OWN_FINGERPRINT_IDS and replica.fingerprint
    assert pools.default.replicas[stubs[1].url].client.exact_reload is False
    assert pools.default.replicas[stubs[0].url].client.exact_reload is True


async def test_weights_swapped_behind_agenttaps_back_are_found_by_the_next_check(
    stubs: list[StubPolicy],
) -> None:
    changed: list[tuple[str, float]] = []
    pools = pools_of(stubs)
    pools.on_weights_changed = lambda url, diff, _window: changed.append((url, diff))
    assert pools.default is not None
    try:
        assert await pools.check_health() == {s.url: True for s in stubs}  # the fingerprint
        first = time.time()
        await pools.check_health()  # the same answers: nothing happens
        assert changed == [] and all(r.serving for r in pools.default.replicas.values())
        stubs[0].shift = 0.5  # someone reloaded other weights, not through agenttap
        await pools.check_health()
    finally:
        await pools.close()
    replica = pools.default.replicas[stubs[0].url]
    assert changed and changed[0][0] == stubs[0].url and abs(changed[0][1] - 0.5) < 1e-9
    assert replica.state == UNVERIFIED and "without a weight update" in replica.unverified
    assert pools.default.replicas[stubs[1].url].state == SERVING
    (window,) = pools.unverified_windows
    assert window[0] == stubs[0].url and first - 5 < window[1] <= window[2] <= time.time()
    # A generation that ran there in the window is flagged; one on the other replica is not.
    assert pools.weights_unverified(stubs[0].url, window[1] + 0.001, window[2])
    assert not pools.weights_unverified(stubs[1].url, window[1], window[2])
    # It stays out (health checks do not bring it back) until an update verifies it.
    assert pools.client_for(sid_hashing_to(0, 2)).base_url == stubs[1].url


@pytest.mark.parametrize("state", [PAUSED, SLEEPING])
async def test_a_paused_or_sleeping_server_is_unhealthy_and_no_call_waits_on_it(
    stubs: list[StubPolicy], state: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(replicas_module, "HEALTH_TIMEOUT_S", 1.0)
    pools = pools_of(stubs)
    assert pools.default is not None
    sid = sid_hashing_to(0, 2)
    try:
        assert await pools.check_health() == {s.url: True for s in stubs}
        if state == PAUSED:
            stubs[0].set_paused(True)
        else:
            stubs[0].sleeping = True
        # A call placed there before the next check waits in the paused server's queue...
        first = pools.client_for(sid)
        assert first.base_url == stubs[0].url
        gen = pools.generation(sid, "", first)
        waiting = asyncio.create_task(
            first.complete([1, 2, 3], SamplingParams(max_tokens=4), failover=gen.failover)
        )
        while not stubs[0].requests or stubs[0].requests[-1]["prompt"] != [1, 2, 3]:
            await asyncio.sleep(0.01)
        started = time.monotonic()
        health = await pools.check_health()
        assert time.monotonic() - started < 5
        assert health[stubs[0].url] is False
        replica = pools.default.replicas[stubs[0].url]
        assert replica.state == state and state in replica.last_error
        # ... and goes on on the other one once the check found it paused.
        moved = await asyncio.wait_for(waiting, 5)
        assert {b for b, _, _ in moved.backends} == {stubs[1].url}
        # /health still answers 200 there: not what health means any more.
        client = pools.client_for(sid)
        assert client.base_url == stubs[1].url
        done = await asyncio.wait_for(client.complete([1, 2, 3], SamplingParams(max_tokens=4)), 9)
        assert done.finish_reason
    finally:
        stubs[0].sleeping = False
        stubs[0].set_paused(False)
        await pools.close()


async def test_a_lone_paused_server_keeps_its_generations_for_its_resume(
    stubs: list[StubPolicy], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With no other server to move to, a generation waiting on a paused server (a trainer's
    own pause for its weight sync) is left to run once it resumes, not failed."""
    monkeypatch.setattr(replicas_module, "HEALTH_TIMEOUT_S", 1.0)
    pools = pools_of(stubs[:1])
    assert pools.default is not None
    try:
        stubs[0].set_paused(True)
        client = pools.client_for("s0")
        gen = pools.generation("s0", "", client)
        waiting = asyncio.create_task(
            client.complete([1, 2, 3], SamplingParams(max_tokens=4), failover=gen.failover)
        )
        health = await pools.check_health()
        assert health == {stubs[0].url: False}
        assert pools.default.replicas[stubs[0].url].state == PAUSED
        assert not waiting.done()
        stubs[0].set_paused(False)
        done = await asyncio.wait_for(waiting, 5)
        assert {b for b, _, _ in done.backends} == {stubs[0].url}
    finally:
        stubs[0].set_paused(False)
        await pools.close()


async def test_a_lora_adapter_is_loaded_checked_and_asked_for(
    stubs: list[StubPolicy], tmp_path: Path
) -> None:
    """``lora``: each server loads the adapter (vLLM's /v1/load_lora_adapter) under the version's
    name, is checked against the PEFT model's probe, and generations ask for it by name; the
    next adapter replaces it; a full update goes back to the base model."""
    first, second = tmp_path / "a1", tmp_path / "a2"
    for s in stubs:
        s.folders.update({str(first): 0.5, str(second): 0.75})
    pools = pools_of(stubs)
    assert pools.default is not None
    replicas = pools.default
    try:
        probe = Probe(PROBE_IDS, trainer_logprobs(PROBE_IDS, 0.5))
        outcomes = await pools.weights.update(
            pools.http, replicas, first, "lora-1", probe, lora=True
        )
        assert [o["ok"] for o in outcomes] == [True, True]
        assert all(r.client.lora == "lora-1" for r in replicas.replicas.values())
        done = await pools.client_for("s1").complete([1, 2, 3], SamplingParams(max_tokens=2))
        assert done.weight_versions[0][0] == "lora-1"
        assert any(r.get("model") == "lora-1" for s in stubs for r in s.requests)
        # A probe of other weights than the adapter's fails, as for full weights.
        with pytest.raises(WeightUpdateError):
            await pools.weights.update(pools.http, replicas, second, "lora-2", probe, lora=True)
        assert [sorted(s.loras) for s in stubs] == [["lora-2"], ["lora-2"]]  # lora-1 unloaded
        # Full weights: the base model again.
        folder = weights_dir(tmp_path, "full")
        await pools.weights.update(pools.http, replicas, folder, "full-1")
        assert all(r.client.lora is None for r in replicas.replicas.values())
    finally:
        await pools.close()
