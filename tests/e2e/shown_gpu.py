"""How GPU 0 looks to this process, as one JSON line on stdout: NVML through the real pynvml
(memory info v1 and v2, the compute process lists v1/v2/v3, the graphics list) and, with
--cuda BYTES, the CUDA driver too (cuInit, BYTES allocated, cuMemGetInfo, cuDeviceTotalMem).
With --hold it then waits for a line on stdin before exiting, so that other processes can look
at the GPU while this one holds its memory. Run under the hook by the end-to-end tests (fake
driver and NVML) and by tests/gpu (the real ones)."""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
from typing import Any

import pynvml


def processes_v1(handle: Any) -> list[list[int]]:
    """nvmlDeviceGetComputeRunningProcesses (v1, 16-byte entries): pynvml only calls v3."""

    class Info(ctypes.Structure):
        _fields_ = [("pid", ctypes.c_uint), ("usedGpuMemory", ctypes.c_ulonglong)]

    fn = pynvml._nvmlGetFunctionPointer("nvmlDeviceGetComputeRunningProcesses")
    count = ctypes.c_uint(0)
    infos = (Info * 64)()
    count.value = 64
    pynvml._nvmlCheckReturn(fn(handle, ctypes.byref(count), infos))
    return [[infos[i].pid, infos[i].usedGpuMemory] for i in range(count.value)]


def nvml() -> dict[str, Any]:
    pynvml.nvmlInit()
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    v1 = pynvml.nvmlDeviceGetMemoryInfo(h)
    v2 = pynvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2)
    return {
        "v1": [v1.total, v1.used, v1.free],
        "v2": [v2.total, v2.used, v2.free, v2.reserved],
        "compute_v3": [
            [p.pid, p.usedGpuMemory] for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h)
        ],
        "compute_v2": [
            [p.pid, p.usedGpuMemory] for p in pynvml.nvmlDeviceGetComputeRunningProcesses_v2(h)
        ],
        "compute_v1": processes_v1(h),
        "graphics": [
            [p.pid, p.usedGpuMemory] for p in pynvml.nvmlDeviceGetGraphicsRunningProcesses(h)
        ],
    }


def cuda(nbytes: int) -> dict[str, Any]:
    lib = ctypes.CDLL("libcuda.so.1")

    def call(name: str, *args: Any) -> None:
        rc = getattr(lib, name)(*args)
        if rc != 0:
            raise RuntimeError(f"{name} failed: {rc}")

    ctx, ptr = ctypes.c_void_p(), ctypes.c_uint64()
    free, total, device_total = ctypes.c_size_t(), ctypes.c_size_t(), ctypes.c_size_t()
    call("cuInit", 0)
    call("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), 0)
    call("cuCtxSetCurrent", ctx)
    call("cuMemAlloc_v2", ctypes.byref(ptr), ctypes.c_size_t(nbytes))
    call("cuMemGetInfo_v2", ctypes.byref(free), ctypes.byref(total))
    call("cuDeviceTotalMem_v2", ctypes.byref(device_total), 0)
    return {"mem_get_info": [free.value, total.value], "device_total": device_total.value}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cuda", type=int, metavar="BYTES")
    parser.add_argument("--hold", action="store_true")
    args = parser.parse_args()
    shown: dict[str, Any] = {}
    if args.cuda is not None:
        shown |= cuda(args.cuda)
    shown |= nvml()
    print(json.dumps(shown), flush=True)
    if args.hold:
        sys.stdin.readline()


if __name__ == "__main__":
    main()
