"""The lock's indexes: who waits, who owns a GPU, who lent one, kept where they change.

Why it exists: an event (a hand-off, a request, a tick) must cost the same with 16 or 2,000
clients connected. The rules (`lock`, `priority`, `share`, `ahead`, `terms`) ask questions of
the waiting and the holding gangs: who is next in line, is anyone else waiting for this GPU, who
of a higher priority lent it, when must its holder give way. Answered by a pass over every gang,
each event cost about 131,000 instructions per waiting client. Here each gang is filed once, when
what it is filed by changes (`refile`), and the questions read the files:

- **owning**: gangs holding or draining a GPU (a handful: one per GPU in mode `on`).
- **the line**: waiting gangs with no quota and no guaranteed share ("plain"), in buckets by
  (offender, priority), each in ticket order, once for the node and once per GPU they wait for.
  Tickets are given out in time order, so a bucket in ticket order is in request order: its
  starved gangs (`priority.starved`) are a prefix, its first gang the longest waiting. The
  order of grants (`priority.line`) is then a merge of a few buckets, read lazily: the lock stops
  reading once every GPU anyone waits for is taken.
- **accounted waiters**: waiting gangs with a quota or a guaranteed share. Whether they may
  start and what they are owed moves with the clock, so they are looked at one by one, on each
  question that concerns their GPU: O(accounted waiters of that GPU).
- **idle lenders**: lone gangs that let their GPU go idle and have not been granted since
  (`priority.borrowed`, `terms.lending`, `ahead`), by GPU and priority.

Costs (n clients, G GPUs, P distinct priorities waiting, A accounted waiters): `refile`
O(G + log n) (a sorted insert moves pointers in C); `turns` O(P + A log A) to start and O(1) a
gang; the questions of `Waiting` O(P + A) for one GPU. Queries never write: accounts are looked
at through copies (`gang.eligible_at`, `gang.owed_at`).

`check` compares every index with a pass over all gangs; the core tests call it after each event.
"""

from __future__ import annotations

import heapq
from bisect import bisect_left, insort
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from appliance.core.gang import account, eligible, eligible_at, owed_at, owed_s
from appliance.core.quota import EPSILON_S
from appliance.core.state import Gang, GangPhase, NodeState

_OWNING = (GangPhase.HOLDING, GangPhase.DRAINING)
# `priority.line`'s order: offender, not owed, not starved, -priority
LineKey = tuple[bool, bool, bool, int]


@dataclass(frozen=True, slots=True)
class _Filing:
    """What a waiting gang was filed by (what `_unfile` must find it by again)."""

    ticket: int
    priority: int
    offender: bool
    gpus: tuple[str, ...]
    lent_at: float | None
    accounted: bool


class Bucket:
    """Plain waiting gangs of one (offender, priority), in ticket order; and those of them that
    lent their GPU, by when."""

    __slots__ = ("gangs", "lent", "order")

    def __init__(self) -> None:
        self.order: list[tuple[int, str]] = []  # (ticket, key), sorted
        self.gangs: dict[str, Gang] = {}
        self.lent: list[tuple[float, int, str]] = []  # (lent_at, ticket, key), sorted

    def __len__(self) -> int:
        return len(self.order)

    def add(self, g: Gang, f: _Filing) -> None:
        insort(self.order, (f.ticket, g.key))
        self.gangs[g.key] = g
        if f.lent_at is not None:
            insort(self.lent, (f.lent_at, f.ticket, g.key))

    def remove(self, key: str, f: _Filing) -> None:
        del self.order[bisect_left(self.order, (f.ticket, key))]
        del self.gangs[key]
        if f.lent_at is not None:
            del self.lent[bisect_left(self.lent, (f.lent_at, f.ticket, key))]

    def first(self) -> Gang:
        return self.gangs[self.order[0][1]]

    def first_lender(self, before: float) -> Gang | None:
        """The gang that lent its GPU earliest, if that was at or before `before`."""
        if self.lent and self.lent[0][0] <= before:
            return self.gangs[self.lent[0][2]]
        return None

    def walk(self, starved: Callable[[Gang], bool], want: bool) -> Iterator[Gang]:
        """In ticket order, the gangs whose starvation is `want` (a prefix, or the rest).
        The reader may take the gang it was just given out of the bucket (a grant)."""
        i = 0
        while i < len(self.order):
            entry = self.order[i]
            g = self.gangs[entry[1]]
            if starved(g) != want:
                if want:
                    return  # past the starved prefix
                i += 1
                continue
            yield g
            if i < len(self.order) and self.order[i] == entry:
                i += 1


