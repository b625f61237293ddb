#!/usr/bin/env bash
# The end-to-end tests with both cores of a 2-core machine busy: nothing may depend on an
# idle machine. Starts two busy processes, runs the tests given (default: tests/e2e and
# tests/integrations), and stops the busy processes by their pid however the tests end.
#   bash scripts/e2e-under-load.sh [pytest args...]
set -uo pipefail
cd "$(dirname "$0")/.."
yes > /dev/null & first=$!
yes > /dev/null & second=$!
trap 'kill "$first" "$second" 2>/dev/null' EXIT
if [ $# -eq 0 ]; then set -- tests/e2e tests/integrations; fi
.venv/bin/python -m pytest -q -p no:cacheprovider "$@"
