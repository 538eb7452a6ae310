"""A rollout's hard limits, enforced by the kernel (issue 37, "Limits"): what a request's
``"limits"`` may say (``parse_sandbox_limits`` → ``SandboxLimits``) and the mechanisms.

Per agent or verifier run (one sandboxed process group):

- ``RolloutCgroup``: a cgroup of its own, made before the run starts. cgroup v1 (``memory`` with
  swap counted, so swap is no escape, and the OOM killer on; ``pids``; ``cpuacct`` for the CPU
  seconds of all its processes together), or v2 where the unified hierarchy holds ``memory`` and
  ``pids``. ``launch_prefix()`` is an argv put before the real command: it moves itself into the
  cgroup(s), applies ``prlimit`` (RLIMIT_CPU per process, a backstop to the cgroup's total;
  RLIMIT_FSIZE per file, a backstop to the disk cap; no core files) and execs the rest. The
  memory limit is the cgroup's, never RLIMIT_AS: V8 reserves far more address space than it
  uses, so a Node CLI under a small RLIMIT_AS does not even start.
- ``DiskQuota``: a size-capped tmpfs for the run's work, HOME and TMPDIR, copied out to real disk
  (``unmount_keeping``) when the run ends.
- ``OutputPump``: the agent's stdout and stderr into its log, kept to ``output_mb``.
- ``watch``: polls the kernel's counters and returns the first limit hit, by its name
  (``LIMIT_NAMES``), for the rollout's ``finish_reason: "limit"``; ``limit_hit`` is one look
  (again once the run ended).

``mechanism()`` is the start-up log's line saying which of these apply on this host (as root
with writable cgroups: all; otherwise what is missing and what still applies). cgroups are made
under this process's own cgroup in each hierarchy, in ``agenttap/<instance>/<run>``, the
instance being this process (its PID namespace, pid and start time); ``remove_stale()`` at
start removes what a crashed instance of the same PID namespace left (its processes killed).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import itertools
import logging
import math
import os
import re
import shutil
import signal
import stat
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from capture.control.sessions import reject_unknown

logger = logging.getLogger(__name__)

MIB = 1 << 20
# The keys of a rollout's "limits" this module reads; SESSION_LIMIT_KEYS are the session's
# (capture/control/sessions.py), allowed beside them and left to it.
SANDBOX_LIMIT_KEYS = ("memory_mb", "pids", "disk_mb", "cpu_s", "output_mb")
SESSION_LIMIT_KEYS = ("max_calls", "max_tokens", "deadline_s")
# What ``watch`` and ``RolloutCgroup.exceeded`` name.
LIMIT_NAMES = ("memory", "pids", "cpu_s", "disk", "output")
# The largest whole-number limit (MiB, tasks): a PiB, past any machine and no overflow in bytes.
MAX_WHOLE = 1 << 30
MAX_CPU_S = 1e9


@dataclass(frozen=True)
class SandboxLimits:
    """One run's limits (an agent's or a verifier's). The defaults, for an agent CLI:

    - ``memory_mb`` 4096: Node CLIs (Claude Code, Codex, Gemini CLI) use 300-600 MB in a
      session (``gemini --version`` alone peaks at 270 MB), the tools they run (a test suite,
      pip, a compiler) more; and the run's tmpfs pages are charged to
      the same cgroup (the kernel charges shmem to whoever wrote it), so this must hold
      ``disk_mb`` and the processes at once: 2 GiB of files and 2 GiB of processes.
    - ``pids`` 512: the kernel counts threads (a Node process alone has about a dozen); enough
      for a CLI, its shells and a parallel test run, and a fork bomb stops there.
    - ``disk_mb`` 2048: a repository checkout with a virtualenv or node_modules. It is RAM
      (tmpfs), charged to ``memory_mb`` too, hence below it.
    - ``cpu_s`` 3600: CPU seconds of every process together; a rollout's default wall-clock
      timeout is 3600 s, so a single busy core for the whole run fits.
    - ``output_mb`` 16: the agent's log is for a person to read; a CLI's stream-JSON output of a
      long session is a few MB.
    """

    memory_mb: int = 4096
    pids: int = 512
    disk_mb: int = 2048
    cpu_s: float = 3600.0
    output_mb: int = 16

    def as_dict(self) -> dict[str, float]:
        return {k: getattr(self, k) for k in SANDBOX_LIMIT_KEYS}


def parse_sandbox_limits(value: Any, defaults: SandboxLimits) -> SandboxLimits:
    """A request's ``"limits"`` object read for the sandbox's keys (``SANDBOX_LIMIT_KEYS``,
    each optional: ``defaults`` fills what is missing); the session's keys are allowed and left
    alone, any other key is a ``ValueError`` naming the known ones, as is a bad value."""
    if value is None:
        return defaults
    if not isinstance(value, dict):
        raise ValueError(
            f'"limits" must be an object with any of {", ".join(SANDBOX_LIMIT_KEYS)}, '
            f"{', '.join(SESSION_LIMIT_KEYS)}; got {value!r}"
        )
    reject_unknown(value, (*SANDBOX_LIMIT_KEYS, *SESSION_LIMIT_KEYS), '"limits" key')
    changes: dict[str, Any] = {}
    units = {"memory_mb": " (MiB)", "pids": " (tasks)", "disk_mb": " (MiB)", "output_mb": " (MiB)"}
    for key, unit in units.items():
        if key not in value:
            continue
        v = value[key]
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= MAX_WHOLE:
            raise ValueError(
                f'"limits.{key}" must be a whole number from 1 to {MAX_WHOLE}{unit}, not {v!r}; '
                f"leave it out for the default ({getattr(defaults, key)})"
            )
        changes[key] = v
    if "cpu_s" in value:
        v = value["cpu_s"]
        if (
            isinstance(v, bool)
            or not isinstance(v, int | float)
            or not math.isfinite(v)
            or not 0 < v <= MAX_CPU_S
        ):
            raise ValueError(
                f'"limits.cpu_s" must be a number of CPU seconds > 0 and at most {MAX_CPU_S:g}, '
                f"not {v!r}; leave it out for the default ({defaults.cpu_s:g})"
            )
        changes["cpu_s"] = float(v)
    return replace(defaults, **changes)


# ---------------------------------------------------------------- the host: what applies here

CONTROLLERS = ("memory", "pids", "cpuacct")
PARENT = "agenttap"
# Free space below this on a run's tmpfs means its disk limit was hit (a write that did not fit
# leaves at most a partial page free).
FULL_SLACK_BYTES = 256 * 1024
# How long an unmount waits for the last open file of a run to close before detaching it.
UNMOUNT_RETRY_S = 1.0
# A degraded disk quota (a plain folder) is measured by walking it: at most this often.
DEGRADED_WALK_EVERY_S = 5.0

_MS_NOSUID, _MS_NODEV, _MNT_DETACH = 2, 4, 2


@dataclass
class _Host:
    """What this host gives (found once, by trying): the cgroup kind, this instance's folder in
    each hierarchy, prlimit, tmpfs mounts, and why anything is missing."""

    kind: str  # "v1", "v2" or "" (no cgroup)
    bases: dict[str, Path]  # v1: controller → instance folder; v2: {"unified": instance folder}
    prlimit: str | None
    tmpfs: bool
    notes: list[str]


_host_cache: _Host | None = None
_run_numbers = itertools.count(1)


def _unescape(field: str) -> str:
    """mountinfo's octal escapes (a space is ``\\040``)."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), field)


