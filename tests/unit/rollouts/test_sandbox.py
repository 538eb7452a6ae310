"""The rollouts' sandbox (capture/isolation/sandbox.py): bwrap's command line, what a real bwrap run
of it lets a process see and do (a tree from an allowlist, no network but what is handed in, a
user that owns nothing), its PID namespace ended as a whole, and the workdir copies (links,
restore, sanitize). Real bwrap where a process runs (scripts/setup.sh installs it), started as
the runner starts it (``sandbox_argv``: through the launcher when the tests run as root)."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from capture.isolation.places import FIXED_PLACES, fixed_layout, moved_value
from capture.isolation.sandbox import (
    SANDBOX_UID,
    Jail,
    SandboxSpec,
    SandboxUnavailable,
    bwrap_argv,
    exposed_paths,
    find_bwrap,
    hidden_paths,
    links_on_the_way,
    make_stage,
    program_paths,
    read_info,
    sandbox_argv,
)
from capture.isolation.workdir import (
    UnsafeWorkdir,
    check_restore,
    check_seed,
    copy_seed,
    give_to,
    restore,
)

ROOT = os.geteuid() == 0
REPO = Path(__file__).resolve().parents[3]


class Host:
    """A proxy's folders as a rollout sees them: OUT holding two runs' folders, a confdir with
    the CA key, the certificate and the bundle, a token file, a secret folder elsewhere, a
    folder the rollout exposes (with OUT inside it, as when OUT is in an exposed checkout)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.out = root / "out"
        self.conf = root / "conf"
        self.conf.mkdir()
        self.key = self.conf / "mitmproxy-ca.pem"
        self.key.write_text("PRIVATE KEY\n")
        self.cert = self.conf / "mitmproxy-ca-cert.pem"
        self.cert.write_text("CERTIFICATE\n")
        self.bundle = self.conf / "agenttap-ca-bundle.pem"
        self.bundle.write_text("BUNDLE\n")
        self.token = root / "token"
        self.token.write_text("the-token\n")
        self.secrets = root / "secrets"
        self.secrets.mkdir()
        (self.secrets / "id_rsa").write_text("ssh key\n")
        self.tools = root / "tools"
        (self.tools / "bin").mkdir(parents=True)
        (self.tools / "bin" / "tool").write_text("#!/bin/sh\necho tool ran\n")
        (self.tools / "bin" / "tool").chmod(0o755)
        self.nested_out = self.tools / "out"  # an OUT inside an exposed folder
        (self.nested_out / "threads").mkdir(parents=True)
        (self.nested_out / "threads" / "shard.parquet").write_text("rows\n")
        (self.out / "threads").mkdir(parents=True)
        (self.out / "threads" / "shard.parquet").write_text("rows\n")
        self.runs = []
        for i in range(2):
            run = self.out / "rollouts" / "r" / str(i)
            for name in ("work", "home", "tmp"):
                (run / name).mkdir(parents=True)
            self.runs.append(run)
        self.outside = root / "outside"
        self.outside.mkdir()
        self.stage = make_stage()

    def spec(
        self,
        index: int = 0,
        bridge: Path | None = None,
        places: tuple[str, str, str] | None = None,
    ) -> SandboxSpec:
        run = self.runs[index]
        return SandboxSpec(
            run / "work", run / "home", run / "tmp",
            hide=(self.out, self.conf, self.token, self.secrets, self.nested_out,
                  self.out / "missing"),
            expose=(self.cert, self.bundle, self.tools,
                    *program_paths([sys.executable], os.environ["PATH"])),
            bridge=bridge, places=places,
        )  # fmt: skip

    def argv(self, command: list[str], index: int = 0, **kw: object) -> list[str]:
        """How the runner starts ``command`` in run ``index``'s sandbox."""
        run = self.runs[index]
        give_to(SANDBOX_UID if ROOT else None, run / "work", run / "home", run / "tmp")
        bridge = kw.pop("bridge", None)
        places = kw.pop("places", None)
        return sandbox_argv(
            self.spec(index, bridge, places),  # type: ignore[arg-type]
            command,
            find_bwrap(),
            uid=SANDBOX_UID if ROOT else None,
            stage=self.stage,
            **kw,  # type: ignore[arg-type]
        )


