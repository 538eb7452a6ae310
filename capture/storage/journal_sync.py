"""The journal's fsync, off the event loop: ``JournalSyncer`` batches the fsyncs of journal
lines written with ``durable=False`` (capture/storage/sessions.py) in worker threads.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from pathlib import Path

logger = logging.getLogger(__name__)


class JournalSyncer:
    """fsyncs journals in worker threads, batched: a journal asked for while its fsync waits
    to start is fsynced once for all the lines written by then; one asked for while its fsync
    runs gets another. Nothing here blocks the event loop."""

    def __init__(self) -> None:
        # journal -> its fsync that has not started yet (it covers every line written so far)
        self._waiting: dict[Path, asyncio.Future[None]] = {}
        self._lock = threading.Lock()
        self.fsyncs = 0  # how many ran (tests, benchmarks)

    def request(self, journal: Path) -> asyncio.Future[None]:
        """fsync ``journal`` soon; the future of the fsync that covers its lines written so
        far (one already waiting to start, shared, or a new one)."""
        # Held while the fsync is submitted: its worker takes the lock before it starts, so it
        # cannot start (and leave the map) before it is in the map.
        with self._lock:
            future = self._waiting.get(journal)
            if future is None:
                future = asyncio.get_running_loop().run_in_executor(None, self._sync, journal)
                future.add_done_callback(_log_sync_failure)
                self._waiting[journal] = future
        return future

    def _sync(self, journal: Path) -> None:
        with self._lock:  # lines written from here on need the next fsync
            del self._waiting[journal]
            self.fsyncs += 1
        sync_journal(journal)


def _log_sync_failure(future: asyncio.Future[None]) -> None:
    if not future.cancelled() and future.exception() is not None:
        logger.error(
            "agenttap: a journal could not be fsynced (%s); its lines are written but may not "
            "survive a crash of this host: check the disk under the output folder",
            future.exception(),
        )


def sync_journal(journal: Path) -> None:
    """fsync a journal whose lines were written with ``durable=False``. Gone already: its
    session was written to shards (fsynced) and the journal removed; nothing is left to do."""
    try:
        fd = os.open(journal, os.O_RDONLY)
    except FileNotFoundError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
