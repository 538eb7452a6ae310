"""The stub speaks vLLM's token-id completions API exactly as the real vLLM does.

The same request goes to the real vLLM and to ``tests/support/stub_vllm.py``; the JSON that comes back
must have the same shape (the same keys at every level, the same value types), the same streamed
chunk kinds in the same order, and the same SSE framing. Values differ (the stub's completion is
scripted), shapes must not: tests that trust the stub then hold for vLLM.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.paths import IM_END
from tests.support.stub_vllm import StubPolicy

pytestmark = pytest.mark.vllm

LONG_REPLY = "Hello there! How are you doing today? I hope the weather is fine where you are."


# -- helpers ---------------------------------------------------------------------------------


def shape(value: Any, key: str | None = None) -> Any:
    """The JSON shape of ``value``: dict keys kept, lists reduced to their distinct item shapes,
    scalars replaced by their type name. ``top_logprobs`` entries map token text to a logprob,
    so their keys (the tokens) are data, not shape."""
    if isinstance(value, dict):
        if key == "top_logprobs":
            return {"<token>": _distinct(shape(v) for v in value.values())}
        return {k: shape(v, k) for k, v in value.items()}
    if isinstance(value, list):
        return _distinct(shape(v, key) for v in value)
    return type(value).__name__


def _distinct(items: Iterator[Any]) -> list[Any]:
    out: list[Any] = []
    for item in items:
        if item not in out:
            out.append(item)
    return out


def shape_diff(a: Any, b: Any, path: str = "$") -> list[str]:
    """Where two shapes differ, as readable paths (empty when equal)."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = [f"{path}.{k}: only in vLLM" for k in a.keys() - b.keys()]
        out += [f"{path}.{k}: only in the stub" for k in b.keys() - a.keys()]
        for k in a.keys() & b.keys():
            out += shape_diff(a[k], b[k], f"{path}.{k}")
        return out
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [
            d
            for i, (x, y) in enumerate(zip(a, b, strict=True))
            for d in shape_diff(x, y, f"{path}[{i}]")
        ]
    return [] if a == b else [f"{path}: vLLM {a!r} != stub {b!r}"]


def assert_same_shape(real: Any, stub: Any, what: str) -> None:
    diff = shape_diff(shape(real), shape(stub))
    assert not diff, f"{what}: the stub deviates from vLLM:\n" + "\n".join(sorted(diff))


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=30) as resp:
        return json.load(resp)


def post(url: str, body: dict[str, Any], path: str = "/v1/completions") -> tuple[int, str, bytes]:
    """POST ``body`` to ``url`` + ``path``: (status, media type, raw body)."""
    req = urllib.request.Request(
        f"{url}{path}", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            media = resp.headers.get_content_type()
            return resp.status, media, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers.get_content_type(), exc.read()


def sse_events(raw: bytes) -> list[bytes]:
    """The payloads of an SSE body; every event must be a lone ``data:`` line."""
    assert raw.endswith(b"\n\n"), raw[-80:]
    frames = raw[:-2].split(b"\n\n")
    payloads = []
    for frame in frames:
        assert frame.startswith(b"data: ") and b"\n" not in frame, frame[:200]
        payloads.append(frame[len(b"data: ") :])
    return payloads


def chunk_kinds(raw: bytes) -> dict[str, list[dict[str, Any]]]:
    """Split a streamed completion into its chunk kinds, checking their order."""
    payloads = sse_events(raw)
    assert payloads[-1] == b"[DONE]"
    assert b"[DONE]" not in payloads[:-1]
    chunks = [json.loads(p) for p in payloads[:-1]]
    kinds: dict[str, list[dict[str, Any]]] = {"first": [], "middle": [], "last": [], "usage": []}
    for i, chunk in enumerate(chunks):
        if not chunk["choices"]:
            assert "usage" in chunk and i == len(chunks) - 1, "usage comes last, alone"
            kinds["usage"].append(chunk)
        elif chunk["choices"][0]["finish_reason"] is not None:
            kinds["last"].append(chunk)
        elif i == 0:
            kinds["first"].append(chunk)
        else:
            kinds["middle"].append(chunk)
    return kinds


# -- fixtures --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def prompt_ids(qwen3_dir: Path) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(qwen3_dir))
    text = tok.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi."}],
        tokenize=False,
        add_generation_prompt=True,
    )
    return list(tok.encode(text, add_special_tokens=False))