@pytest.fixture
def host(tmp_path: Path) -> Iterator[Host]:
    made = Host(tmp_path)
    yield made
    made.stage.rmdir()


def flags_at(argv: list[str], *words: str) -> int:
    for i in range(len(argv) - len(words) + 1):
        if argv[i : i + len(words)] == list(words):
            return i
    raise AssertionError(f"{words} not in {argv}")


def test_the_tree_is_built_from_the_allowlist(host: Host) -> None:
    spec = host.spec()
    argv = bwrap_argv(spec, ["python3", "agent.py"], "/usr/bin/bwrap", info_fd=7)
    assert argv[:13] == [
        "/usr/bin/bwrap",
        "--unshare-user", "--disable-userns",
        "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-net",
        "--unshare-cgroup-try",
        "--die-with-parent", "--new-session",
        "--cap-drop", "ALL",
        "--dev",
    ]  # fmt: skip
    assert argv[-3:] == ["--", "python3", "agent.py"]
    # Never the host's root, nor any folder of it but the system's and what is exposed.
    assert "/" not in [argv[i + 1] for i, a in enumerate(argv) if a in ("--bind", "--ro-bind")]
    sources = {argv[i + 1] for i, a in enumerate(argv) if a in ("--bind", "--ro-bind")}
    allowed = {"/usr", "/etc", "/dev/null", str(host.cert), str(host.bundle), str(host.tools)}
    allowed |= {str(p) for p in exposed_paths(spec.expose)}
    allowed |= {os.path.realpath(p) for p in (spec.work, spec.home, spec.tmp)}
    assert sources <= allowed, sources - allowed
    for name in ("/root", "/home", "/tmp", "/var/tmp", "/srv", "/mnt", "/opt", "/run"):
        assert name not in sources
    # /bin and /lib are links into /usr (merged /usr) or bound read-only.
    assert flags_at(argv, "--symlink", "usr/bin", "/bin") or flags_at(argv, "--ro-bind", "/bin")
    # /etc's secrets are covered: files by /dev/null, folders by an empty read-only tmpfs.
    if Path("/etc/shadow").exists():
        flags_at(argv, "--ro-bind", "/dev/null", "/etc/shadow")
    if Path("/etc/ssl/private").is_dir():
        flags_at(argv, "--tmpfs", "/etc/ssl/private", "--remount-ro", "/etc/ssl/private")
    # A fresh /tmp; the OUT inside the exposed folder is hidden again, and read-only after the
    # run's folders were bound.
    flags_at(argv, "--tmpfs", "/tmp")
    nested = flags_at(argv, "--tmpfs", str(host.nested_out))
    binds = [flags_at(argv, "--bind", str(p), str(p)) for p in (spec.work, spec.home, spec.tmp)]
    assert nested < min(binds) < max(binds) < flags_at(argv, "--remount-ro", str(host.nested_out))
    # OUT, the confdir, the token and the secrets are simply not there: nothing hides them.
    for path in (host.out, host.conf, host.token, host.secrets):
        assert str(path) not in [argv[i + 1] for i, a in enumerate(argv) if a == "--tmpfs"]
    assert argv[argv.index("--chdir") + 1] == str(spec.work)
    assert argv[argv.index("--info-fd") + 1] == "7"


