#!/usr/bin/env bash
# Installs posttrain into .venv and runs the main job: GRPO on SmolLM2-135M-Instruct with Arithmetic-v0 (CPU).
# Extra arguments go to `posttrain train`, e.g. --config.train.steps=30 --workdir=runs/mine
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup_env.sh
exec .venv/bin/posttrain train --config=configs/quickstart.py "$@"
