"""Issue 38 item 6: a flush racing a call. Many sessions, each holding several conversations of
streamed calls, are flushed every few milliseconds while their calls are in flight, through a
real mitmdump answered by the scripted stub (whose chunks are delayed, so every call spends
time in flight). Every generation the stub made must be trained exactly once, at its own ids
and logprobs, and every trained token must belong to one of them: a row holding a trained span
that matches no generation (history trained again, or a split in the wrong place) fails."""

from __future__ import annotations

import asyncio
import json
import os
import random
import ssl
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.paths import QWEN3
from tests.support.proxies import Proxy, proxy_token, read_threads, read_turns, start_proxy
from tests.support.stub_vllm import StubPolicy

# AGENTTAP_RACE_SESSIONS and AGENTTAP_RACE_RUNS press harder (a local hunt for a rare race).
SESSIONS = int(os.environ.get("AGENTTAP_RACE_SESSIONS", 8))
CONVERSATIONS = 3
CALLS = 6
# The scenario is run this many times, each with new sessions (a race is a matter of chance).
RUNS = int(os.environ.get("AGENTTAP_RACE_RUNS", 2))
# Between two flushes of one session: the 20-120 ms, shorter (more races a second).
FLUSH_EVERY_S = (0.002, 0.03)
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron".split()


class RecordingStub(StubPolicy):
    """The scripted stub, keeping every generation it made (ids; the logprobs are a fixed
    function of position and id, ``StubPolicy._logprob``)."""

    def __init__(self, tokenizer_dir: str) -> None:
        super().__init__(tokenizer_dir)
        self.generated: list[list[int]] = []
        self._rng = random.Random(38)
        self.rules.append(self._reply)

    def _reply(self, body: dict[str, Any]) -> str:
        # Different lengths and words: a span cut in the wrong place cannot match another.
        n = self._rng.randint(2, 12)
        return f"Step {len(self.generated)}: " + " ".join(self._rng.choices(WORDS, k=n)) + "."

    def _completion_ids(
        self, body: dict[str, Any], max_tokens: int
    ) -> tuple[list[int], str, str | None]:
        ids, finish, stop = super()._completion_ids(body, max_tokens)
        if body.get("prompt_logprobs") is None:
            self.generated.append(list(ids))
        return ids, finish, stop


@pytest.fixture(scope="module")
def race_stub() -> Iterator[RecordingStub]:
    policy = RecordingStub(str(QWEN3))
    policy.chunk_delay_s = 0.002
    policy.start()
    yield policy
    policy.stop()


@pytest.fixture(scope="module")
def race_proxy(
    race_stub: RecordingStub, confdir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Proxy]:
    proxy = start_proxy(race_stub.url, tmp_path_factory.mktemp("flush-race") / "out", confdir)
    proxy.token = proxy_token(proxy.log)
    yield proxy
    proxy.stop()


async def stream_call(client: httpx.AsyncClient, messages: list[dict[str, Any]]) -> str:
    """One streamed chat completion; the reply's text once the stream has ended."""
    body = {"model": "gpt-4o", "messages": messages, "stream": True}
    text: list[str] = []
    async with client.stream("POST", "https://api.openai.com/v1/chat/completions", json=body) as r:
        assert r.status_code == 200, (await r.aread())[:300]
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                return "".join(text)
            chunk = json.loads(line[6:])
            for choice in chunk["choices"]:
                text.append(choice["delta"].get("content") or "")
    raise AssertionError("the stream ended without [DONE]")


async def conversation(client: httpx.AsyncClient, sid: str, k: int) -> None:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a careful agent."},
        {"role": "user", "content": f"Task {k} of {sid}: tidy the repository."},
    ]
    for step in range(CALLS):
        reply = await stream_call(client, messages)
        messages += [
            {"role": "assistant", "content": reply},
            {"role": "user", "content": f"Go on ({step})."},
        ]


