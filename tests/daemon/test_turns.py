"""Heartbeats and registrations are answered ahead of scheduling work, however much waits.

The daemon runs on a loop the test drives (`driven`): every frame is written while the loop
stands still, then the loop runs a pass at a time. Order and counts, never the clock.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import uvloop

from appliance.core.views import StatusView
from appliance.daemon.queries import Answers
from appliance.wire import protocol as p

from .driven import Peer, connected, daemon, register, registered, until

FLOOD = 100  # connections
FRAMES = 8  # lock request and release, four times each: one turn of a connection


def test_a_heartbeat_is_answered_before_a_flood_of_lock_requests_is_handled(
    tmp_path: Path,
) -> None:
    async def main() -> None:
        async with daemon(tmp_path) as (server, engine):
            flood = [Peer(server.path) for _ in range(FLOOD)]
            beat = Peer(server.path)
            await registered([*flood, beat])
            before = engine.generation
            for peer in flood:  # all written while the loop stands still
                peer.send(*[p.LockRequest(), p.LockReleased(p.ReleaseReason.IDLE)] * 4)
            beat.send(p.Heartbeat())
            await until(lambda: any(isinstance(m, p.HeartbeatAck) for m in beat.read()))
            handled = engine.generation - before
            assert handled < FLOOD * FRAMES // 2, (
                f"the heartbeat was answered after {handled} of the flood's "
                f"{FLOOD * FRAMES} frames: it waited behind them"
            )
            await until(lambda: engine.generation - before == FLOOD * FRAMES)  # none lost

    uvloop.run(main())


def test_a_registration_goes_ahead_of_lock_requests_waiting_their_turn(tmp_path: Path) -> None:
    async def main() -> None:
        async with daemon(tmp_path) as (server, engine):
            flood = [Peer(server.path) for _ in range(FLOOD)]
            await registered(flood)
            late = Peer(server.path)
            before = engine.generation
            for peer in flood:
                peer.send(*[p.LockRequest(), p.LockReleased(p.ReleaseReason.IDLE)] * 4)
            register(late)
            await until(lambda: any(isinstance(m, p.Registered) for m in late.read()))
            handled = engine.generation - before
            assert handled < FLOOD * FRAMES // 2, (
                f"the registration was answered after {handled} of the flood's "
                f"{FLOOD * FRAMES} frames: it waited behind them"
            )

    uvloop.run(main())


def test_a_hand_off_is_not_kept_waiting_while_status_is_built(tmp_path: Path) -> None:
    """Status of 150 clients is built a slice at a time: a hand-off asked after it is
    granted before the status document is done."""

    async def main() -> None:
        async with daemon(tmp_path, status_slice_s=0.0) as (server, engine):
            hooks = await connected(server.path, 150)
            await registered(hooks)
            holder, waiter = hooks[0], hooks[1]
            status = Peer(server.control_path)  # accepted while the lock is taken
            holder.send(p.LockRequest())
            await until(lambda: any(isinstance(m, p.LockGrant) for m in holder.read()))
            waiter.send(p.LockRequest())
            asked = engine.generation
            await until(lambda: engine.generation > asked)  # in line behind the holder
            status.send(p.StatusRequest())  # written first: read first
            holder.send(p.LockReleased(p.ReleaseReason.IDLE))
            granted_meanwhile = False

            def status_done() -> bool:
                nonlocal granted_meanwhile
                granted = any(isinstance(m, p.LockGrant) for m in waiter.read())
                done = any(isinstance(m, p.JsonBody) for m in status.read())
                granted_meanwhile |= granted and not done
                return done

            await until(status_done)
            assert granted_meanwhile, "the hand-off waited for the whole status document"
            doc = next(m for m in status.got if isinstance(m, p.JsonBody)).doc
            assert len(doc["clients"]) == 150

    uvloop.run(main())


def test_events_are_handled_while_a_scrape_reads_status(tmp_path: Path) -> None:
    """A metrics scrape (another thread) reads the status of 150 clients a slice at a time
    (`Engine.read_steps`): hooks' requests sent meanwhile are handled between its steps,
    not after the whole of it."""

    async def main() -> None:
        got: list[Answers] = []
        async with daemon(tmp_path, answers_out=got) as (server, engine):
            (answers,) = got
            hooks = await connected(server.path, 150)
            await registered(hooks)
            seen: list[int] = []  # the events handled by each step of the scrape

            def steps() -> Iterator[StatusView | None]:
                for step in answers.status_slices(slice_s=0.0):  # a row a pass
                    seen.append(engine.generation)
                    yield step

            loop = asyncio.get_running_loop()
            scrape = loop.run_in_executor(None, lambda: engine.read_steps(steps))

            def scraped() -> bool:
                hooks[0].send(p.LockRequest(), p.LockReleased(p.ReleaseReason.IDLE))
                return scrape.done()

            await until(scraped)
            assert len((await scrape).clients) == 150
            assert seen[-1] > seen[0], "no event was handled until the whole status was read"

    uvloop.run(main())
