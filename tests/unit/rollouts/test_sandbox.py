"""The rollouts' sandbox (capture/rollouts/sandbox.py): bwrap's command line and the order of its mounts,
what a real bwrap run of it lets a process see and do, its PID namespace ended as a whole, and
the workdir copies (links, restore). Real bwrap where a process runs (scripts/setup.sh installs
it); nothing else is started."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from capture.rollouts.sandbox import (
    Jail,
    SandboxSpec,
    SandboxUnavailable,
    UnsafeWorkdir,
    bwrap_argv,
    check_restore,
    check_seed,
    copy_seed,
    find_bwrap,
    hidden_paths,
    host_sockets,
    read_info,
    restore,
)


class Host:
    """A proxy's folders as a rollout sees them: OUT holding two runs' folders, a confdir with
    the CA key, the certificate and the bundle, a token file, a secret folder elsewhere."""

    def __init__(self, root: Path) -> None:
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

    def spec(self, index: int = 0) -> SandboxSpec:
        run = self.runs[index]
        return SandboxSpec(
            run / "work", run / "home", run / "tmp",
            hide=(self.out, self.conf, self.token, self.secrets, self.out / "rollouts",
                  self.out / "missing"),
            expose_files=(self.cert, self.bundle),
        )  # fmt: skip


@pytest.fixture
def host(tmp_path: Path) -> Host:
    return Host(tmp_path)


def test_the_command_line_hides_then_binds_back_then_binds_the_run(host: Host) -> None:
    spec = host.spec()
    argv = bwrap_argv(spec, ["python3", "agent.py"], "/usr/bin/bwrap", info_fd=7)
    assert argv[:28] == [
        "/usr/bin/bwrap",
        "--ro-bind", "/", "/",
        "--dev", "/dev",
        "--proc", "/proc",
        "--unshare-pid", "--unshare-ipc", "--unshare-uts",
        "--die-with-parent", "--new-session",
        "--cap-drop", "ALL",
        # What uid 0 could still write in the new /proc: read-only.
        "--ro-bind-try", "/proc/sys", "/proc/sys",
        "--ro-bind-try", "/proc/sysrq-trigger", "/proc/sysrq-trigger",
        "--ro-bind-try", "/proc/irq", "/proc/irq",
        "--ro-bind-try", "/proc/bus", "/proc/bus",
        "--tmpfs",
    ]  # fmt: skip
    assert argv[-3:] == ["--", "python3", "agent.py"]
    # The network is shared (the proxy is on loopback); nothing else is unshared.
    assert "--unshare-net" not in argv and "--unshare-all" not in argv
    assert argv[argv.index("--chdir") + 1] == str(spec.work)
    assert argv[argv.index("--info-fd") + 1] == "7"

    def at(*words: str) -> int:
        for i in range(len(argv) - len(words) + 1):
            if argv[i : i + len(words)] == list(words):
                return i
        raise AssertionError(f"{words} not in {argv}")

    out, conf = at("--tmpfs", str(host.out)), at("--tmpfs", str(host.conf))
    token = at("--ro-bind", "/dev/null", str(host.token))
    at("--tmpfs", str(host.secrets))
    cert = at("--ro-bind", str(host.cert), str(host.cert))
    bundle = at("--ro-bind", str(host.bundle), str(host.bundle))
    binds = [at("--bind", str(p), str(p)) for p in (spec.work, spec.home, spec.tmp)]
    # The CA certificate comes back after its folder was hidden; the run's own folders, inside
    # OUT, after OUT was hidden; then the hidden folders become read-only, and nothing else.
    assert conf < cert and conf < bundle
    assert max(out, conf, token, cert, bundle) < min(binds)
    readonly = [at("--remount-ro", str(p)) for p in (host.secrets, host.out, host.conf)]
    assert binds == sorted(binds) and binds[-1] + 3 == min(readonly)
    assert argv[max(readonly) + 2] == "--chdir"
    # What is inside a hidden folder is hidden with it; a path that does not exist is skipped.
    assert str(host.out / "rollouts") not in argv and str(host.out / "missing") not in argv
    assert "--bind" not in argv[: min(binds)]


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


def run_in(host: Host, script: str, index: int = 0) -> subprocess.CompletedProcess[str]:
    """``script`` (Python) run in run ``index``'s sandbox by the real bwrap."""
    argv = bwrap_argv(host.spec(index), [sys.executable, "-c", script], find_bwrap())
    env = {"PATH": os.environ["PATH"], "TMPDIR": str(host.runs[index] / "tmp")}
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)


