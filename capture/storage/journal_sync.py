"""The journal's fsync, off the event loop: ``JournalSyncer`` batches the fsyncs of journal
lines written with ``durable=False`` (capture/storage/sessions.py) in worker threads.
"""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)


class JournalSyncer:
    """fsyncs journals in worker threads, batched: one fsync per journal runs at a time; every
    request made while it runs shares the next one, which starts when it ends and covers every
    line written by then. Nothing here blocks the event loop; all its state lives on the loop
    (requests and the done callbacks both run there), so it needs no lock."""

    def __init__(self) -> None:
        # journal -> the fsync that runs now (in a worker thread)
        self._running: dict[Path, asyncio.Future[None]] = {}
        # journal -> the fsync that starts when the running one ends (shared by its requests)
        self._next: dict[Path, asyncio.Future[None]] = {}
        self.fsyncs = 0  # how many started (tests, benchmarks)

    def request(self, journal: Path) -> asyncio.Future[None]:
        """fsync ``journal`` soon; the future of the fsync that covers its lines written so
        far: a new one, or the one already waiting for the running fsync to end, shared. Await
        it through ``asyncio.shield``: other requests share it."""
        waiting = self._next.get(journal)
        if waiting is not None:
            return waiting
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        future.add_done_callback(_log_sync_failure)
        self._next[journal] = future
        if journal not in self._running:
            self._start(journal)
        return future

    def _start(self, journal: Path) -> None:
        # Lines written from here on need the next fsync: this one may already be past them.
        future = self._next.pop(journal)
        self.fsyncs += 1
        running = asyncio.get_running_loop().run_in_executor(None, sync_journal, journal)
        self._running[journal] = running

        def ended(running: asyncio.Future[None]) -> None:
            del self._running[journal]
            if not future.done():  # a caller may have cancelled it (not through a shield)
                if running.cancelled():
                    future.cancel()
                elif (error := running.exception()) is not None:
                    future.set_exception(error)
                else:
                    future.set_result(None)
            if journal in self._next:
                self._start(journal)

        running.add_done_callback(ended)


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
