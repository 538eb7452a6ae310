"""Anthropic Messages request parsing, response shapes and SSE events; Claude Code's offline
answers; the model map option. Pure functions: no network, no proxy, no vLLM."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from capture.options.values import parse_model_map
from rewriter.canonical import AssistantReply, Message, RequestError, ToolCall, ToolSpec
from rewriter.parsers import ContentDelta, ParseEvent, ReasoningDelta, ToolCallEvent
from rewriter.providers.anthropic.request import Normalization, parse_request
from rewriter.providers.anthropic.response import (
    EventWriter,
    content_blocks,
    error_body,
    message_response,
    prompt_too_long_message,
    sse,
    stop_reason,
    thinking_signature,
    tool_use_id,
)
from rewriter.providers.anthropic.serving import local_answer

BILLING = "x-anthropic-billing-header: cc_version=2.1.197; cc_entrypoint=sdk-cli; cch=1a2b3;"


def body(**fields: Any) -> bytes:
    data: dict[str, Any] = {
        "model": "claude-sonnet-4-5",
        "max_tokens": 1024,
        "messages": [{"role": "user", "content": "hi"}],
    }
    data.update(fields)
    return json.dumps(data).encode()


def user(content: Any) -> dict[str, Any]:
    return {"role": "user", "content": content}


def assistant(content: Any) -> dict[str, Any]:
    return {"role": "assistant", "content": content}


def text(t: str, **extra: Any) -> dict[str, Any]:
    return {"type": "text", "text": t, **extra}


def refused(raw: bytes, **kwargs: Any) -> RequestError:
    with pytest.raises(RequestError) as info:
        parse_request(raw, **kwargs)
    assert info.value.status == 400
    assert str(info.value) == info.value.message
    return info.value


# -- requests: system and normalization ------------------------------------------------------


def test_minimal_request_defaults() -> None:
    req = parse_request(body())
    assert req.model == "claude-sonnet-4-5"
    assert req.messages == [Message("user", "hi")]
    assert req.tools == []
    assert req.tool_choice is None
    assert req.stream is False
    assert req.enable_thinking is False
    s = req.sampling
    assert s.max_tokens == 1024
    assert (s.temperature, s.top_p, s.top_k, s.json_schema) == (None,) * 4
    assert s.stop == []


def test_system_string() -> None:
    req = parse_request(body(system="Be terse."))
    assert req.messages == [Message("system", "Be terse."), Message("user", "hi")]


def test_system_blocks_joined_and_billing_header_dropped() -> None:
    system = [
        text(BILLING),
        text("You are Claude Code.", cache_control={"type": "ephemeral"}),
        text("Be terse."),
    ]
    req = parse_request(body(system=system))
    assert req.messages[0] == Message("system", "You are Claude Code.\n\nBe terse.")
    # cch= changes on every call; the rendered prompt must not.
    other = [text(BILLING.replace("1a2b3", "9f8e7")), *system[1:]]
    assert parse_request(body(system=other)).messages == req.messages


def test_system_only_billing_header_gives_no_system_message() -> None:
    req = parse_request(body(system=[text(BILLING)]))
    assert req.messages == [Message("user", "hi")]


def test_empty_normalization_keeps_billing_header() -> None:
    req = parse_request(body(system=[text(BILLING), text("S")]), Normalization.from_option(""))
    assert req.messages[0] == Message("system", BILLING + "\n\nS")


def test_custom_normalization_patterns() -> None:
    norm = Normalization.from_option(r"^Today's date is || cwd: /tmp/\w+ ")
    assert len(norm.drop_system_blocks) == 2
    assert norm.keep_system_text("hello")
    assert not norm.keep_system_text("Today's date is 2025-01-01.")
    assert not norm.keep_system_text("env\ncwd: /tmp/abc123")
    system = [text(BILLING), text("Today's date is 2025-01-01."), text("Stay.")]
    req = parse_request(body(system=system), norm)
    # The custom patterns replace the default: the billing header is kept.
    assert req.messages[0] == Message("system", BILLING + "\n\nStay.")


def test_bad_normalization_regex() -> None:
    with pytest.raises(ValueError, match="bad regex"):
        Normalization.from_option("ok||(unclosed")


def test_default_normalization_drops_only_a_leading_billing_header() -> None:
    norm = Normalization()
    assert not norm.keep_system_text(BILLING)
    assert norm.keep_system_text("see x-anthropic-billing-header: in the docs")


def test_system_role_messages_in_the_middle() -> None:
    req = parse_request(
        body(
            system="top",
            messages=[
                user("a"),
                {"role": "system", "content": "reminder"},
                assistant("b"),
                {"role": "system", "content": [text(BILLING), text("x"), text("y")]},
                {"role": "system", "content": [text(BILLING)]},  # nothing left: no message
                user("c"),
            ],
        )
    )
    assert req.messages == [
        Message("system", "top"),
        Message("user", "a"),
        Message("system", "reminder"),
        Message("assistant", "b"),
        Message("system", "x\n\ny"),
        Message("user", "c"),
    ]


# -- requests: message content ---------------------------------------------------------------


def test_string_and_single_text_block_are_equal() -> None:
    as_string = parse_request(
        body(system="s", messages=[user("q"), assistant("a"), user("q2")])
    ).messages
    as_blocks = parse_request(
        body(
            system=[text("s")],
            messages=[user([text("q")]), assistant([text("a")]), user([text("q2")])],
        )
    ).messages
    assert as_string == as_blocks
    assert as_string[2] == Message("assistant", "a")


def test_text_blocks_joined_with_blank_line() -> None:
    req = parse_request(body(messages=[user([text("one"), text(""), text("two")])]))
    assert req.messages == [Message("user", "one\n\ntwo")]


def test_cache_control_is_ignored() -> None:
    cc = {"cache_control": {"type": "ephemeral"}}
    messages = [
        user([text("q")]),
        assistant([{"type": "tool_use", "id": "toolu_1", "name": "ls", "input": {}}]),
        user([{"type": "tool_result", "tool_use_id": "toolu_1", "content": [text("r")]}]),
    ]
    plain = parse_request(body(system=[text("s")], messages=messages, tools=[LS_TOOL]))
    marked_messages = [
        user([text("q", **cc)]),
        assistant([{"type": "tool_use", "id": "toolu_1", "name": "ls", "input": {}, **cc}]),
        user(
            [
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_1",
                    "content": [text("r", **cc)],
                    **cc,
                }
            ]
        ),
    ]
    marked = parse_request(
        body(system=[text("s", **cc)], messages=marked_messages, tools=[{**LS_TOOL, **cc}])
    )
    assert marked.messages == plain.messages
    assert marked.tools == plain.tools


def test_tool_results_then_user_text_in_order() -> None:
    req = parse_request(
        body(
            messages=[
                user("go"),
                assistant(
                    [
                        {"type": "tool_use", "id": "toolu_a", "name": "f", "input": {}},
                        {"type": "tool_use", "id": "toolu_b", "name": "g", "input": {}},
                        {"type": "tool_use", "id": "toolu_c", "name": "h", "input": {}},
                    ]
                ),
                user(
                    [
                        {"type": "tool_result", "tool_use_id": "toolu_a", "content": "plain"},
                        {
                            "type": "tool_result",
                            "tool_use_id": "toolu_b",
                            "content": [text("line 1"), text("line 2")],
                        },
                        {
                            "type": "tool_result",
                            "tool_use_id": "toolu_c",
                            "content": "boom",
                            "is_error": True,
                        },
                        text("now continue"),
                        text("please"),
                    ]
                ),
            ]
        )
    )
    assert req.messages[2:] == [
        Message("tool", "plain", tool_call_id="toolu_a"),
        Message("tool", "line 1\n\nline 2", tool_call_id="toolu_b"),
        Message("tool", "Error: boom", tool_call_id="toolu_c"),
        Message("user", "now continue\n\nplease"),
    ]


def test_text_before_tool_result_is_its_own_user_message() -> None:
    req = parse_request(
        body(
            messages=[
                user(
                    [
                        text("before"),
                        {"type": "tool_result", "tool_use_id": "toolu_a"},
                        {"type": "tool_result", "tool_use_id": "toolu_b", "is_error": True},
                        text("after"),
                    ]
                )
            ]
        )
    )
    assert req.messages == [
        Message("user", "before"),
        Message("tool", "", tool_call_id="toolu_a"),
        Message("tool", "Error", tool_call_id="toolu_b"),
        Message("user", "after"),
    ]


def test_empty_user_content_list_is_one_empty_user_message() -> None:
    assert parse_request(body(messages=[user([])])).messages == [Message("user", "")]


def test_assistant_blocks() -> None:
    req = parse_request(
        body(
            messages=[
                user("q"),
                assistant(
                    [
                        {"type": "thinking", "thinking": "plan", "signature": "sig"},
                        {"type": "redacted_thinking", "data": "opaque"},
                        {"type": "thinking", "thinking": "more", "signature": "sig2"},
                        text("Reading."),
                        {
                            "type": "tool_use",
                            "id": "toolu_1",
                            "name": "read",
                            "input": {"path": "é.txt", "n": 2},
                        },
                        text("And listing."),
                        {"type": "tool_use", "id": "toolu_2", "name": "ls", "input": {}},
                    ]
                ),
            ]
        )
    )
    message = req.messages[1]
    assert message.role == "assistant"
    assert message.reasoning == "plan\n\nmore"
    assert message.content == "Reading.\n\nAnd listing."
    assert message.tool_calls == (
        ToolCall("toolu_1", "read", json.dumps({"path": "é.txt", "n": 2}, ensure_ascii=False)),
        ToolCall("toolu_2", "ls", "{}"),
    )
    assert json.loads(message.tool_calls[0].arguments) == {"path": "é.txt", "n": 2}


def test_assistant_without_thinking_has_no_reasoning() -> None:
    req = parse_request(
        body(
            messages=[
                user("q"),
                assistant([{"type": "redacted_thinking", "data": "opaque"}, text("a")]),
            ]
        )
    )
    assert req.messages[1] == Message("assistant", "a")


@pytest.mark.parametrize("kind", ["image", "document"])
@pytest.mark.parametrize("role", ["user", "assistant"])
def test_image_and_document_blocks_refused(kind: str, role: str) -> None:
    block = {"type": kind, "source": {"type": "base64", "media_type": "image/png", "data": "AA"}}
    err = refused(body(messages=[{"role": role, "content": [text("see"), block]}]))
    assert "text only" in err.message
    assert kind in err.message
    assert err.param == "messages.0.content.1"


def test_image_inside_tool_result_refused() -> None:
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "A"}}
    err = refused(
        body(
            messages=[user([{"type": "tool_result", "tool_use_id": "toolu_1", "content": [image]}])]
        )
    )
    assert "text only" in err.message
    assert err.param == "messages.0.content.0.content.0"


def test_image_in_system_refused() -> None:
    err = refused(body(system=[{"type": "image", "source": {}}]))
    assert "text only" in err.message
    assert err.param == "system.0"


@pytest.mark.parametrize("role", ["user", "assistant", "system"])
def test_unknown_block_type_refused(role: str) -> None:
    err = refused(body(messages=[{"role": role, "content": [{"type": "hologram"}]}]))
    assert "'hologram'" in err.message and "not supported" in err.message


def test_missing_max_tokens() -> None:
    raw = json.dumps({"model": "m", "messages": [user("hi")]}).encode()
    err = refused(raw)
    assert "max_tokens" in err.message
    assert err.param == "max_tokens"
    req = parse_request(raw, count_tokens=True)
    assert req.sampling.max_tokens is None
    assert req.messages == [Message("user", "hi")]


def test_malformed_json() -> None:
    assert "JSON" in refused(b'{"model": "m", "messages": [').message
    assert "JSON" in refused(b"\xff\xfe{}").message


@pytest.mark.parametrize("raw", [b"[]", b"null", b'"text"', b"3"])
def test_non_object_body(raw: bytes) -> None:
    assert "JSON object" in refused(raw).message


def test_missing_messages_and_bad_role() -> None:
    err = refused(json.dumps({"model": "m", "max_tokens": 5}).encode())
    assert err.param == "messages"
    assert "Field required" in err.message
    assert refused(body(messages=[])).param == "messages"
    err = refused(body(messages=[{"role": "tool", "content": "x"}]))
    assert err.param == "messages.0.role"


@pytest.mark.parametrize(
    "fields, name",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 2}, "top_p"),
    ],
)
def test_out_of_range_sampling(fields: dict[str, Any], name: str) -> None:
    assert refused(body(**fields)).param == name


# -- requests: tools, tool_choice, thinking, structured output, sampling ---------------------

LS_TOOL = {
    "name": "ls",
    "description": "List a directory",
    "input_schema": {"type": "object", "properties": {"dir": {"type": "string"}}},
}


def test_tools_and_server_tools() -> None:
    req = parse_request(
        body(
            tools=[
                LS_TOOL,
                {"type": "web_search_20250305", "name": "web_search", "max_uses": 5},
                {"type": "custom", "name": "noop", "input_schema": {"type": "object"}},
            ]
        )
    )
    assert req.tools == [
        ToolSpec("ls", "List a directory", LS_TOOL["input_schema"]),  # type: ignore[arg-type]
        ToolSpec("noop", "", {"type": "object"}),
    ]


def test_custom_tool_without_input_schema_refused() -> None:
    err = refused(body(tools=[{"name": "f"}]))
    assert err.param == "tools.0.input_schema"
    err = refused(body(tools=[LS_TOOL, {"description": "no name", "input_schema": {}}]))
    assert err.param == "tools.1.name"


@pytest.mark.parametrize(
    "choice, expected",
    [
        ({"type": "auto"}, "auto"),
        ({"type": "auto", "disable_parallel_tool_use": True}, "auto"),
        ({"type": "any"}, "required"),
        ({"type": "none"}, "none"),
        ({"type": "tool", "name": "ls"}, {"type": "function", "function": {"name": "ls"}}),
        (None, None),
    ],
)
def test_tool_choice(choice: dict[str, Any] | None, expected: Any) -> None:
    req = parse_request(body(tools=[LS_TOOL], tool_choice=choice))
    assert req.tool_choice == expected


def test_bad_tool_choice() -> None:
    err = refused(body(tool_choice={"type": "sometimes"}))
    assert err.param == "tool_choice.type"
    assert "'sometimes'" in err.message


@pytest.mark.parametrize(
    "thinking, expected",
    [
        ({"type": "enabled", "budget_tokens": 2048}, True),
        ({"type": "adaptive"}, True),
        ({"type": "disabled"}, False),
        (None, False),
    ],
)
def test_thinking(thinking: dict[str, Any] | None, expected: bool) -> None:
    assert parse_request(body(thinking=thinking)).enable_thinking is expected


def test_thinking_absent() -> None:
    assert parse_request(body()).enable_thinking is False


def test_bad_thinking_type() -> None:
    err = refused(body(thinking={"type": "maybe"}))
    assert err.param == "thinking.type"


SCHEMA = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}


@pytest.mark.parametrize(
    "fields",
    [
        {"output_config": {"format": {"type": "json_schema", "schema": SCHEMA}}},
        {"output_format": {"type": "json_schema", "schema": SCHEMA}},
    ],
)
def test_json_schema_output_forces_thinking_off(fields: dict[str, Any]) -> None:
    req = parse_request(body(thinking={"type": "enabled", "budget_tokens": 1024}, **fields))
    assert req.sampling.json_schema == SCHEMA
    assert req.enable_thinking is False


def test_output_config_without_format() -> None:
    req = parse_request(body(output_config={"effort": "high"}, thinking={"type": "adaptive"}))
    assert req.sampling.json_schema is None
    assert req.enable_thinking is True


def test_bad_output_format() -> None:
    err = refused(body(output_config={"format": {"type": "json_object"}}))
    assert err.param == "output_config.format"
    refused(body(output_format={"type": "json_schema"}))  # no schema


def test_sampling_parameters_and_stream() -> None:
    req = parse_request(
        body(
            max_tokens=321,
            temperature=0.3,
            top_p=0.95,
            top_k=40,
            stop_sequences=["END", "\n\nHuman:"],
            stream=True,
            metadata={"user_id": "u"},  # accepted, unused
        )
    )
    s = req.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k) == (321, 0.3, 0.95, 40)
    assert s.stop == ["END", "\n\nHuman:"]
    assert req.stream is True
    assert parse_request(body(stream=False)).stream is False
    assert parse_request(body(stream=None)).stream is False


# -- responses -------------------------------------------------------------------------------

CALL = ToolCall("call_1", "read_file", '{"path": "a"}')


def reply(
    content: str = "", reasoning: str | None = None, calls: list[ToolCall] | None = None
) -> AssistantReply:
    return AssistantReply(content=content, reasoning=reasoning, tool_calls=calls or [])


def test_stop_reason() -> None:
    with_call = reply(calls=[CALL])
    plain = reply("x")
    assert stop_reason("length", None, plain) == ("max_tokens", None)
    assert stop_reason("length", None, with_call) == ("max_tokens", None)
    assert stop_reason("stop", None, with_call) == ("tool_use", None)
    assert stop_reason("stop", "END", plain) == ("stop_sequence", "END")
    assert stop_reason("stop", 151645, plain) == ("end_turn", None)  # the EOS token id
    assert stop_reason("stop", None, plain) == ("end_turn", None)
    assert stop_reason(None, None, plain) == ("end_turn", None)


def test_content_blocks_text_only() -> None:
    assert content_blocks(reply("  Hello  \n")) == [{"type": "text", "text": "Hello"}]


def test_content_blocks_empty_reply_is_one_empty_text_block() -> None:
    assert content_blocks(reply()) == [{"type": "text", "text": ""}]
    assert content_blocks(reply(" \n", reasoning="\n")) == [{"type": "text", "text": ""}]


def test_content_blocks_thinking_text_and_tool_use() -> None:
    blocks = content_blocks(reply("Let me look.", "\nplan it\n", [CALL]))
    assert [b["type"] for b in blocks] == ["thinking", "text", "tool_use"]
    assert blocks[0] == {
        "type": "thinking",
        "thinking": "plan it",
        "signature": thinking_signature("plan it"),
    }
    assert blocks[0]["signature"] and blocks[0]["signature"] == thinking_signature("plan it")
    assert blocks[1] == {"type": "text", "text": "Let me look."}
    use = blocks[2]
    assert use["id"].startswith("toolu_") and use["id"] == tool_use_id(CALL)
    assert use["name"] == "read_file"
    assert use["input"] == {"path": "a"}


def test_content_blocks_tool_only_has_no_text_block() -> None:
    blocks = content_blocks(reply("\n\n", None, [CALL]))
    assert [b["type"] for b in blocks] == ["tool_use"]


def test_tool_use_id_kept_when_already_anthropic() -> None:
    call = ToolCall("toolu_keep", "f", "{}")
    assert content_blocks(reply(calls=[call]))[0]["id"] == "toolu_keep"


@pytest.mark.parametrize(
    "arguments, expected",
    [
        ("[1, 2]", {"input": [1, 2]}),
        ("7", {"input": 7}),
        ("not json", {"input": "not json"}),
        ('{"ok": true}', {"ok": True}),
    ],
)
def test_non_object_arguments_are_wrapped(arguments: str, expected: Any) -> None:
    blocks = content_blocks(reply(calls=[ToolCall("call_x", "f", arguments)]))
    assert blocks[0]["input"] == expected


def test_message_response_shape() -> None:
    r = reply("Done.", "why", [CALL])
    out = message_response("msg_1", "claude-x", r, ("tool_use", None), 11, 5)
    assert out["id"] == "msg_1"
    assert out["type"] == "message"
    assert out["role"] == "assistant"
    assert out["model"] == "claude-x"
    assert [b["type"] for b in out["content"]] == ["thinking", "text", "tool_use"]
    assert out["stop_reason"] == "tool_use"
    assert out["stop_sequence"] is None
    assert out["usage"] == {
        "input_tokens": 11,
        "output_tokens": 5,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
    }
    json.dumps(out)
    out = message_response("msg_2", "m", reply("x"), ("stop_sequence", "END"), 1, 1)
    assert (out["stop_reason"], out["stop_sequence"]) == ("stop_sequence", "END")


@pytest.mark.parametrize(
    "status, kind",
    [
        (400, "invalid_request_error"),
        (404, "not_found_error"),
        (413, "request_too_large"),
        (429, "rate_limit_error"),
        (500, "api_error"),
        (502, "api_error"),
        (529, "overloaded_error"),
        (422, "invalid_request_error"),
    ],
)
def test_error_body(status: int, kind: str) -> None:
    out = error_body("msg", status)
    assert out["type"] == "error"
    assert out["error"] == {"type": kind, "message": "msg"}
    assert out["request_id"].startswith("req_")


def test_error_body_keeps_request_id() -> None:
    assert error_body("m", 400, "req_given")["request_id"] == "req_given"


def test_prompt_too_long_message() -> None:
    message = prompt_too_long_message(5000, 4096)
    assert "prompt is too long" in message
    assert "5000" in message and "4096" in message


def test_sse_bytes() -> None:
    event = {
        "type": "content_block_delta",
        "index": 0,
        "delta": {"type": "text_delta", "text": "é\n"},
    }
    raw = sse(event)
    assert raw.startswith(b"event: content_block_delta\ndata: ")
    assert raw.endswith(b"\n\n")
    lines = raw.decode().split("\n")
    assert len(lines) == 4 and lines[2:] == ["", ""]  # the data is one line
    assert json.loads(lines[1][len("data: ") :]) == event
    assert sse({"type": "ping"}) == b'event: ping\ndata: {"type":"ping"}\n\n'


# -- streaming events ------------------------------------------------------------------------


def stream(
    *feeds: Sequence[ParseEvent],
    reason: tuple[str, str | None] = ("end_turn", None),
    output_tokens: int = 9,
) -> list[dict[str, Any]]:
    """All events of one streamed message, the parser's events given in one or more feeds."""
    writer = EventWriter("msg_s", "claude-x", 42)
    events = writer.start()
    for feed in feeds:
        events += writer.events(list(feed))
    events += writer.finish(reason, output_tokens)
    for event in events:
        sse(event)  # every event serializes
    return events


