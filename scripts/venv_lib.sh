# Sourced by the setup scripts that build a pinned Python 3.12 venv of their own
# (setup_agents.sh, setup_openhands.sh, setup_harbor.sh, setup_peers.sh): the part they share.
# Each keeps what is its own: the packages, and the import check that proves the venv works.
#
#   venv_ready TAG DIR PACKAGES   exits the script (0) when DIR's marker holds PACKAGES
#   venv_build TAG DIR PACKAGES   DIR made anew with PACKAGES installed (one pip resolve)
#   venv_done  TAG DIR PACKAGES   DIR's marker written: the next run leaves it alone
# Idempotent: remove DIR to rebuild it; a changed PACKAGES list rebuilds it too.

PY312=${AGENTTAP_PY312:-}
if [ -z "$PY312" ]; then
  if python3.12 --version >/dev/null 2>&1; then PY312=python3.12
  else PY312="env PYENV_VERSION=3.12.1 python3"; fi
fi

venv_ready() {
  if [ -f "$2/.agenttap-ready" ] && [ "$(cat "$2/.agenttap-ready")" = "$3" ]; then
    echo "[$1] $2 ready ($3)"
    exit 0
  fi
}

venv_build() {
  echo "[$1] building $2 (Python 3.12): $3"
  rm -rf "$2"
  $PY312 -m venv "$2"
  "$2/bin/pip" install -q --upgrade pip
  # shellcheck disable=SC2086  # the list is words on purpose
  "$2/bin/pip" install -q $3
}

venv_done() {
  echo "$3" > "$2/.agenttap-ready"
}
