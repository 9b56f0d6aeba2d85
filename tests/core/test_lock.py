"""Lock rules: FCFS serialisation, quantum preemption, modes, and dead holders."""

from __future__ import annotations

from dataclasses import replace

from appliance.core import actions as act
from appliance.core import events as ev
from appliance.core.node import NodeCore
from appliance.policy.model import Mode, Policy, SchedulerSettings

from .conftest import ADMIN, GiB, Harness, of


def policy(mode: Mode = Mode.ON, tq: float = 30.0) -> Policy:
    return Policy(scheduler=SchedulerSettings(mode=mode, time_quantum_s=tq))


def test_mode_on_serialises_first_come_first_served(harness: Harness) -> None:
    a, b, c = harness.register(), harness.register(), harness.register()
    assert of(harness.feed(ev.LockRequested(a, 5)), act.Grant, a)[0].seq == 5
    assert of(harness.feed(ev.LockRequested(b, 6)), act.Grant) == []
    assert harness.feed(ev.LockRequested(c, 7)) == []
    out = harness.feed(ev.LockReleased(a, ev.ReleaseReason.IDLE))
    assert [(s.client_id, s.seq) for s in of(out, act.Grant)] == [(b, 6)]
    out = harness.feed(ev.LockReleased(b, ev.ReleaseReason.IDLE))
    assert [s.client_id for s in of(out, act.Grant)] == [c]


def test_holder_is_preempted_only_when_someone_waits() -> None:
    h = Harness(NodeCore(policy(tq=10)))
    a, b = h.register(), h.register()
    h.feed(ev.LockRequested(a, 1))
    assert h.advance(100) == []  # alone: never dropped, no deadline armed
    assert h.core.next_deadline() is None
    h.feed(ev.LockRequested(b, 1))  # quantum long over: drop at once
    assert of(h.sent[-1:], act.Drop, a)
    h.feed(ev.LockReleased(a, ev.ReleaseReason.DROPPED))
    assert of(h.sent[-1:], act.Grant, b)
    h.feed(ev.LockRequested(a, 2))
    assert of(h.advance(9.9), act.Drop) == []
    assert of(h.advance(0.2), act.Drop, b)


def test_drop_is_sent_once_while_the_holder_drains() -> None:
    h = Harness(NodeCore(policy(tq=1)))
    a, b = h.register(), h.register()
    h.feed(ev.LockRequested(a, 1))
    h.feed(ev.LockRequested(b, 1))
    h.advance(1.0)
    h.advance(30)
    assert len(of(h.sent, act.Drop, a)) == 1


def test_a_holder_that_dies_hands_over_at_once(harness: Harness) -> None:
    a, b = harness.register(), harness.register()
    harness.feed(ev.LockRequested(a, 1))
    harness.feed(ev.LockRequested(b, 2))
    out = harness.feed(ev.ClientGone(a))
    assert [(s.client_id, s.seq) for s in of(out, act.Grant)] == [(b, 2)]


def test_mode_off_tells_clients_not_to_gate() -> None:
    h = Harness(NodeCore(policy(Mode.OFF)))
    a = h.register()
    assert h.enforced(a).mode is Mode.OFF
    out = h.feed(ev.ModeSet(Mode.ON, reply_to=ADMIN))
    assert of(out, act.LimitsChanged, a)[0].limits.mode is Mode.ON


def test_switching_to_off_unblocks_waiters(harness: Harness) -> None:
    a, b = harness.register(), harness.register()
    harness.feed(ev.LockRequested(a, 1))
    harness.feed(ev.LockRequested(b, 9))
    out = harness.feed(ev.ModeSet(Mode.OFF, reply_to=ADMIN))
    assert of(out, act.Grant, b)[0].seq == 9
    assert {s.client_id for s in of(out, act.LimitsChanged)} == {a, b}


