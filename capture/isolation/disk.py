"""A run's disk limit: its work, HOME and TMPDIR on a tmpfs of ``disk_mb`` (``DiskQuota``),
copied out to real disk (``unmount_keeping``) when the run ends; a plain folder, walked now and
then, where this process may not mount one."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import stat
import time
from pathlib import Path

from capture.isolation.host import DEGRADED_WALK_EVERY_S, _host, _mount_tmpfs, _umount, instance_tag
from capture.isolation.limits import MIB

logger = logging.getLogger(__name__)

# leaves at most a partial page free).
FULL_SLACK_BYTES = 256 * 1024
# How often a container's writable layer is walked: its writes reach the host's disk.
LAYER_WALK_EVERY_S = 1.0
# How long an unmount waits for the last open file of a run to close before detaching it.
UNMOUNT_RETRY_S = 1.0
# A degraded disk quota (a plain folder) is measured by walking it: at most this often.


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

    def __init__(
        self,
        path: Path,
        size_bytes: int,
        mounted: bool,
        walk_every_s: float = DEGRADED_WALK_EVERY_S,
    ) -> None:
        self.path = path
        self.size_bytes = size_bytes
        self.mounted = mounted
        # A plain folder's size is walked at most this often (``full``).
        self.walk_every_s = walk_every_s
        self._walked: tuple[float, int] | None = None

    @classmethod
    def layer(cls, path: Path, disk_mb: int) -> DiskQuota:
        """A container's writable layer (the engine's folder, on the host's disk) held to
        ``disk_mb``: walked every second (a file is capped at ``disk_mb`` by the container's
        RLIMIT_FSIZE meanwhile), never unmounted or emptied here (the engine removes it)."""
        return cls(path, disk_mb * MIB, mounted=False, walk_every_s=LAYER_WALK_EVERY_S)

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

    def full(self, fresh: bool = False) -> bool:
        """Whether the disk limit was hit: (almost) no space or no inode left. A plain folder
        is walked again if ``fresh`` (the last look once its run has ended)."""
        if self.mounted:
            st = os.statvfs(self.path)
            return st.f_bavail * st.f_frsize < FULL_SLACK_BYTES or st.f_favail == 0
        now = time.monotonic()
        if fresh or self._walked is None or now - self._walked[0] > self.walk_every_s:
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
