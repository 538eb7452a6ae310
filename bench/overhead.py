"""What each proxy adds to a chat call, side by side: direct, plain mitmdump, agenttap, LiteLLM.

    .venv/bin/python bench/overhead.py [--quick] [--calls 200] [--seconds 5] [--rounds 3]
                                       [--no-litellm] [--only direct,mitmdump,agenttap]
                                       [--system-tokens 20000] [--tools 20] [--pool 2]

Paths, all in one run, interleaved (each round rotates which path goes first):

- ``direct``: an OpenAI-compatible fake server (aiohttp, its own process) answering chat
  completions at once: ``max_tokens`` words, whole or as an SSE stream of one chunk per word.
- ``mitmdump``: plain mitmdump (no script) in regular mode; the client calls
  ``https://api.openai.com`` through ``HTTPS_PROXY``-style CONNECT, TLS intercepted with the
  mitmproxy CA, and mitmproxy's own ``map_remote`` sends it to the fake server over HTTP.
  As mitmproxy does by default, it holds each answer whole before sending it on: a stream
  reaches the client all at once, when it has ended.
- ``mitmdump-s``: the same with ``bench/stream_responses.py``: streams relayed as they come,
  chunk by chunk, which is what agenttap does (and what a user forwarding SSE would set up).
- ``agenttap``: mitmdump + addons/capture.py, same mode, same client, same CA; answered by the
  vLLM-shaped stub (tests/support/stub_vllm.py, real Qwen3 tokenizer, its decoding cached so it answers
  at once), prompts rendered and calls recorded as in real use.
- ``agenttap-2``: the same, as a pool of ``--pool`` agenttap processes (default 2), each
  conversation's session on one of them (by a hash of its name), as ``capture/client/ray_pool.py``
  and ``bench/concurrency.py --proxies`` place sessions: one Python process uses one core, and
  the pool is how agenttap uses more. Its CPU is the whole pool's.
- ``policy``: the stub alone, called as agenttap calls it (the conversation rendered to token
  ids before the clock starts, ``POST /v1/completions``): the policy's own time, so agenttap's
  latency minus this one is what agenttap itself adds (a second table).
- ``litellm``: LiteLLM's proxy (``litellm --config``) in front of the fake server, called at its
  base URL (plain HTTP, as its users do). Installed on first use into ``.cache/litellm-venv``
  (never into ``.venv``); the column is skipped with a note if that fails.

Each client is an agent-like conversation: every call resends the history plus the reply it got
and a new user message, eight calls, then it starts over (agenttap: one proxy session per client,
extending its calls); ``--system-tokens N`` makes its system prompt N tokens longer, ``--tools N``
makes every call offer N agent-sized function tools. Reported
per path: the latency it adds over ``direct`` at concurrency 1 (p50, p95 of the path's latencies
minus direct's), non-streamed 1 token and a 64-token stream;
calls per second with 32 and 64 clients at once (each its own keep-alive connection); and the
ratios to plain mitmdump; and, from the throughput runs at 32 clients, the CPU milliseconds each
call costs the path's proxy (or server), the server behind it and the bench client (from
/proc: every thread and child process counted), which says where a shared machine's cores go.
Every answer is checked (status, whole stream, content).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import shutil
import signal
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import aiohttp  # noqa: E402

QWEN3 = REPO.parent / "shared" / "tokenizers" / "qwen3"
MITMDUMP = REPO / ".venv" / "bin" / "mitmdump"
LITELLM_VENV = REPO / ".cache" / "litellm-venv"
STREAM_TOKENS = 64
# What every path is called with (LiteLLM's master key; the others take any).
API_KEY = "sk-bench-" + "0123456789abcdef" * 2
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


# Milliseconds between a stream's tokens in the fake server and the stub (bench/paced.py sets it).
PACE_ENV = "OVERHEAD_PACE_MS"
# The most tokens a streamed answer asks for (bench/paced.py --tokens): the stub's reply is this long.
REPLY_ENV = "OVERHEAD_REPLY_TOKENS"
# The conversations' system prompt (--system-tokens makes it longer, as agents' are).
SYSTEM = "You are a terse assistant."
# Each one token of Qwen3's with and without a leading space: n words are n tokens.
WORDS = (
    "the and for are but not you all any can had her was one our out day get has him his how man "
    "new now old see two way who boy did its let put say she too use time long make many over "
    "such take them then they this well were what when will with word work year back call come "
    "each find give good hand high keep last left life line look made more most move must name "
    "need next open part play read room same seem show side tell than that turn want went"
).split()


def reply_words(n: int) -> list[str]:
    """The answer of ``n`` tokens, word by word (the stub's and the fake server's alike)."""
    return [("" if i == 0 else " ") + WORDS[i % len(WORDS)] for i in range(n)]


PATHS = ("direct", "mitmdump", "mitmdump-s", "agenttap", "agenttap-2", "policy", "litellm")
# The pool path: this many agenttap processes, sessions spread over them (--pool sets it).
POOL = 2
# (name, max_tokens, stream)
KINDS = (("1 token", 1, False), (f"{STREAM_TOKENS}-token stream", STREAM_TOKENS, True))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(
    port: int, proc: subprocess.Popen[bytes], what: str, log: Path, timeout: float
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited ({proc.returncode}); see {log}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"{what} did not listen on {port} in {timeout:.0f} s; see {log}")


# -- the servers, each in a process of its own ---------------------------------------------------
def serve_fake() -> None:
    """An OpenAI-compatible chat completions server answering at once (``--serve-fake``), or
    streaming a word every OVERHEAD_PACE_MS milliseconds (bench/paced.py)."""
    from aiohttp import web

    pace = float(os.environ.get(PACE_ENV) or 0) / 1000.0

    async def models(request: web.Request) -> web.Response:
        return web.json_response(
            {"object": "list", "data": [{"id": "gpt-4o-mini", "object": "model"}]}
        )

    async def chat(request: web.Request) -> web.StreamResponse:
        body = json.loads(await request.read())
        n = int(body.get("max_tokens") or 16)
        created = int(time.time())
        base = {"id": "chatcmpl-fake", "created": created, "model": body.get("model", "m")}
        words = reply_words(n)
        prompt = sum(len(str(m.get("content", ""))) for m in body.get("messages", [])) // 4
        usage = {"prompt_tokens": prompt, "completion_tokens": n, "total_tokens": prompt + n}
        if not body.get("stream"):
            message = {"role": "assistant", "content": "".join(words)}
            choice = {"index": 0, "message": message, "finish_reason": "length"}
            out = {**base, "object": "chat.completion", "choices": [choice], "usage": usage}
            return web.json_response(out)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i, word in enumerate(words):
            if pace and i:
                await asyncio.sleep(pace)
            delta: dict[str, Any] = {"content": word}
            if i == 0:
                delta["role"] = "assistant"
            chunk = {**base, "object": "chat.completion.chunk",
                     "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}  # fmt: skip
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        last = {**base, "object": "chat.completion.chunk",
                "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}  # fmt: skip
        if (body.get("stream_options") or {}).get("include_usage"):
            last["usage"] = usage
        await resp.write(b"data: " + json.dumps(last).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def main() -> None:
        app = web.Application()
        app.router.add_get("/v1/models", models)
        # As vLLM's: the rLLM gateway (bench/paced.py) marks a worker without it dead.
        for health in ("/health", "/v1/health"):
            app.router.add_get(health, lambda request: web.Response())
        app.router.add_post("/v1/chat/completions", chat)
        app.router.add_post("/chat/completions", chat)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0, backlog=4096)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        print(f"http://127.0.0.1:{port}", flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)

    asyncio.run(main())


class _CachedTokenizer:
    """The stub's tokenizer with ``decode`` memoized: the stub decodes each answer token by
    token (quadratic in its length), work a real vLLM does not do per call."""

    def __init__(self, tok: Any) -> None:
        self._tok = tok
        self._decode = functools.lru_cache(maxsize=100_000)(self._decode_tuple)

    def _decode_tuple(self, ids: tuple[int, ...], skip: bool) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=skip))

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self._decode(tuple(ids), skip_special_tokens)

    def __len__(self) -> int:  # dunders skip __getattr__ (the stub's /detokenize asks)
        return len(self._tok)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tok, name)


def serve_stub() -> None:
    """The vLLM-shaped stub policy, answering at once (``--serve-stub``), or streaming a token
    every OVERHEAD_PACE_MS milliseconds (bench/paced.py)."""
    from tests.support.stub_vllm import StubPolicy

    stub = StubPolicy(str(QWEN3))
    stub.chunk_delay_s = float(os.environ.get(PACE_ENV) or 0) / 1000.0
    stub.tok = _CachedTokenizer(stub.tok)  # type: ignore[assignment]
    longest = max(2 * STREAM_TOKENS, int(os.environ.get(REPLY_ENV) or 0))
    stub.default_reply = "".join(reply_words(longest))
    print(stub.start(), flush=True)
    sys.stdin.read()
    stub.stop()


@dataclass
class Server:
    name: str
    proc: subprocess.Popen[bytes]
    log: Path
    url: str = ""  # where the client sends its calls
    proxy: str | None = None  # the HTTP proxy it goes through
    note: str = ""
    upstream: Server | None = None  # the server a proxy sends its calls on to

    # More processes of the same path (a pool): their CPU counts as this path's, and each
    # conversation goes through one of them (PoolPath).
    members: list[Server] = field(default_factory=list)

    def cpu(self) -> tuple[float, float]:
        """CPU seconds used so far: (this server's, its upstream's), each with descendants."""
        up = cpu_seconds(self.upstream.proc.pid) if self.upstream else 0.0
        own = cpu_seconds(self.proc.pid) + sum(cpu_seconds(m.proc.pid) for m in self.members)
        return own, up

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT if self.name != "litellm" else signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


_TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (all its threads) and its descendants."""
    total = 0.0
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        total += (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime
        for task in Path(f"/proc/{pid}/task").iterdir():
            for child in (task / "children").read_text().split():
                total += cpu_seconds(int(child))
    except (OSError, ValueError, IndexError):
        pass  # gone meanwhile
    return total


def spawn_child(flag: str, work: Path) -> tuple[subprocess.Popen[bytes], str]:
    """This script in a child process serving ``flag``; its URL from its first line."""
    log = work / f"{flag.strip('-')}.log"
    proc = subprocess.Popen(
        [sys.executable, __file__, flag],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=open(log, "wb"),  # noqa: SIM115 (the child holds it)
    )
    assert proc.stdout is not None
    url = proc.stdout.readline().decode().strip()
    if not url.startswith("http"):
        raise RuntimeError(f"{flag} did not start; see {log}")
    return proc, url


def stop_child(child: subprocess.Popen[bytes]) -> None:
    """Stop a ``spawn_child`` server: it exits when its stdin closes (killed after 10 s)."""
    if child.poll() is None:
        assert child.stdin is not None
        child.stdin.close()
        try:
            child.wait(10)
        except subprocess.TimeoutExpired:
            child.kill()


def start_mitmdump(name: str, args: list[str], work: Path, confdir: Path) -> Server:
    port = free_port()
    log = work / f"{name}.log"
    cmd = [
        str(MITMDUMP), "--listen-host", "127.0.0.1", "--listen-port", str(port),
        "--set", f"confdir={confdir}", "--set", "connection_strategy=lazy", *args,
    ]  # fmt: skip
    # OVERHEAD_PROFILE=FILE: this path (OVERHEAD_PROFILE_PATH, default agenttap) runs under
    # cProfile, its stats written to FILE when it exits.
    profile = os.environ.get("OVERHEAD_PROFILE")
    if profile and name == os.environ.get("OVERHEAD_PROFILE_PATH", "agenttap"):
        cmd = [sys.executable, "-m", "cProfile", "-o", profile, *cmd]
    with open(log, "wb") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=REPO)
    wait_port(port, proc, name, log, 120)
    return Server(name, proc, log, "https://api.openai.com", f"http://127.0.0.1:{port}")