def check_envelope(
    events: list[dict[str, Any]], reason: tuple[str, str | None], output_tokens: int
) -> list[dict[str, Any]]:
    """The message_start / ping / ... / message_delta / message_stop frame; returns the
    content events, after checking their indices."""
    start = events[0]
    assert start["type"] == "message_start"
    message = start["message"]
    assert message["id"] == "msg_s" and message["model"] == "claude-x"
    assert message["role"] == "assistant" and message["content"] == []
    assert message["stop_reason"] is None and message["usage"]["input_tokens"] == 42
    assert events[1] == {"type": "ping"}
    delta, stop = events[-2], events[-1]
    assert delta["type"] == "message_delta"
    assert delta["delta"] == {"stop_reason": reason[0], "stop_sequence": reason[1]}
    assert delta["usage"]["output_tokens"] == output_tokens
    assert stop == {"type": "message_stop"}
    content = events[2:-2]
    # Each block: start, deltas, stop, with consecutive indices from 0.
    index = -1
    open_index: int | None = None
    for event in content:
        if event["type"] == "content_block_start":
            assert open_index is None
            index += 1
            assert event["index"] == index
            open_index = index
        elif event["type"] == "content_block_delta":
            assert event["index"] == open_index
        else:
            assert event == {"type": "content_block_stop", "index": open_index}
            open_index = None
    assert open_index is None
    return content


