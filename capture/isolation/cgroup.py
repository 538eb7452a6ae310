"""A run's cgroup (an agent's or a verifier's processes), made before it starts: memory (swap
counted, the OOM killer on), pids and CPU seconds of all its processes together, and the rlimits
put before its command.

One interface (``RolloutCgroup``), one class per kernel kind: ``CgroupV1`` (the ``memory``,
``pids`` and ``cpuacct`` hierarchies, each a folder) and ``CgroupV2`` (the unified hierarchy:
one folder). ``RolloutCgroup.create`` picks the one this host has (capture/isolation/host.py);
with no writable cgroup, a ``CgroupV1`` with no folder (the rlimits still apply).
``launch_prefix()`` is an argv put before the real command: it moves itself into the cgroup(s),
applies ``prlimit`` (RLIMIT_CPU per process, a backstop to the cgroup's total; RLIMIT_FSIZE per
file, a backstop to the disk cap; no core files) and execs the rest.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import itertools
import logging
import math
import os
import re
import signal
import time
from pathlib import Path

from capture.isolation.host import _host, _procs
from capture.isolation.limits import MIB, SandboxLimits

logger = logging.getLogger(__name__)

_run_numbers = itertools.count(1)


def _read_int(path: Path, default: int = 0) -> int:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return default


def _read_key(path: Path, key: str) -> int:
    """``key N`` from a flat-keyed cgroup file (memory.oom_control, pids.events, cpu.stat)."""
    try:
        for line in path.read_text().splitlines():
            k, _, v = line.partition(" ")
            if k == key:
                return int(v)
    except (OSError, ValueError):
        pass
    return 0


# Run with the cgroup.procs files after it: joins each (a write of its own pid), then execs the
# rest of its arguments as they are (never through a shell). A failed join stops the run.
_JOIN = (
    'n=$1; shift; while [ "$n" -gt 0 ]; do echo $$ > "$1" || '
    '{ echo "agenttap: could not join the cgroup $1" >&2; exit 125; }; '
    'shift; n=$((n - 1)); done; exec "$@"'
)


def _hierarchy_root(folder: Path) -> Path:
    """The top of the cgroup hierarchy ``folder`` is in (the last folder up with a
    ``cgroup.procs``)."""
    root = folder
    while root.parent != root and (root.parent / "cgroup.procs").exists():
        root = root.parent
    return root


def _tree(folder: Path) -> list[Path]:
    """``folder`` and the cgroup folders below it, parents first."""
    found = [folder]
    with contextlib.suppress(OSError):
        for root, dirs, _ in os.walk(folder):
            found.extend(Path(root) / d for d in sorted(dirs))
    return found


def _relative(folder: Path) -> Path:
    return folder.relative_to(_hierarchy_root(folder))


def rlimit_argv(limits: SandboxLimits) -> list[str]:
    """``prlimit`` before a command: RLIMIT_CPU per process, RLIMIT_FSIZE (the disk cap) per
    file, no core files. Empty without prlimit.

    RLIMIT_CPU is a backstop a second past ``cpu_s`` (whole seconds, soft = hard: a SIGKILL):
    the cgroup's total (``watch``) normally ends the run first, and the kernel's cgroup counter
    can lag the rlimit's own clock by a few percent, so a process the backstop killed has a
    total past ``cpu_s`` by the counter ``exceeded`` reads."""
    prlimit = _host().prlimit
    if prlimit is None:
        return []
    cpu = math.ceil(limits.cpu_s) + 1
    return [prlimit, f"--cpu={cpu}", f"--fsize={limits.disk_mb * MIB}", "--core=0", "--"]


class RolloutCgroup:
    """One run's cgroup: what both kernel kinds share (joining, reading the limits hit, ending
    every process, removal). A subclass says where each counter lives and how limits are set."""

    kind = ""

    def __init__(self, name: str, limits: SandboxLimits, dirs: dict[str, Path]):
        self.name = name
        self.limits = limits
        self.dirs = dirs
        # The same path in every hierarchy, for a container engine's --cgroup-parent (its
        # container's cgroup is made below it, under this run's limits); "" when not aligned.
        self.relative = ""

    @staticmethod
    def create_aligned(name: str, limits: SandboxLimits) -> RolloutCgroup:
        """A run's cgroup at one path in every hierarchy (``relative``), for a container engine
        that takes a single ``--cgroup-parent``: this process's cgroup can sit at another path
        in each v1 hierarchy (here: memory under the machine's own folder, pids at the top).
        The memory hierarchy's path is used everywhere. OSError if a folder cannot be made."""
        made = RolloutCgroup.create(name, limits)
        if not made.dirs or made.kind != "v1" or "memory" not in made.dirs:
            made.relative = (
                "/" + str(_relative(next(iter(made.dirs.values())))) if made.dirs else ""
            )
            return made
        relative = _relative(made.dirs["memory"])
        for key, folder in list(made.dirs.items()):
            aligned = _hierarchy_root(folder) / relative
            if aligned == folder:
                continue
            aligned.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(OSError):
                folder.rmdir()
            made.dirs[key] = aligned
        made._configure()
        made.relative = "/" + str(relative)
        return made

    def remove_engine_folders(self) -> None:
        """The folders a container engine made at ``relative`` in the hierarchies this run does
        not use (cpu, cpuset, devices, ...): empty once its container is gone."""
        if not self.relative:
            return
        for hierarchy in Path("/sys/fs/cgroup").iterdir():
            folder = hierarchy / self.relative.lstrip("/")
            if folder not in self.dirs.values():
                with contextlib.suppress(OSError):
                    folder.rmdir()

    @staticmethod
    def create(name: str, limits: SandboxLimits) -> RolloutCgroup:
        """A fresh cgroup named after ``name`` (made safe, a number added so it is unique) with
        ``limits`` set; with no writable cgroup on this host, one with no folder (the rlimits of
        ``launch_prefix`` still apply; ``mechanism()`` says so). OSError if the kernel refuses
        a limit."""
        h = _host()
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", name)[:64].lstrip(".") or "run"
        folder = f"{safe}-{next(_run_numbers)}"
        made = KINDS.get(h.kind, CgroupV1)(folder, limits, {})
        try:
            for key, base in h.bases.items():
                d = base / folder
                d.mkdir()
                made.dirs[key] = d
            made._configure()
        except OSError:
            for d in made.dirs.values():
                with contextlib.suppress(OSError):
                    d.rmdir()
            raise
        return made

    # -- what each kind says ----------------------------------------------------------------
    def _configure(self) -> None:
        """Write the memory and pids limits into the cgroup's folders."""
        raise NotImplementedError

    def _file(self, key: str, v1_name: str, v2_name: str) -> Path | None:
        """The counter file of controller ``key`` (its v1 and v2 names); None: not here."""
        raise NotImplementedError

    def cpu_seconds(self) -> float | None:
        """CPU time of every process this run had, together (None: not measured here)."""
        raise NotImplementedError

    def _kill_at_once(self) -> None:
        """Ask the kernel to kill every process of the cgroup (where it can)."""

    # -- shared -------------------------------------------------------------------------------
    def launch_prefix(self) -> list[str]:
        """An argv to put before the run's command (``setpriv ...``, ``bwrap ...``), started as
        root: it joins this cgroup, applies the rlimits and execs the command, whatever its
        arguments (they are passed on as they are, never read by a shell). Exit 125 if it could
        not join."""
        procs = [str(d / "cgroup.procs") for d in self.dirs.values()]
        join = ["/bin/sh", "-c", _JOIN, "agenttap-limits", str(len(procs)), *procs] if procs else []
        return [*join, *rlimit_argv(self.limits)]

    def oom_kills(self) -> int:
        p = self._file("memory", "memory.oom_control", "memory.events")
        return _read_key(p, "oom_kill") if p is not None else 0

    def pids_refused(self) -> int:
        """Forks the pids limit refused so far."""
        p = self._file("pids", "pids.events", "pids.events")
        return _read_key(p, "max") if p is not None else 0

    def exceeded(self) -> str | None:
        """The limit this run has hit so far, by the kernel's own counters: "memory" (a process
        was OOM-killed; failcnt is not used: reclaiming page cache at the limit counts there
        too), "pids" (a fork was refused), "cpu_s" (their CPU time together reached the limit),
        or None."""
        if self.oom_kills() > 0:
            return "memory"
        if self.pids_refused() > 0 or (self.relative and self._pids_full()):
            return "pids"
        cpu = self.cpu_seconds()
        if cpu is not None and cpu >= self.limits.cpu_s:
            return "cpu_s"
        return None

    def _pids_full(self) -> bool:
        """Whether its processes reached the pids limit: below a container engine's cgroup
        the kernel counts a refused fork in the container's own cgroup, gone with it, so
        the peak is read instead."""
        peak = self._file("pids", "pids.peak", "pids.peak")
        return peak is not None and peak.exists() and _read_int(peak) >= self.limits.pids

    def memory_full(self) -> bool:
        """Whether its memory reached the limit (the peak at the cap, within a MiB): with a
        run killed by SIGKILL, the OOM killer's work where the kernel counted the kill in a
        container's own cgroup, gone with it."""
        peak = self._file("memory", "memory.max_usage_in_bytes", "memory.peak")
        if peak is None or not peak.exists():
            return False
        return _read_int(peak) >= self.limits.memory_mb * MIB - MIB

    def usage(self) -> dict[str, float]:
        """For metrics: ``memory_peak_bytes``, ``pids_peak``, ``cpu_s`` (those measured here)."""
        out: dict[str, float] = {}
        mem = self._file("memory", "memory.max_usage_in_bytes", "memory.peak")
        if mem is not None and mem.exists():
            out["memory_peak_bytes"] = _read_int(mem)
        peak = self._file("pids", "pids.peak", "pids.peak")
        if peak is not None and peak.exists():
            out["pids_peak"] = _read_int(peak)
        cpu = self.cpu_seconds()
        if cpu is not None:
            out["cpu_s"] = round(cpu, 3)
        return out

    def procs(self) -> list[int]:
        """Every process in this cgroup (as this PID namespace numbers them)."""
        # A container engine's cgroups (its container's, its monitor's) are made below it.
        return sorted({p for d in self.dirs.values() for sub in _tree(d) for p in _procs(sub)})

    async def kill_all(self, timeout_s: float = 5.0) -> bool:
        """SIGKILL every process of this run (a sandbox's daemons and their forks too) until
        none is left; True once none is."""
        deadline = time.monotonic() + timeout_s
        while pids := self.procs():
            self._kill_at_once()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.01)
        return True

    async def remove(self, timeout_s: float = 2.0) -> bool:
        """The cgroup's folders removed, once no process is left in them (any still there are
        killed first); True when none is left."""
        await self.kill_all(timeout_s)
        deadline = time.monotonic() + timeout_s
        left = dict(self.dirs)
        while left:
            for key, d in list(left.items()):
                try:
                    for sub in _tree(d)[1:][::-1]:  # what an engine made below it, first
                        with contextlib.suppress(OSError):
                            sub.rmdir()
                    d.rmdir()
                except FileNotFoundError:
                    pass
                except OSError as exc:
                    if exc.errno != errno.EBUSY:
                        logger.error("agenttap: the cgroup %s could not be removed: %s", d, exc)
                        return False
                    continue
                del left[key]
            if not left:
                break
            if time.monotonic() > deadline:
                logger.error("agenttap: the cgroup %s still busy after %g s", self.name, timeout_s)
                return False
            await asyncio.sleep(0.01)
        return True


