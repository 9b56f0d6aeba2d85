"""Memory limits as a program sees them: every allocation path, the boundary byte, rollback,
what cuMemGetInfo / cuDeviceTotalMem / NVML report, and O(1) frees with many live allocations.
No daemon here: the limit comes from NVSHARE_GPU_MEMORY_LIMIT."""

from __future__ import annotations

import pytest

from .conftest import Variant, assert_clean

MiB = 1 << 20
OOM = "err 2"

# Allocation commands that each charge exactly 8 MiB (at 2 MiB granularity).
EXACT_8MIB = {
    "mem": "alloc mem 8388608",
    "mem_rounded": "alloc mem 6291457",  # 6 MiB + 1 byte rounds up to 8 MiB
    "pitch": "alloc pitch 2048 4096",  # pitch 2048 x 4096 rows
    "managed": "alloc managed 8388608",
    "async": "alloc async 8388608",
    "pool": "alloc pool 8388608",
    "vmm": "alloc vmm 8388608",
    "array": "alloc array 1024 2048 32 1",  # float, 1 channel
    "array3d": "alloc array3d 1024 1024 2 32 1",
    "mipmap": "alloc mipmap 1024 1024 0 32 2 1",  # one level, 2 channels
}


@pytest.mark.parametrize("mode", ["run", "--gpa", "--gpa-ptds"])
@pytest.mark.parametrize("kind", sorted(EXACT_8MIB))
def test_limit_is_reached_exactly_and_one_granule_more_is_refused(
    plain: Variant, start_probe, sock_dir: str, kind: str, mode: str
) -> None:
    env = plain.env(NVSHARE_GPU_MEMORY_LIMIT="8Mi", NVSHARE_SOCKET_DIR=sock_dir)
    p = start_probe(plain, env, *(["run"] if mode == "run" else ["run", mode]))
    p.ok("init")
    first = p.ok(EXACT_8MIB[kind]).split()[1]
    assert p.do("alloc mem 1") == OOM
    assert p.do(EXACT_8MIB[kind]) == OOM
    p.ok(f"free {first}")
    # the free gave the whole charge back
    again = p.ok(EXACT_8MIB[kind]).split()[1]
    p.ok(f"free {again}")
    assert p.do("alloc mem 8388609") == OOM  # a single allocation one byte over
    assert_clean(*p.finish())


def test_host_allocations_are_not_device_memory(plain: Variant, start_probe, sock_dir: str) -> None:
    p = start_probe(plain, plain.env(NVSHARE_GPU_MEMORY_LIMIT="8Mi", NVSHARE_SOCKET_DIR=sock_dir))
    p.ok("init")
    p.ok("alloc host 67108864")
    p.ok("alloc mem 8388608")
    assert_clean(*p.finish())


def test_a_failed_driver_call_rolls_the_charge_back(
    plain: Variant, start_probe, sock_dir: str
) -> None:
    env = plain.env(
        NVSHARE_GPU_MEMORY_LIMIT="8Mi",
        NVSHARE_SOCKET_DIR=sock_dir,
        NVSHARE_FAKE_FAIL_ALLOC_SIZE=str(4 * MiB),
    )
    p = start_probe(plain, env)
    p.ok("init")
    assert p.do("alloc mem 4194304") == "err 999"  # the driver's own error passes through
    assert p.do("alloc vmm 4194304") == "err 999"
    p.ok("alloc mem 8388608")  # nothing of the failed calls stayed charged
    assert_clean(*p.finish())


def test_real_driver_out_of_memory_passes_through(
    plain: Variant, start_probe, sock_dir: str
) -> None:
    env = plain.env(NVSHARE_FAKE_GPU_MEM=str(16 * MiB), NVSHARE_SOCKET_DIR=sock_dir)
    p = start_probe(plain, env)
    p.ok("init")
    p.ok("alloc mem 16777216")
    assert p.do("alloc mem 1") == OOM
    assert_clean(*p.finish())


