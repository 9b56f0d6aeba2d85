"""An idle hand-off between equals lends the GPU, it does not give the quantum away.

A loop whose first steps pause on the CPU (CUDA and cuBLAS loading, allocations) hands the GPU
over at every pause while another loop waits (`scheduler.idleHandoff`). If each pause cost it a
whole quantum of the other's, it would make no step for several quanta (issue 22: 100/0 over
15 s). So a holder of equal priority granted in its place gives way as soon as it asks again
inside its quantum, and the lender's quantum goes on from where it was (`priority.lent_back`)."""

from __future__ import annotations

import pytest

from appliance.core import actions as act
from appliance.core import events as ev
from appliance.core.node import NodeCore
from appliance.policy.model import Policy, SchedulerSettings

from .conftest import Harness, of
from .test_priority import LOW, by_uid

TQ = 5.0


def grants(out: list[act.Action]) -> list[int]:
    return [g.client_id for g in of(out, act.Grant)]


def drops(out: list[act.Action]) -> list[int]:
    return [d.client_id for d in of(out, act.Drop)]


def two_loops() -> tuple[Harness, int, int]:
    """a holds since 0; b asked at 0.5, and holds from a's quantum on (5 s)."""
    h = Harness(NodeCore(Policy(scheduler=SchedulerSettings(time_quantum_s=TQ))))
    a, b = h.register(), h.register()
    h.feed(ev.LockRequested(a, 1))
    h.advance(0.5)
    h.feed(ev.LockRequested(b, 1))
    assert drops(h.advance(TQ - 0.5)) == [a]
    h.feed(ev.LockRequested(a, 2))  # its next step asks at once
    assert grants(h.feed(ev.LockReleased(a, ev.ReleaseReason.DROPPED))) == [b]
    return h, a, b


def three_loops() -> tuple[Harness, int, int, int]:
    """a holds since 0; b, then c wait."""
    h = Harness(NodeCore(Policy(scheduler=SchedulerSettings(time_quantum_s=TQ))))
    a, b, c = h.register(), h.register(), h.register()
    for cid in (a, b, c):
        h.feed(ev.LockRequested(cid, 1))
    return h, a, b, c


def test_a_loop_pausing_in_its_first_steps_keeps_the_rest_of_its_quantum() -> None:
    h, a, b = two_loops()
    for n in range(3):  # three pauses in b's first step
        h.advance(0.05)
        assert grants(h.feed(ev.LockReleased(b, ev.ReleaseReason.IDLE))) == [a]
        h.advance(0.02)
        out = h.feed(ev.LockRequested(b, 2 + n))
        assert drops(out) == [a]  # at once, not after a's quantum
        h.feed(ev.LockRequested(a, 3 + n))
        assert grants(h.feed(ev.LockReleased(a, ev.ReleaseReason.DROPPED))) == [b]
    # b's quantum still runs from its grant at 5 s: a has the GPU back at 10 s, not later.
    assert drops(h.advance(10.0 - 0.21 - 5.0 - 0.01)) == []
    assert drops(h.advance(0.02)) == [b]


def test_a_lender_back_after_its_quantum_waits_like_anyone() -> None:
    h, a, b = two_loops()
    h.advance(TQ - 1)
    assert grants(h.feed(ev.LockReleased(b, ev.ReleaseReason.IDLE))) == [a]
    h.advance(2)  # b's quantum (5 to 10 s) is over when it asks again
    assert drops(h.feed(ev.LockRequested(b, 2))) == []
    # a borrowed the last second of b's quantum; its own runs from where b's ended (10 s)
    assert drops(h.advance(TQ - 1 - 0.01)) == []
    assert drops(h.advance(0.02)) == [a]


