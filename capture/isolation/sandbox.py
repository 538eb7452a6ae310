"""The bubblewrap engine's sandbox: the allowlisted mounts of a rollout's agent or verifier,
bwrap's command line (``bwrap_argv``, ``sandbox_argv``) and the sandbox's processes (``Jail``).

``bwrap_argv`` builds the command line. The sandbox's tree is built from an allowlist, not from
the host with holes cut in it: a fresh root holding only

- the system's programs and libraries read-only (``/usr``, ``/bin``, ``/sbin``, ``/lib*``;
  the merged-usr links as links) and ``/etc`` without its secrets (``ETC_SECRETS``: shadow
  files, sudoers, ssh host keys, TLS private keys);
- what ``expose`` names, read-only: the agent program's own install (``program_paths``: a
  ``node_modules`` tree, a venv and its base Python, a prefix), the CA certificate and bundle,
  the rollout's ``"expose"`` and ``agenttap_sandbox_expose``;
- the run's own ``work``, ``home`` and scratch ``tmp``, writable, at ``/workdir``,
  ``/home/agent`` and ``/tmp/agent`` (capture/isolation/places.py: an agent's prompt, which
  names its working folder, is then the same wherever OUT is) or at their host paths; a fresh
  ``/tmp`` and
  ``/var/tmp`` (tmpfs, size-capped with ``tmp_size_mb``), a fresh ``/dev`` and a ``/proc`` of
  its own PID namespace;
- ``bridge``, read-only at ``/.agenttap``: the unix sockets that lead to the proxy and the API
  (capture/isolation/netbridge.py) and the forwarder run inside (capture/isolation/bridge.py).

Nothing else: not ``/root``, ``/home``, the host's ``/tmp``, ``/srv``, ``/mnt``, ``/opt``, OUT,
the proxy's folders, model or checkpoint folders. Paths of ``hide`` that lie inside an exposed
path (OUT inside an exposed checkout, say) are hidden again: an empty read-only tmpfs, a file
``/dev/null``.

It has its own user namespace (``--unshare-user``, no nested one: ``--disable-userns``), network
namespace (``--unshare-net``: only its loopback; the forwarder hands the proxy's and the API's
ports in), PID, IPC, UTS and cgroup namespaces, no capabilities, a session of its own and
``--die-with-parent``. The caller runs bwrap under a uid that owns nothing on the host
(``SANDBOX_UID``, when agenttap runs as root), so a root-owned 0600 file is unreadable even if
exposed by mistake. ``/proc/sys`` and ``/proc/sysrq-trigger`` are bound read-only over the
sandbox's ``/proc``.

When the sandbox's first process (the agent) exits, bwrap exits and the kernel kills whatever
else is left in its PID namespace (a daemon started with ``setsid`` included); ``Jail`` finds
that namespace's init from bwrap's ``--info-fd`` so the caller can wait until every process of
the sandbox is gone.

The workdir copies the sandbox works on: capture/isolation/workdir.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

INSTALL_HINT = "apt-get install bubblewrap, or run scripts/setup.sh"
# Parts of /proc that uid 0 may write without capabilities (bwrap covers them only for some
# callers): bound read-only from the host's /proc, where they exist.
PROC_COVERED = ("/proc/sys", "/proc/sysrq-trigger", "/proc/irq", "/proc/bus")
# The system's programs and libraries: every sandbox shows them, read-only.
SYSTEM_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
# What of /etc a sandbox never shows (and the ssh host keys, /etc/ssh/ssh_host_*key).
ETC_SECRETS = (
    "shadow", "shadow-", "gshadow", "gshadow-", "sudoers", "sudoers.d", "ssl/private",
    "security/opasswd",
)  # fmt: skip
# The uid (and gid) sandboxes run under when agenttap runs as root: nobody, who owns nothing.
SANDBOX_UID = 65534
LAUNCHER = Path(__file__).with_name("launch.py")
# In the launcher's command, where a staged path goes (capture/isolation/launch.py).
PLACEHOLDER = "@STAGED:{}@"
# How long a sandbox may take to report its PID namespace (bwrap's setup: milliseconds).
INFO_TIMEOUT_S = 30.0


class SandboxUnavailable(ValueError):
    """bwrap is not installed (a ValueError: the request that needs it is refused, 400)."""


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


@dataclass(frozen=True)
class SandboxSpec:
    """What one sandboxed process may see: ``work`` (also its working directory), ``home`` and
    ``tmp`` writable; ``expose`` read-only (files or folders); ``bridge`` at ``/.agenttap``;
    the system (``SYSTEM_PATHS``, ``/etc`` less ``ETC_SECRETS``) read-only; nothing else.
    ``hide``: paths hidden again where they lie inside an exposed one."""

    work: Path
    home: Path
    tmp: Path
    hide: tuple[Path, ...] = ()
    expose: tuple[Path, ...] = ()
    bridge: Path | None = None
    # The size of the fresh /tmp and /var/tmp (each); None: the kernel's default for a tmpfs.
    tmp_size_mb: int | None = None
    # More writable folders, (host path, where inside), and the working directory inside when
    # it is not ``work``'s own path: a Harbor trial's /app, /logs, /root (capture/harbor/env.py).
    binds: tuple[tuple[Path, str], ...] = ()
    chdir: str | None = None
    # Where ``work``, ``home`` and ``tmp`` appear inside (capture/isolation/places.py); None: at
    # their own host paths.
    places: tuple[str, str, str] | None = None


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


def exposed_paths(expose: tuple[Path, ...]) -> list[Path]:
    """The real paths of ``expose`` that exist, without those inside another (bound already)
    or inside the system's folders (shown already), parents first."""
    system = [Path(p) for p in (*SYSTEM_PATHS, "/etc")]
    found: set[Path] = set()
    for path in expose:
        if not str(path):
            continue
        real = Path(os.path.realpath(Path(path).expanduser()))
        if real.exists() and real != Path("/"):
            found.add(real)
    kept = [
        p
        for p in found
        if not any(p.is_relative_to(s) for s in system)
        and not any(o != p and p.is_relative_to(o) for o in found)
    ]
    return sorted(kept, key=lambda p: (len(p.parts), str(p)))


