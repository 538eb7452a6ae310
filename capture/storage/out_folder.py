"""Where an output folder's thread shards are: OUT, OUT/threads or one shard read alike, and
the error for a path without shards, naming the OUT folders nearby."""

from __future__ import annotations

import os
from pathlib import Path

from capture.storage.rewards import REWARDS_DIR

# Folders of an output directory: a folder holding any of them is OUT itself.
_OUT_FOLDERS = ("threads", "turns", "failed", "journal", REWARDS_DIR)


def locate(path: str | os.PathLike[str]) -> tuple[Path | None, Path]:
    """(the thread shards to read, or None if there are none; the OUT folder of late rewards)."""
    p = Path(path)
    if p.is_dir() and p.name != "threads" and any((p / d).is_dir() for d in _OUT_FOLDERS):
        threads = p / "threads"
        return (threads if threads.is_dir() else None), p
    shards_dir = p if p.is_dir() else p.parent
    return p, shards_dir.parent


# How far the error of a path without shards looks for OUT folders nearby (folders visited).
_NEARBY_LIMIT = 400
_SKIP_DIRS = {".git", ".venv", "node_modules", "__pycache__", ".cache"}


def _shard_count(out: Path) -> int:
    """How many thread shards an OUT folder holds (0: it is not one)."""
    try:
        return sum(1 for f in (out / "threads").glob("*.parquet") if not f.name.startswith("."))
    except OSError:
        return 0


def _outs_under(root: Path, depth: int = 3) -> list[tuple[Path, int]]:
    """OUT folders (holding threads/*.parquet) at or under ``root``, ``depth`` levels down at
    most, a bounded number of folders looked at."""
    found: list[tuple[Path, int]] = []
    queue = [(root, 0)]
    seen = 0
    while queue and seen < _NEARBY_LIMIT:
        folder, level = queue.pop(0)
        seen += 1
        count = _shard_count(folder)
        if count:
            found.append((folder, count))
            continue
        if level >= depth:
            continue
        try:
            subs = sorted(d for d in folder.iterdir() if d.is_dir() and d.name not in _SKIP_DIRS)
        except OSError:
            continue
        queue += [(d, level + 1) for d in subs if not d.name.startswith(".")]
    return found


def nearby_outs(path: Path) -> str:
    """' Did you mean X?' naming OUT folders near ``path`` (inside it, or beside it with a
    name like it), or ''."""
    import difflib

    if path.is_dir():
        found = _outs_under(path)
    else:
        parent = path.parent if str(path.parent) else Path(".")
        found = _outs_under(parent, depth=2) if parent.is_dir() else []
        names = [str(f.relative_to(parent)) for f, _ in found if f != parent]
        close = set(difflib.get_close_matches(path.name, names, n=3, cutoff=0.5))
        close |= {n for n in names if n.split(os.sep)[0].startswith(path.name)}
        found = [(f, n) for f, n in found if f != parent]
        if close:  # else: every OUT there (a few at most are named)
            found = [(f, n) for f, n in found if str(f.relative_to(parent)) in close]
    if not found:
        return ""
    shown = [f"{f} ({n} thread shard{'s' if n != 1 else ''})" for f, n in found[:3]]
    more = f" (and {len(found) - 3} more)" if len(found) > 3 else ""
    return f" Did you mean {' or '.join(shown)}{more}?"


def check_shards(path: str | os.PathLike[str], threads: Path) -> None:
    """A FileNotFoundError saying what was looked for, and where shards are if nearby, when
    ``threads`` (what ``locate`` found for ``path``) is missing, or is a folder of other files
    with no shard in it (an example's ``--out`` folder, its shards one folder down)."""
    wants = (
        "load_threads reads OUT (the proxy's output folder, agenttap_out: it holds threads/), "
        "OUT/threads, or one .parquet shard"
    )
    if not threads.exists():
        raise FileNotFoundError(
            f"agenttap: no thread shards at {os.fspath(path)!r}: it does not exist; {wants}."
            + nearby_outs(Path(path))
        )
    if not threads.is_dir():
        return
    entries = [e for e in threads.iterdir() if not e.name.startswith((".", "_"))]
    if not entries or any(e.suffix == ".parquet" for e in entries):
        return  # no rows yet, or shards: read them
    raise FileNotFoundError(
        f"agenttap: no thread shards in {os.fspath(path)!r}: it holds no .parquet file and no "
        f"threads/ folder (it holds {', '.join(sorted(e.name for e in entries)[:5])}"
        f"{'...' if len(entries) > 5 else ''}); {wants}." + nearby_outs(threads)
    )
