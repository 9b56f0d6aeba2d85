"""What a hook is told of the lock besides grants and drops.

- The terms a holder is given with the lock, and told again (`LockTerms`) when they change while
  it holds (`TermsRule`): the quantum, and the idle window, how long the holder may submit
  nothing (and wait for nothing) before it hands the lock back. While another gang waits for
  its GPU the window is the short `scheduler.idleHandoff` (a request loop that submits a little
  every few milliseconds leaves the GPU idle in between), or a shorter one when the holder's
  priority is above every waiter's (`TermsRule.window`), else `scheduler.idleRelease`. That
  shorter window is learned per gang from its own pauses (`TermsRule.back`): it starts at
  `OUTRANKING_IDLE_S`. A gang that asks again within `REASK_S` of an idle release gave its
  waiters less than the hand-off costs (a pause inside its work: a token generator reading each
  step back, host-side work between two launches, requests back to back), and its window
  doubles, up to `idleHandoff`; one that asks again later shrinks it by a fifth, down to
  `OUTRANKING_IDLE_S`. A gang that pauses inside its work less than one time in four ends at the
  floor.
- Lending (`Lent`, `LendingRule`): a client that let its GPU go idle and whose GPU now runs only
  clients of lower priority that borrowed it (`PriorityRule.borrowed`) would be granted at once
  if it asked (beside their drain, `lock`). Its hook is told so, and then submits at once when
  it has work again, asking for the lock as it goes instead of before: a request every few tens
  of milliseconds waits for no round trip through the daemon. While its GPU is kept for its next
  request (`ahead`), nobody holding it, it stays told so. It is told again as soon as that stops
  being true (a gang that is not its borrower holds the GPU or waits ahead of it), and then asks
  and waits as usual. Only a client that is a gang of its own is lent to: a gang of several
  clients takes its GPUs together.
- The queue bound (`TermsRule.queue`): a holder on a GPU that a gang of higher priority lent
  keeps at most `scheduler.borrowerQueue` of work queued (its hook paces its launches,
  ld_hook/pace.h), or a quarter (`QUEUE_OF_REQUEST`) of what the lender holds the GPU for each
  time, if longer. The lender's next request is granted at once, but the GPU time-slices it with
  whatever the borrower had queued before its drop: a trainer that queues a 2 ms step at once
  would double a 1 ms request, and add a quarter to an 8 ms one. Pacing costs the borrower (it
  waits for its own launches: 0.89-0.90 of its solo pace while it held the GPU beside 8 ms
  requests at 0.5 ms, 0.94-0.97 unpaced, H200), so the bound is no tighter than the lender's
  requests need. What a lender holds is learned from its idle releases while another gang
  waited (`held`: from its grant to the release, less the idle window it was told), a running
  mean weighted a quarter to the newest; only the lender's own holds move its borrowers' bound.
  Not a holder granted as starved: that quantum is its own.
"""

from __future__ import annotations

from appliance.core import actions as act
from appliance.core import ahead
from appliance.core.gang import gang_of
from appliance.core.line import Line, Waiting
from appliance.core.priority import PriorityRule
from appliance.core.quota_rule import QuotaRule
from appliance.core.state import Client, Gang, NodeState, Phase
from appliance.policy.model import Mode

# A holder that outranks every waiter hands its GPU over after this long idle at least: longer
# than the gap between a request's kernels as a framework launches them (tens of microseconds),
# while each moment it sits idle with the lock is its waiters' (`TermsRule.window`, `back`).
OUTRANKING_IDLE_S = 0.00025
# A release followed by a request this soon gave the waiters less than a hand-off costs (the
# waiter's grant, about 0.5 ms, and its queued work beside the next request).
REASK_S = 0.001
SHRINK = 0.8  # what a gang's learned window keeps after a release that paid off
# A borrower's queue bound is at least this share of what its lender holds the GPU for each
# time (`TermsRule.queue`): a request shares the GPU with at most that much of the borrower's.
QUEUE_OF_REQUEST = 0.25
HELD_WEIGHT = 0.25  # of the newest hold in a lender's learned hold (`TermsRule.held`)


