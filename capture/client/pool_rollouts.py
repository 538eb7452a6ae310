"""One group of rollouts across a Ray pool's proxies (``ProxyPool.rollout``): placed by what each
node can run, run as shares (``POST /rollouts`` on each chosen actor, numbered from their
``first_index`` so session ids and seeds are those of one group), watched for node loss, merged
into one answer.

Placement (``place``, a pure function): a rollout goes to the node with the most memory free for
rollouts (its budget less what the pool's rollouts there hold), preferring a node where the image
is already built; a node without a container engine never gets an ``image`` or ``task`` rollout,
and a group asking more than a node's whole budget per agent is refused. Actors on one node share
its memory.

Node loss: an actor that dies (its node lost, its process killed) fails its share: each of its
rollouts ends ``finish_reason: "node_lost"`` with no reward, or with ``retries`` runs again on an
actor of another node under a new session id (``ID-retryK-I``). The lost attempt's session ids
are written to the pool's ``lost-sessions.json``; ``ProxyPool.dataset`` leaves their rows out,
should any reach storage (a journal recovered later). The answer comes within Ray's detection
of the death (GCS health checks: ``health_check_period_ms`` x ``health_check_failure_threshold``,
about 15 s by default) plus ``POLL_S``.

No mitmproxy here; Ray is imported where a group runs.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from capture.client.shipping import Packed

NODE_LOST = "node_lost"
# How often a running group checks its actors' nodes while it waits.
POLL_S = 0.5


class PlacementError(ValueError):
    """No node of the pool can run a group's rollouts (no engine, too little memory)."""


@dataclass
class Capacity:
    """What one actor reports (``ProxyActor.capacity``)."""

    index: int
    node_id: str
    memory_mb: int
    held_mb: int = 0
    rollouts: int = 0
    engine: str = ""
    image_warm: bool | None = None

    @classmethod
    def of(cls, report: dict[str, Any]) -> Capacity:
        return cls(
            index=int(report["index"]),
            node_id=str(report["node_id"]),
            memory_mb=int(report["memory_mb"]),
            held_mb=int(report.get("held_mb", 0)),
            rollouts=int(report.get("rollouts", 0)),
            engine=str(report.get("engine") or ""),
            image_warm=report.get("image_warm"),
        )


def place(capacities: list[Capacity], n: int, need_mb: int, needs_engine: bool) -> list[int]:
    """The actor index for each of ``n`` rollouts, each needing ``need_mb`` of its node's
    memory: on the node with the most memory free (after the rollouts placed before it), a
    warm image first, then the actor of that node with the fewest placed; rollouts that fit
    nowhere now go where the most is free (the instance's admission holds them until memory
    frees up there). PlacementError when no actor can ever run one."""
    if not capacities:
        raise PlacementError("no actor of the pool is alive to run it: start a new pool")
    usable = [c for c in capacities if c.engine or not needs_engine]
    if not usable:
        raise PlacementError(
            "no node of the pool has a container engine (podman) for an image or task "
            "rollout: install podman on the nodes that are to run them (or unset "
            "AGENTTAP_CONTAINER_ENGINE=none there)"
        )
    budget: dict[str, int] = {}
    free: dict[str, int] = {}
    for c in usable:
        budget[c.node_id] = max(budget.get(c.node_id, 0), c.memory_mb)
    for c in capacities:
        if c.node_id in budget:
            free[c.node_id] = free.get(c.node_id, budget[c.node_id]) - c.held_mb
    largest = max(budget.values())
    if need_mb > largest:
        raise PlacementError(
            f"an agent of this rollout needs {need_mb} MiB (memory_mb + disk_mb) and the largest "
            f"node of the pool promises its rollouts {largest} MiB: lower the limits"
        )
    placed = {c.index: 0 for c in usable}
    out = []
    for _ in range(n):

        def score(c: Capacity) -> tuple[int, int, int, int, int]:
            node_free = free[c.node_id]
            return (
                int(node_free >= need_mb),
                int(bool(c.image_warm)),
                node_free,
                -(placed[c.index] + c.rollouts),
                -c.index,
            )

        best = max((c for c in usable if budget[c.node_id] >= need_mb), key=score)
        out.append(best.index)
        placed[best.index] += 1
        free[best.node_id] -= need_mb
    return out


def shares(indices: list[int], actors: list[int]) -> list[tuple[int, list[int]]]:
    """``indices`` (rollout numbers) given to ``actors`` (one actor per number, from ``place``)
    as (actor, consecutive numbers) shares: each actor's count kept, its numbers made
    consecutive runs so that one ``POST /rollouts`` (``first_index``) runs each."""
    counts: dict[int, int] = {}
    for actor in actors:
        counts[actor] = counts.get(actor, 0) + 1
    ordered = sorted(indices)
    out: list[tuple[int, list[int]]] = []
    at = 0
    for actor in sorted(counts):
        take = ordered[at : at + counts[actor]]
        at += counts[actor]
        # Split where the numbers are not consecutive (a retry's lost numbers can have gaps).
        run: list[int] = []
        for number in take:
            if run and number != run[-1] + 1:
                out.append((actor, run))
                run = []
            run.append(number)
        if run:
            out.append((actor, run))
    return out


@dataclass
class Share:
    """One ``POST /rollouts`` of a group on one actor."""

    actor: int
    node_id: str
    rollout_id: str  # the group's id, or ID-retryK for a retry
    indices: list[int]
    attempt: int
    ref: Any = None


