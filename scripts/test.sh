#!/usr/bin/env bash
# Installs posttrain with the dev extra (pytest, torch CPU, transformers for parity tests) and runs the tests.
# Extra arguments go to pytest (e.g. -m slow for the long tests, or a path). Two pytest-xdist workers (the CI
# machine has 2 cores; tests of one file stay in one worker); POSTTRAIN_TEST_WORKERS=0 runs in one process. The
# 25 slowest tests are listed at the end, so a CI log says where the suite's time went.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup_env.sh dev
exec .venv/bin/python -m pytest -q -n "${POSTTRAIN_TEST_WORKERS:-2}" --dist loadfile --durations=25 "$@"
