#!/usr/bin/env bash
# Installs posttrain with the dev extra (pytest, torch CPU, transformers for parity tests) and runs the tests.
#   scripts/test.sh [fast|ci|full] [pytest args...]
# fast: units and references; ci (the default, what CI runs): fast + loops, subprocesses, notebooks and bench quick
# modes; full: everything, the heavy `slow` cases too. Tiers and their budgets: tests/BUDGET.md. Two pytest-xdist
# workers (the CI machine has 2 cores; tests of one file stay in one worker); POSTTRAIN_TEST_WORKERS=0 runs in one
# process. The 25 slowest tests are listed at the end, so a CI log says where the suite's time went.
set -euo pipefail
cd "$(dirname "$0")/.."
tier=ci
case "${1:-}" in fast|ci|full) tier="$1"; shift ;; esac
case "$tier" in
  fast) markers="not slow and not ci" ;;
  ci) markers="not slow" ;;
  full) markers="" ;;
esac
scripts/setup_env.sh dev
exec .venv/bin/python -m pytest -q -n "${POSTTRAIN_TEST_WORKERS:-2}" --dist loadfile --durations=25 -m "$markers" "$@"
