"""The queue bound (`scheduler.borrowerQueue`, `TermsRule.queue`, ld_hook/pace.h) on the core's
fake clock: told to a holder on a GPU a higher priority lent it, with the grant and again when
that stops being so; never to a holder whose GPU an equal lent, nor with the bound off."""

from __future__ import annotations

from dataclasses import replace

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
