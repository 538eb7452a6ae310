"""A rollout's limits (capture/isolation/) on the real kernel: real cgroups, a real tmpfs,
real processes (python, Node, sh) pushed past each limit, and the request's "limits" parsed.
These machines run the tests as root with cgroup v1's memory, pids and cpuacct writable."""

from __future__ import annotations

import asyncio
import os
import stat
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from capture.isolation import disk
from capture.isolation import host as L
from capture.isolation.cgroup import RolloutCgroup
from capture.isolation.disk import DiskQuota
from capture.isolation.host import remove_stale
from capture.isolation.limits import SandboxLimits, parse_sandbox_limits
from capture.isolation.output import OutputPump, pump_output
from capture.isolation.watch import limit_hit, watch

PY = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable
NODE = "/usr/bin/node"
MIB = 1 << 20


def test_this_host_enforces_every_limit() -> None:
    line = L.mechanism()
    assert "cgroup v1 memory (swap counted) + pids + cpuacct" in line, line
    assert "prlimit cpu/fsize/core" in line and "size-capped tmpfs" in line, line
    assert "NOT enforced" not in line, line


@pytest.fixture(scope="module", autouse=True)
def _release() -> object:
    yield
    L.release()  # this test process's own folders under agenttap/


# ---------------------------------------------------------------- parsing


def test_parse_defaults_values_and_session_keys() -> None:
    d = SandboxLimits()
    assert parse_sandbox_limits(None, d) == d
    assert parse_sandbox_limits({}, d) == d
    got = parse_sandbox_limits(
        {"memory_mb": 256, "pids": 64, "cpu_s": 2, "max_calls": 5, "deadline_s": 9.5}, d
    )
    assert got == SandboxLimits(memory_mb=256, pids=64, disk_mb=2048, cpu_s=2.0, output_mb=16)
    assert isinstance(got.cpu_s, float)
    # The caller's defaults fill the rest, not the class's.
    assert parse_sandbox_limits({"disk_mb": 8}, SandboxLimits(pids=7)).pids == 7


@pytest.mark.parametrize(
    ("value", "needle"),
    [
        ([1], '"limits" must be an object'),
        ({"memory": 5}, "memory_mb, pids, disk_mb, cpu_s, output_mb, max_calls"),
        ({"memory_mb": 0}, '"limits.memory_mb" must be a whole number from 1'),
        ({"memory_mb": "512"}, "not '512'"),
        ({"pids": True}, '"limits.pids" must be a whole number'),
        ({"pids": 1.5}, '"limits.pids"'),
        ({"disk_mb": None}, "leave it out for the default (2048)"),
        ({"output_mb": 1 << 40}, '"limits.output_mb"'),
        ({"cpu_s": 0}, '"limits.cpu_s" must be a number of CPU seconds > 0'),
        ({"cpu_s": float("nan")}, '"limits.cpu_s"'),
        ({"cpu_s": float("inf")}, '"limits.cpu_s"'),
        ({"cpu_s": "1"}, '"limits.cpu_s"'),
    ],
)
def test_parse_refuses_bad_values_clearly(value: object, needle: str) -> None:
    with pytest.raises(ValueError) as exc:
        parse_sandbox_limits(value, SandboxLimits())
    assert needle in str(exc.value)


# ---------------------------------------------------------------- cgroups


@pytest.fixture
async def cgroups() -> AsyncIterator[Callable[..., RolloutCgroup]]:
    """Makes runs' cgroups; each is removed at the end and must leave no folder behind."""
    made: list[RolloutCgroup] = []

    def make(**kw: float) -> RolloutCgroup:
        cg = RolloutCgroup.create("test run", SandboxLimits(**kw))  # type: ignore[arg-type]
        made.append(cg)
        return cg

    yield make
    for cg in made:
        assert await cg.remove()
        assert not any(d.exists() for d in cg.dirs.values()), cg.dirs


def run(prefix: list[str], *cmd: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*prefix, *cmd], capture_output=True, text=True, timeout=timeout, check=False
    )


