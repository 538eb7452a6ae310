#!/usr/bin/env bash
# The test command (README; .ci/run calls exactly this). Installs what it needs first: both
# environments and the tiny model are built from scratch on a clean clone.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -m ruff check rewriter capture addons tests bench scripts examples
.venv/bin/python -m mypy
.venv/bin/python -m pytest -q -p no:cacheprovider --durations=25 "$@"
