"""The memory ledger: chunked reservations, pod-wide limits, live changes, real-time check."""

from __future__ import annotations

from appliance import protocol as p
from appliance.core import events as ev
from appliance.core.pods import PodInfo, PodOverrides
from appliance.core.scheduler import Scheduler
from appliance.policy.model import (
    Limits,
    MemorySettings,
    Policy,
    RealtimeCheck,
    RealtimeCheckMode,
)

from .conftest import GPU, GiB, Harness, of

MiB = 1 << 20


def harness(**kw: object) -> Harness:
    return Harness(Scheduler(Policy(memory=MemorySettings(chunk_bytes=64 * MiB), **kw)))  # type: ignore[arg-type]


def grant(h: Harness, cid: int, n: int, used: int = 0) -> int:
    out = h.feed(ev.MemoryReserveRequested(cid, 7, n, used))
    [reply] = of(out, p.MemGrant, cid)
    assert reply.seq == 7
    return int(reply.message.granted)


def test_reservations_come_in_chunks_up_to_the_limit() -> None:
    h = harness(defaults=Limits(memory_bytes=100 * MiB, core_percent=100))
    a = h.register()
    assert h.wire(a).mem_limit == 100 * MiB
    assert grant(h, a, 1 * MiB) == 64 * MiB  # a chunk, so the next allocations are local
    assert grant(h, a, 30 * MiB) == 36 * MiB  # only what is left under the limit
    assert grant(h, a, 1) == 0  # refused: the hook answers CUDA_ERROR_OUT_OF_MEMORY


def test_two_processes_of_one_pod_share_one_limit_exactly() -> None:
    h = harness()
    pod = PodInfo(uid="u1", namespace="ns", name="p", node="n")
    h.feed(ev.PodUpdated(pod, PodOverrides(memory_bytes=1 * GiB)))
    a, b = h.register(pod_uid="u1"), h.register(pod_uid="u1")
    c = h.register(pod_uid="other")
    assert grant(h, a, 600 * MiB) == 600 * MiB
    assert grant(h, b, 500 * MiB) == 0  # 1.1 GiB together: refused
    assert grant(h, b, 400 * MiB) == 400 * MiB  # what it needs (more than a chunk)
    assert grant(h, c, 900 * MiB) == 900 * MiB  # another pod has its own ledger
    h.feed(ev.ClientGone(a))  # a's reservation is freed with it
    assert grant(h, b, 500 * MiB) == 500 * MiB


def test_lowering_reaches_only_the_clients_it_concerns() -> None:
    h = harness()
    pod_a = PodInfo(uid="a", namespace="ns", name="a", node="n")
    pod_b = PodInfo(uid="b", namespace="ns", name="b", node="n")
    h.feed(ev.PodUpdated(pod_a, PodOverrides(memory_bytes=4 * GiB)))
    h.feed(ev.PodUpdated(pod_b, PodOverrides(memory_bytes=4 * GiB)))
    a, b = h.register(pod_uid="a"), h.register(pod_uid="b")
    out = h.feed(ev.PodUpdated(pod_a, PodOverrides(memory_bytes=1 * GiB)))
    assert [(s.client_id, s.message.limits.mem_limit) for s in of(out, p.LimitUpdate)] == [
        (a, 1 * GiB)
    ]
    out = h.feed(ev.PodUpdated(pod_a, PodOverrides(memory_bytes=None)))  # annotation removed
    assert of(out, p.LimitUpdate, a)[0].message.limits.mem_limit == 0  # policy: no limit
    assert of(out, p.LimitUpdate, b) == []


def test_admin_limit_beats_annotation_and_clear_restores_it() -> None:
    h = harness()
    pod = PodInfo(uid="a", namespace="ns", name="web", node="n")
    h.feed(ev.PodUpdated(pod, PodOverrides(memory_bytes=4 * GiB)))
    a = h.register(pod_uid="a")
    out = h.feed(ev.AdminLimitSet(("pod", "ns/web"), Limits(memory_bytes=1 * GiB)))
    assert of(out, p.LimitUpdate, a)[0].message.limits.mem_limit == 1 * GiB
    assert h.sched.clients[a].limits.sources["memory"] == "nvsharectl limit set"
    out = h.feed(ev.AdminLimitSet(("pod", "ns/web"), Limits(), clear_memory=True))
    assert of(out, p.LimitUpdate, a)[0].message.limits.mem_limit == 4 * GiB


def test_environment_limit_only_lowers() -> None:
    h = harness(defaults=Limits(memory_bytes=2 * GiB, core_percent=100))
    low = h.register(env_mem=1 * GiB)
    high = h.register(env_mem=8 * GiB)
    assert h.wire(low).mem_limit == 1 * GiB
    assert h.wire(high).mem_limit == 2 * GiB


