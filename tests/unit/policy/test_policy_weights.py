"""Weight updates (capture/policy/weights.py) against a scripted server with vLLM's dev routes
(/pause?mode=abort, /collective_rpc, /reset_prefix_cache, /update_weight_version, /resume) and
its /v1/completions stream (which labels no versions: agenttap does). The real vLLM:
``tests/e2e/policy/test_policy_weights_vllm.py``."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from capture.control.sessions import EndReason, SessionControl
from capture.policy.replicas import ReplicaSet
from capture.policy.weights import (
    PolicyWeights,
    WeightHistory,
    WeightUpdateError,
    check_version,
    check_weights_dir,
)
from rewriter.canonical import SamplingParams
from rewriter.vllm_client import Completion, VLLMClient


class DevServer:
    """vLLM-shaped: the first generation streams 3 tokens and then waits; /pause?mode=abort
    ends it with ``finish_reason: abort``; generations that arrive while paused wait for
    /resume and then stream 4 tokens."""

    def __init__(self, fail_reload: bool = False) -> None:
        self.calls: list[str] = []
        self.bodies: list[dict[str, Any]] = []
        self.paused = asyncio.Event()
        self.resumed = asyncio.Event()
        self.resumed.set()
        self.streaming = asyncio.Event()
        self.fail_reload = fail_reload
        self.label = "default"
        self.checks: list[dict[str, Any]] = []

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.completions)
        for name in ("pause", "collective_rpc", "reset_prefix_cache", "update_weight_version"):
            app.router.add_post(f"/{name}", self.dev)
        app.router.add_post("/resume", self.resume)
        return app

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "tiny", "max_model_len": 1000}]})

    async def dev(self, request: web.Request) -> web.Response:
        name = request.path.strip("/")
        body = await request.json()
        self.calls.append(name + (f"?{request.query_string}" if request.query_string else ""))
        if name == "pause":
            self.resumed.clear()
            self.paused.set()
        if name == "collective_rpc":
            assert body["method"] in ("agenttap_reload_weights", "reload_weights")
            if self.fail_reload:
                return web.json_response({"error": "no such file"}, status=500)
        if name == "update_weight_version":
            self.label = body["new_version"]
        return web.json_response({"status": "ok"})

    async def resume(self, request: web.Request) -> web.Response:
        self.calls.append("resume")
        self.paused.clear()
        self.resumed.set()
        return web.json_response({"status": "resumed"})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if body.get("prompt_logprobs") is not None:
            # agenttap's fingerprint of the weights after an update (a 1-token generation).
            await self.resumed.wait()
            self.checks.append(body)
            entries = [None] + [{str(t): {"logprob": -1.0}} for t in body["prompt"][1:]]
            choice = {"index": 0, "text": "", "prompt_logprobs": entries, "finish_reason": "length"}
            return web.json_response({"choices": [choice]})
        self.bodies.append(body)
        first = len(self.bodies) == 1
        await self.resumed.wait()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)

        async def chunk(ids: list[int], finish: str | None) -> None:
            choice = {
                "index": 0,
                "text": "".join(f"<{t}>" for t in ids),
                "token_ids": ids,
                "logprobs": {"tokens": [f"<{t}>" for t in ids],
                             "token_logprobs": [-t / 100 for t in ids]},
                "finish_reason": finish,
                "stop_reason": None,
            }  # fmt: skip
            await resp.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())

        if first:
            for t in (10, 11, 12):
                await chunk([t], None)
            self.streaming.set()
            await self.paused.wait()
            await chunk([], "abort")
        else:
            for t in (13, 14, 15):
                await chunk([t], None)
            await chunk([16], "length")
        await resp.write(b"data: [DONE]\n\n")
        return resp


async def _serve(server: DevServer) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(server.app())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


async def _generate(client: VLLMClient) -> Completion:
    """Seven tokens after the prompt [1, 2], streamed and stitched across aborts."""
    out = Completion()
    async for delta in client.stream_resuming([1, 2], SamplingParams(max_tokens=7)):
        out.extend(delta)
    return out


def _weights_dir(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"x")
    return tmp_path


async def test_a_generation_across_an_update_has_two_spans(tmp_path: Path) -> None:
    server = DevServer()
    runner, url = await _serve(server)
    try:
        async with aiohttp.ClientSession() as http:
            replicas = ReplicaSet([url], lambda u: VLLMClient(u, http, api="completions"))
            client = replicas.replicas[url].client
            weights = PolicyWeights()

            task = asyncio.create_task(_generate(client))
            await asyncio.wait_for(server.streaming.wait(), 10)
            outcomes = await weights.update(http, replicas, _weights_dir(tmp_path), "step-1")
            out = await asyncio.wait_for(task, 10)
    finally:
        await runner.cleanup()
    assert out.token_ids == [10, 11, 12, 13, 14, 15, 16]
    # Sampled before the pause: the old weights'; resumed after the reload: the new ones'.
    assert out.weight_versions == [("default", 0, 3), ("step-1", 3, 7)]
    assert server.bodies[1]["prompt"] == [1, 2, 10, 11, 12]
    assert server.calls == [
        "pause?mode=abort",
        "collective_rpc",
        "reset_prefix_cache",
        "update_weight_version",
        "resume",
    ]
    assert server.label == "step-1" and client.weight_version == "step-1"
    assert client.incoming_version is None
    assert [o["ok"] for o in outcomes] == [True]
    assert weights.history.current == "step-1" and weights.history.index == 1


async def test_a_failed_reload_still_resumes_and_says_which_server(tmp_path: Path) -> None:
    server = DevServer(fail_reload=True)
    runner, url = await _serve(server)
    try:
        async with aiohttp.ClientSession() as http:
            replicas = ReplicaSet([url], lambda u: VLLMClient(u, http, api="completions"))
            client = replicas.replicas[url].client
            weights = PolicyWeights()

            task = asyncio.create_task(_generate(client))
            await asyncio.wait_for(server.streaming.wait(), 10)
            with pytest.raises(WeightUpdateError) as caught:
                await weights.update(http, replicas, _weights_dir(tmp_path), "step-1")
            out = await asyncio.wait_for(task, 10)
    finally:
        await runner.cleanup()
    # The resumed part ran on the weights the server kept: never labelled step-1.
    assert out.weight_versions == [("default", 0, 7)]
    assert server.calls[-1] == "resume"  # never left paused
    assert url in str(caught.value) and "500" in str(caught.value)
    assert caught.value.replicas[0]["ok"] is False
    assert replicas.replicas[url].client.weight_version == "default"
    assert weights.history.index == 0


def test_history_counts_updates() -> None:
    history = WeightHistory()
    assert (history.current, history.index) == ("default", 0)
    history.add("a")
    history.add("a")  # the same weights again: no new version
    history.add("b")
    assert (history.current, history.index) == ("b", 2)


def test_bad_bodies_are_refused_with_what_to_do(tmp_path: Path) -> None:
    for bad in ("", 3.5, True, "x" * 200, "a\nb", None):
        with pytest.raises(ValueError, match="version"):
            check_version(bad)
    assert check_version(7) == "7"
    with pytest.raises(ValueError, match="absolute"):
        check_weights_dir("relative/dir")
    with pytest.raises(ValueError, match="no folder"):
        check_weights_dir(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="safetensors"):
        check_weights_dir(str(tmp_path))
    assert check_weights_dir(str(_weights_dir(tmp_path))) == tmp_path


def test_a_session_too_many_updates_behind_is_ended_stale() -> None:
    control = SessionControl()
    index = [0]
    control.version_index = lambda: index[0]
    control.max_staleness = 1
    assert control.refusal("old") is None  # its first call: version 0
    index[0] = 1
    assert control.refusal("old") is None  # one behind: allowed
    assert control.refusal("new") is None  # first call under version 1
    index[0] = 2
    assert control.refusal("old") == EndReason.STALE
    assert control.refusal("new") is None
    closed = control.close("old")
    assert closed.end_reason == EndReason.STALE
    # Its metrics say how far behind it was: two updates since its first call.
    assert closed.metrics.version_lag == 2 and closed.summary()["metrics"]["version_lag"] == 2
    control.max_staleness = None
    index[0] = 10
    assert control.refusal("new") is None
    control.call_started("new")
    control.call_finished("new")  # while open, the lag so far
    live = control.get("new")
    assert live is not None and live.metrics.version_lag == 9


async def test_a_step_whose_connection_drops_unanswered_is_sent_once_more() -> None:
    """A pooled connection the server closes as the update's /pause is written to it (a broken
    pipe, seen in a training run): an idempotent step is sent again on a new connection; a
    step that is not (loading a LoRA adapter) is not, and fails naming its URL."""
    from capture.policy.weights import _post

    seen: list[bytes] = []

    async def drop_first(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        seen.append(head.split(b" ", 2)[1])
        if len(seen) % 2 == 1:  # every other request: the connection dropped, unanswered
            writer.close()
            return
        length = int(head.lower().split(b"content-length: ", 1)[1].split(b"\r\n", 1)[0])
        await reader.readexactly(length)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(drop_first, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    async with aiohttp.ClientSession() as http:
        client = VLLMClient(url, http, api="completions")
        await _post(client, "/pause?mode=abort")
        assert seen == [b"/pause?mode=abort"] * 2
        with pytest.raises(RuntimeError, match=r"POST .*/v1/load_lora_adapter failed"):
            await _post(client, "/v1/load_lora_adapter", {"lora_name": "a"})
        assert seen[2:] == [b"/v1/load_lora_adapter"]
    server.close()
    await server.wait_closed()
