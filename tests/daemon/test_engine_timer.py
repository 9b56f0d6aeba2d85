"""The engine wakes the core at the deadline the core asks for, no earlier, also when a timer
armed for an earlier deadline is kept (`Engine._arm_timer`: a deadline that moves later, as a
hand-off moves the next quantum's end, keeps the timer armed, which is armed again when it
fires before the deadline).

A real core on a real event loop whose clock the test sets (`SetClock`); a pass of the loop
runs the timers due by then. Order and counts, never the wall clock.
"""

from __future__ import annotations

import asyncio
import itertools
import time

import uvloop

from appliance.core import actions as act
from appliance.core import events as ev
from appliance.core.gpus import GpuFacts
from appliance.core.identity import ClientIdentity
from appliance.core.node import NodeCore
from appliance.daemon.engine import Engine
from appliance.policy.model import Mode, Policy, SchedulerSettings

GPU = "GPU-00000000-0000-0000-0000-0000000000e1"
QUANTUM_S = 0.2


class SetClock(asyncio.SelectorEventLoop):
    """An event loop whose clock reads what the test set."""

    now = 100.0

    def time(self) -> float:
        return self.now

    def passes(self) -> None:
        """Run the loop until what is due by `now` has run (a task's two passes)."""
        self.run_until_complete(asyncio.sleep(0))


class WatchedCore(NodeCore):
    """A real core that notes each Tick it is fed, with the deadline it had asked for."""

    def __init__(self) -> None:
        policy = Policy(scheduler=SchedulerSettings(mode=Mode.ON, time_quantum_s=QUANTUM_S))
        super().__init__(policy, inventory={GPU: GpuFacts(uuid=GPU, memory_total=1 << 30)})
        self.asked: float | None = None
        self.ticks: list[tuple[float, float | None]] = []  # (now, the deadline asked before)

    def handle(self, event: ev.Event, now: float) -> list[act.Action]:
        if isinstance(event, ev.Tick):
            self.ticks.append((now, self.asked))
        return super().handle(event, now)

    def next_deadline(self) -> float | None:
        self.asked = super().next_deadline()
        return self.asked


def _in_line(loop: SetClock, core: WatchedCore, clients: int) -> tuple[Engine, list[int]]:
    """An engine on the test's clock with `clients` asking for the lock in turn (the first
    holds); the clients told to drop, as they are."""
    engine = Engine(core, loop=loop, clock=loop.time)
    drops: list[int] = []
    engine.connect(lambda a: drops.append(a.client_id), act.Drop)
    engine.connect(lambda a: None, act.Registered, act.Grant, act.LockTerms)
    for cid in range(1, clients + 1):
        ident = ClientIdentity(pid=100 + cid, uid=1000, gid=1000)
        engine.dispatch(ev.ClientRegistered(cid, 1, ident, GPU, 1 << 30))
        engine.dispatch(ev.LockRequested(cid, 2))
    return engine, drops


def test_a_deadline_moved_later_wakes_the_core_then_and_not_at_the_earlier_one() -> None:
    loop, core = SetClock(), WatchedCore()
    try:
        engine, drops = _in_line(loop, core, 3)  # 1 holds, 2 and 3 wait
        assert core.asked == 100.0 + QUANTUM_S  # 1's quantum ends: a timer is armed then
        loop.now = 100.1
        engine.dispatch(ev.LockReleased(1, ev.ReleaseReason.EXIT))  # 2 holds, 3 waits
        assert core.asked == 100.1 + QUANTUM_S
        loop.now = 100.0 + QUANTUM_S  # the first timer's time: nothing is due
        loop.passes()
        assert core.ticks == [] and drops == []
        loop.now = 100.1 + QUANTUM_S  # 2's quantum ends
        loop.passes()
        assert core.ticks == [(100.1 + QUANTUM_S, 100.1 + QUANTUM_S)]
        assert drops == [2]
        engine.close()
    finally:
        loop.close()


class EarlyTimers(SetClock):
    """A loop whose timers fire up to half a millisecond before the time asked for, as
    libuv's (uvloop's) whole-millisecond timers may."""

    def call_at(self, when, callback, *args, context=None):  # type: ignore[no-untyped-def,override]
        return super().call_at(when - 0.0005, callback, *args, context=context)


def test_a_timer_that_fires_before_the_deadline_does_not_wake_the_core_early() -> None:
    loop, core = EarlyTimers(), WatchedCore()
    try:
        engine, drops = _in_line(loop, core, 2)  # 1 holds, 2 waits
        deadline = 100.0 + QUANTUM_S
        assert core.asked == deadline
        loop.now = deadline - 0.0004  # the timer fires: the quantum is not over yet
        loop.passes()
        assert core.ticks == [] and drops == []
        loop.now = deadline + 0.0006  # it waited on, a millisecond at most
        loop.passes()
        assert core.ticks == [(deadline + 0.0006, deadline)]
        assert drops == [1]
        engine.close()
    finally:
        loop.close()


def test_on_the_daemons_loop_the_core_is_told_the_time_to_the_microsecond() -> None:
    """uvloop's own clock counts whole milliseconds; the core learns sub-millisecond idle
    windows and holds from the times of events, so the engine reads CLOCK_MONOTONIC."""
    loop, core = uvloop.new_event_loop(), WatchedCore()
    try:
        engine = Engine(core, loop=loop)
        seen: list[float] = []
        for _ in range(3):
            engine.dispatch(ev.Tick())
            seen.append(core.ticks[-1][0])
            until = time.monotonic() + 0.0003
            while time.monotonic() < until:
                pass
        gaps = [b - a for a, b in itertools.pairwise(seen)]
        assert all(0.0002 < gap < 0.05 for gap in gaps), gaps
        engine.close()
    finally:
        loop.close()
