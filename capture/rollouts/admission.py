"""Admission by resources: an agent starts only if the memory it may use fits.

Each run of a rollout (its agent, then its verifier: never both at once) is promised its
``memory_mb`` and, on a size-capped tmpfs that lives in memory, its ``disk_mb``. The promises
of every running run together stay within the budget: ``agenttap_rollout_memory_mb``, by
default 80% of this host's MemTotal (the rest is the proxy's, the policy's and the system's).
A run that does not fit waits (status ``pending``) until others end, so a rollout of 8 agents
on a small host runs as many at once as fit; a rollout asking not to wait (``"wait": false``)
gets 429 with ``Retry-After`` when not even one of its agents fits now; one whose single agent
could never fit is refused at once (400). The instance's parent cgroup
enforces the same total (capture/isolation/host.py ``cap_instance_memory``), so promises the
kernel does not see cannot add up past it either.

No mitmproxy or HTTP here: the routes and the runner ask.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

from capture.isolation.limits import SandboxLimits

DEFAULT_SHARE = 0.8


def host_memory_mb(meminfo: Path = Path("/proc/meminfo")) -> int:
    """This host's MemTotal in MiB."""
    for line in meminfo.read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) // 1024
    raise OSError(f"no MemTotal in {meminfo}")


def default_budget_mb() -> int:
    return int(host_memory_mb() * DEFAULT_SHARE)


def run_need_mb(limits: SandboxLimits) -> int:
    """What one run is promised: its memory cap, and its tmpfs (disk), which is memory too."""
    return limits.memory_mb + limits.disk_mb


class NeverFits(ValueError):
    """A rollout that asks more than the whole budget: no wait would let it start."""


class MemoryBusy(Exception):
    """A rollout that does not fit now (runs holding the memory must end first)."""

    def __init__(self, need_mb: int, promised_mb: int, total_mb: int) -> None:
        super().__init__(
            f"agenttap: an agent of this rollout needs {need_mb} MiB (memory_mb + disk_mb) and "
            f"{promised_mb} of {total_mb} MiB are promised to running agents "
            f"(agenttap_rollout_memory_mb); retry when some have ended"
        )


class MemoryBudget:
    """The promises of running runs against ``total_mb``."""

    def __init__(self, total_mb: int) -> None:
        self.total_mb = total_mb
        self.promised_mb = 0
        self._changed: asyncio.Condition | None = None

    def check(self, need_mb: int) -> None:
        """NeverFits if ``need_mb`` is more than the whole budget."""
        if need_mb > self.total_mb:
            raise NeverFits(
                f"an agent of this rollout needs {need_mb} MiB (memory_mb + disk_mb: its memory "
                f"and its tmpfs), more than the {self.total_mb} MiB all rollouts may have "
                "together (agenttap_rollout_memory_mb, default 80% of this host's memory): "
                "lower memory_mb or disk_mb"
            )

    def fits(self, need_mb: int) -> bool:
        return self.promised_mb + need_mb <= self.total_mb

    def take(self, need_mb: int) -> None:
        """Promise ``need_mb`` now: MemoryBusy if it does not fit."""
        self.check(need_mb)
        if not self.fits(need_mb):
            raise MemoryBusy(need_mb, self.promised_mb, self.total_mb)
        self.promised_mb += need_mb

    def give_back(self, mb: int) -> None:
        self.promised_mb = max(0, self.promised_mb - mb)
        self.nudge()

    def nudge(self) -> None:
        """Wake the waiters to look again (memory given back, or a waiter gave up)."""
        if self._changed is not None:
            changed = self._changed

            async def notify() -> None:
                async with changed:
                    changed.notify_all()

            asyncio.ensure_future(notify())

    async def acquire(self, need_mb: int, give_up: Callable[[], bool] = lambda: False) -> bool:
        """Wait until ``need_mb`` fits, then promise it: True. False if ``give_up`` says so
        first (a cancelled rollout; ``nudge`` makes the waiters look). NeverFits at once if it
        never can."""
        self.check(need_mb)
        if self._changed is None:
            self._changed = asyncio.Condition()
        async with self._changed:
            await self._changed.wait_for(lambda: self.fits(need_mb) or give_up())
        if give_up():
            return False
        self.promised_mb += need_mb
        return True
