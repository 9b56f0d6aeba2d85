"""The memory ledger: chunked reservations, pod-wide limits, live changes, real-time check."""

from __future__ import annotations

from appliance.core import actions as act
from appliance.core import events as ev
from appliance.core import views
from appliance.core.annotations import HAMI_REALTIME_CHECK, MEMORY_LIMIT, REALTIME_CHECK, PodInfo
from appliance.core.events import LimitTarget
from appliance.core.ledger import CONTEXT_ALLOWANCE_BYTES, RECLAIM_WAIT_S
from appliance.core.node import NodeCore
from appliance.policy.model import (
    Limits,
    MemorySettings,
    Policy,
    RealtimeCheck,
    RealtimeCheckMode,
)

from .conftest import ADMIN, GPU, GiB, Harness, MiB, of


def harness(**kw: object) -> Harness:
    return Harness(NodeCore(Policy(memory=MemorySettings(chunk_bytes=64 * MiB), **kw)))  # type: ignore[arg-type]


def grant(h: Harness, cid: int, n: int, used: int = 0) -> int:
    out = h.feed(ev.MemoryReserveRequested(cid, 7, n, used))
    [reply] = of(out, act.MemoryGranted, cid)
    assert reply.seq == 7
    return int(reply.granted)


def test_reservations_come_in_chunks_up_to_the_limit() -> None:
    h = harness(defaults=Limits(memory_bytes=100 * MiB, core_percent=100))
    a = h.register()
    assert h.enforced(a).memory_bytes == 100 * MiB
    assert grant(h, a, 1 * MiB) == 64 * MiB  # a chunk, so the next allocations are local
    assert grant(h, a, 30 * MiB) == 36 * MiB  # only what is left under the limit
    assert grant(h, a, 1) == 0  # refused: the hook answers CUDA_ERROR_OUT_OF_MEMORY


def test_two_processes_of_one_pod_share_one_limit_exactly() -> None:
    h = harness()
    h.feed(ev.PodSeen(PodInfo("u1", "ns", "p", "n", annotations={MEMORY_LIMIT: "1Gi"})))
    a, b = h.register(pod_uid="u1"), h.register(pod_uid="u1")
    c = h.register(pod_uid="other")
    assert grant(h, a, 600 * MiB) == 600 * MiB
    out = h.feed(ev.MemoryReserveRequested(b, 7, 500 * MiB, 0))
    assert of(out, act.MemoryReclaim, a)  # a may have freed some since it last said
    [refused] = of(h.feed(ev.MemoryReturned(a, 0, 600 * MiB)), act.MemoryGranted, b)
    assert refused.granted == 0  # it has not: 1.1 GiB together, refused
    assert grant(h, b, 400 * MiB) == 400 * MiB  # what it needs (more than a chunk)
    assert grant(h, c, 900 * MiB) == 900 * MiB  # another pod has its own ledger
    h.feed(ev.ClientGone(a))  # a's reservation is freed with it
    assert grant(h, b, 500 * MiB) == 500 * MiB


def test_lowering_reaches_only_the_clients_it_concerns() -> None:
    h = harness()

    def pod(uid: str, memory: str | None) -> ev.PodSeen:
        asked = {MEMORY_LIMIT: memory} if memory else {}
        return ev.PodSeen(PodInfo(uid, "ns", uid, "n", annotations=asked))

    h.feed(pod("a", "4Gi"))
    h.feed(pod("b", "4Gi"))
    a, b = h.register(pod_uid="a"), h.register(pod_uid="b")
    out = h.feed(pod("a", "1Gi"))
    assert [(s.client_id, s.limits.memory_bytes) for s in of(out, act.LimitsChanged)] == [
        (a, 1 * GiB)
    ]
    out = h.feed(pod("a", None))  # annotation removed
    assert of(out, act.LimitsChanged, a)[0].limits.memory_bytes is None  # policy: no limit
    assert of(out, act.LimitsChanged, b) == []


