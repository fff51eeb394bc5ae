#!/usr/bin/env bash
# The README's main job: install, then run a local swarm (aux peer + two trainers) on the tiny preset.
# Flags go to the demo (see: .venv/bin/python scripts/demo.py --help), e.g. --duration 60.
set -euo pipefail
cd "$(dirname "$(readlink -f "$0")")/.."
bash scripts/setup_env.sh
exec .venv/bin/python scripts/demo.py "$@"
