"""The providers a gateway serves: which one answers a call (its route, the owners of its host),
and the checked ``TurnRunner`` a provider's WebSocket session drives."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from aiohttp import web

from capture.control.bindings import binding_refusal
from capture.control.sessions import SessionControl
from rewriter.providers import registered
from rewriter.providers.base import Call, Provider, ProviderTurn, Route, TurnRunner

# Answers calls on hosts no provider owns (its error format, its 404).
DEFAULT_PROVIDER = "openai.chat"


class ProviderRouter:
    """The registry's providers a gateway was configured with, and which of them answers a call."""

    def __init__(self, names: list[str] | None, options: Mapping[str, Any]) -> None:
        """``names``: the providers to serve (None or empty: every registered one), each built
        with the providers' ``options``. Raises ValueError naming an unknown one."""
        available = registered()
        names = names or list(available)
        unknown = [n for n in names if n not in available]
        if unknown:
            raise ValueError(
                f"unknown provider(s) {', '.join(unknown)}; known: {', '.join(available)}"
            )
        self.providers: list[Provider[Any]] = [available[n](options) for n in names]
        self.default_provider = next(
            (p for p in self.providers if p.name == DEFAULT_PROVIDER), self.providers[0]
        )

    def route(self, call: Call) -> tuple[Provider[Any], Route | None]:
        """The provider that answers ``call`` and its route; the route is None when nobody
        serves it (the host's owner then answers 404 in its format)."""
        owners = self.owners(call)
        for provider in owners + [p for p in self.providers if p not in owners]:
            route = provider.match(call)
            if route is not None:
                return provider, route
        return (owners[0] if owners else self.default_provider), None

    def owners(self, call: Call) -> list[Provider[Any]]:
        """The providers that claim ``call``, the owners of its host first: a header may claim
        a call too (``anthropic-version``), but a Gemini host's 404 is Gemini's."""
        owners = [p for p in self.providers if p.owns(call)]
        return sorted(owners, key=lambda p: not p.owns_host(call.host))

    def served(self, call: Call) -> str:
        """What the owners of ``call`` serve, for the 404 of a call nobody serves."""
        owners = self.owners(call) or [self.default_provider]
        return "; ".join(p.served for p in owners)


class CheckedTurns:
    """The TurnRunner a WebSocket gets: each turn's session checked again with the secrets its
    connection gave. A socket opened under an id nobody had opened yet is refused the turns it
    sends once a trainer opened that id (they would be the opened session's otherwise)."""

    def __init__(
        self,
        runner: TurnRunner,
        control: SessionControl,
        required: bool,
        secrets_given: list[str],
        bound: str | None = None,
    ) -> None:
        """``runner``: the gateway, which runs a turn let through; ``required``: every call
        must carry an opened session's secret (agenttap_require_session_secret)."""
        self.runner = runner
        self.control = control
        self.required = required
        self.secrets_given = secrets_given
        # The session a rollout's bridge bound the socket's connection to.
        self.bound = bound

    @property
    def max_body_bytes(self) -> int:
        return self.runner.max_body_bytes

    def session_id(self, request: web.Request, provider: Provider[Any]) -> str:
        return self.runner.session_id(request, provider)

    async def run_turn(
        self,
        provider: Provider[Any],
        parsed: ProviderTurn,
        send: Callable[[bytes], Awaitable[None]],
        user_agent: str = "",
    ) -> web.Response | None:
        refused = binding_refusal(self.bound, parsed.session_id) or (
            self.control.credential_refusal(
                parsed.session_id, self.secrets_given, required=self.required
            )
        )
        if refused is not None:
            return provider.error(401, refused)
        return await self.runner.run_turn(provider, parsed, send, user_agent)
