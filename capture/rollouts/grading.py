"""Verify on the seed: a fresh copy of the seed workdir, plus only the agent's files a
verifier's ``"keep"`` names (SWE-bench's grade, the patch applied to a clean checkout).

Whatever else the agent made does not exist there: a ``conftest.py`` that marks every test
passed, an ini file whose ``addopts`` says ``--collect-only``, a forged ``__pycache__`` file,
a ``.pth`` file, links. Those are never kept, whatever ``keep`` says (``NEVER_KEPT``): they
change how the tests run, not what the task asked for. A path under the verifier's
``restore`` is never kept either: the seed's stays. Deleting a seed file does not carry over.
"""

from __future__ import annotations

import filecmp
import os
import re
import shutil
import stat
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from capture.isolation.workdir import copy_seed

# Files that configure or extend Python and pytest rather than hold the task's answer.
NEVER_KEPT_NAMES = frozenset({
    "conftest.py", "pytest.ini", ".pytest.ini", "pyproject.toml", "setup.cfg", "tox.ini",
    "sitecustomize.py", "usercustomize.py", "__init__.pyc",
})  # fmt: skip
NEVER_KEPT_SUFFIXES = (".pth", ".pyc", ".pyo")
NEVER_KEPT_FOLDERS = ("__pycache__", ".pytest_cache")
NEVER_KEPT_FOLDER_SUFFIXES = (".dist-info", ".egg-info", ".egg-link")
# How many kept and left-out paths a run's summary lists (the counts are whole).
LISTED = 200


@dataclass
class Graded:
    """What a grade on the seed took from the agent's copy, and what it left out (and why)."""

    kept: list[str] = field(default_factory=list)
    left_out: list[tuple[str, str]] = field(default_factory=list)

    def summary(self) -> dict[str, object]:
        return {
            "kept": self.kept[:LISTED],
            "kept_count": len(self.kept),
            "left_out": [{"path": p, "why": why} for p, why in self.left_out[:LISTED]],
            "left_out_count": len(self.left_out),
        }


def glob_pattern(glob: str) -> re.Pattern[str]:
    """A ``keep`` glob as a regex on a relative POSIX path: ``*`` and ``?`` stay inside one
    folder, ``**/`` is any number of folders, ``[...]`` a class; ``dir/`` is all under it."""
    if glob.endswith("/"):
        glob += "**"
    out, i = [], 0
    while i < len(glob):
        if glob.startswith("**/", i):
            out.append("(?:[^/]+/)*")
            i += 3
        elif glob.startswith("**", i):
            out.append(".*")
            i += 2
        elif glob[i] == "*":
            out.append("[^/]*")
            i += 1
        elif glob[i] == "?":
            out.append("[^/]")
            i += 1
        elif glob[i] == "[" and "]" in glob[i + 2 :]:
            end = glob.index("]", i + 2)
            body = glob[i + 1 : end]
            negate = body.startswith("!")
            out.append("[" + ("^" if negate else "") + re.escape(body.lstrip("!")) + "]")
            i = end + 1
        else:
            out.append(re.escape(glob[i]))
            i += 1
    return re.compile("".join(out))


def never_kept(rel: str) -> str | None:
    """Why the agent's file ``rel`` is never graded, whatever ``keep`` says; None if it may be."""
    parts = PurePosixPath(rel).parts
    name = parts[-1]
    for folder in parts[:-1]:
        if folder in NEVER_KEPT_FOLDERS or folder.endswith(NEVER_KEPT_FOLDER_SUFFIXES):
            return f"inside {folder}/, which configures Python or pytest"
    if name in NEVER_KEPT_NAMES:
        return "configures Python or pytest"
    if name.endswith(NEVER_KEPT_SUFFIXES):
        return "compiled or path-configuring Python"
    return None


def grade_on_seed(
    seed: Path, agent_work: Path, dest: Path, keep: tuple[str, ...], restore: tuple[str, ...]
) -> Graded:
    """Make ``dest`` (which must not exist) a fresh copy of ``seed``, then copy in each regular
    file of ``agent_work`` that matches ``keep``, is not ``never_kept`` and is not under a
    ``restore`` path. What the agent made or changed and was not copied is listed as left out
    (a file the same as the seed's is not). Every process that could change ``agent_work`` must
    be gone."""
    copy_seed(seed, dest)
    patterns = [glob_pattern(g) for g in keep]
    restored = [PurePosixPath(p) for p in restore]
    graded = Graded()
    root, seed_root = Path(os.path.realpath(agent_work)), Path(os.path.realpath(seed))
    for base, dirs, files in os.walk(root):
        dirs.sort()
        # A folder whose own name is never kept is not walked: all of it is left out at once.
        for folder in [d for d in dirs if never_kept(f"{d}/x") is not None]:
            dirs.remove(folder)
            rel = (Path(base) / folder).relative_to(root).as_posix()
            graded.left_out.append((rel + "/", never_kept(f"{folder}/x") or ""))
        links = [d for d in dirs if (Path(base) / d).is_symlink()]
        for name in sorted(files + links):
            path = Path(base) / name
            rel = path.relative_to(root).as_posix()
            why = _why_left_out(path, rel, patterns, restored)
            if why is None:
                _copy_in(path, dest, rel)
                graded.kept.append(rel)
            elif not _same_as_seed(path, seed_root / rel):
                graded.left_out.append((rel, why))
    return graded


def _same_as_seed(path: Path, seed_path: Path) -> bool:
    """The agent's file is the seed's, unchanged: not worth listing as left out."""
    try:
        mine, theirs = path.lstat(), seed_path.lstat()
    except OSError:
        return False
    if not (stat.S_ISREG(mine.st_mode) and stat.S_ISREG(theirs.st_mode)):
        return False
    return mine.st_size == theirs.st_size and filecmp.cmp(path, seed_path, shallow=False)


def _why_left_out(
    path: Path, rel: str, patterns: list[re.Pattern[str]], restored: list[PurePosixPath]
) -> str | None:
    """Why the agent's ``rel`` is not graded; None: it is (copied into the seed's copy)."""
    mode = path.lstat().st_mode
    if stat.S_ISLNK(mode):
        return "a link (never kept: the grade reads no path the agent chose)"
    if not stat.S_ISREG(mode):
        return "not a regular file"
    why = never_kept(rel)
    if why is not None:
        return why
    pure = PurePosixPath(rel)
    if any(pure == r or pure.is_relative_to(r) for r in restored):
        return "under the verifier's \"restore\": the seed's copy is graded"
    if not any(p.fullmatch(rel) for p in patterns):
        return 'matches no "keep" glob'
    return None


def _copy_in(source: Path, dest: Path, rel: str) -> None:
    """The agent's file's bytes (and whether it is executable) at ``dest/rel``; never a link,
    never its owner. Where the seed has a file in the way of the agent's folders (or a folder
    where the agent has a file), the agent's shape wins."""
    parts = PurePosixPath(rel).parts
    parent = dest
    for part in parts[:-1]:
        parent = parent / part
        if parent.exists() and not parent.is_dir():
            parent.unlink()
        parent.mkdir(exist_ok=True)
    target = parent / parts[-1]
    if target.is_dir():
        shutil.rmtree(target)
    elif target.exists():
        target.unlink()
    executable = os.lstat(source).st_mode & 0o111
    with open(source, "rb") as src, open(target, "xb") as out:
        shutil.copyfileobj(src, out)
    os.chmod(target, 0o755 if executable else 0o644)
