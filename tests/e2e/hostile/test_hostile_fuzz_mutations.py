"""Fuzzed requests per protocol through the real proxy and the stub policy (issue 10): whatever
the body, no 5xx, every error in the provider's own JSON shape, a 200 is a real answer (never an
empty stream), the proxy stays up, a well-formed session recorded before it keeps its shards
unchanged, and a well-formed session calling while the fuzz runs is answered and recorded whole.

Bounded for CI: MAX_EXAMPLES per protocol (~40 s each on a shared 2-core box); under CI the
examples are derandomized (a fixed set). Counts by status are printed by the last test."""

from __future__ import annotations

import copy
import json
import os
import uuid
from collections import Counter
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.fuzzing import encoded, paths, replaced
from tests.support.hostile import ParallelSession, assert_provider_error, good_body, post, witness
from tests.support.proxies import Proxy

MAX_EXAMPLES = int(os.environ.get("AGENTTAP_FUZZ_EXAMPLES", "300"))
COUNTS: Counter[str] = Counter()  # printed by test_zz_report_mutation_counts

TOOL = {"name": "ls", "description": "list files"}
SCHEMA = {"type": "object", "properties": {"path": {"type": "string"}}}

# Rich, valid bodies: every field a mutation may hit is present.
SEEDS: dict[str, dict[str, Any]] = {
    "openai.chat": {
        "model": "gpt-4o",
        "max_tokens": 32,
        "temperature": 0.5,
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "list files"}]},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "ls", "arguments": '{"path": "."}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "a.txt"},
        ],
        "tools": [{"type": "function", "function": {**TOOL, "parameters": SCHEMA}}],
        "tool_choice": "auto",
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}},
        "stream_options": {"include_usage": True},
    },
    "anthropic": {
        "model": "claude-sonnet-4-5",
        "max_tokens": 32,
        "system": [{"type": "text", "text": "be brief"}],
        "messages": [
            {"role": "user", "content": "list files"},
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "ok"},
                    {"type": "tool_use", "id": "toolu_1", "name": "ls", "input": {"path": "."}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_1",
                        "content": [{"type": "text", "text": "a.txt"}],
                    }
                ],
            },
        ],
        "tools": [{**TOOL, "input_schema": SCHEMA}],
        "tool_choice": {"type": "auto"},
        "thinking": {"type": "enabled", "budget_tokens": 1024},
        "output_config": {"format": {"type": "json_schema", "schema": SCHEMA}},
        "metadata": {"user_id": "u"},
    },
    "openai.responses": {
        "model": "gpt-5",
        "store": False,
        "instructions": "be brief",
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "list files"}]},
            {
                "type": "function_call",
                "call_id": "call_1",
                "name": "ls",
                "arguments": '{"path": "."}',
            },
            {"type": "function_call_output", "call_id": "call_1", "output": "a.txt"},
        ],
        "tools": [{"type": "function", **TOOL, "parameters": SCHEMA}],
        "tool_choice": "auto",
        "reasoning": {"effort": "low"},
        "text": {"format": {"type": "json_schema", "name": "x", "schema": SCHEMA}},
        "max_output_tokens": 32,
    },
    "gemini": {
        "systemInstruction": {"parts": [{"text": "be brief"}]},
        "contents": [
            {"role": "user", "parts": [{"text": "list files"}]},
            {
                "role": "model",
                "parts": [
                    {
                        "functionCall": {"name": "ls", "args": {"path": "."}},
                        "thoughtSignature": "c2ln",
                    }
                ],
            },
            {
                "role": "user",
                "parts": [{"functionResponse": {"name": "ls", "response": {"output": "a.txt"}}}],
            },
        ],
        "tools": [{"functionDeclarations": [{**TOOL, "parameters": SCHEMA}]}],
        "toolConfig": {"functionCallingConfig": {"mode": "AUTO"}},
        "generationConfig": {
            "temperature": 0.5,
            "maxOutputTokens": 32,
            "thinkingConfig": {"thinkingBudget": 128},
            "responseMimeType": "application/json",
            "responseSchema": {"type": "OBJECT", "properties": {"path": {"type": "STRING"}}},
        },
    },
}

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=12)
    | st.sampled_from(["", "\u0000", "text", "tool_use", "function", "user", "assistant", "auto"])
)
json_values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)