def links_on_the_way(path: Path, depth: int = 0) -> list[tuple[str, str]]:
    """(where, what it points to) of each symbolic link on the way to ``path`` (an absolute
    path, as a command names it): the sandbox binds an exposed path at its real path only, so
    these links are made again inside for the path as given to lead there too (a checkout whose
    ``.cache`` links to a folder elsewhere)."""
    found: list[tuple[str, str]] = []
    if depth > 8 or not path.is_absolute():
        return found
    parts = Path(os.path.normpath(path)).parts
    for i in range(2, len(parts) + 1):
        prefix = os.path.join(*parts[:i])
        if os.path.islink(prefix):
            target = os.readlink(prefix)
            found.append((prefix, target))
            # The rest of the way from where it leads (which may hold links of its own).
            resolved = os.path.normpath(os.path.join(os.path.dirname(prefix), target))
            found += links_on_the_way(Path(resolved, *parts[i:]), depth + 1)
            break
    return found


def bwrap_argv(
    spec: SandboxSpec,
    command: list[str],
    bwrap: str = "bwrap",
    info_fd: int | None = None,
    root: Path = Path("/"),
    source: Callable[[str], str] = str,
) -> list[str]:
    """The bwrap command line that runs ``command`` in ``spec``'s sandbox (see the module's
    docstring for what it shows). ``info_fd``: where bwrap writes its JSON with the sandbox's
    init pid and PID namespace. ``root``: the host's root, for tests. ``source``: what bwrap
    is given to bind for an exposed path or a run's folder (capture/isolation/launch.py stages
    them where the sandbox's user can reach them)."""
    argv = [
        bwrap,
        "--unshare-user", "--disable-userns",
        "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-net",
        "--unshare-cgroup-try",
        "--die-with-parent",
        "--new-session",
        "--cap-drop", "ALL",
        "--dev", "/dev",
        "--proc", "/proc",
    ]  # fmt: skip
    for covered in PROC_COVERED:
        argv += ["--ro-bind-try", covered, covered]
    for name in SYSTEM_PATHS:
        host = root / name.lstrip("/")
        if host.is_symlink():  # merged /usr: /bin -> usr/bin
            argv += ["--symlink", os.readlink(host), name]
        elif host.is_dir():
            argv += ["--ro-bind", str(host), name]
    etc = root / "etc"
    argv += ["--ro-bind", str(etc), "/etc"]
    secrets: list[tuple[str, bool]] = []
    for name in ETC_SECRETS:
        host = etc / name
        if host.is_symlink() or not host.exists():
            continue
        secrets.append((f"/etc/{name}", host.is_dir()))
    for ssh_key in sorted((etc / "ssh").glob("ssh_host_*key")) if (etc / "ssh").is_dir() else []:
        secrets.append((f"/etc/ssh/{ssh_key.name}", False))
    for secret, is_dir in secrets:
        masked = ["--tmpfs", secret, "--remount-ro", secret]
        argv += masked if is_dir else ["--ro-bind", "/dev/null", secret]
    for scratch in ("/tmp", "/var/tmp"):
        if spec.tmp_size_mb is not None:
            argv += ["--size", str(spec.tmp_size_mb * 1024 * 1024)]
        argv += ["--tmpfs", scratch]
    exposed = exposed_paths(spec.expose)
    for path in exposed:
        argv += ["--ro-bind", source(str(path)), str(path)]
    # The links on the way to an exposed path as given, where the tree shown does not hold
    # them already (inside a folder bound whole, or the system's).
    shown = [*exposed, *(Path(p) for p in (*SYSTEM_PATHS, "/etc"))]
    links: dict[str, str] = {}
    for given in spec.expose:
        for where, target in links_on_the_way(Path(given).expanduser()):
            if not any(Path(where).is_relative_to(p) for p in shown):
                links.setdefault(where, target)
    for where, target in links.items():
        argv += ["--symlink", target, where]
    if spec.bridge is not None:
        argv += ["--ro-bind", source(os.path.realpath(spec.bridge)), "/.agenttap"]
    # Hidden again where an exposed path holds them (OUT inside an exposed checkout).
    hidden = [
        (p, is_dir)
        for p, is_dir in hidden_paths(spec.hide)
        if any(p.is_relative_to(e) for e in exposed)
    ]
    for path, is_dir in hidden:
        argv += ["--tmpfs", str(path)] if is_dir else ["--ro-bind", "/dev/null", str(path)]
    folders = [os.path.realpath(p) for p in (spec.work, spec.home, spec.tmp)]
    places = spec.places or tuple(folders)
    for real, inside in zip(folders, places, strict=True):
        argv += ["--bind", source(real), inside]
    # Read-only once the mount points in them exist (the binds above stay as they are).
    for path, is_dir in hidden:
        if is_dir:
            argv += ["--remount-ro", str(path)]
    argv += ["--chdir", places[0]]
    if info_fd is not None:
        argv += ["--info-fd", str(info_fd)]
    for host_path, inside in spec.binds:
        argv += ["--bind", source(str(host_path)), inside]
    if spec.chdir is not None:
        argv += ["--chdir", spec.chdir]
    return [*argv, "--", *command]


