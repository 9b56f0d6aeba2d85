#!/bin/sh
# Per-call cost of cuLaunchKernel with the lock held, with and without libnvshare.so, against the
# fake driver with zero-length kernels. The hooked run registers with a real nvshare-scheduler in
# mode on and holds the lock for the whole loop (the first launch takes it).
# Usage: bench/hook_fastpath.sh [calls] [rounds] [label=other/libnvshare.so ...]
# Extra hook builds (an older commit's, say) are measured in the same run for a side-by-side ratio.
set -eu
cd "$(dirname "$0")/.."
make -s -C ld_hook
calls=${1:-20000000}
rounds=${2:-5}
tmp=$(mktemp -d /tmp/nvs-bench-XXXXXX)
trap 'kill "$daemon" 2>/dev/null || true; rm -rf "$tmp"' EXIT
mkdir "$tmp/policy"
printf "scheduler: {mode: 'on', timeQuantum: 1h}\nmetrics: {enabled: false}\n" > "$tmp/policy/p.yaml"
NVSHARE_SOCKET_DIR=$tmp .venv/bin/nvshare-scheduler --policy-dir "$tmp/policy" > "$tmp/log" 2>&1 &
daemon=$!
while [ ! -S "$tmp/scheduler.sock" ]; do sleep 0.05; done
export LD_LIBRARY_PATH=ld_hook/build/fake NVSHARE_FAKE_LAUNCH_US=0 NVSHARE_SOCKET_DIR=$tmp
export NVSHARE_IDLE_RELEASE_MS=3600000
printf 'unhooked: '; ld_hook/build/hook_fastpath "$calls" "$rounds"
printf "hooked:   "; NVSHARE_DEBUG=${NVSHARE_DEBUG:-0} LD_PRELOAD=$PWD/ld_hook/build/libnvshare.so ld_hook/build/hook_fastpath "$calls" "$rounds"
if [ $# -ge 2 ]; then shift 2; else set --; fi
for extra in "$@"; do
  printf "%-9s " "${extra%%=*}:"; LD_PRELOAD=${extra#*=} ld_hook/build/hook_fastpath "$calls" "$rounds"
done
