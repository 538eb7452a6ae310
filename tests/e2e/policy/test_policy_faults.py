"""Issue 14 item 4: faults of the policy are the client's errors, never silence.

A policy that sends garbage, cuts its stream short, or stalls while sending keep-alives makes the
client's call fail with its provider's error (a status before streaming, the provider's error
event mid-stream) within the policy timeout; the failed call is journaled and written to
``failed/``, never to a thread row, and the session's well-formed calls are kept. The faults come
from the scripted stub (``StubPolicy.fault``); the client talks HTTPS through a real mitmdump.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pyarrow.dataset as ds
import pytest
from aiohttp import web

from capture.storage.records import FailedCall
from capture.storage.sessions import SessionStore
from rewriter.canonical import ChatRequest, Message, SamplingParams
from rewriter.template import ChatTemplate
from rewriter.vllm_client import PolicyError, VLLMClient
from tests.support.hostile import Answer, assert_provider_error, good_body, post
from tests.support.proxies import Proxy, read_threads, read_turns, record_turn, start_proxy
from tests.support.stub_vllm import StubPolicy

POLICY_TIMEOUT_S = 1
REPLY = "One two three four five six seven."
FAULT_AFTER = 2  # chunks (one token each) the client gets before the fault

# A stream line's payload (or a whole body) that no vLLM sends.
GARBAGE = {
    "not-json": b"{not json",
    "not-an-object": b"[1, 2, 3]",
    "choices-not-a-list": b'{"choices": "yes"}',
    "choice-not-an-object": b'{"choices": [7]}',
    "ids-not-ints": b'{"choices": [{"text": "a", "token_ids": ["x"], "logprobs": {"token_logprobs": [-1.0]}}]}',
    "id-past-int32": b'{"choices": [{"text": "a", "token_ids": [4294967296], "logprobs": {"token_logprobs": [-1.0]}}]}',
    "logprob-not-a-number": b'{"choices": [{"text": "a", "token_ids": [5], "logprobs": {"token_logprobs": ["high"]}}]}',
    "text-not-text": b'{"choices": [{"text": 5, "token_ids": [5], "logprobs": {"token_logprobs": [-1.0]}}]}',
    "finish-not-text": b'{"choices": [{"text": "", "token_ids": [], "finish_reason": 1}]}',
}

GEMINI_STREAM = "/v1beta/models/gemini-2.5-flash:streamGenerateContent?alt=sse"
# protocol -> what its stream ends with on a failure (the provider's own error event)
ERROR_EVENT = {
    "openai.chat": b'"error"',
    "anthropic": b"event: error",
    "openai.responses": b"event: response.failed",
    "gemini": b'"error"',
}
# protocol -> what only a complete answer's stream holds
COMPLETED = {
    "openai.chat": b"data: [DONE]",
    "anthropic": b"message_stop",
    "openai.responses": b"response.completed",
    "gemini": b'"finishReason"',
}
# protocol -> (status for garbage, status for a policy that went away: retryable)
STATUSES = {
    "openai.chat": (502, 503),
    "anthropic": (500, 529),
    "openai.responses": (502, 503),
    "gemini": (500, 503),
}
PROTOCOLS = list(ERROR_EVENT)


@pytest.fixture(scope="module")
def proxy(
    stub: StubPolicy, confdir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Proxy]:
    out = tmp_path_factory.mktemp("faulty-policy") / "out"
    proxy = start_proxy(
        stub.url, out, confdir, extra=["--set", f"agenttap_policy_timeout={POLICY_TIMEOUT_S}"]
    )
    yield proxy
    proxy.stop()


@pytest.fixture
def faulty(stub: StubPolicy) -> Iterator[StubPolicy]:
    stub.replies.clear()
    stub.default_reply = REPLY
    try:
        yield stub
    finally:
        stub.fault, stub.fault_after, stub.garbage = None, 0, b"{not json"
        stub.default_reply = "OK."


def call(proxy: Proxy, session: str, protocol: str, stream: bool, text: str = "Hi") -> Answer:
    body = json.dumps(good_body(protocol, text, stream=stream)).encode()
    path = GEMINI_STREAM if protocol == "gemini" and stream else None
    return post(proxy, session, protocol, body, timeout=60, path=path)


def read_failed(out: Path, session: str) -> list[dict[str, Any]]:
    folder = out / "failed"
    if not folder.exists() or not any(folder.glob("*.parquet")):
        return []
    rows = ds.dataset(str(folder), format="parquet").to_table().to_pylist()
    return [r for r in rows if r["session_id"] == session]


def assert_failed_answer(protocol: str, stream: bool, answer: Answer, statuses: set[int]) -> bytes:
    """The client got its provider's error: before streaming a status in ``statuses`` with the
    provider's JSON; once streaming, the provider's error event and no sign of completion."""
    if stream and answer.status == 200:
        assert answer.content_type.startswith("text/event-stream"), answer.content_type
        assert ERROR_EVENT[protocol] in answer.body, answer.body[-600:]
        assert COMPLETED[protocol] not in answer.body, answer.body[-600:]
        return answer.body
    assert answer.status in statuses, (answer.status, answer.body[:400])
    return assert_provider_error(protocol, answer)["message"].encode()


def assert_only_good_call_trained(proxy: Proxy, session: str, good_text: str) -> list[dict]:
    """After a flush: the one well-formed call is a turn row and trained in a thread row; the
    failed call is a row of ``failed/`` only. Returns the failed rows."""
    proxy.flush(session)
    turns = read_turns(proxy.out, session)
    assert [t["completion_text"] for t in turns] == [good_text], turns
    threads = read_threads(proxy.out, session)
    trained = [r for row in threads for r in row["trained_request_ids"]]
    assert trained == [turns[0]["request_id"]], threads
    failed = read_failed(proxy.out, session)
    assert len(failed) == 1, failed
    assert failed[0]["request_id"] not in trained
    return failed


# -- through the real proxy ------------------------------------------------------------------
@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
@pytest.mark.parametrize("fault", ["garbage", "truncate"])
@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_broken_policy_answer_is_the_clients_error_and_recorded_as_failed(
    proxy: Proxy, faulty: StubPolicy, protocol: str, fault: str, stream: bool
) -> None:
    session = f"fault-{protocol}-{fault}-{stream}-{uuid.uuid4().hex[:6]}"
    good = call(proxy, session, protocol, stream)
    assert good.status == 200, good.body[:400]
    faulty.fault, faulty.fault_after = fault, FAULT_AFTER
    answer = call(proxy, session, protocol, stream, text="And then?")
    garbage_status, gone_status = STATUSES[protocol]
    # A whole body cut short is not JSON: garbage. A stream cut short: the policy went away.
    expected = garbage_status if fault == "garbage" or not stream else gone_status
    said = assert_failed_answer(protocol, stream, answer, {expected})
    if stream:
        assert answer.status == 200  # the fault came after the first tokens went out
    assert (b"not JSON" if expected == garbage_status else b"ended its stream") in said
    failed = assert_only_good_call_trained(proxy, session, REPLY)
    row = failed[0]
    assert row["protocol"] == {
        "anthropic": "anthropic.messages",
        "gemini": "gemini.generate_content",
    }.get(protocol, protocol)
    assert row["stream"] is stream and row["prompt_tokens"] > 0
    assert row["completion_tokens"] == (FAULT_AFTER if stream else 0)
    assert row["policy_status"] == (502 if expected == garbage_status else 0)
    assert ("not JSON" if expected == garbage_status else "ended its stream") in row["reason"]


@pytest.mark.parametrize("name", list(GARBAGE))
def test_every_kind_of_garbage_ends_the_stream_with_an_error_event(
    proxy: Proxy, faulty: StubPolicy, name: str
) -> None:
    session = f"garbage-{name}-{uuid.uuid4().hex[:6]}"
    assert call(proxy, session, "openai.chat", True).status == 200
    faulty.fault, faulty.fault_after, faulty.garbage = "garbage", FAULT_AFTER, GARBAGE[name]
    answer = call(proxy, session, "openai.chat", True, text="And then?")
    assert answer.status == 200
    events = [
        json.loads(line[6:]) for line in answer.body.split(b"\n\n") if line.startswith(b"data: {")
    ]
    assert "error" in events[-1], events[-1]
    assert "the policy server sent" in events[-1]["error"]["message"]
    assert_only_good_call_trained(proxy, session, REPLY)


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_keep_alives_do_not_defeat_the_policy_timeout(
    proxy: Proxy, faulty: StubPolicy, protocol: str, stream: bool
) -> None:
    """The policy sends keep-alives forever (blank lines, ': ping', chunks with no token; a whole
    body's leading whitespace): the client gets its provider's retryable error once no token
    came for agenttap_policy_timeout, however many bytes arrived."""
    session = f"alive-{protocol}-{stream}-{uuid.uuid4().hex[:6]}"
    faulty.fault, faulty.fault_after = "keepalive", 1 if stream else 0
    began = time.monotonic()
    answer = call(proxy, session, protocol, stream)
    waited = time.monotonic() - began
    said = assert_failed_answer(protocol, stream, answer, {STATUSES[protocol][1]})
    assert b"did not answer in time" in said
    # One token, then a timeout's worth of keep-alives: bounded by the timeout, with slack for
    # a loaded machine (the stub would go on for two minutes).
    assert waited < POLICY_TIMEOUT_S + 4, f"the client waited {waited:.1f}s"
    proxy.flush(session)
    assert read_turns(proxy.out, session) == []
    failed = read_failed(proxy.out, session)
    assert [r["completion_tokens"] for r in failed] == [1 if stream else 0]


def test_keep_alives_before_the_first_token_are_a_retryable_status(
    proxy: Proxy, faulty: StubPolicy
) -> None:
    session = f"alive-first-{uuid.uuid4().hex[:6]}"
    faulty.fault, faulty.fault_after = "keepalive", 0
    answer = call(proxy, session, "anthropic", True)
    assert answer.status == 529, answer.body[:300]
    assert "did not answer in time" in assert_provider_error("anthropic", answer)["message"]


def test_a_slow_policy_that_keeps_sampling_is_not_cut_off(proxy: Proxy, faulty: StubPolicy) -> None:
    """The timeout bounds the time between tokens, not the whole generation: a stream that
    takes several timeouts in all, a token every 0.3 s, completes and is trained."""
    session = f"slow-{uuid.uuid4().hex[:6]}"
    faulty.chunk_delay_s = 0.3
    try:
        began = time.monotonic()
        answer = call(proxy, session, "openai.chat", True)
        took = time.monotonic() - began
    finally:
        faulty.chunk_delay_s = 0.0
    assert answer.status == 200 and b"[DONE]" in answer.body, answer.body[-300:]
    assert took > 2 * POLICY_TIMEOUT_S, took
    proxy.flush(session)
    assert [t["completion_text"] for t in read_turns(proxy.out, session)] == [REPLY]


# -- the client alone --------------------------------------------------------------------------
async def test_a_long_prompts_echo_is_read_and_garbage_as_long_is_not(stub: StubPolicy) -> None:
    """vLLM echoes a prompt's ids in a stream's first chunk: for 30,000 ids that line is about
    200 kB, past the 128 KiB a stream line was once held to (a long agent session's every
    streamed call failed with a 502). The limit grows with the prompt; a line past it is still
    refused, and the same garbage fits no longer once the prompt is short."""
    from rewriter.vllm_stream import stream_line_limit

    prompt = [100_000 + i % 50_000 for i in range(30_000)]
    params = SamplingParams(max_tokens=8)
    async with aiohttp.ClientSession() as http:
        client = VLLMClient(stub.url, http, progress_timeout_s=30)
        pieces = [d async for d in client.stream_resuming(prompt, params)]
        assert sum(len(d.token_ids) for d in pieces) > 0
        assert pieces[-1].finish_reason in ("stop", "length")
        short = [1, 2, 3]
        stub.fault, stub.fault_after = "garbage", 1
        stub.garbage = b'{"choices": [{"text": "' + b"x" * stream_line_limit(len(short)) + b'"}]}'
        try:
            with pytest.raises(PolicyError, match="over-long line") as err:
                async for _ in client.stream_resuming(short, params):
                    pass
            assert err.value.status == 502
            # The same line fits a long prompt's limit: then it is read (and found wanting).
            with pytest.raises(PolicyError) as err:
                async for _ in client.stream_resuming(prompt, params):
                    pass
            assert "over-long line" not in str(err.value)
        finally:
            stub.fault = None


async def test_the_client_raises_policy_error_for_every_garbage_and_cut(stub: StubPolicy) -> None:
    async with aiohttp.ClientSession() as http:
        client = VLLMClient(stub.url, http, progress_timeout_s=5)
        prompt, params = [1, 2, 3], SamplingParams(max_tokens=32)
        try:
            for stream in (True, False):
                stub.fault, stub.fault_after = "garbage", 1
                for payload in GARBAGE.values():
                    stub.garbage = payload
                    with pytest.raises(PolicyError) as err:
                        async for _ in client.stream_resuming(prompt, params, stream=stream):
                            pass
                    assert err.value.status == 502 and "the policy server sent" in str(err.value)
                stub.fault = "truncate"
                with pytest.raises(PolicyError) as err:
                    async for _ in client.stream_resuming(prompt, params, stream=stream):
                        pass
                assert err.value.status == (0 if stream else 502)
            stub.fault = None
            whole = await client.complete(prompt, params)
            assert whole.finish_reason == "stop" and whole.token_ids
        finally:
            stub.fault, stub.fault_after, stub.garbage = None, 0, b"{not json"


class CountingPolicy:
    """/v1/models and the generate probe, counted; the first ``failures`` model listings
    answer 500; every answer takes a moment, so concurrent callers overlap."""

    def __init__(self, failures: int = 0) -> None:
        self.models = 0
        self.generate = 0
        self.failures = failures

    async def list_models(self, request: web.Request) -> web.Response:
        self.models += 1
        await asyncio.sleep(0.2)
        if self.models <= self.failures:
            return web.json_response({"error": {"message": "starting"}}, status=500)
        return web.json_response({"data": [{"id": "m", "max_model_len": 100}]})

    async def probe_generate(self, request: web.Request) -> web.Response:
        self.generate += 1
        await asyncio.sleep(0.2)
        return web.json_response({"error": {"message": "no"}}, status=404)


async def _serve(policy: CountingPolicy) -> tuple[web.AppRunner, str]:
    app = web.Application()
    app.router.add_get("/v1/models", policy.list_models)
    app.router.add_post("/inference/v1/generate", policy.probe_generate)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


async def test_concurrent_first_calls_probe_the_policy_once() -> None:
    policy = CountingPolicy()
    runner, url = await _serve(policy)
    try:
        async with aiohttp.ClientSession() as http:
            client = VLLMClient(url, http)
            infos = await asyncio.gather(*(client.info() for _ in range(50)))
            assert {i.model for i in infos} == {"m"}
            assert (policy.models, policy.generate) == (1, 1)
            await client.info()  # remembered
            assert (policy.models, policy.generate) == (1, 1)
    finally:
        await runner.cleanup()


async def test_a_failed_probe_is_not_remembered_and_a_cancelled_caller_does_not_cancel_it() -> None:
    policy = CountingPolicy(failures=1)
    runner, url = await _serve(policy)
    try:
        async with aiohttp.ClientSession() as http:
            client = VLLMClient(url, http)
            results = await asyncio.gather(
                *(client.info() for _ in range(10)), return_exceptions=True
            )
            assert all(isinstance(r, PolicyError) and r.status == 500 for r in results), results
            assert policy.models == 1
            # The next call probes again. One of its callers leaves; the others still get it.
            leaving = asyncio.ensure_future(client.info())
            staying = asyncio.ensure_future(client.info())
            await asyncio.sleep(0.05)
            leaving.cancel()
            assert (await staying).model == "m"
            assert leaving.cancelled() and policy.models == 2 and policy.generate == 1
    finally:
        await runner.cleanup()


# -- journal and recovery --------------------------------------------------------------------
def _failure(session: str, request_id: str) -> FailedCall:
    return FailedCall(
        session_id=session, request_id=request_id, protocol="openai.chat", requested_model="m",
        policy_model="p", backend="b", user_agent="ua", stream=True,
        reason="the policy server sent a stream line that is not JSON", policy_status=502,
        prompt_tokens=12, completion_tokens=3, started_at=1.0, failed_at=2.0,
    )  # fmt: skip


def test_a_failed_call_survives_a_crash_and_stays_out_of_the_threads(
    qwen3_dir: Path, tmp_path: Path
) -> None:
    template = ChatTemplate(qwen3_dir)
    store = SessionStore(tmp_path, template)
    msgs = [Message("user", "q0")]
    ids = template.encode("answer 0") + [template.eos_token_id]
    record_turn(store, "s", ChatRequest(messages=list(msgs), model="m"), ids, 0)
    store.record_failure(_failure("s", "r-failed"))
    assert store.failed_calls("s") == 1
    # A session that only failed is written too; then the crash: journals left behind.
    store.record_failure(_failure("only-failed", "r-f2"))
    assert len(list((tmp_path / "journal").glob("*.jsonl"))) == 2
    recovered = SessionStore(tmp_path, template).recover()
    assert not list((tmp_path / "journal").glob("*.jsonl"))
    assert sorted(p.parent.name for p in recovered) == ["failed", "failed", "threads", "turns"]
    assert [t["request_id"] for t in read_turns(tmp_path)] == ["r0"]
    assert [r["trained_request_ids"] for r in read_threads(tmp_path)] == [["r0"]]
    failed = {r["request_id"]: r for s in ("s", "only-failed") for r in read_failed(tmp_path, s)}
    assert set(failed) == {"r-failed", "r-f2"}
    assert failed["r-failed"]["completion_tokens"] == 3
    assert failed["r-failed"]["policy_status"] == 502