def start_plain_mitmdump(
    name: str, fake_url: str, work: Path, confdir: Path, streaming: bool = False
) -> Server:
    """Plain mitmdump sending api.openai.com's calls to the fake server. It holds a response
    whole before sending it on, streams included; ``streaming``: it relays them as they come
    (bench/stream_responses.py), as a user forwarding SSE would set it up."""
    args = ["--map-remote", f"|https://api.openai.com|{fake_url}"]
    if streaming:
        args += ["-s", str(REPO / "bench" / "stream_responses.py")]
    return start_mitmdump(name, args, work, confdir)


def start_agenttap(
    name: str, stub_url: str, out: Path, work: Path, confdir: Path, options: Sequence[str] = ()
) -> Server:
    """mitmdump with agenttap's addon, answered by the vLLM-shaped stub at ``stub_url``,
    writing its shards under ``out``; ``options``: more ``NAME=VALUE`` options to set."""
    return start_mitmdump(
        name,
        [
            "-s", str(REPO / "addons" / "capture.py"),
            "--set", f"agenttap_policy_url={stub_url}",
            "--set", f"agenttap_tokenizer={QWEN3}",
            "--set", f"agenttap_out={out}",
            *(arg for option in options for arg in ("--set", option)),
        ],
        work,
        confdir,
    )  # fmt: skip


