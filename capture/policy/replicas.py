"""Policy replicas: which vLLM server a session's call goes to, and when it may start.

A session sticks to its replica (its prefix cache stays warm). A session's first call, or one
whose replica went unhealthy or was removed, goes to the least-loaded healthy replica; equal
loads are broken by the session id's hash (``crc32 % n`` first, then the ones after it), so
that idle proxies in a pool place a session on the same replica. Generations per replica can be
bounded (``agenttap_replica_max_inflight``); calls beyond it wait in a bounded queue
(``agenttap_replica_queue``) and past that are refused with the provider's retryable error. A
replica failing mid-generation is marked unhealthy and the generation goes on on another one
(``failover``; the stitching is ``VLLMClient.stream_resuming``'s). Health checks (vLLM's
``GET /health``) bring replicas back.

No HTTP here beyond the health probe: the clients are given.
"""

from __future__ import annotations

import asyncio
import logging
import time
import zlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rewriter.vllm_client import PolicyError, VLLMClient

logger = logging.getLogger(__name__)

# Sessions whose replica is remembered (least recently used forgotten first).
MAX_ASSIGNED_SESSIONS = 100_000
HEALTH_TIMEOUT_S = 5.0


@dataclass
class Replica:
    url: str
    client: VLLMClient
    healthy: bool = True
    # Generations running on it now (their slots), and calls waiting for one.
    in_flight: int = 0
    waiting: int = 0
    # Sessions placed on it (live assignments).
    sessions: int = 0
    # Generations moved away from it after it failed, and health checks it failed.
    failovers: int = 0
    last_error: str = ""
    last_checked: float = 0.0
    removed: bool = False
    _freed: asyncio.Condition | None = field(default=None, repr=False)

    def load(self) -> tuple[int, int]:
        return (self.in_flight + self.waiting, self.sessions)

    def summary(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "healthy": self.healthy,
            "in_flight": self.in_flight,
            "waiting": self.waiting,
            "sessions": self.sessions,
            "failovers": self.failovers,
            "last_error": self.last_error,
        }


class ReplicasBusy(PolicyError):
    """Every slot and the queue of a replica are taken: retry later (status 503)."""


