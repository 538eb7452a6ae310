"""The workdir copies a sandboxed run works on: ``copy_seed`` copies a task's workdir for a
run (a symlink that resolves inside the workdir is copied as what it points to; one pointing
outside it, or nowhere, refuses the copy); ``restore`` puts paths back from the seed into a
finished run's copy before it is scored; ``sanitize`` removes what the agent left for the
verifier to trip on (links out of the workdir, FIFOs, sockets) before it runs; ``give_to`` hands
a run's folders to the sandbox's user. Standard library only."""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
from pathlib import Path, PurePosixPath


class UnsafeWorkdir(ValueError):
    """A seed workdir that cannot be copied safely (a link out of it, a loop, a device)."""


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


def give_to(uid: int | None, *folders: Path) -> None:
    """Make ``folders`` and everything in them owned by ``uid`` (and its gid), links
    themselves and never what they point to; None: left as they are."""
    if uid is None:
        return
    for folder in folders:
        os.lchown(folder, uid, uid)
        for base, dirs, files in os.walk(folder):
            for name in (*dirs, *files):
                os.lchown(os.path.join(base, name), uid, uid)


def sanitize(work: Path) -> list[str]:
    """Remove from ``work`` each symlink that leads out of it (or through a loop) and each
    FIFO, socket or device the agent left: a verifier then never reads a host file through a
    link, nor blocks on a FIFO. Returns the removed paths, relative to ``work``."""
    root = Path(os.path.realpath(work))
    removed = []
    for base, dirs, files in os.walk(root):
        for name in (*dirs, *files):
            path = Path(base) / name
            try:
                mode = path.lstat().st_mode
            except OSError:
                continue
            if stat.S_ISLNK(mode):
                try:
                    target = Path(os.path.realpath(path, strict=True))
                    leaves = not target.is_relative_to(root)
                except (OSError, RuntimeError):  # dangling, or a loop
                    leaves = True
                if not leaves:
                    continue
            elif stat.S_ISDIR(mode) or stat.S_ISREG(mode):
                continue
            with contextlib.suppress(OSError):
                path.unlink()
                removed.append(str(path.relative_to(root)))
    return sorted(removed)


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
