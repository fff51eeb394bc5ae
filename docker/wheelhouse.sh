#!/usr/bin/env bash
# Download every wheel the image installs into docker/wheelhouse/ (or DEST), so that `docker build` installs
# from there with no index: for air-gapped machines and builds that cannot reach PyPI.
# Usage: [PYTHON=python3.X] bash docker/wheelhouse.sh [--torch cuda|cpu] [DEST]
#   --torch cuda  (default) torch from PyPI, the CUDA build, for the default CUDA base image
#   --torch cpu   the CPU-only build of torch (much smaller), for --build-arg BASE_IMAGE=<a CPU base>
#   PYTHON        a Python of the image's version (3.12 on the default Ubuntu 24.04 CUDA base, 3.11 on Debian
#                 bookworm): wheels are picked for it; the Dockerfile refuses a wheelhouse made for another one.
#   TORCH_CPU_INDEX  where the CPU build of torch comes from (empty: only pip's own sources, e.g. --find-links)
set -euo pipefail
cd "$(dirname "$(readlink -f "$0")")/.."
torch=cuda
dest=docker/wheelhouse
while [ $# -gt 0 ]; do
  case "$1" in
    --torch) torch="${2:?--torch needs cuda or cpu}"; shift 2 ;;
    -h|--help) sed -n '2,10p' "$0"; exit 0 ;;
    -*) echo "unknown option $1 (see --help)" >&2; exit 2 ;;
    *) dest="$1"; shift ;;
  esac
done
python="${PYTHON:-python3}"
torch_spec="torch==2.13.0"
extra=()
case "$torch" in
  cpu)
    index="${TORCH_CPU_INDEX-https://download.pytorch.org/whl/cpu}"
    [ -z "$index" ] || extra=(--extra-index-url "$index")
    ;;
  cuda) torch_spec="torch===2.13.0" ;;  # "===": not 2.13.0+cpu, which "==" admits from a local --find-links
  *) echo "--torch must be cuda or cpu, not '$torch'" >&2; exit 2 ;;
esac
mkdir -p "$dest"
rm -f "$dest"/*.whl
# The pins the image installs (requirements.lock, the tested set) plus torch's own dependencies (the CUDA build's
# NVIDIA libraries, pinned by torch); setuptools is the backend `pip install -e .` needs.
"$python" -m pip wheel -q "${extra[@]}" -w "$dest" "$torch_spec" -r requirements.lock "setuptools>=77"
torch_wheel="$(basename "$(ls "$dest"/torch-*.whl)")"
case "$torch:$torch_wheel" in
  cpu:*+cpu*) ;;
  cpu:*) echo "got $torch_wheel, not the CPU build of torch: set TORCH_CPU_INDEX to an index that has it" >&2; exit 1 ;;
  cuda:*+cpu*) echo "got the CPU build of torch ($torch_wheel) for --torch cuda" >&2; exit 1 ;;
esac
"$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])' > "$dest/python-version"
echo "$(ls "$dest"/*.whl | wc -l) wheels ($(du -sh "$dest" | cut -f1)) in $dest for Python $(cat "$dest/python-version"), torch: $torch_wheel"
