"""The queue bound (`scheduler.borrowerQueue`, `TermsRule.queue`, ld_hook/pace.h) on the core's
fake clock: told to a holder on a GPU a higher priority lent it, with the grant and again when
that stops being so; never to a holder whose GPU an equal lent, nor with the bound off."""

from __future__ import annotations

from dataclasses import replace

import pytest

from appliance.core import actions as act
from appliance.core import events as ev
from appliance.core.gang import gang_of

from .conftest import Harness, of
from .test_priority import HIGH, LOW, SETTINGS, by_uid, drops, grants

BOUND = SETTINGS.borrower_queue_s


def _lent_to_low(h: Harness, bound: float = BOUND) -> tuple[int, int]:
    """An inference loop at high that went idle while a trainer at low waited: the trainer
    holds the GPU the high lent it, told `bound`."""
    high, low = h.register(uid=2), h.register(uid=1)
    h.feed(ev.LockRequested(high, 1))
    h.feed(ev.LockRequested(low, 1))
    out = h.feed(ev.LockReleased(high, ev.ReleaseReason.IDLE))
    assert of(out, act.Grant) == [act.Grant(low, 1, 10.0, 1.0, bound)]
    return high, low


def test_a_borrower_of_a_higher_priority_is_told_the_bound_until_the_lender_goes() -> None:
    h = by_uid({1: LOW, 2: HIGH})
    high, low = _lent_to_low(h)
    # the lender takes its GPU back at once: the trainer drains what it queued (at most the
    # bound), and its next grant is bounded again once the high lends again
    assert grants(h.feed(ev.LockRequested(high, 2))) == [high]
    h.feed(ev.LockReleased(low, ev.ReleaseReason.DROPPED))
    h.feed(ev.LockRequested(low, 2))
    out = h.feed(ev.LockReleased(high, ev.ReleaseReason.IDLE))
    assert of(out, act.Grant) == [act.Grant(low, 2, 10.0, 1.0, BOUND)]
    # the lender leaves: nobody takes the GPU back at once, the trainer queues as it likes
    out = h.feed(ev.ClientGone(high))
    assert of(out, act.LockTerms) == [act.LockTerms(low, 10.0, 1.0, 0.0)]
    h.core.check()


def test_a_new_higher_priority_that_lends_bounds_the_holder_then() -> None:
    h = by_uid({1: LOW, 2: HIGH})
    low = h.register(uid=1)
    out = h.feed(ev.LockRequested(low, 1))
    assert of(out, act.Grant) == [act.Grant(low, 1, 10.0, 1.0, 0.0)]  # alone: no bound
    high = h.register(uid=2)
    h.advance(SETTINGS.preempt_after_s)
    assert drops(h.feed(ev.LockRequested(high, 1))) == [low]
    h.feed(ev.LockRequested(low, 2))
    out = h.feed(ev.LockReleased(low, ev.ReleaseReason.DROPPED))
    assert grants(out) == [high]
    out = h.feed(ev.LockReleased(high, ev.ReleaseReason.IDLE))
    assert of(out, act.Grant) == [act.Grant(low, 2, 10.0, 1.0, BOUND)]


def test_no_bound_where_an_equal_lent_or_the_bound_is_off() -> None:
    # two equals: what one lends it takes back only after the borrower's drain, and the
    # borrower's turn is its own; no pacing
    h = by_uid({1: LOW, 2: LOW})
    a, b = h.register(uid=2), h.register(uid=1)
    h.feed(ev.LockRequested(a, 1))
    h.feed(ev.LockRequested(b, 1))
    out = h.feed(ev.LockReleased(a, ev.ReleaseReason.IDLE))
    assert [g.queue_s for g in of(out, act.Grant)] == [0.0]
    # borrowerQueue: 0 turns it off
    _lent_to_low(by_uid({1: LOW, 2: HIGH}, replace(SETTINGS, borrower_queue_s=0.0)), bound=0.0)


