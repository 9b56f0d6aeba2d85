"""One dispatch table answers every way a program finds a driver function: symbol interposition,
dlsym and cuGetProcAddress_v2 (as CUDA 12+ runtimes do), including _v2 and per-thread variants;
everything else passes through to the driver. Only the interposed symbols are exported."""

from __future__ import annotations

import re
import subprocess

from .conftest import Variant, assert_clean


def test_dlsym_answers_with_the_hook_for_interposed_names_only(variant: Variant) -> None:
    out = _symbols(variant)
    owners = dict(re.findall(r"^dlsym (\S+) (\S+)$", out, re.M))
    hooked = [
        "cuInit",
        "cuLaunchKernel",
        "cuLaunchKernel_ptsz",
        "cuMemAlloc_v2",
        "cuMemcpyHtoD_v2",
        "cuMemcpyHtoD_v2_ptds",
        "cuMemsetD8Async_ptsz",
        "cuGraphLaunch",
        "cuMemGetInfo_v2",
        "cuGetProcAddress_v2",
        "cuGraphInstantiate_v2",
        "cuGraphInstantiateWithParams_ptsz",
    ]
    assert {n: owners[n] for n in hooked} == dict.fromkeys(hooked, "libnvshare.so")
    passed = ["cuCtxGetDevice", "cuDeviceGetCount", "cuStreamCreate", "cuMemHostAlloc"]
    assert {n: owners[n] for n in passed} == dict.fromkeys(passed, "libcuda.so.1")


def _symbols(variant: Variant) -> str:
    out = subprocess.run(
        [str(variant.probe), "symbols"], env=variant.env(), capture_output=True, text=True
    )
    assert_clean(out.returncode, out.stderr)
    return out.stdout


def test_cu_get_proc_address_v2_honours_per_thread_flags(variant: Variant) -> None:
    rows = re.findall(r"^gpa (\S+) (\d) (\S+) (\S+)$", _symbols(variant), re.M)
    got = {(name, int(flags)): (lib, sym) for name, flags, lib, sym in rows}
    hook = "libnvshare.so"
    assert got[("cuLaunchKernel", 0)] == (hook, "cuLaunchKernel")
    assert got[("cuLaunchKernel", 2)] == (hook, "cuLaunchKernel_ptsz")
    assert got[("cuMemcpyHtoD", 0)] == (hook, "cuMemcpyHtoD_v2")
    assert got[("cuMemcpyHtoD", 2)] == (hook, "cuMemcpyHtoD_v2_ptds")
    assert got[("cuMemsetD8Async", 2)] == (hook, "cuMemsetD8Async_ptsz")
    assert got[("cuGraphLaunch", 2)] == (hook, "cuGraphLaunch_ptsz")
    assert got[("cuMemFreeAsync", 2)] == (hook, "cuMemFreeAsync_ptsz")
    assert got[("cuMemAlloc", 0)] == got[("cuMemAlloc", 2)] == (hook, "cuMemAlloc_v2")
    assert got[("cuMemGetInfo", 0)] == (hook, "cuMemGetInfo_v2")
    assert got[("cuGetProcAddress", 0)] == (hook, "cuGetProcAddress_v2")
    assert got[("cuInit", 0)] == (hook, "cuInit")
    # from CUDA 12.0 the name means cuGraphInstantiateWithFlags, another signature
    assert got[("cuGraphInstantiate", 0)] == (hook, "cuGraphInstantiateWithFlags")
    for name in ("cuCtxGetDevice", "cuStreamCreate"):
        assert got[(name, 0)] == got[(name, 2)] == ("libcuda.so.1", name)


def test_only_interposed_symbols_are_exported(plain: Variant) -> None:
    nm = subprocess.run(
        ["nm", "-D", "--defined-only", str(plain.build / "libnvshare.so")],
        capture_output=True,
        text=True,
        check=True,
    )
    exported = {line.split()[-1] for line in nm.stdout.splitlines() if line.strip()}
    listed = set(re.findall(r"(\w+);", (plain.build / "libnvshare.map").read_text()))
    assert exported == listed - {"local"}
    assert {"dlsym", "cuInit", "cuLaunchKernel", "nvmlDeviceGetMemoryInfo"} <= exported
    assert not any(name.startswith("nvs_") for name in exported)


def test_shipped_build_is_optimised_and_needs_no_cuda_library(plain: Variant) -> None:
    needed = subprocess.run(
        ["readelf", "-d", str(plain.build / "libnvshare.so")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    libs = set(re.findall(r"Shared library: \[(.+?)\]", needed))
    assert not any("cuda" in lib or "nvidia" in lib for lib in libs), libs