@pytest.fixture(scope="module")
def models(vllm_url: str, stub: StubPolicy) -> tuple[dict[str, Any], dict[str, Any]]:
    return get_json(f"{vllm_url}/v1/models"), get_json(f"{stub.url}/v1/models")


@pytest.fixture(scope="module")
def stub_like_vllm(
    qwen3_dir: Path, models: tuple[dict[str, Any], dict[str, Any]]
) -> Iterator[StubPolicy]:
    """A stub with the real server's context length, for the requests that depend on it."""
    policy = StubPolicy(str(qwen3_dir), max_model_len=models[0]["data"][0]["max_model_len"])
    policy.start()
    yield policy
    policy.stop()


def request(model: str, prompt: list[int], **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "prompt": prompt,
        "max_tokens": 8,
        "logprobs": 0,
        "return_token_ids": True,
        "skip_special_tokens": True,
        # The tiny random model may sample its EOS early; the shapes compared need 8 tokens.
        "ignore_eos": True,
    }
    body.update(extra)
    return body


def both(
    vllm_url: str, stub: StubPolicy, models: Any, prompt: list[int], reply: str, **extra: Any
) -> tuple[tuple[int, str, bytes], tuple[int, str, bytes]]:
    """The same request to vLLM and to the stub (scripted to answer ``reply``)."""
    real_model, stub_model = models[0]["data"][0]["id"], models[1]["data"][0]["id"]
    real = post(vllm_url, request(real_model, prompt, **extra))
    stub.replies.clear()
    stub.script(reply)
    fake = post(stub.url, request(stub_model, prompt, **extra))
    return real, fake


# -- tests -----------------------------------------------------------------------------------


def test_models_shape(models: tuple[dict[str, Any], dict[str, Any]]) -> None:
    real, fake = models
    assert_same_shape(real, fake, "/v1/models")
    assert len(real["data"]) == len(fake["data"]) == 1
    for m in (real, fake):
        assert m["object"] == "list" and m["data"][0]["object"] == "model"
        assert isinstance(m["data"][0]["max_model_len"], int)


def test_non_streamed_completion_shape(
    vllm_url: str, stub: StubPolicy, models: Any, prompt_ids: list[int]
) -> None:
    (rs, rmedia, rraw), (fs, fmedia, fraw) = both(vllm_url, stub, models, prompt_ids, LONG_REPLY)
    assert rs == fs == 200
    assert rmedia == fmedia == "application/json"
    real, fake = json.loads(rraw), json.loads(fraw)
    assert_same_shape(real, fake, "completion")
    assert_same_shape(real["choices"][0], fake["choices"][0], "choices[0]")
    assert_same_shape(real["choices"][0]["logprobs"], fake["choices"][0]["logprobs"], "logprobs")
    assert_same_shape(real["usage"], fake["usage"], "usage")
    for data, model in ((real, models[0]), (fake, models[1])):
        assert data["object"] == "text_completion"
        assert data["id"].startswith("cmpl-")
        assert data["model"] == model["data"][0]["id"]
        choice = data["choices"][0]
        assert choice["finish_reason"] == "length" and choice["stop_reason"] is None
        assert choice["prompt_token_ids"] == prompt_ids
        n = len(choice["token_ids"])
        assert n == 8
        lp = choice["logprobs"]
        assert len(lp["token_logprobs"]) == len(lp["tokens"]) == len(lp["text_offset"]) == n
        assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
        assert all(x <= 0 for x in lp["token_logprobs"])
        assert data["usage"]["prompt_tokens"] == len(prompt_ids)
        assert data["usage"]["completion_tokens"] == n
        assert data["usage"]["total_tokens"] == len(prompt_ids) + n