def test_create_names_are_safe_unique_and_limits_are_written(cgroups: Callable) -> None:
    a, b = cgroups(memory_mb=300, pids=40), cgroups()
    assert a.name.startswith("test_run-") and a.name != b.name
    assert set(a.dirs) == {"memory", "pids", "cpuacct"}
    mem = a.dirs["memory"]
    assert int((mem / "memory.limit_in_bytes").read_text()) == 300 * MIB
    assert int((mem / "memory.memsw.limit_in_bytes").read_text()) == 300 * MIB
    assert (a.dirs["pids"] / "pids.max").read_text().strip() == "40"
    assert a.exceeded() is None


def test_memory_limit_kills_a_process_past_it(cgroups: Callable) -> None:
    cg = cgroups(memory_mb=128)
    done = run(cg.launch_prefix(), PY, "-c", "b = bytearray(1 << 30); print('survived')")
    assert done.returncode == -9 and "survived" not in done.stdout
    assert cg.exceeded() == "memory" == limit_hit(cg, None, None)
    assert cg.oom_kills() >= 1
    assert cg.usage()["memory_peak_bytes"] <= 128 * MIB


def test_node_starts_under_the_memory_cgroup_and_is_killed_past_it(cgroups: Callable) -> None:
    # RLIMIT_AS is no memory limit for Node: V8 reserves address space it never uses.
    as_cap = run(["prlimit", f"--as={256 * MIB}", "--"], NODE, "-e", "console.log('started')")
    assert as_cap.returncode != 0 and "started" not in as_cap.stdout
    cg = cgroups(memory_mb=256)
    ok = run(
        cg.launch_prefix(), NODE, "-e", "const b = Buffer.alloc(64 << 20, 1); console.log('ok')"
    )
    assert (ok.returncode, ok.stdout.strip()) == (0, "ok"), ok.stderr
    assert cg.exceeded() is None
    grow = "const a = []; for (;;) { a.push(Buffer.alloc(16 << 20, 1)); }"
    killed = run(cg.launch_prefix(), NODE, "-e", grow)
    assert killed.returncode == -9, killed.stderr
    assert cg.exceeded() == "memory"


GROW_JS = """
const fs = require("fs");
console.log(fs.readFileSync("/proc/self/cgroup", "utf8").split("\\n").find((l) => l.includes(":memory:")));
const a = [];
for (;;) a.push(Buffer.alloc(16 << 20, 1));
"""
NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--"]
BWRAP = [
    "bwrap", "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc",
    "--unshare-user", "--unshare-pid", "--die-with-parent", "--",
]  # fmt: skip


def test_the_limits_hold_through_setpriv_and_bwrap(cgroups: Callable) -> None:
    # The runner's order: this prefix, then setpriv (a uid that owns nothing), then bwrap.
    cg = cgroups(memory_mb=256, pids=64)
    node = run(cg.launch_prefix(), *NOBODY, *BWRAP, NODE, "-e", GROW_JS)
    assert node.returncode == 137, node.stderr  # bwrap reports its child's SIGKILL
    assert f"/{cg.name}" in node.stdout
    assert cg.exceeded() == "memory"
    forks = run(
        cg.launch_prefix(), *NOBODY, *BWRAP,
        "/bin/sh", "-c", "for i in $(seq 100); do sleep 10 & done; wait",
    )  # fmt: skip
    assert "Cannot fork" in forks.stderr
    assert cg.pids_refused() > 0 and cg.usage()["pids_peak"] == 64


def test_tmpfs_pages_count_against_the_writers_memory(cgroups: Callable, tmp_path: Path) -> None:
    # The kernel charges a tmpfs page to whoever wrote it: disk_mb must sit below memory_mb for
    # a full disk to be the limit that is hit (the defaults: 2048 and 4096).
    cg = cgroups(memory_mb=64)
    quota = DiskQuota.mount(tmp_path / "box", 256)
    try:
        dd = run(
            cg.launch_prefix(), "dd", "if=/dev/zero", f"of={quota.path}/f", "bs=1M", "count=128"
        )
        assert dd.returncode == -9 and cg.exceeded() == "memory"
        assert quota.used_bytes() < 64 * MIB and not quota.full()
    finally:
        quota.unmount_keeping([], tmp_path)


