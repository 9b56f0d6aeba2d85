"""Priorities on the core's fake clock: the line, preemption after the minimum slice, first come
first served among equals, the starvation bound, the idle hand-off, and where a priority comes
from (policy rules, the pod annotation within its range)."""

from __future__ import annotations

from dataclasses import replace

from appliance.core import actions as act
from appliance.core import events as ev
from appliance.core.annotations import PRIORITY, PodInfo
from appliance.core.node import ANNOTATION_WARNING, NodeCore
from appliance.core.state import Phase
from appliance.core.terms import OUTRANKING_IDLE_S
from appliance.core.views import ExplainQuery
from appliance.policy.model import (
    AnnotationPolicy,
    Limits,
    Policy,
    Rule,
    RuleMatch,
    SchedulerSettings,
)

from .conftest import Harness, of

HIGH, LOW = 100, -100
SETTINGS = SchedulerSettings(time_quantum_s=10.0, preempt_after_s=1.0, starvation_limit_s=30.0)


def by_uid(priorities: dict[int, int], settings: SchedulerSettings = SETTINGS) -> Harness:
    """A core whose rules give each Unix uid its priority."""
    rules = tuple(
        Rule(name=f"uid-{uid}", match=RuleMatch(uid=uid), limits=Limits(priority=prio))
        for uid, prio in priorities.items()
    )
    return Harness(NodeCore(Policy(scheduler=settings, rules=rules)))


def grants(out: list[act.Action]) -> list[int]:
    return [g.client_id for g in of(out, act.Grant)]


def drops(out: list[act.Action]) -> list[int]:
    return [d.client_id for d in of(out, act.Drop)]


def lent(out: list[act.Action]) -> list[tuple[int, bool]]:
    return [(a.client_id, a.lent) for a in of(out, act.Lent)]


def test_a_waiting_higher_priority_is_granted_next_and_equals_keep_their_order() -> None:
    h = by_uid({1: LOW, 2: 0, 3: HIGH})
    holder = h.register(uid=2)
    low, first, second = h.register(uid=1), h.register(uid=2), h.register(uid=2)
    high = h.register(uid=3)
    h.feed(ev.LockRequested(holder, 1))
    for cid in (low, first, second, high):
        h.feed(ev.LockRequested(cid, 1))
    order = []
    who = holder
    for _ in range(4):
        (who,) = grants(h.feed(ev.LockReleased(who, ev.ReleaseReason.EXIT)))
        order.append(who)
    assert order == [high, first, second, low]


def test_a_higher_priority_takes_the_gpu_after_the_minimum_slice_not_the_quantum() -> None:
    h = by_uid({1: LOW, 2: HIGH})
    low, high = h.register(uid=1), h.register(uid=2)
    h.feed(ev.LockRequested(low, 1))
    h.advance(0.3)
    assert drops(h.feed(ev.LockRequested(high, 1))) == []  # the slice is not over yet
    assert drops(h.advance(0.69)) == []
    out = h.advance(0.02)  # 1 s after the low one's grant, not 10 s
    assert drops(out) == [low]
    assert grants(h.feed(ev.LockReleased(low, ev.ReleaseReason.DROPPED))) == [high]
    assert h.state.clients[low].usage.drops["priority"] == 1
    # One that has held longer than the slice already gives way at once.
    h.feed(ev.LockRequested(low, 2))
    h.feed(ev.LockReleased(high, ev.ReleaseReason.EXIT))
    h.advance(5)
    assert drops(h.feed(ev.LockRequested(high, 2))) == [low]


def test_a_lower_priority_waits_past_the_quantum_until_the_starvation_limit() -> None:
    h = by_uid({1: LOW, 2: HIGH})
    low, high = h.register(uid=1), h.register(uid=2)
    h.feed(ev.LockRequested(high, 1))
    h.feed(ev.LockRequested(low, 1))
    assert drops(h.advance(29.9)) == []  # the quantum (10 s) is long over: the high one keeps it
    assert drops(h.advance(0.2)) == [high]  # starved: 30 s
    assert grants(h.feed(ev.LockReleased(high, ev.ReleaseReason.DROPPED))) == [low]
    # The starved client keeps its whole quantum against the higher priority.
    h.feed(ev.LockRequested(high, 2))
    assert drops(h.advance(9.9)) == []
    assert drops(h.advance(0.2)) == [low]


