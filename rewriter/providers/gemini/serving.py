"""The Gemini API on generativelanguage.googleapis.com:
``POST /v1beta/models/{model}:generateContent``, ``:streamGenerateContent?alt=sse`` and
``:countTokens``, ``GET /v1beta/models[/{model}]`` (and the ``/v1`` spellings). The model and
whether to stream are in the URL, not the body.

Translation lives in the modules beside it; this is its HTTP glue. Gemini CLI (API-key mode)
sends no session header of its own (``x-gemini-api-privileged-user-id`` names the installation,
not a run), and makes no other call on this host: its telemetry goes to play.googleapis.com,
which the proxy refuses unless it is made an intercepted host.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from aiohttp import web

from rewriter.canonical import AssistantReply, ChatRequest, RequestError
from rewriter.parsers import ParseEvent
from rewriter.providers.base import (
    Call,
    Provider,
    ProviderTurn,
    Route,
    RouteKind,
    StreamWriter,
    register,
)
from rewriter.providers.gemini import request as gemini_request
from rewriter.providers.gemini import response as gemini_response
from rewriter.providers.gemini import routes as gemini_routes
from rewriter.vllm_client import Completion


@dataclass
class GeminiTurn(ProviderTurn):
    # The client asked for reasoning as `thought` parts (thinkingConfig.includeThoughts).
    include_thoughts: bool = False


@register
class GeminiAPI(Provider[GeminiTurn]):
    name = "gemini.generate_content"
    hosts = ("generativelanguage.googleapis.com",)
    served = (
        "POST /v1beta/models/MODEL:generateContent, :streamGenerateContent?alt=sse and "
        ":countTokens, and GET /v1beta/models[/MODEL]"
    )

    def match(self, call: Call) -> Route | None:
        route = gemini_routes.parse_route(call.method, call.path)
        if route is None:
            return None
        if route.kind in ("generate", "stream"):
            # Unambiguous paths: a Google SDK pointed at another base URL is still served.
            if route.kind == "stream" and call.query.get("alt") != "sse":
                return Route(
                    RouteKind.REFUSE,
                    status=400,
                    message="streamGenerateContent is served as server-sent events only: add "
                    "?alt=sse to the URL (every Google SDK does).",
                )
            return Route(RouteKind.TURN)
        if route.kind == "count_tokens":
            return Route(RouteKind.COUNT_TOKENS)
        if not self.owns(call):
            return None  # /v1/models on another host is someone else's listing
        if route.kind == "list_models":
            return Route(RouteKind.MODELS)
        if route.kind == "get_model":
            return Route(RouteKind.MODELS, model_id=route.model)
        return Route(
            RouteKind.REFUSE,
            status=404,
            message=f"agenttap: {call.method} {call.path} ({route.method or 'this method'}) is "
            f"not served by this proxy. It answers {self.served} from the policy.",
        )

    @staticmethod
    def _route(call: Call) -> gemini_routes.Route:
        route = gemini_routes.parse_route(call.method, call.path)
        if route is None:  # match() claimed it, so the path is a Gemini route
            raise RequestError(f"{call.path} is not a Gemini API route", status=404)
        return route

    def parse(self, call: Call, body: bytes, session_id: str) -> GeminiTurn:
        route = self._route(call)
        request = gemini_request.parse_request(body, route.model, stream=route.kind == "stream")
        return GeminiTurn(
            request.chat, gemini_response.new_response_id(), session_id, request.include_thoughts
        )

    def count_tokens(self, call: Call, body: bytes, session_id: str) -> ChatRequest:
        return gemini_request.parse_count_tokens(body, self._route(call).model)

    def count_tokens_body(self, tokens: int) -> dict[str, Any]:
        return gemini_response.count_tokens_response(tokens)

    def models_body(self, names: list[str], model_id: str) -> dict[str, Any]:
        if model_id:
            return gemini_response.model_object(model_id)
        return gemini_response.models_list(names)

    def error(self, status: int, message: str, param: str | None = None) -> web.Response:
        return web.json_response(gemini_response.error_body(status, message), status=status)

    def prompt_too_long_message(self, prompt_tokens: int, max_model_len: int) -> str:
        return gemini_response.prompt_too_long_message(prompt_tokens, max_model_len)

    # UNAVAILABLE: Google's clients back off and retry.
    unavailable_message = "The policy server is unavailable ({exc}); try again in a moment."
    failed_status = 500
    failed_message = "The policy server failed: {exc}"

    # recorded_reply: the default. Function calls carry the parser's ids, which the client is
    # given as functionCall.id and sends back on the call and its functionResponse.

    def response(
        self, turn: GeminiTurn, prompt_tokens: int, completion: Completion, reply: AssistantReply
    ) -> tuple[dict[str, Any], str]:
        reason = gemini_response.finish_reason(completion.finish_reason)
        body = gemini_response.generate_response(
            turn.response_id,
            turn.chat.model,
            reply,
            reason,
            prompt_tokens,
            len(completion.token_ids),
            include_thoughts=turn.include_thoughts,
        )
        return body, reason

    def stream_writer(self, turn: GeminiTurn, prompt_tokens: int) -> StreamWriter:
        return _ChunkStream(turn, prompt_tokens)


class _ChunkStream:
    def __init__(self, turn: GeminiTurn, prompt_tokens: int) -> None:
        self.writer = gemini_response.ChunkWriter(
            turn.response_id, turn.chat.model, prompt_tokens, turn.include_thoughts
        )
        self._final = b""

    def start(self) -> bytes:
        return b""  # Gemini's stream has no opening event: its first chunk carries content

    def events(self, events: list[ParseEvent]) -> bytes:
        return b"".join(gemini_response.sse(c) for c in self.writer.chunks(events))

    def finish(self, completion: Completion, reply: AssistantReply) -> tuple[bytes, str]:
        reason = gemini_response.finish_reason(completion.finish_reason)
        # The chunk with finishReason goes out only once the turn is durable.
        self._final = gemini_response.sse(self.writer.finish(reason, len(completion.token_ids)))
        return b"", reason

    def end(self) -> bytes:
        return self._final

    def error(self, message: str) -> bytes:
        return gemini_response.sse(
            gemini_response.error_body(500, f"The policy server failed: {message}")
        )
