#!/usr/bin/env bash
# Builds .venv-train: the trainer side (Python 3.11, CPU torch, transformers, TRL; verl when it
# installs), where capture/train/ runs. The proxy's .venv stays torch-free on purpose.
#   scripts/setup_train.sh            # idempotent: a finished environment is left alone
#   AGENTTAP_SKIP_VERL=1 scripts/setup_train.sh   # leave verl (the optional extra) out
# agenttap's own client code (capture.client, capture.storage.reader, capture.train) is put on
# the environment's path by a .pth file pointing at this checkout: nothing of the proxy (no
# mitmproxy) is installed here; AgentTap.start runs the proxy from .venv/bin/mitmdump.
# verl is optional: where it cannot be installed the script says so and goes on (the verl
# adapter's tests then skip with that reason).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$PWD"
VENV=.venv-train

PY311=${AGENTTAP_PY311:-}
if [ -z "$PY311" ]; then
  if python3.11 --version >/dev/null 2>&1; then PY311=python3.11
  else PY311="env PYENV_VERSION=3.11.7 python3"; fi
fi

# torch first and pinned: it is the local CPU wheel; a plain `torch` would pull GBs of CUDA.
TORCH=torch==2.13.0
# tensorboard: the example's trainer logs (--report-to tensorboard, its default).
PACKAGES=(transformers trl accelerate datasets pyarrow numpy safetensors tqdm tensorboard peft)
# verl 0.9.1 pins transformers<5.11: with verl installed, transformers is 5.10.x (TRL 1.16 and the
# tiny Qwen3 work with it); without verl, the latest that TRL accepts.
# verl 0.9.1 and what it imports on a CPU beyond its own pins (read from its import errors).
# kernels: transformers 5.10's own range (its "kernels" extra). A newer transformers, installed
# first, brings a newer kernels that verl's downgrade leaves behind, and transformers 5.10 then
# fails to import any model ("Either a revision or a version must be specified").
VERL_PACKAGES=(verl==0.9.1 cachetools uvicorn fastapi "kernels>=0.12,<0.13")
# The marker holds a hash of what is installed: a changed list is installed on the next run.
WANT_HASH=$(printf '%s\n' "$TORCH" "${PACKAGES[@]}" "${VERL_PACKAGES[@]}" \
  "verl=${AGENTTAP_SKIP_VERL:-0}" | sha256sum | cut -c1-16)
READY="$VENV/.agenttap-ready"

if [ -f "$READY" ] && [ "$(cat "$READY")" = "$WANT_HASH" ]; then
  echo "[setup_train] $VENV ready"
  exit 0
fi

if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup_train] building $VENV (trainer side, Python 3.11; about a minute)"
  rm -rf "$VENV"
  $PY311 -m venv "$VENV"
  # git ignores the whole environment (as venv itself does from Python 3.13 on).
  echo '*' > "$VENV/.gitignore"
  "$VENV/bin/pip" install -q --upgrade pip
else
  echo "[setup_train] updating $VENV"
fi
"$VENV/bin/pip" install -q "$TORCH"
"$VENV/bin/pip" install -q "${PACKAGES[@]}" "$TORCH"

# agenttap's client code from this checkout (not a copy: edits take effect at once).
SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "$ROOT" > "$SITE/agenttap-checkout.pth"

rm -f "$VENV/.verl-unavailable"
if [ "${AGENTTAP_SKIP_VERL:-0}" = "1" ]; then
  echo "verl left out: AGENTTAP_SKIP_VERL=1" > "$VENV/.verl-unavailable"
elif "$VENV/bin/pip" install -q "${VERL_PACKAGES[@]}" "$TORCH" >"$VENV/verl-install.log" 2>&1 \
  && "$VENV/bin/python" -c 'import verl.experimental.agent_loop.agent_loop' \
    >>"$VENV/verl-install.log" 2>&1; then
  echo "[setup_train] verl installed (its agent loop imports on this CPU)"
else
  echo "verl could not be installed or imported here; see $VENV/verl-install.log" \
    > "$VENV/.verl-unavailable"
  echo "[setup_train] verl (optional) is not available: $(tail -n 3 "$VENV/verl-install.log" \
    | tr '\n' ' ')... (the verl adapter's tests will skip; see $VENV/verl-install.log)" >&2
fi

# What the trainer code needs must import here, without mitmproxy.
"$VENV/bin/python" - "$VENV" <<'EOF'
import importlib, pathlib, sys
names = ["torch", "transformers", "trl", "capture.client.launcher", "capture.storage.reader",
         "capture.train.rows", "capture.train.trl", "capture.train.trl_cpu",
         "capture.train.cpu_attention", "capture.train.check_logprobs"]
if not (pathlib.Path(sys.argv[1]) / ".verl-unavailable").exists():
    names.append("capture.train.verl")
for name in names:
    importlib.import_module(name)
# The models the tests and the example build: transformers imports a model's module lazily, so
# a broken dependency of it shows only here (not at "import transformers").
from transformers import Qwen2ForCausalLM, Qwen3ForCausalLM  # noqa: F401
import peft  # noqa: F401  (the LoRA tests' adapters)
try:
    importlib.import_module("mitmproxy")
except ImportError:
    pass
else:
    raise SystemExit("mitmproxy is importable in .venv-train: it must not be (the proxy runs from .venv)")
EOF
echo "$WANT_HASH" > "$READY"
echo "[setup_train] $VENV ready ($("$VENV/bin/python" -c 'import torch, transformers, trl; print(f"torch {torch.__version__}, transformers {transformers.__version__}, trl {trl.__version__}")'))"
