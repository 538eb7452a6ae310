#!/usr/bin/env bash
# The test command (README; .ci/run calls exactly this). Installs what it needs first: both
# environments and the tiny model are built from scratch on a clean clone. Prints how long setup
# and the tests took at the end (docs/TESTING.md: the suite's budget is 25 minutes of tests).
set -euo pipefail
cd "$(dirname "$0")/.."
STARTED=$SECONDS
SETUP_S=""
report() {
  local rc=$? total=$((SECONDS - STARTED))
  local tests=$((total - ${SETUP_S:-$total}))
  printf '[test.sh] total %dm%02ds (setup %dm%02ds, checks and tests %dm%02ds), exit %d\n' \
    $((total / 60)) $((total % 60)) $((${SETUP_S:-$total} / 60)) $((${SETUP_S:-$total} % 60)) \
    $((tests / 60)) $((tests % 60)) "$rc"
}
trap report EXIT
bash scripts/setup.sh
SETUP_S=$((SECONDS - STARTED))
# Bytecode for the repo's own modules, which every mitmdump and helper process the tests start
# imports (this environment sets PYTHONDONTWRITEBYTECODE=1, so none is written at import time; the
# task fixtures stay out: their folders are what the task images are built and hashed from).
.venv/bin/python -m compileall -q -j0 -x '/fixtures/' \
  rewriter capture addons policy_server tests bench scripts examples > /dev/null
.venv/bin/python -m ruff check rewriter capture addons policy_server tests bench scripts examples
.venv/bin/python -m mypy
# Two workers by default (docs/TESTING.md: how work is shared out between them, and which tests
# hold the session's vLLM alone). AGENTTAP_TEST_WORKERS=0 runs everything in this one process.
WORKERS=${AGENTTAP_TEST_WORKERS:-2}
PARALLEL=()
[ "$WORKERS" = "0" ] || PARALLEL=(-n "$WORKERS" --dist loadscope --no-loadscope-reorder)
.venv/bin/python -m pytest -q -p no:cacheprovider --durations=25 "${PARALLEL[@]}" "$@"
