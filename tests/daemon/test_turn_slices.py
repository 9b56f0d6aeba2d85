"""How much of a pass of the event loop turns take (`connection.Turns`), on a clock the test
moves: each turn costs an eighth of the slice, and the test says when a pass ends.

A pass takes at most a slice of turns before the loop reads again; what turns cost is
forgotten at the start of a pass once it reaches half a slice, and carried over until then, so
a pass also gets at least half a slice (a hand-off's few turns per pass no longer queue a loop
callback each, which cost as much as the rest of its frame handling).
"""

from __future__ import annotations

import asyncio

import uvloop

from appliance.serve.connection import Turns

SLICE = 1.0
TURN = 0.125  # what one turn costs on the test's clock (exact in binary)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Hook:
    """A connection with one frame to handle: its turn moves the clock by `TURN`."""

    registering = False
    closed = False
    transport = None

    def __init__(self, clock: Clock, number: int, served: list[int]) -> None:
        self.clock = clock
        self.tenant = ("connection", number)
        self.number = number
        self.served = served
        self.turn_waiting = False

    def serve_turn(self) -> None:
        self.clock.now += TURN
        self.served.append(self.number)


def at_once(turns: Turns, hooks: list[Hook]) -> int:
    """Every hook asks in this pass; how many were served there and then (the rest wait)."""
    served = hooks[0].served
    before = len(served)
    for hook in hooks:
        turns.serve(hook)  # type: ignore[arg-type]
    return len(served) - before


def test_a_pass_takes_at_most_a_slice_of_turns_and_the_rest_wait_for_later_passes() -> None:
    async def main() -> None:
        clock, served = Clock(), []
        turns = Turns(slice_s=SLICE, clock=clock)
        hooks = [Hook(clock, n, served) for n in range(25)]
        assert at_once(turns, hooks) == 8
        assert all(h.turn_waiting for h in hooks[8:])
        for _ in range(3):
            await asyncio.sleep(0)
        assert served == list(range(25)), "waiting turns are taken in later passes, in order"

    uvloop.run(main())


def test_turns_under_half_a_slice_carry_over_into_the_next_pass() -> None:
    async def main() -> None:
        clock, served = Clock(), []
        turns = Turns(slice_s=SLICE, clock=clock)
        hooks = [Hook(clock, n, served) for n in range(9)]
        assert at_once(turns, hooks[:3]) == 3  # 3/8 of the slice: not forgotten
        await asyncio.sleep(0)
        assert at_once(turns, hooks[3:9]) == 5  # 3/8 + 5/8: a slice; the last one waits
        assert hooks[8].turn_waiting

    uvloop.run(main())


def test_turns_past_half_a_slice_are_forgotten_at_the_next_pass() -> None:
    async def main() -> None:
        clock, served = Clock(), []
        turns = Turns(slice_s=SLICE, clock=clock)
        hooks = [Hook(clock, n, served) for n in range(15)]
        assert at_once(turns, hooks[:5]) == 5  # 5/8 of the slice
        await asyncio.sleep(0)
        assert at_once(turns, hooks[5:15]) == 8  # a whole slice again

    uvloop.run(main())
