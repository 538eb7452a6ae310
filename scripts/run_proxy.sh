#!/usr/bin/env bash
# Start the agenttap proxy.
#   scripts/run_proxy.sh [--policy-url URL[,URL...]] [--tokenizer PATH] [--out DIR] [--port N]
#                        [--api-port N] [--tool-parser NAME] [--reasoning-parser NAME]
#                        [--max-model-len N] [-- MITMDUMP ARGS...]
# --port: the proxy (default 8080); --api-port: the control API and per-session base URLs
# (default the proxy's port + 1). AGENTTAP_TOKEN in the environment sets the API's token (24 or
# more characters); it reaches mitmdump in a file only you can read, never on a command line.
# With no --policy-url, an embedded tiny policy (vLLM serving a random-weight Qwen3 model built
# here, 32768 tokens of context unless --max-model-len says otherwise) is started first, so the
# whole path can be seen working offline (it prints its progress while it loads). It listens on
# a unix socket in this run's private folder, no TCP port: only agenttap reaches it. A
# --policy-url is http://HOST:PORT or unix:/PATH (vllm serve --uds PATH). Sets up what it needs
# first (scripts/setup.sh). Ready when it prints "agenttap ready: ...". On exit the private
# folder goes; the policy's log is kept (its path printed) only if the policy failed.
# AGENTTAP_POLICY_START_S: how long the embedded policy may take to start (default 300 s).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PY="$ROOT/.venv/bin/python"
# The policy server's launcher (policy_server/) is imported from this checkout, whatever the
# current folder and however old .venv's editable install is.
SIDE_PATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

POLICY_URL="" TOKENIZER="" OUT="agenttap-out" PORT=8080 TOOL_PARSER=hermes REASONING_PARSER=qwen3
MAX_MODEL_LEN=32768 API_PORT=""
CONFDIR="${AGENTTAP_CONFDIR:-$HOME/.mitmproxy}"
while [ $# -gt 0 ]; do
  case "$1" in
    --policy-url) POLICY_URL="$2"; shift 2;;
    --tokenizer) TOKENIZER="$2"; shift 2;;
    --out) OUT="$2"; shift 2;;
    --port) PORT="$2"; shift 2;;
    --api-port) API_PORT="$2"; shift 2;;
    --tool-parser) TOOL_PARSER="$2"; shift 2;;
    --reasoning-parser) REASONING_PARSER="$2"; shift 2;;
    --confdir) CONFDIR="$2"; shift 2;;
    --max-model-len) MAX_MODEL_LEN="$2"; shift 2;;
    --) shift; break;;
    -h|--help) sed -n '2,14p' "$0"; exit 0;;
    *) echo "agenttap: unknown argument $1 (mitmdump arguments go after --)" >&2; exit 2;;
  esac
done

# The environments this needs (idempotent: a finished environment is left alone); the policy
# server's only when it is started here.
if [ -n "$POLICY_URL" ]; then export AGENTTAP_SKIP_VLLM=1; fi
AGENTTAP_SKIP_CLIENTS=1 AGENTTAP_SKIP_BROWSER=1 AGENTTAP_SKIP_PEERS=1 AGENTTAP_SKIP_TRAIN=1 AGENTTAP_SKIP_IMAGES=1 \
  bash "$ROOT/scripts/setup.sh" >&2

