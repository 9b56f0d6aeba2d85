#!/usr/bin/env bash
# Prints requirements.lock as a pip constraints file: every package at its locked version (with
# its environment marker), without the hashes. An install that takes only part of the lock (the
# appliance's runtime packages, not the test tools) uses it with `pip install -c`: pip resolves
# what the appliance needs and each package comes at exactly the locked version.
set -euo pipefail
lock="${1:-$(dirname "$0")/../requirements.lock}"
grep -E '^[A-Za-z0-9]' "$lock" | sed -E 's/[[:space:]]*\\$//'