def test_memory_queries_report_the_limit(plain: Variant, start_probe, sock_dir: str) -> None:
    env = plain.env(NVSHARE_GPU_MEMORY_LIMIT="8Mi", NVSHARE_SOCKET_DIR=sock_dir)
    p = start_probe(plain, env)
    p.ok("init")
    assert p.do("info") == f"ok {8 * MiB} {8 * MiB}"
    assert p.do("total") == f"ok {8 * MiB}"
    p.ok("alloc mem 3145728")  # charged 4 MiB
    assert p.do("info") == f"ok {4 * MiB} {8 * MiB}"
    assert p.do("nvml") == f"ok {4 * MiB} {8 * MiB} {4 * MiB}"
    assert_clean(*p.finish())


def test_without_a_limit_queries_pass_through(plain: Variant, start_probe, sock_dir: str) -> None:
    env = plain.env(NVSHARE_FAKE_GPU_MEM=str(64 * MiB), NVSHARE_SOCKET_DIR=sock_dir)
    p = start_probe(plain, env)
    p.ok("init")
    p.ok("alloc mem 1")
    assert p.do("info") == f"ok {62 * MiB} {64 * MiB}"
    assert p.do("total") == f"ok {64 * MiB}"
    assert p.do("nvml") == f"ok {64 * MiB} {64 * MiB} 0"  # fake NVML, untouched
    assert_clean(*p.finish())


def test_thousands_of_live_allocations_free_by_handle(
    variant: Variant, start_probe, sock_dir: str
) -> None:
    env = variant.env(NVSHARE_GPU_MEMORY_LIMIT="20000Mi", NVSHARE_SOCKET_DIR=sock_dir)
    p = start_probe(variant, env)
    p.ok("init")
    p.ok("many 8000 1")  # 8000 live allocations of one granule each, then all freed
    assert p.do("info") == f"ok {20000 * MiB} {20000 * MiB}"
    p.ok("many 3000 4194304")
    assert p.do("info") == f"ok {20000 * MiB} {20000 * MiB}"
    assert_clean(*p.finish())


@pytest.mark.parametrize("kind", ["mem", "pitch", "vmm", "array3d", "mipmap"])
def test_boundary_under_sanitizers(variant: Variant, start_probe, sock_dir: str, kind: str) -> None:
    env = variant.env(NVSHARE_GPU_MEMORY_LIMIT="8Mi", NVSHARE_SOCKET_DIR=sock_dir)
    p = start_probe(variant, env)
    p.ok("init")
    first = p.ok(EXACT_8MIB[kind]).split()[1]
    assert p.do("alloc mem 1") == OOM
    p.ok(f"free {first}")
    p.ok(EXACT_8MIB[kind])
    assert_clean(*p.finish())


def test_a_mistyped_env_limit_refuses_cuda_instead_of_running_unlimited(
    plain: Variant, start_probe, sock_dir: str
) -> None:
    """It used to be one stderr line and then no limit of the program's own at all."""
    env = plain.env(NVSHARE_GPU_MEMORY_LIMIT="lots", NVSHARE_SOCKET_DIR=sock_dir)
    p = start_probe(plain, env)
    assert p.do("init") == "err 1"  # CUDA_ERROR_INVALID_VALUE
    assert p.do("init") == "err 1"  # every time, said once
    rc, err = p.finish()
    assert_clean(rc, err)
    [line] = [x for x in err.splitlines() if "NVSHARE_GPU_MEMORY_LIMIT" in x]
    assert "NVSHARE_GPU_MEMORY_LIMIT=lots is not a byte quantity: a number with Ki, Mi" in line
    assert "(4Gi, 512Mi, 1.5G; a bare number is MiB)" in line
    assert "CUDA is not started (cuInit fails with CUDA_ERROR_INVALID_VALUE)" in line
