#!/usr/bin/env bash
# bench/gangs.py on a machine with two GPUs: installs the appliance's dependencies from .whl/
# when present and builds the hook (tests/gpu/setup.sh), then runs the benchmark.
# Usage (from the repo root): bash bench/gangs.sh [gangs.py options]
set -euo pipefail
cd "$(dirname "$0")/.."
source tests/gpu/setup.sh
python3 -c 'import torch; print("nccl", torch.cuda.nccl.version())'
python3 bench/gangs.py "$@"
