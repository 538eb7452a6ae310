"""ChatTemplate on the real Qwen3 and Qwen2.5 tokenizers: text, ids, special tokens, tails."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rewriter.canonical import Message, ToolCall, ToolSpec
from rewriter.template import ChatTemplate, message_to_template_dict

ARGS = '{"city": "Paris", "days": 2, "note": "café \\"quoted\\"", "opts": {"units": ["C", null]}}'

TOOLS = [
    ToolSpec(
        "get_weather",
        "Get the weather for a city",
        {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    ),
    ToolSpec("noop"),
]

CONVERSATION = [
    Message("system", "You are a careful agent."),
    Message("user", "What is the weather in Paris?"),
    Message(
        "assistant",
        "Let me check.",
        tool_calls=(ToolCall("call_1", "get_weather", ARGS), ToolCall("call_2", "noop", "{}")),
    ),
    Message("tool", '{"temp_c": 21}', tool_call_id="call_1"),
    Message("tool", "done", tool_call_id="call_2"),
]


@pytest.fixture(scope="module")
def qwen3(qwen3_dir: Path) -> ChatTemplate:
    return ChatTemplate(qwen3_dir)


@pytest.fixture(scope="module")
def qwen25(qwen25_dir: Path) -> ChatTemplate:
    return ChatTemplate(qwen25_dir)


@pytest.fixture(params=["qwen3", "qwen25"])
def template(request: pytest.FixtureRequest) -> ChatTemplate:
    return request.getfixturevalue(request.param)


def token_id(template: ChatTemplate, token: str) -> int:
    tid = template.tokenizer.convert_tokens_to_ids(token)
    assert isinstance(tid, int) and tid != template.tokenizer.unk_token_id, token
    return tid


# -- text <-> ids --------------------------------------------------------------------------


def test_render_ids_decode_to_render_text(template: ChatTemplate) -> None:
    text = template.render_text(CONVERSATION, TOOLS)
    ids = template.render(CONVERSATION, TOOLS)
    assert ids == template.encode(text)
    assert template.decode(ids) == text
    # Every message made it into the prompt, in order, and it ends with a generation prompt.
    positions = [
        text.index("You are a careful agent."),
        text.index("What is the weather in Paris?"),
        text.index("Let me check."),
        text.index('{"temp_c": 21}'),
        text.index("done"),
    ]
    assert positions == sorted(positions)
    assert text.endswith("<|im_start|>assistant\n")
    assert '"name": "get_weather"' in text and '"name": "noop"' in text
    assert "Get the weather for a city" in text


def test_render_without_generation_prompt_is_a_prefix(template: ChatTemplate) -> None:
    with_prompt = template.render(CONVERSATION, TOOLS)
    without = template.render(CONVERSATION, TOOLS, add_generation_prompt=False)
    assert len(without) < len(with_prompt)
    assert with_prompt[: len(without)] == without
    assert template.decode(with_prompt[len(without) :]) == "<|im_start|>assistant\n"


def test_encode_adds_no_bos_or_eos(template: ChatTemplate) -> None:
    assert template.decode(template.encode("hello")) == "hello"
    assert template.encode("") == []


@pytest.mark.parametrize("token", ["<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"])
def test_structural_tokens_are_single_special_ids(template: ChatTemplate, token: str) -> None:
    tid = token_id(template, token)
    assert template.encode(token) == [tid]
    text = template.render_text(CONVERSATION, TOOLS)
    ids = template.render(CONVERSATION, TOOLS)
    assert text.count(token) > 0
    assert ids.count(tid) == text.count(token)


def test_tool_response_is_a_special_id_for_qwen3(qwen3: ChatTemplate) -> None:
    text = qwen3.render_text(CONVERSATION, TOOLS)
    ids = qwen3.render(CONVERSATION, TOOLS)
    for token in ("<tool_response>", "</tool_response>"):
        tid = token_id(qwen3, token)
        assert qwen3.encode(token) == [tid]
        assert text.count(token) == 2  # one per tool message
        assert ids.count(tid) == 2


def test_tool_response_is_plain_text_for_qwen25(qwen25: ChatTemplate) -> None:
    # Qwen2.5's vocabulary has no <tool_response> token: the template's text is still exact.
    text = qwen25.render_text(CONVERSATION, TOOLS)
    assert text.count("<tool_response>") == 2
    assert len(qwen25.encode("<tool_response>")) > 1
    assert qwen25.decode(qwen25.render(CONVERSATION, TOOLS)) == text


def test_im_start_count_matches_messages(template: ChatTemplate) -> None:
    ids = template.render(CONVERSATION, TOOLS)
    start = token_id(template, "<|im_start|>")
    # system, user, assistant, the two tool results (one turn each or merged), generation prompt
    text = template.render_text(CONVERSATION, TOOLS)
    assert ids.count(start) == text.count("<|im_start|>") >= 4
    assert ids[0] == start


# -- tool-call arguments ---------------------------------------------------------------------


def test_tool_call_arguments_rendered_as_json_object(template: ChatTemplate) -> None:
    text = template.render_text(CONVERSATION, TOOLS)
    rendered = '{"name": "get_weather", "arguments": ' + json.dumps(
        json.loads(ARGS), ensure_ascii=False
    )
    assert rendered in text
    assert '"arguments": "{' not in text  # not a JSON string holding JSON
    assert "café" in text  # not \u-escaped
    assert '{"name": "noop", "arguments": {}}' in text


def test_tool_call_bodies_parse_as_json(template: ChatTemplate) -> None:
    text = template.render_text(CONVERSATION, TOOLS, add_generation_prompt=False)
    assistant = text[text.index("Let me check.") :]
    bodies = [
        chunk.split("</tool_call>")[0].strip() for chunk in assistant.split("<tool_call>")[1:]
    ]
    assert [json.loads(b) for b in bodies] == [
        {"name": "get_weather", "arguments": json.loads(ARGS)},
        {"name": "noop", "arguments": {}},
    ]


def test_message_to_template_dict_uses_argument_objects() -> None:
    message = Message(
        "assistant",
        "",
        reasoning="why",
        tool_calls=(ToolCall("c1", "f", '{"a": [1, 2]}'), ToolCall("c2", "g", "not json")),
    )
    out = message_to_template_dict(message)
    assert out["reasoning_content"] == "why"
    assert out["tool_calls"][0] == {
        "id": "c1",
        "type": "function",
        "function": {"name": "f", "arguments": {"a": [1, 2]}},
    }
    # Arguments that are not JSON are passed on as the text they are.
    assert out["tool_calls"][1]["function"]["arguments"] == "not json"
    tool = message_to_template_dict(Message("tool", "r", tool_call_id="c1", name="f"))
    assert tool == {"role": "tool", "content": "r", "tool_call_id": "c1", "name": "f"}


# -- thinking --------------------------------------------------------------------------------


def test_qwen3_enable_thinking_false_appends_empty_think(qwen3: ChatTemplate) -> None:
    messages = [Message("user", "hi")]
    default = qwen3.render_text(messages)
    off = qwen3.render_text(messages, enable_thinking=False)
    on = qwen3.render_text(messages, enable_thinking=True)
    assert default == on
    assert default.endswith("<|im_start|>assistant\n")
    assert off == default + "<think>\n\n</think>\n\n"
    ids_off = qwen3.render(messages, enable_thinking=False)
    ids_default = qwen3.render(messages)
    assert ids_off[: len(ids_default)] == ids_default
    extra = ids_off[len(ids_default) :]
    assert qwen3.decode(extra) == "<think>\n\n</think>\n\n"
    assert extra[0] == token_id(qwen3, "<think>")
    assert token_id(qwen3, "</think>") in extra


def test_qwen25_ignores_enable_thinking(qwen25: ChatTemplate) -> None:
    messages = [Message("user", "hi")]
    assert qwen25.render_text(messages, enable_thinking=False) == qwen25.render_text(messages)
    assert "<think>" not in qwen25.render_text(messages, enable_thinking=False)


# -- the assistant tail --------------------------------------------------------------------


def test_assistant_tail(template: ChatTemplate) -> None:
    tail = template.assistant_tail
    assert tail.text == "<|im_end|>\n"
    assert tail.ids == tuple(template.encode("<|im_end|>\n"))
    assert len(tail.ids) == 2
    assert tail.ids[0] == token_id(template, "<|im_end|>") == template.eos_token_id
    assert template.decode(list(tail.ids[1:])) == "\n"


@pytest.mark.parametrize("name", ["qwen3", "qwen25"])
def test_prompt_plus_completion_plus_tail_is_next_prompt(
    name: str, request: pytest.FixtureRequest
) -> None:
    """The token trajectory extends: prompt ids + completion ids + tail ids == re-rendered turn."""
    template: ChatTemplate = request.getfixturevalue(name)
    thinking = False if name == "qwen3" else None
    messages = [Message("system", "Be brief."), Message("user", "hi")]
    completion = "Hello! How can I help?"
    prompt = template.render(messages, enable_thinking=thinking)
    turn = template.render(
        [*messages, Message("assistant", completion)],
        add_generation_prompt=False,
        enable_thinking=thinking,
    )
    assert turn == prompt + template.encode(completion) + list(template.assistant_tail.ids)


# -- loading ---------------------------------------------------------------------------------


def test_missing_tokenizer_raises_helpful_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError) as info:
        ChatTemplate(tmp_path)
    message = str(info.value)
    assert str(tmp_path) in message
    assert "tokenizer.json" in message and "chat_template" in message


def test_nonexistent_folder_raises_file_not_found(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match="no tokenizer in"):
        ChatTemplate(missing)


def test_tokenizer_without_chat_template_raises(tmp_path: Path, qwen25_dir: Path) -> None:
    (tmp_path / "tokenizer.json").symlink_to(qwen25_dir / "tokenizer.json")
    config = json.loads((qwen25_dir / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="no chat_template"):
        ChatTemplate(tmp_path)


def test_a_template_refusing_a_conversation_is_the_clients_error(qwen3_dir: Path) -> None:
    """A chat template's raise_exception (a conversation shape it rejects) is the client's
    RequestError, not a crash of ours."""
    from rewriter.canonical import RequestError

    template = ChatTemplate(qwen3_dir)
    template.tokenizer.chat_template = "{{ raise_exception('No user query found in messages.') }}"
    with pytest.raises(RequestError, match="No user query found"):
        template.render_text([Message(role="user", content="hi")])