def sandbox_argv(
    spec: SandboxSpec,
    command: list[str],
    bwrap: str = "bwrap",
    info_fd: int | None = None,
    *,
    uid: int | None = None,
    stage: Path | None = None,
) -> list[str]:
    """The command that runs ``command`` in ``spec``'s sandbox. Without ``uid``: bwrap itself,
    run as this user. With ``uid`` (agenttap runs as root): capture/isolation/launch.py, run as
    root, stages every path bwrap binds in ``stage`` (an empty folder the sandbox's user can
    enter), becomes ``uid`` and execs bwrap. (The run's cgroups and rlimits come first, from
    the prefix capture/isolation/cgroup.py gives.)"""
    if uid is None:
        return bwrap_argv(spec, command, bwrap, info_fd=info_fd)
    if stage is None:
        raise ValueError("a sandbox run as another user needs a staging folder")
    binds: list[str] = []

    def staged(path: str) -> str:
        binds.append(path)
        return PLACEHOLDER.format(len(binds) - 1)

    argv = bwrap_argv(spec, command, bwrap, info_fd=info_fd, source=staged)
    launch = {
        "stage": str(stage),
        "binds": binds,
        "uid": uid,
        "gid": uid,
        "argv": argv,
    }
    return [os.path.realpath(sys.executable), "-I", "-S", str(LAUNCHER), json.dumps(launch)]


