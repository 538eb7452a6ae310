"""OpenAI Chat Completions request parsing and response shapes."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from rewriter.canonical import AssistantReply, Message, RequestError, ToolCall, ToolSpec
from rewriter.providers.openai_chat.request import parse_request
from rewriter.providers.openai_chat.response import (
    ChunkWriter,
    completion_response,
    error_body,
    finish_reason,
)


def body(**fields: Any) -> bytes:
    data: dict[str, Any] = {"model": "policy", "messages": [{"role": "user", "content": "hi"}]}
    data.update(fields)
    return json.dumps(data).encode()


def refused(raw: bytes) -> RequestError:
    with pytest.raises(RequestError) as info:
        parse_request(raw)
    assert info.value.status == 400
    assert str(info.value) == info.value.message
    return info.value


# -- valid requests --------------------------------------------------------------------------


def test_minimal_request_defaults() -> None:
    req = parse_request(body())
    assert req.model == "policy"
    assert req.messages == [Message("user", "hi")]
    assert req.tools == []
    assert req.tool_choice is None
    assert req.stream is False
    assert req.include_usage is False
    assert req.enable_thinking is None
    s = req.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.seed, s.json_schema) == (None,) * 5
    assert s.stop == []


def test_list_of_text_parts_is_joined() -> None:
    req = parse_request(
        body(
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "Hello, "},
                        {"type": "text", "text": "you"},
                    ],
                }
            ]
        )
    )
    assert req.messages[0].content == "Hello, you"


def test_developer_role_is_system() -> None:
    req = parse_request(
        body(
            messages=[
                {"role": "developer", "content": "Be terse."},
                {"role": "system", "content": "Also careful."},
                {"role": "user", "content": "hi"},
            ]
        )
    )
    assert [m.role for m in req.messages] == ["system", "system", "user"]
    assert req.messages[0].content == "Be terse."


def test_assistant_tool_calls_and_tool_results() -> None:
    args = '{"path":  "/tmp/a.txt" ,"n":1}'  # kept byte for byte, not re-serialized
    req = parse_request(
        body(
            messages=[
                {"role": "user", "content": "read it"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "call_abc",
                            "type": "function",
                            "function": {"name": "read_file", "arguments": args},
                        },
                        {
                            "id": "call_def",
                            "type": "function",
                            "function": {"name": "ls", "arguments": {"dir": "é"}},
                        },
                    ],
                    "reasoning_content": "need the file",
                },
                {"role": "tool", "tool_call_id": "call_abc", "content": "file text"},
                {
                    "role": "tool",
                    "tool_call_id": "call_def",
                    "content": [{"type": "text", "text": "a.txt"}],
                },
            ]
        )
    )
    assistant = req.messages[1]
    assert assistant.role == "assistant"
    assert assistant.content == ""
    assert assistant.reasoning == "need the file"
    assert assistant.tool_calls == (
        ToolCall("call_abc", "read_file", args),
        ToolCall("call_def", "ls", '{"dir": "é"}'),
    )
    assert req.messages[2] == Message("tool", "file text", tool_call_id="call_abc")
    assert req.messages[3] == Message("tool", "a.txt", tool_call_id="call_def")


def test_reasoning_field_alias() -> None:
    req = parse_request(
        body(
            messages=[
                {"role": "user", "content": "q"},
                {"role": "assistant", "content": "a", "reasoning": "r"},
            ]
        )
    )
    assert req.messages[1].reasoning == "r"


def test_tools_and_tool_choice() -> None:
    params = {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}
    choice = {"type": "function", "function": {"name": "read_file"}}
    req = parse_request(
        body(
            tools=[
                {
                    "type": "function",
                    "function": {
                        "name": "read_file",
                        "description": "Read a file",
                        "parameters": params,
                        "strict": True,
                    },
                },
                {"type": "function", "function": {"name": "noop"}},
            ],
            tool_choice=choice,
        )
    )
    assert req.tools == [ToolSpec("read_file", "Read a file", params), ToolSpec("noop", "", {})]
    assert req.tool_choice == choice
    assert parse_request(body(tool_choice="auto")).tool_choice == "auto"


def test_stop_string_and_list() -> None:
    assert parse_request(body(stop="END")).sampling.stop == ["END"]
    assert parse_request(body(stop=["a", "b"])).sampling.stop == ["a", "b"]


def test_response_format_json_schema() -> None:
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    req = parse_request(
        body(
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "answer", "schema": schema, "strict": True},
            }
        )
    )
    assert req.sampling.json_schema == schema
    req = parse_request(body(response_format={"type": "json_object"}))
    assert req.sampling.json_schema == {"type": "object"}
    req = parse_request(body(response_format={"type": "text"}))
    assert req.sampling.json_schema is None


def test_max_completion_tokens_wins_over_max_tokens() -> None:
    assert parse_request(body(max_completion_tokens=77)).sampling.max_tokens == 77
    assert parse_request(body(max_tokens=33)).sampling.max_tokens == 33
    req = parse_request(body(max_tokens=33, max_completion_tokens=77))
    assert req.sampling.max_tokens == 77


def test_sampling_parameters() -> None:
    req = parse_request(
        body(
            temperature=0.7,
            top_p=0.9,
            seed=42,
            top_k=20,
            min_tokens=3,
            ignore_eos=True,
            store=False,  # an unused OpenAI field is accepted
            metadata={"k": "v"},
        )
    )
    s = req.sampling
    assert (s.temperature, s.top_p, s.seed, s.top_k, s.min_tokens, s.ignore_eos) == (
        0.7,
        0.9,
        42,
        20,
        3,
        True,
    )


def test_stream_options_include_usage() -> None:
    req = parse_request(body(stream=True, stream_options={"include_usage": True}))
    assert req.stream is True and req.include_usage is True
    req = parse_request(body(stream=True))
    assert req.stream is True and req.include_usage is False
    assert parse_request(body(stream_options={"include_usage": False})).include_usage is False


@pytest.mark.parametrize("value", [False, True])
def test_chat_template_kwargs_enable_thinking(value: bool) -> None:
    req = parse_request(body(chat_template_kwargs={"enable_thinking": value}))
    assert req.enable_thinking is value


def test_explicit_nulls_are_defaults() -> None:
    """OpenAI's API takes null for its optional parameters; clients do send them."""
    req = parse_request(
        body(
            n=None,
            stream=None,
            stream_options=None,
            temperature=None,
            top_p=None,
            max_tokens=None,
            stop=None,
            tools=None,
            tool_choice=None,
            response_format=None,
            seed=None,
        )
    )
    assert req.stream is False
    assert req.sampling.max_tokens is None
    assert req.sampling.stop == []