class ReplicaSet:
    """The replicas of one pool of policy servers."""

    def __init__(
        self,
        urls: list[str],
        make_client: Callable[[str], VLLMClient],
        max_in_flight: int = 0,
        max_queue: int = 256,
    ) -> None:
        if not urls:
            raise ValueError("a replica set needs at least one policy server")
        self._make_client = make_client
        self.max_in_flight = max_in_flight
        self.max_queue = max_queue
        self.replicas: dict[str, Replica] = {}
        self._assigned: OrderedDict[str, str] = OrderedDict()
        for url in urls:
            self.add(url)

    # -- membership ------------------------------------------------------------------------
    def urls(self) -> list[str]:
        return list(self.replicas)

    def add(self, url: str) -> Replica:
        url = url.rstrip("/")
        replica = self.replicas.get(url)
        if replica is None:
            replica = Replica(url, self._make_client(url))
            self.replicas[url] = replica
        return replica

    def remove(self, url: str) -> Replica:
        """Take ``url`` out: no new call goes there; its generations finish; its sessions move
        on their next call. The last replica cannot be removed (ValueError)."""
        url = url.rstrip("/")
        if url not in self.replicas:
            raise KeyError(url)
        if len(self.replicas) == 1:
            raise ValueError(f"{url} is the last policy server; add another before removing it")
        replica = self.replicas.pop(url)
        replica.removed = True
        for sid, assigned in list(self._assigned.items()):
            if assigned == url:
                del self._assigned[sid]
        replica.sessions = 0
        return replica

    # -- placement -------------------------------------------------------------------------
    def _hash_order(self, session_id: str) -> list[Replica]:
        reps = list(self.replicas.values())
        start = zlib.crc32(session_id.encode()) % len(reps)
        return reps[start:] + reps[:start]

    def pick(self, session_id: str, exclude: frozenset[str] = frozenset()) -> Replica:
        """The session's replica: its own while healthy, else the least-loaded healthy one
        (ties: hash order). With no healthy replica left, its own (or the hash's) anyway: the
        call then fails with the policy's own error."""
        url = self._assigned.get(session_id)
        current = self.replicas.get(url) if url else None
        if current is not None and current.healthy and current.url not in exclude:
            self._assigned.move_to_end(session_id)
            return current
        order = self._hash_order(session_id)
        healthy = [r for r in order if r.healthy and r.url not in exclude]
        if not healthy:
            others = [r for r in order if r.url not in exclude]
            return current or (others or order)[0]
        # min keeps the first of equals: hash order breaks ties.
        chosen = min(healthy, key=lambda r: r.load())
        self._assign(session_id, chosen)
        return chosen

    def _assign(self, session_id: str, replica: Replica) -> None:
        old = self._assigned.pop(session_id, None)
        if old is not None and old in self.replicas:
            self.replicas[old].sessions = max(0, self.replicas[old].sessions - 1)
        self._assigned[session_id] = replica.url
        replica.sessions += 1
        while len(self._assigned) > MAX_ASSIGNED_SESSIONS:
            _, url = self._assigned.popitem(last=False)
            if url in self.replicas:
                self.replicas[url].sessions = max(0, self.replicas[url].sessions - 1)

    def assigned(self, session_id: str) -> str | None:
        """The replica the session is placed on (None: not placed yet); places nothing."""
        return self._assigned.get(session_id)

    def forget(self, session_id: str) -> None:
        """The session is over: its replica stops counting it."""
        url = self._assigned.pop(session_id, None)
        if url is not None and url in self.replicas:
            self.replicas[url].sessions = max(0, self.replicas[url].sessions - 1)

    def replica_of(self, client: VLLMClient) -> Replica | None:
        return next((r for r in self.replicas.values() if r.client is client), None)

    # -- slots -----------------------------------------------------------------------------
    async def acquire(self, replica: Replica, force: bool = False) -> None:
        """A generation slot on ``replica``; waits in its queue while all are taken, raises
        ReplicasBusy when the queue is full too. ``force``: take one regardless (a generation
        moved here from a failed replica must not be lost)."""
        if force or not self.max_in_flight or replica.in_flight < self.max_in_flight:
            replica.in_flight += 1
            return
        if replica.waiting >= self.max_queue:
            raise ReplicasBusy(
                f"the policy server at {replica.url} is busy: {replica.in_flight} generations "
                f"running (agenttap_replica_max_inflight) and {replica.waiting} calls waiting "
                f"(agenttap_replica_queue); retry shortly",
                503,
            )
        if replica._freed is None:
            replica._freed = asyncio.Condition()
        replica.waiting += 1
        try:
            async with replica._freed:
                await replica._freed.wait_for(lambda: replica.in_flight < self.max_in_flight)
                replica.in_flight += 1
        finally:
            replica.waiting -= 1

    async def release(self, replica: Replica) -> None:
        replica.in_flight = max(0, replica.in_flight - 1)
        if replica._freed is not None:
            async with replica._freed:
                replica._freed.notify()

    async def failover(
        self, session_id: str, failed: Replica, error: BaseException
    ) -> Replica | None:
        """``failed`` broke mid-generation: mark it unhealthy, move the session to another
        healthy replica and hand over the generation's slot. None: no other replica."""
        failed.healthy = False
        failed.failovers += 1
        failed.last_error = str(error)
        target = self.pick(session_id, exclude=frozenset({failed.url}))
        if target is failed or not target.healthy or target.url == failed.url:
            return None
        await self.release(failed)
        await self.acquire(target, force=True)
        logger.warning(
            "agenttap: policy server %s failed mid-generation (%s); session %r goes on on %s",
            failed.url,
            error,
            session_id,
            target.url,
        )
        return target

    # -- health ----------------------------------------------------------------------------
    async def check(self, replica: Replica, http: Any = None) -> bool:
        """vLLM's ``GET /health``: 200 is healthy; anything else, or no answer, is not. The
        probe goes through the replica's own client, over its connection pool (TCP, or the
        unix socket its URL names); ``http``, the pool's shared session some callers pass, is
        not needed for it."""
        client = replica.client
        try:
            async with asyncio.timeout(HEALTH_TIMEOUT_S):
                async with client.session.get(client.url("/health")) as resp:
                    ok = bool(resp.status == 200)
                    why = f"GET /health answered {resp.status}"
        except Exception as exc:  # refused, reset, timed out: all mean "not now"
            ok, why = False, f"GET /health failed: {exc or type(exc).__name__}"
        replica.last_checked = time.time()
        if ok != replica.healthy:
            if ok:
                logger.info("agenttap: policy server %s is healthy again", replica.url)
            else:
                logger.warning("agenttap: policy server %s is unhealthy (%s)", replica.url, why)
        replica.healthy = ok
        if not ok:
            replica.last_error = why
        return ok

    async def check_all(self, http: Any = None) -> dict[str, bool]:
        reps = list(self.replicas.values())
        results = await asyncio.gather(*(self.check(r) for r in reps))
        return {r.url: ok for r, ok in zip(reps, results, strict=True)}

    def summary(self) -> list[dict[str, Any]]:
        return [r.summary() for r in self.replicas.values()]