def make_stage() -> Path:
    """An empty folder for the launcher's staging (``sandbox_argv``): in ``/tmp``, whose
    folders every user may enter, never in a private TMPDIR; 0711."""
    stage = Path(tempfile.mkdtemp(prefix="agenttap-stage-", dir="/tmp"))
    stage.chmod(0o711)
    return stage


def program_paths(command: list[str], path_env: str) -> tuple[Path, ...]:
    """What a sandbox must show for ``command`` to run: the program's own install, found from
    its path (``PATH`` lookup) and its real path, and its script interpreter's (a ``#!`` line,
    ``/usr/bin/env node`` included); each absolute argument naming a file (a script). An
    install is the top-most ``node_modules`` folder the program is in, or a venv (its
    ``pyvenv.cfg``) and the Python it was made from, or the prefix above a ``bin`` folder, or
    the file alone; an absolute argument that is an executable is resolved as a program too
    (``env VAR=1 /path/to/cli``). The system's folders are shown anyway and are left out."""
    found: list[Path] = []
    if not command:
        return ()
    program = command[0]
    if "/" not in program:
        program = shutil.which(program, path=path_env) or program
    _program_installs(Path(program), path_env, found, depth=0)
    for arg in command[1:]:
        if arg.startswith("/") and os.path.isfile(arg):
            # An executable is a program too (``env VAR=1 /path/to/cli``, ``timeout 60 cli``).
            if os.access(arg, os.X_OK):
                _program_installs(Path(arg), path_env, found, depth=0)
            else:
                found.append(Path(arg))
    return tuple(dict.fromkeys(found))


def _program_installs(program: Path, path_env: str, found: list[Path], depth: int) -> None:
    if not program.is_absolute() or not program.exists():
        return
    for candidate in (program, Path(os.path.realpath(program))):
        found.extend(_install_of(candidate))
    if depth >= 2:
        return
    interpreter = shebang(Path(os.path.realpath(program)))
    if interpreter:
        name, *rest = interpreter
        if os.path.basename(name) == "env" and rest:
            args = [a for a in rest if not a.startswith("-")]
            name = (shutil.which(args[0], path=path_env) or "") if args else ""
        if name:
            _program_installs(Path(name), path_env, found, depth + 1)


def _install_of(path: Path) -> list[Path]:
    if any(path.is_relative_to(s) for s in (*SYSTEM_PATHS, "/etc")):
        return []
    modules = [p for p in path.parents if p.name == "node_modules"]
    if modules:
        return [modules[-1]]
    if path.parent.name == "bin":
        prefix = path.parent.parent
        cfg = prefix / "pyvenv.cfg"
        if cfg.is_file():
            return [prefix, *_venv_base(cfg)]
        if prefix != Path("/"):
            return [prefix]
    return [path]


def _venv_base(cfg: Path) -> list[Path]:
    """The Python a venv was made from (its ``home`` is that Python's ``bin`` folder)."""
    try:
        lines = cfg.read_text().splitlines()
    except OSError:
        return []
    for line in lines:
        key, sep, value = line.partition("=")
        if sep and key.strip() == "home":
            home = Path(os.path.realpath(value.strip()))
            return _install_of(home / "python3") if home.name == "bin" else [home]
    return []


def shebang(path: Path) -> list[str]:
    """A script's ``#!`` line, split (empty for anything else)."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(256)
    except OSError:
        return []
    if not head.startswith(b"#!"):
        return []
    return head[2:].split(b"\n", 1)[0].decode(errors="replace").split()


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
