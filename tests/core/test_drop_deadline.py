"""The drop deadline: no holder keeps the GPU by ignoring a drop, or by being wedged in a
synchronisation. Past `scheduler.dropDeadline` the next client is granted and the holder is
marked and queued behind everyone who drops in time."""

from __future__ import annotations

from appliance.core import actions as act
from appliance.core import events as ev
from appliance.core.annotations import PodInfo
from appliance.core.lock import LOCK_NOT_RELEASED
from appliance.core.node import NodeCore
from appliance.core.state import Phase
from appliance.policy.model import Limits, Mode, Policy, SchedulerSettings

from .conftest import GiB, Harness, of

TQ = 10.0
DEADLINE = 3.0


def harness(mode: Mode = Mode.ON) -> Harness:
    settings = SchedulerSettings(mode=mode, time_quantum_s=TQ, drop_deadline_s=DEADLINE)
    return Harness(NodeCore(Policy(scheduler=settings)))


def hostage(h: Harness) -> tuple[int, int]:
    """`hostile` holds the lock and `victim` waits; the quantum is over, the drop sent."""
    hostile, victim = h.register(), h.register()
    h.feed(ev.LockRequested(hostile, 1))
    h.feed(ev.LockRequested(victim, 7))
    out = h.advance(TQ)
    assert of(out, act.Drop, hostile)
    return hostile, victim


def test_a_holder_that_ignores_its_drop_is_passed_over_at_the_deadline() -> None:
    h = harness()
    hostile, victim = hostage(h)
    dropped_at = h.now
    assert h.core.next_deadline() == dropped_at + DEADLINE  # the timer is armed for it
    assert of(h.advance(DEADLINE - 0.01), act.Grant) == []
    out = h.advance(0.02)
    assert [(g.client_id, g.seq) for g in of(out, act.Grant)] == [(victim, 7)]
    c = h.state.clients[hostile]
    assert (c.phase, c.late_drops, h.state.gangs[c.gang].offender) == (Phase.OVERDUE, 1, True)
    assert h.state.counters["drops_overdue"] == 1
    [row] = [r for r in h.core.status(h.now).clients if r.id == hostile]
    assert (row.state, row.late_drops) == (Phase.OVERDUE, 1)
    assert h.state.gpus[c.gpu].holders == {victim}


def test_its_late_release_changes_nothing_for_the_new_holder() -> None:
    h = harness()
    hostile, victim = hostage(h)
    h.advance(DEADLINE)
    out = h.feed(ev.LockReleased(hostile, ev.ReleaseReason.DROPPED))
    assert out == []
    assert h.state.clients[hostile].phase is Phase.IDLE
    assert h.state.gpus[h.state.clients[victim].gpu].holders == {victim}
    assert h.state.counters["releases_late"] == 1


def test_asking_again_before_releasing_queues_nothing() -> None:
    """A raw client that never releases but keeps asking waits forever, alone."""
    h = harness()
    hostile, victim = hostage(h)
    h.advance(DEADLINE)
    assert h.feed(ev.LockRequested(hostile, 2)) == []
    gpu = h.state.gpus[h.state.clients[victim].gpu]
    assert h.queued(gpu.facts.uuid) == []
    h.feed(ev.LockReleased(victim, ev.ReleaseReason.IDLE))
    assert gpu.holders == set()  # the GPU is free rather than given to the hostage taker


def test_an_offender_waits_behind_clients_that_came_later() -> None:
    h = harness()
    hostile, victim = hostage(h)
    h.advance(DEADLINE)
    h.feed(ev.LockReleased(hostile, ev.ReleaseReason.DROPPED))
    h.feed(ev.LockRequested(hostile, 3))
    late = h.register()
    h.feed(ev.LockRequested(late, 4))
    gpu = h.state.gpus[h.state.clients[victim].gpu]
    assert h.queued(gpu.facts.uuid) == [late, hostile]
    h.feed(ev.LockReleased(victim, ev.ReleaseReason.IDLE))
    assert gpu.holders == {late}


def test_a_drop_finished_in_time_clears_the_mark() -> None:
    h = harness()
    hostile, victim = hostage(h)
    h.advance(DEADLINE)
    h.feed(ev.LockReleased(hostile, ev.ReleaseReason.DROPPED))
    h.feed(ev.LockRequested(hostile, 3))
    h.feed(ev.LockReleased(victim, ev.ReleaseReason.IDLE))  # hostile holds again
    # the victim let the GPU go idle inside its quantum: it has it back at once
    assert of(h.feed(ev.LockRequested(victim, 8)), act.Drop, hostile)
    h.advance(DEADLINE / 2)
    h.feed(ev.LockReleased(hostile, ev.ReleaseReason.DROPPED))
    c = h.state.clients[hostile]
    assert (h.state.gangs[c.gang].offender, c.late_drops) == (
        False,
        1,
    )  # the count stays, the penalty goes


def test_the_offenders_pod_gets_a_warning_event() -> None:
    h = harness()
    h.feed(ev.PodSeen(PodInfo("u1", "ml", "trainer", "node-1")))
    hostile = h.register(pod_uid="u1")
    victim = h.register()
    h.feed(ev.LockRequested(hostile, 1))
    h.feed(ev.LockRequested(victim, 2))
    out = h.advance(TQ + DEADLINE)
    [warning] = of(out, act.PodWarning)
    assert warning.reason == LOCK_NOT_RELEASED and str(warning.pod) == "ml/trainer"
    assert "did not release" in warning.message and "3s" in warning.message


def test_a_quota_drop_has_the_same_deadline() -> None:
    settings = SchedulerSettings(time_quantum_s=TQ, drop_deadline_s=DEADLINE)
    h = Harness(NodeCore(Policy(scheduler=settings, defaults=Limits(core_percent=50))))
    hog, waiter = h.register(), h.register()
    h.feed(ev.LockRequested(hog, 1))
    h.feed(ev.LockRequested(waiter, 2))
    out = h.advance(settings.compute_window_s / 2)  # half of the window: its share is spent
    assert of(out, act.Drop, hog)
    out = h.advance(DEADLINE)
    assert of(out, act.Grant, waiter)
    assert h.state.clients[hog].phase is Phase.OVERDUE


def test_in_mode_auto_a_client_that_does_not_fit_is_granted_past_the_deadline() -> None:
    h = harness(Mode.AUTO)
    hostile, victim = h.register(total=2 * GiB), h.register(total=2 * GiB)
    h.feed(ev.MemoryReserveRequested(hostile, 1, GiB + GiB // 2, 0))
    h.feed(ev.MemoryReserveRequested(victim, 1, GiB, 0))
    h.feed(ev.LockRequested(hostile, 1))
    h.feed(ev.LockRequested(victim, 2))
    assert h.state.clients[victim].phase is Phase.WAITING  # does not fit beside it
    assert of(h.advance(TQ), act.Drop, hostile)
    assert of(h.advance(DEADLINE), act.Grant, victim)
