"""Folders shipped to a pool's nodes (capture/client/shipping.py)."""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path

import pytest

from capture.client.shipping import Packed, pack_folder, unpack_folder


def test_a_folder_travels_whole_once_per_content(tmp_path: Path) -> None:
    src = tmp_path / "task"
    (src / "sub").mkdir(parents=True)
    (src / "sub" / "a.txt").write_text("alpha")
    script = src / "run.sh"
    script.write_text("#!/bin/sh\necho 1\n")
    script.chmod(0o755)
    os.symlink("sub/a.txt", src / "link")
    packed = pack_folder(src)
    assert packed.name == "task" and pack_folder(src).digest == packed.digest  # deterministic
    out = unpack_folder(packed, tmp_path / "node")
    assert out.name == "task" and (out / "sub" / "a.txt").read_text() == "alpha"
    assert os.access(out / "run.sh", os.X_OK) and os.readlink(out / "link") == "sub/a.txt"
    # Unpacked once: a second group with the same folder reuses it.
    (out / "marker").write_text("x")
    assert unpack_folder(packed, tmp_path / "node") == out and (out / "marker").exists()
    (src / "sub" / "a.txt").write_text("changed")
    assert unpack_folder(pack_folder(src), tmp_path / "node") != out


def test_a_member_that_leaves_its_folder_is_refused(tmp_path: Path) -> None:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo("../escaped")
        data = b"owned"
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    with pytest.raises(tarfile.TarError):
        unpack_folder(Packed("evil", "d" * 24, buf.getvalue()), tmp_path / "node")
    assert not (tmp_path / "node" / "escaped").exists()
    assert not list((tmp_path / "node").glob("d*/evil"))


def test_a_path_that_is_no_folder_is_refused_in_words(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="is not a folder"):
        pack_folder(tmp_path / "missing")


def test_a_link_out_of_the_folder_is_refused_on_the_driver(tmp_path: Path) -> None:
    src = tmp_path / "task"
    src.mkdir()
    os.symlink("/etc/passwd", src / "out")
    with pytest.raises(ValueError, match="'out' points outside the folder"):
        pack_folder(src)
    (src / "out").unlink()
    os.symlink("missing", src / "dangling")
    with pytest.raises(ValueError, match="'dangling' points outside the folder or to nothing"):
        pack_folder(src)
    (src / "dangling").unlink()
    os.mkfifo(src / "pipe")
    with pytest.raises(ValueError, match="'pipe' is not a file, folder or link"):
        pack_folder(src)


def test_an_unpack_folder_others_may_write_in_is_refused(tmp_path: Path) -> None:
    """A copy planted under a content hash another user can compute would be used as the
    group's seed: the unpack folder must be this user's alone."""
    packed = Packed("task", "e" * 24, b"")
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    (shared / ("e" * 24) / "task").mkdir(parents=True)  # "planted"
    with pytest.raises(OSError, match="not a folder only this user may open"):
        unpack_folder(packed, shared)
    fresh = tmp_path / "fresh"
    unpack_folder(pack_folder(tmp_path / "shared"), fresh)
    assert (fresh.stat().st_mode & 0o777) == 0o700
