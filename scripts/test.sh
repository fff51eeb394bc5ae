#!/usr/bin/env bash
# The README's test command: install everything, then run the whole test suite.
set -euo pipefail
cd "$(dirname "$(readlink -f "$0")")/.."
bash scripts/setup_env.sh --test
# lint and format check first: a style error fails in seconds, not after the suite
.venv/bin/ruff check .
.venv/bin/ruff format --check .
exec .venv/bin/python -m pytest "$@"