def test_a_program_brings_its_own_install(tmp_path: Path) -> None:
    venv = Path(sys.prefix)
    found = program_paths([sys.executable, "-c", "pass"], os.environ["PATH"])
    # The venv and the Python it was made from.
    assert venv in found or Path(os.path.realpath(venv)) in found
    assert Path(os.path.realpath(sys.base_prefix)) in found
    modules = tmp_path / "node" / "node_modules"
    (modules / ".bin").mkdir(parents=True)
    (modules / "cli" / "bin").mkdir(parents=True)
    script = modules / "cli" / "bin" / "cli.js"
    script.write_text("#!/usr/bin/env node\n")
    (modules / ".bin" / "cli").symlink_to(script)
    arg = tmp_path / "task.py"
    arg.write_text("")
    found = program_paths([str(modules / ".bin" / "cli"), str(arg), "/nonexistent"], "/usr/bin")
    assert found[0] == modules and arg in found
    assert all(not p.is_relative_to("/usr") for p in found)
    # A program run through another (env, timeout) brings its install all the same.
    script.chmod(0o755)
    found = program_paths(["env", "A=1", str(modules / ".bin" / "cli"), "-p"], "/usr/bin")
    assert found == (modules,)


def test_a_program_reached_through_a_linked_folder_runs(host: Host, tmp_path: Path) -> None:
    """Issue 51 item 6: a checkout whose ``.cache`` is a link to a folder elsewhere. The sandbox
    binds the install at its real path and makes the link again, so the program's path as the
    command gives it leads there."""
    store = tmp_path / "store"
    (store / "node" / "node_modules" / ".bin").mkdir(parents=True)
    tool = store / "node" / "node_modules" / ".bin" / "tool"
    tool.write_text("#!/bin/sh\necho linked tool ran\n")
    tool.chmod(0o755)
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    (checkout / ".cache").symlink_to("../store")  # relative, as `ln -s ../store .cache` makes
    given = checkout / ".cache" / "node" / "node_modules" / ".bin" / "tool"
    assert links_on_the_way(given) == [(str(checkout / ".cache"), "../store")]
    run = host.runs[0]
    give_to(SANDBOX_UID if ROOT else None, run / "work", run / "home", run / "tmp")
    spec = SandboxSpec(
        run / "work", run / "home", run / "tmp",
        expose=program_paths([str(given)], os.environ["PATH"]),
    )  # fmt: skip
    argv = sandbox_argv(
        spec, [str(given)], find_bwrap(), uid=SANDBOX_UID if ROOT else None, stage=host.stage
    )
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd="/")
    assert (done.returncode, done.stdout) == (0, "linked tool ran\n"), done.stderr


def test_hidden_paths_are_real_paths_parents_first(host: Host, tmp_path: Path) -> None:
    link = tmp_path / "link-to-secrets"
    link.symlink_to(host.secrets)
    found = hidden_paths((host.token, link, host.secrets / "id_rsa", host.out))
    assert found == [(host.out, True), (host.secrets, True), (host.token, False)]


