"""The policy servers a gateway talks to: which one answers a call, and the model names it lists.

Requested model names go to pools of vLLM servers (``agenttap_model_map``, fnmatch patterns;
unmatched names: ``agenttap_policy_url``); within a pool a session sticks to one server, so its
consecutive calls reuse that server's prefix cache. Each session's own model names are kept
(bounded) so that ``GET /v1/models`` lists the asker's names and never another session's.

A session has at most ``agenttap_session_max_inflight`` generations in flight over all of them
(``sessions``, capture/policy/fair.py); its other calls wait in its own queue, in order, before
they ask a server for a slot, so one agent's burst cannot fill a server's slots and queue.
"""

from __future__ import annotations

import asyncio
import fnmatch
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

import aiohttp

from capture.policy.fair import FairScheduler, QueueFull
from capture.policy.replicas import Replica, ReplicasBusy, ReplicaSet
from capture.policy.weights import PolicyWeights
from rewriter.policy_url import connector, is_unix, tcp_connector
from rewriter.vllm_client import PolicyError, VLLMClient
from rewriter.vllm_rotation import Rotation

logger = logging.getLogger(__name__)

# The policy connection failing mid-call (a read timeout, a dropped connection).
POLICY_FAILURES = (aiohttp.ClientError, TimeoutError)
# Bounds on the remembered model names: a client inventing names must not grow memory.
MAX_MODELS_PER_SESSION = 32
MAX_SESSIONS_WITH_MODELS = 10_000
# Windows of weights nobody verified that are remembered (the oldest forgotten first).
MAX_UNVERIFIED_WINDOWS = 1024
# (backend, since, found, why): generations that backend ran between since and found (epoch
# seconds) ran on weights that were not the ones agenttap verified.
UnverifiedWindow = tuple[str, float, float, str]


def policy_failure(client: VLLMClient, exc: BaseException) -> PolicyError:
    """One of ``POLICY_FAILURES`` as the PolicyError its client is answered with."""
    if isinstance(exc, TimeoutError):  # aiohttp's read timeouts are TimeoutErrors too
        return PolicyError(
            f"the policy server at {client.base_url} did not answer in time; "
            "option agenttap_policy_timeout"
        )
    return PolicyError(f"the connection to the policy server at {client.base_url} failed: {exc}")


