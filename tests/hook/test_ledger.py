"""Memory limits that come from the scheduler: chunked reservations against a pod ledger, live
limit updates (raise, lower below usage, remove), the environment only lowering the daemon's
limit, and managed backing."""

from __future__ import annotations

import threading

from appliance.wire.protocol import MsgType, WireBacking

from . import fake_scheduler as fs
from .conftest import Variant, assert_clean

MiB = 1 << 20


def test_reservations_come_in_chunks_and_surplus_goes_back(
    plain: Variant, start_probe, sock_dir: str
) -> None:
    sched = fs.FakeScheduler(sock_dir, chunk=16 * MiB)
    try:
        p = start_probe(plain, plain.env(NVSHARE_SOCKET_DIR=sock_dir))
        p.ok("init")
        ids = [p.ok("alloc mem 2097152").split()[1] for _ in range(8)]
        assert sched.count(MsgType.MEM_RESERVE) == 1  # one round trip for 8 allocations
        big = p.ok("alloc mem 536870912").split()[1]  # 512 MiB: asks exactly what is missing
        reserves = [f for _, t, f in sched.events if t == MsgType.MEM_RESERVE]
        assert reserves[-1] == (512 * MiB, 16 * MiB, 512 * MiB)
        p.ok(f"free {big}")
        assert sched.wait_for(lambda: sched.count(MsgType.MEM_RETURN) >= 1)
        returns = [f for _, t, f in sched.events if t == MsgType.MEM_RETURN]
        assert returns[0] == (512 * MiB, 16 * MiB)  # a surplus over 256 MiB goes back at once
        for i in ids:
            p.ok(f"free {i}")
        # the small rest goes back too, once the process has not allocated for a second
        assert sched.wait_for(lambda: sched.total_reserved() == 0)
        assert_clean(*p.finish())
    finally:
        sched.stop()


