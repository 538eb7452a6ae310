"""bench/overhead.py's client: agent-like conversations, one path's calls through its server
or proxy (each answer checked), and the latency and throughput runs over every path."""

from __future__ import annotations

import asyncio
import json
import ssl
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from bench.common import API_KEY
from bench.overhead_servers import QWEN3, STREAM_TOKENS, WORDS, Server

TURNS = 8  # calls per conversation before a client starts over
# The tools every call offers (--tools N: agents send 10 to 40, with schemas of a kB or more).
TOOLS: list[dict[str, Any]] = []


def bench_tools(n: int) -> list[dict[str, Any]]:
    """``n`` function tools shaped like an agent's (a description, a dozen typed parameters)."""
    properties = {
        f"param_{j}": {"type": "string", "description": f"What parameter {j} of the tool means."}
        for j in range(12)
    }
    return [
        {
            "type": "function",
            "function": {
                "name": f"tool_{i}",
                "description": f"Tool {i}: " + " ".join(WORDS[:60]),
                "parameters": {"type": "object", "properties": properties, "required": ["param_0"]},
            },
        }
        for i in range(n)
    ]


# The conversations' system prompt (--system-tokens makes it longer, as agents' are).
SYSTEM = "You are a terse assistant."
# (name, max_tokens, stream)
KINDS = (("1 token", 1, False), (f"{STREAM_TOKENS}-token stream", STREAM_TOKENS, True))


# -- the client ----------------------------------------------------------------------------------
@dataclass
class Conversation:
    """One agent-like client: its history grows by each reply and a new question."""

    session: str
    messages: list[dict[str, str]] = field(default_factory=list)
    calls: int = 0

    def next_body(self, max_tokens: int, stream: bool) -> dict[str, Any]:
        if self.calls % TURNS == 0:
            self.messages = [{"role": "system", "content": SYSTEM}]
        self.messages.append(
            {"role": "user", "content": f"Step {self.calls % TURNS} of task {self.calls // TURNS}."}
        )
        self.calls += 1
        body: dict[str, Any] = {
            "model": "gpt-4o-mini",
            "messages": list(self.messages),
            "max_tokens": max_tokens,
        }
        if TOOLS:
            body["tools"] = TOOLS
        if stream:
            body["stream"] = True
        return body

    def answered(self, content: str) -> None:
        self.messages.append({"role": "assistant", "content": content})


