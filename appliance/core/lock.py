"""The GPU lock: granted to gangs, all of a gang's GPUs at once; modes, quanta, quotas, deadlines.

Rules, per GPU (keyed by UUID):
- `on`: one gang holds it at a time, first come first served.
- `off`: everyone runs; clients are told not to gate at all (unless they carry a core quota).
- `auto`: gangs hold it concurrently while their memory fits the GPU; one that does not fit
  waits, and the time quantum then serialises until it fits again.
A gang (`core.gang`; a lone client is a gang of one) is granted all the GPUs it takes at once
and holds none while it waits, so no two gangs can each hold what the other waits for; nobody
skips ahead of a waiting gang on any of its GPUs. A member asking while its gang holds its GPU is
granted at once; a gang that holds only part of its GPUs has the holders in its way drop now.
- A holding gang is asked to drop when someone eligible waits on one of its GPUs and its quantum
  (the shortest of its GPUs') has run out, or when its compute quota for the window is spent;
  a drop asks every member. A client that disconnects frees what it alone used.
- A drop has a deadline (`scheduler.dropDeadline`): a member that has not released by then (a
  hostile client, a hook wedged in a synchronisation) no longer holds the GPU hostage. It is
  taken off the holders, so the next gang is granted; it is marked (status, metrics, log, a
  Warning Event on its pod), and its gang is queued behind every gang that drops in time, until
  it completes a drop in time itself.

Priorities (`priority.PriorityRule`) order the line of gangs (a gang's priority is its members'
highest) and let a waiter of higher priority take a GPU after a short slice of the holder's; the
starvation limit bounds how long a low priority waits. While someone waits for a GPU, its
holders' hooks are told a short idle window (`scheduler.idleHandoff`, `LockTerms`, `terms`).

Guaranteed shares (`share.ShareRule`) come before both: a waiter still owed its share goes
first and takes the GPU from a holder that has had its own; a holder inside its share keeps the
GPU (a gang's members' shares, each on its own GPU, count for the gang).

Compute quotas (`quota_rule.QuotaRule`) bill the time a gang holds the lock (a lone client's
account is its own; a grant into an unused window starts one); a quota holder is dropped early
enough for its drain to end on its budget, and a spent one waits for its next window.

Every client's lock time is accounted exactly here (`state.LockUsage`): how long it held the lock
(from the grant to the release, the drain included), how long it waited for it, and why it was
dropped (`drops.DropReason`); status, `nvsharectl top` and the metrics read it.

The state machine, per gang (`state.GangPhase`; each member's `state.Phase` follows):
IDLE -`_enqueue`-> WAITING -`_grant`-> HOLDING -`_drop`-> DRAINING -`_release`-> IDLE (or
WAITING again when a member asked meanwhile); a holder whose members all release early goes
HOLDING -> IDLE through `_settle`. Only these change a gang's phase, and `gang.GangRule` as lone
gangs merge into one (it keeps their turn). After each event, `schedule` runs its phases in
this order, each asking its rules: pass over late holders (the drop deadline) -> drop spent
quotas (`quotas`) -> reclaim ahead of a steady lender (`reclaims`) -> grant in line order
(`line`, ordered by `priorities` and `shares`; `reclaims.kept_from`, `gangs.grantable`; not
for a request that can grant nobody, `calm`) -> preempt for waiters (`gangs.in_the_way`, then
`yields`: `priorities`, `shares`, quantum) -> tell holders their terms (`terms`) and lenders
they lend (`lending`). `next_deadline` and `grant_message` are queries: they bill and roll
nothing (`NodeCore.check` checks what the phases keep after every event of the core tests).

The rules it asks, each an object on the node's state whose commands are named for the phase
that asks them and whose queries write nothing (`tests/core/test_rules.py`): `quotas`
(`quota_rule.QuotaRule`: bill, spent; drop_at, may_start, opens_at), `shares`
(`share.ShareRule`: granted, dropped, bill; owed, turn_at, resumes, yield_at), `priorities`
(`priority.PriorityRule`: granted, dropped; starved, line, borrowed, yield_at, turn),
`reclaims` (`ahead.ReclaimRule`: asked; keeps, borrowers_due, kept_from, deadlines), `terms`
(`terms.TermsRule`: granted, tell; window), `lending` (`terms.LendingRule`: tell;
taken_back_at_once), `gangs` (`gang.GangRule`: asked, left, turn_over, begin_cut, force_cut,
cut_over; grantable, in_the_way, behind), `yields` (`yielding.Yields`: begin, due, dropped; at).

Cost per event (n clients, G GPUs, P priorities waiting; `node` has the whole table):
requested, released, a Tick: O(G x P + log n + owning + accounted + members of the gangs
involved), never a pass over all waiting clients; `leave`: the same plus its gang's members;
`next_deadline`: O(G + owning + paced lenders), plus O(P) for each GPU whose owners or waiters
moved after the event's preempt phase, or whose holder has a share (`yielding.Yields`).
"""