class Line:
    """Every gang filed by what the lock asks of it (see the module's docstring)."""

    def __init__(self, state: NodeState) -> None:
        self._s = state
        self.owning: dict[str, Gang] = {}
        self._filed: dict[str, _Filing] = {}
        self._plain: dict[tuple[bool, int], Bucket] = {}
        self._by_gpu: dict[str, dict[tuple[bool, int], Bucket]] = {}
        self._accounted: dict[str, Gang] = {}
        self._accounted_by_gpu: dict[str, dict[str, Gang]] = {}
        self._waited: dict[str, int] = {}  # GPU -> gangs filed as waiting for it
        self._lenders: dict[str, dict[int, dict[str, Gang]]] = {}  # GPU -> priority -> key -> gang
        self._lent_by: dict[str, tuple[str, int]] = {}  # key -> (GPU, priority) it is filed by

    # ------------------------------------------------------------ filing

    def refile(self, g: Gang) -> None:
        """File g again by what it is now: O(G + log n)."""
        self._unfile(g.key)
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

    def forget(self, key: str) -> None:
        """A gang that no longer exists."""
        self._unfile(key)

    def _file_waiting(self, g: Gang) -> None:
        f = _Filing(
            ticket=g.ticket,
            priority=g.priority,
            offender=g.offender,
            gpus=tuple(g.gpus),
            lent_at=g.lent_at,
            accounted=accounted(self._s, g),
        )
        self._filed[g.key] = f
        for uuid in f.gpus:
            self._waited[uuid] = self._waited.get(uuid, 0) + 1
        if f.accounted:
            self._accounted[g.key] = g
            for uuid in f.gpus:
                self._accounted_by_gpu.setdefault(uuid, {})[g.key] = g
            return
        cls = (f.offender, f.priority)
        self._plain.setdefault(cls, Bucket()).add(g, f)
        for uuid in f.gpus:
            self._by_gpu.setdefault(uuid, {}).setdefault(cls, Bucket()).add(g, f)

    def _unfile(self, key: str) -> None:
        self.owning.pop(key, None)
        if (lent := self._lent_by.pop(key, None)) is not None:
            by_priority = self._lenders[lent[0]]
            del by_priority[lent[1]][key]
            if not by_priority[lent[1]]:
                del by_priority[lent[1]]
        f = self._filed.pop(key, None)
        if f is None:
            return
        for uuid in f.gpus:
            self._waited[uuid] -= 1
            if not self._waited[uuid]:
                del self._waited[uuid]
        if f.accounted:
            del self._accounted[key]
            for uuid in f.gpus:
                del self._accounted_by_gpu[uuid][key]
            return
        cls = (f.offender, f.priority)
        _remove(self._plain, cls, key, f)
        for uuid in f.gpus:
            _remove(self._by_gpu[uuid], cls, key, f)

    # ------------------------------------------------------------ the line

    def turns(self, now: float) -> Iterator[Gang]:
        """The eligible waiting gangs in the order they are granted (`priority.line`), read
        lazily. A command: accounts roll (`gang.eligible`)."""
        s = self._s
        patience = now - s.policy.scheduler.starvation_limit_s

        def starved(g: Gang) -> bool:
            return g.requested_at <= patience

        ready = sorted(
            (g for g in self._accounted.values() if eligible(s, g, now)), key=lambda g: g.ticket
        )
        owed = {g.key for g in ready if owed_s(s, g, now) > EPSILON_S}
        parts: dict[LineKey, list[Iterator[Gang]]] = {}
        for (offender, prio), bucket in self._plain.items():
            for want in (True, False):
                key = (offender, True, not want, -prio)
                parts.setdefault(key, []).append(bucket.walk(starved, want))
        accounted_parts: dict[LineKey, list[Gang]] = {}
        for g in ready:
            key = (g.offender, g.key not in owed, not starved(g), -g.priority)
            accounted_parts.setdefault(key, []).append(g)
        for key in sorted(parts.keys() | accounted_parts.keys()):
            iters = [*parts.get(key, []), iter(accounted_parts.get(key, []))]
            yield from heapq.merge(*iters, key=_ticket)

    def has_waiters(self, uuid: str) -> bool:
        return uuid in self._waited

    def all_taken(self, blocked: set[str]) -> bool:
        """Whether every GPU someone waits for is in `blocked`: O(G)."""
        return all(uuid in blocked for uuid in self._waited)

    def accounted_waiting(self) -> list[Gang]:
        return list(self._accounted.values())

    def idle_lenders(self) -> Iterator[tuple[str, Gang]]:
        """(GPU, gang) for every idle lone gang that lent its GPU."""
        for uuid, by_priority in self._lenders.items():
            for gangs in by_priority.values():
                for g in gangs.values():
                    yield uuid, g

    def lenders_above(self, uuid: str, priority: int) -> list[Gang]:
        """Idle lone gangs that lent GPU `uuid`, of a priority above `priority`."""
        by_priority = self._lenders.get(uuid, {})
        return [g for p, gangs in by_priority.items() if p > priority for g in gangs.values()]

    def waiting(self, now: float) -> Waiting:
        return Waiting(self, now)

    # ------------------------------------------------------------ the check

    def check(self) -> None:
        """Every index against a pass over all gangs (tests call it after every event)."""
        s = self._s
        owning = {k for k, g in s.gangs.items() if g.phase in _OWNING}
        assert owning == self.owning.keys(), (owning, self.owning.keys())
        waiting = {k: g for k, g in s.gangs.items() if g.phase is GangPhase.WAITING}
        assert waiting.keys() == self._filed.keys(), (waiting.keys(), self._filed.keys())
        for k, g in waiting.items():
            f = self._filed[k]
            now_filed = (g.ticket, g.priority, g.offender, set(g.gpus), g.lent_at)
            was = (f.ticket, f.priority, f.offender, set(f.gpus), f.lent_at)
            assert now_filed == was, (k, now_filed, was)
            assert f.accounted == accounted(s, g), k
        lenders = {
            k
            for k, g in s.gangs.items()
            if g.phase is GangPhase.IDLE and g.lent_at is not None and not g.joint
        }
        assert lenders == self._lent_by.keys(), (lenders, self._lent_by.keys())
        for k in lenders:
            g = s.gangs[k]
            assert self._lent_by[k] == (s.clients[next(iter(g.members))].gpu, g.priority), k