def test_status_shows_the_queue_in_the_order_of_grants_a_starved_waiter_first() -> None:
    h = by_uid({1: LOW, 2: HIGH, 3: 0})
    holder, low, high = h.register(uid=3), h.register(uid=1), h.register(uid=2)
    h.feed(ev.LockRequested(holder, 1))
    h.feed(ev.LockRequested(low, 1))
    h.advance(31.0)  # the low one has waited past the starvation limit
    h.feed(ev.LockRequested(high, 1))
    gpu = h.state.clients[holder].gpu
    assert h.queued(gpu) == [low, high]
    assert grants(h.feed(ev.LockReleased(holder, ev.ReleaseReason.EXIT))) == [low]
    assert h.queued(gpu) == [high]


def test_starvation_is_bounded_when_higher_priorities_keep_the_gpu_busy() -> None:
    h = by_uid({1: LOW, 2: HIGH})
    low, a, b = h.register(uid=1), h.register(uid=2), h.register(uid=2)
    h.feed(ev.LockRequested(a, 1))
    h.feed(ev.LockRequested(b, 1))
    h.feed(ev.LockRequested(low, 1))
    granted_at = None
    for _ in range(20):  # two compute-bound high clients hand the GPU back and forth
        for d in drops(h.advance(10)):
            out = h.feed(ev.LockReleased(d, ev.ReleaseReason.DROPPED))
            if low in grants(out):
                granted_at = h.now
                break
            h.feed(ev.LockRequested(d, 2))
        if granted_at is not None:
            break
    assert granted_at is not None
    assert granted_at - 1000.0 <= SETTINGS.starvation_limit_s + SETTINGS.time_quantum_s


def test_a_high_lender_taking_back_every_lend_at_once_still_starves_its_victim() -> None:
    # Issue 24 item 6: the high one lets the GPU go idle just before the victim's starvation
    # limit (as the victim's last request shows it) and asks again 2 ms later; the victim,
    # granted as a borrower, loses the GPU at once. Such turns are not its own: its clock runs
    # on, and the bound (the starvation limit, then a quantum) holds.
    h = by_uid({1: LOW, 2: HIGH})
    low, high = h.register(uid=1), h.register(uid=2)
    h.feed(ev.LockRequested(high, 1))
    h.feed(ev.LockRequested(low, 1))
    asked = last_ask = h.now
    seqs = iter(range(2, 1000))
    lends = 0

    def holding(cid: int) -> bool:
        return h.state.clients[cid].phase is Phase.HOLDING

    while not holding(low) and h.now - asked < 60:
        lend_at = last_ask + SETTINGS.starvation_limit_s - 0.5
        for d in drops(h.advance(max(0.0, min(0.5, lend_at - h.now)))):
            assert d == high  # told to drop, it does, and asks again
            h.feed(ev.LockReleased(high, ev.ReleaseReason.DROPPED))
            h.feed(ev.LockRequested(high, next(seqs)))
        if h.now < lend_at or not holding(high):
            continue
        if low in grants(h.feed(ev.LockReleased(high, ev.ReleaseReason.IDLE))):
            h.advance(0.002)
            if drops(h.feed(ev.LockRequested(high, next(seqs)))) != [low]:
                break  # it kept its turn
            lends += 1
            h.feed(ev.LockRequested(low, next(seqs)))  # its hook asks again at once
            h.feed(ev.LockReleased(low, ev.ReleaseReason.DROPPED))
            last_ask = h.now
    assert holding(low)
    assert lends >= 1
    assert h.now - asked <= SETTINGS.starvation_limit_s + SETTINGS.time_quantum_s
    h.feed(ev.LockRequested(high, next(seqs)))
    assert drops(h.advance(SETTINGS.time_quantum_s - 0.1)) == []  # a whole quantum of its own


