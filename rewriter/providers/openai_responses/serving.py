"""OpenAI Responses API: ``POST /v1/responses`` (whole and SSE), its WebSocket mode
(``GET wss://api.openai.com/v1/responses``, ``response.create`` messages, as Codex uses),
``POST /v1/responses/input_tokens``, and the side calls of Responses clients.

Translation lives in ``request.py`` and ``response.py`` beside it. This provider keeps the
conversations of stored responses (``store: true``) per session, bounded, so
``previous_response_id`` works.
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from aiohttp import WSMsgType, web

from rewriter import jsonbody
from rewriter.canonical import AssistantReply, ChatRequest, Message, RequestError
from rewriter.parsers import ParseEvent
from rewriter.providers.base import (
    Call,
    Provider,
    ProviderOption,
    ProviderTurn,
    Route,
    RouteKind,
    StreamWriter,
    TurnRunner,
    register,
    sse,
)
from rewriter.providers.openai_chat.serving import OpenAIErrors, openai_models_body
from rewriter.providers.openai_responses import ids as responses_ids
from rewriter.providers.openai_responses import request as responses_request
from rewriter.providers.openai_responses import response as responses_response
from rewriter.providers.openai_responses.request import Context, ResponsesRequest
from rewriter.providers.openai_responses.response import EventWriter
from rewriter.vllm_client import Completion

logger = logging.getLogger(__name__)

STORED_RESPONSES = "agenttap_responses_stored"
WEBSOCKET_OPTION = "agenttap_responses_websocket"
# Responses one WebSocket connection remembers for previous_response_id (also unstored ones).
CONNECTION_RESPONSES = 8

# Non-model calls of Responses clients on api.openai.com: (method, path prefix) -> JSON body.
# The Agents SDK uploads its traces; accepted and dropped.
_SIDE_CALLS: list[tuple[str, str, Any]] = [
    ("POST", "/v1/traces/ingest", {}),
]


@dataclass
class ResponsesTurn(ProviderTurn):
    request: ResponsesRequest
    # WebSocket mode: events are sent as bare JSON messages, not SSE.
    websocket: bool = False
    # The WebSocket connection's own memory of its responses (store or not), else None.
    connection: OrderedDict[str, Context] | None = None


@register
class OpenAIResponses(OpenAIErrors, Provider[ResponsesTurn]):
    name = "openai.responses"
    hosts = ("api.openai.com",)
    # Codex names its conversation in this header.
    session_headers = {"session-id": "codex"}
    served = "POST /v1/responses (HTTP and WebSocket) and POST /v1/responses/input_tokens"
    options = (
        ProviderOption(
            STORED_RESPONSES,
            int,
            4096,
            "Responses API: how many stored responses (store: true) are kept for "
            "previous_response_id, over all sessions; the oldest are forgotten first (a whole "
            "number, 0 or more).",
        ),
        ProviderOption(
            WEBSOCKET_OPTION,
            bool,
            True,
            "Responses API: serve the WebSocket mode (wss://api.openai.com/v1/responses) "
            "(true/false; false: the upgrade gets 426 and clients such as Codex fall back to "
            "HTTP at once).",
        ),
    )

    def __init__(self, options: Mapping[str, Any] | None = None) -> None:
        super().__init__(options)
        self.capacity = int(self.option_values[STORED_RESPONSES])
        # (session id, response id) -> the context that response ended with.
        self._stored: OrderedDict[tuple[str, str], Context] = OrderedDict()

    @classmethod
    def check_options(cls, values: Mapping[str, Any]) -> None:
        if int(values[STORED_RESPONSES]) < 0:
            raise ValueError(f"{STORED_RESPONSES} must be 0 or more")

    def match(self, call: Call) -> Route | None:
        if call.path == "/v1/responses":
            if call.method == "POST":
                return Route(RouteKind.TURN)
            if call.method == "GET" and call.websocket:
                if not self.option_values[WEBSOCKET_OPTION]:
                    return Route(
                        RouteKind.REFUSE,
                        status=426,
                        message="WebSocket mode is off on this proxy "
                        f"({WEBSOCKET_OPTION}=false): use POST /v1/responses.",
                    )
                return Route(RouteKind.WEBSOCKET)
        if call.method == "POST" and call.path == "/v1/responses/input_tokens":
            return Route(RouteKind.COUNT_TOKENS)
        if not self.owns(call):
            return None
        for method, prefix, body in _SIDE_CALLS:
            if call.method == method and call.path.startswith(prefix):
                return Route(RouteKind.LOCAL, body=body)
        return None

    # -- per-session state -------------------------------------------------------------------
    def _history(
        self, session_id: str, connection: OrderedDict[str, Context] | None = None
    ) -> Callable[[str], Context | None]:
        def lookup(response_id: str) -> Context | None:
            if connection is not None and response_id in connection:
                return connection[response_id]
            found = self._stored.get((session_id, response_id))
            if found is not None:
                self._stored.move_to_end((session_id, response_id))
            return found

        return lookup

    def recorded_reply(self, turn: ResponsesTurn, reply: AssistantReply) -> Message:
        # The response id travels with the reply: its items, sent back, name this call.
        return replace(reply.as_message(), ids=(turn.response_id,))

    def finished(self, turn: ResponsesTurn, reply: AssistantReply, completion: Completion) -> None:
        conversation = turn.request.context.extended(self.recorded_reply(turn, reply))
        if turn.connection is not None:
            _remember(turn.connection, turn.response_id, conversation)
        if not turn.request.store or self.capacity == 0:
            return
        self._stored[(turn.session_id, turn.response_id)] = conversation
        while len(self._stored) > self.capacity:
            self._stored.popitem(last=False)

    # -- requests ----------------------------------------------------------------------------
    def _parse(
        self,
        body: bytes | dict[str, Any],
        session_id: str,
        connection: OrderedDict[str, Context] | None = None,
    ) -> ResponsesTurn:
        request = responses_request.parse_request(body, self._history(session_id, connection))
        if connection is not None:
            request.chat.stream = True
        return ResponsesTurn(
            chat=request.chat,
            response_id=responses_ids.new_response_id(),
            session_id=session_id,
            request=request,
            websocket=connection is not None,
            connection=connection,
        )

    def parse(self, call: Call, body: bytes, session_id: str) -> ResponsesTurn:
        return self._parse(body, session_id)

    def count_tokens(self, call: Call, body: bytes, session_id: str) -> ChatRequest:
        return responses_request.parse_request(body, self._history(session_id)).chat

    def count_tokens_body(self, tokens: int) -> dict[str, Any]:
        return {"object": "response.input_tokens", "input_tokens": tokens}

    def models_body(self, names: list[str], model_id: str) -> dict[str, Any]:
        return openai_models_body(names, model_id)

    def error(self, status: int, message: str, param: str | None = None) -> web.Response:
        body = responses_response.error_body(message, status, param)
        return web.json_response(body, status=status)

    # -- answers -----------------------------------------------------------------------------
    def response(
        self,
        turn: ResponsesTurn,
        prompt_tokens: int,
        completion: Completion,
        reply: AssistantReply,
    ) -> tuple[dict[str, Any], str]:
        body = responses_response.whole_response(
            turn.response_id,
            turn.request,
            reply,
            completion.finish_reason,
            prompt_tokens,
            len(completion.token_ids),
        )
        return body, body["status"]

    def stream_writer(self, turn: ResponsesTurn, prompt_tokens: int) -> StreamWriter:
        return _ResponseEvents(turn, prompt_tokens)

    async def serve_websocket(
        self, request: web.Request, call: Call, runner: TurnRunner
    ) -> web.StreamResponse:
        """Codex's WebSocket mode: each ``response.create`` message is one turn, answered with
        the same events as the SSE stream, one JSON message each. A bad message gets an error
        event and the connection stays open; one over the body limit is refused the
        WebSocket's own way (close 1009, message too big)."""
        ws = web.WebSocketResponse(heartbeat=None, max_msg_size=runner.max_body_bytes)
        await ws.prepare(request)
        # The handshake is answered: from here on nothing may escape as an HTTP response, which
        # would land inside the WebSocket stream (the client would see a protocol error).
        connection: OrderedDict[str, Context] = OrderedDict()
        session_id = runner.session_id(request, self)
        user_agent = request.headers.get("User-Agent", "")

        async def send(chunk: bytes) -> None:
            # One event per line; split on LF only: str.splitlines would also split at U+2028
            # and other line breaks that JSON leaves unescaped inside strings.
            for line in chunk.split(b"\n"):
                if line:
                    await ws.send_str(line.decode())

        async for msg in ws:
            if msg.type != WSMsgType.TEXT:
                if msg.type == WSMsgType.BINARY:
                    await ws.send_str(json.dumps(_ws_error(400, "send JSON text messages")))
                continue
            try:
                await self._ws_message(msg.data, session_id, connection, runner, send, user_agent)
            except ConnectionError:
                break  # the client left mid-answer
            except Exception:
                # A defect of ours, not the client's: its answer says so, the log has the
                # traceback, and the connection stays usable for the next message.
                logger.exception("agenttap: internal error on a Responses WebSocket message")
                if ws.closed:
                    break
                error = _ws_error(
                    500, "agenttap: internal error in the proxy; its log has the details."
                )
                await ws.send_str(json.dumps(error))
        return ws

    async def _ws_message(
        self,
        data: str,
        session_id: str,
        connection: OrderedDict[str, Context],
        runner: TurnRunner,
        send: Callable[[bytes], Awaitable[None]],
        user_agent: str,
    ) -> None:
        try:
            message = jsonbody.loads(data)
            if not isinstance(message, dict) or message.get("type") != "response.create":
                raise RequestError(
                    "Each WebSocket message must be a JSON object of type 'response.create'.",
                    param="type",
                )
            fields = {k: v for k, v in message.items() if k != "type"}
            # Some clients nest the request under "response".
            if isinstance(fields.get("response"), dict) and "model" not in fields:
                fields = fields["response"]
            turn = self._parse(fields, session_id, connection)
        except jsonbody.JSONBodyError as exc:
            await send(
                _ws_event(_ws_error(400, f"The message is not JSON this proxy reads: {exc}."))
            )
            return
        except RequestError as exc:
            await send(_ws_event(_ws_error(exc.status, exc.message, exc.param)))
            return
        if not turn.request.generate:
            # Codex's prewarm: nothing to generate; a later call may continue from it.
            _remember(connection, turn.response_id, turn.request.context)
            await send(_ResponseEvents(turn, 0).warmup())
            return
        refused = await runner.run_turn(self, turn, send, user_agent)
        if refused is not None:
            body = json.loads(refused.body) if isinstance(refused.body, bytes) else {}
            await send(_ws_event({"type": "error", "status": refused.status, **body}))


