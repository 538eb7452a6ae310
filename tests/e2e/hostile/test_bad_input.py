"""Bad requests through the real proxy: each gets OpenAI's error JSON with a useful message,
reaches no policy, records nothing, and disturbs neither its own session nor anyone else's."""

from __future__ import annotations

import base64
import http.client
import json
import ssl
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import openai
import pytest

from tests.support.proxies import Proxy, read_turns
from tests.support.stub_vllm import StubPolicy

TEN_MB = 10 * 1024 * 1024
HI = [{"role": "user", "content": "Hi"}]


@dataclass
class Answer:
    status: int
    content_type: str
    body: bytes

    def error(self) -> dict[str, Any]:
        data = json.loads(self.body)
        assert set(data) == {"error"}, data
        return data["error"]


def raw_post(
    proxy: Proxy,
    session: str,
    body: bytes | Iterator[bytes],
    path: str = "/v1/chat/completions",
    headers: dict[str, str] | None = None,
) -> Answer:
    """POST exact bytes to https://api.openai.com through the proxy (CONNECT, then TLS trusting
    only the proxy's CA), as a client with its own HTTP stack would."""
    ctx = ssl.create_default_context(cafile=str(proxy.ca))
    conn = http.client.HTTPSConnection("127.0.0.1", proxy.port, context=ctx, timeout=60)
    auth = base64.b64encode(f"{session}:x".encode()).decode()
    conn.set_tunnel("api.openai.com", 443, headers={"Proxy-Authorization": f"Basic {auth}"})
    sent = {"Content-Type": "application/json", "Authorization": "Bearer sk-bad-input-test"}
    sent.update(headers or {})
    try:
        conn.request(
            "POST", path, body=body, headers=sent, encode_chunked=not isinstance(body, bytes)
        )
        resp = conn.getresponse()
        return Answer(resp.status, resp.getheader("Content-Type") or "", resp.read())
    finally:
        conn.close()


def chunks(data: bytes, size: int = 1 << 16) -> Iterator[bytes]:
    for i in range(0, len(data), size):
        yield data[i : i + size]


def body_of(obj: Any) -> bytes:
    return json.dumps(obj).encode()


BIG = body_of({"model": "gpt-4o", "messages": [{"role": "user", "content": "x" * TEN_MB}]})


@dataclass
class Case:
    """A bad request: how it is sent, what the client must be told."""

    status: int
    # Each must appear in the error message (case-insensitive): it says what is wrong.
    words: tuple[str, ...]
    param: str | None = None
    raw: bytes | None = None  # sent as exact bytes (http.client)
    chunked: bool = False
    sdk: dict[str, Any] = field(default_factory=dict)  # sent with the openai SDK


CASES: dict[str, Case] = {
    "malformed-json": Case(400, ("json", "parse"), raw=b'{"model": "gpt-4o", "messages": ['),
    "not-utf8": Case(
        400,
        ("json", "utf-8"),
        raw=b'{"model": "gpt-4o", "messages": [{"role": "user", "content": "\xff\xfe"}]}',
    ),
    "not-an-object": Case(400, ("json object",), raw=b'[{"role": "user", "content": "Hi"}]'),
    "missing-messages": Case(400, ("missing", "messages"), "messages", sdk={"model": "gpt-4o"}),
    "missing-messages-streamed": Case(
        400, ("missing", "messages"), "messages", sdk={"model": "gpt-4o", "stream": True}
    ),
    "empty-messages": Case(
        400, ("messages", "at least 1"), "messages", sdk={"model": "gpt-4o", "messages": []}
    ),
    "unknown-role": Case(
        400,
        ("role", "wizard", "user", "assistant"),
        sdk={"model": "gpt-4o", "messages": [{"role": "wizard", "content": "Hi"}]},
    ),
    "tool-without-id": Case(
        400,
        ("tool_call_id",),
        sdk={"model": "gpt-4o", "messages": [*HI, {"role": "tool", "content": "42"}]},
    ),
    "ten-mb": Case(
        413,
        ("too large", "8388608"),
        sdk={"model": "gpt-4o", "messages": [{"role": "user", "content": "x" * TEN_MB}]},
    ),
    "ten-mb-chunked": Case(413, ("too large", "8388608"), raw=BIG, chunked=True),
}


def send_bad(proxy: Proxy, session: str, case: Case, monkeypatch: pytest.MonkeyPatch) -> Answer:
    if case.raw is not None:
        return raw_post(proxy, session, chunks(case.raw) if case.chunked else case.raw)
    client = proxy.openai(session, monkeypatch)
    expected = openai.BadRequestError if case.status == 400 else openai.APIStatusError
    with pytest.raises(expected) as info:
        client.post("/chat/completions", body=case.sdk, cast_to=object)
    exc = info.value
    assert exc.status_code == case.status
    # The SDK read OpenAI's error object: message, type, param, code.
    assert isinstance(exc.body, dict) and exc.body["message"] in exc.message
    assert exc.type == "invalid_request_error"
    return Answer(
        exc.status_code, exc.response.headers.get("content-type", ""), exc.response.content
    )


