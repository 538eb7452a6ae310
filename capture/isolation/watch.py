"""Every limit of a run, watched: the first one its processes hit, by its name
(``LIMIT_NAMES``), for the rollout's ``finish_reason: "limit"``."""

from __future__ import annotations

import asyncio
import contextlib

from capture.isolation.cgroup import RolloutCgroup
from capture.isolation.disk import DiskQuota
from capture.isolation.output import OutputPump


def limit_hit(
    cgroup: RolloutCgroup | None, quota: DiskQuota | None, output: OutputPump | None
) -> str | None:
    """One look at every limit of a run: the first one hit ("output", "memory", "pids",
    "cpu_s", "disk") or None. Ask again once the run has ended: a limit hit just before its
    last process exited (an OOM kill of the agent itself) may not have been polled yet."""
    if output is not None and output.hit:
        return "output"
    hit = cgroup.exceeded() if cgroup is not None else None
    if hit is not None:
        return hit
    if quota is not None and quota.full():
        return "disk"
    return None


async def watch(
    cgroup: RolloutCgroup | None,
    quota: DiskQuota | None,
    output: OutputPump | None,
    interval_s: float = 0.25,
) -> str:
    """The first limit a run hits (``limit_hit``), polled every ``interval_s`` (the output
    limit at once); runs until one is hit: await it beside the run and cancel it when the run
    ends. A degraded ``DiskQuota`` (a plain folder) is walked at most every
    ``DEGRADED_WALK_EVERY_S``."""
    while True:
        hit = limit_hit(cgroup, quota, output)
        if hit is not None:
            return hit
        if output is None:
            await asyncio.sleep(interval_s)
        else:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(output.event.wait(), interval_s)
