"""Weight-version spans: parsed from vLLM's generate endpoint and stitched across resumed
generations (a scripted generate-shaped server; the real vLLM is in
``test_weight_versions_vllm.py``)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import aiohttp
from aiohttp import web

from capture.storage.records import TurnRecord
from rewriter.canonical import SamplingParams
from rewriter.vllm_client import Completion, CompletionDelta, VLLMClient


def test_extend_offsets_nothing_and_merges_same_version() -> None:
    out = Completion()
    out.extend(CompletionDelta("a", [1, 2], [-1.0, -2.0], weight_versions=[("v1", 0, 2)]))
    out.extend(CompletionDelta("b", [3], [-3.0], weight_versions=[("v1", 2, 3)]))
    out.extend(CompletionDelta("c", [4], [-4.0], weight_versions=[("v2", 3, 4)]))
    assert out.weight_versions == [("v1", 0, 3), ("v2", 3, 4)]
    assert out.token_ids == [1, 2, 3, 4]


def test_turn_record_round_trips_weight_versions() -> None:
    spans = [{"version": "v1", "start": 0, "end": 3}]
    row = dict(_record().to_row(), weight_versions=spans)
    assert TurnRecord.from_row(json.loads(json.dumps(row))).weight_versions == spans
    # A journal line written before the field existed still loads (empty: unknown).
    del row["weight_versions"]
    assert TurnRecord.from_row(row).weight_versions == []


def _record() -> TurnRecord:
    return TurnRecord(
        session_id="s", request_id="r", turn_index=0, protocol="openai.chat",
        requested_model="m", policy_model="m", backend="b", user_agent="u",
        prompt_ids=[1], completion_ids=[2], completion_logprobs=[-1.0],
        finish_reason="stop", response_finish_reason="stop", started_at=0.0,
        latency_s=0.0, stream=False,
    )  # fmt: skip


class GenerateServer:
    """Answers /inference/v1/generate like vLLM: the first generation is aborted after 3 tokens
    under weights v1, the resumed one finishes under v2 (one span changing mid-way: v2, v3)."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "tiny", "max_model_len": 1000}]})

    async def render(self, request: web.Request) -> web.Response:
        return web.json_response([{"sampling_params": {"temperature": 0.6, "top_k": 20}}])

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if not body:
            return web.json_response({"error": {"message": "token_ids required"}}, status=400)
        self.bodies.append(body)
        first = len(self.bodies) == 1
        ids = [10, 11, 12] if first else [13, 14, 15, 16]
        finish = "abort" if first else "length"
        spans = [{"version": "v1", "start": 0, "end": 3}] if first else [
            {"version": "v2", "start": 0, "end": 2},
            {"version": "v3", "start": 2, "end": 4},
        ]  # fmt: skip
        choices: list[dict[str, Any]] = [
            {
                "index": 0, "text": f"<{t}>", "token_ids": [t], "finish_reason": None,
                "logprobs": {"content": [{"token": f"<{t}>", "logprob": -t / 10}]},
                "weight_versions": None,
            }
            for t in ids
        ]  # fmt: skip
        if first:  # vLLM's abort: a last chunk with no tokens
            choices.append({"index": 0, "text": "", "token_ids": [], "logprobs": {"content": []}})
        choices[-1].update(finish_reason=finish, weight_versions=spans)
        if not body["stream"]:
            whole = {
                "index": 0,
                "text": "".join(c["text"] for c in choices),
                "token_ids": ids,
                "finish_reason": finish,
                "logprobs": {"content": [x for c in choices for x in c["logprobs"]["content"]]},
                "weight_versions": spans,
            }
            return web.json_response({"choices": [whole]})
        return await stream_choices(request, choices)


