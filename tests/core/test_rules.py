"""The rules the lock asks (`share.ShareRule`, `priority.PriorityRule`, `terms.LendingRule`,
`gang.GangRule`, `ahead.ReclaimRule`, `terms.TermsRule`): their queries write nothing.

Each rule answers the lock's phases with commands (named for the phase that asks) and queries
(asked by any phase and by `next_deadline`). A query asked later than the last event, when
windows have turned and a holder has held on, must leave the node's whole state as it was: the
answer is worked out on copies. The state is compared by its `repr`, which covers every client,
gang, account and index.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from appliance.core import events as ev
from appliance.core.node import NodeCore
from appliance.core.state import GangPhase
from appliance.core.terms import OUTRANKING_IDLE_S
from appliance.policy.model import Limits, Mode, Policy, SchedulerSettings

from .conftest import Harness
from .test_ahead import LEAD, Pair
from .test_gang import GPU0, GPU1, TQ, ask, job, shown
from .test_gang import harness as gang_harness
from .test_priority import HIGH, LOW, SETTINGS, by_uid


def crowd() -> Harness:
    """Three clients with a quota and a guaranteed share, one holding and two waiting (one in
    a pod), 7.5 s after the last event: windows have turned, the holder has held on."""
    policy = Policy(
        scheduler=SchedulerSettings(mode=Mode.ON, time_quantum_s=2),
        defaults=Limits(core_percent=50, priority=0, core_request=20),
    )
    h = Harness(NodeCore(policy))
    for cid in [h.register(), h.register(), h.register(pod_uid="pod-q")]:
        h.feed(ev.LockRequested(cid, 2))
    h.now += 7.5
    return h


def test_the_share_rules_queries_write_nothing() -> None:
    h = crowd()
    shares, gangs = h.core.lock.shares, list(h.state.gangs.values())
    before = repr(h.state)
    owed = [shares.owed(g, h.now) for g in gangs]
    turns = [shares.turn_at(g, h.now) for g in gangs]
    waiters = [g for g in gangs if g.phase is GangPhase.WAITING]
    keys = {g.key for g in waiters}
    gives_way = [(shares.resumes(g, h.now, 2.0), shares.yield_at(g, waiters, keys)) for g in gangs]
    assert repr(h.state) == before
    assert all(y is not None for _, y in gives_way)  # to a waiter owed its share
    # The waiters are owed their 20 % of the window turned since; the holder, as if billed up
    # to now, has had its own.
    holding = [g.phase is GangPhase.HOLDING for g in gangs]
    assert [o == 0 for o in owed] == holding and holding.count(True) == 1
    assert all(t is not None and t > h.now for t in turns)
    # Asked twice, and once more a window later: the same answers, still nothing written.
    assert [shares.owed(g, h.now) for g in gangs] == owed
    assert [shares.owed(g, h.now + 2.0) for g in gangs] == owed
    assert repr(h.state) == before


def test_the_priority_rules_queries_write_nothing() -> None:
    """A low priority borrows the GPU a high one let go idle, a middle one waits past the
    starvation limit: every priority question about every pair leaves the state as it was."""
    h = by_uid({1: LOW, 2: HIGH, 3: 0})
    low, high, mid = h.register(uid=1), h.register(uid=2), h.register(uid=3)
    h.feed(ev.LockRequested(high, 1))
    h.feed(ev.LockReleased(high, ev.ReleaseReason.IDLE))
    h.feed(ev.LockRequested(low, 1))
    h.feed(ev.LockRequested(mid, 1))
    h.now += 40.0
    rule, gangs = h.core.lock.priorities, list(h.state.gangs.values())
    before = repr(h.state)
    answers = [
        (rule.borrowed(a, b), rule.lent_back(a, b, 10.0), rule.yield_at(a, b, 10.0))
        for a in gangs
        for b in gangs
    ]
    g_low, g_high, g_mid = (h.state.gangs[h.state.clients[c].gang] for c in (low, high, mid))
    line = rule.line([g_high, g_mid], h.now)
    starved = [rule.starved(g_mid, t) for t in (h.now - 40.0, h.now)]
    turns = [rule.turn(g, gangs, 10.0) for g in gangs]
    assert repr(h.state) == before
    assert rule.borrowed(g_low, g_high) and not rule.borrowed(g_mid, g_high)
    assert line == [g_high, g_mid] and starved == [False, True]
    assert len(answers) == 9 and len(turns) == 3
    assert repr(h.state) == before


def test_whether_a_lender_is_taken_back_at_once_is_a_query_that_writes_nothing() -> None:
    """A high priority with a compute quota lets its GPU go idle and a low one borrows it;
    asked windows later whether the lender would be granted at once, its quota is looked at
    through a copy: no account rolls (`gang.eligible` rolled the lender's)."""
    h = by_uid({1: LOW, 2: HIGH}, replace(SETTINGS, idle_handoff_s=0.005))
    h.state.policy = replace(h.state.policy, defaults=Limits(core_percent=50))
    low, high = h.register(uid=1), h.register(uid=2)
    h.feed(ev.LockRequested(high, 1))
    h.advance(0.1)  # (inside its budget: a release after a quota's drop lends nothing)
    h.feed(ev.LockReleased(high, ev.ReleaseReason.IDLE))
    h.feed(ev.LockRequested(low, 1))
    lock = h.core.lock
    h.now += 7.5  # the lender's quota window has turned fifteen times
    waiting, keeps = lock.line.waiting(h.now), lock.reclaims.keeps()
    before = repr(h.state)
    lent = [
        lock.lending.taken_back_at_once(h.state.clients[c], waiting, keeps, h.now)
        for c in (low, high)
    ]
    assert lent == [False, True]
    assert repr(h.state) == before


def test_the_gang_rules_queries_write_nothing() -> None:
    """A gang holds GPU 0 and waits for GPU 1, which a lone client holds: whether each GPU can
    be granted to each gang, who is in the gang's way and whether a member is behind its cut
    leave the state as it was."""
    h = gang_harness()
    (rank,) = job(h, "g", (GPU0,))
    ask(h, rank)
    victim = h.register(gpu=GPU1)
    shown(h, victim)
    ask(h, victim)
    ask(h, h.register(pod_uid="g", gpu=GPU1))  # no context on GPU 1 yet: not at once
    h.now += 1.0
    rule, lock, s = h.core.lock.gangs, h.core.lock, h.state
    before = repr(s)
    grantable = {(u, g.key): rule.grantable(u, g) for u in (GPU0, GPU1) for g in s.gangs.values()}
    in_the_way = rule.in_the_way(list(lock.line.owning.values()), h.now)
    behind = [rule.behind(s.gangs[c.gang], c) for c in s.clients.values()]
    assert repr(s) == before
    assert not grantable[(GPU1, "pod:g")] and grantable[(GPU0, "pod:g")]
    victims = s.gangs[s.clients[victim].gang]
    assert in_the_way == ([], victims.quantum_from + TQ)  # at the end of its quantum
    assert behind == [False, False, False]


def test_the_reclaim_rules_queries_write_nothing() -> None:
    """A request loop lends its GPU to a trainer at a steady pace; a moment before its next
    request is due the GPU is kept for it: what is kept, for whom, who must drop and when the
    keeping ends are answered without a write (the phases then drop the trainer)."""
    p = Pair()
    due = p.steady(6)
    p.h.now = due - LEAD + 0.0001  # (no Tick yet: the trainer still holds)
    rule, s = p.h.core.lock.reclaims, p.h.state
    low, high = (s.gangs[s.clients[c].gang] for c in (p.low, p.high))
    before = repr(s)
    keeps = rule.keeps()
    answers = (
        rule.borrowers_due(keeps, p.h.now),
        rule.kept_from(keeps, low, p.h.now),
        rule.deadlines(keeps, p.h.now),
    )
    assert repr(s) == before
    (kept,) = keeps[s.clients[p.high].gpu]
    assert kept.lender is high and kept.on(p.h.now)
    assert answers == ([low], True, [pytest.approx(due + LEAD)])


def test_the_terms_rules_query_writes_nothing_and_its_commands_what_was_told() -> None:
    """A high priority holds; a low one and an equal one wait in turn: the idle window each
    holder is due is a query; a grant and the terms phase write only what the hook is told."""
    h = by_uid({1: HIGH, 2: LOW, 3: HIGH}, replace(SETTINGS, idle_handoff_s=0.005))
    holder, low, equal = h.register(uid=1), h.register(uid=2), h.register(uid=3)
    h.feed(ev.LockRequested(holder, 1))
    h.feed(ev.LockRequested(low, 1))
    rule, lock, s = h.core.lock.terms, h.core.lock, h.state
    c = s.clients[holder]
    before = repr(s)
    alone = rule.window(c, lock.line.waiting(h.now))
    assert repr(s) == before
    assert alone == OUTRANKING_IDLE_S  # above every waiter: its window, learned from nothing
    h.feed(ev.LockRequested(equal, 1))
    assert c.told == (0.005, 0.0)  # told by the terms phase: an equal waits
    c.told = (0.0, 0.0)
    before = repr(s)
    grant = rule.granted(c, 7, lock.line.waiting(h.now))
    assert (grant.seq, grant.idle_release_s) == (7, 0.005) and c.told == (0.005, 0.0)
    c.told = (0.0, 0.0)
    assert repr(s) == before  # nothing else was written
