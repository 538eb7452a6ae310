"""Gemini API request parsing, routes, schema conversion, response and stream chunk shapes.
Pure functions: no network, no proxy, no vLLM."""

from __future__ import annotations

import json
from typing import Any

import pytest

from rewriter.canonical import (
    AssistantReply,
    ChatRequest,
    Message,
    RequestError,
    ToolCall,
    ToolSpec,
)
from rewriter.parsers import ContentDelta, ReasoningDelta, ToolCallEvent
from rewriter.providers.gemini.request import call_id, parse_count_tokens, parse_request
from rewriter.providers.gemini.response import (
    ChunkWriter,
    count_tokens_response,
    error_body,
    finish_reason,
    generate_response,
    model_object,
    models_list,
    prompt_too_long_message,
    sse,
    usage_metadata,
)
from rewriter.providers.gemini.routes import Route, parse_route
from rewriter.providers.gemini.schemas import openapi_to_json_schema

MODEL = "gemini-2.5-flash"


def body(**fields: Any) -> bytes:
    data: dict[str, Any] = {"contents": [user("hi")]}
    data.update(fields)
    return json.dumps(data).encode()


def user(*texts: str) -> dict[str, Any]:
    return {"role": "user", "parts": [{"text": t} for t in texts]}


def model_turn(*parts: dict[str, Any]) -> dict[str, Any]:
    return {"role": "model", "parts": list(parts)}


def parse(raw: bytes, model: str = MODEL, *, stream: bool = False) -> ChatRequest:
    return parse_request(raw, model, stream=stream).chat


def refused(raw: bytes, model: str = MODEL) -> RequestError:
    with pytest.raises(RequestError) as info:
        parse_request(raw, model)
    assert info.value.status == 400
    return info.value


# -- routes ----------------------------------------------------------------------------------


def test_routes_name_model_and_method_in_the_path() -> None:
    assert parse_route("POST", f"/v1beta/models/{MODEL}:generateContent") == Route(
        "generate", "v1beta", MODEL, "generateContent"
    )
    assert parse_route("POST", f"/v1beta/models/{MODEL}:streamGenerateContent") == Route(
        "stream", "v1beta", MODEL, "streamGenerateContent"
    )
    assert parse_route("POST", f"/v1/models/{MODEL}:countTokens") == Route(
        "count_tokens", "v1", MODEL, "countTokens"
    )
    assert parse_route("GET", "/v1beta/models") == Route("list_models", "v1beta")
    assert parse_route("GET", f"/v1beta/models/{MODEL}") == Route("get_model", "v1beta", MODEL)
    assert parse_route("POST", f"/v1beta/models/{MODEL}:embedContent") == Route(
        "other", "v1beta", MODEL, "embedContent"
    )
    assert parse_route("GET", f"/v1beta/models/{MODEL}:generateContent") is not None
    assert parse_route("GET", f"/v1beta/models/{MODEL}:generateContent").kind == "other"  # type: ignore[union-attr]
    assert parse_route("POST", "/v1/chat/completions") is None
    assert parse_route("POST", "/v1/messages") is None
    assert parse_route("GET", "/v2/models") is None


# -- request ---------------------------------------------------------------------------------


def test_text_conversation_with_system_instruction() -> None:
    chat = parse(
        body(
            systemInstruction={"parts": [{"text": "You are "}, {"text": "terse."}]},
            contents=[user("a", "b"), model_turn({"text": "c"}), user("d")],
        ),
        "models/" + MODEL,
        stream=True,
    )
    assert chat.model == MODEL
    assert chat.stream is True
    assert chat.messages == [
        Message(role="system", content="You are terse."),
        Message(role="user", content="ab"),
        Message(role="assistant", content="c"),
        Message(role="user", content="d"),
    ]
    assert chat.tools == [] and chat.tool_choice is None
    assert chat.enable_thinking is None  # the template's default
    # A bare string is accepted as a system instruction too, and a missing role means user.
    chat = parse(body(systemInstruction="sys", contents=[{"parts": [{"text": "x"}]}]), MODEL)
    assert chat.messages == [Message("system", "sys"), Message("user", "x")]