def _start_time(pid: int) -> str | None:
    """A process's start time (clock ticks after boot): with its pid, it names one process."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The name (field 2) may hold spaces and parentheses: count from its closing one.
    return text[text.rindex(")") + 2 :].split()[19]


def _pid_ns() -> str:
    return str(os.stat("/proc/self/ns/pid").st_ino)


def instance_tag() -> str:
    """This agenttap process: its PID namespace, pid and start time."""
    return f"{_pid_ns()}-{os.getpid()}-{_start_time(os.getpid())}"


def _stale(tag: str) -> bool:
    """Whether the instance ``tag`` names is gone: of this PID namespace, and its process dead
    (or its pid reused). An instance of another namespace is never judged from here."""
    parts = tag.split("-")
    if len(parts) != 3 or parts[0] != _pid_ns() or not parts[1].isdigit():
        return False
    return _start_time(int(parts[1])) != parts[2]


def _cgroup_dirs() -> tuple[dict[str, Path], Path | None]:
    """This process's own cgroup folder in each v1 hierarchy of ``CONTROLLERS``, and in v2."""
    mounts: dict[str, tuple[Path, str]] = {}
    unified: tuple[Path, str] | None = None
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        f, r = left.split(), right.split()
        if len(f) < 5 or len(r) < 3:
            continue
        point, root = Path(_unescape(f[4])), _unescape(f[3])
        if r[0] == "cgroup":
            for c in r[2].split(","):
                if c in CONTROLLERS:
                    mounts.setdefault(c, (point, root))
        elif r[0] == "cgroup2" and unified is None:
            unified = (point, root)
    own: dict[str, str] = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        hid, ctrls, path = line.split(":", 2)
        for c in ctrls.split(",") if ctrls else [""]:
            own[c] = path

    def folder(mount: tuple[Path, str], path: str | None) -> Path:
        point, root = mount
        top = root.rstrip("/") + "/"
        if path is None or "/.." in path or not (path == root or path.startswith(top)):
            return point  # outside the mount's view (a cgroup namespace): its top
        return point / path[len(top) - 1 :].lstrip("/")

    v1 = {c: folder(m, own.get(c)) for c, m in mounts.items()}
    v2 = folder(unified, own.get("")) if unified is not None else None
    return v1, v2