def _ws_event(event: dict[str, Any]) -> bytes:
    return json.dumps(event).encode() + b"\n"


def _remember(memory: OrderedDict[str, Context], response_id: str, conversation: Context) -> None:
    memory[response_id] = conversation
    while len(memory) > CONNECTION_RESPONSES:
        memory.popitem(last=False)


def _ws_error(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    return {
        "type": "error",
        "status": status,
        **responses_response.error_body(message, status, param),
    }


class _ResponseEvents:
    def __init__(self, turn: ResponsesTurn, prompt_tokens: int) -> None:
        self.writer = EventWriter(turn.response_id, turn.request, prompt_tokens)
        self.websocket = turn.websocket
        self._final: list[dict[str, Any]] = []

    def _frame(self, events: list[dict[str, Any]]) -> bytes:
        if self.websocket:
            return b"".join(json.dumps(e, ensure_ascii=False).encode() + b"\n" for e in events)
        return b"".join(sse(e, e["type"]) for e in events)

    def start(self) -> bytes:
        return self._frame(self.writer.start())

    def events(self, events: list[ParseEvent]) -> bytes:
        return self._frame(self.writer.events(events))

    def finish(self, completion: Completion, reply: AssistantReply) -> tuple[bytes, str]:
        events = self.writer.finish(completion.finish_reason, len(completion.token_ids))
        # response.completed goes out only once the turn is durable.
        self._final = events[-1:]
        return self._frame(events[:-1]), self._final[0]["response"]["status"]

    def end(self) -> bytes:
        return self._frame(self._final)

    def error(self, message: str) -> bytes:
        return self._frame([self.writer.failed(message)])

    def warmup(self) -> bytes:
        return self._frame(self.writer.warmup())
