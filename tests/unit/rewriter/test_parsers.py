"""Output parsers: hermes tool calls and qwen3 reasoning, whole-text and incremental."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from rewriter.canonical import AssistantReply, Message, ToolCall
from rewriter.parsers import (
    REASONING_PARSERS,
    TOOL_PARSERS,
    ContentDelta,
    OutputParser,
    ParseEvent,
    ReasoningDelta,
    ToolCallEvent,
    check_parser_names,
    parse_completion,
)
from rewriter.template import ChatTemplate

CALL_A = '<tool_call>\n{"name": "read_file", "arguments": {"path": "/tmp/a.txt"}}\n</tool_call>'
CALL_B = '<tool_call>\n{"name": "ls", "arguments": {"dir": ".", "all": true}}\n</tool_call>'


def summary(reply: AssistantReply) -> tuple[str, str | None, list[tuple[str, Any]]]:
    """A reply without its random tool-call ids."""
    return (
        reply.content,
        reply.reasoning,
        [(c.name, json.loads(c.arguments)) for c in reply.tool_calls],
    )


def run_chunks(
    chunks: list[str], tool_parser: str = "hermes", reasoning_parser: str = "qwen3"
) -> tuple[OutputParser, list[ParseEvent]]:
    parser = OutputParser(tool_parser, reasoning_parser)
    events: list[ParseEvent] = []
    for chunk in chunks:
        events.extend(parser.feed(chunk))
    events.extend(parser.finish())
    return parser, events


def joined(events: list[ParseEvent], kind: type[ContentDelta] | type[ReasoningDelta]) -> str:
    return "".join(e.text for e in events if isinstance(e, kind))


def calls(events: list[ParseEvent]) -> list[ToolCallEvent]:
    return [e for e in events if isinstance(e, ToolCallEvent)]


# -- hermes, whole text ----------------------------------------------------------------------


def test_single_tool_call() -> None:
    reply = parse_completion(CALL_A)
    assert reply.content == ""
    assert reply.reasoning is None
    assert len(reply.tool_calls) == 1
    call = reply.tool_calls[0]
    assert call.name == "read_file"
    assert call.arguments == '{"path": "/tmp/a.txt"}'
    assert call.id.startswith("call_") and len(call.id) > len("call_")


def test_multiple_tool_calls_with_content() -> None:
    text = "I will look around.\n" + CALL_A + "\n" + CALL_B
    reply = parse_completion(text)
    assert reply.content == "I will look around."
    assert [(c.name, json.loads(c.arguments)) for c in reply.tool_calls] == [
        ("read_file", {"path": "/tmp/a.txt"}),
        ("ls", {"dir": ".", "all": True}),
    ]
    assert len({c.id for c in reply.tool_calls}) == 2
    _, events = run_chunks([text])
    assert [e.index for e in calls(events)] == [0, 1]


def test_arguments_as_string_and_parameters_key() -> None:
    text = (
        '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>'
        '<tool_call>{"name": "g", "parameters": {"y": "é"}}</tool_call>'
        '<tool_call>{"name": "h"}</tool_call>'
    )
    reply = parse_completion(text)
    assert [(c.name, c.arguments) for c in reply.tool_calls] == [
        ("f", '{"x": 1}'),
        ("g", '{"y": "é"}'),
        ("h", "{}"),
    ]


def test_invalid_json_is_returned_as_content() -> None:
    bad = '<tool_call>\n{"name": "read_file", "arguments": {"path": \n</tool_call>'
    reply = parse_completion("Before " + bad + " after")
    assert reply.tool_calls == []
    assert reply.content == "Before " + bad + " after"


@pytest.mark.parametrize(
    "body", ['{"arguments": {}}', '["read_file"]', '{"name": 3}', "", "not json at all"]
)
def test_tool_call_body_without_a_name_is_content(body: str) -> None:
    text = f"<tool_call>{body}</tool_call>"
    reply = parse_completion(text)
    assert reply.tool_calls == []
    assert reply.content == text


def test_invalid_call_does_not_drop_valid_neighbours() -> None:
    bad = "<tool_call>{oops}</tool_call>"
    reply = parse_completion(CALL_A + bad + CALL_B)
    assert [c.name for c in reply.tool_calls] == ["read_file", "ls"]
    assert reply.content == bad
    _, events = run_chunks([CALL_A + bad + CALL_B])
    # The invalid one does not use up an index.
    assert [e.index for e in calls(events)] == [0, 1]


def test_unclosed_tool_call_at_end_is_content() -> None:
    text = 'Sure.\n<tool_call>\n{"name": "read_file", "arguments": {"path": "/tm'
    reply = parse_completion(text)
    assert reply.tool_calls == []
    assert reply.content == text
    parser, events = run_chunks(list(text))
    assert joined(events, ContentDelta) == text
    assert parser.reply().content == text


def test_unclosed_tool_call_after_a_complete_one() -> None:
    tail = '<tool_call>\n{"name": "ls"'
    reply = parse_completion(CALL_A + "\n" + tail)
    assert [c.name for c in reply.tool_calls] == ["read_file"]
    assert reply.content == tail


def test_partial_open_tag_at_chunk_boundary_is_held_back() -> None:
    parser = OutputParser("hermes", "none")
    first = parser.feed("Hello <tool_")
    assert first == [ContentDelta("Hello ")]
    second = parser.feed('call>\n{"name": "ls", "arguments": {}}\n</tool')
    assert second == []  # inside a call: nothing certain yet
    third = parser.feed("_call>")
    assert len(third) == 1 and isinstance(third[0], ToolCallEvent)
    assert third[0].call.name == "ls"
    assert parser.finish() == []
    assert "".join(parser.content) == "Hello "


def test_partial_open_tag_that_is_not_a_tag_is_released() -> None:
    parser = OutputParser("hermes", "none")
    assert parser.feed("a <tool") == [ContentDelta("a ")]
    assert parser.feed("box> b") == [ContentDelta("<toolbox> b")]
    assert parser.feed("<") == []
    assert parser.finish() == [ContentDelta("<")]
    assert parser.reply().content == "a <toolbox> b<"


def test_plain_text_is_streamed_immediately() -> None:
    parser = OutputParser("hermes", "qwen3")
    assert parser.feed("Hi") == [ContentDelta("Hi")]
    assert parser.feed(" there") == [ContentDelta(" there")]


def test_none_tool_parser_keeps_tool_call_text() -> None:
    reply = parse_completion(CALL_A, tool_parser="none")
    assert reply.tool_calls == []
    assert reply.content == CALL_A


# -- qwen3 reasoning -------------------------------------------------------------------------


def test_think_block_is_split_off() -> None:
    reply = parse_completion("<think>\nFirst, plan.\nThen act.\n</think>\n\nThe answer is 4.")
    assert reply.reasoning == "First, plan.\nThen act."
    assert reply.content == "The answer is 4."
    assert reply.tool_calls == []


def test_no_think_block_means_no_reasoning() -> None:
    reply = parse_completion("Just an answer.")
    assert reply.reasoning is None
    assert reply.content == "Just an answer."


def test_empty_think_block() -> None:
    reply = parse_completion("<think>\n\n</think>\n\nok")
    assert reply.reasoning == ""
    assert reply.content == "ok"


def test_reasoning_then_tool_call() -> None:
    text = "<think>\nI need the file.\n</think>\n\n" + CALL_A
    reply = parse_completion(text)
    assert reply.reasoning == "I need the file."
    assert reply.content == ""
    assert [c.name for c in reply.tool_calls] == ["read_file"]


def test_tool_call_inside_reasoning_is_not_a_call() -> None:
    text = "<think>maybe " + CALL_A + "</think>\n\nNo."
    reply = parse_completion(text)
    assert reply.tool_calls == []
    assert reply.reasoning == "maybe " + CALL_A
    assert reply.content == "No."


def test_unclosed_think_is_all_reasoning() -> None:
    reply = parse_completion("<think>\nstill thinking about it")
    assert reply.reasoning == "still thinking about it"
    assert reply.content == ""


def test_partial_think_tags_at_chunk_boundaries() -> None:
    parser = OutputParser("hermes", "qwen3")
    assert parser.feed("<th") == []
    assert parser.feed("ink>plan") == [ReasoningDelta("plan")]
    assert parser.feed(" more</th") == [ReasoningDelta(" more")]
    assert parser.feed("ink>\n") == []
    assert parser.feed("\nanswer") == [ContentDelta("answer")]
    assert parser.finish() == []
    reply = parser.reply()
    assert (reply.reasoning, reply.content) == ("plan more", "answer")


def test_text_starting_like_think_but_not() -> None:
    reply = parse_completion("<thought>hm</thought>")
    assert reply.reasoning is None
    assert reply.content == "<thought>hm</thought>"


def test_deepseek_r1_starts_in_reasoning() -> None:
    reply = parse_completion("plan\n</think>\n\nanswer", reasoning_parser="deepseek_r1")
    assert (reply.reasoning, reply.content) == ("plan", "answer")


def test_none_reasoning_parser_keeps_think_text() -> None:
    text = "<think>x</think>y"
    reply = parse_completion(text, reasoning_parser="none")
    assert reply.reasoning is None
    assert reply.content == text


# -- names -----------------------------------------------------------------------------------


def test_check_parser_names_accepts_known() -> None:
    for tool in TOOL_PARSERS:
        for reasoning in REASONING_PARSERS:
            check_parser_names(tool, reasoning)
    assert {"hermes", "none"} <= set(TOOL_PARSERS)
    assert {"qwen3", "deepseek_r1", "none"} <= set(REASONING_PARSERS)


def test_check_parser_names_unknown_tool_parser() -> None:
    with pytest.raises(ValueError) as info:
        check_parser_names("mistral_x", "qwen3")
    message = str(info.value)
    assert "'mistral_x'" in message and "tool-call parser" in message
    assert "hermes" in message and "none" in message


def test_check_parser_names_unknown_reasoning_parser() -> None:
    with pytest.raises(ValueError) as info:
        check_parser_names("hermes", "granite_x")
    message = str(info.value)
    assert "'granite_x'" in message and "reasoning parser" in message
    assert "qwen3" in message and "deepseek_r1" in message


def test_output_parser_rejects_unknown_names() -> None:
    with pytest.raises(ValueError, match="hermes"):
        OutputParser("nope", "qwen3")
    with pytest.raises(ValueError, match="qwen3"):
        OutputParser("hermes", "nope")


# -- incremental == whole text ---------------------------------------------------------------

FRAGMENTS = [
    "<think>",
    "</think>",
    "\n",
    "\n\n",
    " ",
    "<",
    "</",
    "<tool_",
    "<tool_call>",
    "</tool_call>",
    "</tool_",
    '{"name": "ls", "arguments": {"dir": "."}}',
    '{"name": "read_file", "arguments": {"path": "é/ü.txt", "n": [1, 2]}}',
    '{"name": "bad", "arguments": ',
    "{not json}",
    CALL_A,
    CALL_B,
    "Hello",
    "think",
    "tool_call>",
    "<th",
    "ink>",
]

texts = st.lists(st.one_of(st.sampled_from(FRAGMENTS), st.text(max_size=8)), max_size=14).map(
    "".join
)

EXAMPLES = [
    "<think>\nplan\n</think>\n\nSure.\n" + CALL_A + "\n" + CALL_B,
    "  <think>a</think>b<tool_call>{x}</tool_call>c<tool_call>",
    "Hello <tool_call" + "</think>" + "<think>",
    "<think>unclosed " + CALL_A,
]


def split_at(text: str, cuts: list[int]) -> list[str]:
    points = sorted({c % (len(text) + 1) for c in cuts})
    bounds = [0, *points, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


@pytest.mark.parametrize("text", EXAMPLES)
@pytest.mark.parametrize("reasoning_parser", ["qwen3", "deepseek_r1", "none"])
def test_char_by_char_matches_whole_text(text: str, reasoning_parser: str) -> None:
    whole_parser, whole_events = run_chunks([text], reasoning_parser=reasoning_parser)
    char_parser, char_events = run_chunks(list(text), reasoning_parser=reasoning_parser)
    assert summary(char_parser.reply()) == summary(whole_parser.reply())
    assert summary(whole_parser.reply()) == summary(
        parse_completion(text, reasoning_parser=reasoning_parser)
    )
    assert joined(char_events, ContentDelta) == joined(whole_events, ContentDelta)
    assert joined(char_events, ReasoningDelta) == joined(whole_events, ReasoningDelta)
    assert all(e.text for e in char_events if isinstance(e, ContentDelta | ReasoningDelta))


@settings(max_examples=300, deadline=None)
@given(
    text=texts,
    cuts=st.lists(st.integers(min_value=0, max_value=10_000), max_size=12),
    tool_parser=st.sampled_from(["hermes", "none"]),
    reasoning_parser=st.sampled_from(["qwen3", "deepseek_r1", "none"]),
)
@example(text=EXAMPLES[0], cuts=[1, 5, 30, 31, 32], tool_parser="hermes", reasoning_parser="qwen3")
def test_random_chunking_matches_whole_text(
    text: str, cuts: list[int], tool_parser: str, reasoning_parser: str
) -> None:
    chunks = split_at(text, cuts)
    assert "".join(chunks) == text
    whole_parser, whole_events = run_chunks([text], tool_parser, reasoning_parser)
    split_parser, split_events = run_chunks(chunks, tool_parser, reasoning_parser)
    char_parser, char_events = run_chunks(list(text), tool_parser, reasoning_parser)
    for parser, events in ((split_parser, split_events), (char_parser, char_events)):
        reply = parser.reply()
        assert summary(reply) == summary(whole_parser.reply())
        assert joined(events, ContentDelta) == joined(whole_events, ContentDelta)
        assert joined(events, ReasoningDelta) == joined(whole_events, ReasoningDelta)
        assert [e.index for e in calls(events)] == list(range(len(calls(events))))
        assert [e.call.name for e in calls(events)] == [c.name for c in reply.tool_calls]


@settings(max_examples=300, deadline=None)
@given(text=texts, cuts=st.lists(st.integers(min_value=0, max_value=10_000), max_size=12))
def test_nothing_is_dropped(text: str, cuts: list[int]) -> None:
    """Without a valid tool call, content and reasoning together hold every character."""
    parser, events = run_chunks(split_at(text, cuts), "hermes", "none")
    if not calls(events):
        assert joined(events, ContentDelta) == text
    parser, events = run_chunks(split_at(text, cuts), "none", "none")
    assert joined(events, ContentDelta) == text
    assert parser.reply().content == text
    parser, events = run_chunks(split_at(text, cuts), "hermes", "qwen3")
    if not calls(events) and "<think>" not in text and "</think>" not in text:
        assert joined(events, ContentDelta) == text


def test_seeded_random_chunkings_of_a_long_completion() -> None:
    text = (
        "<think>\nThe user wants two files. <tool_ is not a tag here.\n</think>\n\n"
        "Reading both.\n" + CALL_A + "\n" + CALL_B + "\n<tool_call>{broken</tool_call> tail"
    )
    expected = summary(parse_completion(text))
    assert expected == (
        "Reading both.\n\n\n<tool_call>{broken</tool_call> tail",
        "The user wants two files. <tool_ is not a tag here.",
        [("read_file", {"path": "/tmp/a.txt"}), ("ls", {"dir": ".", "all": True})],
    )
    rng = random.Random(1234)
    for _ in range(200):
        cuts = [rng.randrange(len(text) + 1) for _ in range(rng.randrange(1, 20))]
        parser, _ = run_chunks(split_at(text, cuts))
        assert summary(parser.reply()) == expected


# -- round trip through the Qwen3 template ---------------------------------------------------


@pytest.fixture(scope="module")
def qwen3(qwen3_dir: Path) -> ChatTemplate:
    return ChatTemplate(qwen3_dir)


def assistant_body(template: ChatTemplate, message: Message) -> str:
    text = template.render_text(
        [Message("user", "go"), message], add_generation_prompt=False, enable_thinking=False
    )
    marker = "<|im_start|>assistant\n"
    start = text.rindex(marker) + len(marker)
    end = text.index("<|im_end|>", start)
    return text[start:end]


def test_template_tool_call_turn_parses_back(qwen3: ChatTemplate) -> None:
    args_a = '{"path": "/tmp/é x.txt", "opts": {"n": [1, 2.5, null, true]}, "q": "a\\"b\\n"}'
    message = Message(
        "assistant",
        "Let me look.",
        tool_calls=(ToolCall("c1", "read", args_a), ToolCall("c2", "ls", "{}")),
    )
    body = assistant_body(qwen3, message)
    assert "<tool_call>" in body
    whole = parse_completion(body)
    assert whole.content == "Let me look."
    assert [(c.name, c.arguments) for c in whole.tool_calls] == [("read", args_a), ("ls", "{}")]
    streamed, _ = run_chunks(list(body))
    assert summary(streamed.reply()) == summary(whole)


def test_template_reasoning_turn_parses_back(qwen3: ChatTemplate) -> None:
    message = Message(
        "assistant",
        "Done.",
        reasoning="Think step by step.",
        tool_calls=(ToolCall("c1", "ls", '{"dir": "."}'),),
    )
    body = assistant_body(qwen3, message)
    reply = parse_completion(body)
    assert reply.reasoning == "Think step by step."
    assert reply.content == "Done."
    assert [(c.name, c.arguments) for c in reply.tool_calls] == [("ls", '{"dir": "."}')]


safe_text = st.text(st.characters(exclude_categories=["Cs"]), max_size=12)
json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**53), max_value=2**53)
    | st.floats(allow_nan=False, allow_infinity=False)
    | safe_text
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(safe_text, inner, max_size=3),
    max_leaves=8,
)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    name=st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,20}", fullmatch=True),
    arguments=st.dictionaries(safe_text, json_values, max_size=4),
    content=st.sampled_from(["", "On it.", "Two\nlines"]),
)
def test_template_round_trip_property(
    qwen3: ChatTemplate, name: str, arguments: dict[str, Any], content: str
) -> None:
    args_text = json.dumps(arguments, ensure_ascii=False)
    if "</tool_call>" in args_text:
        return
    message = Message("assistant", content, tool_calls=(ToolCall("c1", name, args_text),))
    reply = parse_completion(assistant_body(qwen3, message))
    assert [c.name for c in reply.tool_calls] == [name]
    assert json.loads(reply.tool_calls[0].arguments) == arguments
    assert reply.tool_calls[0].arguments == args_text
    assert reply.content == content


def _held_back_by_definition(buffer: str, tag: str) -> int:
    return max((n for n in range(1, min(len(tag) - 1, len(buffer)) + 1)
                if tag.startswith(buffer[-n:])), default=0)  # fmt: skip


@settings(max_examples=500, deadline=None)
@given(
    buffer=st.text(alphabet="<>/tolcahink_ x", max_size=30),
    tag=st.sampled_from(["<tool_call>", "<think>", "</think>", "<<", "<a<a<b", "ab"]),
)
def test_held_back_is_the_longest_suffix_that_starts_the_tag(buffer: str, tag: str) -> None:
    from rewriter.parsers import _held_back

    assert _held_back(buffer, tag) == _held_back_by_definition(buffer, tag)
