"""The Gemini API through the real proxy: the real google-genai SDK -> mitmdump -> stub.

The SDK is configured only through the environment (HTTPS_PROXY, SSL_CERT_FILE) and talks to
https://generativelanguage.googleapis.com as it would to Google. The stub answers the scripted
completion (Qwen3 tokenizer, ended with ``<|im_end|>``), so each test knows the tokens the
policy produced and the reply the client must see.
"""

from __future__ import annotations

import json
import ssl
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2 as httpx
import pytest
from google import genai
from google.genai import errors, types
from pydantic import BaseModel

from policy_server.launcher import free_port
from tests.support.paths import IM_END
from tests.support.proxies import ONE_EVENT_PER_TOKEN_S, Proxy, start_proxy
from tests.support.stub_vllm import StubPolicy

MODEL = "gemini-2.5-flash"
HOST = "https://generativelanguage.googleapis.com"

WEATHER = types.FunctionDeclaration(
    name="get_weather",
    description="Current weather in a city.",
    parameters=types.Schema(
        type=types.Type.OBJECT,
        properties={"city": types.Schema(type=types.Type.STRING)},
        required=["city"],
    ),
)


def client(proxy: Proxy, session: str, monkeypatch: pytest.MonkeyPatch) -> genai.Client:
    """The real google-genai SDK, configured only through the environment."""
    for key, value in proxy.env(session).items():
        monkeypatch.setenv(key, value)
    for name in ("GOOGLE_GEMINI_BASE_URL", "GOOGLE_GENAI_USE_VERTEXAI", "GOOGLE_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    return genai.Client(api_key="AIza-agenttap-test-key")


def script(stub: StubPolicy, *texts: str) -> int:
    stub.replies.clear()
    stub.script(*texts)
    return len(stub.requests)


def hermes(name: str, arguments: dict[str, Any]) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def rows(proxy: Proxy, session: str, expect: int) -> list[dict]:
    """The session's turn rows once ``expect`` are written; fails if they are not."""
    got = proxy.turns(session, expect=expect)
    assert len(got) == expect, f"{len(got)} turn rows for {session}, expected {expect}"
    return got


def raw_post(proxy: Proxy, session: str, path: str, body: Any, **headers: str) -> httpx.Response:
    with httpx.Client(
        proxy=f"http://{session}:x@127.0.0.1:{proxy.port}",
        verify=ssl.create_default_context(cafile=str(proxy.ca)),
        timeout=60,
    ) as http:
        return http.post(
            HOST + path,
            content=body if isinstance(body, bytes) else json.dumps(body).encode(),
            headers={"x-goog-api-key": "AIza-test", "content-type": "application/json", **headers},
        )


def test_whole_response(
    stub_proxy: Proxy, stub: StubPolicy, tok: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    n = script(stub, "<think>\nShort.\n</think>\n\nHello there.")
    gem = client(stub_proxy, "gem-plain", monkeypatch)
    resp = gem.models.generate_content(
        model=MODEL,
        contents="Say hello.",
        config=types.GenerateContentConfig(
            system_instruction="Be brief.", max_output_tokens=100, temperature=0.5
        ),
    )
    assert resp.text == "Hello there."
    (candidate,) = resp.candidates or []
    assert candidate.finish_reason == types.FinishReason.STOP
    assert candidate.content is not None and candidate.content.role == "model"
    # No includeThoughts: the reasoning stays out of the answer (it is still recorded).
    assert all(not p.thought for p in candidate.content.parts or [])
    sent = stub.requests[n]
    sampled = tok.encode("<think>\nShort.\n</think>\n\nHello there.", add_special_tokens=False)
    usage = resp.usage_metadata
    assert usage is not None
    assert usage.prompt_token_count == len(sent["prompt"])
    assert usage.candidates_token_count == len(sampled) + 1
    assert usage.total_token_count == len(sent["prompt"]) + len(sampled) + 1
    assert resp.model_version == MODEL
    assert sent["max_tokens"] == 100 and sent["temperature"] == 0.5
    text = tok.decode(sent["prompt"])
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nSay hello.")
    (row,) = rows(stub_proxy, "gem-plain", 1)
    assert row["protocol"] == "gemini.generate_content"
    assert row["requested_model"] == MODEL
    assert row["response_finish_reason"] == "STOP"
    assert list(row["completion_ids"]) == [*sampled, IM_END]
    # The key never reaches the records.
    assert "AIza" not in json.dumps({k: str(v) for k, v in row.items()})


def test_streamed_chunks_as_tokens_arrive(
    stub_proxy: Proxy, stub: StubPolicy, monkeypatch: pytest.MonkeyPatch
) -> None:
    script(stub, "One two three four five.")
    gem = client(stub_proxy, "gem-stream", monkeypatch)
    # A token slower than the flush interval: the proxy keeps up, so each goes out as it comes
    # (tokens that came within the interval go out together: tests/e2e/providers/test_coalesced_stream.py).
    stub.chunk_delay_s = ONE_EVENT_PER_TOKEN_S
    try:
        chunks = list(
            gem.models.generate_content_stream(
                model=MODEL,
                contents="Count.",
                config=types.GenerateContentConfig(
                    thinking_config=types.ThinkingConfig(thinking_budget=0)
                ),
            )
        )
    finally:
        stub.chunk_delay_s = 0.0
    texts = [c.text for c in chunks if c.text]
    assert len(texts) > 3  # token by token, not one blob
    assert "".join(texts) == "One two three four five."
    last = chunks[-1]
    assert last.candidates and last.candidates[0].finish_reason == types.FinishReason.STOP
    assert all(not (c.candidates and c.candidates[0].finish_reason) for c in chunks[:-1])
    assert last.usage_metadata is not None and last.usage_metadata.candidates_token_count
    (row,) = rows(stub_proxy, "gem-stream", 1)
    assert row["stream"] is True


def test_function_call_loop_extends_one_thread(
    stub_proxy: Proxy, stub: StubPolicy, tok: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    call = hermes("get_weather", {"city": "Paris"})
    n = script(stub, call, "It is sunny in Paris.")
    gem = client(stub_proxy, "gem-tools", monkeypatch)
    config = types.GenerateContentConfig(
        tools=[types.Tool(function_declarations=[WEATHER])],
        automatic_function_calling=types.AutomaticFunctionCallingConfig(disable=True),
    )
    question = types.Content(role="user", parts=[types.Part(text="Weather in Paris?")])
    first = gem.models.generate_content(model=MODEL, contents=[question], config=config)
    (fc,) = first.function_calls or []
    assert fc.name == "get_weather" and fc.args == {"city": "Paris"} and fc.id
    model_turn = first.candidates[0].content  # type: ignore[index]
    assert model_turn is not None
    # Sent back as Gemini 3 clients do: with a thought signature the proxy must ignore.
    echoed = model_turn.model_copy(deep=True)
    echoed.parts[0].thought_signature = b"opaque-signature"  # type: ignore[index]
    answer = types.Content(
        role="user",
        parts=[
            types.Part(
                function_response=types.FunctionResponse(
                    id=fc.id, name=fc.name, response={"output": "18C, sunny"}
                )
            )
        ],
    )
    second = gem.models.generate_content(
        model=MODEL, contents=[question, echoed, answer], config=config
    )
    assert second.text == "It is sunny in Paris."

    prompt1, prompt2 = stub.requests[n]["prompt"], stub.requests[n + 1]["prompt"]
    sampled = list(tok.encode(call, add_special_tokens=False)) + [IM_END]
    assert prompt2[: len(prompt1) + len(sampled)] == prompt1 + sampled
    assert "<tool_response>\n18C, sunny\n</tool_response>" in tok.decode(prompt2)
    assert "opaque-signature" not in tok.decode(prompt2)
    got = rows(stub_proxy, "gem-tools", 2)
    assert [json.loads(r["metadata"])["assembly"] for r in got] == ["new", "extend"]
    (thread,) = stub_proxy.threads("gem-tools")
    assert thread["num_turns"] == 2 and 2 not in thread["provenance"]
    assert thread["protocol"] == "gemini.generate_content"


def test_streamed_thoughts_when_asked(
    stub_proxy: Proxy, stub: StubPolicy, monkeypatch: pytest.MonkeyPatch
) -> None:
    script(stub, "<think>\nThe user wants a greeting.\n</think>\n\nHello!")
    gem = client(stub_proxy, "gem-thoughts", monkeypatch)
    chunks = list(
        gem.models.generate_content_stream(
            model=MODEL,
            contents="Greet me.",
            config=types.GenerateContentConfig(
                thinking_config=types.ThinkingConfig(include_thoughts=True, thinking_budget=-1)
            ),
        )
    )
    contents = [c.candidates[0].content for c in chunks if c.candidates]
    parts = [p for content in contents if content for p in content.parts or []]
    thoughts = "".join(p.text or "" for p in parts if p.thought)
    text = "".join(p.text or "" for p in parts if not p.thought)
    assert thoughts == "The user wants a greeting."
    assert text == "Hello!"
    # Thoughts come first, as they were sampled.
    assert parts[0].thought and not parts[-1].thought


def test_function_calls_sent_back_without_ids_still_extend(
    stub_proxy: Proxy, stub: StubPolicy, tok: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client that drops the ids (older SDK code, hand-built history) is matched by content."""
    call = hermes("get_weather", {"city": "Oslo"})
    n = script(stub, call, "Cold in Oslo.")
    gem = client(stub_proxy, "gem-noids", monkeypatch)
    config = types.GenerateContentConfig(
        tools=[types.Tool(function_declarations=[WEATHER])],
        automatic_function_calling=types.AutomaticFunctionCallingConfig(disable=True),
    )
    first = gem.models.generate_content(model=MODEL, contents="Weather in Oslo?", config=config)
    (fc,) = first.function_calls or []
    history = [
        types.Content(role="user", parts=[types.Part(text="Weather in Oslo?")]),
        types.Content(
            role="model",
            parts=[types.Part(function_call=types.FunctionCall(name=fc.name, args=fc.args))],
        ),
        types.Content(
            role="user",
            parts=[
                types.Part(
                    function_response=types.FunctionResponse(
                        name=fc.name, response={"output": "-5C"}
                    )
                )
            ],
        ),
    ]
    second = gem.models.generate_content(model=MODEL, contents=history, config=config)
    assert second.text == "Cold in Oslo."
    prompt1, prompt2 = stub.requests[n]["prompt"], stub.requests[n + 1]["prompt"]
    sampled = list(tok.encode(call, add_special_tokens=False)) + [IM_END]
    assert prompt2[: len(prompt1) + len(sampled)] == prompt1 + sampled
    got = rows(stub_proxy, "gem-noids", 2)
    assert [json.loads(r["metadata"])["assembly"] for r in got] == ["new", "extend"]


class Route(BaseModel):
    reasoning: str
    model_choice: str


def test_structured_output_reaches_the_policy_as_json_schema(
    stub_proxy: Proxy, stub: StubPolicy, monkeypatch: pytest.MonkeyPatch
) -> None:
    reply = '{"reasoning": "simple task", "model_choice": "flash"}'
    n = script(stub, reply, reply)
    gem = client(stub_proxy, "gem-json", monkeypatch)
    openapi = types.Schema(
        type=types.Type.OBJECT,
        properties={
            "reasoning": types.Schema(type=types.Type.STRING),
            "model_choice": types.Schema(type=types.Type.STRING, enum=["flash", "pro"]),
        },
        required=["reasoning", "model_choice"],
    )
    resp = gem.models.generate_content(
        model="gemini-2.5-flash-lite",
        contents="Route this.",
        config=types.GenerateContentConfig(
            response_mime_type="application/json",
            response_schema=openapi,
            thinking_config=types.ThinkingConfig(thinking_budget=512),
        ),
    )
    assert json.loads(resp.text or "") == {"reasoning": "simple task", "model_choice": "flash"}
    assert stub.requests[n]["structured_outputs"] == {
        "json": {
            "type": "object",
            "properties": {
                "reasoning": {"type": "string"},
                "model_choice": {"type": "string", "enum": ["flash", "pro"]},
            },
            "required": ["reasoning", "model_choice"],
        }
    }
    # A JSON schema (Gemini CLI's router sends responseJsonSchema) is passed as it is.
    schema = Route.model_json_schema()
    parsed = gem.models.generate_content(
        model="gemini-2.5-flash-lite",
        contents="Route this.",
        config=types.GenerateContentConfig(
            response_mime_type="application/json", response_json_schema=schema
        ),
    )
    generations = [r for r in stub.requests[n:] if r.get("prompt_logprobs") is None]
    assert generations[1]["structured_outputs"] == {"json": schema}
    # Each constrained answer was re-scored (prompt_logprobs) for the thread's trained logprobs.
    assert sum(1 for r in stub.requests[n:] if r.get("prompt_logprobs") is not None) == 2
    assert Route.model_validate_json(parsed.text or "") == Route(
        reasoning="simple task", model_choice="flash"
    )


def test_count_tokens_and_models(
    stub_proxy: Proxy, stub: StubPolicy, monkeypatch: pytest.MonkeyPatch
) -> None:
    n = script(stub, "Fine.")
    gem = client(stub_proxy, "gem-count", monkeypatch)
    counted = gem.models.count_tokens(model=MODEL, contents="How many tokens is this?")
    gem.models.generate_content(model=MODEL, contents="How many tokens is this?")
    assert counted.total_tokens == len(stub.requests[n]["prompt"])
    model = gem.models.get(model=MODEL)
    assert model.name == f"models/{MODEL}"
    assert "generateContent" in (model.supported_actions or [])
    names = [m.name for m in gem.models.list()]
    assert "models/stub-policy" in names


def test_errors_in_googles_shape(
    stub_proxy: Proxy, stub: StubPolicy, monkeypatch: pytest.MonkeyPatch
) -> None:
    gem = client(stub_proxy, "gem-errors", monkeypatch)
    with pytest.raises(errors.ClientError) as bad:
        gem.models.generate_content(
            model=MODEL,
            contents="hi",
            config=types.GenerateContentConfig(candidate_count=2),
        )
    assert bad.value.code == 400 and bad.value.status == "INVALID_ARGUMENT"
    assert "one candidate" in (bad.value.message or "")
    # Longer than the policy's context: Google's own wording, before anything is generated.
    n = len(stub.requests)
    with pytest.raises(errors.ClientError) as too_long:
        gem.models.generate_content(model=MODEL, contents="word " * (stub.max_model_len + 10))
    assert too_long.value.code == 400 and too_long.value.status == "INVALID_ARGUMENT"
    assert "exceeds the maximum number of tokens allowed" in (too_long.value.message or "")
    assert len(stub.requests) == n
    with pytest.raises(errors.ClientError) as missing:
        gem.models.embed_content(model="text-embedding-004", contents="hi")
    assert missing.value.code == 404 and missing.value.status == "NOT_FOUND"
    # Raw HTTP: malformed JSON, a stream without alt=sse, a part the policy cannot read.
    for path, body, says in [
        (f"/v1beta/models/{MODEL}:generateContent", b"{nope", "Invalid JSON payload"),
        (f"/v1beta/models/{MODEL}:streamGenerateContent", {"contents": []}, "alt=sse"),
        (
            f"/v1/models/{MODEL}:generateContent?key=AIza-secret",
            {"contents": [{"role": "user", "parts": [{"inlineData": {"data": "AA=="}}]}]},
            "text only",
        ),
    ]:
        resp = raw_post(stub_proxy, "gem-errors", path, body)
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert error["code"] == 400 and error["status"] == "INVALID_ARGUMENT"
        assert says in error["message"]


@pytest.fixture
def dead_policy_proxy(confdir: Path, tmp_path: Path) -> Iterator[Proxy]:
    # A policy that is down: started anyway, so its calls get the provider's retryable error.
    proxy = start_proxy(
        f"http://127.0.0.1:{free_port()}",
        tmp_path / "out",
        confdir,
        extra=["--set", "agenttap_check_policy=false"],
    )
    yield proxy
    proxy.stop()


def test_unavailable_policy_is_503_unavailable(
    dead_policy_proxy: Proxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    gem = client(dead_policy_proxy, "gem-down", monkeypatch)
    with pytest.raises(errors.ServerError) as down:
        gem.models.generate_content(model=MODEL, contents="hi")
    assert down.value.code == 503 and down.value.status == "UNAVAILABLE"
    assert "policy server is unavailable" in (down.value.message or "")
    with pytest.raises(errors.ServerError) as streamed:
        list(gem.models.generate_content_stream(model=MODEL, contents="hi"))
    assert streamed.value.code == 503
