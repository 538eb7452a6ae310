"""The suite's offline task set (tests/fixtures/tasks/) as container images: the test base
(Debian bookworm with python3, git and python3-pytest, ``localhost/agenttap-base``) and each
task's image, built once per machine and cached by content (capture/isolation/images.py; its
file lock makes two xdist workers wait for one build). ``task_images()`` is the plain function,
the ``task_images`` fixture its session-scoped form: both give task name -> image ref.

SWE tasks (``swe-*``): ``environment/Containerfile`` (FROM the ``BASE`` build arg), the
repository in ``/testbed`` committed, hidden tests in ``tests/`` (never in the image),
``solution.patch`` (``git apply`` in /testbed), ``task.json`` (the prompt). Harbor tasks
(``harbor-*``): ``task.toml``, ``instruction.md``, ``environment/Dockerfile`` (FROM
``localhost/agenttap-base:bookworm``), ``tests/test.sh``, ``solution/solve.sh``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from capture.isolation import images
from tests.support.paths import REPO

TASKS = REPO / "tests" / "fixtures" / "tasks"
# What the test base holds: the SWE tasks' hidden tests are pytest files run by the image's own
# Python (Debian's 3.11, not the host's 3.12).
BASE_PACKAGES = ("python3", "git", "python3-pytest")
SWE_TASKS = tuple(sorted(p.name for p in TASKS.glob("swe-*")))
HARBOR_TASKS = tuple(sorted(p.name for p in TASKS.glob("harbor-*")))
# The hidden tests' command, run in the task's working folder with the tests mounted at /tests
# read-only (no cache folder: the mount is read-only).
SWE_TEST_COMMAND = ["python3", "-m", "pytest", "-q", "-p", "no:cacheprovider", "/tests"]


def suite_base() -> str:
    """The test base's content-tagged ref (also tagged ``localhost/agenttap-base:bookworm``)."""
    return images.base_image(packages=BASE_PACKAGES)


def task_folder(name: str) -> Path:
    return TASKS / name


def swe_task(name: str) -> dict[str, Any]:
    """A SWE task's ``task.json``: id, prompt, workdir, hidden_tests, test_command, solution."""
    loaded: dict[str, Any] = json.loads((TASKS / name / "task.json").read_text())
    return loaded


def task_image(name: str, base: str | None = None) -> str:
    """One task's image ref, built on the test base when not cached."""
    base = base or suite_base()
    environment = TASKS / name / "environment"
    args = {"BASE": base} if name.startswith("swe-") else {}
    return images.build_image(environment, build_args=args)


def task_images() -> dict[str, str]:
    """Every task's image ref by task name, ``"base"`` the test base's."""
    base = suite_base()
    refs = {"base": base}
    for name in (*SWE_TASKS, *HARBOR_TASKS):
        refs[name] = task_image(name, base)
    return refs


@pytest.fixture(scope="session", name="task_images")
def task_images_fixture() -> dict[str, str]:
    """Task name -> image ref for the offline task set, built once per machine."""
    return task_images()