def test_admin_limit_beats_annotation_and_clear_restores_it() -> None:
    h = harness()
    h.feed(ev.PodSeen(PodInfo("a", "ns", "web", "n", annotations={MEMORY_LIMIT: "4Gi"})))
    a = h.register(pod_uid="a")
    out = h.feed(
        ev.AdminLimitSet(LimitTarget.pod("ns", "web"), Limits(memory_bytes=1 * GiB), reply_to=ADMIN)
    )
    assert of(out, act.LimitsChanged, a)[0].limits.memory_bytes == 1 * GiB
    assert h.state.clients[a].limits.sources.memory == "nvsharectl limit set"
    out = h.feed(
        ev.AdminLimitSet(LimitTarget.pod("ns", "web"), Limits(), clear_memory=True, reply_to=ADMIN)
    )
    assert of(out, act.LimitsChanged, a)[0].limits.memory_bytes == 4 * GiB


def test_environment_limit_only_lowers() -> None:
    h = harness(defaults=Limits(memory_bytes=2 * GiB, core_percent=100))
    low = h.register(env_mem=1 * GiB)
    high = h.register(env_mem=8 * GiB)
    assert h.enforced(low).memory_bytes == 1 * GiB
    assert h.enforced(high).memory_bytes == 2 * GiB


def test_realtime_check_strict_refuses_and_warning_grants() -> None:
    rt = RealtimeCheck(mode=RealtimeCheckMode.STRICT, safety_margin_bytes=100 * MiB)
    h = harness(realtime_check=rt)
    a = h.register()
    h.feed(ev.GpuFreeMemory({GPU: 500 * MiB}))
    assert grant(h, a, 450 * MiB) == 0  # 450 > 500 - 100 margin
    assert grant(h, a, 300 * MiB) >= 300 * MiB
    assert h.state.counters["realtime_refusals"] == 1
    h.feed(
        ev.PolicyChanged(
            Policy(
                memory=MemorySettings(chunk_bytes=64 * MiB),
                realtime_check=RealtimeCheck(mode=RealtimeCheckMode.WARNING),
            )
        )
    )
    assert grant(h, a, 450 * MiB) == 450 * MiB
    assert h.state.counters["realtime_warnings"] == 1


def test_realtime_check_skips_stale_samples_and_honours_pod_opt_out() -> None:
    rt = RealtimeCheck(mode=RealtimeCheckMode.STRICT, max_sample_age_s=5)
    h = harness(realtime_check=rt)
    h.feed(ev.PodSeen(PodInfo("a", "ns", "p", "n", annotations={REALTIME_CHECK: "false"})))
    a, b = h.register(pod_uid="a"), h.register()
    h.feed(ev.GpuFreeMemory({GPU: 10 * MiB}))
    assert grant(h, a, 200 * MiB) == 200 * MiB  # the pod opted out
    assert grant(h, b, 200 * MiB) == 0
    h.now += 10  # the sample is now too old to trust: granted, and counted
    assert grant(h, b, 200 * MiB) == 200 * MiB
    assert h.state.counters["realtime_skipped"] == 1


def test_a_pod_opts_in_with_hamis_annotation_while_the_check_is_off() -> None:
    h = harness(realtime_check=RealtimeCheck())  # nothing set: the check is off
    h.feed(ev.PodSeen(PodInfo("a", "ns", "p", "n", annotations={HAMI_REALTIME_CHECK: "true"})))
    a, b = h.register(pod_uid="a"), h.register()
    h.feed(ev.GpuFreeMemory({GPU: 10 * MiB}))
    assert grant(h, a, 200 * MiB) == 0  # opted in: strict, HAMi's default mode
    assert grant(h, b, 200 * MiB) == 200 * MiB
    disabled = RealtimeCheck(mode=RealtimeCheckMode.DISABLED, mode_set=True)
    h.feed(ev.PolicyChanged(Policy(realtime_check=disabled)))
    assert grant(h, a, 200 * MiB) == 200 * MiB  # a mode set to disabled skips the check


def test_reported_usage_counts_even_where_no_reservation_covers_it() -> None:
    # A hook that reconnected to a restarted daemon holds memory the new ledger never granted;
    # its usage report must keep the pod's other processes from taking that room.
    h = harness()
    h.feed(ev.PodSeen(PodInfo("u1", "ns", "p", "n", annotations={MEMORY_LIMIT: "1Gi"})))
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
    told = of(h.sent, act.PeersChanged)
    assert {(s.client_id, s.processes) for s in told} == {(a, 2), (b, 2)}
    alone = h.register(pid=12, pod_uid="u2")
    assert not of(h.sent, act.PeersChanged, alone)  # 1 is what a hook assumes: nothing to say
    out = h.feed(ev.ClientGone(a))
    assert [(s.client_id, s.processes) for s in of(out, act.PeersChanged)] == [(b, 1)]