def _try_v1(v1: dict[str, Path], tag: str, notes: list[str]) -> dict[str, Path]:
    bases: dict[str, Path] = {}
    for c in CONTROLLERS:
        if c not in v1:
            notes.append(f"no cgroup v1 {c} hierarchy")
            continue
        base = v1[c] / PARENT / tag
        try:
            base.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            notes.append(f"cgroup v1 {c} not writable ({base.parent}: {exc.strerror})")
            continue
        bases[c] = base
    return bases


def _try_v2(own: Path, tag: str, notes: list[str]) -> Path | None:
    try:
        have = (own / "cgroup.controllers").read_text().split()
    except OSError as exc:
        notes.append(f"cgroup v2 at {own} unreadable ({exc.strerror})")
        return None
    missing = [c for c in ("memory", "pids") if c not in have]
    if missing:
        notes.append(f"cgroup v2 at {own} has no {' or '.join(missing)} controller")
        return None
    base = own / PARENT / tag
    try:
        # Each level hands memory and pids to its children. The kernel refuses this (EBUSY) on
        # a non-root cgroup that holds processes: run agenttap in a leaf of a delegated one.
        for level in (own, own / PARENT, base):
            level.mkdir(exist_ok=True)
            (level / "cgroup.subtree_control").write_text("+memory +pids")
    except OSError as exc:
        notes.append(f"cgroup v2 controllers cannot be given to children of {own} ({exc.strerror})")
        return None
    return base


def _probe_tmpfs(notes: list[str]) -> bool:
    if os.geteuid() != 0:
        notes.append(f"tmpfs mounts need root (euid {os.geteuid()})")
        return False
    with tempfile.TemporaryDirectory(prefix="agenttap-probe-") as d:
        try:
            _mount_tmpfs(Path(d), "agenttap-probe", 1)
        except OSError as exc:
            notes.append(f"tmpfs cannot be mounted ({exc.strerror})")
            return False
        _umount(Path(d), detach=True)
    return True


def _host() -> _Host:
    """What applies on this host, found on first use (folders made, a tmpfs tried)."""
    global _host_cache
    if _host_cache is not None:
        return _host_cache
    notes: list[str] = []
    tag = instance_tag()
    v1, v2 = _cgroup_dirs()
    kind, bases = "", _try_v1(v1, tag, notes)
    if "memory" in bases and "pids" in bases:
        kind = "v1"
    else:
        unified = _try_v2(v2, tag, notes) if v2 is not None else None
        if unified is not None:
            for base in bases.values():
                with contextlib.suppress(OSError):
                    base.rmdir()
            kind, bases = "v2", {"unified": unified}
        elif bases:
            kind = "v1"
    prlimit = shutil.which("prlimit")
    if prlimit is None:
        notes.append("prlimit not found (util-linux)")
    _host_cache = _Host(kind, bases, prlimit, _probe_tmpfs(notes), notes)
    return _host_cache


