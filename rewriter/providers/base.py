"""The provider seam: everything one API provider's wire format needs, behind one class.

The gateway (``capture/gateway.py``) is provider-free: it reads a call, asks the registry which
provider claims it, and runs the shared turn (``capture/pipeline/turn.py``: assemble the prompt ids,
generate token-in/token-out, parse the completion, answer, record). A provider is one module in
this package that subclasses :class:`Provider` and registers itself with :func:`register`;
nothing else changes to add one.

What a provider owns
--------------------
``name``
    Registry key, and the ``protocol`` column of the turns shard (``"openai.chat"``, ...).
``hosts``
    API hosts it owns (a host or any subdomain of it). The owner of a host answers that host's
    unknown paths (404 in its own error format) and its model listing.
``match(call)``
    Which of its routes a :class:`Call` (method, host, path, query, headers) is: a model turn, a
    token count, a model listing, a local answer to a client's non-model call, a WebSocket, or
    ``None``. Routes may read the whole call: Gemini puts the model and the streaming flag in the
    URL. Providers are asked in order, owners of the call's host first.
``parse(call, body, session_id)``
    The whole request (body + URL + headers) -> a :class:`ProviderTurn` holding the canonical
    :class:`~rewriter.canonical.ChatRequest` plus whatever the provider needs to answer it (its
    own subclass). ``session_id`` lets a provider keep per-session state (Responses'
    ``previous_response_id``); such state lives in the provider and must be bounded.
``response`` / ``stream_writer``
    The whole answer, or a :class:`StreamWriter` that writes events as the policy's tokens arrive.
``recorded_reply`` / ``finished``
    The reply as the client will send it back (its ids) for the thread records, and a hook run once
    the turn is durable (to remember a stored response, say).
``error`` / ``prompt_too_long`` / ``policy_error``
    Errors in the provider's own JSON shape and statuses.
``models_body`` / ``count_tokens`` / ``count_tokens_body``
    Its model listing and token counting (the exact prompt length the policy would be sent).
Local answers
    ``match`` returns ``Route(RouteKind.LOCAL, body=...)`` for the client's non-model calls
    (feature flags, telemetry, ...) and ``RouteKind.REFUSE`` for those it declines: nothing
    leaves the machine.
``serve_websocket``
    A WebSocket mode (``RouteKind.WEBSOCKET``), driving turns through the gateway's
    :class:`TurnRunner`.
``session_headers``
    The client's own session header -> a session-id prefix, used when the proxy URL has no username.
``options`` / ``check_options``
    Its mitmproxy options (scaffold-noise normalization, ...): declared by the addon's ``load``,
    validated in ``configure`` through ``check_options``, and handed to ``__init__`` as values.

Protocol translation itself (bodies <-> canonical) stays in ``rewriter/`` as pure functions; a
provider module is the HTTP glue around one of those.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, ClassVar, Protocol

from aiohttp import web

from rewriter.canonical import AssistantReply, ChatRequest, Message
from rewriter.parsers import ParseEvent
from rewriter.vllm_client import Completion, PolicyError
from rewriter.wire import sse  # noqa: F401 (providers import it from here)


class IncomingRequest(Protocol):
    """What the gateway reads of a call: an aiohttp ``web.Request`` off the loopback listener,
    or a call the addon answers in-process from its buffered body (capture/pipeline/bodies.py
    ``BufferedRequest``)."""

    @property
    def method(self) -> str: ...
    @property
    def path(self) -> str: ...
    @property
    def query(self) -> Mapping[str, str]: ...
    @property
    def headers(self) -> Mapping[str, str]: ...
    @property
    def content_length(self) -> int | None: ...
    async def read(self) -> bytes: ...


@dataclass(frozen=True)
class Call:
    """One intercepted HTTP call as the client sent it (credentials already removed)."""

    method: str
    # The API host the client called (api.openai.com), not the gateway's.
    host: str
    # Without a trailing slash; "/" for the root.
    path: str
    query: Mapping[str, str] = field(default_factory=dict)
    headers: Mapping[str, str] = field(default_factory=dict)
    websocket: bool = False

    @classmethod
    def of(cls, request: IncomingRequest, host: str) -> Call:
        upgrade = request.headers.get("Upgrade", "").lower() == "websocket"
        return cls(
            method=request.method,
            host=host,
            path=request.path.rstrip("/") or "/",
            query=request.query,
            headers=request.headers,
            websocket=upgrade,
        )


class RouteKind(Enum):
    TURN = "turn"  # a model call answered by the policy
    COUNT_TOKENS = "count_tokens"
    MODELS = "models"  # listing (model_id "") or one model
    LOCAL = "local"  # a client's non-model call, answered with ``body``
    WEBSOCKET = "websocket"  # the provider serves the WebSocket itself (``serve_websocket``)
    REFUSE = "refuse"  # a known call the proxy declines: ``status`` + ``message``, provider format


@dataclass(frozen=True)
class Route:
    kind: RouteKind
    model_id: str = ""
    body: Any = None
    status: int = 404
    message: str = ""


@dataclass
class ProviderTurn:
    """One model call as its provider parsed it; providers subclass it to keep what they need."""

    chat: ChatRequest
    response_id: str
    session_id: str


class StreamWriter(Protocol):
    def start(self) -> bytes: ...

    def events(self, events: list[ParseEvent]) -> bytes: ...

    def finish(self, completion: Completion, reply: AssistantReply) -> tuple[bytes, str]:
        """The closing events up to (not including) the final one, and the finish reason
        recorded for the turn. The turn is made durable before :meth:`end` is sent."""
        ...

    def end(self) -> bytes: ...

    def error(self, message: str) -> bytes: ...


@dataclass(frozen=True)
class ProviderOption:
    """A mitmproxy option a provider owns (``--set name=value``)."""

    name: str
    type: type
    default: Any
    help: str


class Provider[T: ProviderTurn](ABC):
    name: ClassVar[str]
    hosts: ClassVar[tuple[str, ...]] = ()
    options: ClassVar[tuple[ProviderOption, ...]] = ()
    session_headers: ClassVar[Mapping[str, str]] = {}
    # For the 404 of an unknown path on an owned host: what this provider does answer.
    served: ClassVar[str] = ""

    def __init__(self, options: Mapping[str, Any] | None = None) -> None:
        values = {o.name: o.default for o in self.options}
        values.update({k: v for k, v in (options or {}).items() if k in values})
        self.check_options(values)
        self.option_values = values

    @classmethod
    def check_options(cls, values: Mapping[str, Any]) -> None:
        """Raise ValueError, worded for the user, when an option value is unusable."""
        return None

    def owns(self, call: Call) -> bool:
        return self.owns_host(call.host)

    def owns_host(self, host: str) -> bool:
        """``host`` is one of ``hosts`` or a subdomain of one."""
        return any(host == h or host.endswith("." + h) for h in self.hosts)

    @abstractmethod
    def match(self, call: Call) -> Route | None: ...

    @abstractmethod
    def parse(self, call: Call, body: bytes, session_id: str) -> T: ...

    @abstractmethod
    def error(self, status: int, message: str, param: str | None = None) -> web.Response: ...

    def prompt_too_long(self, prompt_tokens: int, max_model_len: int) -> web.Response:
        """A prompt over the policy's context: a 400 in the provider's words."""
        return self.error(400, self.prompt_too_long_message(prompt_tokens, max_model_len))

    # A session past its limit (capture/control/sessions.py): an answer its clients take as
    # final. A 400 is never retried by the SDKs, Claude Code, Codex or Gemini CLI, and
    # ``x-should-retry: false`` says so to the Stainless SDKs in any case.
    session_ended_status: ClassVar[int] = 400

    def session_ended(self, reason: str, message: str) -> web.Response:
        """The call of a session that reached ``reason`` (max_calls, max_tokens, deadline,
        closed): the provider's error, final."""
        resp = self.error(self.session_ended_status, message)
        resp.headers["x-should-retry"] = "false"
        return resp

    def prompt_too_long_message(self, prompt_tokens: int, max_model_len: int) -> str:
        return f"prompt is too long: {prompt_tokens} tokens > {max_model_len} maximum"

    # The policy's faults in each provider's own statuses and words: ``unavailable`` is what its
    # clients back off and retry on (Anthropic's 529 overloaded, 503 elsewhere).
    unavailable_status: ClassVar[int] = 503
    unavailable_message: ClassVar[str] = "the policy server is unavailable: {exc}"
    failed_status: ClassVar[int] = 502
    failed_message: ClassVar[str] = "{exc}"

    def policy_error(self, exc: PolicyError) -> web.Response:
        """The policy refused (400), is unavailable, or failed: the provider's error."""
        if exc.status == 400:
            return self.error(400, str(exc))
        if exc.unavailable:
            return self.error(self.unavailable_status, self.unavailable_message.format(exc=exc))
        return self.error(self.failed_status, self.failed_message.format(exc=exc))

    @abstractmethod
    def response(
        self, turn: T, prompt_tokens: int, completion: Completion, reply: AssistantReply
    ) -> tuple[dict[str, Any], str]:
        """The whole answer's JSON body and the finish reason recorded for the turn."""

    @abstractmethod
    def stream_writer(self, turn: T, prompt_tokens: int) -> StreamWriter: ...

    def recorded_reply(self, turn: T, reply: AssistantReply) -> Message:
        """The reply as the client will send it back (its tool-call ids), for the thread."""
        return reply.as_message()

    def finished(self, turn: T, reply: AssistantReply, completion: Completion) -> None:
        """Called once the turn is durable; providers with per-session state update it here."""
        return None

    @abstractmethod
    def models_body(self, names: list[str], model_id: str) -> dict[str, Any]:
        """The model listing (``model_id`` empty) or one model's object."""

    def count_tokens(self, call: Call, body: bytes, session_id: str) -> ChatRequest:
        raise NotImplementedError(f"{self.name} has no token-count route")

    def count_tokens_body(self, tokens: int) -> dict[str, Any]:
        raise NotImplementedError(f"{self.name} has no token-count route")

    async def serve_websocket(
        self, request: web.Request, call: Call, runner: TurnRunner
    ) -> web.StreamResponse:
        return self.error(426, f"{self.name} does not serve WebSocket calls; use HTTP.")