class PolicyPools:
    """The policy servers by requested model name, over one shared HTTP connection pool."""

    def __init__(
        self,
        policy_urls: Sequence[str],
        model_map: Sequence[tuple[str, list[str]]],
        model_names: Sequence[str],
        timeout_s: float,
        max_connections: int,
        max_in_flight: int = 0,
        max_queue: int = 256,
        session_max_in_flight: int = 0,
        health_interval_s: float = 5.0,
        weights_tolerance: float = 1e-3,
        weights_check_s: float = 60.0,
        flush_interval_s: float = 0.0,
    ) -> None:
        self.policy_urls = list(policy_urls)
        # (pattern, servers): the first pattern a requested name matches picks its servers.
        self.model_map = list(model_map)
        self.configured_names = list(model_names)
        self.timeout_s = timeout_s
        self.flush_interval_s = flush_interval_s
        self.max_connections = max_connections
        self._http: aiohttp.ClientSession | None = None
        # A server on a unix socket (unix:/PATH) has a connection pool of its own.
        self._unix_http: dict[str, aiohttp.ClientSession] = {}
        self._clients: dict[str, VLLMClient] = {}
        # Each server's weight-rotation state, held by its replica in every pool listing it.
        self._rotations: dict[str, Rotation] = {}
        self.max_in_flight = max_in_flight
        self.max_queue = max_queue
        # Generations in flight per session over every server (agenttap_session_max_inflight;
        # 0: unbounded); at most max_queue more of a session's calls wait their turn.
        self.sessions = FairScheduler(
            per_session=session_max_in_flight, max_waiting_per_session=max_queue
        )
        self.health_interval_s = health_interval_s
        # Probes and fingerprints compare within this; the fingerprints are checked this
        # often besides every health check (agenttap_weights_tolerance, _check_s).
        self.weights_tolerance = weights_tolerance
        self.weights_check_s = weights_check_s
        self._weights_check: asyncio.Task[None] | None = None
        # Told (url, how far its answers moved, the window) when a replica's weights changed
        # without an update (the gateway's metric and OUT/weights_unverified.jsonl).
        self.on_weights_changed: Callable[[str, float, UnverifiedWindow], None] = (
            lambda _url, _diff, _window: None
        )
        # Replicas whose weights changed without an update: (url, since, found, reason); a
        # generation that ran there between since and found ran on weights nobody verified.
        self.unverified_windows: list[UnverifiedWindow] = []
        # One replica set per pool: agenttap_policy_url's (the default), then model_map's.
        self.default: ReplicaSet | None = None
        self._mapped: list[tuple[str, ReplicaSet]] = []
        self._decode: Callable[[list[int]], str] | None = None
        self._health: asyncio.Task[None] | None = None
        # Told each replica's health after every check (the gateway's policy_up gauge).
        self.on_health: Callable[[str, bool], None] = lambda _url, _ok: None
        # The weights the servers serve, and their updates (POST /policy/weights).
        self.weights = PolicyWeights()
        # Model names each session asked for (GET /v1/models lists the asker's own), bounded.
        self._session_models: OrderedDict[str, OrderedDict[str, None]] = OrderedDict()

    def open(self, decode: Callable[[list[int]], str]) -> None:
        """Create the HTTP connection pool and one client per server (in the running loop)."""
        self._http = self._session(None)
        self._decode = decode
        self.default = ReplicaSet(
            self.policy_urls, self._client, self.max_in_flight, self.max_queue, self._rotations
        )
        self._mapped = [
            (
                pattern,
                ReplicaSet(
                    servers, self._client, self.max_in_flight, self.max_queue, self._rotations
                ),
            )
            for pattern, servers in self.model_map
        ]
        for replicas in self.sets():
            replicas.tolerance = self.weights_tolerance
            replicas.on_changed = self._weights_changed

    def _weights_changed(self, replica: Replica, diff: float) -> None:
        found = time.time()
        since = replica.verified_at or replica.fingerprint_at
        window = (replica.url, since, found, replica.unverified)
        self.unverified_windows.append(window)
        del self.unverified_windows[:-MAX_UNVERIFIED_WINDOWS]
        logger.error(
            "agenttap: policy server %s left rotation: %s. Generations it ran since %s are "
            "marked weights_unverified",
            replica.url,
            replica.unverified,
            time.strftime("%H:%M:%S", time.localtime(since)),
        )
        self.on_weights_changed(replica.url, diff, window)

    def weights_unverified(self, backend: str, started_at: float, ended_at: float) -> bool:
        """Whether a generation ``backend`` ran from ``started_at`` to ``ended_at`` (epoch
        seconds) overlaps a window in which that replica's weights were not the ones verified."""
        return any(
            url == backend and started_at <= found and ended_at >= since
            for url, since, found, _ in self.unverified_windows
        )

    def _session(self, url: str | None) -> aiohttp.ClientSession:
        """A connection pool: the TCP servers' shared one (``url`` None), or one to the unix
        socket ``url`` names."""
        return aiohttp.ClientSession(
            connector=connector(url, self.max_connections)
            if url
            else tcp_connector(self.max_connections),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=self.timeout_s),
        )

    @property
    def http(self) -> aiohttp.ClientSession | None:
        """The TCP servers' connection pool (each server's client holds the one it uses)."""
        return self._http

    def _client(self, url: str) -> VLLMClient:
        """The one client of ``url`` (shared by every pool that lists it)."""
        client = self._clients.get(url)
        if client is None:
            assert self._http is not None and self._decode is not None
            http = self._http
            if is_unix(url):
                http = self._unix_http.get(url) or self._session(url)
                self._unix_http[url] = http
            # The policy timeout bounds time without a new token, not without a byte.
            client = VLLMClient(
                url,
                http,
                decode=self._decode,
                progress_timeout_s=self.timeout_s,
                flush_interval_s=self.flush_interval_s,
            )
            self._clients[url] = client
        return client

    def start_health_checks(self) -> None:
        """Check every replica's health every ``health_interval_s``, and its weights'
        fingerprint then and every ``weights_check_s`` (in the running loop). The first check
        runs now: it takes each replica's fingerprint at start."""
        loop = asyncio.get_running_loop()
        if self._health is None:
            self._health = loop.create_task(self._check_loop(self.health_interval_s, first=True))
        if self._weights_check is None and self.weights_check_s > 0:
            self._weights_check = loop.create_task(self._check_loop(self.weights_check_s))

    async def _check_loop(self, interval_s: float, first: bool = False) -> None:
        if not first:
            await asyncio.sleep(interval_s)
        while True:
            try:
                await self.check_health()
            except Exception:  # a probe must never kill the loop
                logger.exception("agenttap: the policy health check failed")
            if interval_s <= 0:
                return
            await asyncio.sleep(interval_s)

    async def check_health(self) -> dict[str, bool]:
        assert self._http is not None
        out: dict[str, bool] = {}
        for replicas in self.sets():
            out.update(await replicas.check_all())
        for url, ok in out.items():
            self.on_health(url, ok)
        return out

    def replica(self, url: str) -> Replica | None:
        """The replica ``url`` names, in whichever pool lists it."""
        for replicas in self.sets():
            if url in replicas.replicas:
                return replicas.replicas[url]
        return None

    def sets(self) -> list[ReplicaSet]:
        assert self.default is not None
        return [self.default, *(r for _, r in self._mapped)]

    async def close(self) -> None:
        for task in (self._health, self._weights_check):
            if task is not None:
                task.cancel()
        if self._http:
            await self._http.close()
        for http in self._unix_http.values():
            await http.close()

    def set_for(self, model: str) -> ReplicaSet:
        for pattern, replicas in self._mapped:
            if fnmatch.fnmatchcase(model, pattern):
                return replicas
        assert self.default is not None
        return self.default

    def pool_for(self, model: str) -> list[VLLMClient]:
        return [r.client for r in self.set_for(model).replicas.values()]

    def client_for(self, session_id: str, model: str = "") -> VLLMClient:
        """The session's replica (see capture/policy/replicas.py): sticky while healthy, else the
        least-loaded healthy one."""
        return self.set_for(model).pick(session_id).client

    def backend_of(self, session_id: str) -> str | None:
        """The policy server a session's calls go to (None: it made none yet); places nothing."""
        for replicas in self.sets():
            url = replicas.assigned(session_id)
            if url is not None:
                return url
        return None

    def generation(self, session_id: str, model: str, client: VLLMClient) -> Generation:
        """A generation slot on ``client``'s replica, for ``async with`` (or acquire/release):
        bounded per replica (ReplicasBusy when its queue is full too), moved on failover."""
        replicas = self.set_for(model)
        replica = replicas.replica_of(client) or replicas.add(client.base_url)
        return Generation(replicas, session_id, replica, self.sessions)

    def queue_state(self, session_id: str) -> dict[str, int]:
        """A session's calls at the policy now: generations running, and calls waiting for
        their turn (its own queue, then a server's)."""
        at_servers = sum(r.slots.waiting_of(session_id) for r in self._replicas())
        return {
            "policy_in_flight": self.sessions.running_of(session_id),
            "policy_queued": self.sessions.waiting_of(session_id) + at_servers,
        }

    def queued(self) -> int:
        """Calls waiting for a generation slot now, in sessions' queues and servers'."""
        at_servers = sum(r.slots.waiting for r in self._replicas())
        return self.sessions.waiting + at_servers

    def _replicas(self) -> list[Replica]:
        """Every server of every pool (none before ``open``)."""
        if self.default is None:
            return []
        return [r for rs in self.sets() for r in rs.replicas.values()]

    def model_names(self, served: str, session_id: str = "") -> list[str]:
        """Names clients may ask for: every one maps to a policy (``model_map``). Besides the
        configured ones, only the asking session's own names: never another session's."""
        own = list(self._session_models.get(session_id, ())) if session_id else []
        names = [served, *self.configured_names, *own]
        names += [p for p, _ in self.model_map if not any(c in p for c in "*?[")]
        return list(dict.fromkeys(n for n in names if n))

    def remember_model(self, session_id: str, model: str) -> None:
        """Note a name a session asked for; the least recently used go past the bounds."""
        models = self._session_models.pop(session_id, None) or OrderedDict()
        models.pop(model, None)
        models[model] = None
        while len(models) > MAX_MODELS_PER_SESSION:
            models.popitem(last=False)
        self._session_models[session_id] = models
        while len(self._session_models) > MAX_SESSIONS_WITH_MODELS:
            self._session_models.popitem(last=False)