def test_streamed_completion_shape(
    vllm_url: str, stub: StubPolicy, models: Any, prompt_ids: list[int]
) -> None:
    (rs, rmedia, rraw), (fs, fmedia, fraw) = both(
        vllm_url,
        stub,
        models,
        prompt_ids,
        LONG_REPLY,
        stream=True,
        stream_options={"include_usage": True},
    )
    assert rs == fs == 200
    assert rmedia == fmedia == "text/event-stream"
    real, fake = chunk_kinds(rraw), chunk_kinds(fraw)
    for kind in ("first", "last", "usage"):
        assert len(real[kind]) == len(fake[kind]) == 1, kind
    # vLLM may put several tokens in one chunk when it lags; the stub sends one per chunk.
    assert real["middle"] and len(fake["middle"]) == 6
    for kind in ("first", "middle", "last", "usage"):
        for r in real[kind]:
            f = fake[kind][0]
            assert_same_shape(r, f, f"{kind} chunk")
            if r["choices"]:
                assert_same_shape(r["choices"][0], f["choices"][0], f"{kind} chunk choices[0]")
            else:
                assert_same_shape(r["usage"], f["usage"], "usage chunk usage")
    for kinds in (real, fake):
        check_token_chunks(kinds, prompt_ids, 8)


def check_token_chunks(kinds: dict[str, list[dict[str, Any]]], prompt: list[int], n: int) -> None:
    token_chunks = kinds["first"] + kinds["middle"] + kinds["last"]
    assert kinds["first"][0]["choices"][0]["prompt_token_ids"] == prompt
    assert all(c["choices"][0]["prompt_token_ids"] is None for c in token_chunks[1:])
    assert sum(len(c["choices"][0]["token_ids"]) for c in token_chunks) == n
    text = ""
    for c in token_chunks:
        choice = c["choices"][0]
        lp = choice["logprobs"]
        assert len(choice["token_ids"]) == len(lp["tokens"]) == len(lp["token_logprobs"])
        assert len(lp["text_offset"]) == len(lp["top_logprobs"]) == len(choice["token_ids"])
        # (text_offset values are not compared: vLLM's depend on how it batched the chunk, and
        # the proxy does not use them.)
        text += choice["text"]
    assert kinds["last"][0]["choices"][0]["finish_reason"] == "length"
    if kinds["usage"]:
        assert kinds["usage"][0]["usage"]["completion_tokens"] == n
    assert len({c["id"] for c in token_chunks + kinds["usage"]}) == 1


def test_streamed_without_usage_has_no_usage_chunk(
    vllm_url: str, stub: StubPolicy, models: Any, prompt_ids: list[int]
) -> None:
    (rs, _, rraw), (fs, _, fraw) = both(
        vllm_url, stub, models, prompt_ids, LONG_REPLY, max_tokens=3, stream=True
    )
    assert rs == fs == 200
    real, fake = chunk_kinds(rraw), chunk_kinds(fraw)
    assert not real["usage"] and not fake["usage"]
    assert_same_shape(real["last"][0], fake["last"][0], "last chunk without usage")
    assert_same_shape(real["first"][0], fake["first"][0], "first chunk without usage")
    check_token_chunks(real, prompt_ids, 3)
    check_token_chunks(fake, prompt_ids, 3)