def test_function_call_loop_and_thought_signature_does_not_change_messages() -> None:
    call = {"functionCall": {"id": "call_1", "name": "ls", "args": {"path": ".", "all": True}}}
    result = {"functionResponse": {"id": "call_1", "name": "ls", "response": {"output": "a.txt"}}}
    contents = [
        user("list"),
        model_turn({"text": "Listing."}, call),
        {"role": "user", "parts": [result]},
    ]
    plain = parse(body(contents=contents), MODEL)
    signed_call = {**call, "thoughtSignature": "c2tpcF90aG91Z2h0X3NpZ25hdHVyZV92YWxpZGF0b3I="}
    signed = [
        contents[0],
        model_turn({"text": "Listing.", "thoughtSignature": "abc"}, signed_call),
        contents[2],
    ]
    with_signature = parse(body(contents=signed), MODEL)
    assert plain.messages == with_signature.messages
    assert plain.messages == [
        Message("user", "list"),
        Message(
            "assistant",
            "Listing.",
            tool_calls=(ToolCall("call_1", "ls", '{"path": ".", "all": true}'),),
        ),
        Message("tool", "a.txt", tool_call_id="call_1", name="ls"),
    ]
    # A part with only a signature (Gemini 3 sends them after thoughts) is nothing to the policy.
    only_sig = [
        contents[0],
        model_turn({"thoughtSignature": "zz"}, {"text": "Listing."}, call),
        contents[2],
    ]
    assert parse(body(contents=only_sig), MODEL).messages == plain.messages


def test_function_calls_without_ids_get_stable_ids_matched_by_results() -> None:
    contents = [
        user("go"),
        model_turn(
            {"functionCall": {"name": "read", "args": {"f": "a"}}},
            {"functionCall": {"name": "read", "args": {"f": "b"}}},
            {"functionCall": {"name": "write", "args": {}}},
        ),
        {
            "role": "user",
            "parts": [
                {"functionResponse": {"name": "write", "response": {"error": "denied"}}},
                {"functionResponse": {"name": "read", "response": {"output": "A"}}},
                {"functionResponse": {"name": "read", "response": {"lines": 2, "text": "B"}}},
                {"text": "continue"},
            ],
        },
    ]
    first = parse(body(contents=contents), MODEL).messages
    again = parse(body(contents=contents), MODEL).messages
    assert first == again  # stable across calls: same conversation, same ids
    calls = first[1].tool_calls
    assert [c.id for c in calls] == [call_id(1, 0), call_id(1, 1), call_id(1, 2)]
    assert len({c.id for c in calls}) == 3
    assert [(m.role, m.tool_call_id, m.content) for m in first[2:]] == [
        ("tool", call_id(1, 2), "Error: denied"),
        ("tool", call_id(1, 0), "A"),
        ("tool", call_id(1, 1), '{"lines": 2, "text": "B"}'),
        ("user", None, "continue"),
    ]


def test_thought_parts_are_reasoning() -> None:
    chat = parse(
        body(
            contents=[
                user("q"),
                model_turn({"text": "hmm", "thought": True}, {"text": "answer"}),
                user("next"),
            ]
        ),
        MODEL,
    )
    assert chat.messages[1] == Message("assistant", "answer", reasoning="hmm")


def test_tools_openapi_parameters_and_json_schema() -> None:
    chat = parse(
        body(
            tools=[
                {
                    "functionDeclarations": [
                        {
                            "name": "run_shell_command",
                            "description": "Run a command.",
                            "parametersJsonSchema": {
                                "type": "object",
                                "properties": {"command": {"type": "string"}},
                                "required": ["command"],
                            },
                        },
                        {
                            "name": "get_weather",
                            "parameters": {
                                "type": "OBJECT",
                                "properties": {
                                    "city": {"type": "STRING", "description": "City"},
                                    "unit": {
                                        "type": "STRING",
                                        "enum": ["C", "F"],
                                        "nullable": True,
                                    },
                                },
                                "required": ["city"],
                                "propertyOrdering": ["city", "unit"],
                            },
                        },
                        {"name": "now"},
                    ]
                },
                {"googleSearch": {}},
            ],
            toolConfig={"functionCallingConfig": {"mode": "ANY"}},
        ),
        MODEL,
    )
    assert chat.tools == [
        ToolSpec(
            "run_shell_command",
            "Run a command.",
            {
                "type": "object",
                "properties": {"command": {"type": "string"}},
                "required": ["command"],
            },
        ),
        ToolSpec(
            "get_weather",
            "",
            {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "City"},
                    "unit": {"type": ["string", "null"], "enum": ["C", "F", None]},
                },
                "required": ["city"],
            },
        ),
        ToolSpec("now", "", {}),
    ]
    assert chat.tool_choice == "required"


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ({"mode": "AUTO"}, "auto"),
        ({"mode": "NONE"}, "none"),
        ({"mode": "ANY"}, "required"),
        (
            {"mode": "ANY", "allowedFunctionNames": ["ls"]},
            {"type": "function", "function": {"name": "ls"}},
        ),
        ({"mode": "VALIDATED"}, "auto"),
        ({}, None),
    ],
)
def test_tool_config_modes(config: dict[str, Any], expected: Any) -> None:
    chat = parse(body(toolConfig={"functionCallingConfig": config}), MODEL)
    assert chat.tool_choice == expected


