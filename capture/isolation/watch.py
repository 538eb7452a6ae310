"""Every limit of a run, watched: the first one its processes hit, by its name
(``LIMIT_NAMES``), for the rollout's ``finish_reason: "limit"``."""

from __future__ import annotations

import asyncio
import contextlib

from capture.isolation.cgroup import RolloutCgroup
from capture.isolation.disk import DiskQuota
from capture.isolation.output import OutputPump


def limit_hit(
    cgroup: RolloutCgroup | None,
    quota: DiskQuota | None,
    output: OutputPump | None,
    layer: DiskQuota | None = None,
    ended: bool = False,
) -> str | None:
    """One look at every limit of a run: the first one hit ("output", "memory", "pids",
    "cpu_s", "disk") or None. ``layer`` is a container's writable layer (its own ``disk_mb``,
    beside the run's folders'). Ask again once the run has ended (``ended``: the layer is
    walked again): a limit hit just before its last process exited (an OOM kill of the agent
    itself, a layer filled in the last second) may not have been polled yet."""
    if output is not None and output.hit:
        return "output"
    hit = cgroup.exceeded() if cgroup is not None else None
    if hit is not None:
        return hit
    if quota is not None and quota.full():
        return "disk"
    if layer is not None and layer.full(fresh=ended):
        return "disk"
    return None


async def watch(
    cgroup: RolloutCgroup | None,
    quota: DiskQuota | None,
    output: OutputPump | None,
    interval_s: float = 0.25,
    layer: DiskQuota | None = None,
) -> str:
    """The first limit a run hits (``limit_hit``), polled every ``interval_s`` (the output
    limit at once); runs until one is hit: await it beside the run and cancel it when the run
    ends. A degraded ``DiskQuota`` (a plain folder, a container's layer) is walked at most
    every ``walk_every_s`` of its own."""
    while True:
        hit = limit_hit(cgroup, quota, output, layer)
        if hit is not None:
            return hit
        if output is None:
            await asyncio.sleep(interval_s)
        else:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(output.event.wait(), interval_s)
