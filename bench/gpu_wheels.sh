#!/usr/bin/env bash
# The wheels bench/gpu_check.py carries to a lent GPU machine (torch there, no diffusers, no network): the
# versions this repository's tests run with (requirements.txt's tested ones), pure-Python wheels, into
# .whl/ at the repository's root, which git ignores (the device tool carries ignored paths only).
#
#   bash bench/gpu_wheels.sh            # download them (needs the network, once)
#   bash bench/gpu_wheels.sh --print    # print the pins, download nothing (tests/test_gpu_check.py reads them)
#
# Then: the device tool's run(carry=['.whl'], command='python3 -m pip install -q --no-index --no-deps
# --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site ||
# exit; PYTHONUNBUFFERED=1 python3 -m bench.gpu_check --out=$OUT'); the check's env phase stops at once,
# with one line, if they are not there.
set -euo pipefail
PINS=(
  diffusers==0.42.1           # the transformer, the VAE, the attention dispatcher
  transformers==5.25.0        # Qwen2-VL (VideoAlign), the text encoders
  peft==0.21.2                # LoRA
  huggingface_hub==2.4.0      # what diffusers 0.42 and transformers 5.25 import it as
  importlib_metadata==10.2.0  # diffusers' import of versions
  zipp==4.1.2                 # importlib_metadata's
)
if [[ "${1:-}" == "--print" ]]; then
  printf '%s\n' "${PINS[@]}"
  exit 0
fi
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
if ! git check-ignore -q .whl; then  # carried only if ignored: say so in this clone's own exclude file
  exclude="$(git rev-parse --git-path info/exclude)"
  mkdir -p "$(dirname "$exclude")" && echo /.whl/ >> "$exclude"
fi
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_17_x86_64 -d .whl "${PINS[@]}"
ls -l .whl