class TurnRunner(Protocol):
    """What the gateway lends a provider that drives turns itself (a WebSocket session)."""

    @property
    def max_body_bytes(self) -> int:
        """The largest request body (so: WebSocket message) the proxy reads."""
        ...

    def session_id(self, request: web.Request, provider: Provider[Any]) -> str:
        """The session a request belongs to (proxy username, else the client's header)."""
        ...

    async def run_turn(
        self,
        provider: Provider[Any],
        turn: ProviderTurn,
        send: Callable[[bytes], Awaitable[None]],
        user_agent: str = "",
    ) -> web.Response | None:
        """Run one parsed turn streamed through ``send``; an error response if it was refused
        before any event was sent, else None."""
        ...


# -- registry --------------------------------------------------------------------------------

_REGISTRY: dict[str, type[Provider[Any]]] = {}


def register[P: type[Provider[Any]]](cls: P) -> P:
    """Class decorator: make a provider known to the gateway and the addon by its ``name``."""
    if not re.fullmatch(r"[a-z0-9_.-]+", cls.name):
        raise ValueError(f"provider name {cls.name!r} must be lowercase [a-z0-9_.-]")
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ValueError(f"two providers are named {cls.name!r}")
    _REGISTRY[cls.name] = cls
    return cls


def registered() -> dict[str, type[Provider[Any]]]:
    """Every provider by name, in registration order (the package imports the built-in ones)."""
    return dict(_REGISTRY)


def all_options() -> list[ProviderOption]:
    return [o for cls in _REGISTRY.values() for o in cls.options]
