"""The sandbox a rollout's agent and verifier run in (bubblewrap), and the workdir copies they
work on.

``bwrap_argv`` builds the command line: the host read-only (``--ro-bind / /``: programs anywhere
on the host run), a fresh ``/dev`` and a ``/proc`` of the sandbox's own PID namespace (the
proxy and every other agent are out of sight and out of reach of signals), no capabilities
(``--cap-drop ALL``: we may run as root, and root keeps its capabilities in bwrap otherwise, so
it could unmount what hides a folder), a session of its own, and ``--die-with-parent``. The
network is shared: the agent reaches the proxy on loopback.

Without capabilities a process of uid 0 is still the owner of root's files: ``/proc/sys`` (a
write to ``kernel.core_pattern`` would run a program of its choice as the host's root) and
``/proc/sysrq-trigger`` are bound read-only over the sandbox's ``/proc``, and the sockets of
root's services, which a read-only mount does not close to ``connect`` (``/run``: D-Bus,
systemd, Docker; tmux, ssh-agent and X11 sockets in ``/tmp`` and ``/var/tmp``), are hidden
(``host_sockets``). Then, in this order (a later mount goes on top of an earlier one):

1. each hidden folder (OUT, mitmproxy's confdir, the token file's and log folders, paths of
   ``agenttap_sandbox_hide``) becomes an empty tmpfs and each hidden file ``/dev/null``;
2. the files the agent must still read (the proxy's CA certificate and CA bundle, inside the
   confdir) are bound back read-only at their own paths;
3. the run's own ``work``, ``home`` and scratch ``tmp`` (inside OUT) are bound writable;
4. the hidden folders' tmpfs are made read-only (bwrap created the mount points of 2 and 3 in
   them), so nothing can be written there either.

Every other rollout's folder is in OUT, so it is hidden too. When the sandbox's first process
(the agent) exits, bwrap exits and the kernel kills whatever else is left in its PID namespace
(a daemon started with ``setsid`` included); ``Jail`` finds that namespace's init from bwrap's
``--info-fd`` so the caller can wait until every process of the sandbox is gone.

``copy_seed`` copies a task's workdir for a run: a symlink that resolves inside the workdir is
copied as what it points to; one pointing outside it (or nowhere) refuses the copy.
``restore`` puts paths back from the seed into a finished run's copy before it is scored.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import stat
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

INSTALL_HINT = "apt-get install bubblewrap, or run scripts/setup.sh"
# Parts of /proc that uid 0 may write without capabilities (bwrap covers them only for some
# callers): bound read-only from the host's /proc, where they exist.
PROC_COVERED = ("/proc/sys", "/proc/sysrq-trigger", "/proc/irq", "/proc/bus")
# Where root's services keep their sockets: hidden whole.
SERVICE_SOCKETS = (Path("/run"), Path("/var/run"))
# Scanned (and their folders one level down) for sockets of root's sessions.
TEMP_DIRS = (Path("/tmp"), Path("/var/tmp"))
# How long a sandbox may take to report its PID namespace (bwrap's setup: milliseconds).
INFO_TIMEOUT_S = 30.0


class SandboxUnavailable(ValueError):
    """bwrap is not installed (a ValueError: the request that needs it is refused, 400)."""


class UnsafeWorkdir(ValueError):
    """A seed workdir that cannot be copied safely (a link out of it, a loop, a device)."""


def find_bwrap() -> str:
    """The path of ``bwrap``; SandboxUnavailable, naming the install command, if missing."""
    found = shutil.which("bwrap")
    if found is None:
        raise SandboxUnavailable(
            "agenttap: rollouts run their agent in a bubblewrap sandbox and bwrap is not "
            f'installed: {INSTALL_HINT} (or ask for "sandbox": "none", or set '
            "agenttap_sandbox=none, to run agents unsandboxed, with every right of this user)"
        )
    return found


def host_sockets(temp_dirs: tuple[Path, ...] = TEMP_DIRS) -> tuple[Path, ...]:
    """What to hide so that no socket of root's services or sessions is in reach: ``/run``,
    and each socket in ``temp_dirs`` or in a folder right inside one (``tmux-0/default``,
    ``ssh-XXXX/agent.N``, ``.X11-unix/X0``): that folder whole."""
    found = list(SERVICE_SOCKETS)
    for temp in temp_dirs:
        try:
            entries = list(os.scandir(temp))
        except OSError:
            continue
        for entry in entries:
            try:
                mode = entry.stat(follow_symlinks=False).st_mode
                if stat.S_ISSOCK(mode) or (stat.S_ISDIR(mode) and _holds_socket(entry.path)):
                    found.append(Path(entry.path))
            except OSError:
                continue
    return tuple(found)


def _holds_socket(folder: str) -> bool:
    try:
        with os.scandir(folder) as entries:
            return any(stat.S_ISSOCK(e.stat(follow_symlinks=False).st_mode) for e in entries)
    except OSError:
        return False


@dataclass(frozen=True)
class SandboxSpec:
    """What one sandboxed process may see: ``work`` (also its working directory), ``home`` and
    ``tmp`` writable; ``hide`` hidden (folders empty, files empty); ``expose_files`` readable
    even when inside a hidden folder. Everything else is the host, read-only."""

    work: Path
    home: Path
    tmp: Path
    hide: tuple[Path, ...] = ()
    expose_files: tuple[Path, ...] = ()


def hidden_paths(hide: tuple[Path, ...]) -> list[tuple[Path, bool]]:
    """(absolute real path, is a folder) of each path to hide that exists, without those
    inside another hidden folder (hidden already), parents first."""
    found: dict[Path, bool] = {}
    for path in hide:
        if not str(path):
            continue
        real = Path(os.path.realpath(Path(path).expanduser()))
        if real.is_dir():
            found[real] = True
        elif real.exists():  # a file or a socket: /dev/null over it
            found[real] = False
    folders = [p for p, is_dir in found.items() if is_dir]
    kept = [
        (p, is_dir)
        for p, is_dir in found.items()
        if not any(f != p and p.is_relative_to(f) for f in folders)
    ]
    return sorted(kept, key=lambda item: (len(item[0].parts), str(item[0])))


def bwrap_argv(
    spec: SandboxSpec, command: list[str], bwrap: str = "bwrap", info_fd: int | None = None
) -> list[str]:
    """The bwrap command line that runs ``command`` in ``spec``'s sandbox (see the module's
    docstring for the order of its mounts). ``info_fd``: where bwrap writes its JSON with the
    sandbox's init pid and PID namespace."""
    argv = [
        bwrap,
        "--ro-bind", "/", "/",
        "--dev", "/dev",
        "--proc", "/proc",
        "--unshare-pid", "--unshare-ipc", "--unshare-uts",
        "--die-with-parent",
        "--new-session",
        "--cap-drop", "ALL",
    ]  # fmt: skip
    for covered in PROC_COVERED:
        argv += ["--ro-bind-try", covered, covered]
    hidden = hidden_paths(spec.hide)
    for path, is_dir in hidden:
        argv += ["--tmpfs", str(path)] if is_dir else ["--ro-bind", "/dev/null", str(path)]
    for path in spec.expose_files:
        real = os.path.realpath(path)
        if os.path.isfile(real):
            argv += ["--ro-bind", real, real]
    for path in (spec.work, spec.home, spec.tmp):
        real = os.path.realpath(path)
        argv += ["--bind", real, real]
    # Read-only once the mount points in them exist (the binds above stay as they are).
    for path, is_dir in hidden:
        if is_dir:
            argv += ["--remount-ro", str(path)]
    argv += ["--chdir", os.path.realpath(spec.work)]
    if info_fd is not None:
        argv += ["--info-fd", str(info_fd)]
    return [*argv, "--", *command]