def test_stub_can_send_several_tokens_per_chunk(
    vllm_url: str, stub: StubPolicy, models: Any, prompt_ids: list[int]
) -> None:
    """``stub.chunk_tokens`` imitates a lagging vLLM: chunks of several tokens, same shapes."""
    stub.chunk_tokens = 3
    try:
        (rs, _, rraw), (fs, _, fraw) = both(
            vllm_url,
            stub,
            models,
            prompt_ids,
            LONG_REPLY,
            stream=True,
            stream_options={"include_usage": True},
        )
    finally:
        stub.chunk_tokens = 1
    assert rs == fs == 200
    real, fake = chunk_kinds(rraw), chunk_kinds(fraw)
    assert [len(c["choices"][0]["token_ids"]) for c in fake["first"] + fake["middle"]] == [3, 3]
    assert len(fake["last"][0]["choices"][0]["token_ids"]) == 2
    for kind in ("first", "last", "usage"):
        assert_same_shape(real[kind][0], fake[kind][0], f"{kind} chunk")
    check_token_chunks(fake, prompt_ids, 8)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_eos_stop_is_reported_alike(
    stream: bool, vllm_url: str, stub: StubPolicy, models: Any, prompt_ids: list[int]
) -> None:
    """vLLM forced to end at once (logit bias on <|im_end|>) vs the stub scripted to say nothing:
    the EOS token is in token_ids and tokens, not in the text; stop_reason is null."""
    extra: dict[str, Any] = {"logit_bias": {str(IM_END): 100}, "ignore_eos": False}
    if stream:
        extra.update(stream=True, stream_options={"include_usage": True})
    (rs, _, rraw), (fs, _, fraw) = both(vllm_url, stub, models, prompt_ids, "", **extra)
    assert rs == fs == 200
    if stream:
        real_kinds, fake_kinds = chunk_kinds(rraw), chunk_kinds(fraw)
        assert [len(real_kinds[k]) for k in real_kinds] == [0, 0, 1, 1]
        assert [len(fake_kinds[k]) for k in fake_kinds] == [0, 0, 1, 1]
        real, fake = real_kinds["last"][0], fake_kinds["last"][0]
    else:
        real, fake = json.loads(rraw), json.loads(fraw)
    assert_same_shape(real, fake, "EOS-stopped completion")
    for data in (real, fake):
        choice = data["choices"][0]
        assert choice["text"] == ""
        assert choice["token_ids"] == [IM_END]
        assert choice["finish_reason"] == "stop"
        assert choice["stop_reason"] is None
        assert choice["logprobs"]["tokens"] == ["<|im_end|>"]
        assert choice["logprobs"]["text_offset"] == [0]
        assert choice["prompt_token_ids"] == prompt_ids


