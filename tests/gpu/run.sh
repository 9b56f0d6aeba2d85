#!/usr/bin/env bash
# Real-GPU checks: build the hook and the CUDA programs on the GPU machine, then run
# tests/gpu/gpu_checks.py. Usage (from the repo root): bash tests/gpu/run.sh [section...]
# Needs: an NVIDIA GPU, nvcc, gcc, PyTorch; the appliance's Python dependencies either
# installed or carried as wheels in .whl/ (see README "Real-GPU checks").
set -euo pipefail
cd "$(dirname "$0")/../.."
source tests/gpu/setup.sh
# the driver's libcuda.so / libnvidia-ml.so may lack their unversioned names: link the toolkit's stubs
stubs="$(dirname "$(command -v nvcc)")/../lib64/stubs"
nvcc -O2 -arch=sm_90 -o /tmp/nvshare-programs tests/gpu/programs.cu -L"$stubs" -lcuda -lnvidia-ml
python3 tests/gpu/gpu_checks.py "$@"
