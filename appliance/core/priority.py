"""Priorities: who among the waiters is granted next, and when a holder gives way to one.

A client's priority (`EffectiveLimits.priority`: policy default, rules, the pod annotation
`nvshare.com/gpu-priority` within `annotations.priorityRange`) orders the line: a higher
priority is granted first; equal priorities keep first come, first served (the queue's order,
which a stable sort keeps); clients that overran a drop deadline stay behind everyone.

A holder gives way to a waiter (`yield_at`):
- of higher priority, after the holder's minimum slice (`scheduler.preemptAfter`) instead of its
  whole quantum; at once when the waiter had the GPU and let it go because it sat idle
  (`lent_at`) before the holder was granted: the holder only borrowed time the waiter was not
  using, and the lender is granted beside the borrower's drain (`borrowed`), so a request loop
  that goes idle between requests waits for neither the drain nor a second round trip;
- of equal priority, when the holder's quantum is over (the rule without priorities); at once
  when the waiter let the GPU go idle inside its own quantum and the holder was granted since
  (`lent_back`): the waiter has the rest of its quantum back (`quantum_from` kept), so a loop
  whose first steps pause on the CPU (loading kernels, allocating) loses only those pauses, not
  a whole quantum of the other's for each; the holder keeps its place in line (`LENT`). What
  a holder lends on while it borrows an equal's quantum (`lent_borrowed`: until
  `Gang.borrowed_until`, set at its grant by `line.Line.borrowing`) it does not take back: it
  waits again at its place, first in line, and the equal whose quantum it was has it back. A
  borrower's own quantum begins where the lent one ends (`Lock._grant`), and if an equal is
  ahead of it in line, or anyone starved by then who has waited longer, it gives way then,
  keeping its place (`borrow_over`, `LENT`): the next turn is that one's. Who borrows lent time
  is not the first in line either: it goes round the waiters of the highest priority it is
  lent to, starved or not (`line.Line.turns`), so no loop has a lender's pauses on top of its
  own turn while the others wait. An equal takes back what it lent from a borrower granted as
  starved too (`full_quantum` guards against higher priorities, not against the lender whose
  quantum it was), and is granted ahead of its starved equals;
- of lower priority, never, until that waiter has waited `scheduler.starvationLimit`: it is then
  starved, first in line ahead of every priority (of several starved, the one that has waited
  longest first, whatever its priority: else, wherever the loops of a priority each wait past
  the limit for their turns among themselves, the starved of a lower one never came first),
  the holder gives way when its quantum is over, and the starved client keeps the lock for a
  whole quantum (`full_quantum`); what it lends inside that quantum it takes back from any
  priority (`lent_own`, `keeps_place`). So a low priority waits at most the starvation limit
  plus a quantum (and a drain), and the other starved clients' quanta where several starve
  at once (several low ones, each wanting a quantum a limit, can want more than the GPU has:
  they then take turns with the higher ones). The wait counts time without
  a turn of its own: a turn another cut short before it was as long as the wait for it or the
  slice any holder has (`cut_short`: a borrower's near-zero slice) leaves its clock running and
  its place in line kept (`Gang.waiting_since`), whoever lent it the turn; otherwise a `high`
  tenant that lends its idle GPU and asks again a moment later would reset its victim's clock
  with every lend. But what it holds in such turns adds up (`Gang.served_s`), and once that is
  the slice any holder has, it has had its turn: its clock starts again and it goes behind the
  others; else a trainer borrowing half a steady request loop's GPU in 20 ms slices counted as
  starved after the limit, had every slice while the trainer behind it had none, and each then
  held a whole quantum while the request loop above them waited.

The lock is granted to gangs (`core.gang`; a client on one GPU is a gang of one), so these
rules order and compare gangs: a gang's priority is its members' highest.

`PriorityRule` is the one object that answers for priorities, as `quota_rule.QuotaRule` does for
quotas; the lock's phases (`lock.Lock`), the line (`line.Line`), `yielding`, `ahead`, `terms` and
`gang.GangRule` ask it:
- commands: `granted` (the grant phase: whether the turn is a starved one's whole quantum,
  `Gang.full_quantum`, and when it last borrowed an equal's, `Gang.borrowed_at`) and `dropped`
  (a drop: whether the turn was cut short, `Gang.cut_short`, and what it held in turns cut
  short, `Gang.served_s`). They write those facts of the gang asked about and nothing else.
- queries: `starved`, `patience`, `line`, `borrowed`, `takes_back`, `lent_borrowed`,
  `quantum`, `taking_back`, `lent_back`, `lent_own`, `keeps_place`, `resumes`, `borrow_over`,
  `yield_at`, `turn`. They read the gangs they are given and the scheduler's settings, and
  write nothing.
Cost, in clients touched: none; each question reads the gangs it is given (`line`: those
waiters, sorted; the lock hands it one per bucket, `line.Waiting.firsts`), never a pass over
all clients.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

from appliance.core.drops import DropReason
from appliance.core.quota import EPSILON_S
from appliance.core.state import Gang, NodeState

PREEMPTED = DropReason.PRIORITY  # (the names this module has used for them)
QUANTUM = DropReason.QUANTUM
CUT_SHORT = (DropReason.PRIORITY, DropReason.RECLAIM, DropReason.GANG)  # when short (LENT: always)


def quantum_over(g: Gang, quantum_s: float) -> float:
    """When g's quantum (`quantum_s` long) is over: `EPSILON_S` before its end, as the lock
    drops a holder whose turn has come (`lock.Lock`), so that a lender asking in that instant
    is not granted as taking back and dropped in the same event."""
    return g.quantum_from + quantum_s - EPSILON_S


def quantum_runs(g: Gang, quantum_s: float, t: float) -> bool:
    """Whether g's quantum (`quantum_s` long) runs at t (`quantum_over`)."""
    return t < quantum_over(g, quantum_s)


