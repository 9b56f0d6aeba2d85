"""A PyTorch process driven by tests/gpu/gpu_checks.py, run under libnvshare.so.

torch_worker.py serve          read commands on stdin, answer one JSON line each:
                               info | alloc BYTES | hold BYTES | release | nvml |
                               ismanaged BYTES | exit
torch_worker.py burn S OUT [D [HOLD]]
                               matmul bursts for S seconds on device D (default cuda), holding
                               HOLD bytes of GPU memory; writes [t0, t1] busy intervals
torch_worker.py work N         N fixed matmul steps; prints the wall time they took
torch_worker.py rate S         matmuls completed in S seconds of wall time
"""

from __future__ import annotations

import ctypes
import json
import sys
import time

import torch


def serve() -> None:
    held: list[torch.Tensor] = []
    torch.cuda.init()
    for line in sys.stdin:
        cmd, *args = line.split()
        try:
            if cmd == "info":
                free, total = torch.cuda.mem_get_info()
                out = {"free": free, "total": total}
            elif cmd in ("alloc", "hold"):
                n = int(args[0])
                try:
                    t = torch.empty(n, dtype=torch.uint8, device="cuda")
                    t.fill_(1)
                    torch.cuda.synchronize()
                    if cmd == "hold":
                        held.append(t)
                    del t
                    out = {"result": "ok"}
                except torch.cuda.OutOfMemoryError as exc:
                    out = {"result": "oom", "error": str(exc).splitlines()[0][:200]}
                torch.cuda.empty_cache()  # give freed blocks back, so the hook sees the free
            elif cmd == "nvml":  # NVML as this (hooked) process sees it
                import pynvml

                pynvml.nvmlInit()
                mem = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0))
                out = {"total": int(mem.total), "used": int(mem.used), "free": int(mem.free)}
            elif cmd == "ismanaged":  # is a fresh tensor's memory managed (unified) memory?
                t = torch.empty(int(args[0]), dtype=torch.uint8, device="cuda")
                value = ctypes.c_int(0)
                rc = ctypes.CDLL("libcuda.so.1").cuPointerGetAttribute(
                    ctypes.byref(value),
                    8,
                    ctypes.c_uint64(t.data_ptr()),  # IS_MANAGED
                )
                out = {"result": "ok" if rc == 0 else f"error {rc}", "managed": bool(value.value)}
                del t
                torch.cuda.empty_cache()
            elif cmd == "release":
                held.clear()
                torch.cuda.empty_cache()
                out = {"result": "ok"}
            elif cmd == "exit":
                print(json.dumps({"result": "bye"}), flush=True)
                return
            else:
                out = {"error": f"unknown command {cmd}"}
        except Exception as exc:  # report, keep serving
            out = {"result": "error", "error": f"{type(exc).__name__}: {exc}"[:300]}
        print(json.dumps(out), flush=True)


def burn(seconds: float, out_path: str, device: str = "cuda", hold: str = "0") -> None:
    kept = torch.empty(int(hold), dtype=torch.uint8, device=device)  # memory held throughout
    a = torch.randn(4096, 4096, device=device)
    b = torch.randn(4096, 4096, device=device)
    torch.cuda.synchronize()
    intervals = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        c = a @ b  # the launch returns once this process holds the lock
        t0 = time.monotonic()
        for _ in range(20):
            c = c @ b
        torch.cuda.synchronize(device)
        intervals.append((t0, time.monotonic()))
        c = c / c.norm()
    del kept
    with open(out_path, "w") as f:
        json.dump(intervals, f)


def rate(seconds: float) -> None:
    """How many 4096x4096 fp32 matmuls this process completes in `seconds` of wall time."""
    a = torch.randn(4096, 4096, device="cuda")
    b = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()
    done = 0
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        for _ in range(5):
            a = torch.tanh(a @ b)
        torch.cuda.synchronize()
        done += 5
    print(json.dumps({"matmuls": done, "seconds": time.monotonic() - start}), flush=True)


def work(steps: int) -> None:
    begin = time.monotonic()  # CLOCK_MONOTONIC: comparable across processes
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    t0 = time.monotonic()
    for _ in range(steps):
        a = (a @ b) * 1e-2
    torch.cuda.synchronize()
    end = time.monotonic()
    print(json.dumps({"seconds": end - t0, "begin": begin, "end": end}), flush=True)


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "serve":
        serve()
    elif mode == "burn":
        burn(float(sys.argv[2]), sys.argv[3], *sys.argv[4:6])
    elif mode == "work":
        work(int(sys.argv[2]))
    elif mode == "rate":
        rate(float(sys.argv[2]))
    else:
        sys.exit(f"unknown mode {mode}")