async def flusher(flush: httpx.AsyncClient, sid: str, done: asyncio.Event, seed: int) -> int:
    """Flush ``sid`` every few milliseconds until its conversations are over; how many times."""
    rng = random.Random(seed)
    count = 0
    while True:
        try:
            await asyncio.wait_for(done.wait(), rng.uniform(*FLUSH_EVERY_S))
            return count
        except TimeoutError:
            pass
        resp = await flush.post("http://agenttap.local/flush", params={"session": sid})
        # 404: no call of it has reached the proxy yet.
        assert resp.status_code in (200, 404), resp.text[:300]
        count += resp.status_code == 200


async def run_sessions(proxy: Proxy, run: int) -> tuple[list[str], int]:
    ctx = ssl.create_default_context(cafile=str(proxy.ca))
    headers = {"Authorization": f"Bearer {proxy.token}"}
    limits = httpx.Limits(max_connections=CONVERSATIONS)
    timeout = httpx.Timeout(120)
    sids = [f"race-{run}-{s}" for s in range(SESSIONS)]
    async with httpx.AsyncClient(
        proxy=f"http://127.0.0.1:{proxy.port}", headers=headers, timeout=timeout
    ) as flush:

        async def session(sid: str, seed: int) -> int:
            done = asyncio.Event()
            proxy_url = f"http://{sid}:x@127.0.0.1:{proxy.port}"
            async with httpx.AsyncClient(
                proxy=proxy_url, verify=ctx, limits=limits, timeout=timeout
            ) as client:
                flushes = asyncio.create_task(flusher(flush, sid, done, seed))
                try:
                    await asyncio.gather(
                        *(conversation(client, sid, k) for k in range(CONVERSATIONS))
                    )
                finally:
                    done.set()
                return await flushes

        counts = await asyncio.gather(*(session(sid, run * 1000 + i) for i, sid in enumerate(sids)))
    return sids, sum(counts)


def row_problems(
    threads: list[dict[str, Any]],
    turns: list[dict[str, Any]],
    generated: Counter[tuple[int, ...]],
    stub: RecordingStub,
) -> list[str]:
    """What is wrong with one session's rows: every call's ids a generation of the stub's, at
    the stub's logprobs; each call trained once, where its span says, at its own ids and
    logprobs; every trained token inside such a span; each row's ids its last call's."""
    problems: list[str] = []
    by_request = {t["request_id"]: t for t in turns}
    for t in turns:
        ids = t["completion_ids"]
        if tuple(ids) not in generated:
            problems.append(f"call {t['request_id']}: ids {ids} are no generation of the policy")
        expected = [stub._logprob(i, x) for i, x in enumerate(ids)]
        if t["completion_logprobs"] != pytest.approx(expected, abs=1e-5):
            problems.append(f"call {t['request_id']}: logprobs are not the policy's")
    trained: Counter[str] = Counter()
    for row in threads:
        mask, ids, lps = row["loss_mask"], row["input_ids"], row["logprobs"]
        covered = [False] * len(ids)
        for span in row["turns"]:
            call = by_request.get(span["request_id"])
            if call is None:
                problems.append(f"{row['thread_id']}: a span of unknown call {span}")
                continue
            start, end = span["start"], span["end"]
            if span["status"] == "dropped" or start < 0:
                problems.append(f"{row['thread_id']}: call {span['request_id']} dropped")
                continue
            if ids[start:end] != call["completion_ids"]:
                problems.append(
                    f"{row['thread_id']}: span {start}:{end} of {span['request_id']} holds "
                    f"{ids[start:end]}, the call sampled {call['completion_ids']}"
                )
            if span["status"] == "trained":
                trained[span["request_id"]] += 1
                covered[start:end] = [True] * (end - start)
                if lps[start:end] != pytest.approx(call["completion_logprobs"], abs=1e-5):
                    problems.append(
                        f"{row['thread_id']}: trained span {start}:{end} of "
                        f"{span['request_id']} has logprobs {lps[start:end]}, the call's are "
                        f"{call['completion_logprobs']}"
                    )
        stray = [i for i, m in enumerate(mask) if m and not covered[i]]
        if stray:
            problems.append(
                f"{row['thread_id']}: {len(stray)} trained token(s) in no trained span "
                f"(positions {stray[:3]}...{stray[-3:]}, ids {[ids[i] for i in stray][:12]}, "
                f"provenance {sorted({row['provenance'][i] for i in stray})})"
            )
        last = by_request.get(row["turns"][-1]["request_id"]) if row["turns"] else None
        if last is not None and ids != last["prompt_ids"] + last["completion_ids"]:
            problems.append(f"{row['thread_id']}: input_ids are not its last call's sequence")
    for rid in by_request:
        if trained[rid] != 1:
            problems.append(f"call {rid} trained {trained[rid]} times")
    total = sum(sum(row["loss_mask"]) for row in threads)
    sampled = sum(len(t["completion_ids"]) for t in turns)
    if total != sampled:
        problems.append(f"{total} tokens trained, {sampled} sampled")
    return problems


