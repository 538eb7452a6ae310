"""A host program's copy for a container (capture/isolation/hostprog.py): only its interpreter
path changes, every other byte keeps its place; the loader's copy reads agenttap's library
cache, which lists the host's libraries as the container sees them."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from capture.isolation import hostprog


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGENTTAP_IMAGE_CACHE", str(tmp_path / "cache"))


def interpreter(path: Path) -> bytes:
    with open(path, "rb") as fh:
        slot = hostprog._interp_slot(fh)
        assert slot is not None
        fh.seek(slot[0])
        return fh.read(slot[1]).rstrip(b"\x00")


def test_a_programs_copy_differs_only_in_its_interpreter() -> None:
    python = Path(os.path.realpath("/usr/bin/python3"))
    assert hostprog.is_dynamic_elf(python) and not hostprog.is_dynamic_elf(Path("/etc/hostname"))
    copy = hostprog.edited_program(python)
    assert interpreter(copy) == hostprog.LOADER_AT.encode()
    assert interpreter(python).startswith(b"/lib")  # the original is untouched
    old, new = python.read_bytes(), copy.read_bytes()
    assert len(old) == len(new)
    changed = [i for i, (a, b) in enumerate(zip(old, new, strict=True)) if a != b]
    with open(python, "rb") as fh:
        offset, size = hostprog._interp_slot(fh) or (0, 0)
    assert changed and all(offset <= i < offset + size for i in changed)
    assert os.access(copy, os.X_OK)
    # Made once: the second call finds it.
    assert hostprog.edited_program(python) == copy


def test_the_loaders_copy_reads_agenttaps_cache_of_the_hosts_libraries() -> None:
    loader = hostprog.edited_loader().read_bytes()
    assert b"/etc/ld.so.cache\x00" not in loader and hostprog.CACHE_AT.encode() in loader
    cache = hostprog.library_cache("/.agenttap/host/usr")
    listed = subprocess.run(
        ["ldconfig", "-p", "-C", str(cache)], capture_output=True, text=True, check=True
    ).stdout
    libc = [line for line in listed.splitlines() if "libc.so.6 " in line]
    assert libc and "/.agenttap/host/usr/lib/" in libc[0], listed[:500]
