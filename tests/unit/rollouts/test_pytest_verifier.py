"""The built-in pytest verifier's report reading (capture/rollouts/pytest_verifier.py) and the
scoring around it (capture/rollouts/scoring.py): a real pytest writes the reports here."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from capture.rollouts.pytest_verifier import PytestRun, grade, junit_key
from capture.rollouts.scoring import read_inside
from capture.rollouts.verifier import RewardError

TESTS = """
import pytest

def test_ok():
    pass

def test_bad():
    assert False

class TestC:
    @pytest.mark.parametrize("v", [1, 2])
    def test_p(self, v):
        assert v == 1

@pytest.mark.skip
def test_skipped():
    pass
"""


def test_junit_keys() -> None:
    assert junit_key("tests/test_x.py::TestC::test_y[1]") == "tests.test_x.TestC.test_y[1]"
    assert junit_key("test_x.py::test_y") == "test_x.test_y"


def run_pytest(
    tmp_path: Path, node_ids: tuple[str, ...], kept: list[Path] = ()
) -> tuple[int, PytestRun]:  # type: ignore[assignment]
    work = tmp_path / "work"
    (work / "tests").mkdir(parents=True)
    (work / "tests" / "test_x.py").write_text(TESTS)
    run = PytestRun(tmp_path / "report")
    run.prepare(list(kept))
    env = {**os.environ, **run.env()}
    status = subprocess.call(run.command(sys.executable, node_ids), cwd=work, env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    return status, run


def test_the_share_of_the_named_tests_that_passed(tmp_path: Path) -> None:
    ids = (
        "tests/test_x.py::test_ok", "tests/test_x.py::test_bad", "tests/test_x.py::TestC",
        "tests/test_x.py::TestC::test_p[1]", "tests/test_x.py::test_skipped",
    )  # fmt: skip
    status, run = run_pytest(tmp_path, ids)
    assert status == 1
    result = grade(run.junit.read_bytes(), ids + ("tests/test_x.py::test_gone",))
    assert result.passed == ["tests/test_x.py::test_ok", "tests/test_x.py::TestC::test_p[1]"]
    # A class passes only if all under it did; a skipped test did not pass.
    assert result.failed == [
        "tests/test_x.py::test_bad", "tests/test_x.py::TestC", "tests/test_x.py::test_skipped",
    ]  # fmt: skip
    assert result.missing == ["tests/test_x.py::test_gone"]
    assert result.reward == pytest.approx(2 / 6)
    assert not any((tmp_path / "work").rglob("__pycache__"))  # no bytecode written


def test_a_report_that_is_not_pytests_is_refused() -> None:
    for report, words in [
        (b"<?xml version='1.0'?><!DOCTYPE x [<!ENTITY a 'b'>]><x>&a;</x>", "DTD"),
        (b"not xml", "not XML"),
    ]:
        with pytest.raises(RewardError, match=words):
            grade(report, ("t.py::a",))
    empty = grade(b"<testsuites/>", ("t.py::a",))
    assert empty.reward == 0.0 and empty.missing == ["t.py::a"]


def test_the_guard_ends_a_run_that_registers_a_plugin(tmp_path: Path) -> None:
    work = tmp_path / "work"
    (work / "tests").mkdir(parents=True)
    (work / "sneaky.py").write_text(
        "import gc\nfrom _pytest.config import Config\n"
        "class P:\n    pass\n"
        "for o in gc.get_objects():\n"
        "    if isinstance(o, Config):\n        o.pluginmanager.register(P(), 'p')\n        break\n"
    )
    (work / "tests" / "test_y.py").write_text(
        "import sys, pathlib\nsys.path.insert(0, str(pathlib.Path(__file__).parents[1]))\n"
        "import sneaky\n\ndef test_a():\n    pass\n"
    )
    run = PytestRun(tmp_path / "report")
    run.prepare([work / "sneaky.py"])
    status = subprocess.call(run.command(sys.executable, ("tests/test_y.py::test_a",)),
                             cwd=work, env={**os.environ, **run.env()},
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    assert status == 3
    assert "('p', P) was registered while the tests were collected" in run.verdict.read_text()
    assert not run.junit.exists()


def test_report_files_are_read_through_no_link(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("0.5")
    assert read_inside(tmp_path, "f", 10) == b"0.5"
    assert read_inside(tmp_path, "absent", 10) is None
    assert read_inside(tmp_path / "absent-folder", "f", 10) is None
    os.symlink("/etc/hostname", tmp_path / "link")
    with pytest.raises(RewardError, match="not a plain file"):
        read_inside(tmp_path, "link", 100)
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(RewardError, match="not a plain file"):
        read_inside(tmp_path, "fifo", 100)  # and it does not block
    (tmp_path / "big").write_text("1" * 11)
    with pytest.raises(RewardError, match="over 10 bytes"):
        read_inside(tmp_path, "big", 10)
    os.symlink(tmp_path, tmp_path / "dirlink")
    with pytest.raises(RewardError, match="not a plain folder"):
        read_inside(tmp_path / "dirlink", "f", 10)
