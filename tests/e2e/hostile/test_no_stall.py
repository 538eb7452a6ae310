"""Issue 14 item 3: one session's huge prompt does not stall the others. Tokenizing it runs off
the event loop (the tokenizer lets go of the GIL), and a prompt whose text alone cannot fit the
context is refused before it is tokenized at all. Timings are in bench/stall.py; here the
checks are on order and on exact bounds."""

from __future__ import annotations

import json
import random
import threading
import time

from hypothesis import given, settings
from hypothesis import strategies as st

from rewriter.template import ChatTemplate
from tests.support.hostile import assert_provider_error, good_body, post
from tests.support.paths import QWEN3
from tests.support.proxies import Proxy

TEMPLATE = ChatTemplate(QWEN3)


def _text(kb: int) -> str:
    rng = random.Random(kb)
    words = ["".join(rng.choice("abcdefghij klmnop") for _ in range(8)) for _ in range(1000)]
    return " ".join(rng.choice(words) for _ in range(kb * 120))[: kb * 1000]


def test_small_calls_go_on_while_another_session_s_huge_prompt_is_tokenized(
    stub_proxy: Proxy,
) -> None:
    """While a 1.5 MB prompt (about 700k tokens, over the context) is tokenized, another
    session's small calls are answered: many of them before the huge one's answer. With the
    tokenizing on the event loop, none could be."""
    huge = json.dumps(good_body("openai.chat", _text(1500))).encode()
    small = json.dumps(good_body("openai.chat")).encode()
    post(stub_proxy, "stall-small", "openai.chat", small)  # warm: the session exists
    answered: list[float] = []
    huge_done = threading.Event()
    huge_answer: list[int] = []

    def send_huge() -> None:
        huge_answer.append(post(stub_proxy, "stall-huge", "openai.chat", huge, timeout=120).status)
        huge_done.set()

    sender = threading.Thread(target=send_huge)
    sender.start()
    deadline = time.monotonic() + 120
    while not huge_done.is_set() and time.monotonic() < deadline:
        assert post(stub_proxy, "stall-small", "openai.chat", small).status == 200
        if not huge_done.is_set():
            answered.append(time.monotonic())
    sender.join(timeout=120)
    assert huge_answer == [400]
    assert len(answered) >= 5, f"only {len(answered)} small calls answered during the huge one"


def test_a_prompt_that_cannot_fit_is_refused_in_the_provider_s_format(
    stub_proxy: Proxy,
) -> None:
    """Text alone past context x the longest token: refused before tokenizing (the stub's
    context is 32,768 tokens and a Qwen3 token is at most 128 bytes: 4.5 MB cannot fit)."""
    assert TEMPLATE.min_tokens(4_500_000) >= 32768
    for protocol in ("openai.chat", "anthropic"):
        body = json.dumps(good_body(protocol, "word " * 900_000)).encode()
        answer = post(stub_proxy, "too-long", protocol, body, timeout=120)
        assert answer.status == 400, answer.body[:300]
        assert_provider_error(protocol, answer)


@settings(max_examples=60, deadline=None)
@given(st.text(min_size=1, max_size=400))
def test_min_tokens_is_a_lower_bound(text: str) -> None:
    """The early refusal never refuses a prompt that would fit: no text takes fewer tokens
    than min_tokens says."""
    size = len(text.encode("utf-8", "surrogatepass"))
    assert len(TEMPLATE.encode(text)) >= TEMPLATE.min_tokens(size)


def test_min_tokens_bound_is_tight_for_the_longest_token() -> None:
    longest = max(
        (
            t
            for t in TEMPLATE.tokenizer.get_vocab()
            if t not in TEMPLATE.tokenizer.get_added_vocab()
        ),
        key=len,
    )
    text = TEMPLATE.decode(TEMPLATE.encode(TEMPLATE.tokenizer.convert_tokens_to_string([longest])))
    size = len(text.encode())
    assert size == TEMPLATE.max_token_bytes
    assert TEMPLATE.min_tokens(size) == 1 == len(TEMPLATE.encode(text))