# Private to this user (0700): the token file, the embedded policy's socket (and vLLM's ipc
# sockets) and its log. Rollouts' sandboxes hide it.
PRIVATE="$(mktemp -d -t agenttap-XXXXXXXX)"
POLICY_PID="" MITM_PID="" POLICY_FAILED=""
# Whatever exits first (Ctrl-C, a TERM, mitmdump or the policy ending), everything started
# here stops; never under set -e, so one process already gone does not skip the rest. Then the
# private folder goes: a log kept would only be read if the policy failed, so then (alone) it
# is moved out, readable by this user only, and its path printed.
cleanup() {
  set +e
  [ -n "$MITM_PID" ] && kill "$MITM_PID" 2>/dev/null
  [ -n "$POLICY_PID" ] && kill "$POLICY_PID" 2>/dev/null
  wait 2>/dev/null
  if [ -n "$POLICY_FAILED" ] && [ -s "$PRIVATE/policy.log" ]; then
    KEPT="$(mktemp -t agenttap-policy-XXXXXXXX.log)" && chmod 600 "$PRIVATE/policy.log" \
      && mv -f "$PRIVATE/policy.log" "$KEPT" \
      && echo "agenttap: the embedded policy failed; its log: $KEPT" >&2
  fi
  rm -rf "$PRIVATE"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
( umask 077; printf '%s' "${AGENTTAP_TOKEN:-$("$PY" -c 'import secrets; print(secrets.token_urlsafe(24))')}" > "$PRIVATE/token" )
unset AGENTTAP_TOKEN  # no child's environment holds it

if [ -z "$POLICY_URL" ]; then
  LOG="$PRIVATE/policy.log"
  FIFO="$PRIVATE/policy.out"; mkfifo "$FIFO"
  PYTHONPATH="$SIDE_PATH" "$PY" -m policy_server --socket "$PRIVATE/vllm.sock" --log "$LOG" \
    --max-model-len "$MAX_MODEL_LEN" --start-timeout "${AGENTTAP_POLICY_START_S:-300}" > "$FIFO" &
  POLICY_PID=$!
  while read -r line; do
    echo "$line"
    case "$line" in POLICY_URL=*) POLICY_URL="${line#POLICY_URL=}"; break;; esac
  done < "$FIFO"
  rm -f "$FIFO"
  # Its log moves out of the private folder on exit (cleanup prints where).
  [ -n "$POLICY_URL" ] || { POLICY_FAILED=1; echo "agenttap: the embedded policy did not start" >&2; exit 1; }
  [ -n "$TOKENIZER" ] || TOKENIZER="$(PYTHONPATH="$SIDE_PATH" "$PY" -c 'from policy_server.launcher import DEFAULT_MODEL_DIR; print(DEFAULT_MODEL_DIR)')"
fi
if [ -z "$TOKENIZER" ]; then
  echo "agenttap: --tokenizer PATH is required with --policy-url (the policy's tokenizer folder)" >&2
  exit 2
fi

[ -n "$API_PORT" ] || API_PORT=$((PORT + 1))

# Check the policy before anything listens (the addon checks again, with --set options too);
# --set agenttap_check_policy=false after -- skips both.
case " $* " in
  *agenttap_check_policy=false*|*agenttap_check_policy=no*|*agenttap_check_policy=0*|*agenttap_check_policy=off*) ;;
  *) "$PY" -m capture.startup --policy-url "$POLICY_URL" --tokenizer "$TOKENIZER" || exit 1;;
esac

# The addon prints the lines to copy (AGENTTAP_PROXY=, AGENTTAP_TOKEN=, ..., one export line per
# client family) once mitmdump listens, and last "agenttap ready: ..." once both listeners
# accept connections.
"$ROOT/.venv/bin/mitmdump" -s "$ROOT/addons/capture.py" \
  --listen-host 127.0.0.1 --listen-port "$PORT" --set confdir="$CONFDIR" \
  --set agenttap_policy_url="$POLICY_URL" --set agenttap_tokenizer="$TOKENIZER" \
  --set agenttap_out="$OUT" --set agenttap_tool_parser="$TOOL_PARSER" \
  --set agenttap_reasoning_parser="$REASONING_PARSER" \
  --set agenttap_api_port="$API_PORT" --set agenttap_token_file="$PRIVATE/token" \
  --set agenttap_sandbox_hide="$PRIVATE" "$@" &
MITM_PID=$!
# Until mitmdump or the embedded policy ends (its status is the script's); a policy that ends
# first failed.
RC=0
if [ -n "$POLICY_PID" ]; then
  wait -n "$MITM_PID" "$POLICY_PID" || RC=$?
  if ! kill -0 "$POLICY_PID" 2>/dev/null; then
    POLICY_FAILED=1
    echo "agenttap: the embedded policy stopped; stopping the proxy" >&2
    [ "$RC" -ne 0 ] || RC=1
  fi
else
  wait "$MITM_PID" || RC=$?
fi
exit "$RC"