@st.composite
def bodies(draw: st.DrawFn, protocol: str) -> tuple[bytes, dict[str, str]]:
    """One fuzzed request: a seed with one node replaced, or mangled bytes, maybe compressed
    (or claiming a compression it does not have)."""
    seed = SEEDS[protocol]
    kind = draw(st.sampled_from(["replace", "replace", "drop", "bytes", "truncate"]))
    body: Any = copy.deepcopy(seed)
    if protocol != "gemini":  # Gemini streams by URL, not by a body field
        body["stream"] = draw(st.booleans())
    if kind == "replace":
        path = draw(st.sampled_from(paths(body)))
        body = replaced(body, path, draw(json_values))
    elif kind == "drop":
        path = draw(st.sampled_from([p for p in paths(body) if p]))
        node = body
        for key in path[:-1]:
            node = node[key]
        node.pop(path[-1])  # a dict key or a list index: either way that part is missing
    if kind == "bytes":
        data = draw(st.binary(max_size=64))
    else:
        data = json.dumps(body).encode()
        if kind == "truncate":
            data = data[: draw(st.integers(min_value=0, max_value=len(data)))]
    coding = draw(st.sampled_from(["", "", "", "gzip", "deflate", "br", "lies"]))
    headers: dict[str, str] = {}
    if coding == "lies":
        headers["Content-Encoding"] = draw(st.sampled_from(["gzip", "deflate", "br", "zstd"]))
    elif coding:
        data = encoded(data, coding)
        headers["Content-Encoding"] = coding
    return data, headers


def check_answer(
    protocol: str, body: bytes, headers: dict[str, str], status: int, answer: Any
) -> None:
    assert status < 500, (status, body[:200], answer.body[:300])
    if status >= 400:
        assert_provider_error(protocol, answer)
    elif answer.content_type.startswith("text/event-stream"):
        assert answer.body.strip(), "a streamed 200 with an empty body"
    else:
        json.loads(answer.body)


@pytest.mark.parametrize("protocol", list(SEEDS))
def test_fuzzed_requests(stub_proxy: Proxy, protocol: str) -> None:
    session, turns, threads = witness(stub_proxy, protocol)
    fuzz_session = f"fuzz-{protocol}-{uuid.uuid4().hex[:6]}"
    parallel = ParallelSession(stub_proxy, protocol)

    @settings(
        max_examples=MAX_EXAMPLES,
        deadline=None,
        derandomize=bool(os.environ.get("CI")),
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(request=bodies(protocol))
    def fuzz(request: tuple[bytes, dict[str, str]]) -> None:
        data, headers = request
        answer = post(stub_proxy, fuzz_session, protocol, data, headers)
        COUNTS[f"{protocol} {answer.status}"] += 1
        check_answer(protocol, data, headers, answer.status, answer)

    with parallel:
        fuzz()
    assert stub_proxy.proc.poll() is None, "the proxy died"
    parallel.check()
    # The well-formed session is untouched, and the proxy still serves it.
    assert stub_proxy.turns(session) == turns
    assert stub_proxy.threads(session) == threads
    again = post(stub_proxy, session, protocol, json.dumps(good_body(protocol, "again")).encode())
    assert again.status == 200, again.body[:300]


def test_zz_report_mutation_counts() -> None:
    """The closing note's numbers: fuzzed requests by protocol and status."""
    assert COUNTS, "no fuzzed request ran"
    for key, n in sorted(COUNTS.items()):
        print(f"mutation fuzz {key}: {n}")
    assert not [k for k in COUNTS if int(k.rsplit(" ", 1)[1]) >= 500]
