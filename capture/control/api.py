"""The control API a trainer drives agenttap with, over HTTP.

Served on the API listener (``agenttap_api_host``:``agenttap_api_port``, beside the
per-session base URLs) and at ``http://agenttap.local`` through the proxy. Every route but
``/healthz`` and ``/ready`` wants ``Authorization: Bearer TOKEN`` (the token printed at start as
``AGENTTAP_TOKEN=...``). Routes (names kept: other tools are written against them):

- ``POST /sessions`` ``{"id"?, "metadata"?, "limits"?: {"max_calls", "max_tokens", "deadline_s"}}``
  -> ``{"id", "env", "base_urls"}``
- ``POST /sessions/{id}/close`` ``{"reward"?: number | {thread_id: number},
  "reward_auxiliary"?: bool}`` -> the session's thread rows (JSON, or an Arrow IPC stream for
  ``Accept: application/vnd.apache.arrow.stream``) with reward (one number: on main and subagent
  rows, on auxiliary rows too with ``reward_auxiliary``), metadata, ``end_reason``, ``metrics``
- ``POST /sessions/{id}/reward`` ``{"reward"}``: a late reward, after close

Opening an id claims it: calls naming it need its secret from then on, and the rows of calls
made under it before (a proxy username or base URL nobody had opened) stay apart, as session
``ID~unopened-HEX`` (capture/control/sessions.py ``open``, SessionStore.detach). Rows say where
their reward came from (``reward_source``): ``close`` (this close), ``verifier`` (a rollout's),
``late`` (``/reward``).
- ``GET /sessions``, ``GET /sessions/{id}``, ``GET /healthz``, ``GET /ready``,
  ``GET /openapi.json``, ``POST /flush[?session=ID]``

The session bookkeeping is ``capture/control/sessions.py``; the rows come from the store and
are answered by ``capture/control/answers.py``; ``/replicas`` is
``capture/control/replica_routes.py``; ``/policy/weights`` and ``/policy/version`` are
``capture/control/policy_routes.py``.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from pathlib import Path
from typing import Any

from aiohttp import web

from capture.control.answers import error, read_rows, rows_response, unmatched_threads
from capture.control.bindings import Bindings
from capture.control.endpoints import DUMMY_KEYS, Endpoints
from capture.control.metrics import CONTENT_TYPE as METRICS_TYPE
from capture.control.models import read_session
from capture.control.openapi import openapi_spec
from capture.control.policy_routes import PolicyRoutes
from capture.control.readiness import readiness
from capture.control.replica_routes import ReplicaRoutes
from capture.control.routing import Route, RouteTable, token_refusal
from capture.control.sessions import ControlledSession, Limits, reject_unknown
from capture.logs.escape import printable
from capture.ports import GatewayConfig, GatewayCore
from capture.rollouts.routes import RolloutRoutes
from capture.storage.advantages import (
    parse_advantage,
    parse_step,
    parse_step_s,
    write_advantage,
)
from capture.storage.rewards import join_rewards, load_rewards, parse_reward, write_rewards
from capture.storage.sessions import RowAnnotations
from capture.storage.shards import REWARD_CLOSE
from capture.viewer.http import UI_PREFIX, ViewerRoutes, live_viewer
from rewriter import jsonbody

logger = logging.getLogger(__name__)


def banner_lines(api: ControlAPI) -> list[str]:
    """What agenttap prints at start: the lines a trainer, the launcher or a person copies
    (``AGENTTAP_*=`` lines are parsed by tools: keep them as they are)."""
    ends = api.endpoints
    urls = ends.base_urls("SESSION")
    return [
        f"AGENTTAP_PROXY={ends.proxy_url}",
        f"AGENTTAP_API={ends.api_url}",
        f"AGENTTAP_TOKEN={api.token}",
        f"AGENTTAP_CA={ends.ca_path}",
        f"AGENTTAP_CA_BUNDLE={ends.bundle_path}",
        f"AGENTTAP_UI={ends.api_url}/ui/#token={api.token}",
        f"Proxy mode: HTTPS_PROXY={ends.env('SESSION').get('HTTPS_PROXY', '')} "
        f"SSL_CERT_FILE={ends.ca_path} NODE_EXTRA_CA_CERTS={ends.ca_path}",
        "API keys: any value works (none reaches a provider); clients insist on one: "
        + " ".join(f"{name}={value}" for name, value in DUMMY_KEYS.items()),
        "Base-URL mode (SESSION: any name you pick):",
        f"  OPENAI_BASE_URL={urls['openai']}",
        f"  ANTHROPIC_BASE_URL={urls['anthropic']}",
        f"  GOOGLE_GEMINI_BASE_URL={urls['gemini']}",
    ]


class ControlAPI:
    def __init__(
        self, gateway: GatewayCore, token: str, endpoints: Endpoints, max_rollouts: int = 8
    ) -> None:
        self.gateway = gateway
        self.token = token
        self.endpoints = endpoints
        self.started_at = time.time()
        self.rollouts = RolloutRoutes(self, max_rollouts)
        self.replicas = ReplicaRoutes(gateway, self.body)
        self.policy = PolicyRoutes(gateway, self.body)
        self.viewer = live_viewer(gateway)
        self.routes = self._routes()
        # Opening an id takes it from calls made before (capture/control/sessions.py open).
        control, store = gateway.control, gateway.store
        control.on_claim = self._claim
        store.claimed_at = control.claimed_at
        store.on_dropped = control.note_dropped

    def _claim(self, sid: str, apart: str) -> None:
        """What the store holds of ``sid`` from calls before its opening goes under ``apart``
        (written later when a worker thread is placing a call in its tree now)."""
        busy = sid in self.gateway.pipeline.busy_sessions()
        self.gateway.store.detach(sid, apart, write=not busy)

    @property
    def out_dir(self) -> Path:
        return self.gateway.config.out_dir

    # -- what rollouts ask of the proxy (capture.ports.RolloutHost) ------------------------------
    @property
    def settings(self) -> GatewayConfig:
        return self.gateway.config

    @property
    def bindings(self) -> Bindings:
        return self.gateway.bindings

    def open_session(self, sid: str, metadata: dict[str, Any], limits: Limits) -> ControlledSession:
        return self.gateway.control.open(sid, metadata, limits)

    def session(self, sid: str) -> ControlledSession | None:
        return self.gateway.control.get(sid)

    def is_live(self, sid: str) -> bool:
        return self.gateway.control.is_live(sid)

    def allow_egress(self, sid: str, public: bool) -> None:
        if public:
            self.gateway.egress_public.add(sid)
        else:
            self.gateway.egress_public.discard(sid)

    def take_back_rewards(self, sid: str, since: float) -> list[dict[str, Any]]:
        return self.gateway.take_back_rewards(sid, since)

    # -- what the gateway asks of its control plane (capture.ports.ControlPlane) ----------------
    @property
    def api_url(self) -> str:
        return self.endpoints.api_url

    def running_agents(self) -> int:
        return self.rollouts.rollouts.running_agents()

    async def shutdown(self) -> None:
        """Agents never outlive the proxy: their sandboxes end, their rows are kept."""
        await self.rollouts.rollouts.shutdown()

    # -- dispatch ------------------------------------------------------------------------------
    def _routes(self) -> RouteTable:
        """The control routes (docs/API.md's table, capture/control/openapi.py ``OPERATIONS``:
        a test checks the three agree)."""
        rollouts, replicas, policy = self.rollouts, self.replicas, self.policy
        return RouteTable(
            [
                Route("GET", "/healthz", self._healthz, "open"),
                Route("GET", "/ready", self._ready, "detail"),
                Route("GET", "/openapi.json", self._openapi),
                Route("POST", "/flush", self._flush),
                Route("GET", "/metrics", self._metrics),
                Route("GET", "/sessions", self._list),
                Route("POST", "/sessions", self._open),
                Route("GET", "/sessions/{id}", self._get),
                Route("POST", "/sessions/{id}/close", self._close),
                Route("POST", "/sessions/{id}/reward", self._reward),
                Route("POST", "/sessions/{id}/advantage", self._advantage),
                Route("GET", "/rollouts", rollouts.list),
                Route("POST", "/rollouts", rollouts.create),
                Route("GET", "/rollouts/{id}", rollouts.get),
                Route("DELETE", "/rollouts/{id}", rollouts.delete),
                Route("GET", "/replicas", replicas.list),
                Route("POST", "/replicas", replicas.add),
                Route("DELETE", "/replicas", replicas.remove),
                Route("POST", "/policy/weights", policy.weights),
                Route("GET", "/policy/version", policy.get_version),
                Route("POST", "/policy/version", policy.set_version),
            ]
        )

    async def handle(self, request: web.Request, bearer: str | None = None) -> web.StreamResponse:
        """Answer a control route; every one but the open ones wants the token, wherever the
        caller is. ``bearer``: through the proxy, the addon checked the token already ("ok",
        "wrong", "" for none); None: check the request's own ``Authorization`` header."""
        path = request.path.rstrip("/") or "/"
        method = request.method
        if path == UI_PREFIX or path.startswith(f"{UI_PREFIX}/"):
            # The page itself holds no data (it asks for the token); its data routes want it.
            if not ViewerRoutes.is_page(request.path):
                refused = token_refusal(request, self.token, bearer)
                if refused is not None:
                    return refused
            return await self.viewer.handle(request)
        access = self.routes.access(path)
        refused = None if access == "open" else token_refusal(request, self.token, bearer)
        if access == "token" and refused is not None:
            return refused
        found = await self.routes.resolve(request, path)
        if isinstance(found, int):
            return error(
                found,
                f"agenttap: no route {method} {path}. The control API serves POST /sessions, "
                f"POST /sessions/ID/close, POST /sessions/ID/reward, POST /sessions/ID/advantage, "
                f"GET /sessions, "
                f"GET /sessions/ID, POST /rollouts, GET /rollouts[/ID], DELETE /rollouts/ID, "
                f"GET /replicas, POST /replicas, DELETE /replicas?url=URL, POST /policy/weights, "
                f"GET /policy/version, POST /policy/version, "
                f"GET /healthz, GET /ready, GET /metrics, GET /openapi.json, POST /flush, and the "
                f"viewer at GET /ui/.",
            )
        route, args = found
        if access == "detail":
            # Open to anyone (a load balancer's probe): readiness only without the token; the
            # servers' URLs (a unix socket's private path), the model and the reasons with it.
            return await route.handler(request, refused is None)
        try:
            return await route.handler(request, *args)
        except ValueError as exc:
            return error(400, f"agenttap: {exc}")

    # -- routes ------------------------------------------------------------------------------
    async def _healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    async def _ready(self, request: web.Request, detail: bool = False) -> web.Response:
        return await readiness(self.gateway, detail)

    async def _metrics(self, request: web.Request) -> web.Response:
        """Prometheus exposition (capture/control/metrics.py); the token as everywhere else
        (Prometheus: ``authorization: {credentials: TOKEN}`` in the scrape config)."""
        return web.Response(
            body=self.gateway.metrics.exposition(), headers={"Content-Type": METRICS_TYPE}
        )

    async def _openapi(self, request: web.Request) -> web.Response:
        return web.json_response(openapi_spec(self.endpoints.api_url))

    async def _flush(self, request: web.Request) -> web.Response:
        session = request.query.get("session")
        if (
            session is not None
            and not self.gateway.store.knows(session)
            and self.gateway.control.get(session) is None
        ):
            return error(
                404,
                f"agenttap: no session {session!r} to flush: this proxy has seen no call of it. "
                f"GET /sessions lists the live ones; POST /flush without ?session= writes all.",
            )
        written = await self.gateway.flush(session)
        logger.info(
            "agenttap: flushed %s: %d shard file(s)", printable(session or "all"), len(written)
        )
        return web.json_response({"written": [str(p) for p in written]})

    async def body(self, request: web.Request) -> dict[str, Any]:
        raw = await request.read()
        if not raw.strip():
            return {}
        try:
            body = jsonbody.loads(raw)
        except ValueError as exc:
            raise ValueError(f"the body is not JSON: {exc}") from None
        if not isinstance(body, dict):
            raise ValueError("the body must be a JSON object")
        return body

    async def _open(self, request: web.Request) -> web.Response:
        opened = read_session(await self.body(request))
        sid = opened.id if opened.id is not None else _new_id()
        metadata, limits = opened.metadata, opened.session_limits()
        try:
            sess = self.gateway.control.open(sid, metadata, limits)
        except ValueError as exc:
            return error(409, f"agenttap: {exc}")
        logger.info("agenttap: session %r opened (%s)", sid, json.dumps(metadata)[:200])
        return web.json_response(
            {
                "id": sess.id,
                # The session's secret is in both: the proxy password and every API key.
                "env": self.endpoints.env(sid, sess.secret),
                "base_urls": self.endpoints.base_urls(sid),
                "api_key": sess.secret,
                "limits": sess.summary()["limits"],
            }
        )

    async def _list(self, request: web.Request) -> web.Response:
        policies = self.gateway.policies
        return web.json_response(
            {
                "sessions": [
                    s.summary()
                    | {"backend": policies.backend_of(s.id)}
                    | policies.queue_state(s.id)
                    for s in self.gateway.control.live()
                ]
            }
        )

    def _known(self, sid: str) -> ControlledSession:
        sess = self.gateway.control.get(sid)
        if sess is None:
            raise KeyError(sid)
        return sess

    def _unknown(self, sid: str) -> web.Response:
        return error(
            404,
            f"agenttap: no session {sid!r}: this proxy has seen no call of it since it started, "
            f"nor was it opened (POST /sessions). GET /sessions lists the live ones; rows of "
            f"earlier runs are in OUT/threads (capture.storage.reader.load_threads).",
        )

    async def _get(self, request: web.Request, sid: str) -> web.StreamResponse:
        try:
            sess = self._known(sid)
        except KeyError:
            return self._unknown(sid)
        async with self.gateway.pipeline.session_lock(sid):
            pending = self.gateway.store.pending_rows(sid)
        shards = sess.thread_shards if sess.closed else self.gateway.store.written_threads(sid)
        rows = read_rows(shards, sid) + pending
        rows = join_rewards(rows, load_rewards(self.out_dir))
        return rows_response(request, sess, rows, shards=shards)

    async def _close(self, request: web.Request, sid: str) -> web.StreamResponse:
        body = await self.body(request)
        reject_unknown(body, ("reward", "reward_auxiliary"))
        reward = parse_reward(body["reward"]) if body.get("reward") is not None else None
        reward_auxiliary = body.get("reward_auxiliary", False)
        if not isinstance(reward_auxiliary, bool):
            raise ValueError(
                '"reward_auxiliary" must be true or false (true: one reward for the session is '
                "set on its auxiliary rows too: titles, routers, summaries)"
            )
        control = self.gateway.control
        if control.get(sid) is None or not control.is_live(sid):
            if control.get(sid) is not None:
                return error(409, f"agenttap: session {sid!r} is closed already")
            return self._unknown(sid)
        if isinstance(reward, dict):
            # Checked before anything is closed: a reward for a thread the session does not
            # have would be lost without a word (and its rows left unrewarded).
            async with self.gateway.pipeline.session_lock(sid):
                pending = self.gateway.store.pending_rows(sid)
            known = {r["thread_id"] for r in pending}
            known |= {
                r["thread_id"] for r in read_rows(self.gateway.store.written_threads(sid), sid)
            }
            unknown = sorted(k for k in reward if k not in known)
            if unknown:
                raise ValueError(
                    f"the reward names thread(s) session {sid!r} has no row of: "
                    f"{', '.join(unknown[:10])}{' ...' if len(unknown) > 10 else ''}; its rows' "
                    f"thread_id values are in GET /sessions/{sid} (nothing was closed)"
                )
        closed = await self.close_session(sid, reward, reward_auxiliary=reward_auxiliary)
        assert closed is not None
        sess, rows, unmatched = closed
        return rows_response(request, sess, rows, unmatched)

    async def close_session(
        self,
        sid: str,
        reward: float | dict[str, float] | None,
        end_reason: str | None = None,
        reward_auxiliary: bool = False,
        reward_source: str = REWARD_CLOSE,
    ) -> tuple[ControlledSession, list[dict[str, Any]], list[str]] | None:
        """Close a live session: its rows written with the reward, metadata, end reason
        (``end_reason``, else the limit it reached, else ``stop``) and metrics. Returns the
        session, all its rows (those written before the close included) and the thread ids a
        per-thread reward named that it has no row for; None if it is not live. One number is
        the reward of the main and subagent rows, and of the auxiliary ones only with
        ``reward_auxiliary``; a per-thread reward is set on the threads it names.
        ``reward_source``: what the rows' ``reward_source`` says (``verifier``: a rollout's
        runner closing it; the session then records it was the runner)."""
        control = self.gateway.control
        if not control.is_live(sid):
            return None
        started = time.monotonic()
        closed_by = "runner" if reward_source != REWARD_CLOSE else "api"
        sess = control.close(sid, end_reason, closed_by=closed_by, reward=reward)
        self.gateway.metrics.sessions_closed.labels(sess.end_reason or "").inc()
        annotations = RowAnnotations(
            metadata=sess.metadata or None,
            reward=reward,
            end_reason=sess.end_reason,
            metrics=sess.metrics.as_dict(),
            reward_auxiliary=reward_auxiliary,
            reward_source=reward_source,
        )
        new_rows: list[dict[str, Any]] = []
        store = self.gateway.store
        async with self.gateway.pipeline.session_lock(sid):
            written_before = store.written_threads(sid)
            store.end_session(sid, annotations=annotations, rows_out=new_rows, why="close")
            sess.thread_shards = store.written_threads(sid, forget=True)
        earlier = read_rows(written_before, sid)
        if earlier and reward is not None:
            # Rows written before the close (an idle or explicit flush) get the reward too.
            # One number: per thread unless auxiliary rows get it too (a late reward for the
            # whole session would be joined onto them).
            late: float | dict[str, float]
            if isinstance(reward, dict):
                earlier_ids = {r["thread_id"] for r in earlier}
                late = {k: v for k, v in reward.items() if k in earlier_ids}
            elif reward_auxiliary:
                late = reward
            else:
                late = {r["thread_id"]: reward for r in earlier if annotations.rewards(r)}
            if late != {}:
                write_rewards(self.out_dir, sid, late, source=reward_source)
            for row in earlier:
                annotations.apply(row)
        rows = earlier + new_rows
        logger.info(
            "agenttap: session %r closed (%s): %d rows, reward %s, in %.3f s",
            sid,
            sess.end_reason,
            len(rows),
            reward,
            time.monotonic() - started,
        )
        return sess, rows, unmatched_threads(reward, rows)

    async def _reward(self, request: web.Request, sid: str) -> web.Response:
        body = await self.body(request)
        if "reward" not in body:
            raise ValueError('the body must be {"reward": number | {thread_id: number}}')
        reward = parse_reward(body["reward"])
        sess = self.gateway.control.get(sid)
        if sess is None:
            return self._unknown(sid)
        if not sess.closed:
            return error(
                409,
                f"agenttap: session {sid!r} is still open; give its reward at close "
                f"(POST /sessions/{sid}/close), or close it first",
            )
        path = write_rewards(self.out_dir, sid, reward)
        sess.late_rewards += 1
        return web.json_response({"id": sid, "reward": reward, "written": str(path)})

    async def _advantage(self, request: web.Request, sid: str) -> web.Response:
        """The trainer's own advantage for a session (kept for the viewer; nothing trains on
        it): ``{"advantage": number, "step"?: int, "step_s"?: number}`` (``step_s``: the
        trainer's own time for the step, the viewer's time per step)."""
        body = await self.body(request)
        if "advantage" not in body:
            raise ValueError(
                'the body must be {"advantage": number, "step"?: whole number, "step_s"?: seconds}'
            )
        advantage = parse_advantage(body["advantage"])
        step = parse_step(body.get("step"))
        step_s = parse_step_s(body.get("step_s"))
        if self.gateway.control.get(sid) is None:
            return self._unknown(sid)
        path = write_advantage(self.out_dir, sid, advantage, step, step_s)
        return web.json_response({"id": sid, "advantage": advantage, "written": str(path)})


def _new_id() -> str:
    return "s-" + uuid.uuid4().hex[:16]


def build(gateway: GatewayCore, api_url: str) -> ControlAPI:
    """The control API of ``gateway``, reached at ``api_url``: the factory the addon registers
    with the gateway (``Gateway(..., control_plane=build)``), called once it listens."""
    config = gateway.config
    endpoints = Endpoints(api_url, config.proxy_url, config.ca_path, config.bundle_path)
    return ControlAPI(gateway, gateway.api_token, endpoints, config.max_rollouts)
