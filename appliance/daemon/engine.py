"""The engine: where events meet the core and actions leave it, all on the event loop.

The core is sans-I/O: it needs the time with every event and a wake-up call at the deadline it
asks for. The engine gives it both: the time from CLOCK_MONOTONIC to the microsecond (the
loop's own clock, uvloop's, is libuv's: the same clock in whole milliseconds, and the core
learns sub-millisecond windows from it), the wake-up from the loop's timers, which count whole
milliseconds and may fire before the deadline by a fraction of one: such a wake-up waits on
(`_wake`), so the core is never woken before its deadline. It routes every action the
core returns to the sink connected for that action's type (the socket server, the Kubernetes
Event recorder, the device plugin). Nothing else calls the core.

Three ways in, one per kind of caller:
- `dispatch(event)`: on the loop (the socket server's frames, the timer);
- `submit(event)`: from any thread (policy, pod and NVML sources); a failure is logged with its
  cause and the loop and the source carry on;
- `read(fn)`: from any thread, for a reader that must see a consistent state (the device
  plugin's placement, the probes): `fn` runs on the loop and its result is handed back;
- `read_steps(steps)`: the same for a long read (a metrics scrape's status at thousands of
  clients): a step on each pass of the loop, events handled in between.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from appliance.core import events as ev
from appliance.core.node import NodeCore

log = logging.getLogger("nvshare.engine")

T = TypeVar("T")
TIMER_TICK_S = 0.001  # what the loop's timers count in (libuv's); a wake-up before its deadline
Sink = Callable[[Any], None]


class Engine:
    def __init__(
        self,
        core: NodeCore,
        *,
        loop: asyncio.AbstractEventLoop,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`clock`: the core's time, on the clock the loop's timers count (CLOCK_MONOTONIC)."""
        self._core = core
        self._loop = loop
        self._clock = clock
        self._sinks: dict[type, Sink] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._deadline: float | None = None  # when `_timer` fires
        self._wanted: float | None = None  # when the core asked to be woken, as of its last event
        self.generation = 0  # counts the events fed: whatever was read of the core before is stale

    def connect(self, sink: Sink, *kinds: type) -> None:
        """Send every action of these types to `sink` (called on the loop, never blocking)."""
        for kind in kinds:
            if kind in self._sinks:
                raise ValueError(f"{kind.__name__} already goes to {self._sinks[kind]!r}")
            self._sinks[kind] = sink

    def now(self) -> float:
        return self._clock()

    def dispatch(self, event: ev.Event) -> None:
        """Feed one event to the core and route what it returns (event-loop thread only)."""
        self.generation += 1
        actions = self._core.handle(event, self._clock())
        for action in actions:
            sink = self._sinks.get(type(action))
            if sink is None:
                log.debug("nothing is connected for %s; dropped", type(action).__name__)
                continue
            try:
                sink(action)
            except Exception:  # one broken sink must not starve the others, nor the core
                log.exception("sink %r failed on %s; carrying on", sink, action)
        self._arm_timer()

    def submit(self, event: ev.Event) -> None:
        """`dispatch` from another thread: queued on the loop, returns at once."""

        def guarded() -> None:
            try:
                self.dispatch(event)
            except Exception:
                log.exception("handling %s failed; carrying on", type(event).__name__)

        self._loop.call_soon_threadsafe(guarded)

    def read(self, fn: Callable[[], T], *, timeout_s: float = 5.0) -> T:
        """Run `fn` on the loop and return its result (another thread only); TimeoutError
        when the loop does not get to it in time, and then it is not run later either."""
        future = asyncio.run_coroutine_threadsafe(_call(fn), self._loop)
        try:
            return future.result(timeout=timeout_s)
        except concurrent.futures.TimeoutError:  # TimeoutError itself from Python 3.11
            future.cancel()
            raise

    def read_steps(self, steps: Callable[[], Iterator[T | None]], *, timeout_s: float = 5.0) -> T:
        """Like `read`, for a read done in steps: `steps()` yields None after each slice of
        work and then its result; one step runs on each pass of the loop, so events wait at
        most a slice behind it. TimeoutError when not done in time (then it stops)."""
        done: concurrent.futures.Future[T] = concurrent.futures.Future()

        def step(it: Iterator[T | None]) -> None:
            if done.cancelled():
                return
            try:
                result = next(it)
            except Exception as exc:  # the reader gets the failure, the loop carries on
                done.set_exception(exc)
                return
            if result is None:
                self._loop.call_soon(step, it)
            else:
                done.set_result(result)

        self._loop.call_soon_threadsafe(lambda: step(steps()))
        try:
            return done.result(timeout=timeout_s)
        except concurrent.futures.TimeoutError:
            done.cancel()
            raise

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
            self._deadline = None

    def _arm_timer(self) -> None:
        """Wake the core at the deadline it asks for. A timer armed for that deadline or an
        earlier one stays: most events leave the deadline where it was (a lock request in
        line) or move it later (each hand-off moves the new holder's drop deadline on), and
        cancelling and arming a timer for each cost about 1 % of a hand-off, and left a
        cancelled timer on the loop's heap per event. A timer that fires before the deadline
        the core asks for then is armed again for it (`_wake`): the core is woken exactly at
        its deadlines, as if every event had armed its own."""
        wanted = self._wanted = self._core.next_deadline()
        if wanted is None or (self._deadline is not None and self._deadline <= wanted):
            return  # (nothing is due: a timer still armed wakes to nothing)
        self.close()
        self._arm_at(wanted)

    def _arm_at(self, deadline: float, *, at_least: float = 0.0) -> None:
        wait = max(deadline - self._clock(), at_least)
        self._timer = self._loop.call_later(wait, self._wake)
        self._deadline = deadline

    def _wake(self) -> None:
        fired, self._timer, self._deadline = self._deadline, None, None
        wanted = self._wanted
        if wanted is None:
            return  # nothing became due since it was armed
        if fired is None or fired < wanted:  # armed for a deadline the core has since moved later
            self._arm_at(wanted)
        elif self._clock() < wanted:  # a timer of whole milliseconds fired before the deadline
            self._arm_at(wanted, at_least=TIMER_TICK_S)
        else:
            self.dispatch(ev.Tick())  # (it arms the next)


async def _call(fn: Callable[[], T]) -> T:
    return fn()