class PriorityRule:
    """Priorities, as the lock and its parts ask about them (the module's docstring)."""

    def __init__(self, state: NodeState) -> None:
        self._s = state

    # ------------------------------------------------------------ commands (the lock's phases)

    def granted(self, g: Gang, now: float) -> None:
        """The grant phase: a gang granted after waiting past the starvation limit keeps the
        lock for its whole quantum (`full_quantum`): no higher priority cuts it short; one
        granted an equal's lent quantum (`Gang.borrowed_until`, worked out first) borrowed it
        now (`borrowed_at`: what equals lend goes round their waiters, `line.Line.turns`)."""
        g.full_quantum = self.starved(g, now)
        if g.borrowed_until:
            g.borrowed_at = now

    def dropped(self, g: Gang, now: float, why: DropReason) -> None:
        """A drop: whether the turn that ends now for `why` was too short to count as the
        gang's own (`cut_short`): taken by a higher claim (a higher priority, its lender's
        pace, a gang that holds part of its GPUs) before it held as long as it had waited for
        the turn, and before the slice any holder has (`scheduler.preemptAfter`); or, however
        long it held, an equal taking back the GPU it lent (`lent_back`): the turn was the
        lender's, and a lender that lends and asks again would send every waiter it lends to
        to the back, one by one (a loop fed by a data loader, pausing often and long, did).
        Its starvation clock then runs on and it keeps its place (`starved`), until what it
        held in such turns since that clock started (`served_s`; not counting `lent` ones: an
        equal's quantum) adds up to the slice any holder has. Not its own quota, an equal's
        quantum over, nor a share (shares are bounded by 100 % of a window): those turns go
        round."""
        held, waited = now - g.granted_at, g.granted_at - g.requested_at
        slice_s = self._s.policy.scheduler.preempt_after_s
        if why in CUT_SHORT:
            g.served_s += held
        g.cut_short = why is DropReason.LENT or (
            why in CUT_SHORT and held < min(waited, slice_s) and g.served_s < slice_s
        )

    # ------------------------------------------------------------ queries

    def patience(self, now: float) -> float:
        """Who asked before this (`Gang.waiting_since`) is starved now."""
        return now - self._s.policy.scheduler.starvation_limit_s

    def starved(self, g: Gang, now: float) -> bool:
        """Whether a waiting gang has gone without a turn of its own past the starvation
        limit: the clock (`Gang.waiting_since`) runs from its request on, through any turn a
        higher priority cut short, whoever lent it that turn."""
        return now >= g.waiting_since + self._s.policy.scheduler.starvation_limit_s

    def line(self, waiters: Iterable[Gang], now: float, owed: Collection[str] = ()) -> list[Gang]:
        """Waiters in the order they are granted (`line.Line.turns`, but for who borrows lent
        time, which is not a turn): offenders last; first those still `owed` part of their
        guaranteed share (`share`; gang keys), then those taking back a quantum granted as
        starved (from anyone: `lent_own`), then the starved, a priority's starved before
        another's if its longest waiting has waited longer, then by priority; among equals
        one taking back the GPU it lent (`takes_back`) first, starved equals or not, the
        others in the order they came (the sort is stable)."""
        waiters = list(waiters)
        patience = self.patience(now)
        since: dict[tuple[bool, bool, int], float] = {}  # each class's longest waiting
        for g in waiters:
            cls = (g.offender, g.key in owed, g.priority)
            since[cls] = min(since.get(cls, g.waiting_since), g.waiting_since)

        def key(g: Gang) -> tuple[bool, bool, bool, bool, float, int, bool]:
            first = since[(g.offender, g.key in owed, g.priority)]
            return (
                g.offender,
                g.key not in owed,
                not (g.full_quantum and self.taking_back(g, now)),
                first > patience,
                first if first <= patience else 0.0,
                -g.priority,
                not self.taking_back(g, now),
            )

        return sorted(waiters, key=key)

    @staticmethod
    def borrowed(holder: Gang, lender: Gang) -> bool:
        """Whether `holder` was granted time that `lender`, of higher priority, let go idle."""
        return (
            lender.priority > holder.priority
            and not holder.full_quantum
            and lender.lent_at is not None
            and holder.granted_at >= lender.lent_at
        )

    @staticmethod
    def takes_back(lender: Gang, quantum_s: float, at: float | None = None) -> bool:
        """Whether `lender` let its GPU go idle and asked again (or, given `at`, would ask
        then: `ahead.ReclaimRule.takes_from`) before its own quantum was over: an equal
        granted since gives way to it at once (`lent_back`), so among its equals it is also
        granted first (`line.Line.turns`, while that quantum runs: `taking_back` given the
        time), not granted and dropped; and granted, it has what was left of that quantum
        (`lock.Lock._grant`), even when the borrower's drain ran past it. Not what it lent
        while it borrowed an equal's quantum (`lent_borrowed`): that quantum was the equal's,
        and a loop that pauses, borrowing from another that does, would take it from the very
        loop it borrowed it from."""
        if lender.lent_at is None or PriorityRule.lent_borrowed(lender):
            return False
        return quantum_runs(lender, quantum_s, lender.requested_at if at is None else at)

    @staticmethod
    def lent_borrowed(g: Gang) -> bool:
        """Whether g let go idle a GPU it was granted while an equal lent it, before that
        one's quantum was over (`Gang.borrowed_until`): it takes nothing back, and waits
        again at its place in line (it was first when it borrowed)."""
        return g.lent_at is not None and g.lent_at < g.borrowed_until

    def quantum(self, g: Gang) -> float:
        """A gang's own quantum: the shortest of the GPUs it asks for."""
        return min(map(self._s.time_quantum, g.gpus))

    def taking_back(self, lender: Gang, now: float | None = None) -> bool:
        """`takes_back` with the lender's own quantum (`quantum`); given `now`, only if that
        quantum still runs then: a lender whose quantum ran out while it waited (behind a
        starved turn, say) takes nothing back, and waits like anyone from when it asked."""
        return self.takes_back(lender, self.quantum(lender), now)  # (it asked before now)

    @staticmethod
    def lent_back(holder: Gang, lender: Gang, quantum_s: float) -> bool:
        """Whether `holder` was granted time that `lender` let go idle, and the lender asked
        again before its own quantum was over, where that quantum was the lender's against the
        holder: the lender is of equal priority (a holder granted as starved too:
        `full_quantum` guards a turn against higher priorities, not this time, which was the
        lender's; with the default quantum and starvation limit, 30 s each, every one of three
        or more equals is granted as starved, and a loop that paused lost its whole quantum to
        the loop it lent its first pause to), or was granted it as starved (`keeps_place`: a
        trainer that lowered itself lost its starved quantum at its first data-loader pause).
        Not a holder that was itself granted the rest of a quantum it had lent (`resumes`:
        its quantum began before its grant): of two equals that each lent a quantum of their
        own to a higher priority and asked again together, the first granted was dropped at
        once for the other. Nor one granted after the lender's quantum was over: that time
        was nobody's."""
        return (
            PriorityRule.lent_own(lender, holder.priority)
            and lender.lent_at is not None
            and holder.granted_at >= lender.lent_at
            and holder.quantum_from >= holder.granted_at
            and PriorityRule.takes_back(lender, quantum_s)
            and quantum_runs(lender, quantum_s, holder.granted_at)
        )

    @staticmethod
    def lent_own(lender: Gang, priority: int) -> bool:
        """Whether what `lender` lends inside its quantum it lends a gang of `priority` only
        until it asks again (`lent_back`): an equal, or any, if that quantum was granted as
        starved."""
        return lender.priority == priority or lender.full_quantum

    def keeps_place(self, g: Gang, now: float) -> bool:
        """Whether g, asking again now, waits at its place in line with its starvation clock
        running on (`lock.Lock._enqueue`): after a turn cut short (`cut_short`), after lending
        a GPU it borrowed (`lent_borrowed`), or after lending inside a quantum it was granted
        as starved: that quantum is still its own (`lent_back`, from any priority)."""
        starved_own = g.full_quantum and g.lent_at is not None
        return (
            g.cut_short
            or self.lent_borrowed(g)
            or (starved_own and quantum_runs(g, self.quantum(g), now))
        )

    def resumes(self, g: Gang, now: float, quantum_s: float) -> bool:
        """Whether g, granted now, has what is left of its quantum, not a fresh one
        (`lock.Lock._grant`): it asked back inside its quantum after lending it
        (`takes_back`), and that quantum was granted as starved or g is not starved now (a
        lender granted as starved after a turn that was not has a whole quantum: a trainer
        that lowered itself and lent at its first pause was granted after 30 s with nothing
        left of the quantum it had lent, and dropped at once)."""
        return self.takes_back(g, quantum_s) and (g.full_quantum or not self.starved(g, now))

    def borrow_over(self, holder: Gang, waiter: Gang) -> bool:
        """Whether `holder` borrows a lent quantum (its own begins when that one ends:
        `Gang.quantum_from`, set at its grant) and `waiter` is ahead of it in line then: an
        equal that came before it, or one starved by then that has waited longer. The turn
        after the lent quantum is the waiter's, so the borrower gives way when the lent quantum
        ends, and keeps its place (a `lent` drop is cut short)."""
        if holder.quantum_from <= holder.granted_at:
            return False
        if waiter.priority == holder.priority:
            return waiter.ticket < holder.ticket
        starving_at = waiter.waiting_since + self._s.policy.scheduler.starvation_limit_s
        return starving_at <= holder.quantum_from and waiter.waiting_since < holder.waiting_since

    def yield_at(self, holder: Gang, waiter: Gang, quantum_s: float) -> tuple[float, DropReason]:
        """When `holder` must drop for `waiter` (if it still holds and the waiter still waits
        then), and why."""
        settings = self._s.policy.scheduler
        if waiter.priority > holder.priority and not holder.full_quantum:
            slice_s = 0.0 if self.borrowed(holder, waiter) else settings.preempt_after_s
            return min(holder.granted_at + slice_s, holder.quantum_from + quantum_s), PREEMPTED
        quantum_over = holder.quantum_from + quantum_s
        if self.lent_back(holder, waiter, quantum_s):
            return min(holder.granted_at, quantum_over), DropReason.LENT  # the lender's quantum
        if self.borrow_over(holder, waiter):
            return holder.quantum_from, DropReason.LENT  # the lent quantum ends: not its turn
        if waiter.priority < holder.priority:
            starving_at = waiter.waiting_since + settings.starvation_limit_s
            return max(quantum_over, starving_at), QUANTUM
        return quantum_over, QUANTUM

    def turn(
        self, holder: Gang, rivals: Iterable[Gang], quantum_s: float
    ) -> tuple[float, DropReason]:
        """The earliest `yield_at` of `holder` for any of `rivals` (at least one)."""
        best: tuple[float, DropReason] | None = None
        for w in rivals:  # (a loop: `min` of a generator costs a call per rival more)
            at = self.yield_at(holder, w, quantum_s)
            if best is None or at < best:
                best = at
        assert best is not None, "no rival"
        return best
