"""The gateway: a loopback HTTP server that answers intercepted API calls from the policy.

mitmproxy cannot stream a body an addon builds itself, so the addon points each intercepted flow
at this server (running in mitmproxy's own event loop) and lets mitmproxy stream its answer back
to the client. Here the registry's providers (``rewriter/providers``; which one answers a call:
``capture/pipeline/providers.py``) say who answers a call, and the call is dispatched: a model
call to the turn pipeline (``capture/pipeline/turn.py``), a token count, a model list
(``capture/policy/pools.py``), a local answer or a WebSocket. This module holds the server's
lifecycle (start, the idle sweeper, stop, flush) and that routing; its listeners are set up by
``capture/listeners.py``, the API listener's base URLs and ``Host`` / ``Origin`` checks are
``capture/base_url.py``'s, request heads and bodies are read by ``capture/pipeline/bodies.py``,
sessions named by ``capture/pipeline/session_ids.py``, the headers the addon hands a call over
with are ``capture/pipeline/handoff.py``'s. Nothing here knows about mitmproxy or any one
provider.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path
from typing import Any

from aiohttp import web

from capture.base_url import refuse_foreign, serve_base_url
from capture.control.bindings import Bindings, binding_refusal
from capture.control.metrics import Metrics
from capture.control.sessions import SessionControl
from capture.gateway_config import GatewayConfig
from capture.listeners import advertised_host, app_runner, listen, url_host
from capture.logs.escape import printable
from capture.pipeline.bodies import (
    OVERSIZED_HEADER,
    BufferedRequest,
    NeedsLoopback,
    oversized_head_message,
)
from capture.pipeline.handoff import (
    BEARER_HEADER,
    BOUND_HEADER,
    CONTROL_HOST,
    HOST_HEADER,
    TOKEN_HEADER,
)
from capture.pipeline.providers import CheckedTurns, ProviderRouter
from capture.pipeline.session_ids import (
    SESSION_SECRET_HEADER,
    request_session_id,
    unquote_session,
)
from capture.pipeline.turn import TurnPipeline
from capture.policy.pools import PolicyPools
from capture.ports import ControlPlane
from capture.storage.sessions import RowAnnotations, SessionStore
from capture.storage.take_back import take_back_rewards
from capture.storage.unverified import WEIGHTS_UNVERIFIED_FILE
from rewriter.providers.base import (
    Call,
    IncomingRequest,
    Provider,
    ProviderTurn,
    Route,
    RouteKind,
)
from rewriter.template import ChatTemplate
from rewriter.vllm_client import PolicyError

logger = logging.getLogger(__name__)

# Seconds between status lines in the log (only while calls come).
STATUS_EVERY_S = 10.0


class Gateway:
    """The loopback server; also the ``TurnRunner`` a provider's WebSocket session drives."""

    def __init__(
        self,
        config: GatewayConfig,
        template: ChatTemplate | None = None,
        control_plane: Callable[[Gateway, str], ControlPlane] | None = None,
    ) -> None:
        """``control_plane``: builds the control API at start, given this gateway and the
        URL clients reach it at (the addon registers ``capture.control.api.build``); None:
        calls are answered, and the control routes get a 503."""
        self.config = config
        self._control_plane = control_plane
        self.template = template or ChatTemplate(config.tokenizer_path)
        self.store = SessionStore(
            config.out_dir,
            self.template,
            config.idle_timeout_s,
            recompute=config.recompute_logprobs,
        )
        # The secret only the addon sends (its calls to the internal listener).
        self.token = secrets.token_hex(16)
        self.port = 0
        # The control API's token (printed at start) and its listener's port.
        self.api_token = config.token or secrets.token_urlsafe(24)
        self.api_port = 0
        self.control = SessionControl()
        # Sessions whose agent may tunnel to public hosts (capture/egress.py); rollouts set it.
        self.egress_public: set[str] = set()
        # The connections rollouts' bridges relay, each bound to its run's session.
        self.bindings = Bindings()
        self.metrics = Metrics()
        # Every session counts, opened through the API or first seen on a call (proxy mode).
        self.control.on_new = lambda _sid: self.metrics.sessions_opened.inc()
        self.metrics.watch(self._live_counts)
        self.store.annotations_for = self._annotations
        self.policies = PolicyPools(
            config.policy_urls,
            config.model_map,
            config.model_names,
            timeout_s=config.policy_timeout_s,
            flush_interval_s=config.stream_flush_s,
            max_connections=config.policy_max_connections,
            max_in_flight=config.replica_max_inflight,
            max_queue=config.replica_queue,
            session_max_in_flight=config.session_max_inflight,
            health_interval_s=config.health_interval_s,
            weights_tolerance=config.weights_tolerance,
            weights_check_s=config.weights_check_s,
        )
        # agenttap_max_staleness counts in the policy's weight updates.
        self.control.max_staleness = config.max_staleness
        self.control.version_index = lambda: self.policies.weights.history.index
        self.pipeline = TurnPipeline(
            self.template,
            self.store,
            self.policies,
            tool_parser=config.tool_parser,
            reasoning_parser=config.reasoning_parser,
            recompute_logprobs=config.recompute_logprobs,
            max_body_bytes=config.max_body_bytes,
            control=self.control,
            metrics=self.metrics,
            fsync_before_reply=config.fsync_before_reply,
        )
        self.api: ControlPlane | None = None
        # Which of the registry's providers answers a call (capture/pipeline/providers.py).
        self.router = ProviderRouter(config.providers, config.provider_options)
        self.providers: list[Provider[Any]] = self.router.providers
        self._runner: web.AppRunner | None = None
        self._api_runner: web.AppRunner | None = None
        self._sweeper: asyncio.Task[None] | None = None

    def _live_counts(self) -> dict[str, float]:
        """The gauges read when /metrics is scraped."""
        live = self.control.live()
        sessions = set(self.store.session_ids()) | {s.id for s in live if s.opened}
        return {
            "agenttap_sessions_live": len(sessions),
            "agenttap_calls_in_flight": sum(s.in_flight for s in live),
            "agenttap_calls_queued": self.policies.queued(),
            "agenttap_rollout_agents_running": (
                self.api.running_agents() if self.api is not None else 0
            ),
        }

    def _annotations(self, session_id: str) -> RowAnnotations | None:
        """A trainer's metadata for the session's rows, whenever they are written."""
        sess = self.control.get(session_id)
        if sess is None or not sess.metadata:
            return None
        return RowAnnotations(metadata=sess.metadata)

    # -- lifecycle -------------------------------------------------------------------------
    async def start(self) -> int:
        await self.pipeline.warm_up()
        recovered = self.store.recover()
        if recovered:
            logger.info("recovered turns of an earlier run into %d shard(s)", len(recovered))
        self.policies.open(partial(self.template.decode, skip_special_tokens=True))
        self.policies.on_health = self._note_health
        self.policies.on_weights_changed = self._note_weights_changed
        self.policies.start_health_checks()
        # We enforce the body limit ourselves so the client gets its provider's error format.
        self._runner = await app_runner(self._dispatch, self.config.max_body_bytes)
        self.port = await listen(self._runner, "127.0.0.1", 0)
        config = self.config
        if config.api_host is not None:
            self._api_runner = await app_runner(self._public, config.max_body_bytes)
            self.api_port = await listen(self._api_runner, config.api_host, config.api_port)
            host = advertised_host(config.api_host, config.advertise_host)
            api_url = f"http://{url_host(host)}:{self.api_port}"
        else:
            api_url = f"http://{CONTROL_HOST}"
        if self._control_plane is not None:
            self.api = self._control_plane(self, api_url)
        self._sweeper = asyncio.get_running_loop().create_task(self._sweep())
        return self.port

    async def stop(self) -> None:
        if self._sweeper:
            self._sweeper.cancel()
        if self.api is not None:
            # Agents never outlive the proxy: their process groups end, their rows are kept.
            await self.api.shutdown()
        for runner in (self._api_runner, self._runner):
            if runner:
                await runner.cleanup()
        await self.policies.close()
        # Assemblies still running in the workers finish before the sessions are written.
        await self.pipeline.shutdown()
        self.store.close()

    def _note_health(self, url: str, healthy: bool) -> None:
        self.metrics.policy_up.labels(url).set(1 if healthy else 0)
        replica = self.policies.replica(url)
        if replica is not None:
            self.metrics.weights_unverified.labels(url).set(1 if replica.unverified else 0)

    def _note_weights_changed(
        self, url: str, diff: float, window: tuple[str, float, float, str]
    ) -> None:
        """A replica served weights nobody pushed: counted, and the window written to
        ``OUT/weights_unverified.jsonl`` (one line per window: backend, since, found, reason,
        max_diff), so that the rows a backend sampled in it can be marked weights_unverified
        (a turn's ``backend`` and its time inside the window)."""
        self.metrics.weights_changed.labels(url).inc()
        self.metrics.weights_unverified.labels(url).set(1)
        backend, since, found, reason = window
        line = {"backend": backend, "since": since, "found": found, "reason": reason}
        line["max_diff"] = diff
        try:
            with open(self.config.out_dir / WEIGHTS_UNVERIFIED_FILE, "a") as out:
                out.write(json.dumps(line) + "\n")
        except OSError as exc:
            logger.error("agenttap: could not record the unverified window (%s): %s", line, exc)

    async def flush(self, session_id: str | None = None) -> list[Path]:
        """Write a session's shards now (all sessions: None). The session may go on: its next
        call extends the written rows' exact ids, in a new row parented to them."""
        store = self.store
        sessions = [session_id] if session_id is not None else store.session_ids()
        written = []
        for sid in sessions:
            # Not while a worker thread is placing a call in that session's tree.
            async with self.pipeline.session_lock(sid):
                written += store.flush(sid)
        return written

    def take_back_rewards(self, session_id: str, since: float) -> list[dict[str, Any]]:
        """The rewards of ``session_id``'s rows written since ``since`` taken back (a rollout's
        session someone else closed: capture/storage/sessions.py); blocking, a file rewrite."""
        return take_back_rewards(self.config.out_dir, session_id, since)

    async def _sweep(self) -> None:
        last_status = 0.0
        # As at start: no status line until a call has come (none while idle).
        last_totals: dict[str, int] = dict(self.pipeline.totals)
        while True:
            await asyncio.sleep(
                min(self.config.sweep_interval_s, max(0.2, self.config.idle_timeout_s / 2))
            )
            try:
                self.store.flush_idle(skip=self.pipeline.busy_sessions())
                self.control.prune(set(self.store.session_ids()))
            except Exception:  # a full disk must not kill the sweeper; the journal still holds it
                logger.exception("could not write the shard of an idle session")
            now = time.monotonic()
            totals = dict(self.pipeline.totals)
            if now - last_status >= STATUS_EVERY_S and totals != last_totals:
                # One line every few seconds while calls come, none while idle.
                logger.info("%s", self.status_line(totals, last_totals))
                last_status, last_totals = now, totals

    def status_line(self, totals: dict[str, int], before: dict[str, int]) -> str:
        live = self._live_counts()
        new = totals["calls"] - before.get("calls", 0)
        return (
            f"agenttap status: {live['agenttap_sessions_live']:.0f} session(s) live, "
            f"{live['agenttap_calls_in_flight']:.0f} call(s) in flight, {totals['calls']} calls "
            f"(+{new}), {totals['completion_tokens']} tokens sampled, {totals['errors']} policy "
            f"error(s), {totals['refused']} refused by limits"
        )

    # -- TurnRunner, for a provider's WebSocket sessions ---------------------------------------
    @property
    def max_body_bytes(self) -> int:
        return self.config.max_body_bytes

    def session_id(self, request: IncomingRequest, provider: Provider[Any]) -> str:
        return request_session_id(request, provider)

    async def run_turn(
        self,
        provider: Provider[Any],
        parsed: ProviderTurn,
        send: Callable[[bytes], Awaitable[None]],
        user_agent: str = "",
    ) -> web.Response | None:
        """A parsed turn streamed through ``send`` (a provider's WebSocket); see TurnRunner."""
        return await self.pipeline.run_turn(provider, parsed, send, user_agent)

    # -- dispatch --------------------------------------------------------------------------
    def _route(self, call: Call) -> tuple[Provider[Any], Route | None]:
        """The provider that answers ``call`` and its route (None: nobody serves it)."""
        return self.router.route(call)

    def _served(self, call: Call) -> str:
        return self.router.served(call)

    async def answer_buffered(self, request: BufferedRequest) -> web.Response:
        """A call the addon routed here whose body mitmproxy holds whole, answered in this
        event loop without the loopback connection: no HTTP framing and parsing on either of
        its ends, and no connection for mitmproxy to manage (about a fifth more whole calls
        per second in bench/overhead.py). Raises NeedsLoopback, before anything is counted
        or recorded, for what must stream."""
        answer = await self._dispatch(request)
        if not isinstance(answer, web.Response):  # a stream would have been handed back
            raise TypeError(f"a buffered call got a {type(answer).__name__}")
        return answer

    async def _dispatch(self, request: IncomingRequest) -> web.StreamResponse:
        """A call the addon routed here (proxy mode), or a control call via agenttap.local."""
        given = request.headers.get(TOKEN_HEADER, "")
        if not secrets.compare_digest(given.encode(), self.token.encode()):
            return web.Response(status=403, text="agenttap gateway: only the proxy may call this")
        host = request.headers.get(HOST_HEADER, "")
        if not isinstance(request, web.Request) and (
            host == CONTROL_HOST or request.headers.get("Upgrade", "").lower() == "websocket"
        ):
            raise NeedsLoopback("a control call or a WebSocket")
        if host == CONTROL_HOST:
            assert isinstance(request, web.Request)
            if self.api is None:
                return self._no_control_plane()
            return await self.api.handle(request, bearer=request.headers.get(BEARER_HEADER, ""))
        secret = unquote_session(request.headers.get(SESSION_SECRET_HEADER, ""))
        bound = request.headers.get(BOUND_HEADER)
        return await self._answer(
            request, host, [secret], unquote_session(bound) if bound is not None else None
        )

    async def _public(self, request: web.Request) -> web.StreamResponse:
        """The API listener: per-session base URLs (/sess/<id>/...) and the control API."""
        if self.api is None:
            return self._no_control_plane()
        refused = refuse_foreign(request, self.config, self.api.api_url)
        if refused is not None:
            return refused
        if request.path.startswith("/sess/"):
            transport = request.transport
            if transport is None:  # gone: whether it came through a bridge is not known
                message = "agenttap: the connection closed before its call was read"
                return web.json_response({"error": {"message": message}}, status=400)
            bound = self.bindings.session_for(
                transport.get_extra_info("peername"), transport.get_extra_info("sockname")
            )
            return await serve_base_url(
                request,
                self.control,
                self.pipeline,
                self.config.require_session_secret,
                self._answer,
                bound,
            )
        return await self.api.handle(request)

    @staticmethod
    def _no_control_plane() -> web.Response:
        return web.json_response(
            {"error": {"message": "agenttap: this gateway serves no control API", "status": 503}},
            status=503,
        )

    async def _answer(
        self,
        request: IncomingRequest,
        host: str,
        secrets_given: list[str],
        bound: str | None = None,
    ) -> web.StreamResponse:
        """``bound``: the session a rollout's bridge bound the client's connection to."""
        call = Call.of(request, host)
        provider, route = self._route(call)
        # Before anything of the session is read or counted: a caller without its secret, or
        # a sandbox naming a session not its own, touches nothing of it.
        session_id = self.session_id(request, provider)
        refused = binding_refusal(bound, session_id) or self.control.credential_refusal(
            session_id, secrets_given, required=self.config.require_session_secret
        )
        if refused is not None:
            return provider.error(401, refused)
        oversized = request.headers.get(OVERSIZED_HEADER)
        if oversized:
            return provider.error(431, oversized_head_message(oversized))
        if route is None:
            return provider.error(
                404,
                f"agenttap: {call.method} {call.path} on {call.host} is not served by this "
                f"proxy. It answers {self._served(call)} from the policy.",
            )
        try:
            return await self._serve(request, call, provider, route, secrets_given, bound)
        except (web.HTTPException, NeedsLoopback):
            raise
        except Exception:
            # A defect of ours, never the client's: answer in its provider's format, keep the
            # traceback for the operator (the path, the client's, kept on its line).
            logger.exception("agenttap: internal error on %s %s", call.method, printable(call.path))
            return provider.error(
                500, "agenttap: internal error in the proxy; its log has the details."
            )

    async def _serve(
        self,
        request: IncomingRequest,
        call: Call,
        provider: Provider[Any],
        route: Route,
        secrets_given: list[str],
        bound: str | None = None,
    ) -> web.StreamResponse:
        if route.kind is RouteKind.TURN:
            return await self.pipeline.serve_http(request, call, provider)
        if route.kind is RouteKind.COUNT_TOKENS:
            return await self.pipeline.count_tokens(request, call, provider)
        if route.kind is RouteKind.MODELS:
            return await self._models(provider, route.model_id, self.session_id(request, provider))
        if route.kind is RouteKind.LOCAL:
            return web.json_response(route.body)
        if route.kind is RouteKind.WEBSOCKET:
            if not isinstance(request, web.Request):
                raise NeedsLoopback("a WebSocket")
            return await provider.serve_websocket(
                request,
                call,
                CheckedTurns(
                    self, self.control, self.config.require_session_secret, secrets_given, bound
                ),
            )
        return provider.error(route.status, route.message)

    async def _models(
        self, provider: Provider[Any], model_id: str, session_id: str = ""
    ) -> web.Response:
        try:
            info = await self.policies.pool_for("*")[0].info()
        except PolicyError as exc:
            return provider.policy_error(exc)
        names = [model_id] if model_id else self.policies.model_names(info.model, session_id)
        return web.json_response(provider.models_body(names, model_id))
