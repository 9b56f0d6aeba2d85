"""The lock's indexes: who waits, who owns a GPU, who lent one, kept where they change.

Why it exists: an event must cost the same with 16 or 2,000 clients connected. The rules
(`lock`, `priority`, `share`, `ahead`, `terms`) ask who is next in line, who else waits for this
GPU, who of a higher priority lent it, when must its holder give way: answered by a pass over
every gang, an event cost 131,000 instructions per waiting client. Here each gang is filed
once, when what it is filed by changes (`refile`), and the questions read the files:

- **owning**: gangs holding or draining a GPU (a handful: one per GPU in mode `on`).
- **the line**: waiting gangs in buckets by GPU and (offender, owed its share, priority), each
  in ticket order (request order): its starved (`PriorityRule.starved`) are a prefix, its first
  the longest waiting. The order of grants (`PriorityRule.line`) is each GPU's on its own, all
  GPUs' parts sorted together and read lazily (the lock stops once every GPU anyone waits for is
  taken; a gang of several GPUs is given out once): owed shares first, offenders last, and
  within each: lenders taking back a quantum granted as starved (from any priority), and where
  such a quantum is lent, the waiter of the highest priority that borrowed such time longest
  ago (`_borrower`: lent time goes round); then the starved parts, the one whose first has
  waited longest first (on its GPU: not another GPU's); then the rest by priority. In a
  bucket's first part read, an equal taking back the GPU it lent (`PriorityRule.takes_back`)
  goes first (ahead of the starved equals too: the quantum is its own), then where an equal
  lent and takes not back, who borrows it.
- **accounts of waiters**: whether a waiting gang with a quota may start, and whether one with a
  guaranteed share is owed part of it, change only when one of its windows turns (nothing bills
  a waiter), and whether a lender takes back when its quantum runs out. A gang is filed by
  these as of the time it is filed, and filed again when one turns (a heap of those times);
  one whose quota is spent rests outside the line.
- **idle lenders**: lone gangs that let their GPU go idle and have not been granted since
  (`PriorityRule.borrowed`, `terms.LendingRule`, `ahead`), by GPU and priority; apart, those whose
  requests come at a steady pace (`ahead` keeps their GPU for their next request); and per
  GPU the one that lent it last (`borrowing`: whether a grant borrows an equal's quantum).

Costs (n clients, G GPUs, P a GPU's buckets: (offender, owed, priority) waiting): `refile`
O(G + log n) (a sorted insert moves pointers in C); `turns` O(P x G) to start and O(1) a gang; the
questions of `Waiting` O(P) for one GPU; a window turn files its accounted waiters again (once a
window, not once an event); status's `queue` of a GPU O(P log P + its waiters). Accounts are only
looked at, through copies (`QuotaRule.may_start`, `ShareRule.owed`): asking never bills anything.

`check` compares every index with a pass over all gangs; the core tests call it after each event.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator

from appliance.core.bucket import Bucket, Class, Filing, borrowed_at, bucket_of, remove_from
from appliance.core.gang import account
from appliance.core.priority import PriorityRule, quantum_over
from appliance.core.quota import EPSILON_S
from appliance.core.quota_rule import QuotaRule
from appliance.core.share import ShareRule
from appliance.core.state import Gang, GangPhase, NodeState

_OWNING = (GangPhase.HOLDING, GangPhase.DRAINING)
# The order of `turns`: offender, not owed, what is read (a quantum lent, starved, the rest),
# since when its first has waited (starved) or 0, and -priority
LineKey = tuple[bool, bool, int, float, int]
# A part of one GPU's bucket: (key, bucket, what is read, first read of the bucket, its lender
# taking its GPU back, the gang that lent the GPU a quantum that runs on, if nobody takes it back)
Part = tuple[LineKey, Bucket, int, bool, Gang | None, Gang | None]
Starved = Callable[[Gang], bool]
_LENT, _STARVED, _REST = 0, 1, 2


class Line:
    """Every gang filed by what the lock asks of it (see the module's docstring)."""

    def __init__(
        self, state: NodeState, quotas: QuotaRule, shares: ShareRule, priorities: PriorityRule
    ) -> None:
        self._s = state
        self._priorities = priorities  # who is starved
        self._quotas = quotas  # whether a waiter may start, and when it may again
        self._shares = shares  # whether a waiter is owed its share, and when it may be again
        self.now = 0.0  # the time of the event being handled (`NodeCore.handle` sets it)
        self.owning: dict[str, Gang] = {}
        self._filed: dict[str, Filing] = {}  # every waiting gang
        self._resting: dict[str, Gang] = {}  # the others: their quota keeps them out for now
        self._by_gpu: dict[str, dict[Class, Bucket]] = {}
        self._waited: dict[str, int] = {}  # GPU -> eligible gangs waiting for it
        self._turns: list[tuple[float, int, str]] = []  # (a window turns, stamp, key): a heap
        self._stamp: dict[str, int] = {}  # key -> the stamp of its live entry in _turns
        self._stamps = 0
        self._lenders: dict[str, dict[int, dict[str, Gang]]] = {}  # GPU -> priority -> key -> gang
        self._lent_by: dict[str, tuple[str, int]] = {}  # key -> (GPU, priority) it is filed by
        self._paced: dict[str, tuple[str, Gang]] = {}  # lenders at a steady pace (`ahead`)
        self._last_lent: dict[str, str] = {}  # GPU -> the key of the gang that lent it last
        self._waiting = Waiting(self)  # (it keeps nothing of its own: one for every asker)
        # GPUs whose waiters or owners changed since the lock last worked out when their
        # holders give way (`Lock.next_deadline` works those out again, and only those)
        self.moved: set[str] = set()

    # ------------------------------------------------------------ filing

    def refile(self, g: Gang) -> None:
        """File g again by what it is now: O(G + log n)."""
        self._unfile(g.key)
        self.moved.update(g.gpus)  # (what it holds is among them)
        if self._s.gangs.get(g.key) is not g:
            return  # gone
        if g.phase in _OWNING:
            self.owning[g.key] = g
        elif g.phase is GangPhase.WAITING:
            self._file_waiting(g)
        elif g.lent_at is not None and not g.joint:
            gpu = self._s.clients[next(iter(g.members))].gpu
            self._lenders.setdefault(gpu, {}).setdefault(g.priority, {})[g.key] = g
            self._lent_by[g.key] = (gpu, g.priority)
            self._last_lent[gpu] = g.key
            if g.pace is not None:
                self._paced[g.key] = (gpu, g)

    def forget(self, key: str) -> None:
        """A gang that no longer exists."""
        self._unfile(key)

    def _file_waiting(self, g: Gang) -> None:
        s, now = self._s, self.now
        eligible, owed, turn = True, False, None
        if accounted(s, g):
            eligible = self._quotas.may_start(g, now)
            owed = self._shares.owed(g, now) > EPSILON_S
            opens = None if eligible else self._quotas.opens_at(g, now)
            turns = (self._shares.turn_at(g, now), opens)
            turn = min((t for t in turns if t is not None), default=None)
        if back := g.lent_at is not None and self._priorities.taking_back(g, now):
            lapse = quantum_over(g, self._priorities.quantum(g))  # (then it takes nothing
            turn = lapse if turn is None else min(turn, lapse)  # back: filed again)
        f = Filing(
            ticket=g.ticket,
            priority=g.priority,
            offender=g.offender,
            gpus=tuple(g.gpus),
            lent_at=g.lent_at,
            back=back,
            borrowed_at=borrowed_at(g),
            eligible=eligible,
            owed=owed,
        )
        self._filed[g.key] = f
        if turn is not None:
            self._stamps += 1
            self._stamp[g.key] = self._stamps
            heapq.heappush(self._turns, (turn, self._stamps, g.key))
        if not eligible:
            self._resting[g.key] = g
            return  # rests until its quota's window turns
        cls = f.cls
        for uuid in f.gpus:
            self._waited[uuid] = self._waited.get(uuid, 0) + 1
            bucket_of(self._by_gpu.setdefault(uuid, {}), cls).add(g, f)

    def _unfile(self, key: str) -> None:
        self.owning.pop(key, None)
        self._paced.pop(key, None)
        self._stamp.pop(key, None)  # (its entry in _turns is skipped when it comes up)
        if (lent := self._lent_by.pop(key, None)) is not None:
            by_priority = self._lenders[lent[0]]
            del by_priority[lent[1]][key]
            if not by_priority[lent[1]]:
                del by_priority[lent[1]]
        self._resting.pop(key, None)
        f = self._filed.pop(key, None)
        if f is None or not f.eligible:
            return
        self.moved.update(f.gpus)
        cls = f.cls
        for uuid in f.gpus:
            self._waited[uuid] -= 1
            if not self._waited[uuid]:
                del self._waited[uuid]
            remove_from(self._by_gpu[uuid], cls, key, f)

    def catch_up(self, now: float) -> None:
        """File again the waiters one of whose windows (or quantum taken back) has turned by
        `now` (the index follows the clock; no account is touched)."""
        if now > self.now:
            self.now = now
        while self._turns and (  # (asked several times an event: usually no window turns)
            self._turns[0][0] <= now or self._stamp.get(self._turns[0][2]) != self._turns[0][1]
        ):
            _, stamp, key = heapq.heappop(self._turns)
            if self._stamp.get(key) == stamp:
                self.refile(self._s.gangs[key])

    def next_turn(self) -> float | None:
        """When the first window of a waiter turns (it may then be owed, or may start)."""
        return self._turns[0][0] if self._turns else None

    # ------------------------------------------------------------ the line

    def turns(self, now: float) -> Iterator[Gang]:
        """The eligible waiting gangs in the order they are granted (`PriorityRule.line`, GPU
        by GPU: every GPU's parts sorted together; a gang that waits for several GPUs given out
        once; lent time round its waiters: `_borrower`), read lazily: O(P x G) to start, O(1)
        a gang."""
        self.catch_up(now)
        starved = self._starved(now)
        parts: list[Part] = []
        for uuid in self._by_gpu:
            self._parts(uuid, starved, now, parts)
        return self._given(parts, starved)

    def _parts(self, uuid: str, starved: Starved, now: float, parts: list[Part]) -> None:
        """GPU `uuid`'s buckets' parts, added to `parts`: O(P)."""
        buckets = self._by_gpu.get(uuid, {})
        lent = self._lent_quantum(uuid, now) if uuid in self._last_lent else None
        lender = lent[0] if lent is not None else None
        if lender is not None and any(self._lender_back(b) for b in buckets.values()):
            lender = None  # a lender takes it back: nobody borrows it
        starved_lent = lender is not None and lender.full_quantum
        for (offender, owed, prio), bucket in buckets.items():
            back = self._lender_back(bucket) if bucket.back else None  # (usually none)
            if starved_lent or (back is not None and back.full_quantum):
                key = (offender, not owed, _LENT, 0.0, -prio)
                parts.append((key, bucket, _LENT, False, back, lender))
            head = bucket.first()
            if has_starved := starved(head):  # (else it has no starved prefix to read)
                key = (offender, not owed, _STARVED, head.waiting_since, -prio)
                parts.append((key, bucket, _STARVED, True, back, lender))
            key = (offender, not owed, _REST, 0.0, -prio)
            parts.append((key, bucket, _REST, not has_starved, back, lender))

    def _given(self, parts: list[Part], starved: Starved) -> Iterator[Gang]:
        parts.sort(key=lambda p: p[0])  # (stable: equal keys are two GPUs' parts of a class)
        given: set[str] = set()
        for part in parts:
            for g in self._read(part, starved):
                if g.key not in given:
                    given.add(g.key)
                    yield g

    def _read(self, part: Part, starved: Starved) -> Iterator[Gang]:
        """The gangs of one part of one GPU's bucket: a quantum granted as starved and lent
        (`_LENT`: by priority), its lender taking it back first, then who borrows it; else, in
        the bucket's first part read, its lender taking its own quantum back (first among its
        equals, the starved too: the quantum is its own), then who borrows an equal's time;
        then the bucket's starved prefix, or the rest, in ticket order."""
        key, bucket, what, first_read, back, lender = part
        lent = what == _LENT
        if lent or first_read:
            if back is not None and back.full_quantum == lent:
                yield back
            if (g := self._borrower(bucket, -key[4], lender, lent)) is not None:
                yield g
        if not lent:
            yield from bucket.walk(starved, what == _STARVED, () if back is None else (back,))

    @staticmethod
    def _borrower(bucket: Bucket, prio: int, lender: Gang | None, starved: bool) -> Gang | None:
        """Where `lender` lent its GPU inside its quantum to `bucket`'s class, of priority
        `prio` (`PriorityRule.lent_own`: an equal; or any, from a quantum granted as `starved`),
        who of it borrows next: who borrowed such time longest ago, starved or not (lent time
        goes round). (`_parts` passes no lender where one takes the GPU back: two borrowers
        churn.) O(1)."""
        if lender is None or lender.full_quantum is not starved:
            return None
        return bucket.next_borrower() if PriorityRule.lent_own(lender, prio) else None

    def _lender_back(self, bucket: Bucket) -> Gang | None:
        """The bucket's earliest lender taking its GPU back (filed so while its quantum runs)."""
        return bucket.first_lender(self.now, back=True)

    def _starved(self, now: float) -> Starved:
        patience = self._priorities.patience(now)
        return lambda g: g.waiting_since <= patience

    def queue(self, uuid: str, now: float) -> list[int]:
        """The clients waiting for GPU `uuid` in the order `turns` grants their gangs, then those
        whose quota keeps them out until a window turns (by priority, then when they asked).
        For status: O(P log P + waiting for uuid)."""
        self.catch_up(now)
        starved = self._starved(now)
        parts: list[Part] = []
        self._parts(uuid, starved, now, parts)
        gangs = list(self._given(parts, starved))
        resting = (g for g in self._resting.values() if uuid in g.gpus)
        gangs += sorted(resting, key=lambda g: (g.offender, -g.priority, g.ticket))
        clients, out = self._s.clients, []
        for g in gangs:
            if g.joint:
                out += sorted(m for m in g.members if clients[m].gpu == uuid)
            else:  # (a lone gang's one member waits for the one GPU it waits for)
                out += g.members
        return out

    def all_taken(self, blocked: set[str]) -> bool:
        """Whether every GPU someone eligible waits for is in `blocked`: O(G)."""
        return self._waited.keys() <= blocked

    def paced_lenders(self) -> Iterator[tuple[str, Gang]]:
        """(GPU, gang) for every idle lone gang that lent its GPU and asks at a steady pace."""
        return iter(self._paced.values())

    @property
    def paced(self) -> bool:
        """Whether an idle lone gang that lent its GPU asks at a steady pace."""
        return bool(self._paced)

    def lent(self, uuid: str) -> bool:
        """Whether an idle lone gang lent GPU `uuid`."""
        return bool(self._lenders.get(uuid))

    def borrowing(self, g: Gang, now: float) -> float:
        """Granted now, until when g borrows (`Gang.borrowed_until`): the end of the quantum
        of the gang that last lent g's GPU, if it lends it g only until it asks again (an
        equal, or a quantum granted as starved: `PriorityRule.lent_own`), has not had it back
        and its quantum (or the one it borrowed in turn) runs on; 0.0 if g borrows from
        nobody. g itself, if what it lent it borrowed: it borrows on (else it had a quantum of its
        own as it asked again, beside the lender's). O(1). (A gang taking its own quantum back
        borrows nothing: `Lock._grant` does not ask.)"""
        gpu = self._s.clients[next(iter(g.members))].gpu
        lent = None if g.joint else self._lent_quantum(gpu, now)
        if lent is None or not PriorityRule.lent_own(lent[0], g.priority):
            return 0.0
        return 0.0 if lent[0] is g and not PriorityRule.lent_borrowed(g) else lent[1]

    def _lent_quantum(self, uuid: str, now: float) -> tuple[Gang, float] | None:
        """The gang that last lent GPU `uuid` and when the quantum it lent ends, if it has not
        had the GPU back and that quantum (its own, or one it borrowed) runs on. O(1)."""
        lender = self._s.gangs.get(self._last_lent.get(uuid, ""))
        if lender is None or lender.lent_at is None:
            return None
        if lender.phase is GangPhase.WAITING and self._priorities.taking_back(lender):
            return None  # it is taking it back
        if PriorityRule.lent_borrowed(lender):
            end = lender.borrowed_until
        else:
            end = lender.quantum_from + self._priorities.quantum(lender)
        return (lender, end) if end > now else None

    def lenders_above(self, uuid: str, priority: int) -> Iterator[Gang]:
        """Idle lone gangs that lent GPU `uuid`, of a priority above `priority` (first: O(P))."""
        by_priority = self._lenders.get(uuid, {})
        return (g for p, gangs in by_priority.items() if p > priority for g in gangs.values())

    def waiting(self, now: float) -> Waiting:
        self.catch_up(now)
        return self._waiting

    def owed_now(self, g: Gang) -> bool:
        """Whether g (not filed as a waiter: a lender, a holder) is still owed part of its
        share at the time of the event being handled."""
        return self._shares.owed(g, self.now) > EPSILON_S

    # ------------------------------------------------------------ the check

    def check(self) -> None:
        """Every index against a pass over all gangs (tests call it after every event)."""
        s = self._s
        self.catch_up(self.now)
        owning = {k for k, g in s.gangs.items() if g.phase in _OWNING}
        assert owning == self.owning.keys(), (owning, self.owning.keys())
        waiting = {k: g for k, g in s.gangs.items() if g.phase is GangPhase.WAITING}
        assert waiting.keys() == self._filed.keys(), (waiting.keys(), self._filed.keys())
        resting = {k for k, f in self._filed.items() if not f.eligible}
        assert resting == self._resting.keys(), (resting, self._resting.keys())
        for k, g in waiting.items():
            f = self._filed[k]
            back = g.lent_at is not None and self._priorities.taking_back(g, self.now)
            borrowed = borrowed_at(g)
            now_filed = (g.ticket, g.priority, g.offender, set(g.gpus), g.lent_at, back, borrowed)
            was = (f.ticket, f.priority, f.offender, set(f.gpus), f.lent_at, f.back, f.borrowed_at)
            assert now_filed == was, (k, now_filed, was)
            owed = self._shares.owed(g, self.now) > EPSILON_S
            assert (f.eligible, f.owed) == (self._quotas.may_start(g, self.now), owed), k
        lenders = {
            k
            for k, g in s.gangs.items()
            if g.phase is GangPhase.IDLE and g.lent_at is not None and not g.joint
        }
        assert lenders == self._lent_by.keys(), (lenders, self._lent_by.keys())
        for k in lenders:
            g = s.gangs[k]
            assert self._lent_by[k] == (s.clients[next(iter(g.members))].gpu, g.priority), k
        paced = {k for k in lenders if s.gangs[k].pace is not None}
        assert paced == self._paced.keys(), (paced, self._paced.keys())


def accounted(s: NodeState, g: Gang) -> bool:
    """A gang whose place in line moves with its windows: a quota, or a member's share."""
    if account(s, g) is not None:
        return True
    for m in g.members:  # (a loop: asked for every gang that starts waiting)
        if s.clients[m].guarantee is not None:
            return True
    return False


class Waiting:
    """Who waits for a GPU, as the rules ask it; reads the line as it is, writes nothing.
    Each question O(P) for one GPU."""

    def __init__(self, line: Line) -> None:
        self._line = line

    def any(self, uuid: str) -> bool:
        """Whether an eligible gang waits for GPU `uuid`."""
        return uuid in self._line._waited

    def others(self, uuid: str, mine: Gang) -> bool:
        """Whether an eligible gang other than `mine` waits for GPU `uuid`."""
        waiting = self._line._waited.get(uuid, 0)
        f = self._line._filed.get(mine.key)
        if f is not None and f.eligible and uuid in f.gpus:
            waiting -= 1
        return waiting > 0

    def outranked(self, uuid: str, mine: Gang) -> bool:
        """Whether every eligible gang other than `mine` waiting for GPU `uuid` is of a lower
        priority than `mine`."""
        for (_, _, priority), b in self._line._by_gpu.get(uuid, {}).items():
            if priority >= mine.priority and len(b) > (mine.key in b.gangs):
                return False
        return True

    def firsts(self, uuid: str) -> list[Gang]:
        """Enough of GPU `uuid`'s waiters to know who of them comes first in line: each
        bucket's longest waiting."""
        return [b.first() for b in self._line._by_gpu.get(uuid, {}).values()]

    def rivals(self, uuid: str, holder: Gang) -> list[Gang]:
        """Enough of GPU `uuid`'s waiters to know when `holder` must give way to one of them
        (`PriorityRule.yield_at` depends on a waiter's priority, whether it lent the GPU before
        the holder's grant, when it asked, and whether it is owed its share): each bucket's
        longest waiting, its earliest lender (a higher priority's: any lender will do) and its
        earliest lender taking its GPU back (an equal's)."""
        out: list[Gang] = []
        for b in self._line._by_gpu.get(uuid, {}).values():
            first = b.first()
            out.append(first)
            earliest = b.first_lender(holder.granted_at)
            back = b.first_lender(holder.granted_at, back=True)
            for lender in (earliest, None if back is earliest else back):
                if lender is not None and lender is not first:  # (often one gang: asked once)
                    out.append(lender)
        return out

    def owed(self, gangs: list[Gang]) -> set[str]:
        """The keys of those of `gangs` (waiters, or a lender) still owed part of their
        share: a waiter as filed, anyone else looked at through a copy."""
        out = set()
        for g in gangs:
            f = self._line._filed.get(g.key)
            owed = f.owed if f is not None else self._line.owed_now(g)
            if owed:
                out.add(g.key)
        return out