def test_auto_runs_concurrently_while_memory_fits_then_serialises() -> None:
    h = Harness(NodeCore(policy(Mode.AUTO, tq=5)))
    a, b, c = (h.register(total=10 * GiB) for _ in range(3))
    for cid in (a, b):
        h.feed(ev.MemoryReserveRequested(cid, 1, 4 * GiB, 0))
        assert of(h.feed(ev.LockRequested(cid, 2)), act.Grant, cid)
    h.feed(ev.MemoryReserveRequested(c, 1, 4 * GiB, 0))
    assert of(h.feed(ev.LockRequested(c, 3)), act.Grant) == []  # 12 GiB would not fit in 10
    out = h.advance(5.0)
    assert [s.client_id for s in of(out, act.Drop)] == [a]  # oldest holder, one at a time
    out = h.feed(ev.LockReleased(a, ev.ReleaseReason.DROPPED))
    assert of(out, act.Grant, c)
    # b and c fit together: when b frees its memory nobody needs to wait any more
    h.feed(ev.LockRequested(a, 4))
    assert of(h.feed(ev.MemoryReturned(b, 4 * GiB, 0)), act.Grant, a)


def test_set_tq_reaches_grants(harness: Harness) -> None:
    harness.feed(ev.TimeQuantumSet(1, reply_to=ADMIN))
    assert harness.state.time_quantum("GPU-x") == 1.0
    a = harness.register()
    assert of(harness.feed(ev.LockRequested(a, 1)), act.Grant)[0].time_quantum_s == 1


def test_policy_change_replaces_runtime_overrides(harness: Harness) -> None:
    harness.feed(ev.TimeQuantumSet(5, reply_to=ADMIN))
    new = Policy(scheduler=replace(SchedulerSettings(), time_quantum_s=12))
    harness.feed(ev.PolicyChanged(new))
    assert harness.state.time_quantum("GPU-x") == 12


def test_quota_client_is_dropped_when_its_share_is_spent_and_waits_for_next_window() -> None:
    settings = SchedulerSettings(
        compute_window_s=1.0, carry_over_percent=0, drop_tail_billing_percent=100
    )
    from appliance.policy.model import Limits

    h = Harness(NodeCore(Policy(scheduler=settings, defaults=Limits(core_percent=30))))
    a = h.register()
    assert h.enforced(a).core_percent == 30
    h.feed(ev.LockRequested(a, 1))
    out = h.advance(0.31)
    assert of(out, act.Drop, a)  # nobody waits, but 30% of the window is spent
    h.advance(0.01)
    h.feed(ev.LockReleased(a, ev.ReleaseReason.DROPPED))
    assert h.feed(ev.LockRequested(a, 2)) == []  # over quota until the window rolls
    out = h.advance(0.7)
    assert of(out, act.Grant, a)


def test_quota_share_matches_the_limit_over_many_windows() -> None:
    settings = SchedulerSettings(
        compute_window_s=1.0, carry_over_percent=0, drop_tail_billing_percent=100
    )
    from appliance.policy.model import Limits

    h = Harness(NodeCore(Policy(scheduler=settings, defaults=Limits(core_percent=40))))
    a = h.register()
    held = 0.0
    h.feed(ev.LockRequested(a, 1))
    start = h.now
    for _ in range(2000):  # a client that always wants the GPU, releasing promptly on drop
        before = h.now
        holding = h.state.clients[a].phase.value == "holding"
        out = h.advance(0.005)
        if holding:
            held += h.now - before
        if of(out, act.Drop, a):
            h.feed(ev.LockReleased(a, ev.ReleaseReason.DROPPED))
            h.feed(ev.LockRequested(a, 1))
    share = held / (h.now - start)
    assert 0.37 < share < 0.43, share


def test_a_request_while_draining_waits_for_the_release() -> None:
    h = Harness(NodeCore(policy(tq=1)))
    a, b = h.register(), h.register()
    h.feed(ev.LockRequested(a, 1))
    h.feed(ev.LockRequested(b, 2))
    h.advance(1.0)  # a is told to drop
    assert h.feed(ev.LockRequested(a, 3)) == []  # not granted while it still drains
    out = h.feed(ev.LockReleased(a, ev.ReleaseReason.DROPPED))
    assert [(s.client_id, s.seq) for s in of(out, act.Grant)] == [(b, 2)]
    out = h.feed(ev.LockReleased(b, ev.ReleaseReason.IDLE))
    assert [(s.client_id, s.seq) for s in of(out, act.Grant)] == [(a, 3)]  # a was queued