def test_generation_config_to_sampling() -> None:
    request = parse_request(
        body(
            generationConfig={
                "temperature": 0.3,
                "topP": 0.9,
                "topK": 40,
                "maxOutputTokens": 77,
                "stopSequences": ["END"],
                "seed": 5,
                "candidateCount": 1,
                "thinkingConfig": {"includeThoughts": True, "thinkingBudget": -1},
            }
        ),
        MODEL,
    )
    chat = request.chat
    s = chat.sampling
    assert (s.temperature, s.top_p, s.top_k, s.max_tokens, s.stop, s.seed) == (
        0.3,
        0.9,
        40,
        77,
        ["END"],
        5,
    )
    assert s.json_schema is None
    assert chat.enable_thinking is True
    assert request.include_thoughts is True
    # snake_case (proto field names) is accepted as Google's own parser accepts it.
    snake = parse_request(
        body(
            generation_config={
                "max_output_tokens": 9,
                "thinking_config": {"thinking_budget": 0, "include_thoughts": True},
            }
        ),
        MODEL,
    )
    assert snake.chat.sampling.max_tokens == 9
    assert snake.chat.enable_thinking is False
    assert snake.include_thoughts is False  # no thinking, nothing to include


@pytest.mark.parametrize(
    ("thinking", "enabled"),
    [
        ({"thinkingBudget": 0}, False),
        ({"thinkingBudget": 1024}, True),
        ({"thinkingLevel": "HIGH"}, True),
        ({"thinkingLevel": "MINIMAL"}, False),
        ({"includeThoughts": True}, True),
        ({}, None),
    ],
)
def test_thinking_config(thinking: dict[str, Any], enabled: bool | None) -> None:
    chat = parse(body(generationConfig={"thinkingConfig": thinking}), MODEL)
    assert chat.enable_thinking is enabled


def test_response_schema_openapi_becomes_json_schema_and_turns_thinking_off() -> None:
    schema = {
        "type": "OBJECT",
        "properties": {
            "reasoning": {"type": "STRING"},
            "model_choice": {"type": "STRING", "enum": ["flash", "pro"]},
            "scores": {"type": "ARRAY", "items": {"type": "INTEGER"}, "minItems": "1"},
        },
        "required": ["reasoning", "model_choice"],
        "propertyOrdering": ["reasoning", "model_choice"],
    }
    chat = parse(
        body(
            generationConfig={
                "responseMimeType": "application/json",
                "responseSchema": schema,
                "thinkingConfig": {"thinkingBudget": 512},
            }
        ),
        MODEL,
    )
    assert chat.sampling.json_schema == {
        "type": "object",
        "properties": {
            "reasoning": {"type": "string"},
            "model_choice": {"type": "string", "enum": ["flash", "pro"]},
            "scores": {"type": "array", "items": {"type": "integer"}, "minItems": 1},
        },
        "required": ["reasoning", "model_choice"],
    }
    assert chat.enable_thinking is False


def test_response_json_schema_passes_through() -> None:
    schema = {
        "type": "object",
        "properties": {"a": {"type": "number"}},
        "additionalProperties": False,
    }
    for key in ("responseJsonSchema", "_responseJsonSchema"):
        chat = parse(
            body(generationConfig={"responseMimeType": "application/json", key: schema}), MODEL
        )
        assert chat.sampling.json_schema == schema
    chat = parse(body(generationConfig={"responseMimeType": "application/json"}), MODEL)
    assert chat.sampling.json_schema == {"type": "object"}


def test_response_json_schema_with_gemini_type_names_is_lower_cased() -> None:
    # What Gemini CLI's router sends: a JSON schema spelled with OpenAPI's upper-case types.
    router = {
        "type": "OBJECT",
        "properties": {
            "complexity_reasoning": {"type": "STRING", "description": "Why."},
            "complexity_score": {"type": "INTEGER"},
            "type": {"type": ["STRING", "NULL"], "enum": ["OBJECT", None]},
        },
        "required": ["complexity_reasoning", "complexity_score"],
    }
    chat = parse(
        body(
            generationConfig={"responseMimeType": "application/json", "responseJsonSchema": router}
        ),
        MODEL,
    )
    assert chat.sampling.json_schema == {
        "type": "object",
        "properties": {
            "complexity_reasoning": {"type": "string", "description": "Why."},
            "complexity_score": {"type": "integer"},
            "type": {"type": ["string", "null"], "enum": ["OBJECT", None]},
        },
        "required": ["complexity_reasoning", "complexity_score"],
    }


