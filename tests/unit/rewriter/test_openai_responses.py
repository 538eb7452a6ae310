"""rewriter/openai_responses.py directly: input items -> canonical, tools, answers and events."""

from __future__ import annotations

import json
from typing import Any

import pytest

from rewriter.canonical import AssistantReply, Message, RequestError, ToolCall
from rewriter.parsers import ContentDelta, ReasoningDelta, ToolCallEvent
from rewriter.providers.openai_responses.ids import new_response_id
from rewriter.providers.openai_responses.request import (
    decrypt_reasoning,
    encrypt_reasoning,
    parse_request,
)
from rewriter.providers.openai_responses.response import EventWriter, whole_response

EXEC_TOOL = {
    "type": "custom",
    "name": "exec",
    "description": "Run JavaScript.",
    "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"},
}


def body(**fields: Any) -> bytes:
    return json.dumps({"model": "gpt-5", **fields}).encode()


def test_string_input_and_instructions() -> None:
    req = parse_request(body(input="Hi", instructions="Be brief."))
    assert req.chat.messages == [Message("system", "Be brief."), Message("user", "Hi")]
    assert req.context.messages == (Message("user", "Hi"),)
    assert req.store is True and req.include_encrypted is False


def test_message_roles_and_parts() -> None:
    req = parse_request(
        body(
            input=[
                {"role": "developer", "content": "Dev rules."},
                {
                    "type": "message",
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": "A"},
                        {"type": "input_text", "text": "B"},
                    ],
                },
                {
                    "type": "message",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": "Reply."}],
                },
                {"role": "system", "content": "Late system."},
            ]
        )
    )
    assert req.chat.messages == [
        Message("system", "Dev rules."),
        Message("user", "AB"),
        Message("assistant", "Reply."),
        Message("system", "Late system."),
    ]


def test_one_model_turn_is_one_assistant_message() -> None:
    token = encrypt_reasoning("I should call it.")
    req = parse_request(
        body(
            input=[
                {"role": "user", "content": "Go"},
                {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": token},
                {
                    "type": "message",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": "Calling."}],
                    "internal_chat_message_metadata_passthrough": {"x": 1},
                },
                {
                    "type": "function_call",
                    "call_id": "call_a",
                    "name": "f",
                    "arguments": '{"x": 1}',
                },
                {"type": "custom_tool_call", "call_id": "call_b", "name": "exec", "input": "ls()"},
                {"type": "function_call_output", "call_id": "call_a", "output": "one"},
                {
                    "type": "custom_tool_call_output",
                    "call_id": "call_b",
                    "output": [{"type": "input_text", "text": "two"}],
                },
            ],
            tools=[EXEC_TOOL],
        )
    )
    assert req.chat.messages[1] == Message(
        "assistant",
        "Calling.",
        reasoning="I should call it.",
        tool_calls=(
            ToolCall("call_a", "f", '{"x": 1}'),
            ToolCall("call_b", "exec", '{"input": "ls()"}'),
        ),
    )
    assert req.chat.messages[2:] == [
        Message("tool", "one", tool_call_id="call_a"),
        Message("tool", "two", tool_call_id="call_b"),
    ]


def test_reasoning_round_trip_and_foreign_tokens() -> None:
    assert decrypt_reasoning(encrypt_reasoning("héllo\n")) == "héllo\n"
    assert decrypt_reasoning("gAAAAABforeign") is None
    # Someone else's token: fall back to the summary text.
    req = parse_request(
        body(
            input=[
                {
                    "type": "reasoning",
                    "summary": [{"type": "summary_text", "text": "S"}],
                    "encrypted_content": "gAAAA",
                }
            ]
        )
    )
    assert req.chat.messages == [Message("assistant", "", reasoning="S")]


def test_custom_and_function_tools_and_additional_tools_item() -> None:
    fn = {"type": "function", "name": "f", "description": "F.", "parameters": {"type": "object"}}
    req = parse_request(
        body(
            input=[
                {"type": "additional_tools", "role": "developer", "tools": [EXEC_TOOL]},
                {"role": "user", "content": "Go"},
            ],
            tools=[fn, {"type": "web_search"}],
        )
    )
    assert [t.name for t in req.chat.tools] == ["f", "exec"]
    assert req.custom_tools == {"exec"}
    exec_params = req.chat.tools[1].parameters
    assert exec_params["required"] == ["input"]
    assert "lark" in exec_params["properties"]["input"]["description"]
    assert req.chat.messages == [Message("user", "Go")]


def test_sampling_and_options() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    req = parse_request(
        body(
            input="x",
            max_output_tokens=64,
            temperature=0.5,
            top_p=0.9,
            reasoning={"effort": "none"},
            text={
                "format": {"type": "json_schema", "name": "a", "schema": schema},
                "verbosity": "low",
            },
            tool_choice={"type": "function", "name": "f"},
            include=["reasoning.encrypted_content"],
            store=False,
            prompt_cache_key="k",
            stream=True,
        )
    )
    s = req.chat.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.json_schema) == (64, 0.5, 0.9, schema)
    assert req.chat.enable_thinking is False
    assert req.chat.tool_choice == {"type": "function", "function": {"name": "f"}}
    assert req.include_encrypted and not req.store and req.chat.stream
    assert req.echo["text"]["verbosity"] == "low" and req.echo["prompt_cache_key"] == "k"


