"""Graph memory stays inside the limit before the driver reserves it, against the fake driver:
a graph's allocation nodes (a captured cudaMallocAsync, or cuGraphAddMemAllocNode) are read when
it is instantiated, and an instantiation, upload or launch whose memory does not fit is refused
with CUDA_ERROR_OUT_OF_MEMORY without reaching the driver (the graph pool reserves nothing). What
the pool keeps reserved stays charged across launches, is charged once however often the graph
runs, and goes back when the pool is trimmed; a trimmed graph is checked again when it runs."""

from __future__ import annotations

from appliance.wire.protocol import MsgType

from . import fake_scheduler as fs
from .conftest import Variant, assert_clean

MiB = 1 << 20
GiB = 1 << 30
OOM = "err 2"
CAPTURE_GLOBAL = 0
CAPTURE_RELAXED = 2


def start(variant: Variant, start_probe, sock_dir: str, limit: str = "1Gi", **env: str):  # type: ignore[no-untyped-def]
    p = start_probe(
        variant, variant.env(NVSHARE_GPU_MEMORY_LIMIT=limit, NVSHARE_SOCKET_DIR=sock_dir, **env)
    )
    p.ok("init")
    return p


def free_bytes(p) -> int:  # type: ignore[no-untyped-def]
    return int(p.ok("info").split()[1])


def graph_pool(p, device: int = 0) -> tuple[int, int]:  # type: ignore[no-untyped-def]
    """The driver's own figures for the device's graph pool: (used, reserved)."""
    used, reserved = p.ok(f"graph_mem {device}").split()[1:]
    return int(used), int(reserved)


def captured(p, s: str, nbytes: int) -> str:  # type: ignore[no-untyped-def]
    """A graph captured from a stream: cudaMallocAsync(nbytes), a kernel, cudaFreeAsync."""
    p.ok(f"capture_begin {s} {CAPTURE_RELAXED}")
    p.ok(f"capture_alloc {s} {nbytes}")
    return p.ok(f"capture_end {s}").split()[1]


def test_a_2gib_graph_allocation_under_a_1gib_limit_is_refused_and_nothing_is_reserved(
    variant: Variant, start_probe, sock_dir: str
) -> None:
    p = start(variant, start_probe, sock_dir)
    s = p.ok("stream 0").split()[1]
    graph = captured(p, s, 2 * GiB)  # capturing takes nothing, so it is not refused
    assert p.do(f"instantiate {graph}") == OOM
    assert p.do(f"instantiate_upload {graph} {s}") == OOM
    assert graph_pool(p) == (0, 0)  # the driver never reserved the 2 GiB
    assert free_bytes(p) == GiB
    built = p.ok("graph_create").split()[1]  # the same through cuGraphAddMemAllocNode
    p.ok(f"graph_alloc {built} 0 {2 * GiB}")
    assert p.do(f"instantiate_v2 {built}") == OOM
    assert graph_pool(p) == (0, 0)
    assert "graph memory of 2048 MiB on GPU 0 refused" in p.stderr()
    assert_clean(*p.finish())


def test_a_launch_whose_graph_memory_no_longer_fits_is_refused_before_the_driver_reserves_it(
    variant: Variant, start_probe, sock_dir: str
) -> None:
    p = start(variant, start_probe, sock_dir)
    s = p.ok("stream 0").split()[1]
    exe = p.ok(f"instantiate {captured(p, s, 512 * MiB)}").split()[1]  # fits: nothing reserved yet
    ptr = p.ok(f"alloc mem {768 * MiB}").split()[1]  # now it does not
    assert p.do(f"graph_upload {exe} {s}") == OOM
    assert p.do(f"graph_launch {exe} {s}") == OOM
    assert graph_pool(p) == (0, 0)
    p.ok(f"free {ptr}")
    p.ok(f"graph_launch {exe} {s}")
    assert graph_pool(p) == (512 * MiB, 512 * MiB)
    assert free_bytes(p) == 512 * MiB
    assert_clean(*p.finish())


def test_a_512mib_graph_is_admitted_and_charged_once_however_often_it_runs(
    variant: Variant, start_probe, sock_dir: str
) -> None:
    p = start(variant, start_probe, sock_dir)
    s = p.ok("stream 0").split()[1]
    exe = p.ok(f"instantiate {captured(p, s, 512 * MiB)}").split()[1]
    p.ok(f"graph_upload {exe} {s}")
    for _ in range(3):
        p.ok(f"graph_launch {exe} {s}")
    assert free_bytes(p) == 512 * MiB
    assert p.do(f"alloc mem {514 * MiB}") == OOM  # the graph's 512 MiB stay counted
    p.ok(f"alloc mem {512 * MiB}")  # and counted once
    assert_clean(*p.finish())