def test_openapi_schema_nullable_any_of_and_lower_case() -> None:
    assert openapi_to_json_schema(
        {"anyOf": [{"type": "STRING"}, {"type": "integer"}], "nullable": True}
    ) == {"anyOf": [{"type": "string"}, {"type": "integer"}, {"type": "null"}]}
    assert openapi_to_json_schema({"type": "TYPE_UNSPECIFIED", "description": "x"}) == {
        "description": "x"
    }


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        (b"{not json", "Invalid JSON payload"),
        (b"[]", "JSON object"),
        (body(contents=[]), "contents is not specified"),
        (body(contents=[{"role": "system", "parts": [{"text": "x"}]}]), "valid role"),
        (
            body(contents=[{"role": "user", "parts": [{"inlineData": {"mimeType": "image/png"}}]}]),
            "text only",
        ),
        (body(contents=[{"role": "user", "parts": [{"foo": 1}]}]), "one of text"),
        (body(contents=[{"role": "user", "parts": "hi"}]), "expected a list"),
        (
            body(
                contents=[user("x"), {"role": "user", "parts": [{"functionCall": {"name": "f"}}]}]
            ),
            "belongs in a 'model' turn",
        ),
        (body(generationConfig={"candidateCount": 2}), "one candidate"),
        (body(generationConfig={"temperature": 3}), "out of range"),
        (body(generationConfig={"maxOutputTokens": 0}), "at least 1"),
        (body(generationConfig={"topK": "x"}), "expected a number"),
        (body(generationConfig={"responseMimeType": "text/x.enum"}), "not supported"),
        (body(generationConfig={"responseSchema": {"type": "OBJECT"}}), "application/json"),
        (body(toolConfig={"functionCallingConfig": {"mode": "SOMETIMES"}}), "AUTO, ANY"),
        (body(tools=[{"functionDeclarations": [{"description": "no name"}]}]), "needs a name"),
    ],
)
def test_bad_requests_are_refused_clearly(raw: bytes, says: str) -> None:
    assert says in refused(raw).message


def test_count_tokens_bodies() -> None:
    plain = parse_count_tokens(json.dumps({"contents": [user("hi")]}).encode(), MODEL)
    wrapped = parse_count_tokens(
        json.dumps(
            {
                "generateContentRequest": {
                    "model": f"models/{MODEL}",
                    "contents": [user("hi")],
                    "systemInstruction": {"parts": [{"text": "s"}]},
                }
            }
        ).encode(),
        MODEL,
    )
    assert plain.messages == [Message("user", "hi")]
    assert wrapped.messages == [Message("system", "s"), Message("user", "hi")]
    assert wrapped.model == MODEL
    assert count_tokens_response(12)["totalTokens"] == 12


# -- response --------------------------------------------------------------------------------


def test_error_shapes_and_statuses() -> None:
    assert error_body(400, "bad") == {
        "error": {"code": 400, "message": "bad", "status": "INVALID_ARGUMENT"}
    }
    assert error_body(404, "x")["error"]["status"] == "NOT_FOUND"
    assert error_body(429, "x")["error"]["status"] == "RESOURCE_EXHAUSTED"
    assert error_body(503, "x")["error"]["status"] == "UNAVAILABLE"
    assert error_body(500, "x")["error"]["status"] == "INTERNAL"
    assert "exceeds the maximum number of tokens allowed (10)" in prompt_too_long_message(11, 10)


