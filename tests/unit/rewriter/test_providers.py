"""The provider seam: the registry, which provider answers which call, provider options."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from capture.gateway import Gateway, GatewayConfig
from rewriter.providers import base, registered
from rewriter.providers.base import Call, Route, RouteKind, register
from rewriter.providers.openai_chat.serving import OpenAIChat


@pytest.fixture(scope="module")
def gateway(qwen3_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Gateway:
    out = tmp_path_factory.mktemp("providers")
    return Gateway(GatewayConfig(["http://127.0.0.1:9"], qwen3_dir, out))


def route(gateway: Gateway, method: str, host: str, path: str, **kw: Any) -> tuple[str, Any]:
    provider, found = gateway._route(Call(method, host, path, **kw))
    return provider.name, found.kind if found else None


def test_builtin_providers_are_registered() -> None:
    assert list(registered()) == [
        "anthropic.messages",
        "gemini.generate_content",
        "openai.chat",
        "openai.responses",
    ]


GEMINI = "generativelanguage.googleapis.com"


@pytest.mark.parametrize(
    "method, host, path, query, want",
    [
        ("POST", GEMINI, "/v1beta/models/g:generateContent", {}, RouteKind.TURN),
        ("POST", GEMINI, "/v1beta/models/g:streamGenerateContent", {"alt": "sse"}, RouteKind.TURN),
        # The JSON-array stream is refused in Google's format, with what to do instead.
        ("POST", GEMINI, "/v1beta/models/g:streamGenerateContent", {}, RouteKind.REFUSE),
        ("POST", GEMINI, "/v1/models/g:countTokens", {}, RouteKind.COUNT_TOKENS),
        ("GET", GEMINI, "/v1beta/models", {}, RouteKind.MODELS),
        ("GET", GEMINI, "/v1beta/models/g", {}, RouteKind.MODELS),
        ("POST", GEMINI, "/v1beta/models/g:embedContent", {}, RouteKind.REFUSE),
        ("GET", GEMINI, "/v1/nonsense", {}, None),
        # A Google SDK pointed at another base URL: the method in the path says which API.
        ("POST", "example.test", "/v1beta/models/g:generateContent", {}, RouteKind.TURN),
    ],
)
def test_gemini_routes(
    gateway: Gateway, method: str, host: str, path: str, query: dict[str, str], want: Any
) -> None:
    assert route(gateway, method, host, path, query=query) == ("gemini.generate_content", want)
    # Gemini's model listing on a Google host only: OpenAI's /v1/models stays OpenAI's.
    assert route(gateway, "GET", "api.openai.com", "/v1/models") == (
        "openai.chat",
        RouteKind.MODELS,
    )


@pytest.mark.parametrize(
    "method, host, path, headers, websocket, want",
    [
        (
            "POST",
            "api.openai.com",
            "/v1/chat/completions",
            {},
            False,
            ("openai.chat", RouteKind.TURN),
        ),
        (
            "POST",
            "api.openai.com",
            "/v1/responses",
            {},
            False,
            ("openai.responses", RouteKind.TURN),
        ),
        (
            "GET",
            "api.openai.com",
            "/v1/responses",
            {},
            True,
            ("openai.responses", RouteKind.WEBSOCKET),
        ),
        (
            "POST",
            "api.openai.com",
            "/v1/responses/input_tokens",
            {},
            False,
            ("openai.responses", RouteKind.COUNT_TOKENS),
        ),
        (
            "POST",
            "api.openai.com",
            "/v1/traces/ingest",
            {},
            False,
            ("openai.responses", RouteKind.LOCAL),
        ),
        ("GET", "api.openai.com", "/v1/models", {}, False, ("openai.chat", RouteKind.MODELS)),
        (
            "GET",
            "api.anthropic.com",
            "/v1/models",
            {},
            False,
            ("anthropic.messages", RouteKind.MODELS),
        ),
        # An Anthropic SDK pointed elsewhere still says which API it speaks.
        (
            "GET",
            "example.test",
            "/v1/models",
            {"anthropic-version": "2023-06-01"},
            False,
            ("anthropic.messages", RouteKind.MODELS),
        ),
        (
            "POST",
            "api.anthropic.com",
            "/v1/messages/count_tokens",
            {},
            False,
            ("anthropic.messages", RouteKind.COUNT_TOKENS),
        ),
        (
            "GET",
            "api.anthropic.com",
            "/api/claude_cli/bootstrap",
            {},
            False,
            ("anthropic.messages", RouteKind.LOCAL),
        ),
        # Nobody serves it: the host's owner answers 404 in its format.
        ("GET", "api.anthropic.com", "/v1/nonsense", {}, False, ("anthropic.messages", None)),
        ("GET", "api.openai.com", "/v1/nonsense", {}, False, ("openai.chat", None)),
        ("GET", "unknown.test", "/v1/nonsense", {}, False, ("openai.chat", None)),
        # A header claims the call too, but the host's owner words the 404 (bench/fuzz.py found
        # Gemini's unserved paths answered in Anthropic's format when anthropic-version was sent).
        (
            "POST",
            "generativelanguage.googleapis.com",
            "/v1beta/models/m/n:generateContent",
            {"anthropic-version": "2023-06-01"},
            False,
            ("gemini.generate_content", None),
        ),
    ],
)
def test_routes(
    gateway: Gateway,
    method: str,
    host: str,
    path: str,
    headers: dict[str, str],
    websocket: bool,
    want: tuple[str, RouteKind | None],
) -> None:
    assert route(gateway, method, host, path, headers=headers, websocket=websocket) == want


def test_unknown_path_names_what_every_owner_serves(gateway: Gateway) -> None:
    served = gateway._served(Call("GET", "api.openai.com", "/v1/nonsense"))
    assert "/v1/chat/completions" in served and "/v1/responses" in served


def test_provider_options_are_validated() -> None:
    anthropic = registered()["anthropic.messages"]
    assert [o.name for o in anthropic.options] == ["agenttap_drop_system_blocks"]
    with pytest.raises(ValueError, match="bad regex"):
        anthropic.check_options({"agenttap_drop_system_blocks": "(unclosed"})
    with pytest.raises(ValueError):
        registered()["openai.responses"]({"agenttap_responses_stored": -1})


@pytest.fixture
def clean_registry() -> Any:
    before = dict(base._REGISTRY)
    yield
    base._REGISTRY.clear()
    base._REGISTRY.update(before)


def test_a_new_provider_plugs_in_by_name(
    qwen3_dir: Path, tmp_path: Path, clean_registry: None
) -> None:
    """A provider registered from outside the package is served without touching the gateway."""

    @register
    class EchoHost(OpenAIChat):
        name = "test.echo"
        hosts = ("echo.test",)

        def match(self, call: Call) -> Route | None:
            if self.owns(call) and call.path.startswith("/v9/") and ":generate" in call.path:
                return Route(RouteKind.TURN)
            return None

    gw = Gateway(
        GatewayConfig(
            ["http://127.0.0.1:9"], qwen3_dir, tmp_path, providers=["test.echo", "openai.chat"]
        )
    )
    assert [p.name for p in gw.providers] == ["test.echo", "openai.chat"]
    assert route(gw, "POST", "echo.test", "/v9/models/m:generate") == ("test.echo", RouteKind.TURN)
    assert route(gw, "POST", "echo.test", "/v1/chat/completions") == ("openai.chat", RouteKind.TURN)
    with pytest.raises(ValueError, match="unknown provider"):
        Gateway(GatewayConfig(["http://127.0.0.1:9"], qwen3_dir, tmp_path, providers=["nope"]))


def test_a_bug_in_a_provider_is_a_500_in_its_format_not_the_clients_400(
    qwen3_dir: Path, tmp_path: Path, clean_registry: None, caplog: pytest.LogCaptureFixture
) -> None:
    """Only the schema's checks make a 4xx: an AttributeError raised while translating (a bug of
    ours) used to be turned into a 400 blaming the client; it is a 500 in the provider's format,
    with the traceback in the log."""
    import asyncio
    import json

    from aiohttp.test_utils import make_mocked_request

    from capture.pipeline.handoff import HOST_HEADER, TOKEN_HEADER

    @register
    class Broken(OpenAIChat):
        name = "test.broken"
        hosts = ("broken.test",)

        def parse(self, call: Call, body: bytes, session_id: str) -> Any:
            return None.missing  # type: ignore[attr-defined]

    gw = Gateway(
        GatewayConfig(["http://127.0.0.1:9"], qwen3_dir, tmp_path, providers=["test.broken"])
    )

    async def call() -> Any:
        request = make_mocked_request(
            "POST",
            "/v1/chat/completions",
            headers={TOKEN_HEADER: gw.token, HOST_HEADER: "broken.test"},
            payload=None,
        )
        return await gw._dispatch(request)

    with caplog.at_level("ERROR"):
        response = asyncio.run(call())
    assert response.status == 500
    error = json.loads(response.body)["error"]
    assert error["type"] == "server_error" and "internal error" in error["message"]
    assert any(r.exc_info and r.exc_info[0] is AttributeError for r in caplog.records)