def accounted(s: NodeState, g: Gang) -> bool:
    """A gang whose place in line moves with the clock: a quota, or a member's share."""
    return account(s, g) is not None or any(s.clients[m].guarantee is not None for m in g.members)


def _ticket(g: Gang) -> int:
    return g.ticket


def _remove(
    buckets: dict[tuple[bool, int], Bucket], cls: tuple[bool, int], key: str, f: _Filing
) -> None:
    bucket = buckets[cls]
    bucket.remove(key, f)
    if not bucket:
        del buckets[cls]


class Waiting:
    """Who waits for a GPU, as the rules ask it; reads the line as it is now, writes nothing."""

    def __init__(self, line: Line, now: float) -> None:
        self._line = line
        self._s = line._s
        self._now = now

    def accounted(self, uuid: str) -> list[Gang]:
        """The accounted waiters of GPU `uuid` that may start now, in ticket order."""
        gangs = self._line._accounted_by_gpu.get(uuid, {}).values()
        return sorted((g for g in gangs if eligible_at(self._s, g, self._now)), key=_ticket)

    def any(self, uuid: str) -> bool:
        """Whether an eligible gang waits for GPU `uuid`."""
        return bool(self._line._by_gpu.get(uuid)) or bool(self.accounted(uuid))

    def others(self, uuid: str, mine: Gang) -> bool:
        """Whether an eligible gang other than `mine` waits for GPU `uuid`."""
        buckets = self._line._by_gpu.get(uuid, {})
        plain = sum(len(b) for b in buckets.values())
        f = self._line._filed.get(mine.key)
        if f is not None and not f.accounted and uuid in f.gpus:
            plain -= 1
        return plain > 0 or any(g is not mine for g in self.accounted(uuid))

    def firsts(self, uuid: str) -> list[Gang]:
        """Enough of GPU `uuid`'s waiters to know who of them comes first in line: each
        bucket's longest waiting, and the accounted ones."""
        buckets = self._line._by_gpu.get(uuid, {})
        return [*(b.first() for b in buckets.values()), *self.accounted(uuid)]

    def rivals(self, uuid: str, holder: Gang) -> list[Gang]:
        """Enough of GPU `uuid`'s waiters to know when `holder` must give way to one of them
        (`priority.yield_at` depends on a waiter's priority, whether it lent the GPU before
        the holder's grant, and when it asked): each bucket's longest waiting and its earliest
        lender, and the accounted ones."""
        out: list[Gang] = []
        for b in self._line._by_gpu.get(uuid, {}).values():
            out.append(b.first())
            if (lender := b.first_lender(holder.granted_at)) is not None:
                out.append(lender)
        return out + self.accounted(uuid)

    def owed(self, gangs: list[Gang]) -> set[str]:
        """The keys of those of `gangs` still owed part of their share."""
        return {g.key for g in gangs if owed_at(self._s, g, self._now) > EPSILON_S}