async def stream_choices(request: web.Request, choices: list[dict[str, Any]]) -> web.StreamResponse:
    """vLLM's SSE: one chunk per choice, then [DONE]."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for choice in choices:
        await resp.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
    await resp.write(b"data: [DONE]\n\n")
    return resp


async def _run(
    stream: bool,
    server: GenerateServer | None = None,
    decode: Callable[[list[int]], str] | None = None,
    prompt: list[int] | None = None,
) -> tuple[Completion, GenerateServer]:
    server = server or GenerateServer()
    app = web.Application()
    app.router.add_get("/v1/models", server.models)
    app.router.add_post("/v1/completions/render", server.render)
    app.router.add_post("/inference/v1/generate", server.generate)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        async with aiohttp.ClientSession() as http:
            client = VLLMClient(f"http://127.0.0.1:{port}", http, decode=decode)
            out = Completion()
            params = SamplingParams(max_tokens=7, temperature=1.0)
            async for delta in client.stream_resuming(prompt or [1, 2], params, stream=stream):
                out.extend(delta)
    finally:
        await runner.cleanup()
    return out, server


async def test_spans_of_a_resumed_generation_are_offset() -> None:
    for stream in (True, False):
        out, server = await _run(stream)
        assert out.token_ids == [10, 11, 12, 13, 14, 15, 16]
        assert out.logprobs == [-1.0, -1.1, -1.2, -1.3, -1.4, -1.5, -1.6]
        assert out.text == "<10><11><12><13><14><15><16>"
        assert out.finish_reason == "length"
        # The second generation's spans count its own tokens; shifted by the 3 before it.
        assert out.weight_versions == [("v1", 0, 3), ("v2", 3, 5), ("v3", 5, 7)]
        first, resumed = (b["sampling_params"] for b in server.bodies)
        assert server.bodies[1]["token_ids"] == [1, 2, 10, 11, 12]
        assert (first["max_tokens"], resumed["max_tokens"]) == (7, 4)
        # The server's defaults fill what the request left unset; the request's own win.
        assert (first["temperature"], first["top_k"], first["logprobs"]) == (1.0, 20, 0)
        assert server.bodies[0]["output_mode"] == "text"


class SplitCharacterServer(GenerateServer):
    """Real Qwen3 ids for "Hi 😀 there, 雪 ok"; the first generation is aborted after the first
    of the three byte tokens of 雪. Its text is held back there, as vLLM holds back an
    incomplete character; the resumed generation's first text repeats the whole prompt and the
    completion so far, as vLLM's detokenizer does when a resubmitted prompt ends inside a
    character (seen against the real vLLM)."""

    IDS = [13048, 90316, 1052, 11, 18137, 249, 103, 5394]
    TEXTS = ["Hi", " 😀", " there", ",", "", "", None, " ok"]

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        super().__init__()
        self.decode = decode

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if not body:
            return await super().generate(request)  # the probe for the endpoint
        self.bodies.append(body)
        first = len(self.bodies) == 1
        span = range(0, 5) if first else range(5, 8)
        choices: list[dict[str, Any]] = []
        for i in span:
            text = self.TEXTS[i]
            if text is None:  # the quirk: the decoded prompt (tokens so far included) and 雪
                text = self.decode(body["token_ids"] + self.IDS[5 : i + 1])
            choices.append({"index": 0, "text": text, "token_ids": [self.IDS[i]], "finish_reason": None,
                            "logprobs": {"content": [{"token": "x", "logprob": -0.5}]}})  # fmt: skip
        if first:
            choices.append({"index": 0, "text": "", "token_ids": [], "logprobs": {"content": []}})
        choices[-1]["finish_reason"] = "abort" if first else "stop"
        return await stream_choices(request, choices)


async def test_resumed_text_is_decoded_from_the_stitched_ids(qwen3_dir: Any) -> None:
    from rewriter.template import ChatTemplate

    template = ChatTemplate(qwen3_dir)

    def decode(ids: list[int]) -> str:
        return template.decode(ids, skip_special_tokens=True)

    prompt = template.encode("<|im_start|>user\nSay hi<|im_end|>\n<|im_start|>assistant\n")
    out, server = await _run(True, SplitCharacterServer(decode), decode, prompt)
    assert out.token_ids == SplitCharacterServer.IDS
    assert server.bodies[1]["token_ids"] == prompt + SplitCharacterServer.IDS[:5]
    assert out.text == decode(SplitCharacterServer.IDS) == "Hi 😀 there, 雪 ok"
    # Without the tokenizer the client can only pass on what the server said.
    out, _ = await _run(True, SplitCharacterServer(decode), None, prompt)
    assert out.text != "Hi 😀 there, 雪 ok" and "Say hi" in out.text
