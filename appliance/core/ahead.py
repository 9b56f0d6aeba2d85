"""Taking a GPU back ahead of a lender's next request, when its requests come at a steady pace.

A high-priority request loop lends its GPU between requests (`PriorityRule.borrowed`) and takes it
back at once when the next one comes, beside the borrower's drain (`lock`). That drain still
costs the request: the borrower's last queued work is on the GPU, and the two contexts share
it by time slices until that work has run (no lock can take queued work back). A loop that
serves frames or polls at a fixed rate says when its next request is due, though. So when a
lone client's last `ARRIVALS` requests (each after it let its GPU go idle) came at a steady
pace, every interval within `TOLERANCE` of their median (the period) or of a whole number of
periods (a request that follows a drop, not a lend, is not counted: after a quantum's turn an
interval spans the other's quantum), the GPU is kept for its next one: from `lead` before it
is due, lower-priority holders that borrowed the GPU are dropped and lower priorities are not
granted it (nor an equal, where it lent inside a quantum of its own that it takes back as it
asks: `takes_from`), until the request comes or `lead` after it was due. Then they have the
GPU again until the next request (only the due after the last request is kept for), and a
request that strays from the pace stops the keeping until the pace is steady again. A holder
inside its guaranteed share keeps the GPU, and a waiter owed its share or starved
(`PriorityRule.starved`) is granted it, as against any higher priority.

`lead` is the GPU's longest recent drain (drop to release, the last `state.DRAINS`) plus the
jitter of the requests and `GUARD_S`: enough for the borrower's queued work to have run when the
request comes. It is at most `scheduler.reclaimAhead` (0 turns keeping off) and an eighth of the
period, so a borrower gives up at most that share of its time to the keeping (twice that when
the request does not come, at most once a request). While its GPU is kept, the lender's hook
stays told that it may submit at once (`terms.LendingRule`).
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from appliance.core.line import Line
from appliance.core.priority import PriorityRule
from appliance.core.quota import EPSILON_S
from appliance.core.share import ShareRule
from appliance.core.state import ARRIVALS, Gang, GangPhase, NodeState
from appliance.policy.model import Mode, SchedulerSettings

TOLERANCE = 0.05  # of the period: how far an interval may stray and the pace still be steady
GUARD_S = 0.001  # the request's trip to the daemon, and its timer's (epoll's) milliseconds
MAX_SHARE = 8  # the lead is at most the period over this


def pace(arrivals: Sequence[float]) -> tuple[float, float] | None:
    """(period, jitter) when the last ARRIVALS came at a steady pace; None otherwise. An
    interval of several periods counts (the requests between were not counted: they came
    after a drop, not a lend); its jitter is how far it strays from the nearest whole number
    of periods."""
    if len(arrivals) < ARRIVALS:
        return None
    last = list(arrivals)[-ARRIVALS:]
    gaps = [b - a for a, b in itertools.pairwise(last)]
    period = statistics.median(gaps)
    if period <= 0:
        return None
    jitter = max(abs(gap - max(1, round(gap / period)) * period) for gap in gaps)
    if jitter > period * TOLERANCE:
        return None
    return period, jitter


def window(
    steady: tuple[float, float], last: float, drains: Sequence[float], settings: SchedulerSettings
) -> tuple[float, float] | None:
    """[from, until): when a GPU is kept for the next request of a client whose requests come
    at the `steady` pace (period, jitter), the last at `last`, given the GPU's recent `drains`;
    None when nothing is kept."""
    if settings.reclaim_ahead_s <= 0 or not drains:
        return None
    period, jitter = steady
    lead = min(settings.reclaim_ahead_s, period / MAX_SHARE, max(drains) + jitter + GUARD_S)
    due = last + period
    return due - lead, due + lead


@dataclass(frozen=True, slots=True)
class Keep:
    """A GPU kept for `lender`'s next request over [start, until)."""

    lender: Gang
    start: float
    until: float

    def on(self, now: float) -> bool:
        return self.lender.phase is GangPhase.IDLE and self.start <= now < self.until


Keeps = dict[str, list[Keep]]  # by GPU


