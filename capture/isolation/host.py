"""What the kernel gives this host for a rollout's limits, found once by trying: the cgroup
kind (v1 or v2) and this instance's folder in each hierarchy, ``prlimit``, tmpfs mounts.

``mechanism()`` is the start-up log's line saying which limits apply (as root with writable
cgroups: all; otherwise what is missing and what still applies). cgroups are made under this
process's own cgroup in each hierarchy, in ``agenttap/<instance>/<run>``, the instance being
this process (its PID namespace, pid and start time); ``remove_stale()`` at start removes what a
crashed instance of the same PID namespace left (its processes killed, its tmpfs detached).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import re
import shutil
import signal
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from capture.isolation.limits import MIB

CONTROLLERS = ("memory", "pids", "cpuacct")
PARENT = "agenttap"
# Free space below this on a run's tmpfs means its disk limit was hit (a write that did not fit
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
