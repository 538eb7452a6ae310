"""agenttap's guard inside the built-in pytest verifier (``-p agenttap_pytest_guard``).

The tests import the agent's code, which then runs in pytest's own process and could register
a plugin that marks every report passed. This guard notes pytest's plugins when collection
starts; from then on a new plugin is allowed only if it is a module of the task (a seed's
``conftest.py``, or what its ``pytest_plugins`` names), never one of the agent's kept files nor
an object made at run time. Checked before each report is logged (and so before the JUnit
report hears of it) and when the session ends. On a change it says so on stderr and ends the
process with status 3 (and writes why where the runner reads it): the run gets no reward.

No check inside the process can stop code that runs there and sets out to defeat it (patching
pytest itself, this guard, or the report's writer): docs/SECURITY.md says so. This one closes the
plugin route, the one pytest documents.

Standard library and pytest only: it runs under the task's Python, copied into a folder of the
verifier's own (the runner puts it on PYTHONPATH under this module's name).
"""

from __future__ import annotations

import os
import types
from typing import Any

import pytest

# Absolute paths of the agent's files copied into the graded workdir, one per line.
KEPT_ENV = "AGENTTAP_PYTEST_KEPT"
# Where the guard says what it found (pytest captures stderr while tests are collected and run).
VERDICT_ENV = "AGENTTAP_PYTEST_VERDICT"
TAMPERED_STATUS = 3

_known: set[int] | None = None
_config: Any = None


def _kept() -> set[str]:
    path = os.environ.get(KEPT_ENV)
    if not path:
        return set()
    with open(path, encoding="utf-8") as f:
        return {os.path.realpath(line) for line in f.read().splitlines() if line}


_KEPT = _kept()


def _allowed(plugin: Any) -> bool:
    if not isinstance(plugin, types.ModuleType):
        return False
    where = getattr(plugin, "__file__", None)
    return isinstance(where, str) and os.path.realpath(where) not in _KEPT


def _check(config: Any, when: str) -> None:
    if _known is None:
        return
    for plugin in config.pluginmanager.get_plugins():
        if id(plugin) in _known or _allowed(plugin):
            continue
        name = config.pluginmanager.get_name(plugin)
        verdict = (
            f"a pytest plugin ({name!r}, {type(plugin).__name__}) was registered {when}, by "
            "code the tests ran"
        )
        try:
            with open(os.environ[VERDICT_ENV], "w", encoding="utf-8") as f:
                f.write(verdict)
        except (KeyError, OSError):
            pass  # the status alone still ends the run unscored
        os._exit(TAMPERED_STATUS)


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: Any) -> None:
    global _config
    _config = config


@pytest.hookimpl(tryfirst=True)
def pytest_collection(session: Any) -> None:
    global _known
    _known = {id(p) for p in session.config.pluginmanager.get_plugins()}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_finish(session: Any) -> None:
    _check(session.config, "while the tests were collected")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_logreport(report: Any) -> None:
    _check(_config, f"while {report.nodeid} ran")


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session: Any) -> None:
    _check(session.config, "during the session")
