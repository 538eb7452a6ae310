"""A fair share of the policy: who gets the next generation slot when calls must wait.

``FairScheduler`` hands out slots to calls keyed by their session. It bounds two things, each
optional (0: unbounded): the calls in flight at once (``capacity``: the policy is saturated
when they are all taken) and the calls in flight per session (``per_session``). A call that
cannot have a slot waits in its session's queue, first in first out within the session. When a
slot frees, the sessions with a waiting call that their own bound lets run take turns: the one
with the fewest calls running goes first, and among equals the one that has waited longest
since its last grant (round robin). So a session sending 32 calls at once does not push the
single call of another session behind its own queue: that call gets the next free slot.

A waiting call whose task is cancelled (its client left) leaves the queue; one cancelled just
after it was granted hands its slot on at once, so no slot is ever lost. The gateway uses two:
one per session over the whole policy (``agenttap_session_max_inflight``, capture/policy/pools.py)
and one per policy server (``agenttap_replica_max_inflight``, capture/policy/replicas.py).

Pure asyncio, no I/O; everything runs on the event loop that calls it.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Any


class QueueFull(Exception):
    """No more calls may wait (the scheduler's ``max_waiting``, or a session's
    ``max_waiting_per_session``); the caller answers it as a retryable error."""


class FairScheduler:
    """Slots for calls, fair between sessions (see the module's docstring)."""

    def __init__(
        self,
        capacity: int = 0,
        per_session: int = 0,
        max_waiting: int | None = None,
        max_waiting_per_session: int | None = None,
    ) -> None:
        if capacity < 0 or per_session < 0:
            raise ValueError("capacity and per_session are 0 (unbounded) or more")
        self.capacity = capacity
        self.per_session = per_session
        self.max_waiting = max_waiting
        self.max_waiting_per_session = max_waiting_per_session
        self._running: dict[str, int] = {}
        self._queues: dict[str, deque[asyncio.Future[None]]] = {}
        # Sessions with a waiting call that their own bound lets run, in the order they last
        # got a slot (or joined): the turns of the round robin. An ordered set.
        self._ring: OrderedDict[str, None] = OrderedDict()
        self._total = 0
        self._waiting = 0
        # Told after every change of the counts (a server's state mirrors them).
        self.on_change: Callable[[], None] = lambda: None

    # -- what operators read -----------------------------------------------------------------
    @property
    def in_flight(self) -> int:
        return self._total

    @property
    def waiting(self) -> int:
        return self._waiting

    def running_of(self, session: str) -> int:
        return self._running.get(session, 0)

    def waiting_of(self, session: str) -> int:
        return len(self._queues.get(session, ()))

    def summary(self) -> dict[str, Any]:
        return {
            "capacity": self.capacity,
            "per_session": self.per_session,
            "in_flight": self._total,
            "waiting": self._waiting,
            "sessions_waiting": len(self._queues),
        }

    # -- slots -----------------------------------------------------------------------------
    def _full(self) -> bool:
        return bool(self.capacity) and self._total >= self.capacity

    def _under_own_bound(self, session: str) -> bool:
        return not self.per_session or self._running.get(session, 0) < self.per_session

    def _grant(self, session: str) -> None:
        self._running[session] = self._running.get(session, 0) + 1
        self._total += 1

    async def acquire(self, session: str, force: bool = False) -> None:
        """A slot for one call of ``session``: at once where the bounds allow and none of the
        session's calls is waiting (first in, first out), else after waiting its turn.
        ``force``: at once regardless of the bounds (a generation moved here from a failed
        server must not be lost). Raises QueueFull where no more calls may wait."""
        if force or (
            session not in self._queues and not self._full() and self._under_own_bound(session)
        ):
            self._grant(session)
            self.on_change()
            return
        if self.max_waiting is not None and self._waiting >= self.max_waiting:
            raise QueueFull(f"{self._waiting} calls are waiting already")
        own = self._queues.get(session)
        if (
            self.max_waiting_per_session is not None
            and own is not None
            and len(own) >= self.max_waiting_per_session
        ):
            raise QueueFull(f"{len(own)} calls of this session are waiting already")
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._queues.setdefault(session, deque()).append(waiter)
        self._waiting += 1
        if self._under_own_bound(session):
            self._ring.setdefault(session, None)
        self.on_change()
        try:
            await waiter
        except BaseException:
            if waiter.done() and not waiter.cancelled():
                # Granted, then cancelled before it could run: the slot goes to the next.
                self.release(session)
            else:
                self._leave(session, waiter)
            raise

    def release(self, session: str) -> None:
        """One call of ``session`` ended (whatever way): its slot goes to the next in turn."""
        running = self._running.get(session, 0)
        if running <= 0:
            return  # nothing held: a double release must not free another's slot
        self._total -= 1
        if running == 1:
            del self._running[session]
        else:
            self._running[session] = running - 1
        if session in self._queues:
            # Below its own bound again: it takes part in the turns.
            self._ring.setdefault(session, None)
        self._dispatch()
        self.on_change()

    def _dispatch(self) -> None:
        while self._ring and not self._full():
            # Fewest calls running first; min keeps the first of equals: the ring's order.
            session = min(self._ring, key=self.running_of)
            del self._ring[session]
            queue = self._queues[session]
            waiter = queue.popleft()
            self._waiting -= 1
            if not queue:
                del self._queues[session]
            if waiter.cancelled():
                # Its task was cancelled and has not run its cleanup yet: skip it (its
                # ``_leave`` then finds it gone).
                if session in self._queues:
                    self._ring[session] = None
                    self._ring.move_to_end(session, last=False)  # its turn is not over
                continue
            self._grant(session)
            waiter.set_result(None)
            if session in self._queues and self._under_own_bound(session):
                self._ring[session] = None  # to the back: its next turn after the others'

    def _leave(self, session: str, waiter: asyncio.Future[None]) -> None:
        queue = self._queues.get(session)
        if queue is None or waiter not in queue:
            return
        queue.remove(waiter)
        self._waiting -= 1
        if not queue:
            del self._queues[session]
            self._ring.pop(session, None)
        self.on_change()