class CgroupV1(RolloutCgroup):
    """cgroup v1: a folder in each of the ``memory``, ``pids`` and ``cpuacct`` hierarchies this
    host lets us write (none: the rlimits alone)."""

    kind = "v1"

    def _configure(self) -> None:
        mem, tasks = self.limits.memory_mb * MIB, str(self.limits.pids)
        if "memory" in self.dirs:
            d = self.dirs["memory"]
            (d / "memory.limit_in_bytes").write_text(str(mem))
            # memory + swap at the same cap: swapping out is no way past it. Without swap
            # accounting (swapaccount=0), at least no preference for swap.
            if (d / "memory.memsw.limit_in_bytes").exists():
                (d / "memory.memsw.limit_in_bytes").write_text(str(mem))
            else:
                with contextlib.suppress(OSError):
                    (d / "memory.swappiness").write_text("0")
            (d / "memory.oom_control").write_text("0")  # the OOM killer on (never a hang)
        if "pids" in self.dirs:
            (self.dirs["pids"] / "pids.max").write_text(tasks)

    def _file(self, key: str, v1_name: str, v2_name: str) -> Path | None:
        return self.dirs[key] / v1_name if key in self.dirs else None

    def cpu_seconds(self) -> float | None:
        if "cpuacct" not in self.dirs:
            return None
        return _read_int(self.dirs["cpuacct"] / "cpuacct.usage") / 1e9


