"""A log line per kind of failure per interval, with a count, never one per failure.

A failure an adversary can repeat at will (a sandbox opening connections past its budget, an
``accept`` failing with EMFILE thousands of times a second) must not turn the log into the
attack: one flooding rollout once wrote 126,651 tracebacks (41 MB) in a minute. The first
occurrence of a kind is logged at once; the ones after it within ``interval_s`` are counted,
and the next line of that kind (or ``flush``) says how many there were.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class _Kind:
    last_logged: float
    suppressed: int = 0
    # The last suppressed occurrence's words, for flush.
    message: str = ""


class RateLimitedLog:
    """``note(key, message)``: log ``message`` unless a line of ``key`` was logged less than
    ``interval_s`` ago; then only count it. ``clock`` is injectable (tests)."""

    def __init__(
        self,
        logger: logging.Logger,
        interval_s: float = 10.0,
        level: int = logging.WARNING,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.logger = logger
        self.interval_s = interval_s
        self.level = level
        self.clock = clock
        self._kinds: dict[str, _Kind] = {}
        # Every occurrence, logged or not, by key.
        self.counts: dict[str, int] = {}

    def note(self, key: str, message: str) -> bool:
        """Count one occurrence of ``key``; True when it was logged now."""
        self.counts[key] = self.counts.get(key, 0) + 1
        now = self.clock()
        kind = self._kinds.get(key)
        if kind is None:
            self._kinds[key] = _Kind(now)
            self.logger.log(self.level, "%s", message)
            return True
        if now - kind.last_logged < self.interval_s:
            kind.suppressed += 1
            kind.message = message
            return False
        self.logger.log(self.level, "%s%s", message, self._more(kind, now))
        kind.last_logged, kind.suppressed, kind.message = now, 0, ""
        return True

    def flush(self) -> None:
        """Log the count of what was suppressed since each kind's last line (at a close)."""
        now = self.clock()
        for kind in self._kinds.values():
            if kind.suppressed:
                self.logger.log(self.level, "%s%s", kind.message, self._more(kind, now))
                kind.last_logged, kind.suppressed, kind.message = now, 0, ""

    @staticmethod
    def _more(kind: _Kind, now: float) -> str:
        if not kind.suppressed:
            return ""
        return f" ({kind.suppressed} more like it in the last {now - kind.last_logged:.0f} s)"
