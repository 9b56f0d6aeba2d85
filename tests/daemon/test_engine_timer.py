"""The engine wakes the core at the deadline the core asks for, no earlier, also when a timer
armed for an earlier deadline is kept (`Engine._arm_timer`: a deadline that moves later, as a
hand-off moves the next quantum's end, keeps the timer armed, which is armed again when it
fires before the deadline).

A real core on a real event loop whose clock the test sets (`SetClock`); a pass of the loop
runs the timers due by then. Order and counts, never the wall clock.
"""

from __future__ import annotations

import asyncio

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


def test_a_deadline_moved_later_wakes_the_core_then_and_not_at_the_earlier_one() -> None:
    loop, core = SetClock(), WatchedCore()
    try:
        engine = Engine(core, loop=loop)
        drops: list[int] = []
        engine.connect(lambda a: drops.append(a.client_id), act.Drop)
        engine.connect(lambda a: None, act.Registered, act.Grant, act.LockTerms)
        for cid in (1, 2, 3):
            ident = ClientIdentity(pid=100 + cid, uid=1000, gid=1000)
            engine.dispatch(ev.ClientRegistered(cid, 1, ident, GPU, 1 << 30))
            engine.dispatch(ev.LockRequested(cid, 2))  # 1 holds, 2 and 3 wait
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
