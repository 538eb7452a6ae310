"""The built-in pytest verifier: ``"verifier": {"pytest": ["tests/test_x.py::test_y", ...]}``.

It runs on a fresh copy of the seed (capture/rollouts/grading.py), with the seed's own
configuration only (the agent's ``conftest.py`` and ini files are never kept), no cache
provider, no bytecode written, no plugin loaded from entry points, and agenttap's guard
(capture/rollouts/pytest_guard.py). The reward is the share of the named tests that passed,
read from a JUnit report written in a folder the agent never had: not from the exit status,
so an ``os._exit(0)`` at exit changes nothing, nor from anything printed.
"""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from xml.etree import ElementTree

from capture.rollouts import pytest_guard
from capture.rollouts.verifier import RewardError

GUARD_MODULE = "agenttap_pytest_guard"
# pytest's statuses for "the tests ran": all passed, some failed. Anything else (interrupted,
# an internal or usage error, nothing collected, the guard's 3) is no grade.
RAN = (0, 1)
# A JUnit report larger than this is not read (what the tests print is in it).
REPORT_CAP = 64 * 1024 * 1024


@dataclass
class PytestRun:
    """Where one run of the built-in verifier keeps its report and guard."""

    folder: Path  # made fresh, outside the graded workdir and the agent's copy

    @property
    def junit(self) -> Path:
        return self.folder / "junit.xml"

    @property
    def verdict(self) -> Path:
        return self.folder / "guard-verdict.txt"

    @property
    def kept_list(self) -> Path:
        return self.folder / "kept.txt"

    def prepare(self, kept: list[Path]) -> None:
        """The guard under its module name, and the list of the agent's kept files it reads."""
        self.folder.mkdir()
        shutil.copyfile(pytest_guard.__file__, self.folder / f"{GUARD_MODULE}.py")
        self.kept_list.write_text("".join(f"{p}\n" for p in kept), encoding="utf-8")

    def command(self, python: str, node_ids: tuple[str, ...]) -> list[str]:
        return [
            python, "-m", "pytest", "-p", "no:cacheprovider", "-p", GUARD_MODULE,
            f"--junitxml={self.junit}", "-o", "junit_family=xunit2", "-q", "--", *node_ids,
        ]  # fmt: skip

    def env(self) -> dict[str, str]:
        return {
            "PYTHONPATH": str(self.folder),
            "PYTHONDONTWRITEBYTECODE": "1",
            "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
            pytest_guard.KEPT_ENV: str(self.kept_list),
            pytest_guard.VERDICT_ENV: str(self.verdict),
        }


@dataclass
class PytestGrade:
    reward: float
    passed: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    # Named tests the report does not hold (not collected, or the run ended before them).
    missing: list[str] = field(default_factory=list)

    def summary(self) -> dict[str, object]:
        return {"passed": self.passed, "failed": self.failed, "missing": self.missing}


def junit_key(node_id: str) -> str:
    """A node id as pytest's JUnit report names it: ``classname.name``, the path's folders
    dotted and ``.py`` dropped (``tests/test_x.py::TestC::test_y[1]`` ->
    ``tests.test_x.TestC.test_y[1]``)."""
    parts = node_id.split("::")
    parts[0] = re.sub(r"\.py$", "", parts[0].replace("/", "."))
    return ".".join(parts)


def grade(report: bytes, node_ids: tuple[str, ...]) -> PytestGrade:
    """The share of ``node_ids`` that passed in a JUnit ``report``. A node id naming a module or
    a class passes when every test under it passed (and there was one)."""
    if len(report) > REPORT_CAP:
        raise RewardError(f"the JUnit report is over {REPORT_CAP} bytes and was not read")
    if b"<!DOCTYPE" in report or b"<!ENTITY" in report:
        raise RewardError("the JUnit report declares a DTD or entities, which pytest never writes")
    try:
        root = ElementTree.fromstring(report)
    except ElementTree.ParseError as exc:
        raise RewardError(f"the JUnit report is not XML ({exc})") from None
    outcomes: dict[str, bool] = {}
    for case in root.iter("testcase"):
        key = f"{case.get('classname', '')}.{case.get('name', '')}"
        ok = not any(case.find(tag) is not None for tag in ("failure", "error", "skipped"))
        outcomes[key] = outcomes.get(key, True) and ok
    result = PytestGrade(reward=0.0)
    for node_id in node_ids:
        key = junit_key(node_id)
        found = [ok for k, ok in outcomes.items() if k == key or k.startswith(key + ".")]
        if not found:
            result.missing.append(node_id)
        elif all(found):
            result.passed.append(node_id)
        else:
            result.failed.append(node_id)
    result.reward = len(result.passed) / len(node_ids)
    return result
