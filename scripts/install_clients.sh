#!/usr/bin/env bash
# Installs the agent CLIs that the end-to-end tests drive, pinned, into .cache/node (git-ignored).
#   @anthropic-ai/claude-code  -> .cache/node/node_modules/.bin/claude
#   @google/gemini-cli         -> .cache/node/node_modules/.bin/gemini (engines: node >= 20)
#   opencode-ai                -> .cache/node/node_modules/.bin/opencode
# The npm package is a thin wrapper; its postinstall copies the native linux-x64 binary
# (optional dependency @anthropic-ai/claude-code-linux-x64) over bin/claude.exe, so node
# is needed only at install time. Its engines field asks for node >= 22; the native binary
# does not use node, so node 20 is fine (npm prints an EBADENGINE warning, harmless).
# Idempotent: a marker file per pinned version makes a second run a no-op
# (remove .cache/node to reinstall).
set -euo pipefail
cd "$(dirname "$0")/.."

CLAUDE_CODE_VERSION=2.1.330
PREFIX="$PWD/.cache/node"
MARKER="$PREFIX/.agenttap-claude-code-$CLAUDE_CODE_VERSION"
CLAUDE_BIN="$PREFIX/node_modules/.bin/claude"

if [ ! -f "$MARKER" ]; then
  echo "[install_clients] installing @anthropic-ai/claude-code@$CLAUDE_CODE_VERSION into $PREFIX" >&2
  mkdir -p "$PREFIX"
  rm -f "$PREFIX"/.agenttap-claude-code-*
  npm install --prefix "$PREFIX" --no-audit --no-fund --save-exact --loglevel=error \
    "@anthropic-ai/claude-code@$CLAUDE_CODE_VERSION" >&2
  # If npm skipped the postinstall (ignore-scripts / allowScripts), bin/claude.exe is still
  # the placeholder stub: run the package's own installer, which puts the native binary there.
  if ! "$CLAUDE_BIN" --version >/dev/null 2>&1; then
    (cd "$PREFIX/node_modules/@anthropic-ai/claude-code" && node install.cjs) >&2
  fi
  got=$("$CLAUDE_BIN" --version)
  case "$got" in
    "$CLAUDE_CODE_VERSION "*) ;;
    *) echo "[install_clients] unexpected 'claude --version': $got" >&2; exit 1 ;;
  esac
  touch "$MARKER"
fi

GEMINI_CLI_VERSION=0.61.0
GEMINI_MARKER="$PREFIX/.agenttap-gemini-cli-$GEMINI_CLI_VERSION"
GEMINI_BIN="$PREFIX/node_modules/.bin/gemini"

if [ ! -f "$GEMINI_MARKER" ]; then
  echo "[install_clients] installing @google/gemini-cli@$GEMINI_CLI_VERSION into $PREFIX" >&2
  mkdir -p "$PREFIX"
  rm -f "$PREFIX"/.agenttap-gemini-cli-*
  npm install --prefix "$PREFIX" --no-audit --no-fund --save-exact --loglevel=error \
    "@google/gemini-cli@$GEMINI_CLI_VERSION" >&2
  got=$("$GEMINI_BIN" --version)
  if [ "$got" != "$GEMINI_CLI_VERSION" ]; then
    echo "[install_clients] unexpected 'gemini --version': $got" >&2; exit 1
  fi
  touch "$GEMINI_MARKER"
fi
echo "$CLAUDE_BIN"
echo "$GEMINI_BIN"

#   @openai/codex  -> .cache/node/node_modules/.bin/codex
# The npm package is a node launcher; the native binary comes in its platform optional
# dependency (linux x64 here), so node is needed to start it.
CODEX_VERSION=0.169.0
CODEX_MARKER="$PREFIX/.agenttap-codex-$CODEX_VERSION"
CODEX_BIN="$PREFIX/node_modules/.bin/codex"
if [ ! -f "$CODEX_MARKER" ]; then
  echo "[install_clients] installing @openai/codex@$CODEX_VERSION into $PREFIX" >&2
  rm -f "$PREFIX"/.agenttap-codex-*
  npm install --prefix "$PREFIX" --no-audit --no-fund --save-exact --loglevel=error \
    "@openai/codex@$CODEX_VERSION" >&2
  got=$("$CODEX_BIN" --version)
  case "$got" in
    *" $CODEX_VERSION") ;;
    *) echo "[install_clients] unexpected 'codex --version': $got" >&2; exit 1 ;;
  esac
  touch "$CODEX_MARKER"
fi
echo "$CODEX_BIN"

#   opencode-ai  -> .cache/node/node_modules/.bin/opencode
# Its postinstall puts the native binary of its platform optional dependency
# (opencode-linux-x64 here) at bin/opencode.exe, so node is needed only at install time.
# --version runs in a scratch HOME: OpenCode writes its data and config folders there.
OPENCODE_VERSION=1.18.33
OPENCODE_MARKER="$PREFIX/.agenttap-opencode-$OPENCODE_VERSION"
OPENCODE_BIN="$PREFIX/node_modules/.bin/opencode"
if [ ! -f "$OPENCODE_MARKER" ]; then
  echo "[install_clients] installing opencode-ai@$OPENCODE_VERSION into $PREFIX" >&2
  rm -f "$PREFIX"/.agenttap-opencode-*
  npm install --prefix "$PREFIX" --no-audit --no-fund --save-exact --loglevel=error \
    "opencode-ai@$OPENCODE_VERSION" >&2
  scratch=$(mktemp -d)
  # If npm skipped the postinstall (ignore-scripts), run it: it puts the native binary there.
  if ! HOME="$scratch" "$OPENCODE_BIN" --version >/dev/null 2>&1; then
    (cd "$PREFIX/node_modules/opencode-ai" && node postinstall.mjs) >&2
  fi
  got=$(HOME="$scratch" "$OPENCODE_BIN" --version)
  rm -rf "$scratch"
  if [ "$got" != "$OPENCODE_VERSION" ]; then
    echo "[install_clients] unexpected 'opencode --version': $got" >&2; exit 1
  fi
  touch "$OPENCODE_MARKER"
fi
echo "$OPENCODE_BIN"