async def test_pids_limit_refuses_a_fork_flood(cgroups: Callable) -> None:
    cg = cgroups(pids=32)
    flood = (
        "import os, time\n"
        "made = 0\n"
        "for _ in range(200):\n"
        "    try:\n"
        "        if os.fork() == 0:\n"
        "            os.close(1); os.close(2); time.sleep(30); os._exit(0)\n"
        "        made += 1\n"
        "    except OSError:\n"
        "        break\n"
        "print(made, flush=True)\n"
    )
    done = run(cg.launch_prefix(), PY, "-c", flood)  # its children keep no pipe open
    assert done.returncode == 0 and int(done.stdout) < 32
    assert cg.exceeded() == "pids"
    assert cg.usage()["pids_peak"] == 32
    assert len(cg.procs()) == int(done.stdout)  # its children live on in the cgroup
    assert await cg.kill_all()
    assert cg.procs() == []


BUSY = "while True: pass"


def test_rlimit_cpu_stops_a_busy_process_on_its_own(cgroups: Callable) -> None:
    cg = cgroups(cpu_s=1)
    done = run(cg.launch_prefix(), PY, "-c", BUSY)
    assert done.returncode == -9  # RLIMIT_CPU's hard limit (2 s): SIGKILL
    assert cg.exceeded() == "cpu_s"
    assert cg.usage()["cpu_s"] >= 1.0


async def test_watch_sees_cpu_seconds_of_all_processes_together(cgroups: Callable) -> None:
    # 1.5 s in all, 3 s each (RLIMIT_CPU's backstop): only the total can stop them.
    cg = cgroups(cpu_s=1.5)
    procs = [
        await asyncio.create_subprocess_exec(*cg.launch_prefix(), PY, "-c", BUSY) for _ in range(3)
    ]
    try:
        assert await asyncio.wait_for(watch(cg, None, None, 0.05), 10) == "cpu_s"
        assert all(p.returncode is None for p in procs)
        assert cg.usage()["cpu_s"] >= 1.5
    finally:
        assert await cg.kill_all()
        for p in procs:
            assert await p.wait() == -9


def test_launch_prefix_passes_any_argv_untouched(cgroups: Callable, tmp_path: Path) -> None:
    cg = cgroups()
    planted = tmp_path / "planted"
    hostile = [f"$(touch {planted})", "a b", "'\"; exit 3", "`id`", "-n", ""]
    done = run(cg.launch_prefix(), PY, "-c", "import sys; print(sys.argv[1:])", *hostile)
    assert done.returncode == 0 and done.stdout.strip() == repr(hostile)
    assert not planted.exists()
    # It ran in the cgroup, with the rlimits.
    inside = run(cg.launch_prefix(), "/bin/sh", "-c", "cat /proc/self/cgroup; ulimit -t; ulimit -c")
    for d in cg.dirs.values():
        assert str(d).split("/agenttap/")[1] in inside.stdout
    assert inside.stdout.split()[-2:] == ["3601", "0"]


def test_a_failed_join_stops_the_run(tmp_path: Path) -> None:
    cg = RolloutCgroup.create("gone", SandboxLimits())
    asyncio.run(cg.remove())
    done = run(cg.launch_prefix(), "/bin/echo", "ran")
    assert done.returncode == 125 and "ran" not in done.stdout
    assert "agenttap: could not join the cgroup" in done.stderr


def test_a_non_root_process_cannot_leave_its_cgroup(cgroups: Callable) -> None:
    cg = cgroups()
    top = cg.dirs["pids"].parents[2]  # the hierarchy's folder above agenttap/
    escape = f"echo $$ > {top}/cgroup.procs; cat /proc/self/cgroup"
    nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--"]
    done = run(cg.launch_prefix(), *nobody, "/bin/sh", "-c", escape)
    assert "Permission denied" in done.stderr
    assert cg.name in done.stdout


