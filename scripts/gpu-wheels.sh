#!/usr/bin/env bash
# Fetches into .whl/ the appliance's runtime packages, at the versions requirements.lock names,
# as wheels for the GPU machine's Python (3.12, x86-64 manylinux by default), where nothing can be
# fetched. tests/gpu/setup.sh installs them there. Usage: scripts/gpu-wheels.sh [PYTHON_VERSION]
set -euo pipefail
cd "$(dirname "$0")/.."
py="${1:-3.12}"
pins="$(mktemp)"
trap 'rm -f "$pins"' EXIT
scripts/pins.sh > "$pins"
mapfile -t needs < <(python3 -c '
import tomllib
print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]))')
rm -rf .whl
platforms=()
for n in 17 27 28 31 34; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
python3 -m pip download -q --disable-pip-version-check --only-binary=:all: --implementation cp \
  --python-version "$py" "${platforms[@]}" --platform manylinux2014_x86_64 --platform any \
  -c "$pins" -d .whl "${needs[@]}"
ls .whl
