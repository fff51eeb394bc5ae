#!/usr/bin/env bash
# Create .venv (if missing) and install LeanHive with the tested set of dependencies: requirements.lock, or with
# --test requirements-test.lock (the same runtime pins plus the test and benchmark tools) and the system packages
# the tests drive. The locks come from pyproject.toml's ranges (`bash scripts/deps.sh lock`).
# Usage: scripts/setup_env.sh [--test]
set -euo pipefail
cd "$(dirname "$(readlink -f "$0")")/.."
lock=requirements.lock
if [ "${1:-}" = "--test" ]; then
  lock=requirements-test.lock
  # System programs the tests drive for real: Prometheus, headless Chromium, iproute2 (netns, tc), iptables (the
  # home routers' NAT in the home-network testbed, benchmarks/testbed/home).
  need=()
  command -v prometheus >/dev/null || need+=(prometheus)
  command -v chromium >/dev/null || need+=(chromium chromium-driver)
  command -v ip >/dev/null || need+=(iproute2)
  command -v tc >/dev/null || need+=(iproute2)
  command -v iptables >/dev/null || need+=(iptables)
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
# torch first, at the lock's version, from whichever build pip's sources have (the CPU one where pip is pointed at it,
# e.g. with --find-links or PIP_EXTRA_INDEX_URL): the lock then finds it installed and pulls no other build.
.venv/bin/python -m pip install -q "$(grep -m1 '^torch==' "$lock")"
.venv/bin/python -m pip install -q -r "$lock"
# LeanHive itself (editable: the checkout is the code); --no-deps: its dependencies are exactly the lock's
.venv/bin/python -m pip install -q --no-deps -e .
if [ "$lock" = requirements-test.lock ] && [ ! -f .venv/compose_spec.json ]; then
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
