"""A PyTorch process driven by tests/gpu/gpu_checks.py, run under libnvshare.so.

torch_worker.py serve          read commands on stdin, answer one JSON line each:
                               info | alloc BYTES | hold BYTES | release | nvml |
                               ismanaged BYTES | exit
torch_worker.py burn S OUT [D [HOLD]]
                               matmul bursts for S seconds on device D (default cuda), holding
                               HOLD bytes of GPU memory; writes [t0, t1] busy intervals
torch_worker.py work N         N fixed matmul steps; prints the wall time they took
torch_worker.py rate S         matmuls completed in S seconds of wall time
torch_worker.py graphs S       S seconds of torch.cuda.graph captures (a fresh graph each time,
                               replayed once); prints captures and failures
torch_worker.py compiled S     torch.compile(mode="reduce-overhead") on three batch sizes (its
                               CUDA graphs), then S seconds of calls; prints calls and failures
torch_worker.py overhead       what NVML shows this process holding with no tensor allocated
torch_worker.py quota loop|graph S
                               compute-bound matmuls for S seconds once told "go" on stdin
                               (after "ready"): `loop` 5 matmuls per synchronise, `graph` a
                               captured CUDA graph of 10 replayed twice per synchronise; then
                               "batch START END" per synchronise (CLOCK_MONOTONIC seconds)
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
                device_total = torch.cuda.get_device_properties(0).total_memory
                out = {"free": free, "total": total, "device_total": device_total}
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


def small_model() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024)
    ).cuda()


def report(kind: str, count: int, failures: list[str], **extra: float) -> None:
    print(
        json.dumps({kind: count, "failures": len(failures), "first_error": failures[:1], **extra}),
        flush=True,
    )


def graphs(seconds: float) -> None:
    """Repeated captures, as vLLM does at start-up: any failure counts (none is expected)."""
    model = small_model()
    x = torch.randn(64, 1024, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up outside the capture, as torch.cuda.graph asks
        for _ in range(3):
            model(x)
    torch.cuda.current_stream().wait_stream(side)
    captures, failures = 0, []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                y = model(x)
            g.replay()
            torch.cuda.synchronize()
            assert torch.isfinite(y).all()
            del g
        except Exception as exc:  # counted, and the loop goes on
            failures.append(f"{type(exc).__name__}: {exc}"[:300])
        captures += 1
    report("captures", captures, failures)


def compiled(seconds: float) -> None:
    t0 = time.monotonic()
    model = torch.compile(small_model(), mode="reduce-overhead")
    inputs = [torch.randn(n, 1024, device="cuda") for n in (16, 64, 256)]
    calls, failures = 0, []
    with torch.no_grad():
        for x in inputs:  # compile and record each shape's CUDA graph
            for _ in range(3):
                model(x)
        torch.cuda.synchronize()
        compile_s = time.monotonic() - t0
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            for x in inputs:
                try:
                    y = model(x)
                    torch.cuda.synchronize()
                    assert torch.isfinite(y).all()
                except Exception as exc:
                    failures.append(f"{type(exc).__name__}: {exc}"[:300])
                calls += 1
    report("calls", calls, failures, compile_seconds=compile_s)


def overhead() -> None:
    import os

    import pynvml

    torch.cuda.init()
    torch.empty(1, device="cuda")  # the context and the allocator exist; 2 MiB is charged
    torch.cuda.synchronize()
    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    used = [
        p.usedGpuMemory
        for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
        if p.pid == os.getpid()
    ]
    print(json.dumps({"nvml_used": used[0] if used else None, "charged": 2 << 20}), flush=True)


def quota(kind: str, seconds: float) -> None:
    """The quota benchmark's PyTorch work (bench/quota_accuracy_gpu.py)."""
    a = torch.randn(4096, 4096, device="cuda")
    b = torch.randn(4096, 4096, device="cuda") / 64

    def step(n: int) -> None:
        for _ in range(n):
            a.copy_(torch.tanh(a @ b))

    step(5)
    graph = torch.cuda.CUDAGraph()
    if kind == "graph":
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm up outside the capture, as torch.cuda.graph asks
            step(3)
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(graph):
            step(10)
        graph.replay()
    torch.cuda.synchronize()
    print("ready", flush=True)
    sys.stdin.readline()
    batches = []
    stop = time.monotonic() + seconds
    while time.monotonic() < stop:
        t0 = time.monotonic()
        if kind == "graph":
            graph.replay()
            graph.replay()
        else:
            step(5)
        torch.cuda.synchronize()
        batches.append((t0, time.monotonic()))
    print("".join(f"batch {t0:.6f} {t1:.6f}\n" for t0, t1 in batches), end="", flush=True)


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
    elif mode == "graphs":
        graphs(float(sys.argv[2]))
    elif mode == "compiled":
        compiled(float(sys.argv[2]))
    elif mode == "overhead":
        overhead()
    elif mode == "quota":
        quota(sys.argv[2], float(sys.argv[3]))
    else:
        sys.exit(f"unknown mode {mode}")