class Path_:
    """One path's client side: a keep-alive pool, one proxy session per conversation."""

    def __init__(self, server: Server, ca: Path) -> None:
        self.server = server
        self.url = server.url + "/v1/chat/completions"
        self.ssl = ssl.create_default_context(cafile=str(ca))
        self.http: aiohttp.ClientSession | None = None
        self.conversations: dict[str, Conversation] = {}

    async def open(self) -> None:
        connector = aiohttp.TCPConnector(limit=0, ssl=self.ssl)
        self.http = aiohttp.ClientSession(connector=connector)

    async def close(self) -> None:
        if self.http is not None:
            await self.http.close()

    async def call(self, client: str, max_tokens: int, stream: bool) -> float:
        """One call by conversation ``client``; its seconds. Raises on any wrong answer."""
        conv = self.conversations.get(client)
        if conv is None:
            conv = self.conversations[client] = Conversation(f"bench-{client}")
        body, kwargs = self.request(conv, max_tokens, stream)
        assert self.http is not None
        began = time.perf_counter()
        async with self.http.post(self.url, data=json.dumps(body).encode(), **kwargs) as resp:
            raw = await resp.read()
        took = time.perf_counter() - began
        name = self.server.name
        if resp.status != 200:
            raise RuntimeError(f"{name}: HTTP {resp.status}: {raw[:300]!r}")
        if stream:
            events = [e[6:] for e in raw.split(b"\n\n") if e.startswith(b"data: ")]
            if not events or events[-1] != b"[DONE]":
                raise RuntimeError(f"{name}: stream cut short: {raw[-300:]!r}")
            content = "".join(self.event_text(json.loads(e)) for e in events[:-1])
        else:
            content = self.whole_text(json.loads(raw))
        if len(content.split()) != max_tokens:
            raise RuntimeError(f"{name}: {max_tokens} tokens asked, got {content!r}")
        conv.answered(content)
        return took

    def request(
        self, conv: Conversation, max_tokens: int, stream: bool
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """The chat call's body and the post's keyword arguments (headers, proxy)."""
        headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
        kwargs: dict[str, Any] = {"headers": headers}
        if self.server.proxy:
            auth = aiohttp.encode_basic_auth(conv.session, "x")
            kwargs.update(proxy=self.server.proxy, proxy_headers={"Proxy-Authorization": auth})
        return conv.next_body(max_tokens, stream), kwargs

    @staticmethod
    def event_text(event: dict[str, Any]) -> str:
        return "".join(c.get("delta", {}).get("content") or "" for c in event.get("choices", []))

    @staticmethod
    def whole_text(answer: dict[str, Any]) -> str:
        return str(answer["choices"][0]["message"]["content"] or "")


class PoolPath(Path_):
    """Several agenttap processes (one Python process uses one core), each conversation's
    session placed on one of them by its name, as ``capture/client/ray_pool.py`` places sessions."""

    def request(
        self, conv: Conversation, max_tokens: int, stream: bool
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        body, kwargs = super().request(conv, max_tokens, stream)
        servers = [self.server, *self.server.members]
        kwargs["proxy"] = servers[zlib.crc32(conv.session.encode()) % len(servers)].proxy
        return body, kwargs


class PolicyPath(Path_):
    """The stub policy called directly, as agenttap calls it: the conversation rendered with the
    Qwen3 chat template into token ids (before the clock starts), ``POST /v1/completions``
    with ``return_token_ids`` and ``logprobs: 0``. Its latency is the policy's own time, so
    agenttap's latency minus it is what agenttap adds (``direct`` answers from the fake
    OpenAI server, which does less per token than the vLLM-shaped stub)."""

    def __init__(self, server: Server, ca: Path) -> None:
        super().__init__(server, ca)
        self.url = server.url + "/v1/completions"
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(str(QWEN3))

    def request(
        self, conv: Conversation, max_tokens: int, stream: bool
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        chat = conv.next_body(max_tokens, stream)
        ids = self.tok.apply_chat_template(
            chat["messages"], tools=chat.get("tools"), add_generation_prompt=True, tokenize=True
        )
        if not isinstance(ids, list):  # transformers 5 answers a BatchEncoding
            ids = list(ids["input_ids"])
        body = {
            "model": "stub-policy", "prompt": ids, "max_tokens": max_tokens, "stream": stream,
            "return_token_ids": True, "logprobs": 0, "skip_special_tokens": True,
        }  # fmt: skip
        return body, {"headers": {"Content-Type": "application/json"}}

    @staticmethod
    def event_text(event: dict[str, Any]) -> str:
        return "".join(c.get("text") or "" for c in event["choices"])

    @staticmethod
    def whole_text(answer: dict[str, Any]) -> str:
        return str(answer["choices"][0]["text"] or "")


async def throughput(
    path: Path_, clients: int, seconds: float, max_tokens: int, stream: bool
) -> tuple[float, tuple[float, float, float]]:
    """Calls per second with ``clients`` conversations calling back to back for ``seconds``,
    and the CPU milliseconds per call of (the path's server or proxy, the server behind the
    proxy, this client)."""
    done = 0
    stop_at = time.perf_counter() + seconds

    async def worker(i: int) -> None:
        nonlocal done
        while time.perf_counter() < stop_at:
            await path.call(f"t{clients}-{i}", max_tokens, stream)
            done += 1

    began = time.perf_counter()
    own0, up0, client0 = *path.server.cpu(), time.process_time()
    await asyncio.gather(*(worker(i) for i in range(clients)))
    own1, up1, client1 = *path.server.cpu(), time.process_time()
    rate = done / (time.perf_counter() - began)

    def ms(before: float, after: float) -> float:
        return 1000.0 * (after - before) / max(done, 1)

    return rate, (ms(own0, own1), ms(up0, up1), ms(client0, client1))


async def measure(
    paths: dict[str, Path_], calls: int, warmup: int, seconds: float, rounds: int
) -> tuple[
    dict[tuple[str, str], list[float]],
    dict[tuple[str, str, int], list[float]],
    dict[tuple[str, str, int], list[tuple[float, float, float]]],
]:
    names = list(paths)
    for path in paths.values():
        await path.open()
    latency: dict[tuple[str, str], list[float]] = {}
    rates: dict[tuple[str, str, int], list[float]] = {}
    cpu: dict[tuple[str, str, int], list[tuple[float, float, float]]] = {}
    try:
        for kind, max_tokens, stream in KINDS:
            for _ in range(warmup):
                for name in names:
                    await paths[name].call("lat", max_tokens, stream)
            for i in range(calls):
                order = names[i % len(names) :] + names[: i % len(names)]
                for name in order:
                    took = await paths[name].call("lat", max_tokens, stream)
                    latency.setdefault((name, kind), []).append(took * 1000.0)
            print(f"  latency, {kind}: {calls} calls per path", flush=True)
        for r in range(rounds):
            for clients in (32, 64):
                for kind, max_tokens, stream in KINDS:
                    order = names[r % len(names) :] + names[: r % len(names)]
                    for name in order:
                        rate, per_call = await throughput(
                            paths[name], clients, seconds, max_tokens, stream
                        )
                        rates.setdefault((name, kind, clients), []).append(rate)
                        cpu.setdefault((name, kind, clients), []).append(per_call)
            print(f"  throughput round {r + 1}/{rounds} done", flush=True)
    finally:
        for path in paths.values():
            await path.close()
    return latency, rates, cpu
