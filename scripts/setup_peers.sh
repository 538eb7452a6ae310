#!/usr/bin/env bash
# The peers bench/agent_sessions.py compares agenttap with, in a venv of their own:
#   .venv-peers  Python 3.12: rllm-model-gateway (python -m rllm_model_gateway) and
#                litellm[proxy] (the litellm command).
# Neither goes into .venv: the proxy must not depend on a peer's packages (nor they on its pins).
# Idempotent: a finished environment (its marker holds what was asked for) is left alone;
# remove .venv-peers to rebuild it. AGENTTAP_PEERS_PACKAGES overrides what is installed.
set -euo pipefail
cd "$(dirname "$0")/.."

# shellcheck source=scripts/venv_lib.sh
source scripts/venv_lib.sh

PACKAGES=${AGENTTAP_PEERS_PACKAGES:-"rllm-model-gateway litellm[proxy]"}
venv_ready setup-peers .venv-peers "$PACKAGES"

# One resolve for all of them: each peer gets versions that agree with the others'.
venv_build setup-peers .venv-peers "$PACKAGES"
# What the bench runs: fail here, not in the middle of a benchmark.
# (LiteLLM fetches its model cost map at import unless told to use its own copy: no internet.)
LITELLM_LOCAL_MODEL_COST_MAP=True .venv-peers/bin/python -c "import rllm_model_gateway, litellm" >/dev/null
test -x .venv-peers/bin/litellm
venv_done setup-peers .venv-peers "$PACKAGES"
echo "[setup-peers] done: .venv-peers ready"
