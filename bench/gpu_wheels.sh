#!/usr/bin/env bash
# The wheels bench/gpu_check.py carries to a lent GPU machine (torch there, no diffusers, no network): what
# the check imports at the versions this repository's tests run with, and every requirement of theirs that the
# machines' image (bench/gpu_image_packages.txt) does not meet, derived by bench/gpu_image.py (not listed here),
# into .whl/ at the repository's root, which git ignores (the device tool carries ignored paths only).
#
#   bash bench/gpu_wheels.sh            # download them (needs the network, once)
#   bash bench/gpu_wheels.sh --print    # print the pins, download nothing (tests/test_gpu_check.py reads them)
#   python -m bench.gpu_image --why     # why each is carried, and what the image is assumed to meet
#
# Then: the device tool's run(carry=['.whl'], command='python3 -m pip install -q --no-index --no-deps
# --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit;
# PYTHONUNBUFFERED=1 python3 -m bench.gpu_check --out=$OUT'); the check's env phase stops at once, with one
# line, if they are not there.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
mapfile -t PINS < <(python3 -m bench.gpu_image)  # e.g. diffusers==0.42.1 ... httpx2==2.17.0 truststore==0.10.5
(( ${#PINS[@]} )) || { echo 'bench/gpu_image.py printed no wheels' >&2; exit 1; }
if [[ "${1:-}" == "--print" ]]; then
  printf '%s\n' "${PINS[@]}"
  exit 0
fi
if ! git check-ignore -q .whl; then  # carried only if ignored: say so in this clone's own exclude file
  exclude="$(git rev-parse --git-path info/exclude)"
  mkdir -p "$(dirname "$exclude")" && echo /.whl/ >> "$exclude"
fi
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_17_x86_64 -d .whl "${PINS[@]}"
ls -l .whl