class CgroupV2(RolloutCgroup):
    """cgroup v2: one folder of the unified hierarchy (memory, pids, cpu.stat)."""

    kind = "v2"

    def _configure(self) -> None:
        d = self.dirs["unified"]
        (d / "memory.max").write_text(str(self.limits.memory_mb * MIB))
        if (d / "memory.swap.max").exists():
            (d / "memory.swap.max").write_text("0")
        # An OOM ends the whole run, not one process the agent then works around.
        (d / "memory.oom.group").write_text("1")
        (d / "pids.max").write_text(str(self.limits.pids))

    def _file(self, key: str, v1_name: str, v2_name: str) -> Path | None:
        return self.dirs["unified"] / v2_name

    def cpu_seconds(self) -> float | None:
        return _read_key(self.dirs["unified"] / "cpu.stat", "usage_usec") / 1e6

    def _kill_at_once(self) -> None:
        if (self.dirs["unified"] / "cgroup.kill").exists():
            with contextlib.suppress(OSError):
                (self.dirs["unified"] / "cgroup.kill").write_text("1")


# The class for each kind ``host`` finds ("": no writable cgroup, v1's with no folder).
KINDS: dict[str, type[RolloutCgroup]] = {"v1": CgroupV1, "v2": CgroupV2, "": CgroupV1}
