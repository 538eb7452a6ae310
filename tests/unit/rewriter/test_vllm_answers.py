"""rewriter/vllm_answers.py: the prompt ids vLLM echoes are dropped before parsing, and nothing
else of an answer changes."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rewriter.vllm_answers import (
    CompletionDelta,
    PolicyError,
    answer_choices,
    answer_json,
    completions_delta,
    completions_stream_line,
    without_prompt_echo,
)

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


# -- completions_stream_line: the one-pass reader of a streamed token's line --------------------
def _careful(raw: bytes) -> list[CompletionDelta] | None:
    try:
        return [completions_delta(c) for c in answer_choices(answer_json(raw, "a stream line"))]
    except PolicyError:
        return None


# vLLM's lines, as it writes them (return_tokens_as_token_ids; or token_ids; a finish; usage).
VLLM_LINES = [
    b'{"id":"cmpl-9","object":"text_completion","created":1764000000,"model":"m","choices":[{'
    b'"index":0,"text":" the","logprobs":{"text_offset":[12],"token_logprobs":[-1.25],'
    b'"tokens":["token_id:279"],"top_logprobs":[{"token_id:279":-1.25}]},"finish_reason":null,'
    b'"stop_reason":null,"prompt_logprobs":null,"prompt_token_ids":null,"token_ids":null}],'
    b'"usage":null}',
    b'{"choices":[{"index":0,"text":"!","token_ids":[0,2147483647],"logprobs":{'
    b'"token_logprobs":[-0.5,-3e-07]},"finish_reason":"stop","stop_reason":151645}]}',
    b'{"choices":[{"index":0,"text":"","logprobs":{"token_logprobs":[],"tokens":[]},'
    b'"finish_reason":"length","stop_reason":"</s>"}]}',
    b'{"id":"cmpl-9","choices":[],"usage":{"prompt_tokens":4,"completion_tokens":8}}',
]


@pytest.mark.parametrize("raw", VLLM_LINES)
def test_vllms_own_lines_take_the_one_pass_reader(raw: bytes) -> None:
    fast = completions_stream_line(raw)
    assert fast is not None and fast == _careful(raw)


_ANY = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=6),
    st.sampled_from(["token_id:12", "token_id:-1", "token_id:4294967296", "token_id:１２"]),
    st.lists(st.integers(0, 5), max_size=2),
    st.dictionaries(st.sampled_from(["a", "tokens"]), st.none(), max_size=1),
)
_TOKEN = st.one_of(st.builds("token_id:{}".format, st.integers(-3, 2**32)), _ANY)
_LOGPROBS = st.one_of(
    st.none(),
    st.fixed_dictionaries(
        {"token_logprobs": st.one_of(st.lists(st.one_of(st.floats(-30, 0), _ANY), max_size=3))},
        optional={"tokens": st.one_of(st.lists(_TOKEN, max_size=3), _ANY)},
    ),
    _ANY,
)
_CHOICE = st.fixed_dictionaries(
    {},
    optional={
        "text": st.one_of(st.text(max_size=4), _ANY),
        "token_ids": st.one_of(st.lists(st.integers(0, 2**31 + 5), max_size=3), _ANY),
        "logprobs": _LOGPROBS,
        "finish_reason": st.one_of(st.sampled_from(["stop", "length"]), _ANY),
        "stop_reason": st.one_of(st.integers(0, 2**65), _ANY),
    },
)


@st.composite
def _good_choice(draw: st.DrawFn) -> dict[str, object]:
    """A choice as vLLM writes it, in either spelling of its ids, now and then one field off."""
    ids = draw(st.lists(st.integers(0, 2**31 - 1), max_size=3))
    logprobs = [draw(st.floats(-30, 0)) for _ in ids]
    choice: dict[str, object] = {"text": draw(st.text(max_size=4)), "finish_reason": None}
    if draw(st.booleans()):
        choice["token_ids"] = ids
        choice["logprobs"] = {"token_logprobs": logprobs}
    else:
        tokens = [f"token_id:{i}" for i in ids]
        choice["logprobs"] = {"token_logprobs": logprobs, "tokens": tokens}
    if draw(st.booleans()):
        choice["finish_reason"] = draw(st.sampled_from(["stop", "length", "abort"]))
        choice["stop_reason"] = draw(st.one_of(st.none(), st.integers(0, 2**20), st.text()))
    if draw(st.booleans()):
        field = draw(st.sampled_from(["text", "token_ids", "logprobs", "stop_reason"]))
        choice[field] = draw(_ANY)
    return choice


_LINE = st.one_of(
    st.builds(lambda c: {"choices": c}, st.lists(_good_choice(), min_size=1, max_size=2)),
    st.builds(lambda c: {"choices": c}, st.lists(_CHOICE, max_size=2)),
    st.builds(lambda c: {"choices": c}, _ANY),
    st.builds(lambda c: {"choices": [c], "error": {"message": "x"}}, _CHOICE),
    _ANY,
)


@settings(max_examples=600, deadline=None)
@given(_LINE)
def test_the_one_pass_reader_reads_as_the_careful_path_or_not_at_all(line: object) -> None:
    """Whatever the line, the one-pass reader gives what the careful path gives, or declines
    (None) and leaves it to the careful path: never another reading, never garbage accepted."""
    raw = json.dumps(line).encode()
    fast, careful = completions_stream_line(raw), _careful(raw)
    if fast is not None:
        assert careful == fast
    if careful is None:
        assert fast is None


def test_lines_orjson_reads_otherwise_are_left_to_the_careful_path() -> None:
    for raw in (
        b'{"choices": [{"text": "a", "token_ids": [5], "logprobs": {"token_logprobs": [NaN]}}]}',
        b'{"choices": [{"token_ids": [], "finish_reason": "stop", "stop_reason": '
        + b"9" * 25
        + b"}]}",
        b'{"choices": [{"text": "\\ud800", "token_ids": [], "finish_reason": "stop"}]}',
    ):
        assert completions_stream_line(raw) is None
        assert _careful(raw) is not None  # the careful path reads them