class TermsRule:
    """The terms a holder is given with the lock and told again when they change (the
    module's docstring): the quantum, the idle window and the queue bound. The lock asks it:

    - commands: `granted` (a grant, or a request answered at once: the grant's terms) and
      `tell` (the last phase, "tell holders their terms"); they write what a hook was told
      (`Client.told`) and nothing else. `back` (a gang asks again after an idle
      release) writes its learned window (`Gang.idle_s`) and nothing else; `held` (a gang's
      idle release) its learned hold (`Gang.request_s`) and nothing else.
    - queries: `window` (the idle window a holder is due as the line stands) and `queue` (its
      queue bound); they write nothing.
    Cost, in clients touched: `granted` 1 (and O(P) for its GPU's waiters, `Waiting`, and its
    lenders); `tell` the holders of every GPU, each O(P); `window`, `queue` none (O(P)); `back`,
    `held` none.
    """

    def __init__(self, state: NodeState, line: Line) -> None:
        self._s = state
        self._line = line  # the idle lenders, by GPU and priority

    # ------------------------------------------------------------ commands

    def back(self, g: Gang, released_at: float, now: float) -> None:
        """g asks again, `now`, after an idle release at `released_at`: within `REASK_S` it
        paused inside its work and the window it is told above every waiter doubles (up to
        `idleHandoff`), else it shrinks by a fifth (down to `OUTRANKING_IDLE_S`)."""
        learned = max(g.idle_s, OUTRANKING_IDLE_S)
        if now - released_at < REASK_S:
            learned = min(2 * learned, self._s.policy.scheduler.idle_handoff_s)
        else:
            learned = max(SHRINK * learned, OUTRANKING_IDLE_S)
        g.idle_s = round(learned, 6)  # (the hook is told microseconds)

    def held(self, g: Gang, c: Client, now: float) -> None:
        """g's member c released the lock idle: its learned hold (from its grant, the idle
        window c was told left out), what its borrowers' queue bound follows (`queue`). Only a
        hold that another gang waited behind counts: one while it had the GPU to itself (a
        long batch, its idle window `idleRelease`) says nothing of the requests a borrower's
        queue would delay."""
        if not self._line.waiting(now).others(c.gpu, g):
            return
        held_s = max(now - g.granted_at - c.told[0], 0.0)
        learned = held_s if g.request_s <= 0 else g.request_s + HELD_WEIGHT * (held_s - g.request_s)
        g.request_s = round(learned, 6)

    def granted(self, c: Client, seq: int, waiting: Waiting) -> act.Grant:
        """The grant for c (answering its request `seq`), with its terms."""
        idle, queue = c.told = self.terms(c, waiting)
        quantum = self._s.time_quantum(c.gpu)
        return act.Grant(c.id, seq, time_quantum_s=quantum, idle_release_s=idle, queue_s=queue)

    def tell(self, waiting: Waiting) -> list[act.Action]:
        """New terms for every holder whose idle window or queue bound changed (someone started
        or stopped waiting for its GPU, or lending it)."""
        s = self._s
        out: list[act.Action] = []
        for gpu in s.gpus.values():
            holders = gpu.holders
            if not holders:
                continue
            for i in sorted(holders) if len(holders) > 1 else holders:
                h = s.clients[i]
                if h.phase is not Phase.HOLDING:
                    continue  # (a draining holder is told nothing: its window is not asked)
                terms = self.terms(h, waiting)
                if terms != h.told:
                    h.told = terms
                    out.append(act.LockTerms(h.id, s.time_quantum(h.gpu), *terms))
        return out

    # ------------------------------------------------------------ queries

    def untold(self, waiting: Waiting) -> list[int]:
        """Holders whose hook was last told other terms than the line now makes theirs: none
        once `tell` has run (`NodeCore.check`: a phase skipped that should have told one).
        O(holders)."""
        s = self._s
        return sorted(
            h
            for gpu in s.gpus.values()
            for h in gpu.holders
            if s.clients[h].phase is Phase.HOLDING
            and self.terms(s.clients[h], waiting) != s.clients[h].told
        )

    def terms(self, c: Client, waiting: Waiting) -> tuple[float, float]:
        """Holder c's idle window and queue bound."""
        window = self.window(c, waiting)
        return window, self.queue(c) if self._line.lent(c.gpu) else 0.0  # (usually not lent)

    def queue(self, c: Client) -> float:
        """How much work holder c may keep queued while a gang of higher priority lent its GPU
        (`scheduler.borrowerQueue`, or `QUEUE_OF_REQUEST` of the first such lender's learned
        hold if longer), unless c was granted as starved or the bound is off; else 0, no bound."""
        bound = self._s.policy.scheduler.borrower_queue_s
        g = gang_of(self._s, c)
        lender = None if g.full_quantum else next(self._line.lenders_above(c.gpu, g.priority), None)
        if lender is None or bound <= 0:
            return 0.0
        return max(bound, round(QUEUE_OF_REQUEST * lender.request_s, 6))

    def window(self, c: Client, waiting: Waiting) -> float:
        """How long holder c may sit idle with the lock: `scheduler.idleRelease`, or while
        another gang waits for its GPU `scheduler.idleHandoff`, or the window its gang learned
        (`back`; at most idleHandoff) when it outranks every one of them. Taking its GPU back
        costs such a holder little (it is granted at once, beside its borrowers' drain,
        `PriorityRule.borrowed`, and a lone one is told it may submit before asking,
        `LendingRule`), while each moment it sits idle with the lock is its waiters'. A request
        loop beside a trainer then hands the GPU back a fraction of a millisecond after each
        request instead of after `idleHandoff`."""
        settings = self._s.policy.scheduler
        handoff = settings.idle_handoff_s
        if handoff <= 0:
            return settings.idle_release_s
        g = gang_of(self._s, c)
        if not waiting.others(c.gpu, g):
            return settings.idle_release_s
        outranks = waiting.outranked(c.gpu, g)
        if outranks:
            handoff = min(handoff, max(g.idle_s, OUTRANKING_IDLE_S))
        return min(handoff, settings.idle_release_s)