# -- the sandbox's processes ---------------------------------------------------------------------
@dataclass
class Jail:
    """A running sandbox's PID namespace: its init (bwrap's pid 1, as the host numbers it),
    held by a pidfd so its number being reused cannot mislead us, and the namespace's inode.
    The init exits only once every other process of the namespace is gone."""

    init_pid: int
    pid_ns: int
    pidfd: int | None
    _gone: asyncio.Future[None] | None = field(default=None, repr=False)

    @classmethod
    def from_info(cls, info: bytes) -> Jail | None:
        """From bwrap's ``--info-fd`` JSON; None if it reported nothing (it failed to start)."""
        try:
            data = json.loads(info)
            init_pid, pid_ns = int(data["child-pid"]), int(data["pid-namespace"])
        except (ValueError, KeyError, TypeError):
            return None
        try:
            # Read as soon as bwrap has set the sandbox up: its number cannot have been reused
            # yet (pids are handed out in turn, up to pid_max), and from now on it cannot be.
            pidfd: int | None = os.pidfd_open(init_pid)
        except OSError:  # gone already (and reaped): so is every process of its namespace
            pidfd = None
        return cls(init_pid, pid_ns, pidfd)

    def members(self) -> list[int]:
        """Pids (the host's numbers) of the processes in the namespace, its init included."""
        pids = (int(p) for p in os.listdir("/proc") if p.isdigit())
        return [pid for pid in pids if _pid_ns(pid) == self.pid_ns]

    def terminate(self) -> None:
        """SIGTERM to every process of the sandbox but its init: the agent may end cleanly."""
        if self.pidfd is None:
            return
        for pid in self.members():
            if pid != self.init_pid:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL to the init: the kernel kills every process of its namespace."""
        if self.pidfd is not None:
            with contextlib.suppress(OSError):
                signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)

    async def wait_gone(self, timeout: float) -> bool:
        """Wait until the init has exited (then no process of the namespace is left); False
        after ``timeout``. Several callers may wait at once."""
        if self.pidfd is None:
            return True
        if self._gone is None:
            loop = asyncio.get_running_loop()
            self._gone = gone = loop.create_future()
            pidfd = self.pidfd

            def exited() -> None:
                loop.remove_reader(pidfd)
                self.close()
                if not gone.done():
                    gone.set_result(None)

            loop.add_reader(pidfd, exited)
        try:
            await asyncio.wait_for(asyncio.shield(self._gone), timeout)
        except TimeoutError:
            return False
        return True

    def close(self) -> None:
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None


def _pid_ns(pid: int) -> int | None:
    try:
        return os.stat(f"/proc/{pid}/ns/pid").st_ino
    except OSError:
        return None


async def read_info(fd: int) -> bytes:
    """Everything bwrap writes to its ``--info-fd`` (it closes it once the sandbox is set up, or
    exits); ``fd`` is closed after."""

    def read_all() -> bytes:
        chunks = []
        try:
            while chunk := os.read(fd, 65536):
                chunks.append(chunk)
        finally:
            os.close(fd)
        return b"".join(chunks)

    return await asyncio.wait_for(asyncio.to_thread(read_all), INFO_TIMEOUT_S)


# -- workdir copies ------------------------------------------------------------------------------
def check_seed(seed: Path) -> None:
    """Refuse (UnsafeWorkdir) a seed workdir ``copy_seed`` would refuse, copying nothing."""
    _walk(Path(os.path.realpath(seed)), None, seed, ())


def copy_seed(seed: Path, dest: Path) -> None:
    """Copy ``seed`` to ``dest`` (which must not exist): files, folders, and each symlink that
    resolves inside ``seed`` as what it points to (not as a link). UnsafeWorkdir, naming it,
    for a link out of the seed or to nothing, a loop of links, or a special file."""
    _walk(Path(os.path.realpath(seed)), dest, seed, ())


def _walk(real: Path, dest: Path | None, shown: Path, stack: tuple[Path, ...]) -> None:
    """Copy (or, without ``dest``, check) the real folder ``real``; ``shown`` is its path as
    the request named it, for errors; ``stack``: the real folders being copied above it."""
    root = stack[0] if stack else real
    stack = (*stack, real)
    if dest is not None:
        dest.mkdir()
    with os.scandir(real) as entries:
        names = sorted(entry.name for entry in entries)
    for name in names:
        path, named = real / name, shown / name
        target = path
        if path.is_symlink():
            target = Path(os.path.realpath(path))
            if not target.exists():
                raise UnsafeWorkdir(f'"workdir": the symlink {str(named)!r} points to nothing')
            if not target.is_relative_to(root):
                raise UnsafeWorkdir(
                    f'"workdir": the symlink {str(named)!r} points outside the workdir '
                    f"(to {str(target)!r}); only links inside it are copied"
                )
        mode = target.stat().st_mode
        if stat.S_ISDIR(mode):
            if target in stack:
                raise UnsafeWorkdir(f'"workdir": the symlink {str(named)!r} makes a loop')
            _walk(target, dest / name if dest is not None else None, named, stack)
        elif stat.S_ISREG(mode):
            if dest is not None:
                shutil.copy2(target, dest / name)
        else:
            raise UnsafeWorkdir(
                f'"workdir": {str(named)!r} is neither a file nor a folder (a device, pipe or '
                "socket) and is not copied"
            )
    if dest is not None:
        shutil.copystat(real, dest)


def check_restore(paths: object) -> tuple[str, ...]:
    """A verifier's ``restore``: relative paths inside the workdir (``tests/``, ``setup.cfg``),
    normalized; ValueError otherwise."""
    words = '"restore" must be a list of relative paths inside the workdir, such as "tests/"'
    if not isinstance(paths, list):
        raise ValueError(words)
    kept = []
    for path in paths:
        if not isinstance(path, str) or not path.strip() or "\0" in path:
            raise ValueError(words)
        pure = PurePosixPath(path)
        if pure.is_absolute() or ".." in pure.parts or not pure.parts:
            raise ValueError(f"{words}; not {path!r}")
        kept.append(str(pure))
    return tuple(kept)


def restore(seed: Path, work: Path, paths: tuple[str, ...]) -> None:
    """Put each of ``paths`` back from ``seed`` into ``work``: whatever is there now goes (a
    link is removed, never followed), the seed's copy comes in; a path missing in the seed is
    removed from ``work``. Every process that could change ``work`` must be gone."""
    for path in paths:
        parts = PurePosixPath(path).parts
        parent = work
        for part in parts[:-1]:  # the folders above it: real folders, not links out of work
            parent = parent / part
            if parent.is_symlink() or (parent.exists() and not parent.is_dir()):
                parent.unlink()
            parent.mkdir(exist_ok=True)
        target = parent / parts[-1]
        if target.is_symlink() or (target.exists() and not target.is_dir()):
            target.unlink()
        elif target.is_dir():
            shutil.rmtree(target)
        source = seed / path
        if not (source.is_symlink() or source.exists()):
            continue
        root, real = Path(os.path.realpath(seed)), Path(os.path.realpath(source))
        if not real.is_relative_to(root) or not real.exists():
            raise UnsafeWorkdir(f'"restore": {path!r} points outside the seed workdir or nowhere')
        if real.is_dir():
            _walk(real, target, source, (root,))
        else:
            shutil.copy2(real, target)