def test_without_bwrap_the_error_names_the_install_command(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(SandboxUnavailable, match="apt-get install bubblewrap") as err:
        find_bwrap()
    assert "scripts/setup.sh" in str(err.value) and isinstance(err.value, ValueError)


def run_in(
    host: Host, script: str, index: int = 0, places: tuple[str, str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``script`` (Python) run in run ``index``'s sandbox by the real bwrap."""
    argv = host.argv([sys.executable, "-c", script], index, places=places)
    env = {"PATH": os.environ["PATH"], "TMPDIR": str(host.runs[index] / "tmp")}
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60, cwd="/")


SEES = """
import os, pathlib, tempfile, sys
def read(p):
    try:
        return pathlib.Path(p).read_text().strip()
    except OSError as exc:
        return type(exc).__name__
def write(p):
    try:
        pathlib.Path(p).write_text("x")
        return "written"
    except OSError as exc:
        return type(exc).__name__
def listing(p):
    try:
        return sorted(os.listdir(p))
    except OSError as exc:
        return type(exc).__name__
"""


def test_a_sandboxed_process_sees_only_what_it_may(host: Host) -> None:
    script = (
        SEES
        + f"""
import json
print(json.dumps({{
    "out": listing({str(host.out)!r}),
    "conf": listing({str(host.conf)!r}),
    "ca": [read({str(host.key)!r}), read({str(host.cert)!r}), read({str(host.bundle)!r})],
    "token": read({str(host.token)!r}), "secrets": listing({str(host.secrets)!r}),
    "other_run": os.path.exists({str(host.runs[1])!r}), "cwd": os.getcwd(),
    "writable": [write("mine.txt"), write({str(host.runs[0] / "home" / "h")!r}),
                 write(tempfile.gettempdir() + "/t"), write("/tmp/scratch")],
    "outside": write({str(host.outside / "x")!r}), "etc": write("/etc/agenttap-x"),
    "tools_write": write({str(host.tools / "x")!r}),
    "pids": sorted(int(p) for p in os.listdir("/proc") if p.isdigit())[:2],
    "root": listing("/"), "tmp": listing("/tmp"), "nested_out": listing({str(host.nested_out)!r}),
    "tool": read({str(host.tools / "bin" / "tool")!r}),
    "uid": os.getuid(), "shadow": read("/etc/shadow"),
}}))
"""
    )
    done = run_in(host, script)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    # OUT holds only the run's own folder; the confdir only the certificate and bundle.
    assert seen["out"] == ["rollouts"]
    assert seen["conf"] == ["agenttap-ca-bundle.pem", "mitmproxy-ca-cert.pem"]
    assert seen["ca"] == ["FileNotFoundError", "CERTIFICATE", "BUNDLE"]
    assert seen["token"] == "FileNotFoundError" and seen["secrets"] == "FileNotFoundError"
    assert seen["other_run"] is False and seen["cwd"] == str(host.runs[0] / "work")
    assert seen["writable"] == ["written"] * 4
    # Outside the allowlist a folder does not exist; the system and exposed paths are read-only.
    assert (seen["outside"], seen["etc"], seen["tools_write"]) == (
        "FileNotFoundError", "OSError", "OSError",
    )  # fmt: skip
    assert seen["pids"] == [1, 2]  # its own PID namespace: bwrap's init, then itself
    assert not set(seen["root"]) & {"srv", "mnt", "opt", "home", "run", "boot", "media"}
    # The host's /tmp is not there: its own scratch file only (and, where the run's folders or
    # this checkout and its Python lie under /tmp, the folders bwrap made to bind them on).
    bound = (host.root, REPO.resolve(), Path(sys.executable).resolve())
    made = {p.parts[2] for p in bound if len(p.parts) > 2 and p.parts[1] == "tmp"}
    assert set(seen["tmp"]) <= {"scratch", *made}
    assert seen["nested_out"] == [] and seen["tool"] == "#!/bin/sh\necho tool ran"
    assert (host.runs[0] / "work" / "mine.txt").exists() and (host.runs[0] / "tmp" / "t").exists()
    assert not (host.outside / "x").exists() and not (host.out / "planted").exists()
    if ROOT:
        # A user that owns nothing: root's 0640 and 0600 files are out of reach where shown.
        assert seen["uid"] == SANDBOX_UID and seen["shadow"] in ("PermissionError", "")


def test_a_runs_folders_sit_at_fixed_places_whatever_their_host_paths(tmp_path: Path) -> None:
    # Two runs under different OUTs: the same places inside, each one's own host folders.
    made = []
    for out in ("out-a", "elsewhere/out-b"):
        run = tmp_path / out / "rollouts" / "g" / "0"
        folders = (run / "work", run / "home", run / "tmp")
        script = folders[2] / "agenttap-pytest" / "guard.py"  # a file of the run's, an argument
        cert = tmp_path / "conf" / "ca.pem"
        layout = fixed_layout(folders, (cert, script))
        assert layout is not None
        moved, expose = layout
        made.append(
            {moved[str(f)] for f in folders} | {moved[os.path.realpath(f)] for f in folders}
        )
        assert expose == (cert,)  # the run's own file is shown with its folder, not apart
    assert made[0] == made[1] == set(FIXED_PLACES)
    # An install at or above a fixed place: bound there it would hide the install or put mount
    # points in the run's own folder, so the run keeps its host paths.
    work = tmp_path / "w"
    folders = (work, tmp_path / "h", tmp_path / "t")
    assert fixed_layout(folders, (Path("/workdir/checkout/.venv"),)) is None
    assert fixed_layout(folders, (Path("/home"),)) is None
    assert fixed_layout(folders, (Path("/homes/x"), Path("/workdirs"))) is not None


def test_a_runs_folders_are_renamed_wherever_a_value_names_them() -> None:
    places = {"/o/r/box/tmp": "/tmp/agent", "/o/r/box/work": "/workdir"}
    assert moved_value("/o/r/box/tmp", places) == "/tmp/agent"
    assert moved_value("/o/r/box/tmp/p/junit.xml", places) == "/tmp/agent/p/junit.xml"
    assert moved_value("--junitxml=/o/r/box/tmp/j.xml", places) == "--junitxml=/tmp/agent/j.xml"
    assert moved_value("/usr/bin:/o/r/box/work/bin:/bin", places) == "/usr/bin:/workdir/bin:/bin"
    # A path that only starts with the same letters is another path.
    for other in ("/o/r/box/tmpfile", "x/o/r/box/tmp", "/elsewhere/o/r/box/tmp"):
        assert moved_value(other, places) == other


def test_at_fixed_places_the_agent_works_in_workdir_and_sees_no_host_path(host: Host) -> None:
    spec = host.spec(places=FIXED_PLACES)
    argv = bwrap_argv(spec, ["python3", "agent.py"], "/usr/bin/bwrap")
    for real, inside in zip((spec.work, spec.home, spec.tmp), FIXED_PLACES, strict=True):
        flags_at(argv, "--bind", os.path.realpath(real), inside)
    assert argv[argv.index("--chdir") + 1] == "/workdir"
    script = (
        SEES
        + f"""
import json
print(json.dumps({{
    "cwd": os.getcwd(), "host_work": os.path.exists({str(host.runs[0] / "work")!r}),
    "writes": [write("mine.txt"), write("/home/agent/h"), write("/tmp/agent/t")],
}}))
"""
    )
    done = run_in(host, script, places=FIXED_PLACES)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert seen == {"cwd": "/workdir", "host_work": False, "writes": ["written"] * 3}
    # What it wrote is in the run's own folders on the host.
    run = host.runs[0]
    assert [(run / p).read_text() for p in ("work/mine.txt", "home/h", "tmp/t")] == ["x"] * 3


def test_the_network_is_its_own(host: Host, tmp_path: Path) -> None:
    # A TCP listener and a unix socket on the host: neither is reachable from inside.
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    unix = socket.socket(socket.AF_UNIX)
    unix.bind(str(host.outside / "s.sock"))
    unix.listen()
    try:
        script = f"""
import socket
def tcp(host, port):
    try:
        socket.create_connection((host, port), timeout=2).close()
        return "connected"
    except OSError as exc:
        return type(exc).__name__
print(tcp("127.0.0.1", {port}))
print(tcp("1.1.1.1", 443))
print(open("/proc/net/tcp").read().count("\\n"))
try:
    socket.socket(socket.AF_UNIX).connect({str(host.outside / "s.sock")!r})
    print("connected")
except OSError as exc:
    print(type(exc).__name__)
"""
        done = run_in(host, script)
        assert done.returncode == 0, done.stderr
        lines = done.stdout.splitlines()
        assert lines[0] == "ConnectionRefusedError"
        assert lines[1] in ("OSError", "ConnectionRefusedError", "TimeoutError")
        assert lines[2] == "1"  # /proc/net/tcp: its header, no host socket
        assert lines[3] == "FileNotFoundError"
    finally:
        server.close()
        unix.close()


def test_the_kernels_settings_and_mounts_stay_as_they_are(host: Host) -> None:
    # /proc/sys is read-only (a write to kernel.core_pattern would run a program as the host's
    # root); no capability is left to unmount anything; the hostname is the sandbox's own.
    script = f"""
import os, subprocess
try:
    open("/proc/sys/kernel/hostname", "w").write("agenttap-sandboxed")
    print("written")
except OSError as exc:
    print(type(exc).__name__)
print(os.access("/proc/sys/kernel/core_pattern", os.W_OK))
subprocess.run(["umount", "-l", {str(host.nested_out)!r}], capture_output=True)
print(os.listdir({str(host.nested_out)!r}))
print(open("/proc/self/status").read().split("CapEff:")[1].split()[0])
try:
    os.unshare(os.CLONE_NEWUSER)
    print("nested user namespace")
except (OSError, AttributeError) as exc:
    print(type(exc).__name__)
"""
    done = run_in(host, script)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] in ("OSError", "PermissionError") and lines[1] == "False"
    assert lines[2] == "[]" and lines[3] == "0000000000000000"
    assert lines[4] != "nested user namespace"


def test_a_daemon_dies_with_the_sandbox_and_the_jail_waits_for_it(host: Host) -> None:
    work = host.runs[0] / "work"

    async def main() -> tuple[int | None, list[int], bool]:
        info_r, info_w = os.pipe()
        argv = host.argv(
            ["sh", "-c", "setsid sleep 60 & echo $! > pid; exec sleep 0.3"], info_fd=info_w
        )
        proc = await asyncio.create_subprocess_exec(*argv, pass_fds=(info_w,), cwd="/")
        os.close(info_w)
        jail = Jail.from_info(await read_info(info_r))
        assert jail is not None and jail.pidfd is not None
        while not (work / "pid").exists():
            await asyncio.sleep(0.01)
        members = jail.members()
        code = await proc.wait()
        gone = await jail.wait_gone(10)
        return code, members, gone

    code, members, gone = asyncio.run(main())
    assert code == 0 and gone
    # bwrap's init, sh (then sleep 0.3), the daemon; all gone once the first one ended.
    assert len(members) == 3
    assert not any(Path(f"/proc/{pid}").exists() for pid in members[1:])


def test_the_jail_ends_a_sandbox_that_runs_on(host: Host) -> None:
    async def main() -> tuple[list[int], bool, int]:
        info_r, info_w = os.pipe()
        argv = host.argv(["sh", "-c", "setsid sleep 60 & sleep 60"], info_fd=info_w)
        proc = await asyncio.create_subprocess_exec(*argv, pass_fds=(info_w,), cwd="/")
        os.close(info_w)
        jail = Jail.from_info(await read_info(info_r))
        assert jail is not None
        while len(jail.members()) < 4:
            await asyncio.sleep(0.01)
        members = jail.members()
        jail.kill()
        gone = await jail.wait_gone(10)
        return members, gone, await proc.wait()

    members, gone, code = asyncio.run(main())
    assert gone and code != 0
    assert not any(Path(f"/proc/{pid}").exists() for pid in members)


def test_bwrap_that_reports_nothing_has_no_jail() -> None:
    assert Jail.from_info(b"") is None and Jail.from_info(b"{}") is None


# -- workdir copies ------------------------------------------------------------------------------
def seed_with_links(root: Path) -> Path:
    seed = root / "seed"
    (seed / "src" / "pkg").mkdir(parents=True)
    (seed / "src" / "pkg" / "mod.py").write_text("x = 1\n")
    (seed / "README").write_text("task\n")
    (seed / "doc").symlink_to("README")  # a file, inside
    (seed / "src" / "alias").symlink_to("pkg")  # a folder, inside
    (seed / "src" / "up").symlink_to("../README")
    return seed


def test_links_inside_the_seed_are_copied_as_what_they_point_to(tmp_path: Path) -> None:
    seed = seed_with_links(tmp_path)
    dest = tmp_path / "work"
    check_seed(seed)
    copy_seed(seed, dest)
    assert not (dest / "doc").is_symlink() and (dest / "doc").read_text() == "task\n"
    assert not (dest / "src" / "alias").is_symlink()
    assert (dest / "src" / "alias" / "mod.py").read_text() == "x = 1\n"
    assert (dest / "src" / "up").read_text() == "task\n"
    assert not any(p.is_symlink() for p in dest.rglob("*"))


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (lambda seed, out: (seed / "leak").symlink_to(out / "secret"), "points outside"),
        (lambda seed, out: (seed / "src" / "far").symlink_to("../.."), "points outside"),
        (lambda seed, out: (seed / "etc").symlink_to("/etc"), "points outside"),
        (lambda seed, out: (seed / "gone").symlink_to("nothing-here"), "points to nothing"),
        (lambda seed, out: (seed / "src" / "pkg" / "self").symlink_to(".."), "loop"),
        (lambda seed, out: os.mkfifo(seed / "pipe"), "neither a file nor a folder"),
    ],
)
def test_a_seed_that_cannot_be_copied_safely_is_refused_naming_the_path(
    tmp_path: Path, make: Callable[[Path, Path], object], words: str
) -> None:
    seed = seed_with_links(tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_text("s")
    make(seed, outside)
    with pytest.raises(UnsafeWorkdir, match=words) as err:
        check_seed(seed)
    assert str(seed) in str(err.value)
    with pytest.raises(UnsafeWorkdir, match=words):
        copy_seed(seed, tmp_path / "work")


@pytest.mark.parametrize(
    ("paths", "ok"),
    [
        (["tests/", "setup.cfg", "a/b/c.py"], ("tests", "setup.cfg", "a/b/c.py")),
        ([], ()),
        (["/etc/passwd"], None),
        (["../x"], None),
        (["tests/../../x"], None),
        (["."], None),
        ([""], None),
        ([1], None),
        ("tests/", None),
    ],
)
def test_restore_paths_are_relative_paths_inside_the_workdir(
    paths: object, ok: tuple[str, ...] | None
) -> None:
    if ok is None:
        with pytest.raises(ValueError, match='"restore"'):
            check_restore(paths)
    else:
        assert check_restore(paths) == ok


def test_restore_puts_the_seeds_paths_back_without_following_the_agents_links(
    tmp_path: Path,
) -> None:
    seed = tmp_path / "seed"
    (seed / "tests" / "unit").mkdir(parents=True)
    (seed / "tests" / "unit" / "test_a.py").write_text("seed test\n")
    (seed / "setup.cfg").write_text("seed cfg\n")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("not the agent's\n")
    work = tmp_path / "work"
    copy_seed(seed, work)
    # The agent: rewrote the tests, added one, replaced setup.cfg by a link out, made a file
    # the seed lacks, and turned a folder above a restored path into a link out.
    (work / "tests" / "unit" / "test_a.py").write_text("assert True\n")
    (work / "tests" / "unit" / "test_b.py").write_text("planted\n")
    (work / "setup.cfg").unlink()
    (work / "setup.cfg").symlink_to(outside / "keep.txt")
    (work / "conftest.py").write_text("planted\n")
    (work / "deep").symlink_to(outside)
    restore(seed, work, ("tests", "setup.cfg", "conftest.py", "deep/keep.txt"))
    assert sorted(p.name for p in (work / "tests" / "unit").iterdir()) == ["test_a.py"]
    assert (work / "tests" / "unit" / "test_a.py").read_text() == "seed test\n"
    assert not (work / "setup.cfg").is_symlink()
    assert (work / "setup.cfg").read_text() == "seed cfg\n"
    assert not (work / "conftest.py").exists()  # not in the seed: removed
    assert (work / "deep").is_dir() and not (work / "deep").is_symlink()
    # Nothing outside the copy was touched.
    assert sorted(p.name for p in outside.iterdir()) == ["keep.txt"]
    assert (outside / "keep.txt").read_text() == "not the agent's\n"
