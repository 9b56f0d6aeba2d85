#!/usr/bin/env bash
# bench/gangs.py on a machine with two GPUs: installs the appliance's dependencies from .whl/
# when present (as tests/gpu/run.sh does), builds the hook, runs the benchmark.
# Usage (from the repo root): bash bench/gangs.sh [gangs.py options]
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/nvshare-site .whl/*.whl
  export PYTHONPATH="/tmp/nvshare-site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv,noheader
python3 -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version())'
make -s -j8 -C ld_hook build/libnvshare.so
python3 bench/gangs.py "$@"