def good_call(proxy: Proxy, session: str, monkeypatch: pytest.MonkeyPatch, expect: str) -> Any:
    client = proxy.openai(session, monkeypatch)
    resp = client.chat.completions.create(model="gpt-4o", messages=HI, max_tokens=32)
    assert resp.choices[0].message.content == expect
    assert resp.choices[0].finish_reason == "stop"
    return resp


@pytest.mark.parametrize("name", list(CASES))
def test_bad_request_is_refused_cleanly(
    name: str, stub_proxy: Proxy, stub: StubPolicy, monkeypatch: pytest.MonkeyPatch
) -> None:
    case = CASES[name]
    keeper, other = f"bad-keeper-{name}", f"bad-other-{name}"
    stub.replies.clear()
    stub.script(f"First answer for {name}.", f"Second answer for {name}.", f"Other {name}.")

    first = good_call(stub_proxy, keeper, monkeypatch, f"First answer for {name}.")
    policy_calls = len(stub.requests)

    # The bad request, in the keeper's own session.
    answer = send_bad(stub_proxy, keeper, case, monkeypatch)
    assert answer.status == case.status, answer.body[:500]
    assert answer.content_type.startswith("application/json")
    error = answer.error()
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert isinstance(error["message"], str) and len(error["message"]) > 20
    for word in case.words:
        assert word.lower() in error["message"].lower(), (word, error["message"])
    if case.param is not None:
        assert error["param"] == case.param
    if name == "unknown-role":
        assert "role" in error["param"] and "0" in error["param"]
    assert len(stub.requests) == policy_calls, "a bad request must not reach the policy"

    # The same session goes on, and so does another one, through the same proxy.
    second = good_call(stub_proxy, keeper, monkeypatch, f"Second answer for {name}.")
    good_call(stub_proxy, other, monkeypatch, f"Other {name}.")
    assert stub_proxy.proc.poll() is None, "mitmdump died"

    # Exactly the good turns are in the shards: nothing lost, nothing added.
    rows = stub_proxy.turns(keeper, expect=2)
    assert [r["request_id"] for r in rows] == [first.id, second.id]
    assert [r["turn_index"] for r in rows] == [0, 1]
    assert [len(r["completion_ids"]) for r in rows] == [
        first.usage.completion_tokens,
        second.usage.completion_tokens,
    ]
    assert len(stub_proxy.turns(other, expect=1)) == 1
    stub_proxy.flush()  # every session: a stray turn would be written now
    assert len(read_turns(stub_proxy.out, keeper)) == 2
    assert len(read_turns(stub_proxy.out, other)) == 1
    journals = list((stub_proxy.out / "journal").glob(f"bad-keeper-{name}-*.jsonl"))
    assert not journals, journals


def test_bad_requests_leave_no_trace_in_the_log(
    stub_proxy: Proxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Refusals are answers, not crashes: no traceback in mitmdump's log, and the key sent
    with a refused request is not written anywhere."""
    answer = raw_post(
        stub_proxy,
        "bad-secret",
        b'{"model": "gpt-4o", "messages": [',
        headers={"Authorization": "Bearer sk-bad-secret-key"},
    )
    assert answer.status == 400
    log = stub_proxy.log.read_text(errors="replace")
    assert "Traceback" not in log
    assert "sk-bad-secret-key" not in log
    for path in stub_proxy.out.rglob("*"):
        if path.is_file():
            assert b"sk-bad-secret-key" not in path.read_bytes()


def test_unknown_path_is_a_404_in_openais_format(stub_proxy: Proxy) -> None:
    answer = raw_post(stub_proxy, "bad-path", body_of({"model": "gpt-4o"}), path="/v1/nonsense")
    assert answer.status == 404
    error = answer.error()
    assert set(error) == {"message", "type", "param", "code"}
    assert "/v1/nonsense" in error["message"] and "/v1/chat/completions" in error["message"]


def test_turn_index_keeps_counting_after_an_idle_flush(
    stub_proxy: Proxy, stub: StubPolicy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A scaffold that pauses longer than the idle timeout (a long tool run) and goes on under
    the same session: its turns must not share turn indices."""
    stub.replies.clear()
    stub.script("Before the pause.", "After the pause.")
    good_call(stub_proxy, "bad-pause", monkeypatch, "Before the pause.")
    assert len(stub_proxy.turns("bad-pause", expect=1)) == 1  # written, as after an idle pause
    good_call(stub_proxy, "bad-pause", monkeypatch, "After the pause.")
    rows = stub_proxy.turns("bad-pause", expect=2)
    assert len(rows) == 2
    assert sorted(r["turn_index"] for r in rows) == [0, 1]
