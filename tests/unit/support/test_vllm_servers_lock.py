"""The lock that keeps a pause or a weight push on the shared vLLM from reaching another
worker's test (``VllmServers.using``). Threads stand in for workers: flock locks belong to an
open file, so two opens conflict within one process as across two. Each waiter is seen
blocked in ``/proc/locks`` before the next step: no sleeps."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from tests.support.paths import QWEN3
from tests.support.vllm_servers import SESSION, VllmServers


def _blocked_flocks() -> int:
    """How many flock requests on this machine wait for another's lock right now."""
    return sum(" -> FLOCK " in line for line in Path("/proc/locks").read_text().splitlines())


def _until(predicate, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + 30
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def test_a_waiting_exclusive_holder_goes_before_later_shared_ones(tmp_path: Path) -> None:
    servers = VllmServers(tmp_path, QWEN3)
    order: list[str] = []
    release_first = threading.Event()

    def hold(name: str, exclusive: bool, until: threading.Event | None = None) -> None:
        with servers.using(SESSION, exclusive):
            order.append(f"{name} in")
            if until is not None:
                until.wait(30)
            order.append(f"{name} out")

    blocked = _blocked_flocks()
    first = threading.Thread(target=hold, args=("shared-1", False, release_first))
    first.start()
    _until(lambda: order == ["shared-1 in"], "the first shared holder")
    # A second shared holder would get in now; the exclusive one waits for the first.
    pusher = threading.Thread(target=hold, args=("exclusive", True))
    pusher.start()
    _until(lambda: _blocked_flocks() > blocked, "the exclusive holder to wait")
    late = threading.Thread(target=hold, args=("shared-2", False))
    late.start()
    _until(lambda: _blocked_flocks() > blocked + 1, "the late shared holder to wait")
    assert order == ["shared-1 in"]

    release_first.set()
    for thread in (first, pusher, late):
        thread.join(30)
    assert order == [
        "shared-1 in", "shared-1 out", "exclusive in", "exclusive out", "shared-2 in", "shared-2 out",
    ]  # fmt: skip


def test_shared_holders_overlap(tmp_path: Path) -> None:
    servers = VllmServers(tmp_path, QWEN3)
    with servers.using(SESSION, False), servers.using(SESSION, False):
        pass  # a second shared hold while the first is held: no wait, no deadlock
