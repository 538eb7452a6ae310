"""A vLLM-shaped scripted policy for tests that need a chosen completion (a tool call, say).

It answers ``/v1/completions`` with a token-id prompt exactly as vLLM 0.32 does (same fields,
same streaming chunks; ``tests/e2e/providers/test_stub_contract.py`` checks this against the real server), but
the completion is the next scripted text, tokenized with the real tokenizer and ended with EOS.
Like vLLM it clamps ``max_tokens`` to the context left (but refuses one over the whole context)
and refuses over-long prompts and unknown model names. ``chunk_tokens`` > 1 streams several tokens per chunk, as a lagging vLLM does.

A faulty policy, for the tests that need one: set ``fault`` (reset it after) and every completion
goes wrong after ``fault_after`` streamed chunks: ``garbage`` sends ``garbage`` as a stream line's
payload (as the whole body when not streaming), ``truncate`` ends the body there (a whole body is
cut in half), ``stall`` sends nothing more, ``keepalive`` sends only keep-alives (blank lines,
``: ping`` comments, chunks without tokens; whitespace into a whole body) until the caller leaves.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from typing import Any

from aiohttp import web
from transformers import AutoTokenizer

from tests.support.stub_engine import StubEngine


def _dumps(obj: Any) -> str:
    # vLLM writes compact JSON (pydantic's model_dump_json), non-ASCII as UTF-8.
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def _error(status: int, kind: str, message: str, param: str | None = None) -> web.Response:
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return web.json_response(body, status=status, dumps=_dumps)


class StubPolicy:
    def __init__(
        self, tokenizer_dir: str, model_name: str = "stub-policy", max_model_len: int = 32768
    ):
        self.tok = AutoTokenizer.from_pretrained(tokenizer_dir)
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.replies: deque[str] = deque()
        # Consulted before the script: a rule returning text answers that request (a client's
        # concurrent side calls, e.g. Claude Code's title call, arrive in no fixed order).
        self.rules: list[Callable[[dict[str, Any]], str | None]] = []
        self.default_reply = "OK."
        self.requests: list[dict[str, Any]] = []
        self.chunk_delay_s = 0.0
        # A hung policy: seconds before answering a completion at all; ``abandoned`` counts the
        # delayed requests whose caller had hung up by the time the delay ended.
        self.first_delay_s = 0.0
        self.abandoned = 0
        self.abandoned_at: set[int] = set()  # indices in ``requests`` of the abandoned ones
        self.chunk_tokens = 1
        # A policy that ran ahead of the proxy: a stream's token chunks all in one write, so
        # that they wait in the proxy's socket together (each still a chunk of its own).
        self.burst = False
        self.fault: str | None = None  # None, "garbage", "truncate", "stall" or "keepalive"
        self.fault_after = 0
        self.garbage = b"{not json"
        self.keepalive_every_s = 0.1
        self.url = ""
        # GET /health answers 200 (vLLM: an empty body) while true, 503 once false.
        self.healthy = True
        # vLLM's dev-mode routes (VLLM_SERVER_DEV_MODE=1) /pause, /resume, /is_paused, with
        # vLLM's shapes: served where ``dev_mode`` is set before start().
        self.dev_mode = False
        self.paused = False
        self.sleeping = False
        self._awake = asyncio.Event()  # set while neither paused nor sleeping (its own loop)
        # Requests of agenttap's own checks (health, fingerprints, probes: X-Request-Id
        # "agenttap-check-..."), kept apart from ``requests`` so that tests count calls alone.
        self.checks: list[dict[str, Any]] = []
        # Weights: every logprob it gives is shifted by ``shift``; a reload of folder P
        # (dev mode's POST /collective_rpc reload_weights) sets it to ``folders.get(P, 0.0)``.
        # ``extension``: it has agenttap's worker extension (agenttap_reload_weights).
        self.shift = 0.0
        self.folders: dict[str, float] = {}
        self.extension = True
        self.reloads: list[str] = []
        # LoRA adapters loaded (dev mode's /v1/load_lora_adapter): name -> folder; a request
        # naming one is answered with its folder's ``folders`` shift on top.
        self.loras: dict[str, str] = {}
        # A saturated engine (bounded generations at once, the rest queued; None: unbounded and
        # instant): tests/support/stub_engine.py. agenttap's own checks never wait in it.
        self.engine: StubEngine | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None

    # -- scripting --------------------------------------------------------------------------
    def script(self, *texts: str) -> None:
        self.replies.extend(texts)

    def _next_text(self, body: dict[str, Any]) -> str:
        for rule in self.rules:
            text = rule(body)
            if text is not None:
                return text
        return self.replies.popleft() if self.replies else self.default_reply

    def _completion_ids(
        self, body: dict[str, Any], max_tokens: int
    ) -> tuple[list[int], str, str | None]:
        """(ids, finish_reason, stop_reason) as vLLM would sample the scripted text."""
        # A re-score (prompt_logprobs) is not one of the scripted turns: it takes no reply.
        text = (
            self.default_reply if body.get("prompt_logprobs") is not None else self._next_text(body)
        )
        ids = list(self.tok.encode(text, add_special_tokens=False))
        stops = [body["stop"]] if isinstance(body.get("stop"), str) else body.get("stop") or []
        for n in range(1, min(len(ids), max_tokens) + 1):
            # As vLLM: generation ends on the token that completes a stop string; that token
            # stays in token_ids, the stop string is cut from the text.
            piece = self.tok.decode(ids[:n], skip_special_tokens=True)
            hit = next((s for s in stops if s in piece), None)
            if hit is not None:
                return ids[:n], "stop", hit
        if len(ids) + 1 > max_tokens:
            return ids[:max_tokens], "length", None
        return ids + [self.tok.convert_tokens_to_ids("<|im_end|>")], "stop", None

    def _logprob(self, i: int, token: int, model: str | None = None) -> float:
        """Under the base weights (``shift``), or plus a loaded LoRA adapter's own shift."""
        extra = self.folders.get(self.loras[model], 0.0) if model in self.loras else 0.0
        return self._logprob_of(i, token, self.shift + extra)

    @staticmethod
    def _logprob_of(i: int, token: int, shift: float = 0.0) -> float:
        """The logprob the stub gives ``token`` at position ``i`` under weights ``shift``."""
        return -((token * 7919 + i * 104729) % 1000) / 997.0 - 1e-3 - shift

    def _prompt_logprobs(
        self, prompt: list[int], asked: int | None, model: str | None = None
    ) -> list[Any] | None:
        """As vLLM: entry 0 null, then per prompt token {"<id>": {logprob, rank, decoded_token}}
        (with ``prompt_logprobs: 0`` just the prompt's own token). A rewrite's re-score in the
        proxy reads these; the value is a fixed function of the position and the token."""
        if asked is None:
            return None
        out: list[Any] = [None]
        for pos, token in enumerate(prompt[1:], start=1):
            entry = {"logprob": self._logprob(pos, token, model), "rank": 1 + token % 50}
            entry["decoded_token"] = self.tok.decode([token])
            out.append({str(token): entry})
        return out

    def _piece(self, ids: list[int], upto: int) -> str:
        return self.tok.decode(ids[:upto], skip_special_tokens=True)

    # -- server -----------------------------------------------------------------------------
    async def _models(self, request: web.Request) -> web.Response:
        now = int(time.time())
        return web.json_response(
            {
                "object": "list",
                "data": [
                    {
                        "id": self.model_name,
                        "object": "model",
                        "created": now,
                        "owned_by": "vllm",
                        "root": self.model_name,
                        "parent": None,
                        "max_model_len": self.max_model_len,
                        "permission": [
                            {
                                "id": "modelperm-" + uuid.uuid4().hex[:16],
                                "object": "model_permission",
                                "created": now,
                                "allow_create_engine": False,
                                "allow_sampling": True,
                                "allow_logprobs": True,
                                "allow_search_indices": False,
                                "allow_view": True,
                                "allow_fine_tuning": False,
                                "organization": "*",
                                "group": None,
                                "is_blocking": False,
                            }
                        ],
                    }
                ],
            },
            dumps=_dumps,
        )

    async def _tokenize(self, request: web.Request) -> web.Response:
        """vLLM's POST /tokenize (a prompt's ids with its tokenizer)."""
        body = await request.json()
        ids = self.tok.encode(
            body["prompt"], add_special_tokens=body.get("add_special_tokens", True)
        )
        return web.json_response(
            {
                "count": len(ids),
                "max_model_len": self.max_model_len,
                "tokens": ids,
                "token_strs": None,
            }
        )

    async def _detokenize(self, request: web.Request) -> web.Response:
        """vLLM's POST /detokenize (ids to text with its tokenizer; an id past its vocabulary
        decodes to nothing, as vLLM's does)."""
        body = await request.json()
        ids = [i for i in body["tokens"] if 0 <= i < len(self.tok)]
        return web.json_response({"prompt": self.tok.decode(ids)})

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        check = request.headers.get("X-Request-Id", "").startswith("agenttap-check-")
        if check:
            self.checks.append(body)
        else:
            self.requests.append(body)
        index = len(self.requests) - 1
        engine = self.engine
        if engine is None or check:
            return await self._complete(request, body, index)
        async with engine.generation(body):
            return await self._complete(request, body, index)

    async def _complete(
        self, request: web.Request, body: dict[str, Any], index: int
    ) -> web.StreamResponse:
        if not self.healthy:
            # As a vLLM whose engine died: /health answers 503, generations fail.
            return _error(503, "ServiceUnavailableError", "The engine is not running.")
        # As vLLM: a paused or sleeping engine schedules nothing until it is resumed or woken.
        if self.paused or self.sleeping:
            self._awake.clear()
            await self._awake.wait()
        if self.first_delay_s:
            await asyncio.sleep(self.first_delay_s)
            if request.transport is None or request.transport.is_closing():
                self.abandoned += 1
                self.abandoned_at.add(index)
                return web.Response(status=499)
        prompt = body["prompt"]
        if body.get("model") != self.model_name and body.get("model") not in self.loras:
            return _error(
                404,
                "NotFoundError",
                f"The model `{body.get('model')}` does not exist. Valid aliases: {self.model_name}.",
                "model",
            )
        if not (isinstance(prompt, list) and all(isinstance(x, int) for x in prompt)):
            return _error(400, "BadRequestError", "stub takes token-id prompts", "prompt")
        # As vLLM: a prompt over the context is refused; max_tokens (default 16) is clamped to
        # what the context has left, and refused when nothing is left.
        room = self.max_model_len - len(prompt)
        if room < 0:
            return _error(
                400,
                "BadRequestError",
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"your prompt contains {len(prompt)} input tokens, which exceeds this limit even "
                "without any output tokens. Please reduce the length of the input prompt. "
                f"(parameter=input_tokens, value={len(prompt)})",
                "input_tokens",
            )
        asked = body["max_tokens"] if body.get("max_tokens") is not None else 16
        if asked > self.max_model_len:
            return _error(
                400,
                "BadRequestError",
                f"max_tokens={asked} cannot be greater than max_model_len={self.max_model_len}. "
                f"Please request fewer output tokens. (parameter=max_tokens, value={asked})",
                "max_tokens",
            )
        max_tokens = min(asked, room)
        if max_tokens < 1:
            return _error(
                400,
                "BadRequestError",
                f"max_tokens must be at least 1, got {max_tokens}. "
                f"(parameter=max_tokens, value={max_tokens})",
                "max_tokens",
            )
        ids, finish, stop_reason = self._completion_ids(body, max_tokens)
        rid = "cmpl-" + uuid.uuid4().hex[:16]
        created = int(time.time())
        texts = [self._piece(ids, i + 1)[len(self._piece(ids, i)) :] for i in range(len(ids))]
        if stop_reason is not None:
            full = "".join(texts)
            cut = full.index(stop_reason)
            # The last token's text shrinks so the text ends where the stop string began.
            texts[-1] = texts[-1][: max(0, len(texts[-1]) - (len(full) - cut))]
        logprobs = [self._logprob(i, t, body.get("model")) for i, t in enumerate(ids)]
        # As vLLM: return_token_ids adds the ids (and the prompt's); return_tokens_as_token_ids
        # spells logprobs' tokens "token_id:N" instead of their text.
        echo_ids = bool(body.get("return_token_ids"))
        as_ids = bool(body.get("return_tokens_as_token_ids"))

        def token(t: int) -> str:
            return f"token_id:{t}" if as_ids else self.tok.decode([t])

        if not body.get("stream") and self.fault in ("garbage", "keepalive"):
            return await self._whole_fault(request)
        if not body.get("stream"):
            offsets, pos = [], 0
            for t in texts:
                offsets.append(pos)
                pos += len(t)
            choice = {
                "index": 0,
                "text": "".join(texts),
                "logprobs": {
                    "text_offset": offsets,
                    "token_logprobs": logprobs,
                    "tokens": [token(t) for t in ids],
                    "top_logprobs": [{token(t): lp} for t, lp in zip(ids, logprobs, strict=True)],
                },
                "finish_reason": finish,
                "stop_reason": stop_reason,
                "token_ids": ids if echo_ids else None,
                "prompt_logprobs": self._prompt_logprobs(
                    prompt, body.get("prompt_logprobs"), body.get("model")
                ),
                "prompt_token_ids": prompt if echo_ids else None,
                "routed_experts": None,
            }
            whole = web.json_response(
                {
                    "id": rid,
                    "object": "text_completion",
                    "created": created,
                    "model": self.model_name,
                    "choices": [choice],
                    "service_tier": None,
                    "system_fingerprint": "stub",
                    "usage": {
                        "prompt_tokens": len(prompt),
                        "total_tokens": len(prompt) + len(ids),
                        "completion_tokens": len(ids),
                        "prompt_tokens_details": None,
                        "completion_tokens_details": None,
                    },
                    "kv_transfer_params": None,
                    "ec_transfer_params": None,
                    "metrics": None,
                },
                dumps=_dumps,
            )
            if self.fault == "truncate":
                assert isinstance(whole.body, bytes)
                whole.body = whole.body[: len(whole.body) // 2]
            return whole
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await resp.prepare(request)
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        # vLLM sends what the engine produced since the last chunk: usually one token, several
        # when the server lags behind. ``chunk_tokens`` lets a test ask for the latter.
        size = max(1, self.chunk_tokens)
        starts = range(0, len(ids), size)
        pos = 0
        held: list[bytes] = []  # the chunks of a burst
        for i, start in enumerate(starts):
            if self.fault and i == self.fault_after:
                return await self._stream_fault(request, resp)
            part = range(start, min(start + size, len(ids)))
            offsets = []
            for j in part:
                offsets.append(pos)
                pos += len(texts[j])
            last = i == len(starts) - 1
            chunk: dict[str, Any] = {
                "id": rid,
                "object": "text_completion",
                "created": created,
                "model": self.model_name,
                "choices": [
                    {
                        "index": 0,
                        "text": "".join(texts[j] for j in part),
                        "logprobs": {
                            "text_offset": offsets,
                            "token_logprobs": [logprobs[j] for j in part],
                            "tokens": [token(ids[j]) for j in part],
                            "top_logprobs": [{token(ids[j]): logprobs[j]} for j in part],
                        },
                        "finish_reason": finish if last else None,
                        "stop_reason": stop_reason if last else None,
                        "prompt_token_ids": prompt if i == 0 and echo_ids else None,
                        "token_ids": [ids[j] for j in part] if echo_ids else None,
                    }
                ],
            }
            if last and not include_usage:
                # As vLLM: the fingerprint rides on the usage chunk, or else on the last one.
                chunk["system_fingerprint"] = "stub"
            line = b"data: " + _dumps(chunk).encode() + b"\n\n"
            if self.burst:
                held.append(line)
            else:
                await resp.write(line)
            if self.chunk_delay_s:
                await asyncio.sleep(self.chunk_delay_s)
        if held:
            await resp.write(b"".join(held))
        if include_usage:
            usage = {
                "prompt_tokens": len(prompt),
                "total_tokens": len(prompt) + len(ids),
                "completion_tokens": len(ids),
            }
            final = {
                "id": rid,
                "object": "text_completion",
                "created": created,
                "model": self.model_name,
                "choices": [],
                "usage": usage,
                "system_fingerprint": "stub",
            }
            await resp.write(b"data: " + _dumps(final).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def _whole_fault(self, request: web.Request) -> web.StreamResponse:
        if self.fault == "garbage":
            return web.Response(body=self.garbage, content_type="application/json")
        # keepalive: a chunked 200 whose body never gets past leading whitespace.
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(request)
        await self._keep_alive(request, resp, [b" "])
        return resp

    async def _stream_fault(
        self, request: web.Request, resp: web.StreamResponse
    ) -> web.StreamResponse:
        if self.fault == "garbage":
            await resp.write(b"data: " + self.garbage + b"\n\n")
        elif self.fault == "stall":
            await self._keep_alive(request, resp, [])
        elif self.fault == "keepalive":
            empty = {"choices": [{"index": 0, "text": "", "token_ids": [], "logprobs": None,
                                  "finish_reason": None}]}  # fmt: skip
            alive = [b"\n", b": ping\n\n", b"data: " + _dumps(empty).encode() + b"\n\n"]
            await self._keep_alive(request, resp, alive)
        # truncate, and the others once the caller has gone: the body ends here.
        try:
            await resp.write_eof()
        except ConnectionError:
            pass
        return resp

    async def _keep_alive(
        self, request: web.Request, resp: web.StreamResponse, beats: list[bytes]
    ) -> None:
        """Send ``beats`` in turn (nothing if empty) until the caller hangs up (at most 2 min)."""
        for n in range(int(120 / self.keepalive_every_s)):
            if request.transport is None or request.transport.is_closing():
                return
            if beats:
                try:
                    await resp.write(beats[n % len(beats)])
                except ConnectionError:
                    return
            await asyncio.sleep(self.keepalive_every_s)

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.healthy else 503)

    async def _pause(self, request: web.Request) -> web.Response:
        self.paused = True
        return web.json_response({"status": "paused"})

    async def _resume(self, request: web.Request) -> web.Response:
        self.paused = False
        self._wake()
        return web.json_response({"status": "resumed"})

    def _wake(self) -> None:
        if not (self.paused or self.sleeping):
            self._awake.set()

    def set_paused(self, paused: bool) -> None:
        """Pause or resume from a test's thread (as POST /pause?mode=keep, /resume)."""
        assert self._loop is not None
        self.paused = paused
        self._loop.call_soon_threadsafe(self._wake)

    async def _is_paused(self, request: web.Request) -> web.Response:
        # As vLLM: sleeping pauses the scheduler too.
        return web.json_response({"is_paused": self.paused or self.sleeping})

    async def _metrics(self, request: web.Request) -> web.Response:
        """vLLM's sleep-state gauge (vLLM's /metrics has it; the rest is left out)."""
        labels = f'engine="0",model_name="{self.model_name}",sleep_state="awake"'
        awake = 0.0 if self.sleeping else 1.0
        return web.Response(text=f"vllm:engine_sleep_state{{{labels}}} {awake}\n")

    async def _sleep(self, request: web.Request) -> web.Response:
        self.sleeping = True
        return web.Response(status=200)

    async def _wake_up(self, request: web.Request) -> web.Response:
        self.sleeping = False
        self._wake()
        return web.Response(status=200)

    async def _is_sleeping(self, request: web.Request) -> web.Response:
        # As vLLM: true while paused as well (its engine's is_sleeping is paused or asleep).
        return web.json_response({"is_sleeping": self.sleeping or self.paused})

    async def _collective_rpc(self, request: web.Request) -> web.Response:
        """vLLM's reload (``reload_weights``) and agenttap's worker extension's
        (``agenttap_reload_weights``): the folder's weights serve from now on (``folders``)."""
        body = await request.json()
        method = body.get("method")
        path = str((body.get("kwargs") or {}).get("weights_path", ""))
        if method == "agenttap_reload_weights" and not self.extension:
            return _error(
                500,
                "InternalServerError",
                "Call to collective_rpc method failed: Worker failed with error ''CPUWorker' "
                "object has no attribute 'agenttap_reload_weights'', please check the stack "
                "trace above for the root cause",
            )
        if method not in ("reload_weights", "agenttap_reload_weights"):
            return _error(500, "InternalServerError", f"Method {method!r} is not implemented.")
        self.reloads.append(path)
        self.shift = self.folders.get(path, 0.0)
        return web.json_response({"results": [None if method == "reload_weights" else []]})

    async def _load_lora(self, request: web.Request) -> web.Response:
        body = await request.json()
        name = body["lora_name"]
        if name in self.loras:
            return _error(
                400,
                "BadRequestError",
                f"The lora adapter '{name}' has already been loaded.",
            )
        self.loras[name] = str(body["lora_path"])
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def _unload_lora(self, request: web.Request) -> web.Response:
        name = (await request.json())["lora_name"]
        if self.loras.pop(name, None) is None:
            return _error(404, "NotFoundError", f"The lora adapter '{name}' cannot be found.")
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")

    async def _ok(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    def start(self, socket_path: str | None = None) -> str:
        """Serve on 127.0.0.1 (or on the unix socket ``socket_path``, as vLLM's --uds) from a
        background thread; returns the base URL (``unix:PATH`` for a socket)."""
        ready = threading.Event()

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            app = web.Application()
            app.router.add_get("/v1/models", self._models)
            app.router.add_post("/v1/completions", self._completions)
            app.router.add_post("/tokenize", self._tokenize)
            app.router.add_post("/detokenize", self._detokenize)
            app.router.add_get("/health", self._health)
            if self.dev_mode:
                app.router.add_post("/pause", self._pause)
                app.router.add_post("/resume", self._resume)
                app.router.add_get("/is_paused", self._is_paused)
                app.router.add_post("/sleep", self._sleep)
                app.router.add_post("/wake_up", self._wake_up)
                app.router.add_get("/is_sleeping", self._is_sleeping)
                app.router.add_get("/metrics", self._metrics)
                app.router.add_post("/collective_rpc", self._collective_rpc)
                app.router.add_post("/reset_prefix_cache", self._ok)
                app.router.add_post("/update_weight_version", self._ok)
                app.router.add_post("/v1/load_lora_adapter", self._load_lora)
                app.router.add_post("/v1/unload_lora_adapter", self._unload_lora)
            self._runner = web.AppRunner(app, access_log=None)
            loop.run_until_complete(self._runner.setup())
            if socket_path is not None:
                unix = web.UnixSite(self._runner, socket_path)
                loop.run_until_complete(unix.start())
                self.url = f"unix:{socket_path}"
            else:
                site = web.TCPSite(self._runner, "127.0.0.1", 0)
                loop.run_until_complete(site.start())
                port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
                self.url = f"http://127.0.0.1:{port}"
            ready.set()
            loop.run_forever()

        threading.Thread(target=run, daemon=True, name="stub-vllm").start()
        ready.wait(30)
        return self.url

    def stop(self) -> None:
        if self._loop and self._runner:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
            self._loop.call_soon_threadsafe(self._loop.stop)
