"""Verify on the seed (capture/rollouts/grading.py): the seed's files, plus the agent's kept
ones, and never what configures Python or pytest."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from capture.rollouts.grading import glob_pattern, grade_on_seed, never_kept


@pytest.mark.parametrize(
    ("glob", "yes", "no"),
    [
        ("solution.py", ["solution.py"], ["src/solution.py", "solution.pyc"]),
        ("*.py", ["a.py"], ["src/a.py"]),
        ("src/**/*.py", ["src/a.py", "src/x/y/a.py"], ["a.py", "src/a.txt"]),
        ("**/*.py", ["a.py", "x/a.py"], ["a.txt"]),
        ("src/", ["src/a", "src/x/b.py"], ["srcx/a"]),
        ("a?.py", ["ab.py"], ["a/.py", "abc.py"]),
        ("[ab].txt", ["a.txt", "b.txt"], ["c.txt"]),
        ("[!ab].txt", ["c.txt"], ["a.txt"]),
    ],
)
def test_keep_globs(glob: str, yes: list[str], no: list[str]) -> None:
    pattern = glob_pattern(glob)
    assert all(pattern.fullmatch(p) for p in yes) and not any(pattern.fullmatch(p) for p in no)


def test_what_is_never_kept() -> None:
    for path in ("conftest.py", "tests/conftest.py", "pytest.ini", "pyproject.toml", "setup.cfg",
                 "tox.ini", "x.pth", "tests/__pycache__/t.cpython-312-pytest-9.2.0.pyc", "a.pyc",
                 "sitecustomize.py", "pkg-1.0.dist-info/entry_points.txt"):  # fmt: skip
        assert never_kept(path) is not None, path
    for path in ("solution.py", "src/conftest_helpers.py", "README.md", "data.ini.txt"):
        assert never_kept(path) is None, path


def make(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_the_grade_is_the_seed_plus_the_kept_files(tmp_path: Path) -> None:
    seed = make(tmp_path / "seed", {"solution.py": "wrong", "tests/test_x.py": "tests",
                                     "tests/conftest.py": "seed's", "setup.cfg": "seed cfg",
                                     "data/big.txt": "data"})  # fmt: skip
    work = make(tmp_path / "work", {
        "solution.py": "right", "tests/test_x.py": "tests rewritten", "conftest.py": "forged",
        "tests/conftest.py": "forged too", "setup.cfg": "addopts", "notes.txt": "mine",
        "tests/__pycache__/test_x.pyc": "forged", "x.pth": "import os", "src/new.py": "new",
        "data/big.txt": "data",
    })  # fmt: skip
    os.symlink("/etc/passwd", work / "link.py")
    dest = tmp_path / "graded"
    graded = grade_on_seed(seed, work, dest, ("*.py", "src/", "tests/*.py"), ("tests/",))
    files = {p.relative_to(dest).as_posix(): p.read_text() for p in dest.rglob("*") if p.is_file()}
    assert files == {
        "solution.py": "right", "src/new.py": "new", "tests/test_x.py": "tests",
        "tests/conftest.py": "seed's", "setup.cfg": "seed cfg", "data/big.txt": "data",
    }  # fmt: skip
    assert graded.kept == ["solution.py", "src/new.py"]
    left = dict(graded.left_out)
    assert set(left) == {
        "conftest.py", "tests/conftest.py", "setup.cfg", "notes.txt", "tests/__pycache__/",
        "x.pth", "link.py", "tests/test_x.py",
    }  # fmt: skip
    assert "restore" in left["tests/test_x.py"] and "link" in left["link.py"]
    assert "keep" in left["notes.txt"] and "configures" in left["conftest.py"]
    # A file the same as the seed's is not listed: data/big.txt.
    assert graded.summary()["left_out_count"] == 8


def test_the_agents_shape_wins_over_the_seeds(tmp_path: Path) -> None:
    seed = make(tmp_path / "seed", {"pkg": "a file", "mod/x.py": "x"})
    work = make(tmp_path / "work", {"pkg/__init__.py": "now a package", "mod": "now a file"})
    dest = tmp_path / "graded"
    graded = grade_on_seed(seed, work, dest, ("**",), ())
    assert (dest / "pkg" / "__init__.py").read_text() == "now a package"
    assert (dest / "mod").read_text() == "now a file"
    assert graded.kept == ["mod", "pkg/__init__.py"]


def test_kept_files_are_copies_with_plain_modes(tmp_path: Path) -> None:
    seed = make(tmp_path / "seed", {"a.py": "a"})
    work = make(tmp_path / "work", {"a.py": "b", "run.sh": "#!/bin/sh"})
    (work / "run.sh").chmod(0o4777)
    dest = tmp_path / "graded"
    grade_on_seed(seed, work, dest, ("**",), ())
    assert (dest / "run.sh").stat().st_mode & 0o7777 == 0o755
    assert (dest / "a.py").stat().st_mode & 0o7777 == 0o644
    assert (dest / "a.py").stat().st_ino != (work / "a.py").stat().st_ino