async def test_remove_stale_cleans_what_a_dead_instance_left(tmp_path: Path) -> None:
    ours = RolloutCgroup.create("live", SandboxLimits())
    dead_tag = f"{os.stat('/proc/self/ns/pid').st_ino}-999999999-1"
    other_ns = "1-999999999-1"  # another PID namespace's: never judged from here
    runs = []
    for d in ours.dirs.values():
        agenttap = d.parents[1]
        (agenttap / other_ns).mkdir()
        runs.append(agenttap / dead_tag / "r-1")
        runs[-1].mkdir(parents=True)
    sleeper = subprocess.Popen(
        ["/bin/sh", "-c", 'for f in "$@"; do echo $$ > "$f"; done; exec sleep 60', "sh"]
        + [str(r / "cgroup.procs") for r in runs]
    )
    box = tmp_path / "box"
    box.mkdir()
    L._mount_tmpfs(box, f"agenttap-{dead_tag}", 1)
    try:
        for _ in range(100):
            if L._procs(runs[0]):
                break
            await asyncio.sleep(0.01)
        removed = remove_stale()
        assert sleeper.wait(5) == -9
        assert all(str(r) in removed for r in runs)
        assert f"tmpfs {box}" in removed and not os.path.ismount(box)
        assert not any(r.parent.exists() for r in runs)
        assert all(d.exists() for d in ours.dirs.values())
        assert all((d.parents[1] / other_ns).exists() for d in ours.dirs.values())
    finally:
        for d in ours.dirs.values():
            (d.parents[1] / other_ns).rmdir()
        assert await ours.remove()


# ---------------------------------------------------------------- disk


def test_disk_quota_fills_then_keeps_only_the_named_folders(tmp_path: Path) -> None:
    box = tmp_path / "box"
    quota = DiskQuota.mount(box, 16)
    assert quota.mounted and os.path.ismount(box)
    assert not quota.full()
    work = box / "work"
    work.mkdir(mode=0o750)
    (work / "answer.txt").write_text("42\n")
    os.chmod(work / "answer.txt", 0o640 | stat.S_ISUID)
    os.link(work / "answer.txt", work / "hard.txt")
    os.symlink("/etc/hostname", work / "link")
    os.mkfifo(work / "fifo")
    with open(work / "sparse", "wb") as f:
        f.truncate(1 << 40)  # a TB that takes no space: it must not grow on the way out
    (box / "tmp").mkdir()
    big = bytes(MIB)
    with pytest.raises(OSError) as exc, open(box / "tmp" / "fill", "wb", buffering=0) as f:
        for _ in range(64):
            f.write(big)
    assert exc.value.errno == 28  # ENOSPC
    assert quota.full()
    assert 15 * MIB <= quota.used_bytes() <= 16 * MIB

    into = tmp_path / "kept"
    into.mkdir()
    skipped = quota.unmount_keeping(["work", "home"], into)
    assert not os.path.ismount(box) and list(box.iterdir()) == []
    kept = into / "work"
    assert skipped == [f"{work / 'fifo'} (a FIFO, socket or device)"]
    assert (kept / "answer.txt").read_text() == "42\n"
    assert stat.S_IMODE(os.stat(kept / "answer.txt").st_mode) == 0o640  # setuid dropped
    assert stat.S_IMODE(os.stat(kept).st_mode) == 0o750
    assert os.path.samefile(kept / "answer.txt", kept / "hard.txt")
    assert os.readlink(kept / "link") == "/etc/hostname"
    assert os.stat(kept / "sparse").st_size == 1 << 40
    assert os.stat(kept / "sparse").st_blocks == 0
    assert not (into / "tmp").exists() and not (into / "home").exists()