def test_n_equal_one_is_accepted() -> None:
    assert parse_request(body(n=1)).model == "policy"


# -- refused requests ------------------------------------------------------------------------


def test_malformed_json() -> None:
    err = refused(b'{"model": "policy", "messages": [')
    assert "JSON" in err.message


def test_undecodable_bytes() -> None:
    assert "JSON" in refused(b"\xff\xfe{}").message


@pytest.mark.parametrize("raw", [b"[]", b"null", b'"text"', b"3"])
def test_non_object_body(raw: bytes) -> None:
    assert "JSON object" in refused(raw).message


def test_missing_messages() -> None:
    err = refused(json.dumps({"model": "policy"}).encode())
    assert "messages" in err.message and "Missing" in err.message
    assert err.param == "messages"


def test_missing_model() -> None:
    err = refused(json.dumps({"messages": [{"role": "user", "content": "x"}]}).encode())
    assert "model" in err.message


def test_empty_messages() -> None:
    err = refused(body(messages=[]))
    assert "messages" in err.message
    assert err.param == "messages"


def test_unknown_role() -> None:
    err = refused(body(messages=[{"role": "robot", "content": "beep"}]))
    assert "'robot'" in err.message and "role" in err.message
    assert "assistant" in err.message  # names the supported roles
    assert err.param is not None and err.param.endswith("role")


@pytest.mark.parametrize("kind", ["image_url", "input_audio", "file"])
def test_non_text_content_part(kind: str) -> None:
    part = {"type": kind, kind: {"url": "data:image/png;base64,AAAA"}}
    err = refused(
        body(messages=[{"role": "user", "content": [{"type": "text", "text": "see"}, part]}])
    )
    assert repr(kind) in err.message and "not supported" in err.message
    assert err.param == "messages.[0].content"


def test_unknown_content_part() -> None:
    err = refused(body(messages=[{"role": "user", "content": [{"type": "hologram"}]}]))
    assert "'hologram'" in err.message


def test_tool_message_without_tool_call_id() -> None:
    err = refused(
        body(
            messages=[
                {"role": "user", "content": "x"},
                {"role": "tool", "content": "result"},
            ]
        )
    )
    assert "tool_call_id" in err.message and "messages.[1]" in err.message
    assert err.param == "messages.[1].tool_call_id"


def test_n_greater_than_one() -> None:
    err = refused(body(n=2))
    assert "n=1" in err.message
    assert err.param == "n"


@pytest.mark.parametrize(
    "fields, name",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 2}, "top_p"),
    ],
)
def test_out_of_range_sampling(fields: dict[str, Any], name: str) -> None:
    err = refused(body(**fields))
    assert name in err.message
    assert err.param == name


# -- responses -------------------------------------------------------------------------------

CALL = ToolCall("call_1", "read_file", '{"path": "a"}')


