"""Issue 10 item 4 and 5 regressions, through the real proxy: bodies that once got a text/plain
500 (bad compression, deep nesting, lone surrogates, wrong types in nested fields) get the
provider's own 4xx error JSON; nothing of them is recorded; the model list is per session."""

from __future__ import annotations

import gzip
import json
import uuid
import zlib

import pytest

from tests.support.hostile import assert_provider_error, good_body, post
from tests.support.proxies import Proxy
from tests.support.stub_vllm import StubPolicy

NESTED = b'{"model": "gpt-4o", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
SURROGATE = b'{"model": "\\ud800", "messages": [{"role": "user", "content": "Hi"}]}'
ANTHROPIC_SURROGATE = (
    b'{"model": "claude-sonnet-4-5", "max_tokens": 8, '
    b'"messages": [{"role": "user", "content": "a\\udfffb"}]}'
)


def tool_use_turn(result_content: object) -> dict[str, object]:
    return {
        "model": "claude-sonnet-4-5",
        "max_tokens": 64,
        "messages": [
            {"role": "user", "content": "list files"},
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": "toolu_1", "name": "ls", "input": {}}],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": result_content}
                ],
            },
        ],
    }


# name -> (protocol, body bytes, extra headers)
CASES: dict[str, tuple[str, bytes, dict[str, str]]] = {
    "bad-gzip": ("openai.chat", b"\x1f\x8b\x08\x00garbage", {"Content-Encoding": "gzip"}),
    "bad-deflate": ("openai.chat", b"not deflate at all", {"Content-Encoding": "deflate"}),
    "bad-br": ("anthropic", b"\xff\xff\xff not brotli", {"Content-Encoding": "br"}),
    "truncated-gzip": (
        "openai.responses",
        gzip.compress(json.dumps(good_body("openai.responses")).encode())[:20],
        {"Content-Encoding": "gzip"},
    ),
    "unknown-encoding": ("openai.chat", b"{}", {"Content-Encoding": "snappy"}),
    "gzip-bomb": (
        "openai.chat",
        gzip.compress(b" " * (64 * 1024 * 1024)),
        {"Content-Encoding": "gzip"},
    ),
    "deep-nesting-chat": ("openai.chat", NESTED, {}),
    "deep-nesting-anthropic": ("anthropic", NESTED.replace(b"gpt-4o", b"claude"), {}),
    "deep-nesting-responses": ("openai.responses", NESTED.replace(b"messages", b"input"), {}),
    "surrogate-model": ("openai.chat", SURROGATE, {}),
    "surrogate-content-anthropic": ("anthropic", ANTHROPIC_SURROGATE, {}),
    "surrogate-responses": (
        "openai.responses",
        b'{"model": "gpt-5", "input": "\\ud83d", "store": false}',
        {},
    ),
    "tool-result-content-number": ("anthropic", json.dumps(tool_use_turn(42)).encode(), {}),
    "tool-result-content-object": (
        "anthropic",
        json.dumps(tool_use_turn({"type": "text"})).encode(),
        {},
    ),
    "input-schema-string": (
        "anthropic",
        json.dumps(
            {
                **good_body("anthropic"),
                "tools": [{"name": "ls", "description": "d", "input_schema": "object"}],
            }
        ).encode(),
        {},
    ),
    "json-schema-string": (
        "openai.chat",
        json.dumps(
            {
                **good_body("openai.chat"),
                "response_format": {"type": "json_schema", "json_schema": "x"},
            }
        ).encode(),
        {},
    ),
    "output-config-format-string": (
        "anthropic",
        json.dumps({**good_body("anthropic"), "output_config": {"format": "json"}}).encode(),
        {},
    ),
    "streamed-tool-result-content-number": (
        "anthropic",
        json.dumps({**tool_use_turn(42), "stream": True}).encode(),
        {},
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_hostile_body_gets_the_providers_4xx(stub_proxy: Proxy, name: str) -> None:
    protocol, body, headers = CASES[name]
    session = f"hostile-{name}-{uuid.uuid4().hex[:6]}"
    answer = post(stub_proxy, session, protocol, body, headers)
    assert 400 <= answer.status < 500, (answer.status, answer.body[:300])
    assert_provider_error(protocol, answer)
    assert stub_proxy.turns(session, expect=0) == []


def test_compressed_bodies_are_read(stub_proxy: Proxy, stub: StubPolicy) -> None:
    """A good gzip or deflate body is answered."""
    raw = json.dumps(good_body("openai.chat")).encode()
    for coding, data in [
        ("gzip", gzip.compress(raw)),
        ("deflate", zlib.compress(raw)),
    ]:
        stub.script(f"fine-{coding}")
        answer = post(
            stub_proxy, f"compressed-{coding}", "openai.chat", data, {"Content-Encoding": coding}
        )
        assert answer.status == 200, answer.body[:300]
        assert json.loads(answer.body)["choices"][0]["message"]["content"] == f"fine-{coding}"


def test_paired_surrogates_are_text(stub_proxy: Proxy, stub: StubPolicy) -> None:
    """An emoji written as a JSON surrogate pair is ordinary text, not refused."""
    stub.script("nice")
    body = b'{"model": "gpt-4o", "messages": [{"role": "user", "content": "\\ud83d\\ude00"}]}'
    answer = post(stub_proxy, f"emoji-{uuid.uuid4().hex[:6]}", "openai.chat", body)
    assert answer.status == 200, answer.body[:300]


def test_models_list_shows_only_the_askers_own_names(stub_proxy: Proxy, stub: StubPolicy) -> None:
    """GET /v1/models must not leak other sessions' model names, and the memory behind it is
    bounded per session."""
    import base64
    import http.client
    import ssl

    secret = f"secret-model-{uuid.uuid4().hex[:8]}"
    stub.script("a")
    answer = post(
        stub_proxy,
        "models-a",
        "openai.chat",
        json.dumps({"model": secret, "messages": [{"role": "user", "content": "Hi"}]}).encode(),
    )
    assert answer.status == 200, answer.body[:300]

    def listed(session: str) -> list[str]:
        ctx = ssl.create_default_context(cafile=str(stub_proxy.ca))
        conn = http.client.HTTPSConnection("127.0.0.1", stub_proxy.port, context=ctx, timeout=30)
        auth = base64.b64encode(f"{session}:x".encode()).decode()
        conn.set_tunnel("api.openai.com", 443, headers={"Proxy-Authorization": f"Basic {auth}"})
        conn.request("GET", "/v1/models", headers={"Authorization": "Bearer sk-x"})
        resp = conn.getresponse()
        data = json.loads(resp.read())
        conn.close()
        return [m["id"] for m in data["data"]]

    assert secret in listed("models-a")
    assert secret not in listed("models-b")