def tree_problems(threads: list[dict[str, Any]], turns: list[dict[str, Any]]) -> list[str]:
    """A flush writes, the session goes on: its calls are numbered once each, every call but
    each conversation's first extends the call before it (the tree kept across the flushes),
    and a row that does not start a conversation continues the row written before it."""
    problems: list[str] = []
    indices = sorted(t["turn_index"] for t in turns)
    if indices != list(range(len(turns))):
        problems.append(f"turn indices {indices}")
    kinds = Counter(json.loads(t["metadata"])["assembly"] for t in turns)
    if kinds != {"new": CONVERSATIONS, "extend": len(turns) - CONVERSATIONS}:
        problems.append(f"calls placed as {dict(kinds)}")
    firsts = {t["request_id"] for t in turns if json.loads(t["metadata"])["assembly"] == "new"}
    ids = {row["thread_id"] for row in threads}
    for row in threads:
        if firsts.isdisjoint(row["trained_request_ids"]) and not (
            row["parent_relation"] == "continued" and row["parent_thread_id"] in ids
        ):
            problems.append(f"{row['thread_id']} continues no row ({row['parent_relation']})")
    return problems


def test_flushes_racing_streamed_calls_train_every_generation_exactly_once(
    race_proxy: Proxy, race_stub: RecordingStub
) -> None:
    failed_runs: list[str] = []
    started = time.monotonic()
    made = SESSIONS * CONVERSATIONS * CALLS
    for run in range(RUNS):
        before = len(race_stub.generated)
        sids, flushes = asyncio.run(run_sessions(race_proxy, run))
        race_proxy.flush()  # whatever the last flushes left
        generated = Counter(tuple(g) for g in race_stub.generated[before:])
        assert sum(generated.values()) == made
        assert flushes > SESSIONS * CALLS, f"only {flushes} flushes wrote anything"
        problems: list[str] = []
        wrong = 0
        for sid in sids:
            turns = read_turns(race_proxy.out, sid)
            threads = read_threads(race_proxy.out, sid)
            found = row_problems(threads, turns, generated, race_stub)
            found += tree_problems(threads, turns)
            wrong += bool(found)
            problems += [f"{sid}: {p}" for p in found]
        if problems:
            failed_runs.append(
                f"run {run} ({flushes} flushes): {wrong} of {SESSIONS} sessions wrong\n  "
                + "\n  ".join(problems[:12])
            )
    elapsed = time.monotonic() - started
    log = race_proxy.log.read_text(errors="replace")
    assert "was written and let go" not in log, "a flushed session's tree was let go mid-call"
    assert not failed_runs, f"{len(failed_runs)} of {RUNS} runs failed ({elapsed:.0f} s):\n" + (
        "\n".join(failed_runs)
    )