def test_a_holder_granted_as_starved_is_not_bounded() -> None:
    # a quantum granted as starved is its holder's against any priority: the lender does not
    # take it back at once, so nothing is gained by pacing it
    h = by_uid({1: LOW, 2: HIGH})
    _, low = _lent_to_low(h)
    rule, c = h.core.lock.terms, h.state.clients[low]
    assert rule.queue(c) == BOUND
    gang_of(h.state, c).full_quantum = True
    assert rule.queue(c) == 0.0


def _request(h: Harness, high: int, low: int, seq: int, hold_s: float) -> act.Grant:
    """After a pause (irregular: at a steady pace the GPU would be kept for the lender, `ahead`)
    the lender takes its GPU back for a request that holds it `hold_s` (its idle window after
    the work on top), the trainer drains and asks again: the trainer's next grant."""
    h.advance(0.02 * (1 + 0.37 * (seq % 4)))
    assert grants(h.feed(ev.LockRequested(high, seq))) == [high]
    h.feed(ev.LockReleased(low, ev.ReleaseReason.DROPPED))
    h.feed(ev.LockRequested(low, seq))
    h.advance(hold_s + h.state.clients[high].told[0])
    (grant,) = of(h.feed(ev.LockReleased(high, ev.ReleaseReason.IDLE)), act.Grant)
    assert grant.client_id == low
    return grant


def test_the_bound_is_a_quarter_of_what_the_lender_holds_when_that_is_longer() -> None:
    # beside 8 ms requests a 0.5 ms queue costs the trainer a tenth of its pace while it holds
    # the GPU and the request little: it may queue a quarter of a request (2 ms) instead
    h = by_uid({1: LOW, 2: HIGH})
    high, low = _lent_to_low(h)
    assert _request(h, high, low, 2, 0.008).queue_s == pytest.approx(0.002)
    # the lender's requests get shorter: the bound follows (a running mean, a quarter to the
    # newest), down to borrowerQueue and no lower
    assert _request(h, high, low, 3, 0.004).queue_s == pytest.approx(0.25 * 0.007)
    for seq in range(4, 30):
        grant = _request(h, high, low, seq, 0.0002)
    assert grant.queue_s == BOUND
    h.core.check()


def test_only_the_lenders_own_holds_move_the_bound() -> None:
    # a trainer that holds its GPU long and lends it now and then gains no deeper queue for it
    # beside a lender with short requests; and with borrowerQueue 0 nobody is paced, however
    # long the lender's requests
    h = by_uid({1: LOW, 2: HIGH})
    high, low = _lent_to_low(h)
    h.advance(30.0)
    h.feed(ev.LockReleased(low, ev.ReleaseReason.IDLE))  # lends nothing upwards: held 30 s
    assert gang_of(h.state, h.state.clients[high]).request_s == 0.0
    h.feed(ev.LockRequested(low, 2))
    assert _request(h, high, low, 2, 0.001).queue_s == BOUND
    off = by_uid({1: LOW, 2: HIGH}, replace(SETTINGS, borrower_queue_s=0.0))
    high, low = _lent_to_low(off, bound=0.0)
    assert _request(off, high, low, 2, 0.05).queue_s == 0.0


def test_a_hold_nobody_waited_behind_does_not_loosen_the_bound() -> None:
    # a high-priority batch that had the GPU to itself for 10 s says nothing of the requests it
    # sends later: the trainer that comes after is bounded as beside any lender
    h = by_uid({1: LOW, 2: HIGH})
    high = h.register(uid=2)
    h.feed(ev.LockRequested(high, 1))
    h.advance(10.0)
    h.feed(ev.LockReleased(high, ev.ReleaseReason.IDLE))
    low = h.register(uid=1)
    out = h.feed(ev.LockRequested(low, 1))
    assert of(out, act.Grant) == [act.Grant(low, 1, 10.0, 1.0, BOUND)]
