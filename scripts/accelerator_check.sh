#!/usr/bin/env bash
# The prepared accelerator check (one H200, no network, at most 10 minutes): see scripts/accelerator_check.py.
#   scripts/accelerator_check.sh --wheels DIR [--only STEP,...] [--out DIR]    # real shapes, JSON under $OUT
#   scripts/accelerator_check.sh --dry-run --out DIR                          # tiny shapes on the CPU
# The interpreter: $PYTHON, else the checkout's .venv if there is one, else python3.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
python="${PYTHON:-}"
if [[ -z "$python" ]]; then
  if [[ -x "$here/../.venv/bin/python" ]]; then python="$here/../.venv/bin/python"; else python="$(command -v python3)"; fi
fi
exec "$python" "$here/accelerator_check.py" "$@"