class LendingRule:
    """Which idle lone clients are told their GPU is lent (`Lent`): the lock's last phase asks
    it, once its grants and drops are done.

    - command: `tell` (the phase "tell lenders they lend"): it writes only who was told
      (`Client.lent_told`, `NodeState.lent_told`).
    - query: `taken_back_at_once`: whether a client's request would be granted at once; it
      asks the quota through a copy (`QuotaRule.may_start`) and writes nothing.
    Cost, in clients touched: `tell` O(told + candidates), each candidate one query;
    `taken_back_at_once` O(holders of its GPU + P) (P: the buckets waiting for its GPU).
    """

    def __init__(
        self, state: NodeState, *, line: Line, quotas: QuotaRule, priorities: PriorityRule
    ) -> None:
        self._s = state
        self._line = line  # the idle lenders, by GPU and priority
        self._quotas = quotas  # whether a lender may start
        self._priorities = priorities  # who borrowed, who comes first

    # ------------------------------------------------------------ command (the last phase)

    def tell(self, waiting: Waiting, keeps: ahead.Keeps, now: float) -> list[act.Action]:
        """`Lent` to each lone client whose idle GPU is lent to lower priorities only, and to
        each one told so before for whom that has stopped being true. Only an idle lender of
        a priority above all its GPU's holders (or, with no holder, the lender its GPU is kept
        for) can be lent to."""
        s = self._s
        candidates = set(s.lent_told)
        for uuid, gpu in s.gpus.items():
            if gpu.owners:
                if not self._line.lent(uuid):
                    continue  # (nobody lent it: its holders' priorities do not matter)
                top = max(s.gangs[k].priority for k in gpu.owners)
                lenders = self._line.lenders_above(uuid, top)
            else:
                lenders = (k.lender for k in keeps.get(uuid, ()) if k.on(now))
            for g in lenders:
                candidates |= g.members
        out: list[act.Action] = []
        if not candidates:
            return out  # (nobody lends, nobody was told so: the usual case)
        for c in [s.clients[i] for i in sorted(candidates)]:
            if c.phase is Phase.HOLDING:
                self._told(c, False)  # its grant took its hook out of lending
                continue
            g = gang_of(s, c)
            if g.lent_at is None and not c.lent_told:
                continue
            lent = c.phase is Phase.IDLE and self.taken_back_at_once(c, waiting, keeps, now)
            if lent != c.lent_told:
                self._told(c, lent)
                out.append(act.Lent(c.id, lent))
        return out

    def _told(self, c: Client, lent: bool) -> None:
        c.lent_told = lent
        if lent:
            self._s.lent_told.add(c.id)
        else:
            self._s.lent_told.discard(c.id)

    # ------------------------------------------------------------ query

    def taken_back_at_once(
        self, c: Client, waiting: Waiting, keeps: ahead.Keeps, now: float
    ) -> bool:
        """Whether c's request would be granted at once: its GPU is held by borrowers of its
        gang only (or by nobody, kept for its next request), and no waiter goes before it."""
        s, g = self._s, gang_of(self._s, c)
        owners = [s.gangs[k] for k in s.gpus[c.gpu].owners - {g.key}]
        if g.joint or s.gpu_mode(c.gpu) is not Mode.ON or not self._quotas.may_start(g, now):
            return False
        if owners and not all(self._priorities.borrowed(o, g) for o in owners):
            return False
        if not owners and not any(k.lender is g and k.on(now) for k in keeps.get(c.gpu, ())):
            return False
        asking = [*waiting.firsts(c.gpu), g]  # enough of the waiters to tell who comes first
        return self._priorities.line(asking, now, waiting.owed(asking))[0] is g