def test_an_idle_holder_lends_the_gpu_and_takes_it_back_at_once() -> None:
    h = by_uid({1: LOW, 2: HIGH})
    low, high = h.register(uid=1), h.register(uid=2)
    h.feed(ev.LockRequested(high, 1))
    h.feed(ev.LockRequested(low, 1))
    # Its request served, the high one's GPU sits idle: it hands the lock to the waiting one ...
    assert grants(h.feed(ev.LockReleased(high, ev.ReleaseReason.IDLE))) == [low]
    h.advance(0.04)
    # ... and has it back as soon as it submits again, without waiting out a slice, nor the
    # borrower's drain: it is granted with the drop, beside the borrower's last queued work.
    out = h.feed(ev.LockRequested(high, 2))
    assert drops(out) == [low] and grants(out) == [high]
    assert grants(h.feed(ev.LockReleased(low, ev.ReleaseReason.DROPPED))) == []
    h.advance(0.01)
    # A lower priority lends nothing: a higher one keeps the GPU for its slice.
    h.feed(ev.LockRequested(low, 2))
    assert grants(h.feed(ev.LockReleased(high, ev.ReleaseReason.IDLE))) == [low]
    h.feed(ev.LockRequested(high, 3))
    assert drops(h.sent[-1:]) == []
    h.feed(ev.LockReleased(low, ev.ReleaseReason.EXIT))
    other = h.register(uid=1)
    low = h.register(uid=1)
    h.feed(ev.LockRequested(other, 1))
    h.feed(ev.LockRequested(low, 1))
    h.feed(ev.LockReleased(high, ev.ReleaseReason.EXIT))
    # Equal priority: the lender has the rest of its quantum back, after the borrower's drain.
    h.feed(ev.LockReleased(other, ev.ReleaseReason.IDLE))
    out = h.feed(ev.LockRequested(other, 2))
    assert drops(out) == [low] and grants(out) == []
    assert grants(h.feed(ev.LockReleased(low, ev.ReleaseReason.DROPPED))) == [other]


def test_a_lender_is_told_it_may_take_its_gpu_back_without_waiting() -> None:
    h = by_uid({1: LOW, 2: HIGH})
    low, high = h.register(uid=1), h.register(uid=2)
    h.feed(ev.LockRequested(high, 1))
    h.feed(ev.LockRequested(low, 1))
    # Lent to a lower priority only: its hook may submit at once and ask as it goes ...
    out = h.feed(ev.LockReleased(high, ev.ReleaseReason.IDLE))
    assert grants(out) == [low] and lent(out) == [(high, True)]
    # ... and the request it sends then is granted at once, nothing more to tell it.
    out = h.feed(ev.LockRequested(high, 2))
    assert grants(out) == [high] and drops(out) == [low] and lent(out) == []
    # Lent again; then a client of its own priority waits. The lender's quantum is not over,
    # so it still goes first (`PriorityRule.takes_back`): nothing changes for its hook.
    h.feed(ev.LockReleased(low, ev.ReleaseReason.DROPPED))
    h.feed(ev.LockRequested(low, 2))
    assert lent(h.feed(ev.LockReleased(high, ev.ReleaseReason.IDLE))) == [(high, True)]
    peer = h.register(uid=2)
    assert lent(h.feed(ev.LockRequested(peer, 1))) == []
    out = h.feed(ev.LockRequested(high, 3))
    assert grants(out) == [high] and drops(out) == [low] and lent(out) == []
    # The peer was never granted a GPU only to be told to drop it; it waits for the quantum.
    assert grants(h.feed(ev.LockReleased(low, ev.ReleaseReason.DROPPED))) == []
    assert drops(h.advance(SETTINGS.time_quantum_s)) == [high]
    assert grants(h.feed(ev.LockReleased(high, ev.ReleaseReason.DROPPED))) == [peer]
    # Its quantum over, the lender waits its turn like anyone else.
    assert grants(h.feed(ev.LockRequested(high, 4))) == []


