"""What an event costs the core does not grow with the clients connected, idle or waiting.

Work is counted, not timed: the lines of the appliance's own code that run while the core
handles one event (and answers `next_deadline`, as the engine asks after every event), traced
with `sys.settrace`. A pass over every client or gang runs a line (or more) per client, so it
shows as work that grows with n; an indexed structure does the same work at 20 clients and at
400. The bound allows a little growth (a sorted insert, a dict that resized) and nothing like
the 20x of a pass.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import replace
from types import FrameType
from typing import Any

import pytest

from appliance.core import actions as act
from appliance.core import events as ev
from appliance.core.gpus import GpuFacts
from appliance.core.identity import ClientIdentity
from appliance.core.node import NodeCore
from appliance.policy.model import Limits, Mode, Policy, SchedulerSettings

GPU = "GPU-00000000-0000-0000-0000-0000000000c0"
SMALL, LARGE = 20, 400
GROWTH = 1.5  # what the work at LARGE may be of the work at SMALL


class Crowd:
    """A core with n clients on one GPU in mode on: one holds, the rest wait (or idle)."""

    def __init__(self, n: int, *, waiting: bool = True, policy: Policy | None = None) -> None:
        settings = SchedulerSettings(mode=Mode.ON, time_quantum_s=3600)
        policy = policy or Policy(scheduler=settings)
        self.core = NodeCore(policy, inventory={GPU: GpuFacts(uuid=GPU, memory_total=80 << 30)})
        self.now = 1000.0
        self.n = 0
        for _ in range(n):
            self.register()
        self.holder = 1
        if waiting:
            for cid in range(1, n + 1):
                self.feed(ev.LockRequested(cid, 2))

    def feed(self, event: ev.Event) -> list[act.Action]:
        self.now += 0.001
        out = self.core.handle(event, self.now)
        self.core.next_deadline()
        return out

    def register(self) -> int:
        self.n += 1
        ident = ClientIdentity(pid=5000 + self.n, uid=1000, gid=1000)
        self.feed(ev.ClientRegistered(self.n, 1, ident, GPU, 80 << 30))
        return self.n

    def work(self, event: ev.Event | Callable[[], Any]) -> int:
        """Lines of the appliance run to handle `event` (and answer the next deadline)."""
        lines = 0

        def local(frame: FrameType, why: str, arg: Any) -> Any:
            nonlocal lines
            if why == "line":
                lines += 1
            return local

        def tracer(frame: FrameType, why: str, arg: Any) -> Any:
            return local if "/appliance/" in frame.f_code.co_filename else None

        sys.settrace(tracer)
        try:
            if callable(event):
                event()
            else:
                self.feed(event)
        finally:
            sys.settrace(None)
        return lines


def assert_flat(measure: Callable[[Crowd], int], **crowd: Any) -> None:
    small, large = measure(Crowd(SMALL, **crowd)), measure(Crowd(LARGE, **crowd))
    assert large <= small * GROWTH, (
        f"{large} lines with {LARGE} clients against {small} with {SMALL}: the work grows "
        "with the clients"
    )


def test_a_hand_off_costs_the_same_with_400_waiting_as_with_20() -> None:
    def hand_off(c: Crowd) -> int:
        return c.work(ev.LockReleased(c.holder, ev.ReleaseReason.IDLE))

    assert_flat(hand_off)


def test_joining_the_line_costs_the_same_however_long_it_is() -> None:
    def back_of_the_line(c: Crowd) -> int:
        c.feed(ev.LockReleased(c.holder, ev.ReleaseReason.IDLE))
        return c.work(ev.LockRequested(c.holder, 3))

    assert_flat(back_of_the_line)


def test_a_tick_costs_the_same_however_many_wait() -> None:
    assert_flat(lambda c: c.work(ev.Tick()))


def test_registering_costs_the_same_beside_400_idle_or_waiting_clients() -> None:
    assert_flat(lambda c: c.work(c.register))
    assert_flat(lambda c: c.work(c.register), waiting=False)


def test_a_waiter_leaving_costs_the_same_however_many_wait() -> None:
    assert_flat(lambda c: c.work(ev.ClientGone(c.n // 2)))
    assert_flat(lambda c: c.work(ev.ClientGone(c.holder)))


def test_a_priority_hint_costs_the_same_however_many_wait() -> None:
    assert_flat(lambda c: c.work(ev.PriorityHint(c.n // 2, -5)))


def test_a_gang_hint_and_a_memory_request_cost_the_same_however_many_wait() -> None:
    assert_flat(lambda c: c.work(ev.GangHint(c.n, "job")))
    assert_flat(lambda c: c.work(ev.MemoryReserveRequested(c.n // 2, 5, 1 << 20, 0)))


def test_idle_lenders_cost_a_hand_off_nothing() -> None:
    """Clients that let the GPU go idle and stay away (lenders, `terms.LendingRule`) are not
    looked at on every event."""

    def hand_off_beside_lenders(c: Crowd) -> int:
        for cid in range(2, c.n + 1):
            c.feed(ev.LockReleased(cid, ev.ReleaseReason.IDLE))  # gives up waiting
        return c.work(ev.LockReleased(c.holder, ev.ReleaseReason.IDLE))

    assert_flat(hand_off_beside_lenders)


@pytest.mark.parametrize("accounts", [False, True])
def test_a_hand_off_costs_the_same_with_priorities_quotas_and_shares(accounts: bool) -> None:
    """A line of three priorities; with `accounts`, every client has a compute quota and a
    guaranteed share (their windows turn while they wait)."""

    def hand_off(c: Crowd) -> int:
        for cid in range(2, c.n + 1, 3):
            c.feed(ev.PriorityHint(cid, -1 - cid % 2))
        c.now += 2.5  # windows turn: everyone waiting is owed its share again
        c.feed(ev.Tick())
        return c.work(ev.LockReleased(c.holder, ev.ReleaseReason.IDLE))

    limits = Limits(core_percent=50, priority=0, core_request=1) if accounts else Limits()
    policy = Policy(scheduler=SchedulerSettings(mode=Mode.ON, time_quantum_s=3600), defaults=limits)
    assert_flat(hand_off, policy=policy)


def test_the_next_deadline_is_a_query_that_bills_nobody() -> None:
    """Asked at a later time, the deadline leaves every account as it was."""
    policy = Policy(
        scheduler=SchedulerSettings(mode=Mode.ON, time_quantum_s=2),
        defaults=Limits(core_percent=50, priority=0, core_request=20),
    )
    c = Crowd(4, policy=policy)
    s = c.core.state
    c.now += 7.5  # windows have turned and the holder has held for a while
    before = [
        (replace(x.quota) if x.quota else None, replace(x.guarantee) if x.guarantee else None)
        for x in s.clients.values()
    ]
    gangs = [(g.billed_until, g.phase) for g in s.gangs.values()]
    assert c.core.lock.next_deadline(c.now) is not None
    after = [(x.quota, x.guarantee) for x in s.clients.values()]
    assert after == before
    assert [(g.billed_until, g.phase) for g in s.gangs.values()] == gangs


def test_a_priority_hint_said_again_costs_nothing() -> None:
    """A hook flooding PRIORITY_HINT with the value it already sent makes the core do no
    work: no limits resolved again, no schedule."""
    c = Crowd(SMALL)
    first = c.work(ev.PriorityHint(c.n, -1))
    again = [c.work(ev.PriorityHint(c.n, -1)) for _ in range(3)]
    assert max(again) * 4 < first, (first, again)


def test_a_status_lists_pods_in_one_pass_over_the_clients() -> None:
    """Status sums each pod's clients: work linear in the clients, as many pods as clients
    (it was a pass over every client for each pod)."""

    def work(n: int) -> int:
        core = NodeCore(Policy(), inventory={GPU: GpuFacts(uuid=GPU, memory_total=80 << 30)})
        for cid in range(1, n + 1):
            ident = ClientIdentity(pid=5000 + cid, uid=1000, gid=1000, pod_uid=f"pod-{cid}")
            core.handle(ev.ClientRegistered(cid, 1, ident, GPU, 80 << 30), 1.0)
        rows = tuple(core.client_rows(1.0))
        crowd = Crowd(0)
        crowd.core = core
        return crowd.work(lambda: core.status(1.0, rows))

    small, large = work(SMALL), work(LARGE)
    assert large <= small * LARGE / SMALL * GROWTH, (small, large)


def calls(c: Crowd, event: ev.Event, name: str) -> tuple[int, list[act.Action]]:
    """(calls of the appliance's functions called `name` while handling `event`, actions)."""
    count = 0

    def tracer(frame: FrameType, why: str, arg: Any) -> Any:
        nonlocal count
        count += frame.f_code.co_name == name

    sys.settrace(tracer)
    try:
        out = c.feed(event)
    finally:
        sys.settrace(None)
    return count, out


def test_a_lender_taking_its_gpu_back_while_it_is_held_reads_no_line() -> None:
    """The holder lets the GPU go idle; the next is granted; the first asks again inside its
    quantum and takes the GPU back (`priority.lent_back`). That drop frees the GPU for nobody
    before the release, so the line is read once, not again after the drop; and while the GPU
    is held and nobody waits for another, not at all (`calm`)."""
    c = Crowd(SMALL)
    c.feed(ev.LockReleased(1, ev.ReleaseReason.IDLE))
    passes, out = calls(c, ev.LockRequested(1, 3), "_grant_waiting")
    assert [a.client_id for a in out if isinstance(a, act.Drop)] == [2]
    assert passes == 0


def test_a_request_while_the_gpu_is_held_reads_no_line() -> None:
    """The client that just dropped asks again (as every other hand-off's old holder does):
    the GPU is held and every waiter waits for it, so nobody can be granted (`calm`) and the
    grant phase does not read the line, at 20 waiting as at 400."""
    for n in (SMALL, LARGE):
        c = Crowd(n)
        c.feed(ev.LockReleased(1, ev.ReleaseReason.IDLE))
        c.feed(ev.LockRequested(1, 3))  # takes the GPU back: 2 drops
        c.feed(ev.LockReleased(2, ev.ReleaseReason.DROPPED))
        assert calls(c, ev.LockRequested(2, 3), "_grant_waiting") == (0, [])


def test_a_hand_off_works_out_no_gpu_settings_again() -> None:
    """The policy and the GPU have not changed: their mode and quantum are looked up, not
    worked out from the policy's `gpus` rules again (a gang's quantum did, for no GPU)."""
    c = Crowd(SMALL)
    for event in (ev.LockReleased(1, ev.ReleaseReason.IDLE), ev.LockRequested(1, 3)):
        assert calls(c, event, "gpu_settings")[0] == 0


def test_the_deadline_after_a_hand_off_works_out_no_turn_again() -> None:
    """When each GPU's holder gives way is worked out by the event's preempt phase; the
    deadline the engine asks for right after the event reads it, instead of asking every GPU's
    holders and waiters again (a seventh of a hand-off's work in the core). Through a whole
    hand-off: the holder lets the GPU go idle, the next is granted, the first asks again and
    takes it back (the second drops), the second releases."""
    c = Crowd(SMALL)
    events = [
        ev.LockReleased(1, ev.ReleaseReason.IDLE),
        ev.LockRequested(1, 3),
        ev.LockReleased(2, ev.ReleaseReason.DROPPED),
        ev.Tick(),
    ]
    for event in events:
        c.now += 0.001
        c.core.handle(event, c.now)
        asked = 0

        def tracer(frame: FrameType, why: str, arg: Any) -> Any:
            nonlocal asked
            asked += frame.f_code.co_name == "next_yield"

        sys.settrace(tracer)
        try:
            deadline = c.core.next_deadline()
        finally:
            sys.settrace(None)
        assert asked == 0, type(event).__name__
        assert deadline == c.core.lock.next_deadline(c.now, afresh=True)
