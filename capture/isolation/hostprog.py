"""An agent's program from the host, run in a container of any image as if it were installed
there: the program's own ELF file, copied once with its interpreter (``PT_INTERP``) changed to
the host's dynamic loader shown at ``/.agenttap/ld.so``, and that loader copied with its cache
file's name changed to ``/.agenttap/cache``: a library cache of the host's libraries as the
container sees them (under ``/.agenttap/host/usr``). The copy is shown over the program's own
path, so the kernel runs it directly: ``/proc/self/exe`` is the program (node's
``process.execPath``: Claude Code's built-in ripgrep and Gemini CLI's relaunch run it again),
and nothing is in its environment for the programs it starts (its tool calls are the image's,
with the image's own loader and libraries).

Both edits keep every byte's place (a shorter path padded with NULs): a program that reads a
payload from its own file (a bun-compiled CLI) is unchanged but for those bytes. Copies live in
a cache folder of this host, named by the source file's identity (device, inode, size, mtime).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import struct
import subprocess
import tempfile
from pathlib import Path

# In every container: the host's loader (edited) and its library cache.
LOADER_AT = "/.agenttap/ld.so"
CACHE_AT = "/.agenttap/cache"
# What the loader reads by default, and the name it reads instead (the same length).
_HOST_CACHE = b"/etc/ld.so.cache\x00"
_OUR_CACHE = CACHE_AT.encode() + b"\x00"
assert len(_HOST_CACHE) == len(_OUR_CACHE)
PT_INTERP = 3
ELF_MAGIC = b"\x7fELF"


def cache_root() -> Path:
    """Where edited copies are kept (``AGENTTAP_IMAGE_CACHE``, else ~/.cache/agenttap)."""
    env = os.environ.get("AGENTTAP_IMAGE_CACHE")
    base = Path(env) if env else Path.home() / ".cache" / "agenttap"
    folder = base / "hostprog"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def is_dynamic_elf(path: Path) -> bool:
    """Whether ``path`` is an ELF program with an interpreter (dynamically linked)."""
    try:
        with open(path, "rb") as fh:
            return _interp_slot(fh) is not None
    except OSError:
        return False


def _interp_slot(fh: object) -> tuple[int, int] | None:
    """The offset and size of a 64-bit little-endian ELF's PT_INTERP path; None otherwise."""
    read = fh.read  # type: ignore[attr-defined]
    seek = fh.seek  # type: ignore[attr-defined]
    seek(0)
    head = read(64)
    if len(head) < 64 or head[:4] != ELF_MAGIC or head[4] != 2 or head[5] != 1:
        return None
    (phoff,) = struct.unpack_from("<Q", head, 0x20)
    phentsize, phnum = struct.unpack_from("<HH", head, 0x36)
    for index in range(phnum):
        seek(phoff + index * phentsize)
        entry = read(phentsize)
        if len(entry) < 0x28:
            return None
        (kind,) = struct.unpack_from("<I", entry, 0)
        if kind == PT_INTERP:
            offset, size = (
                struct.unpack_from("<Q", entry, 0x08)[0],
                struct.unpack_from("<Q", entry, 0x20)[0],
            )
            return offset, size
    return None


def _identity(path: Path) -> str:
    st = os.stat(path)
    key = f"{os.path.realpath(path)}|{st.st_dev}|{st.st_ino}|{st.st_size}|{st.st_mtime_ns}"
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def _made_once(dest: Path, make: object) -> Path:
    """``dest`` made by ``make(staged)`` unless it exists, under a lock (two proxies, two
    workers), moved into place whole."""
    if dest.exists():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(dest.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if dest.exists():
            return dest
        staged = Path(tempfile.mkdtemp(dir=dest.parent)) / dest.name
        try:
            make(staged)  # type: ignore[operator]
            os.replace(staged, dest)
        finally:
            shutil.rmtree(staged.parent, ignore_errors=True)
    return dest


def edited_program(program: Path) -> Path:
    """A copy of the dynamic ELF ``program`` whose interpreter is ``LOADER_AT``; ValueError
    when its interpreter slot is too short for that path."""
    real = Path(os.path.realpath(program))

    def make(staged: Path) -> None:
        shutil.copy2(real, staged)
        with open(staged, "r+b") as fh:
            slot = _interp_slot(fh)
            if slot is None:
                raise ValueError(f"{real} is not a dynamically linked ELF program")
            offset, size = slot
            path = LOADER_AT.encode()
            if len(path) + 1 > size:
                raise ValueError(f"{real}: its interpreter path has room for {size - 1} bytes")
            fh.seek(offset)
            fh.write(path + b"\x00" * (size - len(path)))

    return _made_once(cache_root() / _identity(real) / real.name, make)


def host_loader() -> Path:
    """The host's dynamic loader (its real path)."""
    for name in ("/lib64/ld-linux-x86-64.so.2", "/lib/ld-linux-aarch64.so.1"):
        if os.path.exists(name):
            return Path(os.path.realpath(name))
    raise FileNotFoundError("the host's dynamic loader was not found")


def edited_loader() -> Path:
    """A copy of the host's loader that reads ``CACHE_AT`` for its library cache."""
    loader = host_loader()

    def make(staged: Path) -> None:
        data = loader.read_bytes()
        if data.count(_HOST_CACHE) != 1:
            raise ValueError(f"{loader}: its library cache's name was not found once")
        staged.write_bytes(data.replace(_HOST_CACHE, _OUR_CACHE))
        staged.chmod(0o755)

    return _made_once(cache_root() / _identity(loader) / "ld.so", make)


def library_cache(host_usr_at: str) -> Path:
    """A library cache (``ldconfig``'s format) of the host's library folder as the container
    sees it (under ``host_usr_at``): made once, in a mount namespace of its own."""
    libs = host_loader().parent  # /usr/lib/x86_64-linux-gnu on a merged-/usr host
    inside = host_usr_at.rstrip("/") + "/" + str(libs.relative_to("/usr"))

    def make(staged: Path) -> None:
        root = Path(tempfile.mkdtemp(dir=staged.parent))
        try:
            (root / inside.lstrip("/")).mkdir(parents=True)
            (root / "ld.conf").write_text(inside + "\n")
            script = 'mount --bind "$1" "$2" && ldconfig -X -r "$3" -f /ld.conf -C /cache'
            done = subprocess.run(
                ["unshare", "-m", "sh", "-c", script, "sh", str(libs),
                 str(root / inside.lstrip("/")), str(root)],
                capture_output=True, text=True, check=False,
            )  # fmt: skip
            if done.returncode != 0 or not (root / "cache").exists():
                raise OSError(f"the host's library cache could not be made: {done.stderr}")
            shutil.copyfile(root / "cache", staged)
        finally:
            subprocess.run(["umount", "-R", str(root)], capture_output=True, check=False)
            shutil.rmtree(root, ignore_errors=True)

    key = hashlib.sha256(f"{_identity(libs)}|{inside}".encode()).hexdigest()[:16]
    return _made_once(cache_root() / key / "ld.so.cache", make)