def test_only_a_lender_is_granted_beside_a_drain() -> None:
    h = by_uid({1: LOW, 2: HIGH, 3: 0})
    low, high = h.register(uid=1), h.register(uid=2)
    h.feed(ev.LockRequested(low, 1))
    # Holding since before the high one came: it is preempted after the minimum slice, and
    # the high one waits for its drain (its queued work is its own, not borrowed time).
    h.feed(ev.LockRequested(high, 1))
    out = h.advance(SETTINGS.preempt_after_s)
    assert drops(out) == [low] and grants(out) == []
    assert grants(h.feed(ev.LockReleased(low, ev.ReleaseReason.DROPPED))) == [high]
    # Lent, borrowed and taken back: a third client waiting all along is not granted beside
    # the drain, and is granted after the lender, by priority.
    h.feed(ev.LockRequested(low, 2))
    h.feed(ev.LockReleased(high, ev.ReleaseReason.IDLE))
    normal = h.register(uid=3)
    h.feed(ev.LockRequested(normal, 1))
    out = h.feed(ev.LockRequested(high, 2))
    assert drops(out) == [low] and grants(out) == [high]
    assert grants(h.feed(ev.LockReleased(low, ev.ReleaseReason.DROPPED))) == []
    assert grants(h.feed(ev.LockReleased(high, ev.ReleaseReason.IDLE))) == [normal]


def test_a_lender_asking_while_its_borrower_drains_is_granted_beside_the_drain() -> None:
    """The borrower was told to drop for its quantum and still drains when the lender asks:
    the lender is granted at once, by the grant phase (a request for a GPU that only a drain
    holds is not one that can grant nobody, `calm`)."""
    h = by_uid({1: LOW, 2: HIGH, 3: LOW})
    low, high, other = h.register(uid=1), h.register(uid=2), h.register(uid=3)
    h.feed(ev.LockRequested(high, 1))
    h.feed(ev.LockRequested(low, 1))
    assert grants(h.feed(ev.LockReleased(high, ev.ReleaseReason.IDLE))) == [low]
    h.feed(ev.LockRequested(other, 1))
    assert drops(h.advance(SETTINGS.time_quantum_s)) == [low]  # its quantum, for the other
    assert grants(h.feed(ev.LockRequested(high, 2))) == [high]


def test_a_gpu_let_go_idle_while_nobody_waited_is_taken_back_at_once_too() -> None:
    h = by_uid({1: LOW, 2: HIGH})
    low, high = h.register(uid=1), h.register(uid=2)
    h.feed(ev.LockRequested(high, 1))
    h.feed(ev.LockReleased(high, ev.ReleaseReason.IDLE))  # idle, nobody waiting
    h.advance(5)
    assert grants(h.feed(ev.LockRequested(low, 1))) == [low]
    h.advance(0.1)
    assert drops(h.feed(ev.LockRequested(high, 2))) == [low]  # not after preemptAfter
    # A client that comes new (or was dropped) waits the slice out, as before.
    other = h.register(uid=2)
    h.feed(ev.LockReleased(low, ev.ReleaseReason.DROPPED))
    h.feed(ev.LockRequested(low, 2))
    h.feed(ev.LockReleased(high, ev.ReleaseReason.EXIT))
    assert drops(h.feed(ev.LockRequested(other, 1))) == []
    assert drops(h.advance(1.0)) == [low]


def test_while_someone_waits_the_holder_is_told_to_hand_over_after_a_short_idle() -> None:
    settings = replace(SETTINGS, idle_release_s=1.0, idle_handoff_s=0.005)
    h = by_uid({1: 0}, settings)
    a, b = h.register(uid=1), h.register(uid=1)
    (grant,) = of(h.feed(ev.LockRequested(a, 1)), act.Grant)
    assert grant.idle_release_s == 1.0  # nobody waits: the long idle release
    out = h.feed(ev.LockRequested(b, 1))
    assert of(out, act.LockTerms) == [act.LockTerms(a, 10.0, 0.005)]
    h.advance(9)
    (grant,) = of(h.feed(ev.LockReleased(a, ev.ReleaseReason.IDLE)), act.Grant)
    assert (grant.client_id, grant.idle_release_s) == (b, 1.0)
    h.advance(2)  # a's quantum is over: it waits for b's like anyone
    h.feed(ev.LockRequested(a, 2))
    assert of(h.sent[-1:], act.LockTerms) == [act.LockTerms(b, 10.0, 0.005)]
    out = h.feed(ev.LockReleased(a, ev.ReleaseReason.EXIT))  # the waiter gave up
    assert of(out, act.LockTerms) == [act.LockTerms(b, 10.0, 1.0)]
    # 0 turns the hand-off off.
    off = by_uid({1: 0}, replace(settings, idle_handoff_s=0.0))
    a, b = off.register(uid=1), off.register(uid=1)
    off.feed(ev.LockRequested(a, 1))
    assert of(off.feed(ev.LockRequested(b, 1)), act.LockTerms) == []
    # Any more than 0 is a window (the hook is told microseconds), the shorter one kept for a
    # holder that outranks its waiters.
    short = by_uid({1: LOW, 2: HIGH}, replace(settings, idle_handoff_s=0.0001))
    high, low = short.register(uid=2), short.register(uid=1)
    short.feed(ev.LockRequested(high, 1))
    assert of(short.feed(ev.LockRequested(low, 1)), act.LockTerms) == [
        act.LockTerms(high, 10.0, 0.0001)
    ]