@dataclass
class GroupRun:
    """A group across the pool while it runs, and its merged answer."""

    id: str
    agent: Any
    n: int
    retries: int
    created_at: float = field(default_factory=time.time)
    runs: dict[int, dict[str, Any]] = field(default_factory=dict)
    lost: list[dict[str, Any]] = field(default_factory=list)
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)

    def summary(self) -> dict[str, Any]:
        """The answer, as ``POST /rollouts`` gives it, each rollout naming its ``node`` and
        ``proxy``; ``lost``: the attempts lost with their node."""
        runs = [self.runs[i] for i in sorted(self.runs)]
        nodes: dict[str, int] = {}
        for run in runs:
            if run.get("node"):
                nodes[run["node"]] = nodes.get(run["node"], 0) + 1
        return {
            "id": self.id,
            "group_id": self.id,
            "agent": self.agent,
            "n": self.n,
            "status": "done" if self.done.is_set() else "running",
            "sandbox": next((r.get("sandbox") for r in runs if r.get("sandbox")), None),
            "cancelled": False,
            "created_at": self.created_at,
            "nodes": nodes,
            "lost": list(self.lost),
            "error": None if self.error is None else str(self.error),
            "rollouts": runs,
        }


def lost_run(index: int, share: Share, why: str) -> dict[str, Any]:
    """The answer's entry for a rollout whose node was lost (no retry left)."""
    return {
        "index": index,
        "session_id": f"{share.rollout_id}-{index}",
        "status": "error",
        "finish_reason": NODE_LOST,
        "reward": None,
        "exit_code": None,
        "error": f"the node running it ({share.node_id}) was lost: {why}",
        "node": share.node_id,
        "proxy": share.actor,
        "attempt": share.attempt,
        "metrics": {},
        "rows": [],
    }


class GroupRunner:
    """Runs one ``GroupRun`` on a pool's actors (its own thread with ``wait=False``)."""

    def __init__(
        self,
        group: GroupRun,
        body: dict[str, Any],
        packed: dict[str, Packed],
        actors: list[Any],
        capacities: Callable[[set[int]], list[Capacity]],
        on_lost: Callable[[int, list[str], str], None],
        need_mb: int,
        needs_engine: bool,
    ) -> None:
        self.group = group
        self.body = body
        self.packed = packed
        self.actors = actors
        self.capacities = capacities  # the alive actors' capacities, leaving out those given
        self.on_lost = on_lost  # (actor, lost session ids, why): the pool marks them
        self.need_mb = need_mb
        self.needs_engine = needs_engine
        self.dead: set[int] = set()
        self._refs: dict[str, Any] = {}

    def run(self) -> None:
        try:
            self._run()
        except BaseException as exc:  # the waiting caller sees it
            self.group.error = exc
        finally:
            self.group.done.set()

    def _run(self) -> None:
        import ray

        # The shipped folders go to the object store once, whatever the number of shares.
        self._refs = {key: ray.put(packed) for key, packed in self.packed.items()}
        pending: dict[Any, Share] = {}
        for share in self._start(list(range(self.group.n)), attempt=0):
            pending[share.ref] = share
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=POLL_S)
            for ref in ready:
                share = pending.pop(ref)
                try:
                    answer = ray.get(ref)
                except (ray.exceptions.RayActorError, ray.exceptions.ObjectLostError) as exc:
                    for new in self._lose(share, _why(exc)):
                        pending[new.ref] = new
                    continue
                for run in answer.get("rollouts") or []:
                    run.setdefault("attempt", share.attempt)
                    self.group.runs[int(run["index"])] = run
            if not ready and pending:
                alive = _alive_nodes()
                for ref, share in list(pending.items()):
                    if share.node_id and share.node_id not in alive:
                        del pending[ref]
                        for new in self._lose(share, "Ray reports its node dead"):
                            pending[new.ref] = new

    def _start(self, indices: list[int], attempt: int) -> list[Share]:
        caps = self.capacities(self.dead)
        chosen = place(caps, len(indices), self.need_mb, self.needs_engine)
        node_of = {c.index: c.node_id for c in caps}
        started = []
        for actor, numbers in shares(indices, chosen):
            rid = self.group.id if attempt == 0 else f"{self.group.id}-retry{attempt}"
            body = {**self.body, "id": rid, "n": len(numbers), "first_index": numbers[0]}
            share = Share(actor, node_of[actor], rid, numbers, attempt)
            share.ref = self.actors[actor].run_rollout.remote(
                body,
                self._refs.get("workdir"),
                self._refs.get("task"),
                self._refs.get("tests"),
            )
            started.append(share)
        return started

    def _lose(self, share: Share, why: str) -> list[Share]:
        """A share whose actor died: marked lost (the pool stops placing on that actor), its
        rollouts run again elsewhere while retries are left, else answered ``node_lost``."""
        self.dead.add(share.actor)
        sessions = [f"{share.rollout_id}-{i}" for i in share.indices]
        self.on_lost(share.actor, sessions, why)
        self.group.lost.append(
            {
                "node": share.node_id,
                "proxy": share.actor,
                "attempt": share.attempt,
                "session_ids": sessions,
                "why": why,
            }
        )
        if share.attempt < self.group.retries:
            try:
                return self._start(share.indices, share.attempt + 1)
            except PlacementError as exc:
                why = f"{why}; no other node can run it again ({exc})"
        for i in share.indices:
            self.group.runs[i] = lost_run(i, share, why)
        return []


def _alive_nodes() -> set[str]:
    import ray

    return {str(n["NodeID"]) for n in ray.nodes() if n.get("Alive")}


def _why(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]
