"""bench/overhead.py's servers, each in a process of its own: the fake OpenAI server, the
vLLM-shaped stub, plain mitmdump, agenttap and LiteLLM's proxy, with the CPU each has used."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import common
from bench.common import cpu_seconds, free_port

REPO = Path(__file__).resolve().parent.parent
QWEN3 = REPO.parent / "shared" / "tokenizers" / "qwen3"
MITMDUMP = REPO / ".venv" / "bin" / "mitmdump"
LITELLM_VENV = REPO / ".cache" / "litellm-venv"
# The script whose --serve-fake and --serve-stub run the servers (spawn_child).
OVERHEAD = Path(__file__).with_name("overhead.py")
STREAM_TOKENS = 64

# Milliseconds between a stream's tokens in the fake server and the stub (bench/paced.py sets it).
PACE_ENV = "OVERHEAD_PACE_MS"
# The most tokens a streamed answer asks for (bench/paced.py --tokens): the stub's reply is this long.
REPLY_ENV = "OVERHEAD_REPLY_TOKENS"
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


def serve_stub() -> None:
    """The vLLM-shaped stub policy, answering at once (``--serve-stub``), or streaming a token
    every OVERHEAD_PACE_MS milliseconds (bench/paced.py)."""
    longest = max(2 * STREAM_TOKENS, int(os.environ.get(REPLY_ENV) or 0))
    common.serve_stub(
        QWEN3,
        "".join(reply_words(longest)),
        float(os.environ.get(PACE_ENV) or 0) / 1000.0,
        cached_decode=True,
    )


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


def spawn_child(flag: str, work: Path) -> tuple[subprocess.Popen[bytes], str]:
    """bench/overhead.py in a child process serving ``flag``; its URL from its first line."""
    log = work / f"{flag.strip('-')}.log"
    proc = subprocess.Popen(
        [sys.executable, str(OVERHEAD), flag],
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
    return common.litellm_config(
        "gpt-4o-mini", "openai/gpt-4o-mini", f"{fake_url}/v1", "sk-fake", drop_params=True
    )


def start_litellm(fake_url: str, work: Path) -> Server | str:
    """LiteLLM's proxy (installed under .cache/ on first use) in front of the fake server, once
    it listens; else why it did not start."""
    exe = install_litellm(work)
    if exe is None:
        return "install failed"
    proc, port, log = common.start_litellm(exe, litellm_config(fake_url), work, new_session=False)
    try:
        wait_port(port, proc, "litellm", log, 180)
    except RuntimeError as exc:
        proc.kill()
        proc.wait()
        return str(exc)
    return Server("litellm", proc, log, f"http://127.0.0.1:{port}")