def install_litellm(work: Path) -> Path | None:
    """LiteLLM's proxy in its own venv under .cache/ (first use: pip install); None if it fails."""
    exe = LITELLM_VENV / "bin" / "litellm"
    if exe.exists():
        return exe
    print(f"installing litellm[proxy] into {LITELLM_VENV} (first use) ...", flush=True)
    log = work / "litellm-install.log"
    with open(log, "wb") as fh:
        ok = (
            subprocess.call([sys.executable, "-m", "venv", str(LITELLM_VENV)], stdout=fh, stderr=fh)
            == 0
            and subprocess.call(
                [str(LITELLM_VENV / "bin" / "pip"), "install", "-q", "litellm[proxy]"],
                stdout=fh,
                stderr=fh,
            )
            == 0
        )
    if ok and exe.exists():
        return exe
    shutil.rmtree(LITELLM_VENV, ignore_errors=True)
    print(f"  litellm install failed (see {log}); its column is skipped", flush=True)
    return None


def litellm_config(fake_url: str) -> str:
    """LiteLLM proxy's config in front of the fake OpenAI server (its openai/ provider, as a
    user fronting an OpenAI-compatible server configures it), keyed by ``API_KEY``."""
    return (
        "model_list:\n"
        "  - model_name: gpt-4o-mini\n"
        "    litellm_params:\n"
        "      model: openai/gpt-4o-mini\n"
        f"      api_base: {fake_url}/v1\n"
        "      api_key: sk-fake\n"
        "general_settings:\n"
        f"  master_key: {API_KEY}\n"
        "litellm_settings:\n"
        "  telemetry: false\n"
        "  drop_params: true\n"
    )


