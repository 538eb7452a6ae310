"""Fuzzed requests for every provider, through a real proxy: the strategies, the senders and the
checks shared by the CI fuzz tests (``tests/e2e/hostile/test_hostile_fuzz.py``, a bounded number of examples)
and ``bench/fuzz.py`` (10,000 and more per provider).

Each provider's strategy starts from a rich, valid request of its own shape (``SEEDS``) and breaks
it the ways a hostile or buggy client would: a node replaced by a value of another type, an
extreme number written as JSON text (``1e999``, ``NaN``, ``-0``, ``2**70``, thousands of digits),
lone surrogates, deep nesting, huge strings and lists, unknown fields, repeated keys, a part
dropped, the bytes truncated, mangled or in another encoding, a ``Content-Encoding`` that is
honest, lying or unknown, odd headers and session names. The Responses API's WebSocket mode gets
sequences of such messages, text and binary, on one connection.

What must hold for every answer (``check_http`` / ``check_websocket``): no status of 500 or
more; every error in the provider's own JSON shape; a 200 is a real answer (JSON, or a
non-empty event stream); a WebSocket answers each message with events, an error event among
them for a refusal, or closes with 1007 / 1008 / 1009, never 1002 / 1011 / an abnormal close.
"""

from __future__ import annotations

import asyncio
import base64
import copy
import gzip
import http.client
import json
import math
import ssl
import zlib
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import aiohttp
import brotli
from hypothesis import HealthCheck, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

from tests.support.hostile import Answer, assert_provider_error


class Endpoint(Protocol):
    """Where a running proxy listens and the CA it signs with (a ``tests.support.proxies.Proxy``)."""

    port: int
    ca: Path


GEMINI_MODEL = "/v1beta/models/gemini-2.5-flash"

# Provider -> (host, [(path, weight)]): every model route a provider serves, count routes too.
ROUTES: dict[str, tuple[str, list[str]]] = {
    "openai.chat": ("api.openai.com", ["/v1/chat/completions"]),
    "openai.responses": ("api.openai.com", ["/v1/responses", "/v1/responses/input_tokens"]),
    "anthropic": ("api.anthropic.com", ["/v1/messages", "/v1/messages/count_tokens"]),
    "gemini": (
        "generativelanguage.googleapis.com",
        [
            f"{GEMINI_MODEL}:generateContent",
            f"{GEMINI_MODEL}:streamGenerateContent?alt=sse",
            f"{GEMINI_MODEL}:countTokens",
        ],
    ),
}
PROVIDERS = list(ROUTES)
WEBSOCKET = "openai.responses.websocket"

TOOL = {"name": "ls", "description": "list files"}
SCHEMA = {"type": "object", "properties": {"path": {"type": "string"}}}

# Rich, valid bodies: every field a mutation may hit is present.
SEEDS: dict[str, dict[str, Any]] = {
    "openai.chat": {
        "model": "gpt-4o",
        "max_tokens": 32,
        "max_completion_tokens": 32,
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 20,
        "min_tokens": 1,
        "seed": 7,
        "n": 1,
        "stop": ["\n\n"],
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
        "chat_template_kwargs": {"enable_thinking": False},
    },
    "anthropic": {
        "model": "claude-sonnet-4-5",
        "max_tokens": 32,
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 20,
        "stop_sequences": ["\n\n"],
        "system": [{"type": "text", "text": "be brief", "cache_control": {"type": "ephemeral"}}],
        "messages": [
            {"role": "user", "content": "list files"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "hm", "signature": "c2ln"},
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
        "temperature": 0.5,
        "top_p": 0.9,
        "metadata": {"k": "v"},
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
            "topP": 0.9,
            "topK": 20,
            "seed": 7,
            "candidateCount": 1,
            "maxOutputTokens": 32,
            "stopSequences": ["\n\n"],
            "thinkingConfig": {"thinkingBudget": 128, "includeThoughts": True},
            "responseMimeType": "application/json",
            "responseSchema": {"type": "OBJECT", "properties": {"path": {"type": "STRING"}}},
        },
    },
}
SEEDS[WEBSOCKET] = SEEDS["openai.responses"]

