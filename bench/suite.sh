#!/usr/bin/env bash
# The workload suite on a GPU machine (bench/suite.py): installs the appliance's dependencies
# from .whl/ when present and builds the hook (tests/gpu/setup.sh), then runs every section.
# Usage (from the repo root): bash bench/suite.sh OUTDIR [--seconds 12] [--quota-seconds 60]
set -euo pipefail
cd "$(dirname "$0")/.."
source tests/gpu/setup.sh
python3 bench/suite.py run "$@"