class ReclaimRule:
    """Keeping a GPU for a steady lender's next request, as the lock (`lock.Lock`) asks it
    (the module's docstring), like `quota_rule.QuotaRule` for quotas:

    - command: `asked` (a request: a lender back after letting its GPU go idle; it writes the
      gang's arrivals and pace, `Gang.arrivals`, `Gang.pace`, and nothing else).
    - queries, written nothing by: `keeps` (the start of `Lock.schedule`, and `next_deadline`),
      `borrowers_due` (the phase "reclaim ahead of a steady lender"), `kept_from` and
      `takes_from` (the grant phase), `deadlines` (`next_deadline`).
    Cost, in clients touched: `asked` none (O(ARRIVALS)); `keeps` O(paced lenders), read from
    the line; `borrowers_due` the owners of the kept GPUs; `kept_from` none (O(g's GPUs x
    keepings of them)); `deadlines` none (O(keepings)).
    """

    def __init__(
        self, state: NodeState, *, line: Line, priorities: PriorityRule, shares: ShareRule
    ) -> None:
        self._s = state
        self._line = line  # the paced lenders
        self._priorities = priorities  # who is starved
        self._shares = shares  # who is owed its share

    # ------------------------------------------------------------ command (a request)

    def asked(self, g: Gang, now: float) -> None:
        """g asks again after letting its GPU go idle: when, and its pace (`pace`)."""
        g.arrivals.append(now)
        g.pace = pace(g.arrivals)

    # ------------------------------------------------------------ queries

    def keeps(self) -> Keeps:
        """By GPU, the keeping for each lone client in mode `on` that let its GPU go idle and
        whose requests come at a steady pace."""
        s = self._s
        out: Keeps = {}
        for uuid, g in self._line.paced_lenders():
            if g.pace is None or s.gpu_mode(uuid) is not Mode.ON:
                continue
            kept = window(g.pace, g.arrivals[-1], s.gpus[uuid].drains, s.policy.scheduler)
            if kept is not None:
                out.setdefault(uuid, []).append(Keep(g, *kept))
        return out

    def kept_from(self, keeps: Keeps, g: Gang, now: float) -> bool:
        """Whether one of g's GPUs is kept now for a lender that would take it from g as it
        asks (`takes_from`), and g, not owed its guaranteed share, waits for it; a starved g
        is kept from it only by a lender that takes back what it lent from anyone (an equal:
        `PriorityRule.lent_back`), not by a higher priority (against which a turn granted as
        starved is the holder's)."""
        lenders = [
            k.lender
            for uuid in g.gpus
            for k in keeps.get(uuid, ())
            if k.on(now) and self.takes_from(k.lender, g, now)
        ]
        if not lenders or self._shares.owed(g, now) > EPSILON_S:
            return False
        starved = self._priorities.starved(g, now)
        return any(not starved or PriorityRule.lent_own(k, g.priority) for k in lenders)

    def takes_from(self, lender: Gang, g: Gang, now: float) -> bool:
        """Whether `lender`, asking about now, would have the GPU from g granted now at once: it
        is of higher priority, or it lent inside a quantum of its own that runs on and that
        it lends g only until it asks (`PriorityRule.lent_back`: an equal, or any where that
        quantum was granted as starved) and g takes no quantum of its own back. Else two equal
        request loops whose requests come together churn: one borrows the other's quantum,
        is granted as it asks and dropped a moment later as the other asks (each time a drain
        on the other's request)."""
        if lender.priority > g.priority:
            return True
        quantum_s = self._priorities.quantum(lender)
        return (
            PriorityRule.lent_own(lender, g.priority)
            and PriorityRule.takes_back(lender, quantum_s, now)
            and not self._priorities.taking_back(g, now)
        )

    def borrowers_due(self, keeps: Keeps, now: float) -> list[Gang]:
        """The holders that borrowed a GPU kept now for its lender, outside their own share:
        they drop."""
        s = self._s
        due: dict[str, Gang] = {}
        for uuid, kept in keeps.items():
            for o in [s.gangs[k] for k in sorted(s.gpus[uuid].owners)]:
                if o.phase is not GangPhase.HOLDING or self._shares.owed(o, now) > EPSILON_S:
                    continue
                if any(k.on(now) and PriorityRule.borrowed(o, k.lender) for k in kept):
                    due[o.key] = o
        return list(due.values())

    @staticmethod
    def deadlines(keeps: Keeps, now: float) -> list[float]:
        """When a keeping starts or ends."""
        ks = [k for kept in keeps.values() for k in kept]
        return [k.start if now < k.start else k.until for k in ks if now < k.until]