def test_max_tokens_is_clamped_to_the_context_alike(
    vllm_url: str, stub_like_vllm: StubPolicy, prompt_ids: list[int]
) -> None:
    real_models = get_json(f"{vllm_url}/v1/models")
    fake_models = get_json(f"{stub_like_vllm.url}/v1/models")
    limit = real_models["data"][0]["max_model_len"]
    assert fake_models["data"][0]["max_model_len"] == limit
    prompt = (prompt_ids * (limit // len(prompt_ids) + 1))[: limit - 3]
    (rs, _, rraw), (fs, _, fraw) = both(
        vllm_url, stub_like_vllm, (real_models, fake_models), prompt, LONG_REPLY
    )
    assert rs == fs == 200
    real, fake = json.loads(rraw), json.loads(fraw)
    assert_same_shape(real, fake, "clamped completion")
    for data in (real, fake):
        assert len(data["choices"][0]["token_ids"]) == 3
        assert data["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize(
    "case", ["prompt-too-long", "no-room-left", "max-tokens-over-context", "unknown-model"]
)
def test_errors_have_vllms_shape(
    case: str, vllm_url: str, stub_like_vllm: StubPolicy, prompt_ids: list[int]
) -> None:
    real_models = get_json(f"{vllm_url}/v1/models")
    fake_models = get_json(f"{stub_like_vllm.url}/v1/models")
    limit = real_models["data"][0]["max_model_len"]
    prompt = prompt_ids
    if case == "prompt-too-long":
        prompt = [9707] * (limit + 1)
    elif case == "no-room-left":
        prompt = [9707] * limit
    bodies = []
    for url, models in ((vllm_url, real_models), (stub_like_vllm.url, fake_models)):
        model = "no-such-model" if case == "unknown-model" else models["data"][0]["id"]
        extra = {"max_tokens": limit + 1} if case == "max-tokens-over-context" else {}
        bodies.append(post(url, request(model, prompt, **extra)))
    (rs, rmedia, rraw), (fs, fmedia, fraw) = bodies
    assert rs == fs == (404 if case == "unknown-model" else 400)
    assert rmedia == fmedia == "application/json"
    real, fake = json.loads(rraw), json.loads(fraw)
    assert_same_shape(real, fake, f"{case} error")
    assert real["error"]["type"] == fake["error"]["type"]
    assert real["error"]["param"] == fake["error"]["param"]
    assert real["error"]["code"] == fake["error"]["code"] == rs


def test_prompt_logprobs_shape(
    vllm_url: str, stub: StubPolicy, models: Any, prompt_ids: list[int]
) -> None:
    """The proxy re-scores rewritten history with ``prompt_logprobs: 0``: the stub answers it in
    vLLM's shape (entry 0 null, then the prompt token's own entry)."""
    (rs, _, rraw), (fs, _, fraw) = both(
        vllm_url,
        stub,
        models,
        prompt_ids,
        LONG_REPLY,
        prompt_logprobs=0,
        max_tokens=1,
        logprobs=None,
    )
    assert rs == fs == 200
    real, fake = json.loads(rraw)["choices"][0], json.loads(fraw)["choices"][0]
    assert_same_shape(real["prompt_logprobs"], fake["prompt_logprobs"], "prompt_logprobs")
    for choice in (real, fake):
        entries = choice["prompt_logprobs"]
        assert len(entries) == len(prompt_ids) and entries[0] is None
        for token, entry in zip(prompt_ids[1:], entries[1:], strict=True):
            assert str(token) in entry and entry[str(token)]["logprob"] <= 0


def test_tokenize_shape(vllm_url: str, stub: StubPolicy, models: Any) -> None:
    """POST /tokenize (agenttap's startup check compares its ids with the tokenizer given)."""
    from capture.policy.startup import PROBE

    real_model, stub_model = models[0]["data"][0]["id"], models[1]["data"][0]["id"]
    answers = []
    for url, model in [(vllm_url, real_model), (stub.url, stub_model)]:
        status, _, raw = post(
            url, {"model": model, "prompt": PROBE, "add_special_tokens": False}, path="/tokenize"
        )
        assert status == 200, raw[:300]
        answers.append(json.loads(raw))
    real, fake = answers
    assert_same_shape(real, fake, "/tokenize")
    assert real["tokens"] == fake["tokens"] and real["count"] == len(real["tokens"])


def test_detokenize_shape(vllm_url: str, stub: StubPolicy, models: Any) -> None:
    """POST /detokenize (the startup check decodes ids spread over the whole vocabulary, the
    last one included) answers alike; an id past the tokenizer's vocabulary decodes to nothing
    on both (so a served vocabulary that ends sooner shows as other text)."""
    from capture.policy.startup import vocab_probe_ids

    ids = vocab_probe_ids(len(stub.tok))
    real_model, stub_model = models[0]["data"][0]["id"], models[1]["data"][0]["id"]
    answers, past = [], []
    for url, model in [(vllm_url, real_model), (stub.url, stub_model)]:
        status, _, raw = post(url, {"model": model, "tokens": ids}, path="/detokenize")
        assert status == 200, raw[:300]
        answers.append(json.loads(raw))
        past.append(
            post(url, {"model": model, "tokens": [len(stub.tok) + 10**6]}, path="/detokenize")
        )
    real, fake = answers
    assert_same_shape(real, fake, "/detokenize")
    assert real["prompt"] == fake["prompt"] == stub.tok.decode(ids)
    (rs, _, rraw), (fs, _, fraw) = past
    assert rs == fs == 200 and json.loads(rraw) == json.loads(fraw) == {"prompt": ""}


def test_health_answers_alike(vllm_url: str, stub: StubPolicy) -> None:
    """GET /health (agenttap's replica health checks): 200 with an empty body on both."""
    answers = []
    for url in (vllm_url, stub.url):
        with urllib.request.urlopen(f"{url}/health", timeout=30) as resp:
            answers.append((resp.status, resp.read()))
    assert answers[0] == answers[1] == (200, b"")


# -- the body agenttap sends (rewriter/vllm_request.py generation_body) ------------------------


def agenttap_body(model: str, prompt: list[int], stream: bool) -> dict[str, Any]:
    from rewriter.canonical import SamplingParams
    from rewriter.vllm_request import PolicyInfo, generation_body

    params = SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True, seed=11)
    path, body = generation_body(PolicyInfo(model, max_model_len=None), prompt, params, stream)
    assert path == "/v1/completions"
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def read_ids(raw: bytes, stream: bool) -> tuple[list[int], list[float]]:
    """The ids and logprobs agenttap reads from an answer (rewriter/vllm_answers.py)."""
    from rewriter.vllm_answers import answer_choices, answer_json, completions_delta

    lines = sse_events(raw)[:-1] if stream else [raw]
    ids: list[int] = []
    logprobs: list[float] = []
    for line in lines:
        for choice in answer_choices(answer_json(line, "an answer")):
            delta = completions_delta(choice)
            ids += delta.token_ids
            logprobs += delta.logprobs
    return ids, logprobs


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_agenttaps_body_is_answered_alike_without_the_prompt_echo(
    stream: bool, vllm_url: str, stub: StubPolicy, models: Any, prompt_ids: list[int]
) -> None:
    """generation_body asks for the ids as logprobs' tokens: neither server echoes the prompt's
    ids, both spell the tokens "token_id:N", and agenttap reads 8 ids and 8 logprobs from both."""
    real_model, stub_model = models[0]["data"][0]["id"], models[1]["data"][0]["id"]
    status, _, rraw = post(vllm_url, agenttap_body(real_model, prompt_ids, stream))
    stub.replies.clear()
    stub.script(LONG_REPLY)
    fstatus, _, fraw = post(stub.url, agenttap_body(stub_model, prompt_ids, stream))
    assert status == fstatus == 200
    if stream:
        real, fake = chunk_kinds(rraw), chunk_kinds(fraw)
        for kind in ("first", "middle", "last", "usage"):
            assert_same_shape(real[kind][0], fake[kind][0], f"{kind} chunk")
        firsts = [real["first"][0], fake["first"][0]]
    else:
        real_whole, fake_whole = json.loads(rraw), json.loads(fraw)
        assert_same_shape(real_whole, fake_whole, "completion")
        firsts = [real_whole, fake_whole]
    for first in firsts:
        choice = first["choices"][0]
        assert choice["prompt_token_ids"] is None and choice["token_ids"] is None
        assert all(t.startswith("token_id:") for t in choice["logprobs"]["tokens"])
    for raw in (rraw, fraw):
        ids, logprobs = read_ids(raw, stream)
        assert len(ids) == len(logprobs) == 8
    assert b'"prompt_token_ids":[' not in rraw.replace(b" ", b"")


def test_token_id_tokens_are_the_ids_return_token_ids_gives(
    vllm_url: str, models: Any, prompt_ids: list[int]
) -> None:
    """The same seeded generation asked both ways: the same ids, the same logprobs."""
    model = models[0]["data"][0]["id"]
    ours = agenttap_body(model, prompt_ids, stream=True)
    echoed = {**ours, "return_token_ids": True}
    del echoed["return_tokens_as_token_ids"]
    a = read_ids(post(vllm_url, ours)[2], stream=True)
    b = read_ids(post(vllm_url, echoed)[2], stream=True)
    assert a == b and len(a[0]) == 8
