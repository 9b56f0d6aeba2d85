#!/usr/bin/env bash
# Real-GPU checks: build the hook and the CUDA programs on the GPU machine, then run
# tests/gpu/gpu_checks.py. Usage (from the repo root): bash tests/gpu/run.sh [section...]
# Needs: an NVIDIA GPU, nvcc, gcc, PyTorch; the appliance's Python dependencies either
# installed or carried as wheels in .whl/ (see README "Real-GPU checks").
set -euo pipefail
cd "$(dirname "$0")/../.."
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/nvshare-site .whl/*.whl
  export PYTHONPATH="/tmp/nvshare-site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv,noheader
python3 -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)'
make -s -j8 -C ld_hook build/libnvshare.so
# the driver's libcuda.so / libnvidia-ml.so may lack their unversioned names: link the toolkit's stubs
stubs="$(dirname "$(command -v nvcc)")/../lib64/stubs"
nvcc -O2 -arch=sm_90 -o /tmp/nvshare-programs tests/gpu/programs.cu -L"$stubs" -lcuda -lnvidia-ml
python3 tests/gpu/gpu_checks.py "$@"