def test_with_a_third_loop_waiting_the_lender_has_its_gpu_back_and_nobody_is_granted_in_vain() -> (
    None
):
    # a holds, b and c wait; a pauses (b borrows) and asks again inside its quantum. b drops
    # at once; at b's release a is granted, not c: c was granted and told to drop in the same
    # breath before (its hook starting work it must drain at once), and a waited for it.
    h, a, b, c = three_loops()
    h.advance(1.0)
    assert grants(h.feed(ev.LockReleased(a, ev.ReleaseReason.IDLE))) == [b]
    h.advance(0.02)
    assert drops(h.feed(ev.LockRequested(a, 2))) == [b]
    out = h.feed(ev.LockReleased(b, ev.ReleaseReason.DROPPED))
    assert grants(out) == [a] and drops(out) == []
    # a's quantum runs on from its first grant: c's turn comes at 5 s, then b's.
    assert drops(h.advance(TQ - 1.02 - 0.01)) == []
    assert drops(h.advance(0.02)) == [a]
    assert grants(h.feed(ev.LockReleased(a, ev.ReleaseReason.DROPPED))) == [c]


def test_an_idle_release_after_a_drop_lends_nothing() -> None:
    # A hook that went idle as its drop arrived releases "idle"; its turn was over all the
    # same. Counted as a lend, the borrower that a lender took the GPU back from would take it
    # back in turn, and the two would hand it to and fro.
    h, a, b = two_loops()
    h.advance(0.05)
    assert grants(h.feed(ev.LockReleased(b, ev.ReleaseReason.IDLE))) == [a]  # b lends to a
    h.advance(0.02)
    assert drops(h.feed(ev.LockRequested(b, 2))) == [a]  # and takes it back
    out = h.feed(ev.LockReleased(a, ev.ReleaseReason.IDLE))  # a, told to drop, was idle
    assert grants(out) == [b]
    h.advance(0.01)
    out = h.feed(ev.LockRequested(a, 4))
    assert drops(out) == [] and grants(out) == []