class Generation:
    """One call's hold on a replica; ``failover`` moves it to another when its replica fails
    mid-generation (passed to ``VLLMClient.stream_resuming``)."""

    def __init__(
        self,
        replicas: ReplicaSet,
        session_id: str,
        replica: Replica,
        sessions: FairScheduler | None = None,
    ) -> None:
        self.replicas = replicas
        self.session_id = session_id
        self.replica = replica
        self.sessions = sessions or FairScheduler()
        self._held = False

    async def acquire(self) -> None:
        """The session's turn first (its own bound), then a slot on the server; a call that
        waits is no error, one past a full queue is ReplicasBusy (the provider's 503)."""
        try:
            await self.sessions.acquire(self.session_id)
        except QueueFull:
            raise ReplicasBusy(
                f"session {self.session_id!r} has {self.sessions.running_of(self.session_id)} "
                f"generations running (agenttap_session_max_inflight) and "
                f"{self.sessions.waiting_of(self.session_id)} calls waiting "
                f"(agenttap_replica_queue); retry shortly",
                503,
            ) from None
        try:
            await self.replicas.acquire(self.replica, self.session_id)
        except BaseException:
            self.sessions.release(self.session_id)
            raise
        self._held = True

    async def release(self) -> None:
        if self._held:
            self._held = False
            try:
                await self.replicas.release(self.replica, self.session_id)
            finally:
                self.sessions.release(self.session_id)

    async def __aenter__(self) -> Generation:
        await self.acquire()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.release()

    async def failover(self, client: VLLMClient, error: BaseException) -> VLLMClient | None:
        target = await self.replicas.failover(self.session_id, self.replica, error)
        if target is None:
            return None
        self.replica = target
        return target.client