def start_litellm(fake_url: str, work: Path) -> Server | str:
    exe = install_litellm(work)
    if exe is None:
        return "install failed"
    config = work / "litellm.yaml"
    config.write_text(litellm_config(fake_url))
    port = free_port()
    log = work / "litellm.log"
    env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_LOG": "ERROR"}
    env.pop("HTTPS_PROXY", None)
    env.pop("HTTP_PROXY", None)
    with open(log, "wb") as fh:
        proc = subprocess.Popen(
            [str(exe), "--config", str(config), "--host", "127.0.0.1", "--port", str(port),
             "--num_workers", "1"],
            stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=work,
        )  # fmt: skip
    try:
        wait_port(port, proc, "litellm", log, 180)
    except RuntimeError as exc:
        proc.kill()
        proc.wait()
        return str(exc)
    return Server("litellm", proc, log, f"http://127.0.0.1:{port}")


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


def ratio(value: float, ref: float) -> str:
    """``value`` as a multiple of ``ref`` for the tables ("-" where there is no reference)."""
    return f"{value / ref:.2f}x" if ref > 0 else "-"


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


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


def bound(ms: list[float], processes: int, cores: int) -> float:
    """Calls/s a path's CPU per call (proxy, server behind it, client) allows: its proxy's
    processes use a core each at most, and everything shares the machine's cores."""
    own, total = ms[0], sum(ms)
    limits = [1000.0 * cores / total] if total > 0 else []
    if own > 0:
        limits.append(1000.0 * processes / own)
    return min(limits) if limits else float("inf")


