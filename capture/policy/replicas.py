"""Policy replicas: which vLLM server a session's call goes to, and when it may start.

A session sticks to its replica (its prefix cache stays warm). A session's first call, or one
whose replica went unhealthy or was removed, goes to the least-loaded healthy replica; equal
loads are broken by the session id's hash (``crc32 % n`` first, then the ones after it), so
that idle proxies in a pool place a session on the same replica. Generations per replica can be
bounded (``agenttap_replica_max_inflight``); calls beyond it wait in a bounded queue
(``agenttap_replica_queue``) and past that are refused with the provider's retryable error.
While a replica is saturated its free slots go to the waiting sessions in turn, fewest running
first (capture/policy/fair.py), not to whichever call came first. A
replica failing mid-generation is marked unhealthy and the generation goes on on another one
(``failover``; the stitching is ``VLLMClient.stream_resuming``'s).

A replica is in rotation (``serving``) while it is healthy, not loading weights and its weights
are verified. Healthy means a 1-token generation completed within ``HEALTH_TIMEOUT_S`` at its
last check, not that ``GET /health`` answers: a paused or sleeping vLLM answers ``/health``
and hangs every generation. The check's generation asks for the prompt logprobs of the
replica's fingerprint sequence too (capture/policy/weights.py): answers that changed without
an update take the replica out of rotation (``unverified``) until an update verifies it.

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

from capture.policy.fair import FairScheduler, QueueFull
from rewriter.vllm_client import PolicyError, VLLMClient
from rewriter.vllm_rotation import Rotation

logger = logging.getLogger(__name__)

# Sessions whose replica is remembered (least recently used forgotten first).
MAX_ASSIGNED_SESSIONS = 100_000
# A health check's 1-token generation must complete within this (a loaded CPU server takes a
# second or two; a paused or sleeping one never completes it).
HEALTH_TIMEOUT_S = 15.0
# The state /replicas reports: in rotation, or why not.
SERVING, LOADING, PAUSED, SLEEPING, UNVERIFIED, FAILING = (
    "serving",
    "loading",
    "paused",
    "sleeping",
    "unverified",
    "failing",
)
# How much of the fingerprint's logprobs a summary shows.
FINGERPRINT_SHOWN = 4
# agenttap's own fingerprint sequence, where no trainer gave a probe: 32 ids spread over the
# first thousand (ordinary tokens of any real vocabulary), the same on every replica.
OWN_FINGERPRINT_IDS = [100 + (i * 7919) % 900 for i in range(32)]


def max_abs_diff(got: list[float | None], want: list[float | None]) -> float:
    """The largest |got - want| over the positions both have a number for (inf where the
    lengths differ: a different sequence)."""
    if len(got) != len(want):
        return float("inf")
    diffs = [abs(a - b) for a, b in zip(got, want, strict=True) if a is not None and b is not None]
    return max(diffs, default=0.0)


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
    # Why it is unhealthy: paused, sleeping or failing (its last check's generation).
    down: str = FAILING
    # A weight update is loading on it now (capture/policy/weights.py): out of rotation.
    loading: bool = False
    # Why its weights are not trusted ("": they are): a probe it failed after an update, or
    # a fingerprint that changed without one. Out of rotation until an update verifies it.
    unverified: str = ""
    # Its answers for the fingerprint sequence (prompt logprobs), taken after each update and
    # at start; each check compares against them. None: not taken yet.
    fingerprint_ids: list[int] = field(default_factory=list, repr=False)
    fingerprint: list[float | None] | None = field(default=None, repr=False)
    fingerprint_at: float = 0.0
    # When its weights were last found as fingerprinted (the start of a window that becomes
    # unverified if the next check finds them changed).
    verified_at: float = 0.0
    # Whether the last update's probe was checked on it, and its max |diff| then.
    probe_diff: float | None = None
    # Its generation slots, shared fairly between sessions (``in_flight`` and ``waiting``
    # mirror it after every change; ReplicaSet sizes it).
    slots: FairScheduler = field(default_factory=FairScheduler, repr=False)
    # Its weight-rotation state (rewriter/vllm_rotation.py): the weights it serves, the update
    # loading on it (``hold``), why its generations are refused (``refuse``), its LoRA adapter.
    # A weight update (capture/policy/weights.py) writes it; its client's generations read it.
    # One per server: every pool listing the server shares it (``ReplicaSet``'s ``rotations``).
    rotation: Rotation = field(default_factory=Rotation, repr=False)

    def __post_init__(self) -> None:
        self.client.rotation = self.rotation  # its generations read the replica's

    def load(self) -> tuple[int, int]:
        return (self.in_flight + self.waiting, self.sessions)

    @property
    def serving(self) -> bool:
        """In rotation: healthy, not loading weights, its weights verified."""
        return self.healthy and not self.loading and not self.unverified

    @property
    def state(self) -> str:
        if self.loading:
            return LOADING
        if self.unverified:
            return UNVERIFIED
        return SERVING if self.healthy else self.down

    def summary(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "state": self.state,
            "in_rotation": self.serving,
            "healthy": self.healthy,
            "unverified": self.unverified,
            "in_flight": self.in_flight,
            "waiting": self.waiting,
            "sessions": self.sessions,
            "failovers": self.failovers,
            "last_error": self.last_error,
            "last_checked": self.last_checked or None,
            "weights": {
                "version": self.rotation.weight_version,
                "fingerprint_at": self.fingerprint_at or None,
                "verified_at": self.verified_at or None,
                "probe_diff": self.probe_diff,
                "fingerprint": (self.fingerprint or [])[1 : 1 + FINGERPRINT_SHOWN],
            },
        }


def _mirroring(replica: Replica) -> Callable[[], None]:
    def mirror() -> None:
        ReplicaSet._mirror(replica)

    return mirror


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
        rotations: dict[str, Rotation] | None = None,
    ) -> None:
        """``rotations``: the servers' weight-rotation states by URL, shared with the other
        sets listing the same servers (their clients are shared too); None: each replica has
        its own."""
        if not urls:
            raise ValueError("a replica set needs at least one policy server")
        self._make_client = make_client
        self._rotations = rotations
        self.max_in_flight = max_in_flight
        self.max_queue = max_queue
        self.replicas: dict[str, Replica] = {}
        self._assigned: OrderedDict[str, str] = OrderedDict()
        # The sequence new replicas are fingerprinted with (the last update's probe, if any).
        self.fingerprint_ids = list(OWN_FINGERPRINT_IDS)
        # The tolerance fingerprints and probes are compared with (agenttap_weights_tolerance).
        self.tolerance = 1e-3
        # Told (replica, how far its answers moved) when a replica's fingerprint changed
        # without an update (the pools log it, count it and keep the unverified window).
        self.on_changed: Callable[[Replica, float], None] = lambda _r, _d: None
        for url in urls:
            self.add(url)

    # -- membership ------------------------------------------------------------------------
    def urls(self) -> list[str]:
        return list(self.replicas)

    def add(self, url: str) -> Replica:
        url = url.rstrip("/")
        replica = self.replicas.get(url)
        if replica is None:
            rotation = Rotation()
            if self._rotations is not None:
                rotation = self._rotations.setdefault(url, rotation)
            replica = Replica(url, self._make_client(url), rotation=rotation)
            replica.slots.on_change = _mirroring(replica)
            replica.fingerprint_ids = list(self.fingerprint_ids)
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
        if current is not None and current.serving and current.url not in exclude:
            self._assigned.move_to_end(session_id)
            return current
        order = self._hash_order(session_id)
        healthy = [r for r in order if r.serving and r.url not in exclude]
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
    async def acquire(self, replica: Replica, session_id: str = "", force: bool = False) -> None:
        """A generation slot on ``replica`` for a call of ``session_id``; waits its session's
        turn while all are taken, raises ReplicasBusy when the queue is full too. ``force``:
        take one regardless (a generation moved here from a failed replica must not be lost)."""
        slots = replica.slots
        slots.capacity = self.max_in_flight
        slots.max_waiting = self.max_queue
        try:
            await slots.acquire(session_id, force=force)
        except QueueFull:
            raise ReplicasBusy(
                f"the policy server at {replica.url} is busy: {slots.in_flight} generations "
                f"running (agenttap_replica_max_inflight) and {slots.waiting} calls waiting "
                f"(agenttap_replica_queue); retry shortly",
                503,
            ) from None

    async def release(self, replica: Replica, session_id: str = "") -> None:
        replica.slots.release(session_id)

    @staticmethod
    def _mirror(replica: Replica) -> None:
        """``in_flight`` and ``waiting`` (placement's load, /replicas) follow the slots."""
        replica.in_flight = replica.slots.in_flight
        replica.waiting = replica.slots.waiting

    async def failover(
        self, session_id: str, failed: Replica, error: BaseException
    ) -> Replica | None:
        """``failed`` broke mid-generation: mark it unhealthy, move the session to another
        healthy replica and hand over the generation's slot. None: no other replica."""
        if failed.healthy:  # else its check said why already (paused, sleeping)
            failed.last_error = str(error)
        failed.healthy = False
        failed.failovers += 1
        # Replicas loading a weight update rejoin once it is checked: wait for that rather
        # than give up (the update that took ``failed`` out loads them too).
        holds = [
            r.rotation.hold
            for r in self.replicas.values()
            if r is not failed and r.loading and r.rotation.hold is not None
        ]
        if holds:
            await asyncio.gather(*(hold.wait() for hold in holds))
        target = self.pick(session_id, exclude=frozenset({failed.url}))
        if target is failed or not target.serving or target.url == failed.url:
            return None
        await self.release(failed, session_id)
        await self.acquire(target, session_id, force=True)
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
        """A 1-token generation on ``replica`` (through its own client and connection pool;
        ``http``, the pool's shared session some callers pass, is not needed): healthy when it
        completes within ``HEALTH_TIMEOUT_S``. It asks for the prompt logprobs of the
        replica's fingerprint sequence too: answers far from the fingerprint
        (``on_changed``) take it out of rotation. Where the generation does not complete, the
        reason is asked of vLLM (paused, sleeping) or the error kept (failing). A replica
        loading weights is left to its update."""
        if replica.loading:
            return replica.healthy
        client = replica.client
        if not replica.healthy and replica.down in (PAUSED, SLEEPING):
            # Still paused or asleep: asked without sending a generation it would hold.
            down = await self.why_down(replica)
            if down != FAILING:
                replica.down = down
                replica.last_checked = time.time()
                return False
        answers: list[float | None] | None = None
        try:
            async with asyncio.timeout(HEALTH_TIMEOUT_S):
                ids = replica.fingerprint_ids or OWN_FINGERPRINT_IDS
                answers = await client.prompt_logprobs(ids, check=True)
            ok, why = True, ""
        except TimeoutError:
            ok = False
            why = f"a 1-token generation did not complete in {HEALTH_TIMEOUT_S:g} s"
        except Exception as exc:  # refused, reset, an error answer: all mean "not now"
            ok, why = False, f"a 1-token generation failed: {exc or type(exc).__name__}"
        if replica.loading:  # an update began meanwhile: what was seen predates it
            return replica.healthy
        replica.last_checked = time.time()
        if not ok:
            replica.down = await self.why_down(replica)
            if replica.down != FAILING:
                why = f"{replica.down}: {why}"
                # Its generations would wait there until someone resumes it: where another
                # replica serves, they go on there now (with none, they wait: a trainer that
                # paused its only server resumes it). agenttap resumes only what it paused.
                others = any(r.serving for r in self.replicas.values() if r is not replica)
                moved = client.abandon() if others else 0
                if moved:
                    logger.warning(
                        "agenttap: policy server %s is %s; its %d generation(s) move to "
                        "another server",
                        replica.url,
                        replica.down,
                        moved,
                    )
        if ok != replica.healthy or (not ok and why != replica.last_error):
            if ok:
                logger.info("agenttap: policy server %s is healthy again", replica.url)
            else:
                logger.warning("agenttap: policy server %s is unhealthy (%s)", replica.url, why)
        replica.healthy = ok
        if not ok:
            replica.last_error = why
        elif answers is not None and replica.fingerprint_ids:
            self.compare_fingerprint(replica, answers)
        return ok

    async def why_down(self, replica: Replica) -> str:
        """Why a replica's generation did not complete, as vLLM's dev-mode routes tell it:
        ``GET /is_paused`` true is paused, or sleeping where its metrics say the engine is not
        awake (``vllm:engine_sleep_state{sleep_state="awake"} 0``: vLLM's sleep pauses the
        scheduler too, and its ``/is_sleeping`` is true while merely paused); else failing."""
        if await self._dev_flag(replica, "/is_paused", "is_paused"):
            return SLEEPING if await self._asleep(replica) else PAUSED
        if await self._dev_flag(replica, "/is_sleeping", "is_sleeping"):
            return SLEEPING
        return FAILING

    async def _dev_flag(self, replica: Replica, path: str, key: str) -> bool:
        client = replica.client
        try:
            async with asyncio.timeout(HEALTH_TIMEOUT_S / 3):
                async with client.session.get(client.url(path)) as resp:
                    return resp.status == 200 and (await resp.json()).get(key) is True
        except Exception:  # no such route (not in dev mode), no answer: not known to be so
            return False

    async def _asleep(self, replica: Replica) -> bool:
        client = replica.client
        try:
            async with asyncio.timeout(HEALTH_TIMEOUT_S / 3):
                async with client.session.get(client.url("/metrics")) as resp:
                    text = await resp.text() if resp.status == 200 else ""
        except Exception:  # no metrics: paused is all that is known
            return False
        for line in text.splitlines():
            if line.startswith("vllm:engine_sleep_state{") and 'sleep_state="awake"' in line:
                return line.rsplit(" ", 1)[-1].strip() in ("0", "0.0")
        return False

    def compare_fingerprint(self, replica: Replica, answers: list[float | None]) -> bool:
        """Whether ``answers`` (the replica's prompt logprobs for its fingerprint sequence, now)
        are its fingerprint within the tolerance; if not, the replica leaves rotation as
        unverified and ``on_changed`` is told."""
        if replica.fingerprint is None:
            replica.fingerprint = answers
            replica.fingerprint_at = replica.verified_at = time.time()
            return True
        diff = max_abs_diff(answers, replica.fingerprint)
        if diff <= self.tolerance:
            replica.verified_at = time.time()
            return True
        if not replica.unverified:
            replica.unverified = (
                f"its answers changed without a weight update (max |logprob diff| {diff:.3g} "
                f"> agenttap_weights_tolerance {self.tolerance:g} on its fingerprint "
                "sequence): someone else loaded weights, or it restarted; POST /policy/weights "
                "loads and verifies the trainer's weights again"
            )
            self.on_changed(replica, diff)
        return False

    def differs_from_pool(self, replica: Replica) -> str:
        """Why ``replica``, just fingerprinted, does not serve what the pool serves: its
        fingerprint against a verified peer's on the same sequence ("" where they agree, or
        where no peer in rotation has one to compare: then it is the pool's first word)."""
        if replica.fingerprint is None:
            return ""
        for peer in self.replicas.values():
            if (
                peer is replica
                or not peer.serving
                or peer.fingerprint is None
                or peer.fingerprint_ids != replica.fingerprint_ids
            ):
                continue
            diff = max_abs_diff(replica.fingerprint, peer.fingerprint)
            if diff <= self.tolerance:
                return ""
            return (
                f"its logprobs for the fingerprint sequence are {diff:.3g} from those of "
                f"{peer.url}, which serves {peer.rotation.weight_version!r} "
                f"(agenttap_weights_tolerance {self.tolerance:g})"
            )
        return ""

    async def check_all(self, http: Any = None) -> dict[str, bool]:
        reps = list(self.replicas.values())
        results = await asyncio.gather(*(self.check(r) for r in reps))
        return {r.url: ok for r, ok in zip(reps, results, strict=True)}

    def summary(self) -> list[dict[str, Any]]:
        return [r.summary() for r in self.replicas.values()]
