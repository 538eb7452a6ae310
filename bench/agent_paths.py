"""bench/agent_sessions.py's paths: one client per way of reaching vLLM (its chat endpoint, token
ids, a peer proxy, agenttap), each making a session's streamed calls and timing them."""

from __future__ import annotations

import math
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson

from bench.agent_plan import Plan
from bench.agent_procs import Proc, cpu_precise
from bench.agent_wire import (
    AnthropicReader,
    AnthropicShape,
    ChatReader,
    CompletionReader,
    ResponsesReader,
    ResponsesShape,
    Shape,
    StreamReader,
)
from bench.common import cpu_seconds

PATHS = (
    "chat",
    "ids",
    "ids-echo",
    "rllm",
    "litellm",
    "litellm-anthropic",
    "litellm-responses",
    "mitmdump-s",
    "agenttap",
    "agenttap-responses",
    "agenttap-anthropic",
)
# Paths with a process of their own between the client and vLLM (its CPU is read): all but
# the ones calling vLLM directly.
PROXIED = set(PATHS) - {"chat", "ids", "ids-echo"}


# -- the paths -----------------------------------------------------------------------------------
@dataclass
class Call:
    """One measured call."""

    path: str
    session: int
    turn: int  # 1-based
    ms: float
    ttft_ms: float
    tokens: int
    prompt_tokens: int


class Path_:
    """One path's client: how a session's call is made and read, and the processes whose CPU
    is its own."""

    reader: type[StreamReader] = ChatReader
    shape: type[Shape] = Shape

    def __init__(self, name: str, url: str, procs: list[Proc], **kw: Any) -> None:
        self.name = name
        self.url = url  # where the call goes
        self.procs = procs  # whose CPU counts as this path's (proxies)
        self.proxies: list[str] = kw.get("proxies", [])  # HTTP proxies, a session on one
        self.ssl: ssl.SSLContext | bool = kw.get("ssl", False)
        self.headers: dict[str, str] = {"Content-Type": "application/json", **kw.get("headers", {})}
        self.model: str = kw.get("model", "")
        self.session_url: Callable[[str], str] | None = kw.get("session_url")
        self.http: Any = None
        self.sessions: list[Shape] = []
        self.failed: dict[int, str] = {}
        self.redials = 0  # calls sent again on a new connection (a stale kept-alive one)

    def begin(self, plan: Plan, max_tokens: int) -> None:
        self.sessions = [
            self.shape(plan, i, self.model, max_tokens) for i in range(len(plan.texts))
        ]

    def cpu(self) -> tuple[float, float]:
        """CPU seconds of the path's own processes so far: (/proc/PID/stat's, schedstat's)."""
        pids = [p.proc.pid for p in self.procs]
        return sum(map(cpu_seconds, pids)), sum(map(cpu_precise, pids))

    def request(self, session: int, name: str) -> tuple[str, bytes, dict[str, Any]]:
        """(url, body, aiohttp keyword arguments) of the session's next call."""
        kwargs: dict[str, Any] = {"headers": self.headers}
        if self.proxies:
            import aiohttp

            kwargs["proxy"] = self.proxies[session % len(self.proxies)]
            kwargs["proxy_headers"] = {"Proxy-Authorization": aiohttp.encode_basic_auth(name, "x")}
            kwargs["ssl"] = self.ssl
        url = self.session_url(name) if self.session_url else self.url
        return url, orjson.dumps(self.sessions[session].body()), kwargs

    async def call(self, session: int, turn: int, name: str) -> Call:
        url, body, kwargs = self.request(session, name)
        return await self.post(session, turn, url, body, kwargs)

    async def post(
        self, session: int, turn: int, url: str, body: bytes, kwargs: dict[str, Any]
    ) -> Call:
        import aiohttp

        began = time.perf_counter()
        for attempt in (1, 2):
            reader = self.reader()
            first = 0.0
            answered = False
            try:
                async with self.http.post(url, data=body, **kwargs) as resp:
                    answered = True
                    if resp.status != 200:
                        raise RuntimeError(f"HTTP {resp.status}: {(await resp.read())[:400]!r}")
                    async for line in resp.content:
                        if not line.startswith(b"data:"):
                            continue
                        data = line[5:].strip()
                        if data == b"[DONE]":
                            continue
                        if reader.feed(orjson.loads(data)) and not first:
                            first = time.perf_counter()
                break
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError):
                # A kept-alive connection the server closed while it sat idle (uvicorn closes
                # them after 5 s; paths are interleaved): dialled again once, as the SDKs do.
                # The clock keeps running.
                if answered or attempt == 2:
                    raise
                self.redials += 1
        took = time.perf_counter() - began
        reply = reader.finish()
        shape = self.sessions[session]
        if turn < len(shape.texts):  # the reply and the next tool result, for the next call
            shape.add(reply, turn - 1)
        return Call(
            self.name, session, turn, took * 1000, (first - began) * 1000 if first else math.nan,
            reply.tokens, reply.prompt_tokens,
        )  # fmt: skip


class IdsPath(Path_):
    """vLLM's /v1/completions with the prompt's ids, rendered here before the clock starts
    (the same chat template vLLM's chat endpoint applies, from the served model's folder),
    with the body agenttap sends (``return_tokens_as_token_ids``, ``logprobs: 0``); with
    ``echo``, ``return_token_ids`` instead (the prompt's ids come back in the first chunk)."""

    reader = CompletionReader

    def __init__(self, *args: Any, template: Any, echo: bool = False, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.template = template
        self.echo = echo

    def prompt_ids(self, session: int) -> list[int]:
        shape = self.sessions[session]
        ids = self.template.apply_chat_template(
            shape.messages, tools=shape.plan.tools, add_generation_prompt=True, tokenize=True
        )
        if not isinstance(ids, list):  # transformers 5 answers a BatchEncoding
            ids = list(ids["input_ids"])
        return ids

    def request(self, session: int, name: str) -> tuple[str, bytes, dict[str, Any]]:
        shape = self.sessions[session]
        body = {
            "model": self.model,
            "prompt": self.prompt_ids(session),
            "max_tokens": shape.max_tokens,
            "temperature": 1.0,
            "ignore_eos": True,
            "logprobs": 0,
            "skip_special_tokens": True,
            "return_token_ids" if self.echo else "return_tokens_as_token_ids": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        return self.url, orjson.dumps(body), {"headers": self.headers}

    async def call(self, session: int, turn: int, name: str) -> Call:
        # Rendered and tokenized before the clock (the caller has done it for every session
        # of the turn: see Bench.prepare).
        url, body, kwargs = self.prepared.pop(session)
        return await self.post(session, turn, url, body, kwargs)

    prepared: dict[int, tuple[str, bytes, dict[str, Any]]]


class AnthropicPath(Path_):
    reader = AnthropicReader
    shape = AnthropicShape


class ResponsesPath(Path_):
    reader = ResponsesReader
    shape = ResponsesShape
