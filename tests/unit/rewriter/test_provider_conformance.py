"""One conformance suite that every registered provider runs (issue 15): in-process, no proxy.

A provider added to the registry without an entry in ``EXAMPLES`` fails here, so a fifth provider
arrives with the same checks as the first four: its errors in its own JSON shape at every status
the gateway uses, the policy's faults and a too-long prompt worded by it, its model turn routed
from its own host, a valid body parsed into the canonical chat form and a bad one refused as the
client's error, and options that say what they take."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import pytest
from aiohttp import web

from rewriter.canonical import RequestError
from rewriter.providers import registered
from rewriter.providers.base import Call, Provider, RouteKind
from rewriter.vllm_client import PolicyError
from tests.support.hostile import Answer, assert_provider_error, good_body


@dataclass(frozen=True)
class Example:
    """How to call a provider: its error format (``tests.support.hostile`` protocol name), its model turn
    (method, host, path, query) and a valid body for it."""

    protocol: str
    host: str
    path: str
    query: tuple[tuple[str, str], ...] = ()

    def call(self, **headers: str) -> Call:
        return Call("POST", self.host, self.path, dict(self.query), headers)

    def body(self, text: str = "Hi") -> bytes:
        return json.dumps(good_body(self.protocol, text)).encode()


EXAMPLES: dict[str, Example] = {
    "openai.chat": Example("openai.chat", "api.openai.com", "/v1/chat/completions"),
    "openai.responses": Example("openai.responses", "api.openai.com", "/v1/responses"),
    "anthropic.messages": Example("anthropic", "api.anthropic.com", "/v1/messages"),
    "gemini.generate_content": Example(
        "gemini",
        "generativelanguage.googleapis.com",
        "/v1beta/models/gemini-2.5-flash:generateContent",
    ),
}
PROVIDERS = sorted(registered())
# Every status the gateway answers with in a provider's format.
STATUSES = [400, 401, 403, 404, 405, 413, 415, 429, 431, 500, 502, 503, 504]


def _answer(response: web.StreamResponse) -> Answer:
    assert isinstance(response, web.Response)
    assert isinstance(response.body, bytes)
    return Answer(response.status, response.content_type, response.body)


@pytest.fixture(params=PROVIDERS)
def provider(request: pytest.FixtureRequest) -> tuple[Provider[Any], Example]:
    name = request.param
    assert name in EXAMPLES, f"provider {name!r} is registered but has no conformance example"
    return registered()[name](), EXAMPLES[name]


def test_every_registered_provider_has_an_example() -> None:
    assert set(PROVIDERS) == set(EXAMPLES)


def test_identity(provider: tuple[Provider[Any], Example]) -> None:
    impl, example = provider
    assert impl.hosts and impl.served
    assert impl.owns_host(example.host) and impl.owns(example.call())
    assert not impl.owns_host("example.com")


@pytest.mark.parametrize("status", STATUSES)
def test_errors_are_in_the_providers_format(
    provider: tuple[Provider[Any], Example], status: int
) -> None:
    impl, example = provider
    answer = _answer(impl.error(status, "something went wrong here"))
    assert answer.status == status
    error = assert_provider_error(example.protocol, answer)
    assert "something went wrong here" in error["message"]


def test_a_prompt_too_long_names_both_lengths(provider: tuple[Provider[Any], Example]) -> None:
    impl, example = provider
    answer = _answer(impl.prompt_too_long(40961, 40960))
    assert answer.status == 400
    message = assert_provider_error(example.protocol, answer)["message"]
    assert "40961" in message and "40960" in message


@pytest.mark.parametrize(
    ("fault", "statuses"),
    [
        (PolicyError("the policy refused the prompt", status=400), {400}),
        # Each provider's own server-side statuses (Anthropic's 529 overloaded, Google's 500).
        (PolicyError("connection refused"), {503, 529}),
        (PolicyError("the policy answered garbage", status=200), {500, 502}),
    ],
    ids=["refused", "unavailable", "garbage"],
)
def test_policy_faults_are_the_providers_errors(
    provider: tuple[Provider[Any], Example], fault: PolicyError, statuses: set[int]
) -> None:
    impl, example = provider
    answer = _answer(impl.policy_error(fault))
    assert answer.status in statuses, answer.body[:200]
    assert str(fault) in assert_provider_error(example.protocol, answer)["message"]


def test_its_model_turn_is_routed_and_parsed(provider: tuple[Provider[Any], Example]) -> None:
    impl, example = provider
    route = impl.match(example.call())
    assert route is not None and route.kind is RouteKind.TURN
    turn = impl.parse(example.call(), example.body("What is 2+2?"), "conformance")
    messages = turn.chat.messages
    assert messages and messages[-1].role == "user"
    assert "What is 2+2?" in messages[-1].content


@pytest.mark.parametrize(
    "body",
    [b"", b"not json", b"[]", b'{"messages": 5}', b'{"temperature": NaN}', b"\xff\xfe"],
    ids=["empty", "text", "array", "wrong-type", "nan", "not-utf8"],
)
def test_a_bad_body_is_the_clients_error(
    provider: tuple[Provider[Any], Example], body: bytes
) -> None:
    impl, example = provider
    with pytest.raises(RequestError) as caught:
        impl.parse(example.call(), body, "conformance")
    assert 400 <= caught.value.status < 500 and caught.value.message


def test_options_say_what_they_take(provider: tuple[Provider[Any], Example]) -> None:
    impl, _ = provider
    for option in impl.options:
        assert option.name.startswith("agenttap_"), option
        assert len(option.help) > 20, option