def test_graph_memory_goes_back_on_trim_and_a_trimmed_graph_is_checked_again(
    variant: Variant, start_probe, sock_dir: str
) -> None:
    p = start(variant, start_probe, sock_dir)
    s = p.ok("stream 0").split()[1]
    exe = p.ok(f"instantiate {captured(p, s, 512 * MiB)}").split()[1]
    p.ok(f"graph_launch {exe} {s}")
    p.ok("graph_trim 0")  # the graph is idle: the driver unmaps and releases its memory
    assert graph_pool(p) == (0, 0)
    assert free_bytes(p) == GiB
    ptr = p.ok(f"alloc mem {768 * MiB}").split()[1]
    assert p.do(f"graph_launch {exe} {s}") == OOM  # it would have to reserve 512 MiB again
    assert graph_pool(p) == (0, 0)
    p.ok(f"free {ptr}")
    p.ok(f"graph_launch {exe} {s}")
    assert free_bytes(p) == 512 * MiB
    assert_clean(*p.finish())


def test_a_destroyed_graph_keeps_its_memory_in_the_pool_until_trimmed(
    variant: Variant, start_probe, sock_dir: str
) -> None:
    p = start(variant, start_probe, sock_dir)
    s = p.ok("stream 0").split()[1]
    first = p.ok(f"instantiate {captured(p, s, 512 * MiB)}").split()[1]
    p.ok(f"graph_launch {first} {s}")
    p.ok(f"exec_destroy {first}")
    assert graph_pool(p) == (0, 512 * MiB)  # back in the graph pool, still reserved
    assert free_bytes(p) == 512 * MiB
    p.ok(f"alloc mem {512 * MiB}")
    # another graph of the same size is served from the pool's reserve: it fits
    second = p.ok(f"instantiate {captured(p, s, 512 * MiB)}").split()[1]
    p.ok(f"graph_launch {second} {s}")
    assert free_bytes(p) == 0
    p.ok(f"exec_destroy {second}")
    p.ok("graph_trim 0")
    assert free_bytes(p) == 512 * MiB
    assert_clean(*p.finish())


def test_an_instantiation_that_uploads_is_charged_when_it_reserves(
    variant: Variant, start_probe, sock_dir: str
) -> None:
    p = start(variant, start_probe, sock_dir)
    s = p.ok("stream 0").split()[1]
    exe = p.ok(f"instantiate_upload {captured(p, s, 512 * MiB)} {s}").split()[1]
    assert graph_pool(p) == (512 * MiB, 512 * MiB)
    assert free_bytes(p) == 512 * MiB
    p.ok(f"graph_launch {exe} {s}")  # already held: nothing more
    assert free_bytes(p) == 512 * MiB
    assert_clean(*p.finish())


def test_graph_memory_is_charged_to_the_gpu_of_its_allocation_nodes(
    plain: Variant, start_probe, sock_dir: str
) -> None:
    p = start(plain, start_probe, sock_dir, limit="64Mi", NVSHARE_FAKE_GPU_COUNT="2")
    p.ok(f"alloc mem {64 * MiB}")  # GPU 0 is full
    graph = p.ok("graph_create").split()[1]
    p.ok(f"graph_alloc {graph} 1 {48 * MiB}")
    s = p.ok("stream 0").split()[1]
    exe = p.ok(f"instantiate {graph}").split()[1]
    p.ok(f"graph_launch {exe} {s}")  # launched from GPU 0, its memory on GPU 1
    assert graph_pool(p, 1) == (48 * MiB, 48 * MiB)
    big = p.ok("graph_create").split()[1]
    p.ok(f"graph_alloc {big} 1 {32 * MiB}")
    assert p.do(f"instantiate {big}") == OOM  # 48 + 32 MiB on GPU 1
    assert_clean(*p.finish())


def test_a_graph_without_memory_nodes_runs_as_before(
    variant: Variant, start_probe, sock_dir: str
) -> None:
    p = start(variant, start_probe, sock_dir, limit="64Mi")
    p.ok(f"alloc mem {64 * MiB}")  # at the limit
    s = p.ok("stream 0").split()[1]
    p.ok(f"capture_begin {s} {CAPTURE_RELAXED}")
    p.ok(f"capture_launch {s} 3")
    graph = p.ok(f"capture_end {s}").split()[1]
    parent = p.ok("graph_create").split()[1]
    p.ok(f"graph_child {parent} {graph}")
    for g in (graph, parent):
        exe = p.ok(f"instantiate {g}").split()[1]
        p.ok(f"graph_launch {exe} {s}")
    assert_clean(*p.finish())


def test_a_capture_with_memory_nodes_survives_a_drop_and_its_graph_is_checked(
    variant: Variant, start_probe, sock_dir: str
) -> None:
    env = variant.env(
        NVSHARE_SOCKET_DIR=sock_dir,
        NVSHARE_IDLE_RELEASE_MS="3600000",
        NVSHARE_GPU_MEMORY_LIMIT="64Mi",
    )
    with fs.FakeScheduler(sock_dir, tq_s=0.1) as sched:
        a, b = start_probe(variant, env), start_probe(variant, env)
        a.ok("init")
        b.ok("init")
        a.ok("launch 1")  # a holds the lock
        s = a.ok("stream 0").split()[1]
        a.ok(f"capture_begin {s} {CAPTURE_GLOBAL}")
        a.ok(f"capture_alloc {s} {48 * MiB}")
        b.send("launch 1")  # b asks for the lock: a is told to drop it mid-capture
        assert sched.wait_for(lambda: sched.count(MsgType.LOCK_DROP) == 1)
        a.ok(f"capture_alloc {s} {80 * MiB}")
        graph = a.ok(f"capture_end {s}").split()[1]  # not CUDA_ERROR_STREAM_CAPTURE_INVALIDATED
        assert sched.wait_for(lambda: sched.count(MsgType.LOCK_RELEASED) == 1)
        assert b.answer() == "ok"
        assert a.do(f"instantiate {graph}") == OOM  # its 80 MiB node under 64 MiB (48 freed first)
        assert graph_pool(a) == (0, 0)
        for p in (a, b):
            assert_clean(*p.finish())