@pytest.mark.parametrize(
    ("works", "borrows", "lends"),
    [(0.5, 0.01, 3), (0.02, 0.2, 5)],
    ids=["short-borrows", "borrows-longer-than-it-waited"],
)
def test_a_borrower_the_lender_takes_back_from_keeps_its_place_in_line(
    works: float, borrows: float, lends: int
) -> None:
    # a lends and asks again a moment later: the borrower's time was a's. b goes next when
    # a's quantum is over, not behind c: else a lender that lends and asks again would send
    # every waiter it lends to to the back, one by one. So also when a borrower borrows each
    # pause for longer than it waited for it (it asks again as it drains): a loop fed by a
    # data loader pauses long and works briefly (on an H200 with four loops, a borrower sent
    # back for such a turn put the loop that had just had its quantum first: it held two
    # quanta in a row, 32 % of the GPU for 25 % due). And what a lends goes round b and c,
    # not all to b on top of its turn (`bucket.Bucket.next_borrower`).
    h = Harness(NodeCore(Policy(scheduler=SchedulerSettings(time_quantum_s=TQ))))
    a, b, c = h.register(), h.register(), h.register()
    h.feed(ev.LockRequested(a, 1))
    h.advance(0.1)
    h.feed(ev.LockRequested(b, 1))
    h.advance(0.1)
    h.feed(ev.LockRequested(c, 1))
    for n in range(lends):
        borrower = (b, c)[n % 2]
        h.advance(works)
        assert grants(h.feed(ev.LockReleased(a, ev.ReleaseReason.IDLE))) == [borrower]
        h.advance(borrows)
        assert drops(h.feed(ev.LockRequested(a, 2 + n))) == [borrower]
        h.feed(ev.LockRequested(borrower, 2 + n))  # its hook asks again as it drains
        assert grants(h.feed(ev.LockReleased(borrower, ev.ReleaseReason.DROPPED))) == [a]
    assert h.state.clients[b].usage.drops == {"lent": (lends + 1) // 2}
    assert h.state.clients[c].usage.drops == {"lent": lends // 2}
    assert drops(h.advance(TQ)) == [a]
    assert grants(h.feed(ev.LockReleased(a, ev.ReleaseReason.DROPPED))) == [b]


def test_a_lender_that_asked_back_as_its_quantum_ended_gets_no_fresh_one() -> None:
    # a lends just before its quantum is over and asks again at once; b's drain ends after it.
    # a's quantum is over: it gets no new one ahead of b and c (else a loop that pauses often
    # would chain quanta while the others wait: four loops on the core's clock, one waited four
    # turns instead of three), nor, as before, the nothing left of it, granted and dropped in
    # the same instant (an empty drain): b, whose place in line was kept, has its turn.
    h, a, b, c = three_loops()
    h.advance(TQ - 0.01)
    assert grants(h.feed(ev.LockReleased(a, ev.ReleaseReason.IDLE))) == [b]
    h.advance(0.005)
    assert drops(h.feed(ev.LockRequested(a, 2))) == [b]
    h.feed(ev.LockRequested(b, 2))
    h.advance(0.01)  # b's drain ends past a's quantum
    out = h.feed(ev.LockReleased(b, ev.ReleaseReason.DROPPED)) + h.advance(0.001)
    assert (grants(out), drops(out)) == ([b], [])
    assert drops(h.advance(TQ)) == [b]
    assert grants(h.feed(ev.LockReleased(b, ev.ReleaseReason.DROPPED))) == [c]


def test_a_lender_taking_back_is_not_hidden_by_one_that_asked_after_its_quantum() -> None:
    # c lent its GPU long ago and was never granted since (a loop that paused as its warm-up
    # ended, then asked again much later): it still counts as a lender, of a quantum long over.
    # b then lends inside its own quantum to d, next in line, and asks again: d gives way at
    # once. Before, the line read only the earliest lender of the bucket (c), saw that it did
    # not take back, and d held a whole quantum of b's (four loops on an H200: the data loader's
    # share 15.6 % where 25 % was due, 20 s without a step).
    h = Harness(NodeCore(Policy(scheduler=SchedulerSettings(time_quantum_s=TQ))))
    a, b, c, d = h.register(), h.register(), h.register(), h.register()
    h.feed(ev.LockRequested(c, 1))
    h.advance(0.5)
    h.feed(ev.LockReleased(c, ev.ReleaseReason.IDLE))  # lends (nobody waits)
    h.advance(TQ)
    h.feed(ev.LockRequested(a, 1))  # a holds; b, d, then c wait
    h.feed(ev.LockRequested(b, 1))
    h.feed(ev.LockRequested(d, 1))
    h.feed(ev.LockRequested(c, 2))  # its quantum long over
    assert drops(h.advance(TQ)) == [a]
    h.feed(ev.LockRequested(a, 2))
    assert grants(h.feed(ev.LockReleased(a, ev.ReleaseReason.DROPPED))) == [b]
    h.advance(0.02)
    assert grants(h.feed(ev.LockReleased(b, ev.ReleaseReason.IDLE))) == [d]  # d borrows
    h.advance(0.01)
    assert drops(h.feed(ev.LockRequested(b, 2))) == [d]  # b takes its GPU back at once
    h.feed(ev.LockRequested(d, 2))
    assert grants(h.feed(ev.LockReleased(d, ev.ReleaseReason.DROPPED))) == [b]


def test_what_a_borrower_lends_on_it_does_not_take_back_from_its_lender() -> None:
    # a's quantum: it lends to b (next in line), b pauses too and lends to c. a asks again:
    # c gives way to a, and b, asking again, waits for a's quantum to end at its place, first
    # in line: b took back, before, as if a's quantum were its own, from a itself.
    h, a, b, c = three_loops()
    h.advance(1.0)
    assert grants(h.feed(ev.LockReleased(a, ev.ReleaseReason.IDLE))) == [b]
    h.advance(0.01)
    assert grants(h.feed(ev.LockReleased(b, ev.ReleaseReason.IDLE))) == [c]
    h.advance(0.01)
    assert drops(h.feed(ev.LockRequested(a, 2))) == [c]
    assert drops(h.feed(ev.LockRequested(b, 2))) == []
    h.feed(ev.LockRequested(c, 2))
    out = h.feed(ev.LockReleased(c, ev.ReleaseReason.DROPPED))
    assert grants(out) == [a] and drops(out) == []  # (not granted only to give way to b)
    # a has its own quantum back, not b's lend of it: what a lends again it takes back.
    h.advance(0.01)
    assert grants(h.feed(ev.LockReleased(a, ev.ReleaseReason.IDLE))) == [b]
    h.advance(0.01)
    assert drops(h.feed(ev.LockRequested(a, 3))) == [b]
    h.feed(ev.LockRequested(b, 3))
    assert grants(h.feed(ev.LockReleased(b, ev.ReleaseReason.DROPPED))) == [a]
    assert drops(h.advance(TQ - 1.04 - 0.01)) == []
    assert drops(h.advance(0.02)) == [a]  # a's own quantum, from 0
    h.feed(ev.LockRequested(a, 4))
    assert grants(h.feed(ev.LockReleased(a, ev.ReleaseReason.DROPPED))) == [b]  # then b, not c


def test_what_an_equal_lends_goes_round_and_a_new_process_waits_its_turn_for_it() -> None:
    # a lends its pauses; b and c wait. b borrows, then c (not b again: the loop first in line
    # would have every pause on top of its own turn). A process a tenant starts meanwhile, d,
    # has borrowed nothing, but came after b and c borrowed: the next lend is b's, not d's;
    # d's turn to borrow comes after b's and c's.
    h, a, b, c = three_loops()
    h.advance(0.1)
    borrowers = []
    for n in range(5):
        if n == 2:
            d = h.register()
            h.feed(ev.LockRequested(d, 1))
        h.advance(0.05)
        borrowers += grants(h.feed(ev.LockReleased(a, ev.ReleaseReason.IDLE)))
        h.advance(0.05)
        assert drops(h.feed(ev.LockRequested(a, 2 + n))) == borrowers[-1:]
        h.feed(ev.LockRequested(borrowers[-1], 2 + n))
        h.feed(ev.LockReleased(borrowers[-1], ev.ReleaseReason.DROPPED))
    assert borrowers == [b, c, b, c, d]
    # and the turns keep the line's order: b, c, then d
    order = []
    for _ in range(3):
        out = h.advance(TQ)
        (holder,) = drops(out)
        h.feed(ev.LockRequested(holder, 99))
        order += grants(h.feed(ev.LockReleased(holder, ev.ReleaseReason.DROPPED)))
    assert order == [b, c, d]


def test_a_borrower_granted_again_after_lending_borrows_on_and_takes_nothing_back() -> None:
    # b borrows a's quantum, lends it (nobody waits) and asks again: granted, it still borrows
    # a's quantum. Before, it had a quantum of its own from then on, beside a's: a took back
    # what it lent from b, and b what it lent from a, each granted and dropped at once as the
    # other asked (two request loops on a GPU, 298 times in 600 s on the core's clock).
    h = Harness(NodeCore(Policy(scheduler=SchedulerSettings(time_quantum_s=TQ))))
    a, b = h.register(), h.register()
    h.feed(ev.LockRequested(a, 1))
    h.advance(0.01)
    h.feed(ev.LockReleased(a, ev.ReleaseReason.IDLE))  # a lends inside its quantum
    h.advance(0.01)
    assert grants(h.feed(ev.LockRequested(b, 1))) == [b]  # b borrows it
    h.advance(0.01)
    h.feed(ev.LockReleased(b, ev.ReleaseReason.IDLE))  # b lends what it borrowed
    h.advance(0.01)
    assert grants(h.feed(ev.LockRequested(b, 2))) == [b]
    h.advance(0.01)
    h.feed(ev.LockReleased(b, ev.ReleaseReason.IDLE))
    h.advance(0.01)
    assert grants(h.feed(ev.LockRequested(a, 2))) == [a]  # a takes its quantum back
    assert drops(h.feed(ev.LockRequested(b, 3))) == []  # b has none to take back
    assert drops(h.advance(TQ - 0.06 + 0.001)) == [a]  # a's quantum over: b's turn


def test_two_equals_that_each_lent_a_quantum_of_their_own_are_not_granted_and_dropped() -> None:
    # Two low data loaders borrow a normal loop's idle time in turn, each granted a quantum of
    # its own and lending it at its next pause; the normal loop takes the GPU, and both ask
    # again. Before: the first granted, as the normal loop handed over, was dropped in that
    # instant for the other, which took back what it had lent (27 times in 600 s in a random
    # crowd of `bench/crowd_model.py sweep --two-gpus --tq 30`). Each resumes its own quantum:
    # neither takes it from the other.
    h = by_uid({1: LOW, 2: 0}, SchedulerSettings(time_quantum_s=TQ, idle_handoff_s=0.005))
    top, x, y = h.register(uid=2), h.register(uid=1), h.register(uid=1)
    seq = dict.fromkeys((top, x, y), 0)

    def step(cid: int) -> None:  # asks, is granted, works 20 ms and pauses
        seq[cid] += 1
        assert grants(h.feed(ev.LockRequested(cid, seq[cid]))) == [cid]
        h.advance(0.02)
        h.feed(ev.LockReleased(cid, ev.ReleaseReason.IDLE))

    for cid in (top, x, top, y):
        step(cid)
    assert grants(h.feed(ev.LockRequested(top, 9))) == [top]
    h.advance(0.01)
    for cid in (x, y):
        h.feed(ev.LockRequested(cid, 9))
    h.advance(0.04)
    out = h.feed(ev.LockReleased(top, ev.ReleaseReason.IDLE))
    assert (grants(out), drops(out)) == ([x], [])
    h.advance(0.02)
    out = h.feed(ev.LockReleased(x, ev.ReleaseReason.IDLE))
    assert (grants(out), drops(out)) == ([y], [])


def test_a_lender_whose_quantum_ran_out_behind_a_starved_turn_waits_its_turn() -> None:
    # Two busy equals take turns above a low loop. The holder lends as the low one's wait
    # passes the starvation limit, and asks again inside its quantum: the starved loop keeps
    # its turn, and the lender's quantum runs out meanwhile. Before: at the end of that turn
    # the lender was still read as taking back, granted first with nothing left, and dropped
    # in that instant for the equal that waited (in `bench/crowd_model.py sweep --serving`).
    # Now the equal that waited is granted, and the lender after it.
    settings = SchedulerSettings(time_quantum_s=TQ, starvation_limit_s=30.0, idle_handoff_s=0.005)
    h = by_uid({1: LOW, 2: 0}, settings)
    low, a, b = h.register(uid=1), h.register(uid=2), h.register(uid=2)
    seq = dict.fromkeys((low, a, b), 0)
    turns: list[tuple[list[int], list[int]]] = []

    def ask(cid: int) -> None:
        seq[cid] += 1
        h.feed(ev.LockRequested(cid, seq[cid]))

    def run_to(t: float) -> None:  # busy loops: each drop released 2 ms later, asked again
        while (due := h.core.next_deadline()) is not None and due <= t:
            for cid in drops(h.advance(due - h.now + 1e-9)):
                h.advance(0.002)
                out = h.feed(ev.LockReleased(cid, ev.ReleaseReason.DROPPED))
                turns.append((grants(out), drops(out)))
                ask(cid)
        h.advance(t - h.now)

    start = h.now
    ask(low)
    h.advance(0.001)
    ask(a)
    h.advance(0.5)
    ask(b)
    run_to(start + 31.005)  # a and b alternate; the low loop is starved from 31.001 s
    holder = a if h.state.clients[a].phase.name == "HOLDING" else b
    other = b if holder == a else a
    assert grants(h.feed(ev.LockReleased(holder, ev.ReleaseReason.IDLE))) == [low]
    h.advance(0.003)
    ask(holder)  # inside its quantum, which ends a few milliseconds later
    turns.clear()
    run_to(start + 42.0)
    assert turns[:2] == [([other], []), ([holder], [])]
