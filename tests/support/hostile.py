"""Raw HTTPS through the real proxy for the hostile-input tests: exact bytes to a provider's host,
and checks that an answer is in that provider's own error format."""

from __future__ import annotations

import base64
import http.client
import json
import ssl
import threading
import uuid
from collections import Counter
from dataclasses import dataclass
from typing import Any

from tests.support.proxies import Proxy

# protocol -> (host, path)
ENDPOINTS = {
    "openai.chat": ("api.openai.com", "/v1/chat/completions"),
    "anthropic": ("api.anthropic.com", "/v1/messages"),
    "openai.responses": ("api.openai.com", "/v1/responses"),
    "gemini": (
        "generativelanguage.googleapis.com",
        "/v1beta/models/gemini-2.5-flash:generateContent",
    ),
}


@dataclass
class Answer:
    status: int
    content_type: str
    body: bytes


def post(
    proxy: Proxy,
    session: str,
    protocol: str,
    body: bytes,
    headers: dict[str, str] | None = None,
    timeout: float = 60,
    path: str | None = None,
) -> Answer:
    """POST exact bytes to the protocol's endpoint (or ``path`` on its host) through the proxy
    (CONNECT, then TLS trusting only the proxy's CA), as a client with its own HTTP stack
    would."""
    host, path = ENDPOINTS[protocol][0], path or ENDPOINTS[protocol][1]
    ctx = ssl.create_default_context(cafile=str(proxy.ca))
    conn = http.client.HTTPSConnection("127.0.0.1", proxy.port, context=ctx, timeout=timeout)
    auth = base64.b64encode(f"{session}:x".encode()).decode()
    conn.set_tunnel(host, 443, headers={"Proxy-Authorization": f"Basic {auth}"})
    sent = {"Content-Type": "application/json", "Authorization": "Bearer sk-hostile-test"}
    if protocol == "anthropic":
        sent.update({"x-api-key": "sk-ant-hostile-test", "anthropic-version": "2023-06-01"})
    if protocol == "gemini":
        sent["x-goog-api-key"] = "AIza-hostile-test"
    sent.update(headers or {})
    try:
        conn.request("POST", path, body=body, headers=sent)
        resp = conn.getresponse()
        return Answer(resp.status, resp.getheader("Content-Type") or "", resp.read())
    finally:
        conn.close()


def assert_provider_error(protocol: str, answer: Answer) -> dict[str, Any]:
    """The answer is an error in the provider's own JSON shape; its error object."""
    assert answer.content_type.startswith("application/json"), (answer.status, answer.body[:300])
    data = json.loads(answer.body)
    if protocol == "anthropic":
        assert data["type"] == "error", data
        err = data["error"]
        assert isinstance(err["type"], str) and isinstance(err["message"], str), data
    elif protocol == "gemini":
        # Google's: {"error": {"code": 400, "message": ..., "status": "INVALID_ARGUMENT"}}
        assert set(data) == {"error"}, data
        err = data["error"]
        assert err["code"] == answer.status and isinstance(err["status"], str), data
    else:
        assert set(data) == {"error"}, data
        err = data["error"]
        assert isinstance(err["message"], str) and isinstance(err["type"], str), data
    assert err["message"], data
    return dict(err)


def good_body(protocol: str, text: str = "Hi", stream: bool = False) -> dict[str, Any]:
    if protocol == "openai.chat":
        return {
            "model": "gpt-4o",
            "messages": [{"role": "user", "content": text}],
            "stream": stream,
        }
    if protocol == "anthropic":
        return {
            "model": "claude-sonnet-4-5",
            "max_tokens": 64,
            "messages": [{"role": "user", "content": text}],
            "stream": stream,
        }
    if protocol == "gemini":
        return {"contents": [{"role": "user", "parts": [{"text": text}]}]}
    return {"model": "gpt-5", "input": text, "stream": stream, "store": False}


def witness(proxy: Proxy, protocol: str) -> tuple[str, list[dict], list[dict]]:
    """A well-formed session recorded before the fuzzing: its rows must not change."""
    session = f"fuzz-witness-{protocol}-{uuid.uuid4().hex[:6]}"
    answer = post(proxy, session, protocol, json.dumps(good_body(protocol)).encode())
    assert answer.status == 200, answer.body[:300]
    return session, proxy.turns(session), proxy.threads(session)


class ParallelSession:
    """A well-formed session that keeps calling (alternately streamed and whole) while the fuzz
    runs on the same proxy: each of its calls must be answered and recorded whole."""

    def __init__(self, proxy: Proxy, protocol: str, most: int = 40) -> None:
        self.proxy, self.protocol, self.most = proxy, protocol, most
        self.session = f"fuzz-parallel-{protocol}-{uuid.uuid4().hex[:6]}"
        self.statuses: list[int] = []
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            while not self._stop.is_set() and len(self.statuses) < self.most:
                n = len(self.statuses)
                body = good_body(self.protocol, f"parallel question {n}", stream=n % 2 == 1)
                answer = post(self.proxy, self.session, self.protocol, json.dumps(body).encode())
                self.statuses.append(answer.status)
                if answer.status == 200 and answer.content_type.startswith("text/event-stream"):
                    assert answer.body.strip(), "a streamed 200 with an empty body"
                self._stop.wait(0.05)
        except BaseException as exc:  # reported by the test
            self.errors.append(exc)

    def __enter__(self) -> ParallelSession:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(120)

    def check(self) -> None:
        assert not self.errors, self.errors
        assert self.statuses and set(self.statuses) == {200}, Counter(self.statuses)
        turns = self.proxy.turns(self.session, expect=len(self.statuses))
        threads = self.proxy.threads(self.session, expect=len(self.statuses))
        # Each call a conversation of its own: one row each, training exactly that call.
        assert len(turns) == len(threads) == len(self.statuses)
        assert sorted(r for t in threads for r in t["trained_request_ids"]) == sorted(
            t["request_id"] for t in turns
        )
        print(
            f"parallel session {self.protocol}: {len(turns)} calls answered and recorded whole during the fuzz"
        )
        for row in threads:
            assert sum(row["loss_mask"]) == sum(
                len(t["completion_ids"])
                for t in turns
                if t["request_id"] in row["trained_request_ids"]
            )