def test_completion_response_text() -> None:
    reply = AssistantReply(content="Hello", reasoning=None, tool_calls=[])
    out = completion_response("chatcmpl-1", "policy", reply, "stop", 10, 3)
    assert out["id"] == "chatcmpl-1"
    assert out["object"] == "chat.completion"
    assert out["model"] == "policy"
    assert isinstance(out["created"], int) and out["created"] > 1_600_000_000
    assert len(out["choices"]) == 1
    choice = out["choices"][0]
    assert choice["index"] == 0
    assert choice["finish_reason"] == "stop"
    assert choice["message"] == {"role": "assistant", "content": "Hello"}
    assert out["usage"] == {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13}
    json.dumps(out)  # serializable


def test_completion_response_tool_calls_and_reasoning() -> None:
    reply = AssistantReply(content="", reasoning="thought", tool_calls=[CALL])
    out = completion_response("chatcmpl-2", "policy", reply, "tool_calls", 5, 7)
    message = out["choices"][0]["message"]
    assert message["content"] is None
    assert message["reasoning_content"] == "thought"
    assert message["tool_calls"] == [
        {
            "id": "call_1",
            "type": "function",
            "function": {"name": "read_file", "arguments": '{"path": "a"}'},
        }
    ]
    assert "index" not in message["tool_calls"][0]
    assert out["choices"][0]["finish_reason"] == "tool_calls"


def test_completion_response_empty_text_is_empty_string() -> None:
    reply = AssistantReply(content="", reasoning=None, tool_calls=[])
    out = completion_response("chatcmpl-3", "policy", reply, "length", 1, 0)
    assert out["choices"][0]["message"]["content"] == ""
    assert out["choices"][0]["finish_reason"] == "length"


def test_finish_reason_mapping() -> None:
    with_call = AssistantReply(content="", reasoning=None, tool_calls=[CALL])
    plain = AssistantReply(content="x", reasoning=None, tool_calls=[])
    assert finish_reason("stop", with_call) == "tool_calls"
    assert finish_reason("length", with_call) == "length"
    assert finish_reason("stop", plain) == "stop"
    assert finish_reason("length", plain) == "length"
    assert finish_reason(None, plain) == "stop"


def test_chunk_writer_shapes() -> None:
    writer = ChunkWriter("chatcmpl-9", "policy")
    chunks = [
        writer.role(),
        writer.reasoning("hmm"),
        writer.content("Hi"),
        writer.tool_call(0, CALL),
        writer.finish("tool_calls"),
    ]
    for chunk in chunks:
        assert chunk["id"] == "chatcmpl-9"
        assert chunk["object"] == "chat.completion.chunk"
        assert chunk["model"] == "policy"
        assert chunk["created"] == writer.created
        assert len(chunk["choices"]) == 1 and chunk["choices"][0]["index"] == 0
        json.dumps(chunk)
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert deltas[1] == {"reasoning_content": "hmm"}
    assert deltas[2] == {"content": "Hi"}
    assert deltas[3] == {
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "read_file", "arguments": '{"path": "a"}'},
                "index": 0,
            }
        ]
    }
    assert deltas[4] == {}
    reasons = [c["choices"][0]["finish_reason"] for c in chunks]
    assert reasons == [None, None, None, None, "tool_calls"]
    usage = writer.usage(12, 4)
    assert usage["object"] == "chat.completion.chunk"
    assert usage["choices"] == []
    assert usage["usage"] == {"prompt_tokens": 12, "completion_tokens": 4, "total_tokens": 16}


def test_error_body_shape() -> None:
    assert error_body("bad", 400, "n") == {
        "error": {"message": "bad", "type": "invalid_request_error", "param": "n", "code": None}
    }
    assert error_body("down", 503)["error"]["type"] == "server_error"
    assert error_body("slow", 429)["error"]["type"] == "rate_limit_error"


@settings(max_examples=300, deadline=None)
@given(text=st.text(), model=st.text(max_size=20))
@example(text="", model="\x00agenttap text\x00")  # the old fixed marker, as a model name
def test_a_text_event_is_the_whole_event_rendered(text: str, model: str) -> None:
    """rewriter/wire.py TextEvent: the chunk built around a marker equals the chunk rendered
    whole, for any text (quotes, backslashes, controls, astral characters, the marker's NUL)."""
    from rewriter.providers.base import sse
    from rewriter.providers.openai_chat.response import ChunkWriter
    from rewriter.wire import TextEvent

    writer = ChunkWriter("chatcmpl-1", model)
    for build in (writer.content, writer.reasoning):
        fast = TextEvent(lambda t, build=build: sse(build(t)))  # type: ignore[misc]
        try:
            whole = sse(build(text))
        except UnicodeEncodeError:  # a lone surrogate: no event can carry it
            with pytest.raises(UnicodeEncodeError):
                fast(text)
            continue
        assert fast(text) == whole


def test_a_text_event_needs_its_text_once() -> None:
    from rewriter.wire import TextEvent

    with pytest.raises(ValueError, match="exactly once"):
        TextEvent(lambda t: b"data: {}\n\n")
    with pytest.raises(ValueError, match="exactly once"):
        TextEvent(lambda t: json.dumps([t, t], ensure_ascii=False).encode())
