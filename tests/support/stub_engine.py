"""A saturated engine for the scripted stub policy (tests/support/stub_vllm.py ``engine``).

A real vLLM runs a bounded batch: past ``max_num_seqs`` generations, requests wait in its own
queue, first come first served. ``StubEngine`` gives the stub that shape: at most ``slots``
generations at once (0: unbounded), the rest wait in arrival order; each takes ``call_s``
seconds once it runs. It counts, per label (``label(body)``: which session a request is from,
as the test tells it), the generations running now and the most at once, and notes the order
in which they started. ``hold``: each generation that starts waits until the test releases it
(``release``), so that a test orders events instead of timing them.

The engine lives on the stub's event loop (its own thread); the counts are read from the
test's thread under a lock, and ``wait_for`` blocks there until a condition on them holds.
"""

from __future__ import annotations

import asyncio
import threading
from collections import Counter, deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any


class StubEngine:
    def __init__(
        self, slots: int = 0, call_s: float = 0.0, label: Callable[[dict[str, Any]], str] = str
    ) -> None:
        self.slots = slots
        self.call_s = call_s
        self.label = label
        self.hold = False
        self.running: Counter[str] = Counter()
        self.peak: Counter[str] = Counter()
        self.started: list[str] = []
        self._changed = threading.Condition()
        self._free: asyncio.Semaphore | None = None
        self._held: deque[asyncio.Event] = deque()
        self._loop: asyncio.AbstractEventLoop | None = None

    @asynccontextmanager
    async def generation(self, body: dict[str, Any]) -> AsyncIterator[None]:
        """One generation's time in the engine: queued for a slot, then run (held, timed)."""
        self._loop = asyncio.get_running_loop()
        if self.slots and self._free is None:
            self._free = asyncio.Semaphore(self.slots)
        name = self.label(body)
        if self._free is not None:
            await self._free.acquire()
        try:
            with self._changed:
                self.running[name] += 1
                self.peak[name] = max(self.peak[name], self.running[name])
                self.started.append(name)
                self._changed.notify_all()
            try:
                if self.hold:
                    released = asyncio.Event()
                    self._held.append(released)
                    await released.wait()
                if self.call_s:
                    await asyncio.sleep(self.call_s)
                yield
            finally:
                with self._changed:
                    self.running[name] -= 1
                    self._changed.notify_all()
        finally:
            if self._free is not None:
                self._free.release()

    def release(self, n: int = 1) -> None:
        """Let the ``n`` oldest held generations go on (from the test's thread)."""

        def go() -> None:
            for _ in range(min(n, len(self._held))):
                self._held.popleft().set()

        if self._loop is not None:
            self._loop.call_soon_threadsafe(go)

    def release_all(self) -> None:
        """Hold no more, and let every held generation go on."""
        self.hold = False
        self.release(1 << 30)

    def wait_for(
        self, check: Callable[[StubEngine], bool], what: str, timeout_s: float = 30
    ) -> None:
        """Block until ``check(self)`` holds (checked at each start and end); AssertionError
        naming ``what`` after ``timeout_s``."""
        with self._changed:
            if not self._changed.wait_for(lambda: check(self), timeout_s):
                raise AssertionError(
                    f"timed out after {timeout_s:g} s waiting for {what}: running "
                    f"{dict(self.running)}, started {self.started[-12:]}"
                )
