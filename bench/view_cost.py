"""What the pod's view of the GPU costs a program: cuMemGetInfo and nvmlDeviceGetMemoryInfo per
call, without the hook, with the hook and no limit (no daemon), and with a limit from a real
daemon, answered from the hook's 100 ms cache or by a round trip to the daemon (VIEW_REQUEST).

Fake driver and NVML (ld_hook/tests), real daemon, one process timing each call with
perf_counter_ns; a round trip is forced by sleeping past the cache between calls.

    make -C ld_hook && .venv/bin/python bench/view_cost.py [--calls 2000]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from _daemon import BenchDaemon, machine

ROOT = Path(__file__).resolve().parents[1]
BUILD = ROOT / "ld_hook" / "build"

TIMER = r"""
import ctypes, json, statistics, sys, time
calls, gap = int(sys.argv[1]), float(sys.argv[2])
cuda, nvml = ctypes.CDLL("libcuda.so.1"), ctypes.CDLL("libnvidia-ml.so.1")
ctx, free, total = ctypes.c_void_p(), ctypes.c_size_t(), ctypes.c_size_t()
assert cuda.cuInit(0) == 0 and cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0) == 0
assert cuda.cuCtxSetCurrent(ctx) == 0 and nvml.nvmlInit_v2() == 0
dev, mem = ctypes.c_void_p(), (ctypes.c_ulonglong * 3)()
assert nvml.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(dev)) == 0
def timed(call):
    out = []
    for _ in range(calls):
        if gap:
            time.sleep(gap)
        t0 = time.perf_counter_ns()
        assert call() == 0
        out.append(time.perf_counter_ns() - t0)
    return statistics.median(out) / 1000
cu = timed(lambda: cuda.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)))
nv = timed(lambda: nvml.nvmlDeviceGetMemoryInfo(dev, mem))
print(json.dumps({"cuMemGetInfo": cu, "nvmlDeviceGetMemoryInfo": nv, "total": total.value}))
"""


def measure(env: dict[str, str], calls: int, gap: float) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, "-c", TIMER, str(calls), str(gap)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
    )
    return json.loads(out.stdout)  # type: ignore[no-any-return]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    base = {k: v for k, v in os.environ.items() if not k.startswith("NVSHARE_")}
    base["LD_LIBRARY_PATH"] = str(BUILD / "fake")
    hooked = {**base, "LD_PRELOAD": str(BUILD / "libnvshare.so")}
    d = BenchDaemon("defaults: {memoryLimit: 1Gi}")
    try:
        limited = {**hooked, "NVSHARE_SOCKET_DIR": str(d.socket_dir)}
        rows = [
            ("no hook", measure(base, args.calls, 0)),
            (
                "hook, no daemon, no limit",
                measure({**hooked, "NVSHARE_SOCKET_DIR": "/nonexistent"}, args.calls, 0),
            ),
            ("hook, 1Gi from the daemon, cached", measure(limited, args.calls, 0)),
            ("hook, 1Gi from the daemon, round trip", measure(limited, args.calls // 20, 0.11)),
        ]
    finally:
        d.stop()
    print(f"machine: {machine()}")
    print("| | cuMemGetInfo (median µs) | nvmlDeviceGetMemoryInfo (median µs) | total shown |")
    print("|---|---:|---:|---:|")
    for label, r in rows:
        print(
            f"| {label} | {r['cuMemGetInfo']:.1f} | {r['nvmlDeviceGetMemoryInfo']:.1f} "
            f"| {r['total']} |"
        )


if __name__ == "__main__":
    main()
