#!/usr/bin/env bash
# The README's test command: install the tested set (requirements-test.lock), then run the whole test suite.
# Arguments go to pytest (e.g. -m "not slow", -k generation). Two checks against releases the lock does not hold yet:
#   bash scripts/test.sh --newest   the dependency-sensitive tests (-m deps) in a scratch venv with the newest
#   bash scripts/test.sh --oldest   versions pyproject.toml's ranges allow, or the oldest (see scripts/deps.sh)
set -euo pipefail
cd "$(dirname "$(readlink -f "$0")")/.."
bash scripts/setup_env.sh --test
case "${1:-}" in
  --newest | --oldest) mode="${1#--}"; shift; exec bash scripts/deps.sh "$mode" "$@" ;;
esac
# lint and format check first: a style error fails in seconds, not after the suite
.venv/bin/ruff check .
.venv/bin/ruff format --check .
exec .venv/bin/python -m pytest "$@"
