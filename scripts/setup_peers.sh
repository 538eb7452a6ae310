#!/usr/bin/env bash
# The peers bench/agent_sessions.py compares agenttap with, in a venv of their own:
#   .venv-peers  Python 3.12: rllm-model-gateway (python -m rllm_model_gateway) and
#                litellm[proxy] (the litellm command).
# Neither goes into .venv: the proxy must not depend on a peer's packages (nor they on its pins).
# Idempotent: a finished environment (its marker holds what was asked for) is left alone;
# remove .venv-peers to rebuild it. AGENTTAP_PEERS_PACKAGES overrides what is installed.
set -euo pipefail
cd "$(dirname "$0")/.."

PY312=${AGENTTAP_PY312:-}
if [ -z "$PY312" ]; then
  if python3.12 --version >/dev/null 2>&1; then PY312=python3.12
  else PY312="env PYENV_VERSION=3.12.1 python3"; fi
fi

PACKAGES=${AGENTTAP_PEERS_PACKAGES:-"rllm-model-gateway litellm[proxy]"}
MARKER=.venv-peers/.agenttap-ready
if [ -f "$MARKER" ] && [ "$(cat "$MARKER")" = "$PACKAGES" ]; then
  echo "[setup-peers] .venv-peers ready ($PACKAGES)"
  exit 0
fi

echo "[setup-peers] building .venv-peers (Python 3.12): $PACKAGES"
rm -rf .venv-peers
$PY312 -m venv .venv-peers
.venv-peers/bin/pip install -q --upgrade pip
# One resolve for all of them: each peer gets versions that agree with the others'.
# shellcheck disable=SC2086  # the list is words on purpose
.venv-peers/bin/pip install -q $PACKAGES
# What the bench runs: fail here, not in the middle of a benchmark.
# (LiteLLM fetches its model cost map at import unless told to use its own copy: no internet.)
LITELLM_LOCAL_MODEL_COST_MAP=True .venv-peers/bin/python -c "import rllm_model_gateway, litellm" >/dev/null
test -x .venv-peers/bin/litellm
echo "$PACKAGES" > "$MARKER"
echo "[setup-peers] done: .venv-peers ready"
