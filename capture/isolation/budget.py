"""How many connections sandboxes may hold through their bridges, per sandbox and in all.

Each sandbox may hold at most ``agenttap_rollout_max_connections`` connections at once, to the
proxy and the API counted together (``ConnectionBudget``): past it the bridge accepts the new
one and closes it at once, unrelayed. One flooding rollout once held 7,500 idle connections,
took mitmdump from 23 descriptors to its limit of 20,000, and every other session got 503s.

And the bridges together leave the process a reserve of descriptors (``Descriptors``): a
relayed connection costs about ``FDS_PER_CONNECTION`` of them in this process (the unix side,
the bridge's TCP side, mitmproxy's accepted end, mitmproxy's connection to the gateway and the
gateway's end of it), and a new one is refused when what is open, plus that, would eat into
the reserve (``RESERVE_FRACTION`` of the limit, at least ``RESERVE_MIN``), so mitmproxy,
the gateway and the trainer's sessions never meet EMFILE because of a sandbox. At start the
soft ``RLIMIT_NOFILE`` is raised to the hard one (``raise_nofile``).

With the limit of 20,000 measured: a reserve of 5,000, so 3,000 relayed connections in all (46
sandboxes at the default 64 each).
"""

from __future__ import annotations

import logging
import os
import resource
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)

# Descriptors a relayed connection to the proxy holds in this process (see above; one to the
# API listener holds three).
FDS_PER_CONNECTION = 5
RESERVE_FRACTION = 0.25
RESERVE_MIN = 1024
# What is open is counted again at most this often (a count reads /proc/self/fd); in between,
# each admitted connection adds FDS_PER_CONNECTION to the last count.
RECOUNT_S = 0.05


def raise_nofile() -> int:
    """Raise this process's soft descriptor limit to its hard one; the soft limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as exc:
            logger.warning(
                "agenttap: could not raise the descriptor limit from %d to %d: %s", soft, hard, exc
            )
    if soft == resource.RLIM_INFINITY:
        return 1 << 20  # the kernel's usual nr_open; no real limit is this high
    return int(soft)


def reserve_for(limit: int) -> int:
    """The descriptors kept from the bridges out of ``limit``: a quarter, at least
    ``RESERVE_MIN``, never more than half."""
    return min(max(RESERVE_MIN, int(limit * RESERVE_FRACTION)), limit // 2)


def open_descriptors() -> int | None:
    """How many descriptors this process holds (None where /proc is not there)."""
    try:
        return len(os.listdir("/proc/self/fd")) - 1  # the listing's own
    except OSError:
        return None


class ConnectionBudget:
    """One sandbox's connections at once: ``take`` one (False: at the cap, refused and
    counted), ``give_back`` when it ends."""

    def __init__(self, max_connections: int) -> None:
        if max_connections < 1:
            raise ValueError("a sandbox needs at least one connection")
        self.max_connections = max_connections
        self.open = 0
        self.peak = 0
        self.refused = 0

    def take(self) -> bool:
        if self.open >= self.max_connections:
            self.refused += 1
            return False
        self.open += 1
        self.peak = max(self.peak, self.open)
        return True

    def give_back(self) -> None:
        self.open = max(0, self.open - 1)


class Descriptors:
    """The process's descriptors, shared by every bridge: ``take`` room for one relayed
    connection (False: it would eat into the reserve; refused and counted), ``give_back``."""

    def __init__(
        self,
        limit: int,
        reserve: int | None = None,
        count: Callable[[], int | None] = open_descriptors,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.limit = limit
        self.reserve = reserve_for(limit) if reserve is None else reserve
        self._count = count
        self._clock = clock
        self.relayed = 0
        self.refused = 0
        self._estimate: int | None = None
        self._counted_at = -RECOUNT_S

    @property
    def usable(self) -> int:
        """Descriptors the bridges may use in all (the limit less the reserve)."""
        return self.limit - self.reserve

    @property
    def max_relayed(self) -> int:
        """Relayed connections the bridges may hold at once in all."""
        return max(0, self.usable // FDS_PER_CONNECTION)

    def _open_now(self) -> int:
        now = self._clock()
        if self._estimate is None or now - self._counted_at >= RECOUNT_S:
            counted = self._count()
            if counted is not None:
                self._estimate, self._counted_at = counted, now
            elif self._estimate is None:
                self._estimate = 0  # no /proc: the relayed count alone decides
        assert self._estimate is not None
        return self._estimate

    def take(self) -> bool:
        if self.relayed >= self.max_relayed or self._open_now() + FDS_PER_CONNECTION > self.usable:
            self.refused += 1
            return False
        self.relayed += 1
        assert self._estimate is not None
        self._estimate += FDS_PER_CONNECTION
        return True

    def give_back(self) -> None:
        self.relayed = max(0, self.relayed - 1)