def assemble(content: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The blocks a client builds from the content events."""
    blocks: list[dict[str, Any]] = []
    partial: dict[int, str] = {}
    for event in content:
        if event["type"] == "content_block_start":
            blocks.append(dict(event["content_block"]))
        elif event["type"] == "content_block_delta":
            block, delta = blocks[event["index"]], event["delta"]
            if delta["type"] == "text_delta":
                assert block["type"] == "text"
                block["text"] += delta["text"]
            elif delta["type"] == "thinking_delta":
                assert block["type"] == "thinking"
                block["thinking"] += delta["thinking"]
            elif delta["type"] == "signature_delta":
                assert block["type"] == "thinking"
                block["signature"] += delta["signature"]
            else:
                assert delta["type"] == "input_json_delta" and block["type"] == "tool_use"
                partial[event["index"]] = partial.get(event["index"], "") + delta["partial_json"]
        else:
            if event["index"] in partial:
                blocks[event["index"]]["input"] = json.loads(partial.pop(event["index"]))
    return blocks


def kinds(content: list[dict[str, Any]]) -> list[str]:
    return [
        e["type"] + ":" + e.get("delta", e.get("content_block", {})).get("type", "")
        for e in content
    ]


def without_ids(blocks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in b.items() if k != "id"} for b in blocks]


def test_stream_text_only() -> None:
    events = stream([ContentDelta("Hel"), ContentDelta("lo")])
    content = check_envelope(events, ("end_turn", None), 9)
    assert content == [
        {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Hel"}},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "lo"}},
        {"type": "content_block_stop", "index": 0},
    ]


def test_stream_thinking_text_tool_use() -> None:
    call = ToolCall("call_9", "read_file", '{"path": "é/a", "n": [1, 2]}')
    parsed: list[ParseEvent] = [
        ReasoningDelta("\nplan "),
        ReasoningDelta("it\n"),
        ContentDelta("\n\nLet me "),
        ContentDelta("look."),
        ContentDelta("\n"),
        ToolCallEvent(0, call),
    ]
    events = stream(parsed, reason=("tool_use", None), output_tokens=30)
    content = check_envelope(events, ("tool_use", None), 30)
    assert kinds(content) == [
        "content_block_start:thinking",
        "content_block_delta:thinking_delta",
        "content_block_delta:thinking_delta",
        "content_block_delta:signature_delta",
        "content_block_stop:",
        "content_block_start:text",
        "content_block_delta:text_delta",
        "content_block_delta:text_delta",
        "content_block_stop:",
        "content_block_start:tool_use",
        "content_block_delta:input_json_delta",
        "content_block_stop:",
    ]
    tool_start = content[9]["content_block"]
    assert tool_start["name"] == "read_file" and tool_start["input"] == {}
    assert tool_start["id"] == tool_use_id(call) == "toolu_9"
    streamed = assemble(content)
    assert streamed[2]["input"] == {"path": "é/a", "n": [1, 2]}
    expected = content_blocks(reply("\n\nLet me look.\n", "\nplan it\n", [call]))
    assert without_ids(streamed) == without_ids(expected)
    assert streamed[0]["signature"] == expected[0]["signature"] == thinking_signature("plan it")


def test_stream_leading_whitespace_before_tool_call_sends_no_text_block() -> None:
    events = stream([ContentDelta("\n\n"), ToolCallEvent(0, CALL)], reason=("tool_use", None))
    content = check_envelope(events, ("tool_use", None), 9)
    assert kinds(content) == [
        "content_block_start:tool_use",
        "content_block_delta:input_json_delta",
        "content_block_stop:",
    ]
    assert assemble(content)[0]["input"] == {"path": "a"}


def test_stream_trailing_whitespace_is_not_sent() -> None:
    events = stream([ContentDelta("Done."), ContentDelta(" \n"), ContentDelta("\n")])
    content = check_envelope(events, ("end_turn", None), 9)
    assert assemble(content) == [{"type": "text", "text": "Done."}]
    for event in content:
        if event["type"] == "content_block_delta":
            assert event["delta"]["text"].strip() == event["delta"]["text"]


def test_stream_whitespace_between_words_is_kept() -> None:
    pieces = ["  The", " quick ", "", "\n", "brown", "  ", "fox", " \n "]
    events = stream(*[[ContentDelta(p)] for p in pieces])
    content = check_envelope(events, ("end_turn", None), 9)
    texts = [e["delta"]["text"] for e in content if e["type"] == "content_block_delta"]
    assert "".join(texts) == "".join(pieces).strip() == "The quick \nbrown  fox"
    assert all(texts)  # no empty deltas
    assert assemble(content) == content_blocks(reply("".join(pieces)))


def test_stream_thinking_whitespace_and_signature() -> None:
    pieces = ["\n", "Step one.", "\n\n", "Step two.", "\n"]
    events = stream([*(ReasoningDelta(p) for p in pieces), ContentDelta("Answer")])
    content = check_envelope(events, ("end_turn", None), 9)
    streamed = assemble(content)
    expected = content_blocks(reply("Answer", "".join(pieces)))
    assert streamed == expected
    assert streamed[0]["thinking"] == "Step one.\n\nStep two."
    # The signature delta is the last event before the thinking block's stop.
    stop_at = next(i for i, e in enumerate(content) if e["type"] == "content_block_stop")
    assert content[stop_at - 1]["delta"]["type"] == "signature_delta"


@pytest.mark.parametrize("parsed", [[], [ContentDelta("")], [ContentDelta(" \n\n ")]])
def test_stream_empty_reply_has_one_empty_text_block(parsed: list[ParseEvent]) -> None:
    events = stream(parsed)
    content = check_envelope(events, ("end_turn", None), 9)
    assert content == [
        {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
        {"type": "content_block_stop", "index": 0},
    ]
    assert assemble(content) == content_blocks(reply("".join(p.text for p in parsed)))  # type: ignore[union-attr]


def test_stream_two_tool_calls() -> None:
    second = ToolCall("toolu_keep", "ls", "[1]")
    events = stream([ToolCallEvent(0, CALL), ToolCallEvent(1, second)], reason=("tool_use", None))
    content = check_envelope(events, ("tool_use", None), 9)
    blocks = assemble(content)
    assert [b["type"] for b in blocks] == ["tool_use", "tool_use"]
    assert blocks[0]["input"] == {"path": "a"}
    assert blocks[1] == {
        "type": "tool_use",
        "id": "toolu_keep",
        "name": "ls",
        "input": {"input": [1]},
    }


def test_stream_stop_sequence_and_max_tokens() -> None:
    events = stream([ContentDelta("x")], reason=("stop_sequence", "END"), output_tokens=3)
    check_envelope(events, ("stop_sequence", "END"), 3)
    events = stream([ReasoningDelta("cut off mid")], reason=("max_tokens", None), output_tokens=64)
    content = check_envelope(events, ("max_tokens", None), 64)
    blocks = assemble(content)
    assert blocks == [
        {
            "type": "thinking",
            "thinking": "cut off mid",
            "signature": thinking_signature("cut off mid"),
        }
    ]


# -- Claude Code's non-model calls -----------------------------------------------------------

OFFLINE_CALLS = [
    ("POST", "/api/eval/sdk-abc"),
    ("GET", "/api/claude_code/policy_limits"),
    ("GET", "/api/claude_code/settings"),
    ("GET", "/api/claude_cli/bootstrap"),
    ("GET", "/mcp-registry/v0/servers"),
    ("POST", "/api/event_logging/v2/batch"),
    ("GET", "/api/claude_code/organizations/metrics_enabled"),
    ("GET", "/api/claude_code_penguin_mode"),
]


@pytest.mark.parametrize("method, path", OFFLINE_CALLS)
def test_local_answer_on_anthropic(method: str, path: str) -> None:
    answer = local_answer("api.anthropic.com", method, path)
    assert answer is not None
    assert isinstance(answer, dict)
    json.dumps(answer)


def test_local_answer_bodies() -> None:
    host = "api.anthropic.com"
    assert local_answer(host, "POST", "/api/eval/sdk-abc") == {"features": {}}
    assert local_answer(host, "GET", "/mcp-registry/v0/servers")["servers"] == []  # type: ignore[index]
    metrics = local_answer(host, "GET", "/api/claude_code/organizations/metrics_enabled")
    assert metrics == {"metrics_logging_enabled": False}


@pytest.mark.parametrize("method, path", OFFLINE_CALLS)
@pytest.mark.parametrize("host", ["api.openai.com", "example.com", "127.0.0.1", ""])
def test_local_answer_other_hosts(host: str, method: str, path: str) -> None:
    assert local_answer(host, method, path) is None


@pytest.mark.parametrize(
    "method, path",
    [
        ("POST", "/v1/messages"),
        ("POST", "/v1/messages/count_tokens"),
        ("GET", "/v1/models"),
        ("GET", "/api/oauth/profile"),
        ("GET", "/"),
        # Known paths with the wrong method.
        ("GET", "/api/eval/sdk-abc"),
        ("POST", "/api/claude_code/settings"),
        ("GET", "/api/event_logging/v2/batch"),
        ("DELETE", "/mcp-registry/v0/servers"),
    ],
)
def test_local_answer_unknown_calls(method: str, path: str) -> None:
    assert local_answer("api.anthropic.com", method, path) is None


# -- model map option ------------------------------------------------------------------------


def test_parse_model_map() -> None:
    spec = " claude-haiku-* = http://a:8000 | http://b:8000 ,gpt-*=http://c:8000,,"
    assert parse_model_map(spec) == [
        ("claude-haiku-*", ["http://a:8000", "http://b:8000"]),
        ("gpt-*", ["http://c:8000"]),
    ]
    assert parse_model_map("m=http://x/?a=b") == [("m", ["http://x/?a=b"])]


@pytest.mark.parametrize("spec", ["", "  ", ",", " , "])
def test_parse_model_map_empty(spec: str) -> None:
    assert parse_model_map(spec) == []


@pytest.mark.parametrize(
    "spec, bad",
    [
        ("claude-*", "claude-*"),
        ("claude-*=", "claude-*="),
        ("=http://a:8000", "=http://a:8000"),
        ("claude-*=|", "claude-*=|"),
        ("ok=http://a,broken", "broken"),
    ],
)
def test_parse_model_map_malformed(spec: str, bad: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_model_map(spec)
    message = str(info.value)
    assert repr(bad) in message
    assert "PATTERN=URL" in message


@settings(max_examples=200, deadline=None)
@given(
    pieces=st.lists(st.tuples(st.booleans(), st.text(max_size=12)), max_size=12),
    calls=st.lists(st.integers(0, 11), max_size=2),
)
def test_streamed_deltas_are_the_events_rendered_whole(
    pieces: list[tuple[bool, str]], calls: list[int]
) -> None:
    """The stream's text and thinking deltas go out through a TextEvent per block: byte for byte
    the events rendered one by one (``sse``), across blocks, tool calls and any text."""
    from rewriter.canonical import ChatRequest
    from rewriter.providers.anthropic import response as anthropic_response
    from rewriter.providers.anthropic.serving import _EventStream
    from rewriter.providers.base import ProviderTurn

    turn = ProviderTurn(ChatRequest(messages=[], model="claude"), "msg_1", "s")
    fast, plain = _EventStream(turn, 10), anthropic_response.EventWriter("msg_1", "claude", 10)
    parsed: list[ParseEvent] = [
        ContentDelta(text) if is_text else ReasoningDelta(text) for is_text, text in pieces
    ]
    for i in sorted(calls, reverse=True):
        parsed.insert(min(i, len(parsed)), ToolCallEvent(0, ToolCall("c", "bash", "{}")))
    try:
        expected = b"".join(anthropic_response.sse(e) for e in plain.events(parsed))
    except UnicodeEncodeError:  # a lone surrogate: no event carries it
        with pytest.raises(UnicodeEncodeError):
            fast.events(parsed)
        return
    assert fast.events(parsed) == expected
    if b'"type":"text_delta"' in expected or b'"type":"thinking_delta"' in expected:
        assert fast._deltas  # the deltas did take the TextEvent path
