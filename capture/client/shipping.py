"""Folders that travel with a rollout from the driver to the node that runs it: a seed workdir, a
Harbor task folder, a verifier's tests. ``pack_folder`` makes one tar (the bytes Ray's object
store carries, so no node needs the driver's filesystem); ``unpack_folder`` writes it once per
node under a folder named by its content's hash, so the agents of a group, and later groups with
the same folder, reuse one copy.

Links are kept as links; extraction refuses any member that would land outside its folder (an
absolute path, ``..``, a link pointing out of it) with tarfile's ``data`` filter: a folder is
data the caller sent, not trusted.
"""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import stat
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

# Where a node keeps the folders it was sent (one per content hash), per user: a folder found
# there is used as it is, so nobody else may write in it (checked by ``private_root``).
SHIPPED_ROOT = Path(tempfile.gettempdir()) / f"agenttap-shipped-{os.getuid()}"


@dataclass(frozen=True)
class Packed:
    """A folder as one tar: its bytes and their hash (the name it is unpacked under)."""

    name: str  # the folder's own name, kept: a Harbor task's name is its folder's
    digest: str
    data: bytes


def pack_folder(folder: str | os.PathLike[str]) -> Packed:
    """``folder`` (and everything under it, links as links) as one tar in memory. ValueError,
    worded for the caller, for a path that is not a folder."""
    root = Path(folder)
    if not root.is_dir():
        raise ValueError(f"{str(folder)!r} is not a folder: a rollout ships folders to its node")
    real = Path(os.path.realpath(root))
    members = sorted(root.rglob("*"))
    for path in members:  # what the node's unpacking (and agenttap's seed copy) would refuse
        shown = path.relative_to(root)
        if path.is_symlink():
            target = Path(os.path.realpath(path))
            if not target.is_relative_to(real) or not target.exists():
                raise ValueError(
                    f"{str(folder)!r}: the link {str(shown)!r} points outside the folder or to "
                    "nothing; a folder shipped to a node holds only what is in it"
                )
        elif not (path.is_file() or path.is_dir()):
            raise ValueError(f"{str(folder)!r}: {str(shown)!r} is not a file, folder or link")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        # Sorted, so the same folder gives the same bytes (and the same hash) every time.
        for path in members:
            tar.add(path, arcname=str(path.relative_to(root)), recursive=False)
    data = buf.getvalue()
    return Packed(root.resolve().name, hashlib.sha256(data).hexdigest()[:24], data)


def unpack_folder(packed: Packed, root: Path = SHIPPED_ROOT) -> Path:
    """``packed`` written under ``root/DIGEST/NAME`` (once: a folder already there is reused);
    its path. Written to a temporary folder first and moved into place, so two rollouts
    unpacking the same folder at once never see half of it."""
    private_root(root)
    final = root / packed.digest / packed.name
    if final.is_dir():
        return final
    staging = Path(tempfile.mkdtemp(prefix=".unpack-", dir=root))
    try:
        inner = staging / packed.name
        inner.mkdir()
        with tarfile.open(fileobj=io.BytesIO(packed.data), mode="r") as tar:
            tar.extractall(inner, filter="data")
        (root / packed.digest).mkdir(exist_ok=True)
        try:
            inner.rename(final)
        except OSError:
            if not final.is_dir():  # not another unpack of the same folder winning the race
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return final


def private_root(root: Path) -> None:
    """Make ``root`` (mode 0700) or check that it is this user's alone: a folder another user
    could write in (in a shared /tmp) could hold a planted copy under a content hash it can
    compute, which would be used as the group's seed. OSError, saying so, otherwise."""
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = os.lstat(root)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise OSError(
            f"{root} (where shipped folders are unpacked) is not a folder only this user may "
            "open: remove it, and agenttap makes it anew"
        )
