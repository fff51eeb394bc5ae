#!/usr/bin/env bash
# The README's test command: install everything, then run the whole test suite.
set -euo pipefail
cd "$(dirname "$(readlink -f "$0")")/.."
bash scripts/setup_env.sh --test
.venv/bin/ruff check .  # lint first: a style error fails in seconds, not after the suite
exec .venv/bin/python -m pytest "$@"
