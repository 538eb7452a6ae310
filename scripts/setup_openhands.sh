#!/usr/bin/env bash
# OpenHands, headless, pinned, in a venv of its own:
#   .venv-openhands  Python 3.12: the OpenHands CLI (PyPI `openhands`, the `openhands` command;
#                    `openhands --headless -t TASK` runs one task without its UI, on the local
#                    machine: no Docker) with the openhands-sdk and openhands-tools it pins
#                    (LiteLLM underneath).
# Apart from .venv-agents too: it pins its own LiteLLM, pydantic and rich, which mini-swe-agent's
# would fight. Nothing of its goes into .venv: the proxy must not depend on a scaffold's packages,
# and a rollout's sandbox shows only this venv and its base Python to the agent
# (capture/isolation/sandbox.py program_paths).
# Idempotent: a finished environment (its marker holds what was asked for) is left alone;
# remove .venv-openhands to rebuild it. AGENTTAP_OPENHANDS_PACKAGES overrides what is installed.
set -euo pipefail
cd "$(dirname "$0")/.."

# shellcheck source=scripts/venv_lib.sh
source scripts/venv_lib.sh

OPENHANDS_VERSION=1.16.0
PACKAGES=${AGENTTAP_OPENHANDS_PACKAGES:-"openhands==$OPENHANDS_VERSION"}
venv_ready setup-openhands .venv-openhands "$PACKAGES"

venv_build setup-openhands .venv-openhands "$PACKAGES"
# What the tests and rollouts run: fail here, not in the middle of a run. (LiteLLM fetches its
# model cost map at import unless told to use its own copy: no internet here.)
got=$(LITELLM_LOCAL_MODEL_COST_MAP=True OPENHANDS_SUPPRESS_BANNER=1 .venv-openhands/bin/python -c \
  "import importlib.metadata as m, openhands_cli, openhands.sdk, openhands.tools, litellm; print(m.version('openhands'))" \
  | tail -n 1)
case "$PACKAGES" in
  *"openhands==$got"*) ;;
  *) echo "[setup-openhands] installed openhands $got, asked for: $PACKAGES" >&2 ;;
esac
test -x .venv-openhands/bin/openhands
venv_done setup-openhands .venv-openhands "$PACKAGES"
echo "[setup-openhands] done: .venv-openhands ready (openhands $got)"
