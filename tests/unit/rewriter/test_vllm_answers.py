"""rewriter/vllm_answers.py: the prompt ids vLLM echoes are dropped before parsing, and nothing
else of an answer changes."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rewriter.vllm_answers import PolicyError, answer_json, completions_delta, without_prompt_echo

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


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=20,
)


def _python_reader(raw: bytes) -> object:
    try:
        return ("ok", json.dumps(json.loads(without_prompt_echo(raw)), sort_keys=True))
    except (ValueError, RecursionError):
        return ("refused",)


def _answer_json(raw: bytes) -> object:
    try:
        return ("ok", json.dumps(answer_json(raw, "an answer"), sort_keys=True))
    except PolicyError:
        return ("refused",)


@settings(max_examples=300, deadline=None)
@given(value=json_values, ensure_ascii=st.booleans())
def test_answers_read_as_pythons_json_reads_them(value: object, ensure_ascii: bool) -> None:
    """The fast reader gives the very values Python's json gives, NaN, huge integers and all."""
    raw = json.dumps(value, ensure_ascii=ensure_ascii).encode("utf-8", "surrogatepass")
    assert _answer_json(raw) == _python_reader(raw)


@settings(max_examples=300, deadline=None)
@given(raw=st.binary(max_size=64) | st.text(max_size=64).map(lambda t: t.encode("utf-16")))
def test_what_is_not_json_is_refused_alike(raw: bytes) -> None:
    assert _answer_json(raw) == _python_reader(raw)


def test_edge_cases_read_alike() -> None:
    for raw in (b"NaN", b"[1e999]", b"-0", b'"\\ud800"', b"[" * 5000 + b"]" * 5000,
                b"18446744073709551616", b'{"a": 1, "a": 2}', b"\xef\xbb\xbf{}", b" 1 "):  # fmt: skip
        assert _answer_json(raw) == _python_reader(raw), raw


# -- the ids of a completion: token_ids, or logprobs' "token_id:N" tokens -------------------


def _choice(**fields: object) -> dict[str, object]:
    lp = {"text_offset": [0, 9], "token_logprobs": [-0.5, -1.25],
          "tokens": ["token_id:9315", "token_id:0"],
          "top_logprobs": [{"token_id:9315": -0.5}, {"token_id:0": -1.25}]}  # fmt: skip
    choice: dict[str, object] = {"index": 0, "text": " temperature", "logprobs": lp,
                                 "finish_reason": None, "token_ids": None}  # fmt: skip
    choice.update(fields)
    return choice


def test_ids_come_from_the_tokens_where_token_ids_is_null() -> None:
    delta = completions_delta(_choice())
    assert delta.token_ids == [9315, 0]
    assert delta.logprobs == [-0.5, -1.25]
    assert delta.text == " temperature"


def test_token_ids_win_where_the_server_sends_both() -> None:
    # return_token_ids and return_tokens_as_token_ids together: the ids are read where vLLM
    # always wrote them.
    assert completions_delta(_choice(token_ids=[9315, 0])).token_ids == [9315, 0]
    text_tokens = _choice(token_ids=[9315, 0])
    text_tokens["logprobs"]["tokens"] = [" temperature", "!"]  # type: ignore[index]
    assert completions_delta(text_tokens).token_ids == [9315, 0]


@pytest.mark.parametrize(
    "tokens",
    [
        [" temperature", "!"],  # text tokens: the server ignored return_tokens_as_token_ids
        ["token_id:9315", "token_id:-1"],
        ["token_id:9315", "token_id:"],
        ["token_id:9315", "token_id:１２"],  # fullwidth digits: isdigit, not ASCII
        ["token_id:9315", "token_id:99999999999"],
        ["token_id:9315", 7],
        "token_id:9315",
    ],
)
def test_tokens_that_are_not_ids_are_a_policy_error(tokens: object) -> None:
    choice = _choice()
    choice["logprobs"]["tokens"] = tokens  # type: ignore[index]
    with pytest.raises(PolicyError) as err:
        completions_delta(choice)
    assert err.value.status == 502 and "is it a vLLM server" in str(err.value)


def test_fewer_ids_than_logprobs_is_a_policy_error() -> None:
    choice = _choice()
    choice["logprobs"]["tokens"] = ["token_id:9315"]  # type: ignore[index]
    with pytest.raises(PolicyError, match="1 token ids but 2 logprobs"):
        completions_delta(choice)


def test_a_chunk_without_logprobs_has_no_ids() -> None:
    delta = completions_delta({"index": 0, "text": "", "logprobs": None, "token_ids": None,
                               "finish_reason": "stop"})  # fmt: skip
    assert delta.token_ids == [] and delta.finish_reason == "stop"