def test_a_containers_layer_is_walked_each_second_and_afresh_once_its_run_ended(
    tmp_path: Path,
) -> None:
    """A container's writable layer (a plain folder of the engine's) against its disk_mb: the
    watch walks it at most once a second; the last look, once the run has ended, walks it
    again, so a layer filled in the run's last moment still names the "disk" limit."""
    layer = tmp_path / "upper"
    layer.mkdir()
    quota = DiskQuota.layer(layer, 1)
    assert not quota.mounted and quota.walk_every_s == disk.LAYER_WALK_EVERY_S == 1.0
    assert limit_hit(None, None, None, quota) is None
    (layer / "f").write_bytes(b"x" * (2 << 20))
    assert limit_hit(None, None, None, quota) is None  # walked less than a second ago
    assert limit_hit(None, None, None, quota, ended=True) == "disk"
    assert layer.exists()  # the engine's folder: never emptied here


def test_a_tree_past_path_max_keeps_what_it_can_and_says_what_it_skipped(tmp_path: Path) -> None:
    """An agent's folders nested past PATH_MAX (4096 bytes): the rest is kept, the too-deep
    part is named in what was skipped, and nothing raises."""
    box = tmp_path / "box"
    quota = DiskQuota.mount(box, 16)
    work = box / "work"
    work.mkdir()
    (work / "answer.txt").write_text("42\n")
    fd = os.open(work, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(30):  # 30 x 201 bytes: past PATH_MAX from any root
            os.mkdir("d" * 200, dir_fd=fd)
            inner = os.open("d" * 200, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = inner
        with open(os.open("deep.txt", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd), "w") as f:
            f.write("too deep")
    finally:
        os.close(fd)
    into = tmp_path / "kept"
    into.mkdir()
    skipped = quota.unmount_keeping(["work"], into)
    assert (into / "work" / "answer.txt").read_text() == "42\n"
    assert len(skipped) == 1 and "File name too long" in skipped[0], skipped
    assert (into / "work" / ("d" * 200)).is_dir()  # the part that fits is kept


def test_a_failed_copy_or_an_open_file_still_unmounts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    quota = DiskQuota.mount(tmp_path / "box", 1)
    (quota.path / "work").mkdir()
    (tmp_path / "work").mkdir()  # in the way
    with pytest.raises(FileExistsError):
        quota.unmount_keeping(["work"], tmp_path)
    assert not os.path.ismount(quota.path)
    # A process left with a file open (the runner should have killed it): detached, not stuck.
    monkeypatch.setattr(disk, "UNMOUNT_RETRY_S", 0.1)
    quota = DiskQuota.mount(tmp_path / "box", 1)
    with open(quota.path / "held", "w"):
        assert quota.unmount_keeping([], tmp_path) == []
        assert not os.path.ismount(quota.path)


async def test_watch_names_a_full_disk(tmp_path: Path) -> None:
    quota = DiskQuota.mount(tmp_path / "box", 4)
    try:
        with pytest.raises(OSError), open(quota.path / "f", "wb", buffering=0) as f:
            for _ in range(8):
                f.write(bytes(MIB))
        assert await asyncio.wait_for(watch(None, quota, None, 0.05), 5) == "disk"
    finally:
        quota.unmount_keeping([], tmp_path)


REPO = Path(__file__).resolve().parents[3]
AS_NOBODY = """
import subprocess, sys, tempfile
from pathlib import Path
from capture.isolation import cgroup, disk, host, limits
print(host.mechanism())
cg = cgroup.RolloutCgroup.create("x", limits.SandboxLimits(disk_mb=1))
quota = disk.DiskQuota.mount(Path(tempfile.mkdtemp()) / "box", 1)
dd = ["dd", "if=/dev/zero", f"of={quota.path}/f", "bs=1M", "count=4"]
done = subprocess.run([*cg.launch_prefix(), *dd], capture_output=True)
print(cg.dirs, cg.launch_prefix()[0], quota.mounted, done.returncode, quota.full())
"""


def test_without_root_it_says_what_is_not_enforced() -> None:
    # The system's python: the venv's lives under /root, which uid 65534 cannot enter.
    done = subprocess.run(
        [*NOBODY, "env", f"PYTHONPATH={REPO}", "HOME=/tmp", "/usr/bin/python3", "-c", AS_NOBODY],
        capture_output=True, text=True, timeout=30, cwd="/tmp", check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    line, state = done.stdout.splitlines()
    assert line.startswith("agenttap limits: prlimit cpu/fsize/core per process"), line
    assert "disk: a plain folder, RLIMIT_FSIZE per file" in line
    assert "NOT enforced: memory, pids, total cpu_s" in line
    assert "tmpfs mounts need root (euid 65534)" in line and "Permission denied" in line
    # No cgroup, prlimit alone; a plain folder; RLIMIT_FSIZE stops dd (SIGXFSZ) at 1 MiB.
    assert state == "{} /usr/bin/prlimit False -25 True"


def test_a_plain_folder_quota_moves_what_is_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    h = L._host()
    monkeypatch.setattr(L, "_host_cache", L._Host("", {}, h.prlimit, False, ["simulated"]))
    quota = DiskQuota.mount(tmp_path / "box", 1)
    assert not quota.mounted and not os.path.ismount(quota.path)
    (quota.path / "work").mkdir()
    (quota.path / "work" / "a").write_bytes(bytes(2 * MIB))
    (quota.path / "tmp").mkdir()
    assert quota.full() and quota.used_bytes() >= 2 * MIB
    into = tmp_path / "kept"
    into.mkdir()
    assert quota.unmount_keeping(["work"], into) == []
    assert (into / "work" / "a").stat().st_size == 2 * MIB
    assert list(quota.path.iterdir()) == []
    assert RolloutCgroup.create("r", SandboxLimits()).launch_prefix()[0] == h.prlimit


# ---------------------------------------------------------------- output


WRITER = (
    "import sys\n"
    "out = sys.stdout.buffer\n"
    "for i in range(int(sys.argv[1])):\n"
    "    out.write(b'%07d' % i + b'.' * 1016 + b'\\n')\n"
    "out.write(b'THE END\\n')\n"
)


async def _pumped(tmp_path: Path, lines: int, cap: int) -> tuple[bool, bytes, int]:
    proc = await asyncio.create_subprocess_exec(
        PY, "-c", WRITER, str(lines), stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    assert proc.stdout is not None
    log = tmp_path / "agent.log"
    hit = await asyncio.wait_for(pump_output(proc.stdout, log, cap), 20)
    return hit, log.read_bytes(), await proc.wait()


async def test_output_past_the_cap_is_flagged_and_the_log_bounded(tmp_path: Path) -> None:
    hit, log, code = await _pumped(tmp_path, 3 * 1024, MIB)  # 3 MiB
    # The agent wrote everything and exited: the pipe was drained past the cap.
    assert hit and code == 0
    assert MIB <= len(log) <= MIB + 200
    assert log.startswith(b"0000000.") and log.endswith(b"THE END\n")
    assert b"[agenttap: output limit of 1048576 bytes reached:" in log


async def test_output_under_the_cap_is_kept_whole(tmp_path: Path) -> None:
    hit, log, code = await _pumped(tmp_path, 900, MIB)
    assert not hit and code == 0
    assert len(log) == 900 * 1024 + 8 and b"agenttap" not in log


async def test_watch_names_the_output_limit_at_once_from_a_pipe_fd(tmp_path: Path) -> None:
    r, w = os.pipe()
    pump = OutputPump(tmp_path / "agent.log", 64 * 1024)
    task = asyncio.ensure_future(pump.run(r))
    watcher = asyncio.ensure_future(watch(None, None, pump, 30))
    writer = asyncio.ensure_future(asyncio.to_thread(os.write, w, b"x" * 100_000))
    assert await asyncio.wait_for(watcher, 5) == "output"
    await writer
    os.close(w)
    assert await asyncio.wait_for(task, 5) is True
    assert len((tmp_path / "agent.log").read_bytes()) <= 64 * 1024 + 200
