#!/usr/bin/env bash
# Create .venv (if missing) and install LeanHive from pyproject.toml, the one dependency list.
# Usage: scripts/setup_env.sh [--test]   (--test also installs test extras and system packages)
set -euo pipefail
cd "$(dirname "$(readlink -f "$0")")/.."
extras=""
if [ "${1:-}" = "--test" ]; then
  extras="[test]"
  # System programs the tests drive for real: Prometheus, headless Chromium, iproute2 (netns, tc).
  need=()
  command -v prometheus >/dev/null || need+=(prometheus)
  command -v chromium >/dev/null || need+=(chromium chromium-driver)
  command -v ip >/dev/null || need+=(iproute2)
  command -v tc >/dev/null || need+=(iproute2)
  if [ ${#need[@]} -gt 0 ]; then
    if [ "$(id -u)" = 0 ]; then
      echo "installing system packages: ${need[*]}"
      (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}") >/dev/null
    else
      echo "warning: missing ${need[*]}; install them with apt-get (tests that need them will fail)" >&2
    fi
  fi
fi
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# torch first and pinned, so nothing below can pull a different (CUDA) build.
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".${extras}"
if [ -n "$extras" ] && [ ! -f .venv/compose_spec.json ]; then
  # The official Compose JSON schema (as shipped in docker-compose 1.29.2's wheel) for tests/test_docker.py;
  # fetched, not vendored, and never installed (its pins clash with ours).
  .venv/bin/python -m pip download -q --no-deps --only-binary=:all: -d .venv/downloads "docker-compose==1.29.2"
  .venv/bin/python - <<'PY'
import glob, zipfile
wheel = glob.glob(".venv/downloads/docker_compose-1.29.2-*.whl")[0]
with zipfile.ZipFile(wheel) as z, open(".venv/compose_spec.json", "wb") as out:
    out.write(z.read("compose/config/compose_spec.json"))
PY
fi