def test_a_holder_above_every_waiter_hands_over_after_the_shortest_idle() -> None:
    # A request loop at high beside a trainer at low: each millisecond it holds the lock idle
    # after a request is the trainer's, and taking the GPU back costs it nothing.
    settings = replace(SETTINGS, idle_release_s=1.0, idle_handoff_s=0.005)
    h = by_uid({1: LOW, 2: HIGH, 3: HIGH}, settings)
    high, low = h.register(uid=2), h.register(uid=1)
    h.feed(ev.LockRequested(high, 1))
    out = h.feed(ev.LockRequested(low, 1))
    assert of(out, act.LockTerms) == [act.LockTerms(high, 10.0, OUTRANKING_IDLE_S)]
    # An equal waiting too: it would wait a quantum for a turn given back, so idleHandoff.
    peer = h.register(uid=3)
    out = h.feed(ev.LockRequested(peer, 1))
    assert of(out, act.LockTerms) == [act.LockTerms(high, 10.0, 0.005)]
    h.feed(ev.LockReleased(peer, ev.ReleaseReason.EXIT))
    assert of(h.sent, act.LockTerms)[-1] == act.LockTerms(high, 10.0, OUTRANKING_IDLE_S)
    h.feed(ev.LockReleased(high, ev.ReleaseReason.IDLE))
    h.advance(settings.preempt_after_s)
    assert grants(h.feed(ev.LockRequested(high, 2))) == [high]  # taken back at once
    h.feed(ev.LockReleased(low, ev.ReleaseReason.DROPPED))
    out = h.feed(ev.LockRequested(low, 2))  # the trainer's hook asks again
    assert of(out, act.LockTerms) == [act.LockTerms(high, 10.0, OUTRANKING_IDLE_S)]
    h.feed(ev.LockReleased(high, ev.ReleaseReason.IDLE))
    # nobody waits; the high lent it: the trainer keeps its queue short (borrowerQueue)
    assert of(h.sent, act.Grant)[-1] == act.Grant(low, 2, 10.0, 1.0, 0.0005)
    assert drops(h.feed(ev.LockRequested(high, 3))) == [low]  # and back at once again


def test_a_holder_above_every_waiter_learns_the_pauses_inside_its_work() -> None:
    # A token generator at high reads every step back and works on the host before the next:
    # handed over in those pauses, it asks again at once (within REASK_S), having given the
    # trainer nothing but a hand-off. Its window doubles until the pauses fit, never past
    # idleHandoff (a client that asks again at once after every release gets no more than an
    # equal would), and shrinks back to the floor once its releases pay off (its next request
    # comes later).
    settings = replace(SETTINGS, idle_release_s=1.0, idle_handoff_s=0.004)
    h = by_uid({1: LOW, 2: HIGH, 3: HIGH}, settings)
    high, low = h.register(uid=2), h.register(uid=1)
    h.feed(ev.LockRequested(high, 1))
    told = [of(h.feed(ev.LockRequested(low, 1)), act.LockTerms, high)[-1].idle_release_s]
    for seq, pause in enumerate([0.0003] * 6 + [0.05] * 14 + [0.0009], start=2):
        h.feed(ev.LockReleased(high, ev.ReleaseReason.IDLE))  # the trainer borrows the GPU
        h.advance(pause)
        assert grants(h.feed(ev.LockRequested(high, seq))) == [high]  # back at once
        h.feed(ev.LockReleased(low, ev.ReleaseReason.DROPPED))
        told.append(of(h.feed(ev.LockRequested(low, seq)), act.LockTerms, high)[-1].idle_release_s)
    assert told[:7] == [OUTRANKING_IDLE_S, 0.0005, 0.001, 0.002, 0.004, 0.004, 0.004]
    assert told[7:9] == [0.0032, 0.00256] and told[-2] == OUTRANKING_IDLE_S
    assert told[-1] == 2 * OUTRANKING_IDLE_S  # a pause inside its work again
    # An equal waiting too: idleHandoff, whatever it learned.
    peer = h.register(uid=3)
    assert of(h.feed(ev.LockRequested(peer, 1)), act.LockTerms, high) == [
        act.LockTerms(high, 10.0, 0.004)
    ]