def report(
    names: list[str],
    latency: dict[tuple[str, str], list[float]],
    rates: dict[tuple[str, str, int], list[float]],
    cpu: dict[tuple[str, str, int], list[tuple[float, float, float]]],
    notes: dict[str, str],
    processes: dict[str, int],
) -> None:
    """The tables; ``processes``: proxy processes per path where more than one."""
    kinds = [k for k, _, _ in KINDS]
    print("\nAdded latency per call at concurrency 1, ms (the path's p50/p95 minus direct's):")
    head = f"{'path':<10}"
    for kind in kinds:
        head += f" | {kind + ' p50':>20} {'p95':>6} {'x mitm':>7}"
    print(head)
    added: dict[tuple[str, str], tuple[float, float]] = {}
    for name in names:
        for kind in kinds:
            own, base = latency[(name, kind)], latency[("direct", kind)]
            added[(name, kind)] = (pct(own, 0.5) - pct(base, 0.5), pct(own, 0.95) - pct(base, 0.95))
    for name in names:
        line = f"{name:<10}"
        for kind in kinds:
            p50, p95 = added[(name, kind)]
            if name == "direct":
                p50, p95 = pct(latency[(name, kind)], 0.5), pct(latency[(name, kind)], 0.95)
                line += f" | {'(own) ' + f'{p50:.2f}':>20} {p95:>6.2f} {'':>7}"
                continue
            ref = added.get(("mitmdump", kind), (0.0, 0.0))[0]
            line += f" | {p50:>20.2f} {p95:>6.2f} {ratio(p50, ref):>7}"
        print(line)
    if ("agenttap", kinds[0]) in latency and ("policy", kinds[0]) in latency:
        # What agenttap itself adds: its latency over its policy's own (the stub called as
        # agenttap calls it), against what plain mitmdump adds over its server (the fake).
        print("\nagenttap over its policy, ms (agenttap's p50/p95 minus the policy path's):")
        print(
            f"{'path':<10}"
            + "".join(f" | {k + ' p50':>20} {'p95':>6} {'x mitm':>7}" for k in kinds)
        )
        line = f"{'agenttap':<10}"
        for kind in kinds:
            own, base = latency[("agenttap", kind)], latency[("policy", kind)]
            p50, p95 = pct(own, 0.5) - pct(base, 0.5), pct(own, 0.95) - pct(base, 0.95)
            ref = added.get(("mitmdump", kind), (0.0, 0.0))[0]
            line += f" | {p50:>20.2f} {p95:>6.2f} {ratio(p50, ref):>7}"
        print(line)
    print("\nThroughput, calls/s (median of rounds; x mitm: / plain mitmdump's):")
    cols = [(kind, c) for c in (32, 64) for kind in kinds]
    print(
        f"{'path':<10}"
        + "".join(f" | {f'{kind}, {c} clients':>27} {'x mitm':>6}" for kind, c in cols)
    )
    for name in names:
        line = f"{name:<10}"
        for kind, c in cols:
            value = statistics.median(rates[(name, kind, c)])
            ref = statistics.median(rates.get(("mitmdump", kind, c), [0.0]))
            line += f" | {value:>27.1f} {ratio(value, ref):>6}"
        print(line)
    print(
        f"\nCPU per call at 32 clients, ms (median of rounds; this machine has {os.cpu_count()} "
        "cores shared by every process): the path's server or proxy | the server behind the "
        "proxy | the bench client | all"
    )
    print(f"{'path':<10}" + "".join(f" | {kind:>34} {'bound':>7}" for kind in kinds))
    cores = os.cpu_count() or 1
    for name in names:
        line = f"{name:<10}"
        for kind in kinds:
            samples = cpu[(name, kind, 32)]
            ms = [statistics.median(s[i] for s in samples) for i in range(3)]
            cell = " | ".join(f"{v:.2f}" for v in (*ms, sum(ms)))
            line += f" | {cell:>34} {bound(ms, processes.get(name, 1), cores):>7.0f}"
        print(line)
    print(
        "bound: the most calls/s this CPU per call allows: each proxy process at most one core "
        "(Python), all processes together at most this machine's cores"
    )
    if "mitmdump-s" in names:
        streaming_ratios(names, kinds, added, rates)
    for name, note in notes.items():
        print(f"{name}: skipped ({note})")