def mechanism() -> str:
    """One line for the start-up log: which limit mechanisms apply on this host, and what is not
    enforced (and why) where something is missing."""
    h = _host()
    parts = []
    if h.kind == "v1":
        names = [c + (" (swap counted)" if c == "memory" else "") for c in h.bases]
        where = ", ".join(str(base.parent) for base in h.bases.values())
        parts.append(f"cgroup v1 {' + '.join(names)} per run (under {where})")
    elif h.kind == "v2":
        parts.append(f"cgroup v2 memory + pids + cpu.stat per run ({h.bases['unified'].parent})")
    missing = [
        what
        for what, ok in (
            ("memory", "memory" in h.bases or h.kind == "v2"),
            ("pids", "pids" in h.bases or h.kind == "v2"),
            ("total cpu_s", "cpuacct" in h.bases or h.kind == "v2"),
        )
        if not ok
    ]
    if h.prlimit:
        parts.append("prlimit cpu/fsize/core per process")
    parts.append(
        "disk: size-capped tmpfs per run"
        if h.tmpfs
        else f"disk: a plain folder, RLIMIT_FSIZE per file, its size checked every "
        f"{DEGRADED_WALK_EVERY_S:g} s (no hard cap)"
    )
    line = "agenttap limits: " + ", ".join(parts)
    if missing:
        line += f"; NOT enforced: {', '.join(missing)}"
    if h.notes:
        line += f" ({'; '.join(h.notes)})"
    return line


def _procs(folder: Path) -> list[int]:
    try:
        return [int(p) for p in (folder / "cgroup.procs").read_text().split()]
    except OSError:
        return []