def test_previous_response_id() -> None:
    earlier = (Message("user", "Q"), Message("assistant", "A"))
    first = parse_request(
        body(
            input=[
                {
                    "type": "additional_tools",
                    "tools": [{"type": "namespace", "name": "ns", "tools": [EXEC_TOOL]}],
                },
                {"role": "user", "content": "Q"},
            ],
            tools=[{"type": "function", "name": "top", "parameters": {}}],
        )
    )
    stored = first.context.extended(Message("assistant", "A"))
    req = parse_request(
        body(input="More", previous_response_id="resp_1", instructions="I"),
        lambda rid: stored if rid == "resp_1" else None,
    )
    assert req.chat.messages == [Message("system", "I"), *earlier, Message("user", "More")]
    assert req.context.messages == (*earlier, Message("user", "More"))
    # Tools sent as input items are part of the context; top-level tools are not carried.
    assert [t.name for t in req.chat.tools] == ["ns.exec"]
    assert req.custom_tools == {"ns.exec"} and req.namespaces == {"ns.exec": ("ns", "exec")}
    with pytest.raises(RequestError) as err:
        parse_request(body(input="x", previous_response_id="resp_2"), lambda rid: None)
    assert err.value.param == "previous_response_id"


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"input": [{"type": "nope"}]}, "input[0].type"),
        ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
            "input[0].content[0].type",
        ),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
        ({"input": "x", "tools": [{"type": "function"}]}, "tools[0]"),
        ({"input": []}, "input"),
    ],
)
def test_bad_input(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(RequestError) as err:
        parse_request(body(**fields))
    assert err.value.param == param and err.value.status == 400


def test_missing_model() -> None:
    with pytest.raises(RequestError) as err:
        parse_request(b'{"input": "x"}')
    assert err.value.param == "model"


def test_whole_response_items() -> None:
    req = parse_request(body(input="x", tools=[EXEC_TOOL], include=["reasoning.encrypted_content"]))
    reply = AssistantReply("Running.", "Think.", [ToolCall("call_1", "exec", '{"input": "ls()"}')])
    resp = whole_response("resp_1", req, reply, "stop", 10, 5)
    assert resp["status"] == "completed" and resp["usage"]["total_tokens"] == 15
    reasoning, message, call = resp["output"]
    assert decrypt_reasoning(reasoning["encrypted_content"]) == "Think."
    assert message["content"][0]["text"] == "Running."
    assert call == {
        "type": "custom_tool_call",
        "id": call["id"],
        "call_id": "call_1",
        "name": "exec",
        "input": "ls()",
        "status": "completed",
    }
    cut = whole_response("resp_2", req, AssistantReply("Par", None, []), "length", 10, 5)
    assert cut["status"] == "incomplete"
    assert cut["incomplete_details"] == {"reason": "max_output_tokens"}


def test_items_sent_back_name_the_response_they_came_from() -> None:
    """Output items carry their response's id, whole or streamed: the assistant message a client
    sends them back as names the policy call it came from (the trajectory's strongest evidence
    for text-only replies). Foreign item ids name nothing."""
    rid = new_response_id()
    req = parse_request(body(input="x", tools=[EXEC_TOOL], include=["reasoning.encrypted_content"]))
    reply = AssistantReply("Running.", "Think.", [ToolCall("call_1", "exec", '{"input": "ls()"}')])
    writer = EventWriter(rid, req, 1)
    writer.events(
        [ReasoningDelta("Think."), ContentDelta("Running."), ToolCallEvent(0, reply.tool_calls[0])]
    )
    streamed = writer.finish("stop", 3)[-1]["response"]["output"]
    for output in (whole_response(rid, req, reply, "stop", 1, 1)["output"], streamed):
        assert len(output) == 3 and all(
            item["id"].split("_", 1)[1].startswith(rid[5:]) for item in output
        )
        back = parse_request(body(tools=[EXEC_TOOL], input=[
            {"role": "user", "content": "x"}, *output,
            {"type": "custom_tool_call_output", "call_id": "call_1", "output": "ok"}]))  # fmt: skip
        (asst,) = [m for m in back.chat.messages if m.role == "assistant"]
        assert asst.ids == (rid,) and asst.content == "Running."
    foreign = {"type": "message", "role": "assistant", "id": "msg_" + "ab" * 24, "content": "hi"}
    back = parse_request(body(input=[{"role": "user", "content": "x"}, foreign]))
    assert back.chat.messages[-1].ids == ()


def test_event_writer_sequence() -> None:
    req = parse_request(body(input="x", stream=True))
    writer = EventWriter("resp_1", req, 7)
    events = writer.start()
    events += writer.events([ReasoningDelta("Hm"), ReasoningDelta(".")])
    events += writer.events([ContentDelta("A"), ContentDelta("B")])
    events += writer.events([ToolCallEvent(0, ToolCall("call_1", "f", '{"a": 1}'))])
    events += writer.finish("stop", 9)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    final = events[-1]["response"]
    assert [i["type"] for i in final["output"]] == ["reasoning", "message", "function_call"]
    assert final["output"][1]["content"][0]["text"] == "AB"
    assert final["usage"]["input_tokens"] == 7 and final["usage"]["output_tokens"] == 9
    assert writer.failed("boom")["response"]["status"] == "failed"


def test_event_writer_custom_tool_and_incomplete() -> None:
    req = parse_request(body(input="x", tools=[EXEC_TOOL]))
    writer = EventWriter("resp_1", req, 1)
    events = writer.events([ToolCallEvent(0, ToolCall("call_1", "exec", '{"input": "ls()"}'))])
    kinds = [e["type"] for e in events]
    assert "response.custom_tool_call_input.delta" in kinds
    done = next(e for e in events if e["type"] == "response.custom_tool_call_input.done")
    assert done["input"] == "ls()"
    final = writer.finish("length", 3)[-1]
    assert final["type"] == "response.incomplete"