def test_whole_response_parts_finish_and_usage() -> None:
    call = ToolCall("call_abc", "ls", '{"path": "."}')
    reply = AssistantReply(content="\n\nOK.\n", reasoning="think", tool_calls=[call])
    out = generate_response("r1", MODEL, reply, finish_reason("stop"), 10, 7)
    assert out["candidates"] == [
        {
            "index": 0,
            "content": {
                "parts": [
                    {"text": "OK."},
                    {"functionCall": {"id": "call_abc", "name": "ls", "args": {"path": "."}}},
                ],
                "role": "model",
            },
            "finishReason": "STOP",
        }
    ]
    assert out["usageMetadata"]["promptTokenCount"] == 10
    assert out["usageMetadata"]["candidatesTokenCount"] == 7
    assert out["usageMetadata"]["totalTokenCount"] == 17
    assert "thoughtsTokenCount" not in out["usageMetadata"]
    assert out["modelVersion"] == MODEL and out["responseId"] == "r1"
    with_thoughts = generate_response("r1", MODEL, reply, "STOP", 10, 7, include_thoughts=True)
    assert with_thoughts["candidates"][0]["content"]["parts"][0] == {
        "text": "think",
        "thought": True,
    }
    assert finish_reason("length") == "MAX_TOKENS"
    empty = generate_response("r", MODEL, AssistantReply("", None, []), "STOP", 1, 1)
    assert empty["candidates"][0]["content"]["parts"] == [{"text": ""}]
    # Arguments that are not an object are wrapped: Gemini's args is always one.
    odd = generate_response(
        "r", MODEL, AssistantReply("", None, [ToolCall("c", "f", "[1]")]), "STOP", 1, 1
    )
    assert odd["candidates"][0]["content"]["parts"][0]["functionCall"]["args"] == {"input": [1]}
    assert usage_metadata(5, 9, 4) == {
        "promptTokenCount": 5,
        "candidatesTokenCount": 5,
        "totalTokenCount": 14,
        "thoughtsTokenCount": 4,
        "promptTokensDetails": [{"modality": "TEXT", "tokenCount": 5}],
    }


def test_stream_chunks_text_as_it_arrives_and_calls_whole() -> None:
    writer = ChunkWriter("r2", MODEL, prompt_tokens=8)
    call = ToolCall("call_x", "write_file", '{"path": "a.txt", "content": "hi"}')
    chunks = writer.chunks(
        [
            ReasoningDelta("secret"),
            ContentDelta("\n\n"),
            ContentDelta("Hel"),
            ContentDelta("lo \n"),
            ContentDelta("there\n\n"),
            ToolCallEvent(0, call),
        ]
    )
    parts = [c["candidates"][0]["content"]["parts"] for c in chunks]
    assert parts == [
        [{"text": "Hel"}],
        [{"text": "lo"}],
        [{"text": " \nthere"}],
        [
            {
                "functionCall": {
                    "id": "call_x",
                    "name": "write_file",
                    "args": {"path": "a.txt", "content": "hi"},
                }
            }
        ],
    ]
    assert all("finishReason" not in c["candidates"][0] for c in chunks)
    assert all(c["responseId"] == "r2" for c in chunks)
    last = writer.finish("STOP", 20)
    assert last["candidates"][0]["finishReason"] == "STOP"
    assert "content" not in last["candidates"][0]
    assert last["usageMetadata"]["totalTokenCount"] == 28
    # The streamed text is the whole answer's text.
    whole = generate_response(
        "r2", MODEL, AssistantReply("\n\nHello \nthere\n\n", "secret", [call]), "STOP", 8, 20
    )
    assert (
        "".join(p[0].get("text", "") for p in parts)
        == whole["candidates"][0]["content"]["parts"][0]["text"]
    )
    encoded = sse(last)
    assert encoded.startswith(b"data: {") and encoded.endswith(b"\r\n\r\n")
    assert json.loads(encoded[len(b"data: ") :]) == last


def test_stream_thoughts_only_when_asked_and_empty_reply() -> None:
    writer = ChunkWriter("r", MODEL, 3, include_thoughts=True)
    chunks = writer.chunks([ReasoningDelta("\nstep"), ReasoningDelta(" one\n"), ContentDelta("ok")])
    assert [c["candidates"][0]["content"]["parts"] for c in chunks] == [
        [{"text": "step", "thought": True}],
        [{"text": " one", "thought": True}],
        [{"text": "ok"}],
    ]
    empty = ChunkWriter("r", MODEL, 3)
    assert empty.chunks([ReasoningDelta("x"), ContentDelta("  ")]) == []
    last = empty.finish("MAX_TOKENS", 4)
    assert last["candidates"][0]["content"]["parts"] == [{"text": ""}]
    assert last["candidates"][0]["finishReason"] == "MAX_TOKENS"


def test_models_listing_shape() -> None:
    listing = models_list(["policy", "gemini-2.5-flash"], 4096)
    names = [m["name"] for m in listing["models"]]
    assert names == ["models/policy", "models/gemini-2.5-flash"]
    one = model_object("models/gemini-2.5-pro", 4096)
    assert one["name"] == "models/gemini-2.5-pro"
    assert one["baseModelId"] == "gemini-2.5-pro"
    assert one["inputTokenLimit"] == 4096
    assert set(one["supportedGenerationMethods"]) == {
        "generateContent",
        "streamGenerateContent",
        "countTokens",
    }