from __future__ import annotations

import logging

from appliance.core import actions as act
from appliance.core import calm, yielding
from appliance.core import events as ev
from appliance.core.ahead import Keeps, ReclaimRule
from appliance.core.drops import DropReason
from appliance.core.gang import GangRule, gang_of
from appliance.core.line import Line, Waiting
from appliance.core.priority import PriorityRule
from appliance.core.quota import EPSILON_S
from appliance.core.quota_rule import QuotaRule
from appliance.core.share import ShareRule
from appliance.core.state import Client, Gang, GangPhase, NodeState, Phase
from appliance.core.terms import LendingRule, TermsRule

log = logging.getLogger("nvshare.scheduler")

LOCK_NOT_RELEASED = "NvshareLockNotReleased"  # the reason of the Event on an offender's pod
_OWNING = (GangPhase.HOLDING, GangPhase.DRAINING)
Actions = list[act.Action]


class Lock:
    def __init__(self, state: NodeState) -> None:
        self._s = state
        self.quotas = QuotaRule(state)  # (the pattern for the other rules: `quota_rule`)
        self.shares = ShareRule(state)
        self.priorities = PriorityRule(state)
        self.line = Line(state, self.quotas, self.shares, self.priorities)
        self.terms = TermsRule(state, self.line)
        self.lending = LendingRule(
            state, line=self.line, quotas=self.quotas, priorities=self.priorities
        )
        self.reclaims = ReclaimRule(
            state, line=self.line, priorities=self.priorities, shares=self.shares
        )
        self.gangs = GangRule(
            state, priorities=self.priorities, refile=self.line.refile, forget=self.line.forget
        )
        self.yields = yielding.Yields(
            state, line=self.line, priorities=self.priorities, shares=self.shares
        )
        self.told = False  # the last event's schedule told every holder its terms

    # ------------------------------------------------------------ requests

    def requested(self, e: ev.LockRequested, now: float) -> list[act.Action]:
        c = self._s.clients.get(e.client_id)
        if c is None:
            return []
        if not c.gated or c.phase is Phase.HOLDING:
            # Not gated, or already holding: answer at once so the hook never blocks on us.
            return [self.grant_message(c, e.seq, now)]
        c.request_seq = e.seq
        if c.phase in (Phase.DRAINING, Phase.OVERDUE):
            c.requeue = True  # asked again before its release arrived: queue it then
            return []
        out = self.gangs.asked(c, now)
        g = gang_of(self._s, c)
        if e.catch_up and self.gangs.behind(g, c):
            # Behind its gang's cut: it runs to the cut, then releases like the others.
            out.append(self._grant_member(c, now))
            c.phase, c.dropped_at = Phase.DRAINING, g.dropped_at
            return out
        if c.phase is not Phase.WAITING:
            out += self._want(c, now)
        return out + self.schedule(now, quiet=calm.quiet(self._s, self.line, c.gpu))

    def _want(self, c: Client, now: float) -> list[act.Action]:
        g = gang_of(self._s, c)
        c.phase, c.requested_at = Phase.WAITING, now
        g.asked.add(c.gpu)
        if g.phase is GangPhase.HOLDING and c.gpu in g.held:
            return [self._grant_member(c, now)]
        g.gpus.add(c.gpu)  # (a draining gang queues again once every member has released)
        if g.phase is GangPhase.IDLE:
            if g.lent_at is not None:  # back after letting the GPU go idle: its pace (`ahead`)
                self.reclaims.asked(g, now)
                self.terms.back(g, g.lent_at, now)
            self._enqueue(g, now)
        self.line.refile(g)  # (it may wait for one more GPU)
        return []

    def released(self, e: ev.LockReleased, now: float) -> list[act.Action]:
        c = self._s.clients.get(e.client_id)
        if c is None:
            return []
        if c.id in self._s.gpus[c.gpu].holders:
            self._end_hold(c, now)
            self._s.counters[f"releases_{e.reason.value}"] += 1
        elif c.phase is Phase.OVERDUE:
            self._s.counters["releases_late"] += 1
            log.info(
                "client %d (pid %d) released the lock %.1fs after it was told to drop",
                c.id,
                c.ident.pid,
                now - c.dropped_at,
            )
        c.phase = Phase.IDLE  # a waiting client that releases gives up waiting (e.g. exiting)
        g = gang_of(self._s, c)
        phase = g.phase  # (told to drop, its turn is over: an idle release lends nothing)
        if lent := e.reason is ev.ReleaseReason.IDLE and phase is GangPhase.HOLDING:
            g.lent_at = now  # it takes the GPU back at once from a lower priority
            self.terms.held(g, c, now)  # (what it held bounds its borrowers' queues)
        out = self._settle(g, now)
        if lent and g.phase is phase:  # (a gang whose phase changed was filed again)
            self.line.refile(g)
        if c.requeue:
            c.requeue = False
            out += self._want(c, now)
        return out + self.schedule(now)

    def _enqueue(self, g: Gang, now: float) -> None:
        """Wait in line: behind everyone (`PriorityRule.line` orders it); or at its place with
        its starvation clock running on (`PriorityRule.keeps_place`)."""
        if not self.priorities.keeps_place(g, now):
            self._s.tickets += 1
            g.ticket, g.waiting_since, g.served_s = self._s.tickets, now, 0.0
        g.phase, g.requested_at, g.cut_short = GangPhase.WAITING, now, False  # (filed by callers)

    def leave(self, c: Client, now: float) -> tuple[bool, list[act.Action]]:
        """A client that is gone: out of its GPU's holders and its gang; True if it held."""
        held = c.id in self._s.gpus[c.gpu].holders
        if held:
            self._end_hold(c, now)
        self.line.moved.add(c.gpu)  # (its gang may own the GPU no longer)
        c.phase = Phase.IDLE
        g = gang_of(self._s, c)
        out = self.gangs.left(c)
        if g.key in self._s.gangs:
            out += self._settle(g, now)
        return held, out

    def ungate(self, c: Client, now: float) -> list[act.Action]:
        """A client that is no longer gated: a waiting one is answered at once."""
        out: list[act.Action] = []
        if c.phase is Phase.WAITING:
            out.append(self.grant_message(c, c.request_seq, now))
        if c.id in self._s.gpus[c.gpu].holders:
            self._end_hold(c, now)
        c.phase = Phase.IDLE
        return out + self._settle(gang_of(self._s, c), now)

    def grant_message(self, c: Client, seq: int, now: float) -> act.Grant:
        return self.terms.granted(c, seq, self.line.waiting(now))

    # ------------------------------------------------------------ a gang's turn

    def _settle(self, g: Gang, now: float) -> list[act.Action]:
        """A gang whose members all stopped holding has released its GPUs; one whose members
        all stopped waiting leaves the line."""
        phases = {self._s.clients[m].phase for m in g.members}
        if g.phase in _OWNING and not phases & {Phase.HOLDING, Phase.DRAINING}:
            return self._release(g, now)
        if g.phase is GangPhase.WAITING and Phase.WAITING not in phases:
            g.phase = GangPhase.IDLE
            self.line.refile(g)
        return []

    def _release(self, g: Gang, now: float) -> list[act.Action]:
        self._bill(g, now)
        if g.phase is GangPhase.DRAINING and not g.late:
            g.offender = False  # dropped in time: back in line like everyone else
            for uuid in g.held:
                self._s.gpus[uuid].drains.append(now - g.dropped_at)
        for uuid in g.held:
            self._s.gpus[uuid].owners.discard(g.key)
        self.line.moved |= g.held
        g.held = set()
        out = self.gangs.cut_over(g)
        g.phase, g.late = GangPhase.IDLE, False
        self.gangs.turn_over(g)
        if any(self._s.clients[m].phase is Phase.WAITING for m in g.members):
            self._enqueue(g, now)
        self.line.refile(g)
        return out

    def _grant(self, g: Gang, now: float) -> list[act.Action]:
        g.phase = GangPhase.HOLDING
        # Cut short for another's share (`ShareRule.resumes`), or asked back inside its quantum
        # after lending the GPU (`PriorityRule.resumes`; granted after the borrower's drain,
        # maybe past it): it has the rest of its quantum back, not a fresh one ahead of the line.
        quantum = self.priorities.quantum(g)
        resumed = self.shares.resumes(g, now, quantum) or self.priorities.resumes(g, now, quantum)
        g.borrowed_until = 0.0 if resumed else self.line.borrowing(g, now)
        self.priorities.granted(g, now)
        g.lent_at = None
        g.quantum_from = g.quantum_from if resumed else max(now, g.borrowed_until)
        self.shares.granted(g)
        self.quotas.granted(g, now)
        g.granted_at = g.billed_until = now
        g.held, g.asked = set(g.gpus), set()
        for uuid in g.held:
            self._s.gpus[uuid].owners.add(g.key)
        self.line.refile(g)
        if log.isEnabledFor(logging.DEBUG):  # (the sort is not made for nobody)
            log.debug("grant gpus %s -> gang %s", sorted(g.held), g.key)
        return self._grant_waiting_members(g, now)

    def _grant_waiting_members(self, g: Gang, now: float) -> list[act.Action]:
        out: list[act.Action] = []
        for m in sorted(g.members):
            c = self._s.clients[m]
            if c.phase is Phase.WAITING and c.gpu in g.held:
                g.asked.add(c.gpu)
                out.append(self._grant_member(c, now))
        return out

    def _grant_member(self, c: Client, now: float) -> act.Grant:
        self._s.gpus[c.gpu].holders.add(c.id)
        c.phase = Phase.HOLDING
        c.granted_at = now
        c.usage.waited_s += now - c.requested_at
        self._s.counters["grants"] += 1
        log.debug("grant gpu %s -> client %d (pid %d)", c.gpu, c.id, c.ident.pid)
        return self.grant_message(c, c.request_seq, now)

    def _drop(self, g: Gang, now: float, why: DropReason) -> list[act.Action]:
        self._bill(g, now)
        g.phase, g.dropped_at = GangPhase.DRAINING, now
        self.yields.dropped(g)
        self.shares.dropped(g, why)
        self.priorities.dropped(g, now, why)
        self._s.counters[f"drops_{why}"] += 1
        out: list[act.Action] = []
        for m in sorted(g.members):
            c = self._s.clients[m]
            if c.phase is Phase.HOLDING:
                c.phase, c.dropped_at = Phase.DRAINING, now
                c.usage.drops[why] += 1
                log.debug("drop client %d (pid %d): %s", c.id, c.ident.pid, why)
                if not g.joint:
                    out.append(act.Drop(c.id))
        if g.joint:
            out += self.gangs.begin_cut(g)
        return out

    def _bill(self, g: Gang, now: float) -> None:
        """Bill g's quota (`quota_rule`) and its members' shares (`share`) up to now."""
        self.quotas.bill(g, now)
        self.shares.bill(g, now)
        g.billed_until = now

    def _end_hold(self, c: Client, now: float) -> None:
        self._s.gpus[c.gpu].holders.discard(c.id)
        c.usage.held_s += max(0.0, now - c.granted_at)

    # ------------------------------------------------------------ scheduling

    def schedule(self, now: float, *, quiet: str | None = None) -> list[act.Action]:
        """The phases of a decision, in order (the module's docstring): pass over late
        holders, drop spent quotas, reclaim ahead, grant (not if `quiet`), preempt, terms."""
        keeps = self.reclaims.keeps() if self.line.paced else {}  # (nobody to keep a GPU for)
        out = self._pass_over_late_holders(now) + self._drop_spent_quotas(now)
        out += self._reclaim_ahead(keeps, now) if keeps else []
        self.yields.only = None if out else quiet  # (`calm`: nobody can be granted then)
        out += self._grant_waiting(keeps, now) if self.yields.only is None else []
        waiting = self.line.waiting(now)  # who is left waiting, for the holders' turns
        dropped, gangs = self._preempt_for_waiters(waiting, now)
        if gangs and any(yielding.frees(g, waiting) for g in gangs):
            dropped += self._grant_waiting(keeps, now)  # a lender is granted beside the drain
        lending, self.told = self.lending.tell(waiting, keeps, now), True  # (`NodeCore.check`)
        return [*out, *dropped, *self.terms.tell(waiting), *lending]

    def _pass_over_late_holders(self, now: float) -> list[act.Action]:
        """Members still draining past the drop deadline no longer hold their GPUs."""
        deadline = self._s.policy.scheduler.drop_deadline_s
        out: list[act.Action] = []
        for g in list(self.line.owning.values()):
            if g.phase is not GangPhase.DRAINING or now < g.dropped_at + deadline - EPSILON_S:
                continue
            out += self.gangs.force_cut(g)
            for m in sorted(g.members):
                if self._s.clients[m].phase is Phase.DRAINING:
                    out += self._pass_over(g, self._s.clients[m], now)
            out += self._settle(g, now)
        return out

    def _pass_over(self, g: Gang, c: Client, now: float) -> list[act.Action]:
        self._end_hold(c, now)
        c.phase = Phase.OVERDUE
        g.offender = g.late = True
        c.late_drops += 1
        self._s.counters["drops_overdue"] += 1
        message = (
            f"client {c.id} (pid {c.ident.pid}) did not release GPU {c.gpu} within "
            f"{self._s.policy.scheduler.drop_deadline_s:g}s of being told to drop "
            "it (scheduler.dropDeadline); the next client is granted, and this one waits behind "
            "every client that drops in time"
        )
        log.warning("%s", message)
        pod, _ = self._s.pod_of(c.ident)
        return [] if pod is None else [act.PodWarning(pod.ref, LOCK_NOT_RELEASED, message)]

    def _drop_spent_quotas(self, now: float) -> list[act.Action]:
        """A holder whose quota is spent drops, even if nobody waits."""
        out: list[act.Action] = []
        for g in list(self.line.owning.values()):
            if g.phase is not GangPhase.HOLDING or self.quotas.of(g) is None:
                continue
            self._bill(g, now)
            if self.quotas.spent(g, now):
                out += self._drop(g, now, DropReason.QUOTA)
        return out

    def _reclaim_ahead(self, keeps: Keeps, now: float) -> list[act.Action]:
        out: list[act.Action] = []
        for g in self.reclaims.borrowers_due(keeps, now):
            out += self._drop(g, now, DropReason.RECLAIM)
        return out

    def _grant_waiting(self, keeps: Keeps, now: float) -> list[act.Action]:
        """In line order, every gang whose GPUs can all be granted now; a gang that cannot be
        keeps everyone behind it off its GPUs, and so does a GPU kept for a lender (`ahead`)."""
        blocked: set[str] = set()
        out: list[act.Action] = []
        for g in list(self.line.owning.values()):
            if g.phase is not GangPhase.HOLDING:
                continue
            growing = g.gpus - g.held
            if growing and all(self.gangs.grantable(uuid, g) for uuid in growing):
                g.held |= growing
                self.line.moved |= growing
                for uuid in growing:
                    self._s.gpus[uuid].owners.add(g.key)
            blocked |= g.gpus - g.held
            out += self._grant_waiting_members(g, now)
        if self.line.all_taken(blocked):
            return out
        for g in self.line.turns(now):
            if self.gangs.held_back(g, blocked) or self.reclaims.kept_from(keeps, g, now):
                blocked |= g.gpus
                if self.line.all_taken(blocked):
                    break  # everyone further back waits for a GPU taken here
                continue
            out += self._grant(g, now)
        return out

    def _preempt_for_waiters(self, waiting: Waiting, now: float) -> tuple[Actions, list[Gang]]:
        """On each GPU, the holder whose turn for an eligible waiter has come drops (one at a
        time); a gang in the way of one that holds part of its GPUs drops now: (drops, gangs)."""
        dropped, out = self.gangs.in_the_way(self.line.owning.values(), now)[0], []
        for g in dropped:  # (loops, no comprehensions: every event asks every phase)
            out += self._drop(g, now, DropReason.GANG)
        for uuid in self.yields.begin():
            due = self.yields.due(uuid, waiting, now)
            if due is not None and now >= due[0] - EPSILON_S:
                out += self._drop(due[1], now, due[2])
                dropped.append(due[1])
        return out, dropped

    # ------------------------------------------------------------ deadlines

    def next_deadline(self, now: float, *, afresh: bool = False) -> float | None:
        """When to look again: a quantum, slice, quota, drop deadline or window running out.
        A query: it writes nothing. O(G + owning gangs + paced lenders): a GPU's turn is the
        one the preempt phase worked out (`yielding.Yields`), worked out again (O(P)) only
        where its owners or waiters moved since, where it moves with the clock (a holder's
        share), or `afresh` (what the kept one must equal, `NodeCore.check`); a waiter's own
        deadline (a window turning) is the top of the line's heap."""
        times: list[float] = []
        grows = False
        for g in self.line.owning.values():
            if g.phase is GangPhase.DRAINING:
                times.append(g.dropped_at + self._s.policy.scheduler.drop_deadline_s)
            elif (due := self.quotas.drop_at(g)) is not None:
                times.append(due)
            grows = grows or len(g.gpus) > len(g.held)
        later = self.gangs.in_the_way(self.line.owning.values(), now)[1] if grows else None
        if later is not None:
            times.append(later)  # a holder's quantum ends, in the way of a gang that grows
        if (turn := self.line.next_turn()) is not None:
            times.append(turn)  # a waiter's window turns: it may be owed again, or start
        waiting = self.line.waiting(now)
        for uuid in self._s.gpus:
            if (at := self.yields.at(uuid, waiting, now, afresh=afresh)) is not None:
                times.append(at)
        if self.line.paced:  # (`ahead`: lenders at a steady pace are few)
            times += self.reclaims.deadlines(self.reclaims.keeps(), now)
        return min(times) if times else None
