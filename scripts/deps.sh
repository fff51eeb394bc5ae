#!/usr/bin/env bash
# LeanHive's dependency sets: the lock of the tested set, and checks against the newest and oldest versions that
# pyproject.toml's ranges allow (a release that changes under a fresh install is caught here, not by a user).
#
#   bash scripts/deps.sh lock     refresh requirements.lock (runtime) and requirements-test.lock (runtime + test and
#                                 bench extras, same runtime pins) from pyproject.toml; commit both
#   bash scripts/deps.sh newest   scratch venv (.venv-newest/) with the newest versions the ranges allow, then the
#                                 dependency-sensitive tests (pytest -m deps); extra arguments go to pytest
#   bash scripts/deps.sh oldest   the same with every direct dependency at its lower bound (.venv-oldest/)
#
# `bash scripts/test.sh --newest` / `--oldest` call the last two. The resolver is uv (`uv pip compile`, installed by
# `bash scripts/setup_env.sh --test`): it writes the pip-readable requirements format that setup_env.sh and the
# Docker build install with plain pip, and, unlike pip-tools, it can resolve the lowest versions for `oldest`.
#
# torch: pyproject pins it exactly; the locks are resolved against its CPU build (found where pip finds it: pip's
# --find-links, else the PyTorch CPU index), so they hold no CUDA packages, and record it without the "+cpu" label:
# `torch==X` admits both builds, and each install takes the one its source has (setup_env.sh installs torch first).
set -euo pipefail
cd "$(dirname "$(readlink -f "$0")")/.."

usage() { sed -n '2,18p' "$0" | sed 's/^# \{0,1\}//'; }
mode="${1:-}"
[ $# -gt 0 ] && shift
case "$mode" in
  lock | newest | oldest) ;;
  -h | --help) usage; exit 0 ;;
  *) usage >&2; echo "scripts/deps.sh: give lock, newest or oldest, not '${mode}'" >&2; exit 2 ;;
esac

uv="$(command -v .venv/bin/uv || command -v uv || true)"
if [ -z "$uv" ]; then
  echo "uv is not installed: run 'bash scripts/setup_env.sh --test' first (it installs uv into .venv)" >&2
  exit 2
fi
torch_version="$(sed -n 's/^ *"torch==\([^"]*\)".*/\1/p' pyproject.toml)"
[ -n "$torch_version" ] || { echo "pyproject.toml must pin torch exactly (\"torch==X.Y.Z\")" >&2; exit 2; }

# The lock's platform: the CPython and the Linux wheels CI and the CPU Docker image (Debian bookworm) run.
platform=(--python-version 3.11 --python-platform x86_64-manylinux_2_28)
links="${PIP_FIND_LINKS:-$(python3 -m pip config get global.find-links 2>/dev/null || true)}"
torch_source=()
if [ -n "$links" ]; then
  for link in $links; do torch_source+=(--find-links "$link"); done
else
  torch_source=(--extra-index-url https://download.pytorch.org/whl/cpu --index-strategy unsafe-best-match)
fi
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
echo "torch==${torch_version}+cpu" > "$work/torch-cpu.txt"

compile() {  # compile OUTPUT [uv arguments...]: resolve pyproject.toml against torch's CPU build
  local output="$1"
  shift
  "$uv" pip compile -q pyproject.toml "${platform[@]}" "${torch_source[@]}" --override "$work/torch-cpu.txt" \
    --no-header --output-file "$output" "$@"
  sed -i "s/^torch==${torch_version//./\\.}+cpu\$/torch==${torch_version}/" "$output"
}

header() {  # header WHAT: the comment block a lock starts with
  cat <<EOF
# $1, pinned by \`bash scripts/deps.sh lock\` (uv pip compile) from pyproject.toml's ranges.
# Resolved for CPython 3.11 on x86_64 Linux against torch's CPU build; "torch==${torch_version}" admits the CUDA build
# too (scripts/setup_env.sh installs torch first, from whichever source pip has). Do not edit by hand.
EOF
}

if [ "$mode" = lock ]; then
  compile "$work/runtime.txt"
  compile "$work/test.txt" --extra test --extra bench --constraint "$work/runtime.txt"
  { header "LeanHive's runtime dependencies"; cat "$work/runtime.txt"; } > requirements.lock
  { header "LeanHive's runtime, test and benchmark dependencies (runtime pins equal requirements.lock's)"
    cat "$work/test.txt"; } > requirements-test.lock
  for name in transformers tokenizers datasets numpy hivemind; do
    grep -m1 "^${name}==" requirements.lock || true
  done
  echo "wrote requirements.lock ($(grep -c '==' requirements.lock) pins) and requirements-test.lock" \
       "($(grep -c '==' requirements-test.lock) pins); run the tests, then commit both"
  exit 0
fi

resolution=highest
[ "$mode" = oldest ] && resolution=lowest-direct
venv=".venv-$mode"
# --refresh: the checks are about releases as they are now, not as uv's cache last saw the index
compile "$work/set.txt" --extra test --resolution "$resolution" --refresh
rm -rf "$venv"
python3 -m venv "$venv"
# installed by the resolver that chose the set: pip's cached view of the index lagged a release of that morning
# and did not find the version uv had just chosen
"$uv" pip install -q --refresh --python "$venv/bin/python" "${torch_source[@]}" --override "$work/torch-cpu.txt" \
  -r "$work/set.txt"
"$uv" pip install -q --python "$venv/bin/python" --no-deps -e .
echo "== the $mode versions the ranges allow:"
"$venv/bin/python" -m pip list --format=freeze 2>/dev/null \
  | grep -iE '^(torch|transformers|tokenizers|datasets|huggingface.hub|numpy|hivemind|bitsandbytes|safetensors)=' \
  | tee "$venv/versions.txt"
exec "$venv/bin/python" -m pytest -m deps -p no:cacheprovider "$@"
