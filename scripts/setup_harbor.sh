#!/usr/bin/env bash
# Harbor (PyPI `harbor`: the `harbor` command that runs Terminus-2 trials), pinned, in a venv of
# its own:
#   .venv-harbor  Python 3.12: harbor (LiteLLM underneath, as Terminus-2 calls its model through it).
# Apart from .venv and .venv-agents: Harbor pins its own LiteLLM, Pydantic and friends, and the
# proxy must not depend on a scaffold's packages. agenttap's Harbor environment
# (capture/harbor/env.py) is imported by Harbor from this venv with the repository on
# PYTHONPATH: it uses only the standard library and Harbor's own classes.
# Terminus-2 drives a tmux session inside the environment: scripts/setup.sh installs tmux.
# Idempotent: a finished environment (its marker holds what was asked for) is left alone;
# remove .venv-harbor to rebuild it. AGENTTAP_HARBOR_PACKAGES overrides what is installed.
set -euo pipefail
cd "$(dirname "$0")/.."

# shellcheck source=scripts/venv_lib.sh
source scripts/venv_lib.sh

HARBOR_VERSION=0.26.0
PACKAGES=${AGENTTAP_HARBOR_PACKAGES:-"harbor==$HARBOR_VERSION"}
venv_ready setup-harbor .venv-harbor "$PACKAGES"

venv_build setup-harbor .venv-harbor "$PACKAGES"
# What the tests and rollouts run: fail here, not in the middle of a run. (LiteLLM fetches its
# model cost map at import unless told to use its own copy: no internet here.)
got=$(LITELLM_LOCAL_MODEL_COST_MAP=True .venv-harbor/bin/python -c \
  "import importlib.metadata as m, harbor, litellm
from harbor.environments.base import BaseEnvironment
from harbor.agents.terminus_2 import Terminus2
print(m.version('harbor'))" | tail -n 1)
case "$PACKAGES" in
  *"harbor==$got"*) ;;
  *) echo "[setup-harbor] installed harbor $got, asked for: $PACKAGES" >&2 ;;
esac
test -x .venv-harbor/bin/harbor
venv_done setup-harbor .venv-harbor "$PACKAGES"
echo "[setup-harbor] done: .venv-harbor ready (harbor $got)"