# Every number a provider reads, as a path in its seed: each gets the extreme numbers.
NUMBERS: dict[str, list[tuple[Any, ...]]] = {
    "openai.chat": [
        ("max_tokens",),
        ("max_completion_tokens",),
        ("temperature",),
        ("top_p",),
        ("top_k",),
        ("min_tokens",),
        ("seed",),
        ("n",),
    ],
    "anthropic": [
        ("max_tokens",),
        ("temperature",),
        ("top_p",),
        ("top_k",),
        ("thinking", "budget_tokens"),
    ],
    "openai.responses": [("max_output_tokens",), ("temperature",), ("top_p",)],
    "gemini": [
        ("generationConfig", "temperature"),
        ("generationConfig", "topP"),
        ("generationConfig", "topK"),
        ("generationConfig", "seed"),
        ("generationConfig", "candidateCount"),
        ("generationConfig", "maxOutputTokens"),
        ("generationConfig", "thinkingConfig", "thinkingBudget"),
    ],
}
NUMBERS[WEBSOCKET] = NUMBERS["openai.responses"]


class Raw(str):
    """JSON text written into a body as it is (numbers Python would not write, nesting)."""


# Numbers as a client may write them: past a float's range, not finite, past 64 bits, negative
# zero, thousands of digits, and the edges of what is fine.
NON_FINITE = ["1e999", "-1e999", "NaN", "Infinity", "-Infinity"]
HUGE_INTEGERS = [str(2**70), str(-(2**70)), str(2**63), str(-(2**63) - 1), "1" * 5000]
EDGE_NUMBERS = [
    "-0",
    "-0.0",
    "0",
    "1e-999",
    "1e308",
    "-1e308",
    str(2**63 - 1),
    str(-(2**63)),
    str(2**31),
    str(-(2**31) - 1),
    "0.5",
    "1.0",
    "-1",
    "2",
    "1E+2",
]
extreme_numbers = st.sampled_from(NON_FINITE + HUGE_INTEGERS + EDGE_NUMBERS).map(Raw)

SURROGATES = ["\ud800", "a\udfffb", "\udbff", "\ud83d", "\ude00x"]
odd_text = st.sampled_from(
    [*SURROGATES, "", "\x00", "\u202e", "a\u2028b\u2029c\x85", "💥" * 5, "<|im_end|>", "\ufeff"]
)
texts = st.text(max_size=16) | odd_text
scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**80), max_value=2**80)
    | st.floats()
    | texts
    | extreme_numbers
    | st.sampled_from(["text", "tool_use", "function", "user", "assistant", "model", "auto"])
)
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(texts, inner, max_size=3),
    max_leaves=8,
)


def nesting(depth: int, kind: str) -> Raw:
    if kind == "list":
        return Raw("[" * depth + "]" * depth)
    return Raw('{"a":' * depth + "1" + "}" * depth)


deep = st.builds(
    nesting,
    st.sampled_from([50, 99, 100, 101, 500, 1_000, 5_000, 100_000]),
    st.sampled_from(["list", "dict"]),
)
huge = st.one_of(
    st.sampled_from([1_000, 70_000, 300_000]).map(lambda n: "x" * n),
    st.sampled_from([1_000, 20_000]).map(lambda n: ["x"] * n),
    st.sampled_from([1_000, 20_000]).map(lambda n: {f"k{i}": i for i in range(n)}),
)


