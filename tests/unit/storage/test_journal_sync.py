"""The journal's fsync: batched in worker threads (capture/storage/journal_sync.py ``JournalSyncer``), and
the option that decides whether an answer waits for it."""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path

import pytest

from capture.options import parse_settings
from capture.storage import journal_sync
from capture.storage.journal_sync import JournalSyncer


def test_the_option_reads_both_modes_and_refuses_others() -> None:
    assert parse_settings({}).fsync_before_reply is False  # the default: after the reply
    assert parse_settings({"agenttap_journal_fsync": " Before_Reply "}).fsync_before_reply
    assert not parse_settings({"agenttap_journal_fsync": "after_reply"}).fsync_before_reply
    with pytest.raises(ValueError, match="agenttap_journal_fsync=always is not one of"):
        parse_settings({"agenttap_journal_fsync": "always"})


def test_requests_while_one_waits_share_its_fsync(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    journal = tmp_path / "s.jsonl"
    journal.write_bytes(b"line\n")
    started, release = threading.Event(), threading.Event()
    synced: list[str] = []

    def slow_fsync(fd: int) -> None:
        started.set()
        assert release.wait(5), "the test never released the fsync"
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))

    monkeypatch.setattr(journal_sync.os, "fsync", slow_fsync)

    async def main() -> None:
        syncer = JournalSyncer()
        first = syncer.request(journal)
        # The first fsync runs (it took its request): a line written now needs another one,
        # which starts only when the first ends ...
        await asyncio.get_running_loop().run_in_executor(None, started.wait, 5)
        second = syncer.request(journal)
        assert second is not first
        # ... and every request while the first runs shares it (before_reply awaits the fsync
        # that covers its own line), however many worker threads are free.
        for _ in range(20):
            await asyncio.sleep(0.01)
            assert syncer.request(journal) is second
        assert syncer.fsyncs == 1
        other = syncer.request(tmp_path / "gone.jsonl")  # removed already: nothing to do
        assert syncer.fsyncs == 2  # another journal does not wait for this one
        # A reply cancelled while it waits (shielded, as recording.py awaits it) leaves the
        # shared fsync to the others.
        waiter = asyncio.ensure_future(asyncio.shield(second))
        await asyncio.sleep(0)
        waiter.cancel()
        release.set()
        await asyncio.wait_for(asyncio.gather(first, second, other), 5)
        assert syncer.fsyncs == 3
        # Once it ran, a new request gets a new fsync.
        third = syncer.request(journal)
        assert third is not second
        await asyncio.wait_for(third, 5)

    asyncio.run(main())
    assert synced == [str(journal)] * 3


def test_a_failed_fsync_is_logged_for_the_user(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    journal = tmp_path / "s.jsonl"
    journal.write_bytes(b"line\n")

    def failing_fsync(fd: int) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(journal_sync.os, "fsync", failing_fsync)

    async def main() -> None:
        future = JournalSyncer().request(journal)
        with pytest.raises(OSError):
            await future
        await asyncio.sleep(0)  # the done callback runs

    asyncio.run(main())
    assert "could not be fsynced" in caplog.text
    assert "check the disk" in caplog.text
