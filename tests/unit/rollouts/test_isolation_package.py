"""capture/isolation/ stands alone: importing its facade loads nothing of the proxy, and its
engines are the sandboxes a rollout request may name."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from capture.isolation.engines import ENGINES
from capture.rollouts.spec import SANDBOXES

REPO = Path(__file__).resolve().parents[3]
PROXY = ("capture.gateway", "capture.control", "capture.storage", "capture.policy",
         "capture.pipeline", "capture.rollouts", "mitmproxy")  # fmt: skip


def test_the_isolation_package_imports_nothing_of_the_proxy() -> None:
    code = (
        "import sys, capture.isolation.box, capture.isolation.workdir\n"
        f"print(sorted(m for m in sys.modules if m.startswith({PROXY!r})))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
    )
    assert done.stdout.strip() == "[]", done.stdout


def test_every_engine_is_a_sandbox_a_request_may_name_or_an_image_takes() -> None:
    # "podman" is not named by "sandbox": a request with an "image" runs in it.
    assert tuple(ENGINES) == (*SANDBOXES, "podman")


def test_the_limit_registry_is_what_sandbox_limits_hold_and_the_docs_table_says() -> None:
    """Each ``Limit`` is a field of ``SandboxLimits`` with its default, and a row of the limits
    table in docs/API.md with the same default."""
    from dataclasses import fields

    from capture.isolation.limits import LIMITS, SandboxLimits

    assert [f.name for f in fields(SandboxLimits)] == [limit.key for limit in LIMITS]
    table = (REPO / "docs" / "API.md").read_text()
    for limit in LIMITS:
        assert getattr(SandboxLimits(), limit.key) == limit.default
        assert f"| `{limit.key}` | {limit.default:g} |" in table, limit.key
