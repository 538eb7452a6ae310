"""The processes a box starts (capture/isolation/box.py): a ``Child`` (an agent or a
verifier, and its sandbox), and ``stop``, which ends every process of one, sandboxed (its PID
namespace) or not (its process group).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from dataclasses import dataclass
from typing import Protocol

from capture.isolation.sandbox import Jail

logger = logging.getLogger(__name__)

# A grace period between SIGTERM and SIGKILL for an agent's process group.
KILL_GRACE_S = 3.0
# The longest wait for a sandbox's last process once it was killed (the kernel's work: quick).
GONE_TIMEOUT_S = 10.0


@dataclass
class Child:
    """A started agent or verifier: the process we started (bwrap, or the command itself) and,
    sandboxed, the sandbox's PID namespace."""

    proc: asyncio.subprocess.Process
    jail: Jail | None = None
    # In a container: the engine ends its processes (the process we started is its client).
    container: Stoppable | None = None


class Stoppable(Protocol):
    async def stop(self, grace_s: int = ...) -> None: ...

    async def running(self) -> bool: ...

    async def remove(self) -> None: ...


async def stop(child: Child, graceful: bool) -> bool:
    """End every process of an agent or verifier; True once none is left. Sandboxed: with
    ``graceful``, SIGTERM to each of its processes and a grace for it to exit, then SIGKILL to
    its sandbox's init (the kernel kills the rest of its PID namespace), and a wait until that
    init is gone. Unsandboxed: its process group, SIGTERM then SIGKILL."""
    jail, proc = child.jail, child.proc
    if child.container is not None:
        await child.container.stop(int(KILL_GRACE_S) if graceful else 0)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(proc.wait(), GONE_TIMEOUT_S)
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
        return not await child.container.running()
    if jail is None:
        await _kill_group(proc)
        return not _group_alive(proc.pid)
    if graceful and proc.returncode is None:
        jail.terminate()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(proc.wait(), KILL_GRACE_S)
    jail.kill()
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
    await proc.wait()
    gone = await jail.wait_gone(GONE_TIMEOUT_S)
    if not gone:
        logger.error("agenttap: a sandbox's processes did not end in %g s", GONE_TIMEOUT_S)
    return gone


async def _kill_group(proc: asyncio.subprocess.Process) -> None:
    """End a process and every process of its group: SIGTERM, then SIGKILL after a grace."""
    for sig, wait in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, KILL_GRACE_S)):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
        if proc.returncode is None:
            try:
                await asyncio.wait_for(proc.wait(), wait)
            except TimeoutError:
                continue
        if not _group_alive(proc.pid):
            return


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True