def streaming_ratios(
    names: list[str],
    kinds: list[str],
    added: dict[tuple[str, str], tuple[float, float]],
    rates: dict[tuple[str, str, int], list[float]],
) -> None:
    """The ratios again, against mitmdump-s: a proxy that streams, as agenttap does (plain
    mitmdump sends a stream on only once it has ended)."""
    print("\nRatios to mitmdump-s (plain mitmdump relaying streams as they come):")
    cols = [(kind, c) for c in (32, 64) for kind in kinds]
    print(
        f"{'path':<10}"
        + "".join(f" | {f'added p50, {kind}':>27}" for kind in kinds)
        + "".join(f" | {f'calls/s, {kind}, {c}':>30}" for kind, c in cols)
    )
    for name in names:
        if name in ("direct", "mitmdump-s"):
            continue
        line = f"{name:<10}"
        for kind in kinds:
            ref = added.get(("mitmdump-s", kind), (0.0, 0.0))[0]
            line += f" | {ratio(added[(name, kind)][0], ref):>27}"
        for kind, c in cols:
            ref = statistics.median(rates[("mitmdump-s", kind, c)])
            line += f" | {ratio(statistics.median(rates[(name, kind, c)]), ref):>30}"
        print(line)


def main() -> int:
    global SYSTEM, POOL, TOOLS
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short run: 40 calls, 2 s, 1 round")
    parser.add_argument("--calls", type=int, default=200, help="latency calls per path and kind")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--seconds", type=float, default=5.0, help="per throughput measurement")
    parser.add_argument("--rounds", type=int, default=3, help="throughput rounds (median)")
    parser.add_argument("--no-litellm", action="store_true")
    parser.add_argument(
        "--pool",
        type=int,
        default=POOL,
        help="agenttap processes in the agenttap-2 path (0: no such path)",
    )
    parser.add_argument("--only", default="", help="comma-separated paths (direct always runs)")
    parser.add_argument(
        "--system-tokens",
        type=int,
        default=0,
        help="a system prompt this many tokens longer (agents send 10,000 and more)",
    )
    parser.add_argument(
        "--tools", type=int, default=0, help="function tools every call offers (agents: 10-40)"
    )
    parser.add_argument("--serve-fake", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--serve-stub", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_fake:
        serve_fake()
        return 0
    if args.serve_stub:
        serve_stub()
        return 0
    if args.quick:
        args.calls, args.warmup, args.seconds, args.rounds = 40, 5, 2.0, 1
    SYSTEM += "".join(" " + WORDS[i % len(WORDS)] for i in range(args.system_tokens))
    TOOLS = bench_tools(args.tools)
    wanted = [p for p in PATHS if not args.only or p == "direct" or p in args.only.split(",")]
    if args.no_litellm and "litellm" in wanted:
        wanted.remove("litellm")
    POOL = args.pool
    if POOL < 2 and "agenttap-2" in wanted:
        wanted.remove("agenttap-2")
    work = Path(tempfile.mkdtemp(prefix="agenttap-overhead-"))
    confdir = work / "conf"
    children: list[subprocess.Popen[bytes]] = []
    servers: dict[str, Server] = {}
    notes: dict[str, str] = {}
    try:
        fake, fake_url = spawn_child("--serve-fake", work)
        children.append(fake)
        servers["direct"] = Server("direct", fake, work / "serve-fake.log", fake_url)
        if "mitmdump" in wanted:
            servers["mitmdump"] = start_plain_mitmdump("mitmdump", fake_url, work, confdir)
            servers["mitmdump"].upstream = servers["direct"]
        if "mitmdump-s" in wanted:
            servers["mitmdump-s"] = start_plain_mitmdump(
                "mitmdump-s", fake_url, work, confdir, streaming=True
            )
            servers["mitmdump-s"].upstream = servers["direct"]
        if "agenttap" in wanted or "agenttap-2" in wanted:
            stub, stub_url = spawn_child("--serve-stub", work)
            children.append(stub)
            # The stub alone, called as agenttap calls it: agenttap's own share of its latency.
            servers["policy"] = Server("policy", stub, work / "serve-stub.log", stub_url)

            def agenttap(name: str) -> Server:
                server = start_agenttap(name, stub_url, work / "out" / name, work, confdir)
                server.upstream = servers["policy"]
                return server

            if "agenttap" in wanted:
                servers["agenttap"] = agenttap("agenttap")
            if "agenttap-2" in wanted and POOL > 1:
                pool = [agenttap(f"agenttap-2.{i}") for i in range(POOL)]
                pool[0].name, pool[0].members = "agenttap-2", pool[1:]
                servers["agenttap-2"] = pool[0]
        if "litellm" in wanted:
            started = start_litellm(fake_url, work)
            if isinstance(started, str):
                notes["litellm"] = started
            else:
                servers["litellm"] = started
                started.upstream = servers["direct"]
        names = [p for p in PATHS if p in servers]
        ca = confdir / "mitmproxy-ca-cert.pem"
        deadline = time.monotonic() + 30
        while not ca.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        kinds = {"policy": PolicyPath, "agenttap-2": PoolPath}
        paths = {name: kinds.get(name, Path_)(servers[name], ca) for name in names}
        print(
            f"paths: {', '.join(names)}; system prompt {len(SYSTEM.split())} words, "
            f"{len(TOOLS)} tools; "
            f"{args.calls} latency calls per path and kind after "
            f"{args.warmup} warm-up, throughput {args.seconds:g} s x {args.rounds} round(s); "
            f"logs in {work}",
            flush=True,
        )
        latency, rates, cpu = asyncio.run(
            measure(paths, args.calls, args.warmup, args.seconds, args.rounds)
        )
        report(
            names,
            latency,
            rates,
            cpu,
            notes,
            {name: 1 + len(server.members) for name, server in servers.items()},
        )
    finally:
        for server in servers.values():
            if server.name not in ("direct", "policy"):  # children, stopped below
                for member in (server, *server.members):
                    member.stop()
        for child in children:
            stop_child(child)
    return 0


if __name__ == "__main__":
    sys.exit(main())
