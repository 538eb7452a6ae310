"""rewriter/vllm_answers.py: the prompt ids vLLM echoes are dropped before parsing, and nothing
else of an answer changes."""

from __future__ import annotations

import json

import pytest

from rewriter.vllm_answers import answer_json, without_prompt_echo

PROMPT = list(range(100_000, 103_000))  # 3,000 ids: an answer well past the size worth cutting


def _answer(text: str, prompt: object = PROMPT) -> dict[str, object]:
    choice = {"index": 0, "text": text, "token_ids": [11, 12], "prompt_token_ids": prompt,
              "logprobs": {"token_logprobs": [-0.5, -1.25]}, "finish_reason": "stop"}  # fmt: skip
    return {"id": "cmpl-1", "object": "text_completion", "choices": [choice]}


@pytest.mark.parametrize("separators", [(",", ":"), (", ", ": ")])
def test_the_echo_is_null_and_the_rest_is_as_sent(separators: tuple[str, str]) -> None:
    # The completion's own text names the key, quoted: a string's quotes are escaped, so only
    # the real key is cut.
    sent = _answer('{"prompt_token_ids": [1, 2]} said the model')
    got = answer_json(json.dumps(sent, separators=separators).encode(), "an answer")
    expected = json.loads(json.dumps(sent))
    expected["choices"][0]["prompt_token_ids"] = None
    assert got == expected


def test_what_is_not_a_list_of_ints_is_parsed_whole() -> None:
    for prompt in ([[1, 2], *PROMPT], [*PROMPT, "x"], None, [0.5, *PROMPT]):
        raw = json.dumps(_answer("hi", prompt)).encode()
        assert without_prompt_echo(raw) == raw
        assert answer_json(raw, "an answer")["choices"][0]["prompt_token_ids"] == prompt


def test_a_short_answer_is_left_alone() -> None:
    raw = json.dumps(_answer("hi", [1, 2, 3])).encode()
    assert without_prompt_echo(raw) is raw
    assert answer_json(raw, "an answer")["choices"][0]["prompt_token_ids"] == [1, 2, 3]