def dumps(value: Any) -> str:
    """JSON text of ``value``; :class:`Raw` parts are written as they are, floats as Python's
    json writes them (``NaN``, ``Infinity``), strings ASCII-escaped (a lone surrogate as
    ``\\ud800``)."""
    if isinstance(value, Raw):
        return str(value)
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(str(k))}: {dumps(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(dumps(v) for v in value) + "]"
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    return json.dumps(value)


def paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(value, dict):
        for k, v in value.items():
            out += paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += paths(v, (*prefix, i))
    return out


def replaced(body: Any, path: tuple[Any, ...], value: Any) -> Any:
    if not path:
        return value
    out = copy.deepcopy(body)
    node = out
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return out


def encoded(data: bytes, coding: str) -> bytes:
    if coding == "gzip":
        return gzip.compress(data)
    if coding == "deflate":
        return zlib.compress(data)
    if coding == "br":
        return bytes(brotli.compress(data))
    return data


SESSIONS = ["fuzz", "fuzz", "fuzz", "", "a" * 2000, "s\x01p", "ünï", "../../etc", "%00", "a:b"]
ODD_HEADERS: list[dict[str, str]] = [
    {"x-stainless-retry-count": "7"},
    {"x-stainless-retry-count": "-1e999"},
    {"anthropic-version": "garbage", "anthropic-beta": "x" * 300},
    {"Content-Type": "text/plain; charset=utf-16"},
    {"session-id": "\u00e9" * 10},
    {"x-goog-api-client": "genai-js/0 gl-node/0"},
]


@dataclass
class Request:
    """One fuzzed HTTP request: where, what, with which headers, from which session."""

    provider: str
    path: str
    body: bytes
    headers: dict[str, str] = field(default_factory=dict)
    session: str = "fuzz"
    what: str = ""

    def __repr__(self) -> str:  # hypothesis prints failing examples; keep them readable
        return (
            f"Request({self.provider} {self.path} {self.what} session={self.session[:20]!r} "
            f"headers={ {k: v[:40] for k, v in self.headers.items()} } "
            f"body[{len(self.body)}]={self.body[:300]!r})"
        )


@st.composite
def mutated(draw: st.DrawFn, provider: str) -> tuple[Any, str]:
    """The provider's seed, broken one way (or left valid): the body and what was done."""
    body: Any = copy.deepcopy(SEEDS[provider])
    if provider in ("openai.chat", "anthropic", "openai.responses"):
        body["stream"] = draw(st.booleans())  # Gemini streams by URL
    kind = draw(
        st.sampled_from(
            ["valid", "replace", "replace", "number", "number", "drop", "unknown", "huge", "deep"]
        )
    )
    if kind == "replace":
        body = replaced(body, draw(st.sampled_from(paths(body))), draw(json_values))
    elif kind == "number":
        path = draw(st.sampled_from(NUMBERS[provider]))
        body = replaced(body, path, draw(extreme_numbers | st.floats() | st.integers()))
    elif kind == "drop":
        path = draw(st.sampled_from([p for p in paths(body) if p]))
        node = body
        for key in path[:-1]:
            node = node[key]
        node.pop(path[-1])  # a dict key or a list index: either way that part is missing
    elif kind == "unknown":
        where = draw(st.sampled_from([p for p in paths(body) if _is_dict(body, p)]))
        key = draw(texts | st.sampled_from(["type", "role", "stream", "__proto__", "id"]))
        body = replaced(body, (*where, key), draw(json_values))
    elif kind == "huge":
        body = replaced(body, draw(st.sampled_from([p for p in paths(body) if p])), draw(huge))
    elif kind == "deep":
        body = replaced(body, draw(st.sampled_from([p for p in paths(body) if p])), draw(deep))
    return body, kind


def _is_dict(body: Any, path: tuple[Any, ...]) -> bool:
    node = body
    for key in path:
        node = node[key]
    return isinstance(node, dict)


@st.composite
def requests(draw: st.DrawFn, provider: str) -> Request:
    """One fuzzed HTTP request to one of ``provider``'s routes."""
    host_paths = ROUTES[provider][1]
    path = draw(st.sampled_from(host_paths))
    if provider == "gemini" and draw(st.integers(0, 9)) == 0:
        # The model and method live in the URL: fuzz them too.
        model = draw(st.sampled_from(["", "x" * 300, "%00", "m%2Fn", "..", "m:n", "%F0%9F%92%A5"]))
        method = draw(
            st.sampled_from(
                ["generateContent", "streamGenerateContent", "countTokens", "embedContent", "x"]
            )
        )
        path = f"/v1beta/models/{model}:{method}" + draw(
            st.sampled_from(["", "?alt=sse", "?alt=json", "?alt=sse&alt=json"])
        )
    body, what = draw(mutated(provider))
    text = dumps(body)
    how = draw(
        st.sampled_from(
            ["json"] * 6
            + ["duplicate", "truncate", "bytes", "utf16", "latin1", "bad-utf8", "bom", "trailing"]
        )
    )
    if how == "duplicate":
        key = draw(
            st.sampled_from(["model", "messages", "contents", "input", "stream", "max_tokens"])
        )
        text = "{" + json.dumps(key) + ": " + dumps(draw(json_values)) + ", " + text[1:]
    data = text.encode("utf-8", "surrogatepass")
    if how == "truncate":
        data = data[: draw(st.integers(min_value=0, max_value=len(data)))]
    elif how == "bytes":
        data = draw(st.binary(max_size=128))
    elif how == "utf16":
        data = text.encode("utf-16", "surrogatepass")
    elif how == "latin1":
        data = text.replace('"', '"é', 1).encode("latin-1", "replace")
    elif how == "bad-utf8":
        at = draw(st.integers(min_value=0, max_value=len(data)))
        data = (
            data[:at]
            + draw(
                st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\x00"])
            )
            + data[at:]
        )
    elif how == "bom":
        data = b"\xef\xbb\xbf" + data
    elif how == "trailing":
        data += draw(st.sampled_from([b" ", b"\n", b"}", b",", b"{}", b"\x00"]))
    headers: dict[str, str] = {}
    coding = draw(st.sampled_from([""] * 12 + ["gzip", "deflate", "br", "lies", "unknown"]))
    if coding == "lies":
        headers["Content-Encoding"] = draw(st.sampled_from(["gzip", "deflate", "br", "identity"]))
    elif coding == "unknown":
        headers["Content-Encoding"] = draw(st.sampled_from(["zstd", "x-bogus", "gzip, gzip", ""]))
    elif coding:
        data = encoded(data, coding)
        headers["Content-Encoding"] = coding
    if draw(st.integers(0, 9)) == 0:
        headers.update(draw(st.sampled_from(ODD_HEADERS)))
    session = draw(st.sampled_from(SESSIONS))
    return Request(provider, path, data, headers, session, f"{what}/{how}/{coding or 'plain'}")


def post(proxy: Endpoint, request: Request, timeout: float = 60) -> Answer:
    """Send ``request`` through the proxy as a client with its own HTTP stack would (CONNECT
    with the session as proxy username, then TLS trusting only the proxy's CA)."""
    host = ROUTES[request.provider][0]
    ctx = ssl.create_default_context(cafile=str(proxy.ca))
    conn = http.client.HTTPSConnection("127.0.0.1", proxy.port, context=ctx, timeout=timeout)
    auth = base64.b64encode(f"{request.session}:x".encode()).decode()
    conn.set_tunnel(host, 443, headers={"Proxy-Authorization": f"Basic {auth}"})
    sent = {"Content-Type": "application/json", "Authorization": "Bearer sk-fuzz"}
    if request.provider == "anthropic":
        sent.update({"x-api-key": "sk-ant-fuzz", "anthropic-version": "2023-06-01"})
    if request.provider == "gemini":
        sent["x-goog-api-key"] = "AIza-fuzz"
    sent.update(request.headers)
    try:
        conn.request("POST", request.path, body=request.body, headers=sent)
        resp = conn.getresponse()
        return Answer(resp.status, resp.getheader("Content-Type") or "", resp.read())
    finally:
        conn.close()


def check_http(request: Request, answer: Answer) -> None:
    """What every answer to a fuzzed request must be."""
    where = (answer.status, repr(request), answer.body[:300])
    assert answer.status < 500, where
    if answer.status >= 400:
        assert_provider_error(request.provider, answer)
    elif answer.content_type.startswith("text/event-stream"):
        assert answer.body.strip(), ("a streamed 200 with an empty body", *where)
        for line in answer.body.splitlines():
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                event = json.loads(line[6:])
                # Bad input is refused before the stream starts, never by an error event in it.
                assert "error" not in event, where
                assert event.get("type") not in ("error", "response.failed"), where
    else:
        json.loads(answer.body)


# -- the Responses API's WebSocket mode ------------------------------------------------------------

# Closes a refusal may end with: invalid frame data (1007), policy (1008), message too big (1009).
ALLOWED_CLOSES = {1007, 1008, 1009}
TERMINAL = {"response.completed", "response.failed", "response.incomplete", "error"}
WARMUP = {"type": "response.create", "model": "gpt-5", "input": None, "generate": False}


@dataclass
class Frame:
    """One WebSocket message: a text frame (``text``) or raw bytes in a text or binary frame."""

    text: str | None = None
    data: bytes = b""
    binary: bool = False
    what: str = ""

    def __repr__(self) -> str:
        shown = self.text if self.text is not None else self.data
        return f"Frame({self.what} binary={self.binary} {shown[:200]!r} [{len(shown)}])"


@st.composite
def frames(draw: st.DrawFn, max_bytes: int) -> Frame:
    body, what = draw(mutated(WEBSOCKET))
    if isinstance(body, dict):
        kind = draw(st.sampled_from(["response.create"] * 8 + ["response.cancel", "", None]))
        if kind is not None:
            body = {"type": kind, **body}
            if draw(st.integers(0, 3)) == 0:  # some clients nest the request
                body = {"type": kind, "response": {k: v for k, v in body.items() if k != "type"}}
    how = draw(st.sampled_from(["text"] * 8 + ["binary", "bad-utf8", "garbage", "too-big"]))
    text = dumps(body)
    if how == "binary":
        return Frame(data=text.encode("utf-8", "surrogatepass"), binary=True, what=f"{what}/binary")
    if how == "bad-utf8":
        data = text.encode("utf-8", "surrogatepass")
        at = draw(st.integers(min_value=0, max_value=len(data)))
        return Frame(data=data[:at] + b"\xff\xfe" + data[at:], what=f"{what}/bad-utf8")
    if how == "garbage":
        return Frame(text=draw(st.text(max_size=64)), what="garbage")
    if how == "too-big":
        return Frame(
            text='{"type": "response.create", "input": "' + "x" * max_bytes + '"}', what="too-big"
        )
    if any(s in text for s in SURROGATES):
        # A text frame is UTF-8: a raw lone surrogate cannot be sent, its escape can.
        text = text.encode("utf-8", "surrogatepass").decode("utf-8", "replace")
    return Frame(text=text, what=f"{what}/text")


@dataclass
class Exchange:
    """What one WebSocket conversation got: per message its events (or the close)."""

    sent: int = 0  # fuzzed messages sent (none after a close)
    events: list[list[dict[str, Any]]] = field(default_factory=list)
    close: int | None = None
    alive: bool = False  # answered a well-formed message after the fuzzed ones

    def outcomes(self) -> list[str]:
        out = []
        for events in self.events:
            last = events[-1] if events else {}
            status = last.get("status")
            out.append(f"{last.get('type', 'nothing')}" + (f" {status}" if status else ""))
        if self.close is not None:
            out.append(f"close {self.close}")
        return out


async def _converse(
    proxy: Endpoint, session: str, messages: list[Frame], timeout: float
) -> Exchange:
    context = ssl.create_default_context(cafile=str(proxy.ca))
    result = Exchange()
    async with aiohttp.ClientSession() as client:
        async with client.ws_connect(
            "wss://api.openai.com/v1/responses",
            proxy=f"http://{session}:x@127.0.0.1:{proxy.port}",
            ssl=context,
            max_msg_size=0,
        ) as ws:

            async def answer() -> list[dict[str, Any]] | None:
                events: list[dict[str, Any]] = []
                while True:
                    msg = await ws.receive(timeout=timeout)
                    if msg.type != aiohttp.WSMsgType.TEXT:
                        result.close = ws.close_code if ws.close_code is not None else -1
                        return None
                    event = json.loads(msg.data)
                    events.append(event)
                    if event.get("type") in TERMINAL:
                        return events

            for frame in messages:
                result.sent += 1
                if frame.text is not None:
                    await ws.send_str(frame.text)
                else:
                    opcode = aiohttp.WSMsgType.BINARY if frame.binary else aiohttp.WSMsgType.TEXT
                    await ws.send_frame(frame.data, opcode)
                events = await answer()
                if events is None:
                    return result
                result.events.append(events)
            await ws.send_str(json.dumps(WARMUP))
            events = await answer()
            result.alive = events is not None and events[-1]["type"] == "response.completed"
    return result


def converse(proxy: Endpoint, session: str, messages: list[Frame], timeout: float = 60) -> Exchange:
    """Send ``messages`` on one WebSocket, then a well-formed warm-up; what came back."""
    return asyncio.run(_converse(proxy, session, messages, timeout))


def check_websocket(messages: list[Frame], exchange: Exchange) -> None:
    where = (messages, exchange.outcomes())
    for events in exchange.events:
        for event in events:
            if event.get("type") == "error":
                assert event["status"] < 500, where
                error = event["error"]
                assert isinstance(error["message"], str) and error["message"], where
                assert isinstance(error["type"], str), where
            assert event.get("type") != "response.failed", where
    if exchange.close is not None:
        assert exchange.close in ALLOWED_CLOSES, where
    else:
        assert exchange.alive, ("the connection no longer answers a well-formed message", *where)


# -- running many examples ---------------------------------------------------------------------------


def run_examples(
    strategy: st.SearchStrategy[Any],
    body: Callable[[Any], None],
    examples: int,
    *,
    seed: int | None = None,
) -> None:
    """Run ``body`` on ``examples`` examples of ``strategy``: derandomized (CI: the same set each
    run) unless a ``seed`` picks another set."""

    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        derandomize=seed is None,
        suppress_health_check=list(HealthCheck),
    )
    @given(strategy)
    def run(case: Any) -> None:
        body(case)

    if seed is not None:
        run = hypothesis_seed(seed)(run)
    run()


def tally(counts: Counter[str]) -> Iterator[str]:
    for key, n in sorted(counts.items()):
        yield f"{key}: {n}"