def test_memory_nodes_of_a_child_graph_count(plain: Variant, start_probe, sock_dir: str) -> None:
    p = start(plain, start_probe, sock_dir)
    child = p.ok("graph_create").split()[1]
    p.ok(f"graph_alloc {child} 0 {2 * GiB}")
    parent = p.ok("graph_create").split()[1]
    assert p.do(f"graph_child {parent} {child}") == "err 801"  # cloned: not with memory nodes
    p.ok(f"graph_child_move {parent} {child}")  # moved into the parent (CUDA 12.9)
    assert p.do(f"instantiate {parent}") == OOM
    assert graph_pool(p) == (0, 0)
    assert_clean(*p.finish())


def test_a_driver_that_shares_memory_within_a_graph_is_charged_what_it_reserved(
    variant: Variant, start_probe, sock_dir: str
) -> None:
    p = start(variant, start_probe, sock_dir, NVSHARE_FAKE_GRAPH_SHARE="1")
    s = p.ok("stream 0").split()[1]
    p.ok(f"capture_begin {s} {CAPTURE_RELAXED}")
    p.ok(f"capture_alloc {s} {256 * MiB}")
    p.ok(f"capture_alloc {s} {256 * MiB}")  # never live at once: the driver shares them
    first = p.ok(f"instantiate {p.ok(f'capture_end {s}').split()[1]}").split()[1]
    p.ok(f"graph_launch {first} {s}")  # checked for its 256 MiB peak, the 256 reserved
    assert graph_pool(p) == (256 * MiB, 256 * MiB)
    assert free_bytes(p) == GiB - 256 * MiB
    p.ok(f"alloc mem {256 * MiB}")
    second = p.ok(f"instantiate {captured(p, s, 128 * MiB)}").split()[1]
    p.ok(f"graph_launch {second} {s}")
    assert free_bytes(p) == GiB - 640 * MiB
    p.ok(f"graph_launch {first} {s}")  # still mapped: not checked for its 512 MiB again
    assert free_bytes(p) == GiB - 640 * MiB
    assert_clean(*p.finish())


def test_a_graph_that_frees_before_it_allocates_again_is_checked_for_its_peak_not_the_sum(
    variant: Variant, start_probe, sock_dir: str
) -> None:
    """Three 400 MiB allocations, each freed before the next is made: at most 400 MiB live. The
    sum of the nodes (1200 MiB) used to refuse it under 1 GiB. Allocations that nothing orders
    may all be live at once, and still count together."""
    p = start(variant, start_probe, sock_dir, NVSHARE_FAKE_GRAPH_SHARE="1")
    s = p.ok("stream 0").split()[1]
    chain = p.ok("graph_create").split()[1]
    for _ in range(3):
        p.ok(f"graph_chain {chain} 0 {400 * MiB}")
    exe = p.ok(f"instantiate_v2 {chain}").split()[1]
    p.ok(f"graph_launch {exe} {s}")
    assert graph_pool(p) == (400 * MiB, 400 * MiB)
    assert free_bytes(p) == GiB - 400 * MiB
    unordered = p.ok("graph_create").split()[1]
    p.ok(f"graph_alloc {unordered} 0 {400 * MiB}")
    p.ok(f"graph_alloc {unordered} 0 {400 * MiB}")
    assert p.do(f"instantiate_v2 {unordered}") == OOM  # 800 MiB may be live; 624 are left
    assert "graph memory of 800 MiB on GPU 0 refused" in p.stderr()
    assert free_bytes(p) == GiB - 400 * MiB
    assert_clean(*p.finish())


def test_an_instantiation_that_uploads_waits_for_the_lock_like_an_upload(
    plain: Variant, start_probe, sock_dir: str
) -> None:
    with fs.FakeScheduler(sock_dir, auto_grant=False) as sched:
        p = start_probe(plain, plain.env(NVSHARE_SOCKET_DIR=sock_dir))
        p.ok("init")
        s = p.ok("stream 0").split()[1]
        graph = captured(p, s, 16 * MiB)  # recorded work runs later: it never waits
        p.send(f"instantiate_upload {graph} {s}")
        assert sched.wait_for(lambda: sched.count(MsgType.LOCK_REQUEST) >= 1)
        assert not p.answered(0.3)  # it uploads only once granted the GPU
        sched.grant_waiting()
        assert p.answer().startswith("ok")
        assert_clean(*p.finish())