def _kill_folder_sync(folder: Path, timeout_s: float) -> bool:
    """SIGKILL every process of a cgroup until none is left (a fork racing the kill is caught
    on the next round); True once it is empty."""
    deadline = time.monotonic() + timeout_s
    while pids := _procs(folder):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _rmdir_sync(folder: Path, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            folder.rmdir()
            return True
        except FileNotFoundError:
            return True
        except OSError as exc:
            # EBUSY: a process that just died is still leaving it.
            if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                return False
        time.sleep(0.01)


def cap_instance_memory(total_mb: int) -> str:
    """Cap this instance's parent cgroup (every run's cgroup is made under it) at ``total_mb``:
    what all its runs use together, whatever each was promised. One line for the log."""
    h = _host()
    try:
        if h.kind == "v2":
            (h.bases["unified"] / "memory.max").write_text(str(total_mb * MIB))
        elif "memory" in h.bases:
            d = h.bases["memory"]
            (d / "memory.limit_in_bytes").write_text(str(total_mb * MIB))
            if (d / "memory.memsw.limit_in_bytes").exists():
                (d / "memory.memsw.limit_in_bytes").write_text(str(total_mb * MIB))
        else:
            return f"rollouts' total memory: {total_mb} MiB promised at most (no memory cgroup)"
    except OSError as exc:
        return f"rollouts' total memory: {total_mb} MiB promised at most; NOT capped ({exc})"
    return f"rollouts' total memory: {total_mb} MiB, promised and capped (the parent cgroup)"


def remove_stale() -> list[str]:
    """What instances of agenttap in this PID namespace left behind when they died (a crash, a
    SIGKILL): their runs' cgroups (every process in them killed) and tmpfs mounts (detached:
    their contents are lost, as the runs were). Call at start; returns what it removed, for the
    log. Instances still running, and those of other PID namespaces, are left alone."""
    removed: list[str] = []
    v1, v2 = _cgroup_dirs()
    parents = [d / PARENT for d in v1.values()] + ([v2 / PARENT] if v2 is not None else [])
    for parent in parents:
        try:
            instances = [p for p in parent.iterdir() if p.is_dir() and _stale(p.name)]
        except OSError:
            continue
        for inst in instances:
            runs = [p for p in inst.iterdir() if p.is_dir()]
            for run in runs:
                _kill_folder_sync(run, 5.0)
                if _rmdir_sync(run, 1.0):
                    removed.append(str(run))
            if _rmdir_sync(inst, 1.0):
                removed.append(str(inst))
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        r = right.split()
        if len(r) >= 2 and r[0] == "tmpfs" and r[1].startswith("agenttap-"):
            tag = r[1].removeprefix("agenttap-")
            if _stale(tag):
                point = Path(_unescape(left.split()[4]))
                with contextlib.suppress(OSError):
                    _umount(point, detach=True)
                    removed.append(f"tmpfs {point}")
    return removed


def release() -> None:
    """This instance's own (empty) folders removed, at shutdown once every run's cgroup is."""
    global _host_cache
    if _host_cache is None:
        return
    for base in _host_cache.bases.values():
        with contextlib.suppress(OSError):
            base.rmdir()
    _host_cache = None


# ---------------------------------------------------------------- a run's cgroup


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
    """One run's cgroup (an agent's or a verifier's processes), made before it starts."""

    def __init__(self, name: str, limits: SandboxLimits, kind: str, dirs: dict[str, Path]):
        self.name = name
        self.limits = limits
        self.kind = kind
        self.dirs = dirs

    @classmethod
    def create(cls, name: str, limits: SandboxLimits) -> RolloutCgroup:
        """A fresh cgroup named after ``name`` (made safe, a number added so it is unique) with
        ``limits`` set; with no writable cgroup on this host, one with no folder (the rlimits of
        ``launch_prefix`` still apply; ``mechanism()`` says so). OSError if the kernel refuses
        a limit."""
        h = _host()
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", name)[:64].lstrip(".") or "run"
        folder = f"{safe}-{next(_run_numbers)}"
        made = cls(folder, limits, h.kind, {})
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

    def _configure(self) -> None:
        mem, tasks = self.limits.memory_mb * MIB, str(self.limits.pids)
        if self.kind == "v2":
            d = self.dirs["unified"]
            (d / "memory.max").write_text(str(mem))
            if (d / "memory.swap.max").exists():
                (d / "memory.swap.max").write_text("0")
            # An OOM ends the whole run, not one process the agent then works around.
            (d / "memory.oom.group").write_text("1")
            (d / "pids.max").write_text(tasks)
            return
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

    def launch_prefix(self) -> list[str]:
        """An argv to put before the run's command (``setpriv ...``, ``bwrap ...``), started as
        root: it joins this cgroup, applies the rlimits and execs the command, whatever its
        arguments (they are passed on as they are, never read by a shell). Exit 125 if it could
        not join."""
        procs = [str(d / "cgroup.procs") for d in self.dirs.values()]
        join = ["/bin/sh", "-c", _JOIN, "agenttap-limits", str(len(procs)), *procs] if procs else []
        return [*join, *rlimit_argv(self.limits)]

    def _file(self, key: str, v1_name: str, v2_name: str) -> Path | None:
        if self.kind == "v2":
            return self.dirs["unified"] / v2_name
        return self.dirs[key] / v1_name if key in self.dirs else None

    def oom_kills(self) -> int:
        p = self._file("memory", "memory.oom_control", "memory.events")
        return _read_key(p, "oom_kill") if p is not None else 0

    def pids_refused(self) -> int:
        """Forks the pids limit refused so far."""
        p = self._file("pids", "pids.events", "pids.events")
        return _read_key(p, "max") if p is not None else 0

    def cpu_seconds(self) -> float | None:
        """CPU time of every process this run had, together (None: not measured here)."""
        if self.kind == "v2":
            return _read_key(self.dirs["unified"] / "cpu.stat", "usage_usec") / 1e6
        if "cpuacct" not in self.dirs:
            return None
        return _read_int(self.dirs["cpuacct"] / "cpuacct.usage") / 1e9

    def exceeded(self) -> str | None:
        """The limit this run has hit so far, by the kernel's own counters: "memory" (a process
        was OOM-killed; failcnt is not used: reclaiming page cache at the limit counts there
        too), "pids" (a fork was refused), "cpu_s" (their CPU time together reached the limit),
        or None."""
        if self.oom_kills() > 0:
            return "memory"
        if self.pids_refused() > 0:
            return "pids"
        cpu = self.cpu_seconds()
        if cpu is not None and cpu >= self.limits.cpu_s:
            return "cpu_s"
        return None

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
        return sorted({p for d in self.dirs.values() for p in _procs(d)})

    async def kill_all(self, timeout_s: float = 5.0) -> bool:
        """SIGKILL every process of this run (a sandbox's daemons and their forks too) until
        none is left; True once none is."""
        deadline = time.monotonic() + timeout_s
        while pids := self.procs():
            if self.kind == "v2" and (self.dirs["unified"] / "cgroup.kill").exists():
                with contextlib.suppress(OSError):
                    (self.dirs["unified"] / "cgroup.kill").write_text("1")
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


# ---------------------------------------------------------------- a run's disk


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _mount_tmpfs(path: Path, source: str, size_mb: int) -> None:
    # Inodes capped too: empty files cost no blocks, and each is kernel memory.
    data = f"size={size_mb}m,nr_inodes={max(1024, size_mb * 256)},mode=0755"
    flags = _MS_NOSUID | _MS_NODEV
    if _libc().mount(source.encode(), str(path).encode(), b"tmpfs", flags, data.encode()) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e), str(path))


