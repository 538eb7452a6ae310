"""The one door to a sandboxed run: ``Box.start(spec) -> BoxHandle``, then the handle's
``wait``, ``stop`` and ``usage``. A ``Box`` is made once per process: it holds what every run
shares (the network bridges, the launcher's staging folder, the paths always hidden and always
shown) and the host's limit mechanisms (``prepare`` at start, ``close`` at shutdown).

One run (an agent's or a verifier's command, ``BoxSpec``) gets a cgroup of its own with its
limits (capture/isolation/cgroup.py), its output kept to ``output_mb`` (output.py), the engine
its spec names (engines.py: ``bwrap`` or ``none``) and, with a session, a bridge to the proxy
and the API (netbridge.py). ``BoxHandle.wait`` returns once it ended, ran past its timeout, went
past a limit (watch.py) or was cancelled; every process of it is ended then, its cgroup and
bridge removed.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from capture.isolation.cgroup import RolloutCgroup
from capture.isolation.containers import Container, ContainerPlan
from capture.isolation.containers import remove_stale as remove_stale_containers
from capture.isolation.disk import DiskQuota
from capture.isolation.engines import ENGINES, Engine
from capture.isolation.host import cap_instance_memory, mechanism, release, remove_stale
from capture.isolation.limits import MIB, SandboxLimits
from capture.isolation.netbridge import Binder, Bridges, NetBridge, Route
from capture.isolation.output import OutputPump
from capture.isolation.processes import Child, stop
from capture.isolation.sandbox import make_stage
from capture.isolation.watch import limit_hit, watch

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BoxSpec:
    """One command to run in a box: ``folders`` are its work (its working directory), HOME and
    TMPDIR, the only ones it may write; ``log`` takes its output (its stderr apart in
    ``stderr_log`` when given); ``session_id``: the session whose bridge it reaches the proxy
    and the API through (None: no network); ``quota``: the disk its folders live on, watched."""

    name: str
    engine: Engine
    command: list[str]
    env: dict[str, str]
    folders: tuple[Path, Path, Path]
    limits: SandboxLimits
    log: Path
    stderr_log: Path | None = None
    session_id: str | None = None
    expose: tuple[Path, ...] = ()
    quota: DiskQuota | None = None
    # In a container of an image (the podman engine): what it runs in.
    container: ContainerPlan | None = None


@dataclass(frozen=True)
class Ended:
    """How a box's run ended: past its timeout, past a limit (its name), whether every process
    of it is gone, its exit code and what it used (peak memory, CPU seconds; ``bridge``: what
    its bridge counted, when it had one)."""

    timed_out: bool
    limit: str | None
    gone: bool
    exit_code: int | None
    usage: dict[str, Any] = field(default_factory=dict)
    bridge: Any = None


class BoxHandle:
    """A started run: ``wait`` for its end, ``stop`` it early (a cancel), ``usage`` so far."""

    def __init__(self, box: Box, spec: BoxSpec, cgroup: RolloutCgroup) -> None:
        self.box, self.spec, self.cgroup = box, spec, cgroup
        cap = spec.limits.output_mb * MIB
        self.pump = OutputPump(spec.log, cap)
        self.errors = OutputPump(spec.stderr_log, cap) if spec.stderr_log else None
        self.child: Child | None = None
        # A container's writable layer, held to disk_mb (``wait``).
        self.layer: DiskQuota | None = None

    @property
    def exit_code(self) -> int | None:
        return self.child.proc.returncode if self.child is not None else None

    def usage(self) -> dict[str, float]:
        """What its processes used so far: ``memory_peak_bytes``, ``pids_peak``, ``cpu_s``."""
        return self.cgroup.usage()

    async def stop(self, graceful: bool = True) -> bool:
        """End every process of it (a cancel); True once none is left. ``wait`` then returns."""
        return await stop(self.child, graceful) if self.child is not None else True

    async def wait(self, timeout_s: float, cancelled: Callable[[], bool]) -> Ended:
        """Until it ends, runs past ``timeout_s``, goes past a limit or ``cancelled()`` (asked
        before it waits: a cancel while it started found no process to stop); then every
        process of it is ended, its cgroup removed and its bridge closed."""
        child = self.child
        assert child is not None and child.proc.stdout is not None
        timed_out, limit, gone = False, None, True
        usage: dict[str, Any] = {}
        try:
            pumping: asyncio.Future[Any] = asyncio.ensure_future(self.pump.run(child.proc.stdout))
            if self.errors is not None:
                assert child.proc.stderr is not None
                pumping = asyncio.gather(pumping, self.errors.run(child.proc.stderr))
            waiting = asyncio.ensure_future(child.proc.wait())
            layer = child.container.layer if isinstance(child.container, Container) else None
            # A container's writable layer holds disk_mb too (the run's folders are a tmpfs).
            self.layer = DiskQuota.layer(layer, self.spec.limits.disk_mb) if layer else None
            watching = asyncio.ensure_future(
                watch(self.cgroup, self.spec.quota, self.pump, layer=self.layer)
            )
            try:
                if not cancelled():
                    done, _ = await asyncio.wait(
                        {waiting, watching}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED
                    )
                    timed_out = not done
                    if watching in done:
                        limit = watching.result()
            finally:
                watching.cancel()
                # Whatever it left running (a tool's server, a daemon) ends with it.
                gone = await stop(child, graceful=timed_out or cancelled())
                await self.cgroup.kill_all()
                await pumping
            # A run the kernel killed (out of memory) may have exited before a poll saw it.
            limit = limit or limit_hit(
                self.cgroup, self.spec.quota, self.pump, self.layer, ended=True
            )
            if limit is None and child.container is not None and child.proc.returncode == 137:
                # SIGKILLed in a container: the OOM killer's count went with its cgroup.
                limit = "memory" if self.cgroup.memory_full() else None
            if limit is None and self.errors is not None and self.errors.hit:
                limit = "output"
            usage = self.cgroup.usage()
        finally:
            container = child.container
            if container is not None and not (self.spec.container and self.spec.container.keep):
                await container.remove()
            bridge = await self.box.release(self)
        return Ended(timed_out, limit, gone, child.proc.returncode, usage, bridge)


class Box:
    """Every sandboxed run of this process. ``hide``: paths no run may see (OUT, mitmproxy's
    confdir); ``expose``: paths every run is shown read-only (the CA); ``paths``: ``fixed``, a
    bwrap run's work, HOME and TMPDIR shown at ``FIXED_PLACES``, or ``host``, at their host
    paths (capture/isolation/sandbox.py); ``routes``: the proxy's
    and the API's ports a run with a session reaches; ``bindings``: where each relayed
    connection is bound to its session."""

    def __init__(
        self,
        hide: tuple[Path, ...],
        expose: tuple[Path, ...],
        routes: Callable[[], list[Route]],
        bindings: Binder,
        max_connections: int,
        max_running: int,
        paths: str = "fixed",
    ) -> None:
        self.hide, self.expose = hide, expose
        # Where a bwrap run's folders appear inside (agenttap_sandbox_paths).
        self.paths = paths
        self._routes, self._bindings = routes, bindings
        self._max_connections, self._max_running = max_connections, max_running
        # Each sandboxed run's unix sockets to the proxy and the API (its own folder, bound to
        # its session, under its connection budget); made on the first one.
        self._bridges: Bridges | None = None
        # Where the launcher stages what bwrap binds (an empty folder; mounts go on it only in
        # each launcher's own mount namespace).
        self._stage: Path | None = None

    @staticmethod
    def prepare(total_mb: int) -> None:
        """At start: what a crashed instance left (its cgroups, its tmpfs) goes; the log says
        which kernel limits apply on this host; all runs together are capped at ``total_mb``."""
        removed = remove_stale() + [f"container {n}" for n in remove_stale_containers()]
        if removed:
            logger.info("agenttap: removed what an earlier instance left: %s", ", ".join(removed))
        logger.info("%s", mechanism())
        logger.info("agenttap: %s", cap_instance_memory(total_mb))

    def make_engine(self, name: str) -> Engine:
        """The engine ``name`` names (``ENGINES``), running in this box; SandboxUnavailable (a
        ValueError) when it cannot run here (bwrap not installed)."""
        return ENGINES[name](self)

    @staticmethod
    def disk(folder: Path, disk_mb: int) -> DiskQuota:
        """A run's folders' disk: a tmpfs of ``disk_mb`` at ``folder`` (a plain folder where
        this process may not mount one). Blocking: in a thread."""
        return DiskQuota.mount(folder, disk_mb)

    async def start(self, spec: BoxSpec, label: str = "") -> BoxHandle:
        """Start ``spec``'s command in its engine under its limits (``label`` names it in the
        log); OSError if it could not start (its cgroup and bridge are gone again then)."""
        # A container engine takes one --cgroup-parent: the run's cgroup at one path in every
        # hierarchy, its container's made below it, under its limits.
        make = RolloutCgroup.create_aligned if spec.engine.aligned_cgroup else RolloutCgroup.create
        cgroup = make(spec.name, spec.limits)
        handle = BoxHandle(self, spec, cgroup)
        pipes: dict[str, Any] = {
            "env": spec.env,
            "stdin": asyncio.subprocess.DEVNULL,
            "stdout": asyncio.subprocess.PIPE,
            "stderr": asyncio.subprocess.PIPE
            if spec.stderr_log is not None
            else asyncio.subprocess.STDOUT,
            "start_new_session": True,
        }
        try:
            handle.child = await spec.engine.spawn(label or spec.name, spec, cgroup, pipes)
        except BaseException:
            await self.release(handle)
            raise
        return handle

    async def bridge(self, session_id: str) -> NetBridge:
        """The bridge into a run's sandbox's network: the proxy's port (when mitmdump listens)
        and the API's, its connections bound to the run's session."""
        if self._bridges is None:
            self._bridges = Bridges(self._bindings, self._max_connections, self._max_running)
        return await self._bridges.open(session_id, self._routes())

    def stage(self) -> Path:
        if self._stage is None:
            self._stage = make_stage()
        return self._stage

    async def release(self, handle: BoxHandle) -> Any:
        """A run's cgroup removed and its bridge closed; what the bridge refused, if any."""
        await handle.cgroup.remove()
        handle.cgroup.remove_engine_folders()
        sid = handle.spec.session_id
        if sid is not None and self._bridges is not None:
            return await self._bridges.close(sid)
        return None

    async def close(self) -> None:
        """At shutdown, once every run ended: the bridges, the staging folder, this instance's
        own cgroup folders go."""
        if self._bridges is not None:
            await self._bridges.close_all()
        if self._stage is not None:
            shutil.rmtree(self._stage, ignore_errors=True)
            self._stage = None
        release()