def test_nvml_usage_reaches_the_hook_of_that_process_only_when_it_moved() -> None:
    h = harness(defaults=Limits(memory_bytes=1 * GiB, core_percent=100))
    a = h.register(pid=10)
    b = h.register(pid=11)
    sample = ev.GpuFreeMemory({GPU: 10 * GiB}, processes={GPU: {10: 3 * GiB}})
    [told] = of(h.feed(sample), act.MemoryObserved)
    assert told == act.MemoryObserved(a, 3 * GiB, CONTEXT_ALLOWANCE_BYTES)
    assert views.client_view(h.state, h.state.clients[a], h.now).memory_observed == 3 * GiB
    assert h.state.counters["nvml_over_limit"] == 1  # 3 GiB > 1 GiB + the context allowance
    moved_a_little = {GPU: {10: 3 * GiB + (1 << 20)}, "GPU-other": {11: 5 * GiB}}
    assert not of(h.feed(ev.GpuFreeMemory({}, processes=moved_a_little)), act.MemoryObserved)
    assert h.state.clients[b].nvml_used is None  # b's pid on another GPU is not b's usage


def test_a_refusal_for_room_a_peer_holds_unused_waits_for_the_peer_to_give_it_back() -> None:
    h = harness()
    h.feed(ev.PodSeen(PodInfo("u1", "ns", "p", "n", annotations={MEMORY_LIMIT: "1Gi"})))
    a, b, c = (h.register(pid=pid, pod_uid="u1") for pid in (10, 11, 12))
    assert grant(h, a, 1 * MiB, used=1 * MiB) == 64 * MiB  # 63 MiB reserved and unused
    assert grant(h, c, 1 * MiB, used=1 * MiB) == 64 * MiB
    # b needs room that only a's and c's unused chunks hold: they are asked, b waits
    out = h.feed(ev.MemoryReserveRequested(b, 9, 950 * MiB, 0))
    assert of(out, act.MemoryGranted) == []
    assert [r.client_id for r in of(out, act.MemoryReclaim)] == [a, c]
    assert h.feed(ev.MemoryReturned(a, 63 * MiB, 1 * MiB)) == []  # c has not answered yet
    [granted] = of(h.feed(ev.MemoryReturned(c, 63 * MiB, 1 * MiB)), act.MemoryGranted, b)
    assert (granted.seq, granted.granted) == (9, 950 * MiB)  # decided once both answered
    # room a peer holds in use is no reason to wait: refused at once
    out = h.feed(ev.MemoryReserveRequested(b, 10, 100 * MiB, 950 * MiB))
    assert of(out, act.MemoryReclaim) == [] and of(out, act.MemoryGranted, b)[0].granted == 0


def test_a_peer_that_never_gives_back_delays_its_pods_refusal_only_briefly() -> None:
    h = harness()
    h.feed(ev.PodSeen(PodInfo("u1", "ns", "p", "n", annotations={MEMORY_LIMIT: "1Gi"})))
    a, b = h.register(pid=10, pod_uid="u1"), h.register(pid=11, pod_uid="u1")
    assert grant(h, a, 1 * MiB, used=1 * MiB) == 64 * MiB
    assert of(h.feed(ev.MemoryReserveRequested(b, 9, 1000 * MiB, 0)), act.MemoryReclaim, a)
    assert h.advance(RECLAIM_WAIT_S / 2) == []
    [refused] = of(h.advance(RECLAIM_WAIT_S), act.MemoryGranted, b)
    assert (refused.seq, refused.granted) == (9, 0)  # decided as things stand: refused
    # a peer that leaves answers too
    assert of(h.feed(ev.MemoryReserveRequested(b, 10, 1000 * MiB, 0)), act.MemoryReclaim, a)
    [granted] = of(h.feed(ev.ClientGone(a)), act.MemoryGranted, b)
    assert (granted.seq, granted.granted) == (10, 1000 * MiB)
