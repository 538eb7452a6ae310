#!/usr/bin/env bash
# The Python agent scaffolds the end-to-end tests and rollouts run, pinned, in a venv of their own:
#   .venv-agents  Python 3.12: mini-swe-agent (the `mini` command; LiteLLM underneath) and mcp
#                 (LiteLLM fails every completion without it).
# Nothing of theirs goes into .venv: the proxy must not depend on a scaffold's packages, and a
# rollout's sandbox shows only this venv and its base Python to the agent (capture/rollouts/
# sandbox.py program_paths).
# Idempotent: a finished environment (its marker holds what was asked for) is left alone;
# remove .venv-agents to rebuild it. AGENTTAP_AGENTS_PACKAGES overrides what is installed.
set -euo pipefail
cd "$(dirname "$0")/.."

# shellcheck source=scripts/venv_lib.sh
source scripts/venv_lib.sh

MINI_SWE_AGENT_VERSION=2.4.6
PACKAGES=${AGENTTAP_AGENTS_PACKAGES:-"mini-swe-agent==$MINI_SWE_AGENT_VERSION mcp"}
venv_ready setup-agents .venv-agents "$PACKAGES"

venv_build setup-agents .venv-agents "$PACKAGES"
# What the tests and rollouts run: fail here, not in the middle of a run. (LiteLLM fetches its
# model cost map at import unless told to use its own copy: no internet here.)
# minisweagent prints a banner and makes its config folder on import: a scratch one here.
scratch=$(mktemp -d)
got=$(LITELLM_LOCAL_MODEL_COST_MAP=True MSWEA_CONFIGURED=true MSWEA_GLOBAL_CONFIG_DIR="$scratch" \
  .venv-agents/bin/python -c \
  "import importlib.metadata as m, minisweagent, litellm, mcp; print(m.version('mini-swe-agent'))" \
  | tail -n 1)
rm -rf "$scratch"
case "$PACKAGES" in
  *"mini-swe-agent==$got"*) ;;
  *) echo "[setup-agents] installed mini-swe-agent $got, asked for: $PACKAGES" >&2 ;;
esac
test -x .venv-agents/bin/mini
venv_done setup-agents .venv-agents "$PACKAGES"
echo "[setup-agents] done: .venv-agents ready (mini-swe-agent $got)"
