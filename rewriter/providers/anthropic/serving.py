"""Anthropic Messages (``POST /v1/messages``, ``/v1/messages/count_tokens``, ``GET /v1/models``)
and local answers to Claude Code's non-model calls on api.anthropic.com.

Translation and normalization rules live in ``request.py`` and ``response.py`` beside it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from aiohttp import web

from rewriter.canonical import AssistantReply, ChatRequest, Message
from rewriter.parsers import ParseEvent
from rewriter.providers.anthropic import request as anthropic_request
from rewriter.providers.anthropic import response as anthropic_response
from rewriter.providers.anthropic.request import BILLING_HEADER_RE, Normalization
from rewriter.providers.base import (
    Call,
    Provider,
    ProviderOption,
    ProviderTurn,
    Route,
    RouteKind,
    StreamWriter,
    register,
)
from rewriter.vllm_client import Completion
from rewriter.wire import TextEvent

DROP_SYSTEM_BLOCKS = "agenttap_drop_system_blocks"

# Claude Code calls api.anthropic.com for feature flags, settings, a bootstrap config, the MCP
# registry and telemetry. None of it concerns the policy; each gets the answer of an account with
# nothing configured and nothing enabled. Telemetry is accepted and dropped.
# (method, path prefix) -> JSON body; first match wins.
_CLAUDE_CODE_CALLS: list[tuple[str, str, Any]] = [
    ("POST", "/api/eval/", {"features": {}}),  # feature flags
    ("GET", "/api/claude_code/policy_limits", {"restrictions": {}}),
    ("GET", "/api/claude_code/settings", {}),
    ("GET", "/api/claude_code/organizations/metrics_enabled", {"metrics_logging_enabled": False}),
    ("GET", "/api/claude_code_penguin_mode", {"enabled": False}),
    ("GET", "/api/claude_cli/bootstrap", {}),
    ("GET", "/mcp-registry/", {"servers": [], "metadata": {"count": 0}}),
    ("POST", "/api/event_logging/", {}),
    ("POST", "/api/claude_code/metrics", {}),
]


def _anthropic_host(host: str) -> bool:
    return host == "anthropic.com" or host.endswith(".anthropic.com")


def local_answer(host: str, method: str, path: str) -> Any | None:
    """The JSON body that answers a Claude Code non-model call, or None when it is not one."""
    if not _anthropic_host(host):
        return None
    for want_method, prefix, body in _CLAUDE_CODE_CALLS:
        if method == want_method and path.startswith(prefix):
            return body
    return None


@register
class AnthropicMessages(Provider[ProviderTurn]):
    name = "anthropic.messages"
    hosts = ("anthropic.com",)
    session_headers = {"X-Claude-Code-Session-Id": "claude-code"}
    served = "POST /v1/messages, POST /v1/messages/count_tokens and GET /v1/models"
    options = (
        ProviderOption(
            DROP_SYSTEM_BLOCKS,
            str,
            BILLING_HEADER_RE,
            "Regexes, separated by '||': system text blocks matching one are dropped before "
            "rendering (scaffold noise such as Claude Code's per-call billing header).",
        ),
    )

    def __init__(self, options: Mapping[str, Any] | None = None) -> None:
        super().__init__(options)
        self.normalization = Normalization.from_option(self.option_values[DROP_SYSTEM_BLOCKS])

    @classmethod
    def check_options(cls, values: Mapping[str, Any]) -> None:
        Normalization.from_option(values[DROP_SYSTEM_BLOCKS])

    def owns(self, call: Call) -> bool:
        # An Anthropic SDK pointed at another base URL still says which API it speaks.
        return _anthropic_host(call.host) or "anthropic-version" in call.headers

    def match(self, call: Call) -> Route | None:
        if call.method == "POST" and call.path == "/v1/messages":
            return Route(RouteKind.TURN)
        if call.method == "POST" and call.path == "/v1/messages/count_tokens":
            return Route(RouteKind.COUNT_TOKENS)
        if not self.owns(call):
            return None
        if call.method == "GET" and call.path == "/v1/models":
            return Route(RouteKind.MODELS)
        if call.method == "GET" and call.path.startswith("/v1/models/"):
            return Route(RouteKind.MODELS, model_id=call.path[len("/v1/models/") :])
        answer = local_answer(call.host, call.method, call.path)
        if answer is not None:
            return Route(RouteKind.LOCAL, body=answer)
        return None

    def parse(self, call: Call, body: bytes, session_id: str) -> ProviderTurn:
        chat = anthropic_request.parse_request(body, self.normalization)
        return ProviderTurn(chat, anthropic_response.new_message_id(), session_id)

    def count_tokens(self, call: Call, body: bytes, session_id: str) -> ChatRequest:
        return anthropic_request.parse_request(body, self.normalization, count_tokens=True)

    def count_tokens_body(self, tokens: int) -> dict[str, Any]:
        return {"input_tokens": tokens}

    def models_body(self, names: list[str], model_id: str) -> dict[str, Any]:
        if model_id:
            return anthropic_response.model_object(model_id)
        return anthropic_response.models_list(names)

    def error(self, status: int, message: str, param: str | None = None) -> web.Response:
        body = anthropic_response.error_body(message, status)
        return web.json_response(body, status=status, headers={"request-id": body["request_id"]})

    def prompt_too_long_message(self, prompt_tokens: int, max_model_len: int) -> str:
        return anthropic_response.prompt_too_long_message(prompt_tokens, max_model_len)

    # Anthropic's "overloaded": clients back off and retry.
    unavailable_status = 529
    unavailable_message = "Overloaded: the policy server is unavailable ({exc})"
    failed_status = 500
    failed_message = "the policy server failed: {exc}"

    def recorded_reply(self, turn: ProviderTurn, reply: AssistantReply) -> Message:
        return anthropic_response.with_client_ids(reply).as_message()

    def response(
        self, turn: ProviderTurn, prompt_tokens: int, completion: Completion, reply: AssistantReply
    ) -> tuple[dict[str, Any], str]:
        reason = anthropic_response.stop_reason(
            completion.finish_reason, completion.stop_reason, reply
        )
        body = anthropic_response.message_response(
            turn.response_id,
            turn.chat.model,
            reply,
            reason,
            prompt_tokens,
            len(completion.token_ids),
        )
        return body, reason[0]

    def stream_writer(self, turn: ProviderTurn, prompt_tokens: int) -> StreamWriter:
        return _EventStream(turn, prompt_tokens)


# The text field of each delta type a token's text streams in.
_DELTA_TEXT = {"text_delta": "text", "thinking_delta": "thinking"}


class _EventStream:
    def __init__(self, turn: ProviderTurn, prompt_tokens: int) -> None:
        self.writer = anthropic_response.EventWriter(
            turn.response_id, turn.chat.model, prompt_tokens
        )
        self._final: list[dict[str, Any]] = []
        # A text or thinking delta per token: only its text changes within a block.
        self._deltas: dict[tuple[int, str], TextEvent] = {}

    def _join(self, events: list[dict[str, Any]]) -> bytes:
        return b"".join(self._encode(e) for e in events)

    def _encode(self, event: dict[str, Any]) -> bytes:
        """``anthropic_response.sse(event)``, a token's text delta through its block's
        TextEvent."""
        delta: dict[str, Any] = event.get("delta") or {}
        field = _DELTA_TEXT.get(delta.get("type", ""))
        if field is None or list(delta) != ["type", field] or len(event) != 3:
            return anthropic_response.sse(event)
        key = (event["index"], delta["type"])
        fast = self._deltas.get(key)
        if fast is None:
            index, kind = key
            fast = self._deltas[key] = TextEvent(
                lambda text: anthropic_response.sse(
                    {
                        "type": "content_block_delta",
                        "index": index,
                        "delta": {"type": kind, field: text},
                    }
                )
            )
        return fast(delta[field])

    def start(self) -> bytes:
        return self._join(self.writer.start())

    def events(self, events: list[ParseEvent]) -> bytes:
        return self._join(self.writer.events(events))

    def finish(self, completion: Completion, reply: AssistantReply) -> tuple[bytes, str]:
        reason = anthropic_response.stop_reason(
            completion.finish_reason, completion.stop_reason, reply
        )
        events = self.writer.finish(reason, len(completion.token_ids))
        # message_stop goes out only once the turn is durable.
        self._final = events[-1:]
        return self._join(events[:-1]), reason[0]

    def end(self) -> bytes:
        return self._join(self._final)

    def error(self, message: str) -> bytes:
        return anthropic_response.sse(anthropic_response.error_body(message, 500))
