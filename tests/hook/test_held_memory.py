"""Memory that is held is memory that is counted, against the fake driver: VMM handles released
while still mapped (the CUDA samples' and NCCL's pattern), a pool that keeps freed memory cached
(RMM's and TensorRT's release threshold), graph memory charged when the graph reserves it and not
at capture, contexts destroyed and devices reset giving their memory back, allocations charged to
the GPU of their stream, and memory NVML shows that never passed an allocation call."""

from __future__ import annotations

import struct

import pytest

from appliance.wire.protocol import MsgType

from . import fake_scheduler as fs
from .conftest import Variant, assert_clean

MiB = 1 << 20
OOM = "err 2"
CAPTURE_RELAXED = 2


def start(variant: Variant, start_probe, sock_dir: str, limit: str = "64Mi", **env: str):  # type: ignore[no-untyped-def]
    p = start_probe(
        variant, variant.env(NVSHARE_GPU_MEMORY_LIMIT=limit, NVSHARE_SOCKET_DIR=sock_dir, **env)
    )
    p.ok("init")
    return p


def free_bytes(p) -> int:  # type: ignore[no-untyped-def]
    return int(p.ok("info").split()[1])


def test_vmm_memory_stays_charged_until_the_last_mapping_is_gone(
    variant: Variant, start_probe, sock_dir: str
) -> None:
    p = start(variant, start_probe, sock_dir)
    handles = [p.ok(f"alloc vmm {16 * MiB}").split()[1] for _ in range(4)]
    maps = [p.ok(f"map {h}").split()[1] for h in handles]
    for h in handles:
        p.ok(f"free {h}")  # cuMemRelease while mapped: the memory is still in use
    assert p.do("alloc mem 2097152") == OOM
    assert free_bytes(p) == 0
    retained = p.ok(f"retain {maps[0]}").split()[1]  # a second reference to handle 0
    p.ok(f"unmap {maps[0]}")
    assert free_bytes(p) == 0  # the retained reference still holds it
    p.ok(f"free {retained}")
    assert free_bytes(p) == 16 * MiB
    for m in maps[1:]:
        p.ok(f"unmap {m}")
    assert free_bytes(p) == 64 * MiB
    p.ok(f"alloc mem {64 * MiB}")
    assert_clean(*p.finish())


def test_a_pool_that_keeps_freed_memory_is_charged_for_it(
    variant: Variant, start_probe, sock_dir: str
) -> None:
    p = start(variant, start_probe, sock_dir)
    pool = p.ok("pool_create 0").split()[1]
    p.ok(f"pool_threshold {pool} -1")  # release threshold max: never give memory back
    ptr = p.ok(f"alloc_pool {pool} 0 {48 * MiB}").split()[1]
    p.ok(f"free_async {ptr} 0")
    p.ok("sync")
    assert free_bytes(p) == 16 * MiB  # 48 MiB still reserved by the pool
    assert p.do(f"alloc mem {32 * MiB}") == OOM
    again = p.ok(f"alloc_pool {pool} 0 {48 * MiB}").split()[1]  # served from the cache
    p.ok(f"free_async {again} 0")
    p.ok(f"pool_trim {pool} 0")
    assert free_bytes(p) == 64 * MiB
    p.ok(f"alloc mem {32 * MiB}")
    assert_clean(*p.finish())


def test_the_default_pool_gives_back_at_synchronisation_and_the_charge_follows(
    plain: Variant, start_probe, sock_dir: str
) -> None:
    p = start(plain, start_probe, sock_dir)
    ptr = p.ok(f"alloc async {48 * MiB}").split()[1]
    assert p.do(f"alloc mem {32 * MiB}") == OOM
    p.ok(f"free {ptr}")  # cuMemFreeAsync: back in the pool, still reserved ...
    p.ok("sync")  # ... until a synchronisation releases it (release threshold 0)
    p.ok(f"alloc mem {32 * MiB}")  # settled before refusing, not after a tick
    assert_clean(*p.finish())