def _umount(path: Path, detach: bool = False) -> None:
    if _libc().umount2(str(path).encode(), _MNT_DETACH if detach else 0) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e), str(path))


def _tree_bytes(root: Path) -> int:
    """Bytes a folder takes on disk (blocks; each inode once; links never followed)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    stack = [str(root)]
    while stack:
        with contextlib.suppress(OSError), os.scandir(stack.pop()) as it:
            for e in it:
                with contextlib.suppress(OSError):
                    st = e.stat(follow_symlinks=False)
                    if (st.st_dev, st.st_ino) in seen:
                        continue
                    seen.add((st.st_dev, st.st_ino))
                    total += st.st_blocks * 512
                    if stat.S_ISDIR(st.st_mode):
                        stack.append(e.path)
    return total


class DiskQuota:
    """A folder (for a run's work, HOME and TMPDIR) holding at most ``disk_mb``: a tmpfs of that
    size, mounted by root; where mounting is not allowed, a plain folder (the rlimits' per-file
    RLIMIT_FSIZE then, and a walk of the folder now and then for ``full``)."""

    def __init__(self, path: Path, size_bytes: int, mounted: bool) -> None:
        self.path = path
        self.size_bytes = size_bytes
        self.mounted = mounted
        self._walked: tuple[float, int] | None = None

    @classmethod
    def mount(cls, path: Path, disk_mb: int) -> DiskQuota:
        """Make ``path`` (it must be missing or an empty folder) a tmpfs of ``disk_mb`` MiB,
        mode 0755, owned by root, no setuid and no device files; ``mounted`` says whether it is.
        Blocking (a mount call): from async code, in a thread or between awaits."""
        path.mkdir(parents=True, exist_ok=True)
        if any(path.iterdir()):
            raise ValueError(f"agenttap: the disk quota's folder {path} is not empty")
        mounted = False
        if _host().tmpfs:
            _mount_tmpfs(path, f"agenttap-{instance_tag()}", disk_mb)
            mounted = True
        return cls(path, disk_mb * MIB, mounted)

    def used_bytes(self) -> int:
        if not self.mounted:
            return _tree_bytes(self.path)
        st = os.statvfs(self.path)
        return (st.f_blocks - st.f_bfree) * st.f_frsize

    def full(self) -> bool:
        """Whether the disk limit was hit: (almost) no space or no inode left."""
        if self.mounted:
            st = os.statvfs(self.path)
            return st.f_bavail * st.f_frsize < FULL_SLACK_BYTES or st.f_favail == 0
        now = time.monotonic()
        if self._walked is None or now - self._walked[0] > DEGRADED_WALK_EVERY_S:
            self._walked = (now, _tree_bytes(self.path))
        return self._walked[1] >= self.size_bytes - FULL_SLACK_BYTES

    def unmount_keeping(self, names: list[str] | tuple[str, ...], into: Path) -> list[str]:
        """Copy the named subfolders out to ``into`` (same names; modes, owners and times kept,
        setuid and setgid bits dropped, symlinks copied as symlinks and never followed, hard
        links kept as hard links, holes kept: nothing grows on the way out), then unmount (the
        rest is gone). ``into/<name>`` must not exist. Every process of the run must be gone
        first (an open file keeps the mount busy: after a short retry it is detached). Returns
        what was not copied: FIFOs, sockets, device files. A plain folder (not mounted) has its
        named subfolders moved and the rest deleted. Blocking: run it in a thread."""
        skipped: list[str] = []
        for name in names:
            if not name or "/" in name or name in (".", ".."):
                raise ValueError(f"agenttap: {name!r} is not a folder name")
        try:
            for name in names:
                src, dst = self.path / name, into / name
                if not os.path.lexists(src):
                    continue
                if self.mounted:
                    _copy_tree(src, dst, skipped)
                else:
                    os.rename(src, dst)
        finally:  # a failed copy (the real disk full) still frees the run's RAM
            self._discard()
        return skipped

    def _discard(self) -> None:
        """Unmount (a tmpfs) or empty (a plain folder) what is left."""
        if self.mounted:
            deadline = time.monotonic() + UNMOUNT_RETRY_S
            while True:
                try:
                    _umount(self.path)
                    break
                except OSError as exc:
                    if exc.errno != errno.EBUSY:
                        raise
                    if time.monotonic() > deadline:
                        logger.error("agenttap: %s still in use: detached", self.path)
                        _umount(self.path, detach=True)
                        break
                time.sleep(0.02)
            self.mounted = False
        else:
            for entry in list(self.path.iterdir()):
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    with contextlib.suppress(OSError):
                        entry.unlink()


def _copy_meta(dst: Path, st: os.stat_result) -> None:
    os.chown(dst, st.st_uid, st.st_gid, follow_symlinks=False)
    if not stat.S_ISLNK(st.st_mode):
        # No setuid or setgid bit reaches the host's disk (a root-owned one would be a gift).
        os.chmod(dst, stat.S_IMODE(st.st_mode) & 0o1777)
    os.utime(dst, ns=(st.st_atime_ns, st.st_mtime_ns), follow_symlinks=False)


def _copy_file(src: Path, dst: Path) -> None:
    """A regular file's data, its holes kept (a sparse 1 TB file stays a few bytes on disk)."""
    fin = os.open(src, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        fout = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            pos = 0
            while True:
                try:
                    start = os.lseek(fin, pos, os.SEEK_DATA)
                except OSError as exc:
                    if exc.errno == errno.ENXIO:  # no data past pos
                        break
                    raise
                end = os.lseek(fin, start, os.SEEK_HOLE)
                os.lseek(fout, start, os.SEEK_SET)
                while start < end:
                    sent = os.sendfile(fout, fin, start, end - start)
                    if sent == 0:
                        break
                    start += sent
                pos = end
            os.ftruncate(fout, os.fstat(fin).st_size)
        finally:
            os.close(fout)
    finally:
        os.close(fin)


def _copy_tree(src: Path, dst: Path, skipped: list[str]) -> None:
    """``src`` (a folder, a file or a symlink) copied to ``dst``, without recursion (a deep tree
    is no stack overflow) and without following any link. What cannot be copied (a path past
    PATH_MAX, a name the disk refuses) is left out with why, in ``skipped``, and the rest kept."""
    linked: dict[tuple[int, int], Path] = {}
    folders: list[tuple[Path, os.stat_result]] = []
    stack: list[tuple[Path, Path]] = []
    _copy_entry(src, dst, stack, folders, linked, skipped)  # its own failure is the caller's
    while stack:
        s, d = stack.pop()
        try:
            _copy_entry(s, d, stack, folders, linked, skipped)
        except OSError as exc:
            skipped.append(f"{s} ({exc.strerror or exc})")
    for d, st in reversed(folders):
        with contextlib.suppress(OSError):
            _copy_meta(d, st)


def _copy_entry(
    s: Path,
    d: Path,
    stack: list[tuple[Path, Path]],
    folders: list[tuple[Path, os.stat_result]],
    linked: dict[tuple[int, int], Path],
    skipped: list[str],
) -> None:
    """One entry of ``_copy_tree``: a folder's children go on ``stack``."""
    st = os.lstat(s)
    if stat.S_ISDIR(st.st_mode):
        os.mkdir(d, 0o700)
        folders.append((d, st))  # its mode last: a read-only folder is filled first
        with os.scandir(s) as it:
            stack.extend((Path(e.path), d / e.name) for e in it)
    elif stat.S_ISLNK(st.st_mode):
        os.symlink(os.readlink(s), d)
        _copy_meta(d, st)
    elif stat.S_ISREG(st.st_mode):
        key = (st.st_dev, st.st_ino)
        if key in linked:
            os.link(linked[key], d)
            return
        _copy_file(s, d)
        _copy_meta(d, st)
        if st.st_nlink > 1:
            linked[key] = d
    else:
        skipped.append(f"{s} (a FIFO, socket or device)")


# ---------------------------------------------------------------- a run's output


class OutputPump:
    """An agent's stdout and stderr (one pipe) into its log, at most ``cap_bytes`` of it: the
    first part written as it comes, the last ``tail_bytes`` kept in memory and written when the
    pipe closes, after a line saying how much was dropped in between. So the log ends with the
    latest output and holds at most ``cap_bytes`` plus that line. Past the cap, ``hit`` is set
    (and ``event``) and the pipe is still read to its end, so the agent never blocks on it
    before the runner stops it."""

    def __init__(self, log_path: Path, cap_bytes: int, tail_bytes: int | None = None) -> None:
        self.log_path = log_path
        self.cap_bytes = cap_bytes
        self.tail_bytes = min(cap_bytes // 4, 256 * 1024) if tail_bytes is None else tail_bytes
        self.head_bytes = cap_bytes - self.tail_bytes
        self.total = 0
        self.hit = False
        self.event = asyncio.Event()
        self._tail = bytearray()

    async def run(self, source: asyncio.StreamReader | int) -> bool:
        """Read ``source`` (a StreamReader, or a pipe's read end, which is then closed) to its
        end; True if the output limit was hit."""
        reader = await _reader_of(source) if isinstance(source, int) else source
        with open(self.log_path, "wb") as log:
            while chunk := await reader.read(64 * 1024):
                self._take(chunk, log)
            dropped = self.total - self.head_bytes - len(self._tail)
            if dropped > 0:
                log.write(
                    f"\n[agenttap: output limit of {self.cap_bytes} bytes reached: {dropped} bytes "
                    f"dropped here, the last {len(self._tail)} follow]\n".encode()
                )
            log.write(self._tail)
        return self.hit

    def _take(self, chunk: bytes, log: Any) -> None:
        head_left = self.head_bytes - min(self.total, self.head_bytes)
        self.total += len(chunk)
        if head_left > 0:
            log.write(chunk[:head_left])  # a local file: page cache, no wait worth a thread
            chunk = chunk[head_left:]
        if chunk:
            self._tail += chunk
            if len(self._tail) > self.tail_bytes:
                del self._tail[: len(self._tail) - self.tail_bytes]
        if self.total > self.cap_bytes and not self.hit:
            self.hit = True
            self.event.set()


async def _reader_of(fd: int) -> asyncio.StreamReader:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=1 << 20)
    await loop.connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(fd, "rb", buffering=0)
    )
    return reader


async def pump_output(source: asyncio.StreamReader | int, log_path: Path, cap_bytes: int) -> bool:
    """``OutputPump(log_path, cap_bytes).run(source)``: True if the output limit was hit."""
    return await OutputPump(log_path, cap_bytes).run(source)


# ---------------------------------------------------------------- all of them, watched


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
