"""Policy replicas through a real mitmdump (launcher), answered by vLLM-shaped stubs: placement
by load and hash, replicas added and removed at GET/POST/DELETE /replicas, bounded generations
with the provider's retryable error, and a generation that goes on on another replica when its
own cuts the stream, seen by the real openai SDK as one answer and recorded with both spans."""

from __future__ import annotations

import json
import threading
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from capture.client.launcher import AgentTap
from capture.storage.reader import load_threads
from tests.e2e.rollouts.test_control_api import http
from tests.support.paths import QWEN3
from tests.support.stub_vllm import StubPolicy


@pytest.fixture(scope="module")
def stubs() -> Iterator[list[StubPolicy]]:
    servers = [StubPolicy(str(QWEN3)) for _ in range(3)]
    for s in servers:
        s.start()
    yield servers
    for s in servers:
        s.stop()


@pytest.fixture(scope="module")
def tap(
    stubs: list[StubPolicy], confdir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[AgentTap]:
    instance = AgentTap.start(
        f"{stubs[0].url},{stubs[1].url}",
        QWEN3,
        tmp_path_factory.mktemp("replicas") / "out",
        confdir=confdir,
        options={"agenttap_replica_max_inflight": "1", "agenttap_replica_queue": "1"},
    )
    yield instance
    instance.close()


@pytest.fixture(autouse=True)
def reset(stubs: list[StubPolicy]) -> Iterator[None]:
    for s in stubs:
        s.replies.clear()
        s.fault, s.chunk_delay_s, s.first_delay_s, s.healthy = None, 0.0, 0.0, True
    yield
    for s in stubs:
        s.fault, s.chunk_delay_s, s.first_delay_s, s.healthy = None, 0.0, 0.0, True


def wait_until(check: Any, what: str, timeout_s: float = 30.0) -> Any:
    """Poll ``check()`` until it returns something true; fail naming ``what`` after the timeout."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.02)
    pytest.fail(f"timed out after {timeout_s:g} s waiting for {what}")


def session_hashing_to(index: int, n: int, prefix: str) -> str:
    return next(
        f"{prefix}{i}" for i in range(1000) if zlib.crc32(f"{prefix}{i}".encode()) % n == index
    )


def openai_client(tap: AgentTap, sid: str, open_it: bool = True, key: str = "x") -> Any:
    """A base-URL client of session ``sid``: opened here (its secret as the key), or opened
    already (``key``: its secret)."""
    import openai

    if open_it:
        key = tap.open_session(id=sid).api_key
    base_url = f"{tap.api_url}/sess/{sid}/v1"
    return openai.OpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=60)


def test_sessions_stick_to_the_replica_their_hash_names_when_idle(
    tap: AgentTap, stubs: list[StubPolicy]
) -> None:
    for index in (0, 1):
        sid = session_hashing_to(index, 2, "idle-")
        client = openai_client(tap, sid)
        before = [len(s.requests) for s in stubs]
        for _ in range(2):
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        after = [len(s.requests) for s in stubs]
        assert after[index] - before[index] == 2 and after[1 - index] == before[1 - index]
    status, body = http(f"{tap.api_url}/replicas", token=tap.token)
    assert status == 200 and [r["url"] for r in body["replicas"]] == [s.url for s in stubs[:2]]
    assert all(r["healthy"] for r in body["replicas"]) and body["max_inflight"] == 1


def test_a_replica_is_added_and_removed_while_running(
    tap: AgentTap, stubs: list[StubPolicy]
) -> None:
    api, token = tap.api_url, tap.token
    # Two new sessions land on the two replicas (least loaded: the second avoids the first's).
    pinned = [openai_client(tap, f"pinned-{k}") for k in range(2)]
    for c in pinned:
        c.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    status, body = http(f"{api}/replicas", "POST", token, {"url": "http://127.0.0.1:1"})
    assert status == 400 and "did not complete a 1-token generation" in body["error"]["message"]
    status, body = http(f"{api}/replicas", "POST", token, {"url": stubs[2].url})
    assert status == 200 and stubs[2].url in [r["url"] for r in body["replicas"]]
    # Both old replicas busy with their sessions' long answers: a new session goes to the new one.
    for s in stubs[:2]:
        s.chunk_delay_s = 0.1
        s.script(" ".join(["word"] * 40))
    busy = [
        threading.Thread(
            target=c.chat.completions.create,
            kwargs={"model": "m", "messages": [{"role": "user", "content": "long"}]},
        )
        for c in pinned
    ]
    for t in busy:
        t.start()
    try:
        wait_until(
            lambda: http(f"{api}/replicas", token=token)[1]["replicas"],
            "a generation running on each of the first two replicas",
        )
        before = len(stubs[2].requests)
        fresh = openai_client(tap, "fresh")
        fresh.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
        assert len(stubs[2].requests) == before + 1
    finally:
        for t in busy:
            t.join(60)
    status, body = http(f"{api}/replicas?url={stubs[2].url}", "DELETE", token)
    assert status == 200 and stubs[2].url not in [r["url"] for r in body["replicas"]]
    status, body = http(f"{api}/replicas?url={stubs[2].url}", "DELETE", token)
    assert status == 404
    # Its session goes on, on a replica still in the pool.
    before = [len(s.requests) for s in stubs]
    fresh.chat.completions.create(model="m", messages=[{"role": "user", "content": "y"}])
    assert len(stubs[2].requests) == before[2]
    assert sum(len(s.requests) for s in stubs) == sum(before) + 1


def test_a_replica_serving_other_weights_joins_out_of_rotation(
    tap: AgentTap, stubs: list[StubPolicy]
) -> None:
    """A server started from another checkpoint than the pool serves (its fingerprint 0.5 off
    the serving replicas') is not put in rotation: 409 naming the difference, /replicas says
    it is unverified, and no session is placed there."""
    api, token = tap.api_url, tap.token
    stubs[2].shift = 0.5
    try:
        status, body = http(f"{api}/replicas", "POST", token, {"url": stubs[2].url})
        message = body["error"]["message"]
        assert status == 409 and "serves other weights than the pool" in message, body
        assert "0.5" in message and "POST /policy/weights" in message
        _, listed = http(f"{api}/replicas", token=token)
        added = next(r for r in listed["replicas"] if r["url"] == stubs[2].url)
        assert added["state"] == "unverified" and added["in_rotation"] is False
        before = len(stubs[2].requests)
        for k in range(4):
            openai_client(tap, f"other-weights-{k}").chat.completions.create(
                model="m", messages=[{"role": "user", "content": "x"}]
            )
        assert len(stubs[2].requests) == before
    finally:
        stubs[2].shift = 0.0
        http(f"{api}/replicas?url={stubs[2].url}", "DELETE", token)


def test_a_full_replica_answers_the_providers_retryable_error(
    tap: AgentTap, stubs: list[StubPolicy]
) -> None:
    """One generation at a time per replica and one call waiting: a third call is refused with
    OpenAI's 503 (the SDKs retry it), the waiting one is served."""
    import openai

    sid = session_hashing_to(0, 2, "full-")
    stubs[0].first_delay_s = stubs[1].first_delay_s = 1.0
    results: list[Any] = []

    def call() -> None:
        try:
            results.append(
                openai_client(tap, sid, open_it=False, key=key)
                .chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
                .choices[0]
                .message.content
            )
        except openai.APIStatusError as exc:
            results.append(exc)

    key = tap.open_session(id=sid).api_key
    threads = [threading.Thread(target=call) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    refused = [r for r in results if isinstance(r, Exception)]
    assert len(results) == 3 and len(refused) == 1, results
    assert refused[0].status_code == 503 and "agenttap_replica_queue" in str(refused[0])


def test_a_generation_cut_mid_stream_goes_on_on_another_replica(
    tap: AgentTap, stubs: list[StubPolicy], tok: Any
) -> None:
    sid = session_hashing_to(0, 2, "failover-")
    client = openai_client(tap, sid)
    text = "alpha beta gamma delta epsilon zeta eta theta iota kappa"
    # The first replica streams 4 tokens ("alpha beta gamma delta") and cuts; the second, sent
    # the prompt plus those 4, writes the rest (a stub continues what it is scripted).
    assert len(tok.encode("alpha beta gamma delta", add_special_tokens=False)) == 4
    stubs[0].script(text)
    stubs[1].script(text.removeprefix("alpha beta gamma delta"))
    stubs[0].fault, stubs[0].fault_after = "truncate", 4
    n1 = len(stubs[1].requests)
    stream = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "letters"}], stream=True
    )
    got = ""
    finish = None
    for chunk in stream:
        if chunk.choices:
            got += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    # One uninterrupted answer: the text the policy would have written, once.
    assert got == text and finish == "stop"
    resumed = stubs[1].requests[n1]["prompt"]
    tap.flush(sid)
    rows = [r for r in load_threads(tap.out) if r["session_id"] == sid]
    assert len(rows) == 1 and rows[0]["num_turns"] == 1
    turn = rows[0]["turns"][0]
    ids = rows[0]["input_ids"][turn["start"] : turn["end"]]
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert resumed == rows[0]["input_ids"][: turn["start"] + 4]
    assert turn["backend"] == stubs[1].url
    import pyarrow.dataset as ds

    turns = ds.dataset(str(tap.out / "turns")).to_table().to_pylist()
    meta = json.loads(next(t for t in turns if t["session_id"] == sid)["metadata"])
    assert meta["backends"] == [
        {"backend": stubs[0].url, "start": 0, "end": 4},
        {"backend": stubs[1].url, "start": 4, "end": len(ids)},
    ]
    _, listed = http(f"{tap.api_url}/replicas", token=tap.token)
    first = next(r for r in listed["replicas"] if r["url"] == stubs[0].url)
    assert first["failovers"] >= 1