def test_realtime_check_strict_refuses_and_warning_grants() -> None:
    rt = RealtimeCheck(mode=RealtimeCheckMode.STRICT, safety_margin_bytes=100 * MiB)
    h = harness(realtime_check=rt)
    a = h.register()
    h.feed(ev.GpuFreeMemory({GPU: 500 * MiB}))
    assert grant(h, a, 450 * MiB) == 0  # 450 > 500 - 100 margin
    assert grant(h, a, 300 * MiB) >= 300 * MiB
    assert h.sched.counters["realtime_refusals"] == 1
    h.feed(
        ev.PolicyChanged(
            Policy(
                memory=MemorySettings(chunk_bytes=64 * MiB),
                realtime_check=RealtimeCheck(mode=RealtimeCheckMode.WARNING),
            )
        )
    )
    assert grant(h, a, 450 * MiB) == 450 * MiB
    assert h.sched.counters["realtime_warnings"] == 1


def test_realtime_check_skips_stale_samples_and_honours_pod_opt_out() -> None:
    rt = RealtimeCheck(mode=RealtimeCheckMode.STRICT, max_sample_age_s=5)
    h = harness(realtime_check=rt)
    pod = PodInfo(uid="a", namespace="ns", name="p", node="n")
    h.feed(ev.PodUpdated(pod, PodOverrides(realtime_check=False)))
    a, b = h.register(pod_uid="a"), h.register()
    h.feed(ev.GpuFreeMemory({GPU: 10 * MiB}))
    assert grant(h, a, 200 * MiB) == 200 * MiB  # the pod opted out
    assert grant(h, b, 200 * MiB) == 0
    h.now += 10  # the sample is now too old to trust: granted, and counted
    assert grant(h, b, 200 * MiB) == 200 * MiB
    assert h.sched.counters["realtime_skipped"] == 1


def test_reported_usage_counts_even_where_no_reservation_covers_it() -> None:
    # A hook that reconnected to a restarted daemon holds memory the new ledger never granted;
    # its usage report must keep the pod's other processes from taking that room.
    h = harness()
    pod = PodInfo(uid="u1", namespace="ns", name="p", node="n")
    h.feed(ev.PodUpdated(pod, PodOverrides(memory_bytes=1 * GiB)))
    a, b = h.register(pod_uid="u1"), h.register(pod_uid="u1")
    h.feed(ev.MemoryReturned(a, 0, 700 * MiB))  # usage report, nothing reserved
    assert grant(h, b, 400 * MiB) == 0
    assert grant(h, b, 300 * MiB) == 300 * MiB
    # a's next allocation asks for its whole usage plus the new bytes: counted once, not twice
    assert grant(h, a, 710 * MiB, used=700 * MiB) == 710 * MiB


def test_each_hook_hears_how_many_processes_share_its_ledger() -> None:
    h = harness()
    a = h.register(pid=10, pod_uid="u1")
    b = h.register(pid=11, pod_uid="u1")  # a second process of the pod
    told = of(h.sent, p.LedgerPeers)
    assert {(s.client_id, s.message.clients) for s in told} == {(a, 2), (b, 2)}
    alone = h.register(pid=12, pod_uid="u2")
    assert not of(h.sent, p.LedgerPeers, alone)  # 1 is what a hook assumes: nothing to say
    out = h.feed(ev.ClientGone(a))
    assert [(s.client_id, s.message.clients) for s in of(out, p.LedgerPeers)] == [(b, 1)]


def test_nvml_usage_reaches_the_hook_of_that_process_only_when_it_moved() -> None:
    from appliance.core.scheduler import CONTEXT_ALLOWANCE_BYTES

    h = harness(defaults=Limits(memory_bytes=1 * GiB, core_percent=100))
    a = h.register(pid=10)
    b = h.register(pid=11)
    sample = ev.GpuFreeMemory({GPU: 10 * GiB}, processes={GPU: {10: 3 * GiB}})
    [told] = of(h.feed(sample), p.MemObserved)
    assert told.client_id == a
    assert told.message == p.MemObserved(3 * GiB, CONTEXT_ALLOWANCE_BYTES)
    assert h.sched.client_view(h.sched.clients[a], h.now)["memory_observed"] == 3 * GiB
    assert h.sched.counters["nvml_over_limit"] == 1  # 3 GiB > 1 GiB + the context allowance
    moved_a_little = {GPU: {10: 3 * GiB + (1 << 20)}, "GPU-other": {11: 5 * GiB}}
    assert not of(h.feed(ev.GpuFreeMemory({}, processes=moved_a_little)), p.MemObserved)
    assert h.sched.clients[b].nvml_used is None  # b's pid on another GPU is not b's usage