def test_two_processes_racing_never_exceed_the_pod_ledger(
    variant: Variant, start_probe, sock_dir: str
) -> None:
    sched = fs.FakeScheduler(sock_dir, chunk=8 * MiB, pod_limit=64 * MiB)
    try:
        env = variant.env(NVSHARE_SOCKET_DIR=sock_dir)
        probes = [start_probe(variant, env) for _ in range(2)]
        for p in probes:
            p.ok("init")
        granted = [0, 0]

        def race(i: int) -> None:
            for _ in range(40):
                if probes[i].do("alloc mem 2097152").startswith("ok"):
                    granted[i] += 1

        threads = [threading.Thread(target=race, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sum(granted) * 2 * MiB <= 64 * MiB
        assert sum(granted) >= 24  # the ledger was used, not refused wholesale
        assert sched.total_reserved() <= 64 * MiB
        for p in probes:
            assert_clean(*p.finish())
    finally:
        sched.stop()


def test_limit_updates_raise_lower_and_remove(variant: Variant, start_probe, sock_dir: str) -> None:
    sched = fs.FakeScheduler(sock_dir, limits=fs.limits(mem_limit=8 * MiB))
    try:
        p = start_probe(variant, variant.env(NVSHARE_SOCKET_DIR=sock_dir))
        p.ok("init")
        a = p.ok("alloc mem 8388608").split()[1]
        assert p.do("alloc mem 1") == "err 2"
        assert p.do("info") == f"ok 0 {8 * MiB}"

        sched.push_limits(fs.limits(mem_limit=16 * MiB))  # raise: the next allocation fits
        assert sched.wait_for(lambda: sched.count(MsgType.MEM_RETURN) >= 1)  # unused went back
        assert p.ok("info") == f"ok {8 * MiB} {16 * MiB}"
        b = p.ok("alloc mem 4194304").split()[1]

        sched.push_limits(fs.limits(mem_limit=4 * MiB))  # lower below usage: keep, refuse new
        assert sched.wait_for(lambda: sched.count(MsgType.MEM_RETURN) >= 2)
        assert p.do("info") == f"ok 0 {4 * MiB}"
        assert p.do("alloc mem 1") == "err 2"
        p.ok(f"free {a}")
        assert p.do("alloc mem 1") == "err 2"  # 4 MiB used: still at the limit
        p.ok(f"free {b}")
        p.ok("alloc mem 4194304")  # under the limit again

        sched.push_limits(fs.limits(mem_limit=0))  # removed: the whole GPU
        assert sched.wait_for(lambda: sched.count(MsgType.MEM_RETURN) >= 3)
        p.ok("alloc mem 1073741824")
        assert_clean(*p.finish())
    finally:
        sched.stop()


def test_a_raise_still_on_its_way_is_not_refused(
    variant: Variant, start_probe, sock_dir: str
) -> None:
    # The daemon raised the limit and its LIMIT_UPDATE crosses the next allocation (as right
    # after `nvsharectl limit set`): over the limit the hook knows, it asks all the same, and
    # the raise arrives before the answer. A refusal the daemon's limit confirms still refuses.
    sched = fs.FakeScheduler(sock_dir, limits=fs.limits(mem_limit=8 * MiB), chunk=2 * MiB)
    try:
        p = start_probe(variant, variant.env(NVSHARE_SOCKET_DIR=sock_dir))
        p.ok("init")
        p.ok("alloc mem 4194304")
        sched.limits_with_next_grant = fs.limits(mem_limit=64 * MiB)
        p.ok("alloc mem 16777216")
        assert p.ok("info").split()[2] == str(64 * MiB)
        assert p.do("alloc mem 1073741824") == "err 2"
        assert_clean(*p.finish())
    finally:
        sched.stop()


def test_a_grant_refused_by_a_lower_local_limit_goes_back_at_once(
    plain: Variant, start_probe, sock_dir: str
) -> None:
    # The environment's 64 MiB is below the daemon's limit: 300 MiB is asked of the daemon,
    # granted, and refused here. The grant goes back before anything else is asked, so the next
    # small allocation asks for its own reservation instead of living off the refused one.
    sched = fs.FakeScheduler(sock_dir, chunk=2 * MiB, limits=fs.limits(mem_limit=1 << 30))
    try:
        env = plain.env(NVSHARE_SOCKET_DIR=sock_dir, NVSHARE_GPU_MEMORY_LIMIT="64Mi")
        p = start_probe(plain, env)
        p.ok("init")
        assert p.do(f"alloc mem {300 * MiB}") == "err 2"
        p.ok(f"alloc mem {2 * MiB}")
        kinds = [
            (t, f) for _, t, f in sched.events if t in (MsgType.MEM_RESERVE, MsgType.MEM_RETURN)
        ]
        assert [t for t, _ in kinds] == [
            MsgType.MEM_RESERVE,
            MsgType.MEM_RETURN,
            MsgType.MEM_RESERVE,
        ]
        assert kinds[0][1][2] == 300 * MiB and kinds[1][1][0] == 300 * MiB
        assert_clean(*p.finish())
    finally:
        sched.stop()


def test_the_environment_can_only_lower_the_daemon_limit(
    plain: Variant, start_probe, sock_dir: str
) -> None:
    for env_limit, daemon_limit, fits in (("4Mi", 8 * MiB, 4), ("64Mi", 8 * MiB, 8)):
        sched = fs.FakeScheduler(sock_dir, limits=fs.limits(mem_limit=daemon_limit))
        try:
            env = plain.env(NVSHARE_SOCKET_DIR=sock_dir, NVSHARE_GPU_MEMORY_LIMIT=env_limit)
            p = start_probe(plain, env)
            p.ok("init")
            p.ok(f"alloc mem {fits * MiB}")
            assert p.do("alloc mem 1") == "err 2"
            assert p.do("total") == f"ok {fits * MiB}"
            assert_clean(*p.finish())
        finally:
            sched.stop()


def test_a_refused_reservation_is_out_of_memory(plain: Variant, start_probe, sock_dir: str) -> None:
    sched = fs.FakeScheduler(sock_dir, chunk=2 * MiB, pod_limit=6 * MiB)
    try:
        p = start_probe(plain, plain.env(NVSHARE_SOCKET_DIR=sock_dir))
        p.ok("init")
        p.ok("alloc mem 6291456")
        assert p.do("alloc mem 1") == "err 2"
        assert [f[2] for _, t, f in sched.events if t == MsgType.MEM_RESERVE][-1] == 0
        assert_clean(*p.finish())
    finally:
        sched.stop()


def test_a_refusal_is_counted_once_by_whoever_decided_it(
    plain: Variant, start_probe, sock_dir: str
) -> None:
    # Inside its reservation but over the environment's lower limit, the hook refuses alone;
    # the daemon hears it, to count it. Beyond its reservation the hook asks (the daemon's limit
    # may be newer), and a refusal there is the daemon's own count: not reported again.
    sched = fs.FakeScheduler(
        sock_dir, chunk=16 * MiB, pod_limit=6 * MiB, limits=fs.limits(mem_limit=8 * MiB)
    )
    try:
        env = plain.env(NVSHARE_SOCKET_DIR=sock_dir, NVSHARE_GPU_MEMORY_LIMIT="4Mi")
        p = start_probe(plain, env)
        p.ok("init")
        p.ok("alloc mem 2097152")  # reserves the pod's 6 MiB
        for size in (4 * MiB, 3 * MiB, 5 * MiB // 2):
            assert p.do(f"alloc mem {size}") == "err 2"  # over 4 MiB, inside the reservation
        assert sched.wait_for(lambda: sched.count(MsgType.MEM_REFUSALS) >= 1)
        reports = [f for _, t, f in sched.events if t == MsgType.MEM_REFUSALS]
        assert reports == [(3, 4 * MiB)]  # one report for the three, with the largest
        assert p.do("alloc mem 16777216") == "err 2"  # beyond it: asked, the daemon refuses
        reserves = [f for _, t, f in sched.events if t == MsgType.MEM_RESERVE]
        assert reserves[-1][2] == 0
        p.do("sleep 300")  # several service ticks
        assert sched.count(MsgType.MEM_REFUSALS) == 1
        assert_clean(*p.finish())
    finally:
        sched.stop()


def test_managed_backing_oversubscribes_only_when_allowed(
    plain: Variant, start_probe, sock_dir: str
) -> None:
    gpu = 64 * MiB
    managed = fs.limits(backing=WireBacking.MANAGED, mem_limit=128 * MiB)
    cases = (
        (fs.limits(backing=WireBacking.DEVICE), {}, "err 2"),  # the device itself is full
        (managed, {}, "err 2"),  # managed, but capped at the GPU size
        (fs.limits(backing=WireBacking.MANAGED, flags=1, mem_limit=128 * MiB), {}, "ok"),
        # nvshare's variable: this process asks, and the policy's managed backing allows it
        (managed, {"NVSHARE_ENABLE_SINGLE_OVERSUB": "1"}, "ok"),
        (fs.limits(backing=WireBacking.DEVICE), {"NVSHARE_ENABLE_SINGLE_OVERSUB": "1"}, "err 2"),
        (managed, {"NVSHARE_ENABLE_SINGLE_OVERSUB": "yes"}, "err 2"),  # reported, ignored
    )
    for limits, extra, expected in cases:
        sched = fs.FakeScheduler(sock_dir, limits=limits)
        try:
            env = plain.env(NVSHARE_SOCKET_DIR=sock_dir, NVSHARE_FAKE_GPU_MEM=str(gpu), **extra)
            p = start_probe(plain, env)
            p.ok("init")
            assert p.do(f"alloc mem {96 * MiB}").startswith(expected), (limits, extra)
            rc, err = p.finish()
            assert_clean(rc, err)
            if extra.get("NVSHARE_ENABLE_SINGLE_OVERSUB") == "yes":
                assert "NVSHARE_ENABLE_SINGLE_OVERSUB=yes is not 0 or 1" in err
        finally:
            sched.stop()
