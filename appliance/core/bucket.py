"""A bucket of the lock's line (`line.Line`): the waiting gangs of one class (offender, owed
its share, priority) in ticket order, and those of them that lent their GPU by when they lent,
twice: all of them (whether a holder borrowed from a higher priority: any lender will do, the
earliest is read), and those that asked again inside their quantum (`PriorityRule.takes_back`,
as of when they were filed: an equal taking its GPU back, the earliest lender first). A lender
that lent long ago and asked after its quantum is only in the first: it must not hide one that
takes back. And its lone gangs by when they last borrowed a lent quantum
(`borrowed_at`): who borrows the next such time. Every question O(1); filing O(log n)."""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Callable, Iterator
from typing import NamedTuple

from appliance.core.state import Gang

Class = tuple[bool, bool, int]  # a bucket's: offender, owed, priority


class Filing(NamedTuple):
    """What a waiting gang was filed by (what `Line._unfile` must find it by again). (A tuple: one
    is made for every gang that starts waiting, and a frozen dataclass costs a call a field.)"""

    ticket: int
    priority: int
    offender: bool
    gpus: tuple[str, ...]
    lent_at: float | None
    back: bool  # it lent and asked again inside its quantum (`PriorityRule.takes_back`)
    borrowed_at: float | None  # a lone gang's, as `borrowed_at` (a gang of several: None)
    eligible: bool  # its quota lets it start (`QuotaRule.may_start`)
    owed: bool  # part of a member's share is owed to it (`share`)

    @property
    def cls(self) -> Class:
        return (self.offender, self.owed, self.priority)


class Bucket:
    """Waiting gangs of one class, in ticket order; those of them that lent their GPU, by when;
    by when, those of these that take it back; and the lone ones by when they last borrowed."""

    __slots__ = ("back", "borrowers", "gangs", "lent", "order")

    def __init__(self) -> None:
        self.order: list[tuple[int, str]] = []  # (ticket, key), sorted
        self.gangs: dict[str, Gang] = {}
        self.lent: list[tuple[float, int, str]] = []  # (lent_at, ticket, key), sorted
        self.back: list[tuple[float, int, str]] = []  # the same, of those taking back
        self.borrowers: list[tuple[float, int, str]] = []  # (borrowed_at, ticket, key), lone

    def __len__(self) -> int:
        return len(self.order)

    def add(self, g: Gang, f: Filing) -> None:
        insort(self.order, (f.ticket, g.key))
        self.gangs[g.key] = g
        if f.borrowed_at is not None:
            insort(self.borrowers, (f.borrowed_at, f.ticket, g.key))
        if f.lent_at is not None:
            insort(self.lent, (f.lent_at, f.ticket, g.key))
            if f.back:
                insort(self.back, (f.lent_at, f.ticket, g.key))

    def remove(self, key: str, f: Filing) -> None:
        del self.order[bisect_left(self.order, (f.ticket, key))]
        del self.gangs[key]
        if f.borrowed_at is not None:
            del self.borrowers[bisect_left(self.borrowers, (f.borrowed_at, f.ticket, key))]
        if f.lent_at is not None:
            del self.lent[bisect_left(self.lent, (f.lent_at, f.ticket, key))]
            if f.back:
                del self.back[bisect_left(self.back, (f.lent_at, f.ticket, key))]

    def first(self) -> Gang:
        return self.gangs[self.order[0][1]]

    def next_borrower(self) -> Gang | None:
        """The lone gang that borrowed an equal's lent quantum longest ago."""
        return self.gangs[self.borrowers[0][2]] if self.borrowers else None

    def first_lender(self, before: float, back: bool = False) -> Gang | None:
        """The gang that lent its GPU earliest, if that was at or before `before`; `back`: of
        those taking it back."""
        lent = self.back if back else self.lent
        if lent and lent[0][0] <= before:
            return self.gangs[lent[0][2]]
        return None

    def walk(
        self, starved: Callable[[Gang], bool], want: bool, skip: tuple[Gang, ...]
    ) -> Iterator[Gang]:
        """In ticket order, the gangs whose starvation is `want` (a prefix, or the rest), but
        those of `skip` (given out already, wherever they stand: a lender taking back is given
        out ahead of its starved equals, and may have the first ticket). The reader may take
        the one just given out (a grant)."""
        i = 0
        while i < len(self.order):
            entry = self.order[i]
            g = self.gangs[entry[1]]
            skipped = any(g is s for s in skip) if skip else False
            if skipped or starved(g) != want:
                if want and not skipped:
                    return  # past the starved prefix
                i += 1
                continue
            yield g
            if i < len(self.order) and self.order[i] == entry:
                i += 1


def borrowed_at(g: Gang) -> float | None:
    """When a lone gang last borrowed a lent quantum (`Line.borrowing`), for who borrows next
    (`Bucket.next_borrower`); one that never did as if when it began waiting, so that a process
    that comes new does not take the next lend from those that borrowed before it came."""
    return None if g.joint else g.borrowed_at or g.waiting_since


def bucket_of(buckets: dict[Class, Bucket], cls: Class) -> Bucket:
    """The bucket of class `cls`, made when it is the first (a `setdefault` would make one
    for every gang filed)."""
    bucket = buckets.get(cls)
    if bucket is None:
        bucket = buckets[cls] = Bucket()
    return bucket


def remove_from(buckets: dict[Class, Bucket], cls: Class, key: str, f: Filing) -> None:
    bucket = buckets[cls]
    bucket.remove(key, f)
    if not bucket:
        del buckets[cls]