def test_graph_memory_counts_when_the_graph_reserves_it_not_at_capture(
    variant: Variant, start_probe, sock_dir: str
) -> None:
    p = start(variant, start_probe, sock_dir)
    p.ok(f"alloc mem {8 * MiB}")
    s = p.ok("stream 0").split()[1]
    p.ok(f"capture_begin {s} {CAPTURE_RELAXED}")
    p.ok(f"capture_alloc {s} {48 * MiB}")  # a memory node: nothing reserved yet
    assert free_bytes(p) == 56 * MiB
    graph = p.ok(f"capture_end {s}").split()[1]
    exe = p.ok(f"instantiate {graph}").split()[1]
    assert free_bytes(p) == 56 * MiB
    p.ok(f"graph_upload {exe} {s}")  # now the driver reserves the graph's memory
    assert free_bytes(p) == 8 * MiB
    assert p.do(f"alloc mem {16 * MiB}") == OOM
    p.ok(f"graph_launch {exe} {s}")
    p.ok(f"exec_destroy {exe}")
    p.ok("graph_trim 0")  # the graph pool gives its memory back
    p.ok(f"alloc mem {16 * MiB}")
    assert_clean(*p.finish())


@pytest.mark.parametrize("teardown", ["ctx_destroy", "reset"])
def test_context_teardown_and_device_reset_give_memory_back(
    variant: Variant, start_probe, sock_dir: str, teardown: str
) -> None:
    p = start(variant, start_probe, sock_dir)
    for _ in range(3):  # without the uncharge the second round is refused
        if teardown == "ctx_destroy":
            ctx = p.ok("ctx_create 0").split()[1]
            p.ok(f"alloc mem {48 * MiB}")
            p.ok(f"ctx_destroy {ctx}")
            p.ok("primary 0")
        else:
            p.ok("primary 0")
            p.ok(f"alloc mem {48 * MiB}")
            p.ok("alloc array 1024 2048 32 1")
            p.ok("reset 0")  # what cudaDeviceReset does
            p.ok("primary 0")
        assert free_bytes(p) == 64 * MiB
    assert_clean(*p.finish())


def test_allocations_are_charged_to_the_gpu_of_their_stream(
    variant: Variant, start_probe, sock_dir: str
) -> None:
    p = start(variant, start_probe, sock_dir, limit="8Mi", NVSHARE_FAKE_GPU_COUNT="2")
    gpu1 = p.ok("stream 1").split()[1]  # the current context stays on GPU 0
    p.ok(f"alloc_async {gpu1} {6 * MiB}")
    p.ok(f"alloc mem {6 * MiB}")  # GPU 0 still has its 8 MiB
    assert p.do(f"alloc_async {gpu1} {6 * MiB}") == OOM  # GPU 1 does not
    pool1 = p.ok("pool_create 1").split()[1]
    assert p.do(f"alloc_pool {pool1} 0 {4 * MiB}") == OOM  # a GPU 1 pool, on GPU 0's stream
    assert_clean(*p.finish())


def test_memory_nvml_shows_beyond_the_ledger_refuses_allocations_while_over(
    plain: Variant, start_probe, sock_dir: str
) -> None:
    with fs.FakeScheduler(sock_dir, limits=fs.limits(mem_limit=64 * MiB)) as sched:
        p = start_probe(plain, plain.env(NVSHARE_SOCKET_DIR=sock_dir))
        p.ok("init")
        p.ok(f"alloc mem {8 * MiB}")
        allowance = 500 * MiB

        def observed(nvml_used: int) -> None:
            sched.send_raw(MsgType.MEM_OBSERVED, struct.pack("<QQ", nvml_used, allowance))

        # NVML: the context, the 8 MiB, and 62 MiB of module globals and heaps the hook never saw
        observed(allowance + 70 * MiB)
        p.eventually("info", f"ok 0 {64 * MiB}")  # 70 MiB held: over the 64 MiB limit
        assert p.do("alloc mem 2097152") == OOM
        observed(allowance + 8 * MiB)  # those are gone again
        p.eventually(f"alloc mem {32 * MiB}", "ok")
        assert_clean(*p.finish())