def pod(priority: str) -> ev.PodSeen:
    return ev.PodSeen(PodInfo("u1", "ml", "serve", "node-1", annotations={PRIORITY: priority}))


def test_the_pod_annotation_sets_a_priority_within_the_policy_range() -> None:
    capped = AnnotationPolicy(max_priority=0)
    h = Harness(NodeCore(Policy(scheduler=SETTINGS, annotations=capped)))
    h.feed(pod("low"))
    served = h.register(pod_uid="u1")
    assert h.state.clients[served].limits.priority == LOW
    out = h.feed(pod("high"))
    [warning] = [w for w in out if isinstance(w, act.PodWarning)]
    assert warning.reason == ANNOTATION_WARNING
    assert warning.message == (
        "pod ml/serve: annotation nvshare.com/gpu-priority='high' ignored: high is outside the "
        "policy range annotations.priorityRange low to normal; kept previous override low"
    )
    assert h.state.clients[served].limits.priority == LOW
    h.feed(pod("-5"))
    (row,) = h.core.explain(ExplainQuery(pod="ml/serve")).clients
    assert row.priority == "-5 (from annotation)"
    assert "not a priority" in str(h.feed(pod("urgent")))


def test_explain_names_the_rule_that_set_a_priority() -> None:
    h = by_uid({7: HIGH})
    a = h.register(uid=7, pid=4242)
    (row,) = h.core.explain(ExplainQuery(pid=4242)).clients
    assert row.priority == "high (from rule 'uid-7')"
    assert h.core.status(h.now).clients[0].priority == HIGH
    b = h.register(uid=8, pid=4343)
    (row,) = h.core.explain(ExplainQuery(pid=4343)).clients
    assert row.priority == "normal (from policy default (default))"
    assert {a, b} == set(h.state.clients)


def test_a_process_can_lower_its_own_priority_but_not_raise_it() -> None:
    h = by_uid({7: HIGH})
    polite, pushy = h.register(uid=1, pid=500), h.register(uid=1, pid=501)
    served = h.register(uid=7, pid=502)
    h.feed(ev.PriorityHint(polite, LOW))  # NVSHARE_GPU_PRIORITY=low
    h.feed(ev.PriorityHint(pushy, 500))  # above its policy's normal: ignored
    h.feed(ev.PriorityHint(served, 0))  # normal, below its rule's high: taken
    (row,) = h.core.explain(ExplainQuery(pid=500)).clients
    assert row.priority == "low (from env NVSHARE_GPU_PRIORITY)"
    (row,) = h.core.explain(ExplainQuery(pid=501)).clients
    assert row.priority == "normal (from policy default (default))"
    (row,) = h.core.explain(ExplainQuery(pid=502)).clients
    assert row.priority == "normal (from env NVSHARE_GPU_PRIORITY)"
    # The line follows: the polite one is granted last.
    holder = h.register(uid=1)
    h.feed(ev.LockRequested(holder, 1))
    for cid in (polite, pushy, served):
        h.feed(ev.LockRequested(cid, 1))
    first = grants(h.feed(ev.LockReleased(holder, ev.ReleaseReason.EXIT)))
    second = grants(h.feed(ev.LockReleased(first[0], ev.ReleaseReason.EXIT)))
    third = grants(h.feed(ev.LockReleased(second[0], ev.ReleaseReason.EXIT)))
    assert first + second + third == [pushy, served, polite]