def test_a_sandboxed_process_sees_only_what_it_may(host: Host) -> None:
    script = f"""
import os, pathlib, tempfile
def read(p):
    try:
        return pathlib.Path(p).read_text()
    except OSError as exc:
        return type(exc).__name__
def write(p):
    try:
        pathlib.Path(p).write_text("x")
        return "written"
    except OSError as exc:
        return type(exc).__name__
print(sorted(os.listdir({str(host.out)!r})))
print(sorted(os.listdir({str(host.conf)!r})))
print(read({str(host.key)!r}), read({str(host.cert)!r}).strip(), read({str(host.bundle)!r}).strip())
print(repr(read({str(host.token)!r})), os.listdir({str(host.secrets)!r}))
print(os.path.exists({str(host.runs[1])!r}), os.getcwd())
print(write("mine.txt"), write({str(host.runs[0] / "home" / "h")!r}),
      write(tempfile.gettempdir() + "/t"))
print(write({str(host.outside / "x")!r}), write("/etc/agenttap-x"),
      write({str(host.out / "planted")!r}), write({str(host.runs[1] / "work" / "x")!r}))
print(sorted(int(p) for p in os.listdir("/proc") if p.isdigit())[:3])
"""
    done = run_in(host, script)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    # OUT is empty but for the run's own folders; the confdir holds the certificate and bundle.
    assert lines[0] == "['rollouts']"
    assert lines[1] == "['agenttap-ca-bundle.pem', 'mitmproxy-ca-cert.pem']"
    assert lines[2] == "FileNotFoundError CERTIFICATE BUNDLE"
    # The token file is /dev/null on a nodev mount: it cannot be opened; the secret folder is
    # empty.
    assert lines[3] == "'PermissionError' []"
    assert lines[4] == f"False {host.runs[0] / 'work'}"  # the other run is not there
    assert lines[5] == "written written written"
    assert lines[6] == "OSError OSError OSError FileNotFoundError"
    assert lines[7] == "[1, 2]"  # its own PID namespace: bwrap's init, then itself
    assert (host.runs[0] / "work" / "mine.txt").exists() and (host.runs[0] / "tmp" / "t").exists()
    assert not (host.outside / "x").exists() and not (host.out / "planted").exists()
    assert not (host.runs[1] / "work" / "x").exists()


def test_root_cannot_write_the_kernels_settings(host: Host) -> None:
    # uid 0 owns /proc/sys: without the read-only cover it could set kernel.core_pattern (a
    # program the host's kernel runs as root). The hostname is the sandbox's own (its UTS
    # namespace), so trying it here changes nothing outside even without the cover.
    script = """
import os
try:
    open("/proc/sys/kernel/hostname", "w").write("agenttap-sandboxed")
    print("written")
except OSError as exc:
    print(type(exc).__name__, exc.errno)
print(os.access("/proc/sys/kernel/core_pattern", os.W_OK), os.uname().nodename)
"""
    done = run_in(host, script)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["OSError 30", f"False {os.uname().nodename}"]


def test_sockets_of_roots_services_and_sessions_are_hidden(tmp_path: Path) -> None:
    import socket

    temp = tmp_path / "tmp"
    (temp / "tmux-0").mkdir(parents=True)
    (temp / "plain").mkdir()
    (temp / "plain" / "file").write_text("x")
    listeners = []
    for path in (temp / "tmux-0" / "default", temp / "agent.sock"):
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(str(path))
        sock.listen()
        listeners.append(sock)
    try:
        found = host_sockets((temp, tmp_path / "missing"))
        assert found[:2] == (Path("/run"), Path("/var/run"))
        assert set(found[2:]) == {temp / "agent.sock", temp / "tmux-0"}
        (tmp_path / "host").mkdir()
        host = Host(tmp_path / "host")
        spec = host.spec()
        spec = SandboxSpec(spec.work, spec.home, spec.tmp, hide=(*spec.hide, *found))
        script = f"""
import os, socket
for path in ({str(temp / "tmux-0" / "default")!r}, {str(temp / "agent.sock")!r}):
    try:
        socket.socket(socket.AF_UNIX).connect(path)
        print("connected")
    except OSError as exc:
        print(type(exc).__name__)
print(os.listdir("/run"), os.listdir({str(temp / "plain")!r}))
"""
        argv = bwrap_argv(spec, [sys.executable, "-c", script], find_bwrap())
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        assert done.stdout.splitlines() == [
            "FileNotFoundError",  # its folder is empty
            "ConnectionRefusedError",  # /dev/null, not the socket
            "[] ['file']",
        ]
    finally:
        for sock in listeners:
            sock.close()


def test_root_cannot_unmount_what_hides_a_folder(host: Host) -> None:
    # Without --cap-drop ALL, root keeps CAP_SYS_ADMIN in the sandbox and umount shows the key.
    script = f"""
import pathlib, subprocess
subprocess.run(["umount", {str(host.conf)!r}], capture_output=True)
subprocess.run(["umount", "-l", {str(host.conf)!r}], capture_output=True)
subprocess.run(["umount", "-l", {str(host.out)!r}], capture_output=True)
key = pathlib.Path({str(host.key)!r})
print(key.read_text() if key.exists() else "hidden")
print(pathlib.Path({str(host.out / "threads" / "shard.parquet")!r}).exists())
print(open("/proc/self/status").read().split("CapEff:")[1].split()[0])
"""
    done = run_in(host, script)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["hidden", "False", "0000000000000000"]


def test_a_daemon_dies_with_the_sandbox_and_the_jail_waits_for_it(host: Host) -> None:
    work = host.runs[0] / "work"

    async def main() -> tuple[int | None, list[int], bool]:
        info_r, info_w = os.pipe()
        argv = bwrap_argv(
            host.spec(),
            ["sh", "-c", "setsid sleep 60 & echo $! > pid; exec sleep 0.3"],
            find_bwrap(),
            info_fd=info_w,
        )
        proc = await asyncio.create_subprocess_exec(*argv, pass_fds=(info_w,))
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
        argv = bwrap_argv(
            host.spec(), ["sh", "-c", "setsid sleep 60 & sleep 60"], find_bwrap(), info_fd=info_w
        )
        proc = await asyncio.create_subprocess_exec(*argv, pass_fds=(info_w,))
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
